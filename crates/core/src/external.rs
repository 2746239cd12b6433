//! Which events a caller outside the engine may send (SPEC Z3).
//!
//! A definition lists them in `external_events`: the replies, approvals and dependency
//! notices its runs wait for. Everything else — engine events, call results, what a node's
//! action decides, what timers fire — is written only by the engine. CANCEL is always
//! accepted from outside: it is the cancel operation.
//!
//! A definition stored before `external_events` existed has none; it gets the events the
//! engine never writes on its own that some waiting state takes (see [`derived`]), so runs
//! of it keep taking their replies and approvals, and still no call result or engine event.

use std::collections::{BTreeSet, HashMap};

use crate::definition::{Senders, Transition};
use crate::event::EngineEvent;
use crate::spec::{DefinitionSpec, StateKind};

/// Validates `spec.external_events` (reporting each problem through `p`) and resolves who
/// may send what.
pub(crate) fn resolve(
    spec: &DefinitionSpec,
    events: &BTreeSet<String>,
    call_results: &BTreeSet<String>,
    table: &HashMap<(String, String), Vec<Transition>>,
    p: &mut impl FnMut(String, String),
) -> Senders {
    let approval: BTreeSet<String> = spec
        .states
        .iter()
        .filter_map(|s| s.approval.as_ref())
        .flat_map(|a| [a.granted_event(), a.denied_event()])
        .filter(|e| events.contains(*e))
        .map(str::to_owned)
        .collect();
    let Some(listed) = &spec.external_events else {
        return Senders {
            external: derived(spec, events, call_results, table, &approval),
            approval,
        };
    };
    let mut external = BTreeSet::new();
    for (i, event) in listed.iter().enumerate() {
        let item = format!("external_events[{i}] ({event})");
        if event == EngineEvent::Cancel.as_str() {
            p(
                item,
                "CANCEL is always accepted from outside callers; do not list it".into(),
            );
        } else if EngineEvent::is_reserved(event) {
            p(
                item,
                format!("`{event}` is an engine event: only the engine writes it"),
            );
        } else if !events.contains(event) {
            p(item, format!("unknown event `{event}`"));
        } else if call_results.contains(event) {
            p(
                item,
                format!(
                    "`{event}` is a call result: only the worker that dispatched the call writes it \
                     (an operator settles an in-doubt call with `rein resolve`)"
                ),
            );
        } else if !external.insert(event.clone()) {
            p(item, format!("`{event}` is listed twice"));
        }
    }
    Senders { external, approval }
}

/// The external events of a definition that lists none: the events some waiting state
/// takes, less call results and the events the engine commits itself (backoff, timeouts,
/// approval expiry and reminders, joins, budgets, lease expiry, rejected decisions, http
/// failures), plus the approval events.
fn derived(
    spec: &DefinitionSpec,
    events: &BTreeSet<String>,
    call_results: &BTreeSet<String>,
    table: &HashMap<(String, String), Vec<Transition>>,
    approval: &BTreeSet<String>,
) -> BTreeSet<String> {
    let mut engine: BTreeSet<&str> = BTreeSet::new();
    for s in &spec.states {
        engine.extend(s.timeout.iter().map(|t| t.event.as_str()));
        engine.extend(
            s.backoff
                .iter()
                .flat_map(|b| [b.due.as_str(), b.exhausted.as_str()]),
        );
        if let Some(a) = &s.approval {
            engine.insert(&a.expiry_event);
            engine.extend(a.reminder_event.as_deref());
        }
        engine.extend(s.on_lease_expired.as_deref());
        engine.extend(s.on_rejected_decision.as_deref());
        engine.extend(
            s.http
                .iter()
                .flat_map(|h| [h.transient_event.as_str(), h.fatal_event.as_str()]),
        );
        engine.extend(
            s.fan_out
                .iter()
                .flat_map(|f| [f.joined_event.as_str(), f.failed_event.as_str()]),
        );
    }
    engine.extend(spec.budget.iter().map(|b| b.event.as_str()));
    let waiting: BTreeSet<&str> = spec
        .states
        .iter()
        .filter(|s| s.kind == StateKind::Waiting)
        .map(|s| s.name.as_str())
        .collect();
    let mut external: BTreeSet<String> = table
        .keys()
        .filter(|(state, _)| waiting.contains(state.as_str()))
        .map(|(_, event)| event)
        .filter(|e| events.contains(*e))
        .filter(|e| !call_results.contains(*e) && !engine.contains(e.as_str()))
        .cloned()
        .collect();
    external.extend(approval.iter().cloned());
    external
}
