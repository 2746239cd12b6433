//! `rein why RUN`: the diagnosis of a run ([`rein_ops::why`]) for a person or as JSON.

use serde_json::Value;
use uuid::Uuid;

use rein_ops::Code;
use rein_ops::why::{compact, duration, from_now};
use rein_process::exit;

use crate::print::{printable, text};
use crate::remote::{Backend, Conn};

#[derive(clap::Args)]
pub struct WhyArgs {
    #[command(flatten)]
    conn: Conn,
    run: Uuid,
    /// One JSON object with the same facts.
    #[arg(long)]
    json: bool,
}

/// Width of the labels of the human output.
const LABEL_WIDTH: usize = 12;

pub async fn why(args: WhyArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let diagnosis = match backend.why(args.run).await {
        Ok(d) => d,
        Err(e) if e.code == Code::NotFound => {
            eprintln!(
                "error: run {} not found (`rein runs list` shows the runs there are)",
                args.run
            );
            return exit::INPUT;
        }
        Err(e) => return crate::print::fail(&e),
    };
    if args.json {
        crate::print::print_json(&diagnosis);
    } else {
        print_human(&diagnosis);
    }
    exit::OK
}

/// Prints `label  value`, and further values under the first one.
fn field(label: &str, values: &[String]) {
    for (i, value) in values.iter().enumerate() {
        let label = if i == 0 { label } else { "" };
        // Senders, reasons and payloads come from callers: they must not drive the terminal.
        let value = printable(value);
        println!("{label:<LABEL_WIDTH$}  {value}");
    }
}

