//! The diagnosis behind `rein why RUN` and `GET /v1/runs/{id}/why`: where a run is, what it is waiting for and what would move it, in the order
//! of seed 000 §16 (state, last event, lease, pending action, rejected decisions, side
//! effects, approvals and inbox, timers), ending with one verdict derived from all of them.

use rein_core::{ActionStatus, Definition, StateKind};
use rein_store::{WhyEvent, WhyFacts};
use serde_json::{Value, json};

/// Longest rendering of tool arguments in the human output.
const ARGS_SHOWN_CHARS_MAX: usize = 120;

/// What the run waits for and what would move it.
struct Verdict {
    waiting_for: String,
    next_step: String,
}

/// The whole diagnosis of a run as one document: what `rein why --json` prints and
/// `GET /v1/runs/{id}/why` answers.
pub fn diagnosis(facts: &WhyFacts, def: &Definition) -> Value {
    let mut out = to_json(facts, &verdict(facts, def));
    if let Some(map) = out.as_object_mut() {
        map.insert("transitions_out".to_owned(), transitions_out(facts, def));
    }
    out
}

/// The transitions out of the run's state with each guard's value against the run as it is
/// (SPEC I4): which guard blocks a way out. The event that would take one is not known yet,
/// so it is taken without payload; a guard that reads it says so (`reads_event`).
fn transitions_out(facts: &WhyFacts, def: &Definition) -> Value {
    let mut run = facts.run.projection.clone();
    // The row's state and sequence are the truth the diagnosis reports.
    run.state = facts.run.state.clone();
    run.sequence = facts.run.last_sequence.max(0) as u64;
    serde_json::to_value(rein_core::explain::transitions_out(def, &run)).unwrap_or(Value::Null)
}

/// `1.2 s`, `350 ms`, `4m 10s`, `59m`, `3h 5m`, `2d 4h`: how long, rounded for a person.
pub fn duration(ms: f64) -> String {
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
pub fn from_now(ms: f64) -> String {
    if ms >= 0.0 {
        format!("in {}", duration(ms))
    } else {
        format!("{} ago", duration(ms))
    }
}

fn str_of<'v>(payload: &'v Value, key: &str) -> Option<&'v str> {
    payload.get(key).and_then(Value::as_str)
}

pub fn compact(value: &Value) -> String {
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
