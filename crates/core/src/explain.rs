//! How the reducer chooses among the candidate transitions of one (state, event), guard by
//! guard (SPEC I4): what `rein why` shows for the transitions out of a run's state, and what
//! a what-if replay ([`crate::whatif`]) names when a guard decides differently.
//!
//! The guards are evaluated exactly as the reducer's selection does: in priority order, in
//! one [`GuardScope`] (so they share its evaluation budget), each candidate up to its first
//! guard that does not hold; the chosen transition is the first whose guards all hold.

use serde::Serialize;

use crate::definition::{Definition, Transition};
use crate::event::Event;
use crate::guard::{GuardKind, GuardScope};
use crate::state::RunState;

/// What a guard evaluated to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardValue {
    True,
    False,
    /// It could not be evaluated; the reducer treats that as not holding (fails closed).
    Error,
    /// An earlier guard of the same transition did not hold, so the reducer never looks at
    /// this one.
    NotEvaluated,
}

/// One guard of a candidate transition and its value.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GuardResult {
    pub kind: GuardKind,
    /// Its label: the guard's `name`, else its expression or function name.
    pub name: String,
    /// The CEL expression; `None` for a registered Rust function.
    pub expr: Option<String>,
    pub value: GuardValue,
    /// Why it could not be evaluated (with [`GuardValue::Error`]).
    pub error: Option<String>,
    /// Whether it reads the event (`event`, `payload`, `args`): evaluated without the event
    /// that will arrive, its value may change when that event carries a payload.
    pub reads_event: bool,
}

/// One candidate transition of an event, with its guards' values.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateResult {
    pub event: String,
    pub from: String,
    pub to: String,
    pub priority: i32,
    /// Its position among the transitions of the definition (0-based, declaration order).
    pub index: usize,
    pub guards: Vec<GuardResult>,
    /// Every guard holds.
    pub holds: bool,
    /// The reducer fires this one: the first candidate that holds.
    pub chosen: bool,
}

impl CandidateResult {
    /// The first guard that does not hold: the one that blocks this transition.
    pub fn blocking(&self) -> Option<&GuardResult> {
        self.guards
            .iter()
            .find(|g| matches!(g.value, GuardValue::False | GuardValue::Error))
    }
}

/// The candidates of `event` in `run`'s state, highest priority first, each with the values
/// of its guards. Pure: the same guards, input and order as the reducer's selection.
pub fn candidates(def: &Definition, run: &RunState, event: &Event) -> Vec<CandidateResult> {
    let input = crate::reducer::guard_input(def, run, event);
    let mut scope = GuardScope::new(&input);
    let mut chosen = false;
    def.candidates(&run.state, &event.kind)
        .iter()
        .map(|t| {
            let mut result = evaluate(t, &mut scope);
            if result.holds && !chosen {
                chosen = true;
                result.chosen = true;
            }
            result
        })
        .collect()
}

fn evaluate(t: &Transition, scope: &mut GuardScope<'_, '_>) -> CandidateResult {
    let mut holds = true;
    let guards = t
        .guards
        .iter()
        .map(|g| {
            let (value, error) = if !holds {
                (GuardValue::NotEvaluated, None)
            } else {
                match g.eval(scope) {
                    Ok(true) => (GuardValue::True, None),
                    Ok(false) => (GuardValue::False, None),
                    Err(e) => (GuardValue::Error, Some(e)),
                }
            };
            if value != GuardValue::True && value != GuardValue::NotEvaluated {
                holds = false;
            }
            GuardResult {
                kind: g.kind,
                name: g.name.clone(),
                expr: g.expr().map(|e| e.source().to_owned()),
                value,
                error,
                reads_event: g.expr().is_some_and(|e| e.reads_event()),
            }
        })
        .collect();
    CandidateResult {
        event: t.event.clone(),
        from: t.from.clone(),
        to: t.to.clone(),
        priority: t.priority,
        index: t.index,
        guards,
        holds,
        chosen: false,
    }
}

/// Every transition out of (or looping on) `run`'s state, grouped by event in declaration
/// order, with its guards evaluated against the run as it is and an event without payload
/// (`{}`): which guard blocks a way out, and with what value.
pub fn transitions_out(def: &Definition, run: &RunState) -> Vec<CandidateResult> {
    let mut events: Vec<&str> = Vec::new();
    for t in def.transitions() {
        if t.from == run.state && !events.contains(&t.event.as_str()) {
            events.push(&t.event);
        }
    }
    events
        .into_iter()
        .flat_map(|kind| {
            let event = Event::new(run.sequence + 1, kind, serde_json::json!({}));
            candidates(def, run, &event)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Format, GuardRegistry};
    use serde_json::json;

    const DEF: &str = r#"
name = "explain"
version = 1
events = ["GO", "STOP"]
cancel_state = "CANCELLED"

[[states]]
name = "A"
kind = "waiting"
initial = true

[[states]]
name = "BIG"
kind = "terminal"

[[states]]
name = "SMALL"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "A"
event = "GO"
to = "BIG"
priority = 10
guards = [{ expr = "run.data.amount > 100" }, { expr = "run.data.vip == true" }]

[[transitions]]
from = "A"
event = "GO"
to = "SMALL"
priority = 1
guards = [{ expr = "payload.ok == true" }]

[[transitions]]
from = "A"
event = "STOP"
to = "CANCELLED"
"#;

    fn def() -> Definition {
        Definition::parse(DEF, Format::Toml, &GuardRegistry::new()).expect("valid")
    }

    #[test]
    fn the_first_failing_guard_blocks_and_the_rest_are_not_evaluated() {
        let def = def();
        let run = RunState::initial(&def, json!({"amount": 50, "vip": true}));
        let event = Event::new(1, "GO", json!({"ok": true}));
        let out = candidates(&def, &run, &event);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].to, "BIG");
        assert_eq!(out[0].guards[0].value, GuardValue::False);
        assert_eq!(out[0].guards[1].value, GuardValue::NotEvaluated);
        assert_eq!(
            out[0].blocking().map(|g| g.name.as_str()),
            Some("run.data.amount > 100")
        );
        assert!(!out[0].holds && !out[0].chosen);
        assert!(out[1].holds && out[1].chosen, "{out:?}");
        assert!(out[1].guards[0].reads_event);
        assert!(!out[0].guards[0].reads_event);
        let next = crate::apply(&def, &run, &event).expect("applies");
        assert_eq!(next.state, "SMALL", "the reducer chooses the same one");
    }

    #[test]
    fn transitions_out_show_every_way_out_with_errors_for_a_missing_payload() {
        let def = def();
        let run = RunState::initial(&def, json!({"amount": 500, "vip": true}));
        let out = transitions_out(&def, &run);
        let shown: Vec<(&str, &str, bool)> = out
            .iter()
            .map(|c| (c.event.as_str(), c.to.as_str(), c.holds))
            .collect();
        assert_eq!(
            shown,
            [
                ("GO", "BIG", true),
                ("GO", "SMALL", false),
                ("STOP", "CANCELLED", true)
            ]
        );
        assert!(out[0].chosen && !out[1].chosen && out[2].chosen);
        let small = &out[1].guards[0];
        assert_eq!(small.value, GuardValue::Error, "{small:?}");
        assert!(small.error.as_deref().is_some_and(|e| !e.is_empty()));
        assert!(out[2].guards.is_empty());
    }
}