/// `key` of `v` as a number of milliseconds (0 when absent).
fn ms(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

/// `key` of `v` as it reads in prose: text without quotes, anything else as JSON.
fn shown(v: &Value, key: &str) -> String {
    match v.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

/// Timestamps as the database reports them (`2026-11-30 04:08:21.085896 UTC`).
fn at(v: &Value, key: &str) -> String {
    chrono::DateTime::parse_from_rfc3339(text(v, key))
        .map(|t| t.with_timezone(&chrono::Utc).to_string())
        .unwrap_or_else(|_| shown(v, key))
}

/// Each item of the list `key`, rendered; `empty` when there is none.
fn lines(d: &Value, key: &str, empty: &str, line: impl Fn(&Value) -> String) -> Vec<String> {
    let items: Vec<String> = d
        .get(key)
        .and_then(Value::as_array)
        .map(|list| list.iter().map(line).collect())
        .unwrap_or_default();
    if items.is_empty() {
        vec![empty.to_owned()]
    } else {
        items
    }
}

/// The human rendering of a diagnosis document (from the database or the API alike).
fn print_human(d: &Value) {
    let null = Value::Null;
    field(
        "run",
        &[format!(
            "{} ({} v{}, queue {})",
            text(d, "run_id"),
            text(d, "definition"),
            shown(d, "version"),
            text(d, "queue")
        )],
    );
    let since = d.get("since").unwrap_or(&null);
    field(
        "state",
        &[format!(
            "{} ({}) since {}, {} ago; attempt {}, sequence {}",
            text(d, "state"),
            text(d, "status"),
            at(since, "state_entered_at"),
            duration(ms(since, "in_state_ms")),
            shown(d, "attempt"),
            shown(d, "sequence")
        )],
    );
    field(
        "last event",
        &[match d.get("last_event").filter(|e| !e.is_null()) {
            Some(e) => format!(
                "#{} {} at {} ({} ago) by {}, token {}",
                shown(e, "sequence"),
                text(e, "type"),
                at(e, "occurred_at"),
                duration(ms(e, "ago_ms")),
                text(e, "worker"),
                shown(e, "token")
            ),
            None => "none: nothing has happened to the run yet".into(),
        }],
    );
    let token = shown(d, "fencing_token");
    field(
        "lease",
        &[match d.get("lease").filter(|l| !l.is_null()) {
            Some(l)
                if l.get("left_ms")
                    .and_then(Value::as_f64)
                    .is_some_and(|m| m > 0.0) =>
            {
                format!(
                    "held by {}, token {token}, expires in {}",
                    text(l, "worker"),
                    duration(ms(l, "left_ms"))
                )
            }
            Some(l) if l.get("left_ms").is_some_and(|m| !m.is_null()) => format!(
                "held by {}, token {token}, EXPIRED {} ago",
                text(l, "worker"),
                duration(ms(l, "left_ms"))
            ),
            _ => format!("none (token {token})"),
        }],
    );
    field(
        "pending",
        &[match d.get("pending_action").filter(|a| !a.is_null()) {
            Some(a) => {
                let ledger = match a.get("ledger").filter(|l| !l.is_null()) {
                    Some(l) => format!(
                        "ledger {} since {}",
                        text(l, "status"),
                        at(l, "dispatched_at")
                    ),
                    None => "no ledger row".to_owned(),
                };
                let tool = match text(a, "tool") {
                    "" => String::new(),
                    t => format!(", tool {t}"),
                };
                let call = match text(a, "call_id") {
                    "" => "(none open)",
                    c => c,
                };
                format!(
                    "step {} ({}) at node {}{tool}: {}, call {call}, key {}; {ledger}",
                    shown(a, "step"),
                    text(a, "action_id"),
                    text(a, "node"),
                    text(a, "status"),
                    text(a, "idempotency_key")
                )
            }
            None => "no action in flight".into(),
        }],
    );
    if let Some(e) = d.get("last_rejection").filter(|e| !e.is_null()) {
        let step = match text(e, "step") {
            "" => "?",
            s => s,
        };
        let reason = match text(e, "reason") {
            "" => "no reason recorded",
            r => r,
        };
        field(
            "rejected",
            &[format!(
                "#{} at step `{step}`: {reason} ({} ago)",
                shown(e, "sequence"),
                duration(ms(e, "ago_ms"))
            )],
        );
    }
    if let Some(e) = d.get("operator_required").filter(|e| !e.is_null()) {
        let reason = match text(e, "reason") {
            "" => "no reason recorded",
            r => r,
        };
        let settled = if d.get("needs_operator").and_then(Value::as_bool) == Some(true) {
            ""
        } else {
            " (since settled)"
        };
        field(
            "operator",
            &[format!("#{} {reason}{settled}", shown(e, "sequence"))],
        );
    }
    let effects = d.get("effects").unwrap_or(&null);
    let mut shown_effects: Vec<String> = effects
        .get("actions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|a| {
            let tool = match text(a, "tool") {
                "" => String::new(),
                t => format!(" ({t})"),
            };
            format!(
                "{} step {}{tool}: {}",
                text(a, "action_id"),
                shown(a, "step"),
                text(a, "status")
            )
        })
        .collect();
    shown_effects.extend(
        effects
            .get("sim")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|e| {
                format!(
                    "sim effect applied: step {} key {} by {} at {}",
                    shown(e, "step"),
                    text(e, "idempotency_key"),
                    text(e, "worker"),
                    at(e, "applied_at")
                )
            }),
    );
    if shown_effects.is_empty() {
        shown_effects.push("none recorded".into());
    }
    field("effects", &shown_effects);
    field(
        "approvals",
        &lines(d, "approvals", "none open", |a| {
            format!(
                "{} {} {} (expires in {})",
                text(a, "approval_id"),
                text(a, "tool"),
                compact(a.get("args").unwrap_or(&null)),
                duration(ms(a, "expires_in_ms"))
            )
        }),
    );
    field(
        "inbox",
        &lines(d, "inbox", "empty", |e| {
            format!(
                "#{} {} from {} (expires {})",
                shown(e, "id"),
                text(e, "type"),
                text(e, "sender"),
                from_now(ms(e, "expires_in_ms"))
            )
        }),
    );
    field(
        "timer",
        &[match d.get("timer").filter(|t| !t.is_null()) {
            Some(t) if ms(t, "due_in_ms") >= 0.0 => {
                format!(
                    "due in {} (at {})",
                    duration(ms(t, "due_in_ms")),
                    at(t, "wake_at")
                )
            }
            Some(t) => format!(
                "overdue by {} (at {})",
                duration(ms(t, "due_in_ms")),
                at(t, "wake_at")
            ),
            None => "none".into(),
        }],
    );
    field("guards", &guard_lines(d));
    println!(
        "waiting for: {} / what would move it: {}",
        text(d, "waiting_for"),
        text(d, "next_step")
    );
}

/// Each transition out of the run's state with what its guards say now (SPEC I4).
fn guard_lines(d: &Value) -> Vec<String> {
    lines(
        d,
        "transitions_out",
        "no transition out of this state",
        |t| {
            let guards: Vec<String> = t
                .get("guards")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|g| {
                    let value = match text(g, "value") {
                        "error" => format!("error: {}", text(g, "error")),
                        "not_evaluated" => "not evaluated".to_owned(),
                        v => v.to_owned(),
                    };
                    let event = if g.get("reads_event").and_then(Value::as_bool) == Some(true) {
                        " (reads the event, taken without payload)"
                    } else {
                        ""
                    };
                    format!("{} `{}` = {value}{event}", text(g, "kind"), text(g, "name"))
                })
                .collect();
            let verdict = if t.get("chosen").and_then(Value::as_bool) == Some(true) {
                "fires"
            } else if t.get("holds").and_then(Value::as_bool) == Some(true) {
                "open (a higher-priority one fires)"
            } else {
                "blocked"
            };
            let guards = if guards.is_empty() {
                "no guard".to_owned()
            } else {
                guards.join(", ")
            };
            format!(
                "{} -> {}: {verdict}; {guards}",
                text(t, "event"),
                text(t, "to")
            )
        },
    )
}
