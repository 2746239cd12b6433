//! Operator commands for approval requests (SPEC H1–H4): list what waits for a person, and
//! grant or deny one. A decision is delivered to the run as its waiting state's granted or
//! denied event; a request that can no longer be decided is refused with the reason.

use std::time::{SystemTime, UNIX_EPOCH};

use rein_store::COMMENT_BYTES_MAX;
use serde_json::Value;
use uuid::Uuid;

use crate::print::print_json;
use crate::print::{cell, text};
use crate::remote::{Backend, Conn};
use rein_process::exit;

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
    conn: Conn,
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
    conn: Conn,
    /// The approval request's id (from `rein approvals list`).
    approval: Uuid,
    /// Who decides; recorded with the decision and sent to the run. Through the API
    /// (REIN_URL) the token's subject is recorded instead.
    #[arg(long = "as", value_name = "NAME", env = "REIN_APPROVER")]
    approver: Option<String>,
    /// Why, kept with the decision.
    #[arg(long, value_name = "TEXT")]
    comment: Option<String>,
    /// Print the decided request with its `delivery` as one JSON object.
    #[arg(long)]
    json: bool,
}

pub async fn approvals(cmd: ApprovalsCommand) -> u8 {
    match cmd {
        ApprovalsCommand::List(args) => list(args).await,
    }
}

async fn list(args: ListArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let rows = match backend.approvals(args.all, args.run, args.limit).await {
        Ok(rows) => rows,
        Err(e) => return crate::print::fail(&e),
    };
    if args.json {
        print_json(&rows);
        return exit::OK;
    }
    let now_ms = now_ms();
    println!(
        "{:<36}  {:<36}  {:<12}  {:<ARGS_CHARS_SHOWN$}  {:<8}  {:<19}  {:<12}  status",
        "approval", "run", "tool", "args", "risk", "requested (UTC)", "expires in"
    );
    let rows = rows.as_array().cloned().unwrap_or_default();
    for a in &rows {
        println!(
            "{:<36}  {:<36}  {:<12}  {:<ARGS_CHARS_SHOWN$}  {:<8}  {:<19}  {:<12}  {}",
            text(a, "approval_id"),
            text(a, "run_id"),
            text(a, "tool"),
            shorten(&cell(a, "args"), ARGS_CHARS_SHOWN),
            text(a, "risk"),
            crate::print::short_time(text(a, "requested_at")),
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
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    // Through the API the token's subject decides; locally someone must say who they are.
    let approver = match (args.approver.as_deref(), backend.is_api()) {
        (Some(name), _) => match check_approver(name) {
            Ok(name) => name.to_owned(),
            Err(why) => {
                eprintln!("error: {why}");
                return exit::INPUT;
            }
        },
        (None, true) => String::new(),
        (None, false) => {
            eprintln!("error: --as NAME (or REIN_APPROVER) must say who decides");
            return exit::INPUT;
        }
    };
    if backend.is_api() && args.approver.is_some() {
        eprintln!(
            "note: through the API the token's subject is recorded as the approver, not --as"
        );
    }
    let comment = match check_comment(args.comment.as_deref()) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("error: {why}");
            return exit::INPUT;
        }
    };
    let decided = match backend
        .decide(args.approval, grant, &approver, comment)
        .await
    {
        Ok(d) => d,
        Err(e) => return crate::print::fail(&e),
    };
    if args.json {
        print_json(&decided);
        return exit::OK;
    }
    let verb = if grant { "granted" } else { "denied" };
    let d = decided.get("delivery").cloned().unwrap_or(Value::Null);
    let event = match text(&d, "event") {
        "" => format!("the {verb} event"),
        e => e.to_owned(),
    };
    let delivery = if text(&d, "outcome") == "applied" {
        format!(
            "the run got {event} (sequence {}) and is now in {}",
            cell(&d, "sequence"),
            text(&d, "state")
        )
    } else {
        format!("{event} queued in the run's inbox; the worker holding its lease applies it")
    };
    println!(
        "{verb} approval {} ({} on run {}) as {}; {delivery}",
        text(&decided, "approval_id"),
        text(&decided, "tool"),
        text(&decided, "run_id"),
        text(&decided, "decided_by")
    );
    exit::OK
}

fn check_approver(name: &str) -> Result<&str, String> {
    rein_ops::service::approver(name).map_err(|why| format!("--as: {why}"))
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

fn status(a: &Value) -> String {
    let open = a.get("open").and_then(Value::as_bool) == Some(true);
    let consumed = a.get("consumed_at").is_some_and(|c| !c.is_null());
    match text(a, "status") {
        "pending" if !open => "expired".into(),
        "granted" if consumed => "granted, used".into(),
        s => s.to_owned(),
    }
}

fn expires_in(a: &Value, now_ms: i64) -> String {
    if text(a, "status") != "pending" {
        return "-".into();
    }
    if a.get("open").and_then(Value::as_bool) != Some(true) {
        return "expired".into();
    }
    match chrono::DateTime::parse_from_rfc3339(text(a, "expires_at")) {
        Ok(at) => human_duration(at.timestamp_millis() - now_ms),
        Err(_) => "?".into(),
    }
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
    use rein_ops::service::APPROVER_BYTES_MAX;

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
