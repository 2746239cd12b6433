//! Operator commands for approval requests (SPEC H1–H4): list what waits for a person, and
//! grant or deny one. A decision is delivered to the run as its waiting state's granted or
//! denied event; a request that can no longer be decided is refused with the reason.

use std::time::{SystemTime, UNIX_EPOCH};

use rein_store::{Approval, COMMENT_BYTES_MAX, Store, StoreError};
use uuid::Uuid;

use crate::{DbArgs, exit, ops};

/// The longest approver name the store records.
const APPROVER_BYTES_MAX: usize = 256;

/// How much of a request's arguments the table shows.
const ARGS_CHARS_SHOWN: usize = 40;

#[derive(clap::Subcommand)]
pub enum ApprovalsCommand {
    /// Approval requests, newest first: the open ones (pending, not expired) unless --all.
    List(ListArgs),
}

#[derive(clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Every request: decided, expired and void ones too.
    #[arg(long)]
    all: bool,
    /// Only this run's requests.
    #[arg(long, value_name = "RUN")]
    run: Option<Uuid>,
    /// At most this many (1..=1000).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=1000))]
    limit: i64,
    /// Print a JSON array of the requests.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct DecideArgs {
    #[command(flatten)]
    db: DbArgs,
    /// The approval request's id (from `rein approvals list`).
    approval: Uuid,
    /// Who decides; recorded with the decision and sent to the run.
    #[arg(long = "as", value_name = "NAME", env = "REIN_APPROVER")]
    approver: String,
    /// Why, kept with the decision.
    #[arg(long, value_name = "TEXT")]
    comment: Option<String>,
}

pub async fn approvals(cmd: ApprovalsCommand) -> u8 {
    match cmd {
        ApprovalsCommand::List(args) => list(args).await,
    }
}

async fn list(args: ListArgs) -> u8 {
    let store = match ops::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let rows = match store.approvals(args.all, args.run, args.limit).await {
        Ok(rows) => rows,
        Err(e) => return ops::report(&e),
    };
    if args.json {
        match serde_json::to_string(&rows) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("error: cannot encode the requests as JSON: {e}");
                return exit::DATABASE;
            }
        }
        return exit::OK;
    }
    let now_ms = now_ms();
    println!(
        "{:<36}  {:<36}  {:<12}  {:<ARGS_CHARS_SHOWN$}  {:<8}  {:<19}  {:<12}  status",
        "approval", "run", "tool", "args", "risk", "requested (UTC)", "expires in"
    );
    for a in &rows {
        println!(
            "{:<36}  {:<36}  {:<12}  {:<ARGS_CHARS_SHOWN$}  {:<8}  {:<19}  {:<12}  {}",
            a.approval_id,
            a.run_id,
            a.tool,
            shorten(&a.args.to_string(), ARGS_CHARS_SHOWN),
            a.risk,
            a.requested_at.format("%Y-%m-%d %H:%M:%S"),
            expires_in(a, now_ms),
            status(a)
        );
    }
    if rows.is_empty() {
        println!(
            "(no {}approval requests{})",
            if args.all { "" } else { "open " },
            args.run
                .map(|r| format!(" for run {r}"))
                .unwrap_or_default()
        );
    }
    exit::OK
}

/// Grants (`grant`) or denies the request and reports the event the run was sent.
pub async fn decide(args: DecideArgs, grant: bool) -> u8 {
    let approver = match check_approver(&args.approver) {
        Ok(name) => name,
        Err(why) => {
            eprintln!("error: {why}");
            return exit::INPUT;
        }
    };
    let comment = match check_comment(args.comment.as_deref()) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("error: {why}");
            return exit::INPUT;
        }
    };
    let store = match ops::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    // Where the run's log stood before the decision, to find the event it is sent.
    let before = match store.approval(args.approval).await {
        Ok(a) => match store.run(a.run_id).await {
            Ok(run) => run.last_sequence,
            Err(e) => return refused_or_report(&e),
        },
        Err(e) => return refused_or_report(&e),
    };
    let decided = match store
        .decide_approval(args.approval, grant, approver, comment)
        .await
    {
        Ok(a) => a,
        Err(e) => return refused_or_report(&e),
    };
    let verb = if grant { "granted" } else { "denied" };
    let delivery = delivery(&store, &decided, before, grant).await;
    println!(
        "{verb} approval {} ({} on run {}) as {approver}; {delivery}",
        decided.approval_id, decided.tool, decided.run_id
    );
    exit::OK
}

