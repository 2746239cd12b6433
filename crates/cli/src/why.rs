//! `rein why RUN`: where a run is, what it is waiting for and what would move it, in the order
//! of seed 000 §16 (state, last event, lease, pending action, rejected decisions, side
//! effects, approvals and inbox, timers), ending with one verdict derived from all of them.

use rein_core::{ActionStatus, Definition, StateKind};
use rein_store::{WhyEvent, WhyFacts};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::exit;
use crate::ops::text;
use crate::remote::{self, Backend, Conn};

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
/// Longest rendering of tool arguments in the human output.
const ARGS_SHOWN_CHARS_MAX: usize = 120;

/// What the run waits for and what would move it.
struct Verdict {
    waiting_for: String,
    next_step: String,
}

pub async fn why(args: WhyArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let diagnosis = match backend.why(args.run).await {
        Ok(d) => d,
        Err(e) if e.code == "not_found" => {
            eprintln!(
                "error: run {} not found (`rein runs list` shows the runs there are)",
                args.run
            );
            return exit::INPUT;
        }
        Err(e) => return remote::fail(&e),
    };
    if args.json {
        remote::print_json(&diagnosis);
    } else {
        print_human(&diagnosis);
    }
    exit::OK
}

/// The whole diagnosis of a run as one document: what `rein why --json` prints and
/// `GET /v1/runs/{id}/why` answers.
pub fn diagnosis(facts: &WhyFacts, def: &Definition) -> Value {
    to_json(facts, &verdict(facts, def))
}

/// `1.2 s`, `350 ms`, `4m 10s`, `59m`, `3h 5m`, `2d 4h`: how long, rounded for a person.
fn duration(ms: f64) -> String {
    let ms = ms.abs();
    if ms < 1_000.0 {
        return format!("{ms:.0} ms");
    }
    if ms < 60_000.0 {
        return format!("{:.1} s", ms / 1_000.0);
    }
    let s = (ms / 1_000.0) as u64;
    match s {
        0..600 => format!("{}m {}s", s / 60, s % 60),
        600..3_600 => format!("{}m", s / 60),
        3_600..172_800 => format!("{}h {}m", s / 3_600, s % 3_600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3_600),
    }
}

/// `in 3.0 s` for a time ahead, `4.0 s ago` for one past.
fn from_now(ms: f64) -> String {
    if ms >= 0.0 {
        format!("in {}", duration(ms))
    } else {
        format!("{} ago", duration(ms))
    }
}

fn str_of<'v>(payload: &'v Value, key: &str) -> Option<&'v str> {
    payload.get(key).and_then(Value::as_str)
}