/// A decision the store refuses (unknown, expired, already decided or void request; a run
/// that waits for no approval) exits REFUSED with the store's own reason.
fn refused_or_report(e: &StoreError) -> u8 {
    match e {
        StoreError::Invalid(why) => {
            eprintln!("error: {why}");
            exit::REFUSED
        }
        other => ops::report(other),
    }
}

/// Says which event the run got: applied now (with its sequence and the run's new state), or
/// waiting in the run's inbox for the worker holding its lease.
async fn delivery(store: &Store, decided: &Approval, before: i64, grant: bool) -> String {
    let events = store
        .history_after(decided.run_id, before)
        .await
        .unwrap_or_default();
    let sent = events.iter().find(|e| {
        e.payload.get("approval_id").and_then(|v| v.as_str())
            == Some(decided.approval_id.to_string().as_str())
    });
    let run = store.run(decided.run_id).await.ok();
    if let Some(e) = sent {
        let now_in = run
            .map(|r| format!(" and is now in {}", r.state))
            .unwrap_or_default();
        return format!("the run got {} (sequence {}){now_in}", e.kind, e.sequence);
    }
    // Not in the log yet: queued for the lease holder. Name the event the waiting state
    // takes for this decision.
    let mut event = None;
    if let Some(run) = run
        && let Ok(def) = store
            .load_definition(&run.definition, Some(run.version))
            .await
        && let Some(policy) = def.state(&run.state).and_then(|s| s.approval.as_ref())
    {
        event = Some(if grant {
            policy.granted_event().to_owned()
        } else {
            policy.denied_event().to_owned()
        });
    }
    format!(
        "{} queued in the run's inbox; the worker holding its lease applies it",
        event.unwrap_or_else(|| format!("the {} event", if grant { "granted" } else { "denied" }))
    )
}

fn check_approver(name: &str) -> Result<&str, String> {
    let name = name.trim();
    if name.is_empty() {
        return Err("--as needs the approver's name; it is empty".into());
    }
    if name.len() > APPROVER_BYTES_MAX {
        return Err(format!(
            "--as is {} bytes; an approver's name is at most {APPROVER_BYTES_MAX}",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err("--as contains control characters; give a plain name".into());
    }
    Ok(name)
}

fn check_comment(comment: Option<&str>) -> Result<Option<&str>, String> {
    match comment {
        Some(c) if c.len() > COMMENT_BYTES_MAX => Err(format!(
            "--comment is {} bytes; a comment is at most {COMMENT_BYTES_MAX}",
            c.len()
        )),
        Some(c) if c.trim().is_empty() => Ok(None),
        other => Ok(other),
    }
}

fn status(a: &Approval) -> String {
    match a.status.as_str() {
        "pending" if !a.open => "expired".into(),
        "granted" if a.consumed_at.is_some() => "granted, used".into(),
        s => s.to_owned(),
    }
}

fn expires_in(a: &Approval, now_ms: i64) -> String {
    if a.status != "pending" {
        return "-".into();
    }
    if !a.open {
        return "expired".into();
    }
    human_duration(a.expires_at.timestamp_millis() - now_ms)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `3d 4h`, `2h 05m`, `12m 30s`, `42s`, `<1s`.
fn human_duration(ms: i64) -> String {
    let s = ms / 1000;
    match s {
        ..1 => "<1s".into(),
        1..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `text` cut to `max` characters, ending in `…` when cut.
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(human_duration(-5), "<1s");
        assert_eq!(human_duration(999), "<1s");
        assert_eq!(human_duration(42_000), "42s");
        assert_eq!(human_duration(750_000), "12m 30s");
        assert_eq!(human_duration(3_600_000 * 2 + 300_000), "2h 05m");
        assert_eq!(human_duration(86_400_000 * 3 + 3_600_000 * 4), "3d 4h");
    }

    #[test]
    fn long_arguments_are_cut_on_a_character_boundary() {
        assert_eq!(shorten("{\"a\":1}", 40), "{\"a\":1}");
        let cut = shorten(&"é".repeat(50), 10);
        assert_eq!(cut.chars().count(), 10);
        assert!(cut.ends_with('…'));
    }

    #[test]
    fn names_and_comments_are_checked() {
        assert_eq!(check_approver("  alice "), Ok("alice"));
        assert!(check_approver("   ").is_err());
        assert!(check_approver(&"a".repeat(APPROVER_BYTES_MAX + 1)).is_err());
        assert!(check_approver("al\nice").is_err());
        assert_eq!(check_comment(Some("")), Ok(None));
        assert!(check_comment(Some(&"x".repeat(COMMENT_BYTES_MAX + 1))).is_err());
        assert_eq!(check_comment(Some("ok")), Ok(Some("ok")));
    }
}