fn compact(value: &Value) -> String {
    let mut text = value.to_string();
    if text.len() > ARGS_SHOWN_CHARS_MAX {
        let mut cut = ARGS_SHOWN_CHARS_MAX;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

/// The events that leave (or loop on) `state`, in declaration order, without repeats.
fn accepted_events(def: &Definition, state: &str) -> Vec<String> {
    let mut events: Vec<String> = Vec::new();
    for t in def.transitions() {
        if t.from == state && !events.contains(&t.event) {
            events.push(t.event.clone());
        }
    }
    events
}

/// The rejection that put the run in front of an operator: a DECISION_REJECTED committed
/// right before the newest OPERATOR_REQUIRED (the worker writes them together).
fn rejection_behind_operator(facts: &WhyFacts) -> Option<&WhyEvent> {
    let rejection = facts.last_rejection.as_ref()?;
    let operator = facts.last_operator_required.as_ref()?;
    (rejection.sequence + 1 == operator.sequence).then_some(rejection)
}

fn operator_reason(facts: &WhyFacts) -> Option<&str> {
    facts
        .last_operator_required
        .as_ref()
        .and_then(|e| str_of(&e.payload, "reason"))
}

fn scheduler_hint(facts: &WhyFacts) -> &'static str {
    if facts.fleet.schedulers == 0 {
        " (no scheduler sent a heartbeat in the last minute: is `rein scheduler` running?)"
    } else {
        ""
    }
}

fn verdict(facts: &WhyFacts, def: &Definition) -> Verdict {
    let mut v = verdict_without_inbox(facts, def);
    if !facts.inbox.is_empty() && !def.is_terminal(&facts.run.state) {
        let kinds: Vec<&str> = facts.inbox.iter().map(|e| e.kind.as_str()).collect();
        v.next_step.push_str(&format!(
            "; {} event(s) wait in its inbox ({}) until a state accepts them",
            facts.inbox.len(),
            kinds.join(", ")
        ));
    }
    v
}

fn verdict_without_inbox(facts: &WhyFacts, def: &Definition) -> Verdict {
    let run = &facts.run;
    let p = &run.projection;
    let id = run.run_id;
    if def.is_terminal(&run.state) || run.status == "terminal" {
        let reason = run
            .terminal_reason
            .as_deref()
            .or(p.terminal_reason.as_deref())
            .unwrap_or("none recorded");
        return Verdict {
            waiting_for: format!("nothing: terminal ({}), reason: {reason}", run.state),
            next_step: "nothing will move it; the run is finished".into(),
        };
    }
    if let (Some(owner), Some(left_ms)) = (&run.lease_owner, run.lease_left_ms) {
        if left_ms > 0.0 {
            let doing = match (&p.action, p.pending_call()) {
                (Some(a), Some(call)) => format!(
                    "node {} ({} call {call}, step {})",
                    a.node,
                    a.tool.as_deref().unwrap_or("its"),
                    a.step
                ),
                _ => format!("node {}", run.state),
            };
            return Verdict {
                waiting_for: format!(
                    "worker {owner}, which holds the lease (token {}, expires in {}) and is executing {doing}",
                    run.fencing_token,
                    duration(left_ms)
                ),
                next_step: format!(
                    "the worker's next commit; if {owner} stops, its lease runs out in {} and the scheduler recovers the run",
                    duration(left_ms)
                ),
            };
        }
        return Verdict {
            waiting_for: format!(
                "recovery: the lease of worker {owner} (token {}) expired {} ago",
                run.fencing_token,
                duration(left_ms)
            ),
            next_step: format!(
                "the scheduler will recover it at its next tick{}",
                scheduler_hint(facts)
            ),
        };
    }
    if p.needs_operator {
        let reason = operator_reason(facts).unwrap_or("no reason recorded");
        let by_hand = format!(
            "an operator settles it by hand (`rein send {id} EVENT --payload …`, EVENT one of {}) or cancels it (`rein send {id} CANCEL`)",
            accepted_events(def, &run.state).join(", ")
        );
        if let Some(rejection) = rejection_behind_operator(facts) {
            let step = str_of(&rejection.payload, "step").unwrap_or("?");
            let why = str_of(&rejection.payload, "reason").unwrap_or(reason);
            return Verdict {
                waiting_for: format!(
                    "an operator — rejected decision at step `{step}`: {why}; the run waits for an operator"
                ),
                next_step: by_hand,
            };
        }
        if let (Some(a), Some(call)) = (&p.action, p.pending_call()) {
            let what = a.tool.as_deref().unwrap_or(&a.node);
            let status = match a.status {
                ActionStatus::InDoubt => "is in doubt",
                _ => "was dispatched and has no result",
            };
            // The state's first declared call result (its success, by convention).
            let result = accepted_events(def, &run.state)
                .into_iter()
                .find(|e| def.is_call_result(e))
                .unwrap_or_else(|| "RESULT_EVENT".into());
            return Verdict {
                waiting_for: format!(
                    "an operator — the run needs an operator: the {what} call {call} {status} and could not be reconciled automatically ({reason})"
                ),
                next_step: format!(
                    "`rein resolve {id} applied --event {result} --payload '{{\"result\": …}}' --as NAME` if it took effect, or `rein resolve {id} not-applied --as NAME` to dispatch it again with the same idempotency key"
                ),
            };
        }
        return Verdict {
            waiting_for: format!("an operator — the run needs an operator: {reason}"),
            next_step: by_hand,
        };
    }
    let state = def.state(&run.state);
    if state.map(|s| s.kind) != Some(StateKind::Waiting) {
        let q = &run.queue;
        // A fleet-wide limit handed the run back until it allows the action (SPEC K1).
        if let Some(e) = facts
            .last_event
            .as_ref()
            .filter(|e| e.kind == rein_core::EngineEvent::ActionDeferred.as_str())
        {
            let wait_ms = e.payload["wait_ms"].as_f64().unwrap_or(0.0);
            let key = e.payload["key"].as_str().unwrap_or("?");
            let limit = e.payload["limit"].as_str().unwrap_or("limit");
            let left_ms = wait_ms - e.ago_ms;
            if left_ms > 0.0 {
                return Verdict {
                    waiting_for: format!(
                        "the fleet-wide {limit} limit on `{key}`: the action was deferred (ACTION_DEFERRED #{}) and the run is claimable again in {}",
                        e.sequence,
                        duration(left_ms)
                    ),
                    next_step: format!(
                        "a worker on queue {q} claims it then; to let more through, raise the limit (`rein worker --limit '{key}=…'`)"
                    ),
                };
            }
        }
        let workers = if facts.fleet.workers == 0 {
            "no worker sent a heartbeat in the last minute"
        } else {
            "workers are alive"
        };
        return Verdict {
            waiting_for: format!(
                "a worker to claim it: runnable, not leased (is a worker running on queue {q}?)"
            ),
            next_step: format!(
                "a worker on queue {q} claims it (`rein worker --queue {q}`); {workers}"
            ),
        };
    }
    let timer = run.wake_in_ms.map(|ms| {
        if ms >= 0.0 {
            format!("due in {}", duration(ms))
        } else {
            format!("overdue by {}", duration(ms))
        }
    });
    if let Some(a) = facts.approvals.first() {
        return Verdict {
            waiting_for: format!(
                "a person to decide approval {} ({} {})",
                a.approval_id,
                a.tool,
                compact(&a.args)
            ),
            next_step: format!(
                "`rein approve {0} --as NAME` or `rein deny {0} --as NAME`; it expires in {1}",
                a.approval_id,
                duration(a.expires_in_ms)
            ),
        };
    }
    let backoff = state.and_then(|s| s.backoff.as_ref());
    if let (Some(b), Some(timer)) = (backoff, &timer) {
        return Verdict {
            waiting_for: format!("its retry timer ({timer})"),
            next_step: format!(
                "the scheduler fires it: {} while retries are left (attempt {} so far), else {}{}",
                b.due,
                p.attempt,
                b.exhausted,
                scheduler_hint(facts)
            ),
        };
    }
    let events = accepted_events(def, &run.state).join(", ");
    let timer_part = timer
        .map(|t| {
            format!(
                "; or its timer ({t}), which the scheduler fires{}",
                scheduler_hint(facts)
            )
        })
        .unwrap_or_default();
    let waiting_for = match state.and_then(|s| s.approval.as_ref()) {
        Some(_) => "an approval decision, but no request is open (expired, decided or void)".into(),
        None => format!("an outside event in {} (one of {events})", run.state),
    };
    Verdict {
        waiting_for,
        next_step: format!("`rein send {id} EVENT --payload …` with one of {events}{timer_part}"),
    }
}

fn rejection_json(e: &WhyEvent) -> Value {
    json!({
        "sequence": e.sequence,
        "step": str_of(&e.payload, "step"),
        "reason": str_of(&e.payload, "reason"),
        "node": e.node,
        "occurred_at": e.occurred_at,
        "ago_ms": e.ago_ms,
    })
}

fn to_json(facts: &WhyFacts, v: &Verdict) -> Value {
    let run = &facts.run;
    let p = &run.projection;
    let pending_action = p.action.as_ref().map(|a| {
        json!({
            "node": a.node,
            "step": a.step,
            "action_id": a.action_id,
            "tool": a.tool,
            "status": a.status,
            "call_id": a.call_id,
            "idempotency_key": a.idempotency_key,
            "ledger": facts.actions.iter().find(|l| l.action_id == a.action_id),
        })
    });
    let lease = run.lease_owner.as_ref().map(|owner| {
        json!({
            "worker": owner,
            "token": run.fencing_token,
            "until": run.lease_until,
            "live": run.lease_left_ms.is_some_and(|ms| ms > 0.0),
            "left_ms": run.lease_left_ms,
        })
    });
    json!({
        "run_id": run.run_id,
        "definition": run.definition,
        "version": run.version,
        "queue": run.queue,
        "state": run.state,
        "status": run.status,
        "since": {
            "state_entered_at": run.state_entered_at,
            "in_state_ms": run.in_state_ms,
            "updated_at": run.updated_at,
            "updated_ago_ms": run.updated_ago_ms,
        },
        "sequence": run.last_sequence,
        "attempt": p.attempt,
        "terminal_reason": run.terminal_reason,
        "last_event": facts.last_event,
        "lease": lease,
        "fencing_token": run.fencing_token,
        "pending_action": pending_action,
        "last_rejection": facts.last_rejection.as_ref().map(rejection_json),
        "needs_operator": p.needs_operator,
        "operator_reason": operator_reason(facts),
        "operator_required": facts.last_operator_required.as_ref().map(|e| json!({
            "sequence": e.sequence,
            "reason": str_of(&e.payload, "reason"),
        })),
        "last_error": p.last_error,
        "effects": { "actions": facts.actions, "sim": facts.sim_effects },
        "approvals": facts.approvals,
        "inbox": facts.inbox,
        "timer": run.wake_at.map(|at| json!({ "wake_at": at, "due_in_ms": run.wake_in_ms })),
        "fleet": facts.fleet,
        "db_now": facts.db_now,
        "waiting_for": v.waiting_for,
        "next_step": v.next_step,
    })
}

/// Prints `label  value`, and further values under the first one.
fn field(label: &str, values: &[String]) {
    for (i, value) in values.iter().enumerate() {
        let label = if i == 0 { label } else { "" };
        // Senders, reasons and payloads come from callers: they must not drive the terminal.
        let value = crate::ops::printable(value);
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
    println!(
        "waiting for: {} / what would move it: {}",
        text(d, "waiting_for"),
        text(d, "next_step")
    );
}
