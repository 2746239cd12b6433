//! What-if replay: a recorded run's log replayed, side-effect free, on the definition version
//! it ran on and on another one, event by event, up to the first event where the other
//! decides differently. Recorded tool and model results are in the log, so they are reused
//! as they are; nothing is called again.
//!
//! At each event both replays start from the same control state (they have not diverged
//! yet), and the other definition may: refuse the event ([`Kind::Rejected`], with the
//! reducer's reason), refuse the tool decision it records ([`Kind::DecisionRefused`]) or not
//! ask for the approval it records ([`Kind::Approval`]), take another transition because a
//! guard now evaluates differently ([`Kind::Guard`]) or because its table says so
//! ([`Kind::TargetState`]), give the state another status ([`Kind::Status`]), leave the run
//! otherwise different ([`Kind::Projection`]), or have the engine commit another event after
//! it ([`Kind::FollowUp`]: a budget, a join, the step limit). The first of these ends the
//! comparison: after it the two runs are in different places and later events say nothing.

use serde::Serialize;

use crate::decision::{self, Valid};
use crate::definition::Definition;
use crate::event::{EngineEvent, Event};
use crate::explain::{self, CandidateResult, GuardValue};
use crate::reducer::{InvalidTransition, apply, follow_up};
use crate::replay_cost::Cancel;
use crate::state::{RunState, RunStatus};

/// The verdict on one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every event is decided the same way and the run ends in the same place.
    Same,
    /// The other definition takes the run elsewhere at some event.
    Diverged,
    /// The other definition refuses a recorded event or decision.
    Refused,
    /// The log does not replay on the run's own definition version (`rein runs verify`).
    Unreplayable,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Same => "same",
            Verdict::Diverged => "diverged",
            Verdict::Refused => "refused",
            Verdict::Unreplayable => "unreplayable",
        }
    }
}

/// How the other definition decides differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// It starts runs in another state.
    InitialState,
    /// It has no state the run is in.
    MissingState,
    /// It refuses the event (the reducer's reason is given).
    Rejected,
    /// It refuses the tool call the event records.
    DecisionRefused,
    /// The recorded run asked for an approval of a tool call the other would make without
    /// one.
    Approval,
    /// A guard evaluates differently, so another transition fires.
    Guard,
    /// Its table sends the event to another state.
    TargetState,
    /// The target state has another kind, so the run's status differs.
    Status,
    /// Same state and status, but the run's projection differs (effects, usage, ...).
    Projection,
    /// The engine would commit a different event after this one.
    FollowUp,
    /// The run's own definition refuses the event: the log does not replay.
    RecordedRejected,
}

impl Kind {
    fn verdict(self) -> Verdict {
        match self {
            Kind::MissingState | Kind::Rejected | Kind::DecisionRefused => Verdict::Refused,
            Kind::RecordedRejected => Verdict::Unreplayable,
            _ => Verdict::Diverged,
        }
    }
}

/// A transition, by its place in its definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransitionRef {
    pub from: String,
    pub event: String,
    pub to: String,
    pub index: usize,
}

/// Where one definition takes the run with one event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    pub state: String,
    pub status: RunStatus,
    /// The transition the reducer fired (absent for the engine's own events).
    pub transition: Option<TransitionRef>,
    pub terminal_reason: Option<String>,
}

/// Where a replay ends.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct End {
    pub state: String,
    pub status: RunStatus,
    pub terminal_reason: Option<String>,
    pub sequence: u64,
}

/// The first event the other definition decides differently.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    /// The event's sequence (0: before the first event).
    pub sequence: u64,
    /// The event's type (empty before the first event).
    pub event: String,
    /// The control state both replays were in before it.
    pub state_before: String,
    pub kind: Kind,
    /// What the recorded run did (absent when its own definition refuses the event).
    pub recorded: Option<Step>,
    /// What the other definition would do (absent when it refuses the event).
    pub would: Option<Step>,
    /// Why, in words.
    pub why: String,
    /// The reducer's refusal, for [`Kind::Rejected`] and [`Kind::RecordedRejected`].
    pub rejection: Option<InvalidTransition>,
    /// The other definition's candidate transitions for the event, with their guards'
    /// values (empty for the engine's own events).
    pub candidates: Vec<CandidateResult>,
}

/// The comparison of one recorded log on two definitions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WhatIf {
    pub verdict: Verdict,
    /// Events in the log.
    pub events: u64,
    /// Events replayed on both before the comparison ended (all of them when the same).
    pub compared: u64,
    pub divergence: Option<Divergence>,
    /// Where the run's own definition takes the whole log (up to the event it refuses, when
    /// the log does not replay).
    pub recorded: End,
    /// Where the other definition takes it: the whole log when the same, else the state
    /// before the divergence.
    pub replayed: End,
}

fn end(def: &Definition, run: &RunState) -> End {
    End {
        state: run.state.clone(),
        status: run.status(def),
        terminal_reason: run.terminal_reason.clone(),
        sequence: run.sequence,
    }
}

fn chosen(candidates: &[CandidateResult]) -> Option<TransitionRef> {
    candidates.iter().find(|c| c.chosen).map(|c| TransitionRef {
        from: c.from.clone(),
        event: c.event.clone(),
        to: c.to.clone(),
        index: c.index,
    })
}

fn step(def: &Definition, run: &RunState, candidates: &[CandidateResult]) -> Step {
    Step {
        state: run.state.clone(),
        status: run.status(def),
        transition: chosen(candidates),
        terminal_reason: run.terminal_reason.clone(),
    }
}

fn version_of(def: &Definition) -> String {
    format!("{} v{}", def.name(), def.version())
}

/// The fields of two projections that differ, the definition's name and version aside.
fn differing_fields(a: &RunState, b: &RunState) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) =
        (serde_json::to_value(a), serde_json::to_value(b))
    else {
        return vec!["projection".to_owned()];
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| !matches!(k.as_str(), "definition" | "version"))
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect()
}

/// A guard value in words.
fn guard_words(c: &CandidateResult) -> String {
    match c.blocking() {
        Some(g) => match g.value {
            GuardValue::Error => format!(
                "guard `{}` could not be evaluated ({})",
                g.name,
                g.error.as_deref().unwrap_or("no message")
            ),
            _ => format!("guard `{}` is false", g.name),
        },
        None if c.guards.is_empty() => "it has no guard".to_owned(),
        None => "its guards hold".to_owned(),
    }
}

/// Whether the tool decision `event` records, which `old` allowed in `recorded`, would be
/// refused by `new` in `replayed` (or made without the approval it records), with why. A
/// decision `old` itself would not allow now is not judged: only a change of definition is.
fn decision_divergence(
    (old, recorded): (&Definition, &RunState),
    (new, replayed): (&Definition, &RunState),
    event: &Event,
) -> Option<(Kind, String)> {
    let engine = EngineEvent::parse(&event.kind)?;
    let tool = event.payload.get("tool").and_then(|t| t.as_str())?;
    match engine {
        EngineEvent::ActionDispatched
            if old.tool(&recorded.state, tool).is_some()
                && new.tool(&replayed.state, tool).is_none() =>
        {
            Some((
                Kind::DecisionRefused,
                format!(
                    "the recorded run called tool `{tool}`; state {} of {} offers no such tool",
                    replayed.state,
                    version_of(new)
                ),
            ))
        }
        EngineEvent::ApprovalRequested => {
            let call = serde_json::json!({
                "decision": decision::CALL_TOOL,
                "tool": tool,
                "args": event.payload.get("args").cloned().unwrap_or(serde_json::json!({})),
            });
            let Ok(Valid::Call(before)) = decision::validate(old, recorded, &call) else {
                return None;
            };
            match decision::validate(new, replayed, &call) {
                Err(rejection) => Some((
                    Kind::DecisionRefused,
                    format!(
                        "{} refuses the recorded call of `{tool}` at its {} step: {}",
                        version_of(new),
                        rejection.step.as_str(),
                        rejection.reason
                    ),
                )),
                Ok(Valid::Call(c)) if before.needs_approval && !c.needs_approval => Some((
                    Kind::Approval,
                    format!(
                        "the recorded run asked a person to approve its call of `{tool}`; {}'s \
                         approval rule does not ask, so it would call the tool at once",
                        version_of(new)
                    ),
                )),
                Ok(_) => None,
            }
        }
        _ => None,
    }
}

/// Replays `events` (a run's whole log, in sequence order, from `input`) on `old` (the
/// definition version it ran on) and on `new`, and reports the first event `new` decides
/// differently, or that it decides every one the same. Pure; never panics on a definition
/// that lacks states or events the log names.
pub fn compare(
    old: &Definition,
    new: &Definition,
    input: serde_json::Value,
    events: &[Event],
) -> WhatIf {
    compare_until(old, new, input, events, &Cancel::new())
}

fn compare_until(
    old: &Definition,
    new: &Definition,
    input: serde_json::Value,
    events: &[Event],
    cancel: &Cancel,
) -> WhatIf {
    let recorded = RunState::initial(old, input.clone());
    let replayed = RunState::initial(new, input);
    compare_between(old, new, recorded, replayed, events, true, cancel)
}

/// [`compare`] for the part of a log after `at`, the recorded state of the run when it came
/// to `old` (right after its last DEFINITION_MIGRATED): what came before stays judged by
/// the versions it ran on, and `new` takes over from `at` as `old` did.
pub fn compare_after(old: &Definition, new: &Definition, at: RunState, events: &[Event]) -> WhatIf {
    compare_after_until(old, new, at, events, &Cancel::new())
}

fn compare_after_until(
    old: &Definition,
    new: &Definition,
    at: RunState,
    events: &[Event],
    cancel: &Cancel,
) -> WhatIf {
    let mut replayed = at.clone();
    replayed.version = new.version();
    compare_between(old, new, at, replayed, events, false, cancel)
}

/// [`compare`] for a run whose log may hold DEFINITION_MIGRATED events, `current` being the
/// version it is on now and `def_of` every version its log names: the events up to its
/// last migration are replayed on the versions they ran on, and `new` is compared with
/// `current` from there. Also the sequence the comparison starts after (0 from the start).
pub fn compare_across<'d>(
    def_of: &dyn Fn(u32) -> Option<&'d Definition>,
    current: &Definition,
    new: &Definition,
    input: serde_json::Value,
    events: &[Event],
) -> (WhatIf, u64) {
    compare_across_watched(def_of, current, new, input, events, &Cancel::new())
}

/// [`compare_across`], stopping early once `cancel` is set (looked at every
/// [`crate::replay_cost::CANCEL_CHECK_EVERY`] events of each replay): `None` then.
pub fn compare_across_until<'d>(
    def_of: &dyn Fn(u32) -> Option<&'d Definition>,
    current: &Definition,
    new: &Definition,
    input: serde_json::Value,
    events: &[Event],
    cancel: &Cancel,
) -> Option<(WhatIf, u64)> {
    let judged = compare_across_watched(def_of, current, new, input, events, cancel);
    (!cancel.is_cancelled()).then_some(judged)
}

fn compare_across_watched<'d>(
    def_of: &dyn Fn(u32) -> Option<&'d Definition>,
    current: &Definition,
    new: &Definition,
    input: serde_json::Value,
    events: &[Event],
    cancel: &Cancel,
) -> (WhatIf, u64) {
    let migrated = EngineEvent::DefinitionMigrated.as_str();
    let Some(last) = events.iter().rposition(|e| e.kind == migrated) else {
        return (compare_until(current, new, input, events, cancel), 0);
    };
    let first = crate::migration::first_version(current.version(), events.iter());
    let at_end = |state: &RunState| end(current, state);
    let Some(first_def) = def_of(first) else {
        let why = format!("version {first}, which the run started on, is not known");
        return (
            unreplayable(
                events,
                0,
                &at_end(&RunState::initial(current, input)),
                why,
                None,
            ),
            0,
        );
    };
    let start = RunState::initial(first_def, input);
    let logged = cancel.until_cancelled(events[..=last].iter());
    match crate::checkpoint::replay_judging_across(def_of, start.clone(), logged, &[]) {
        Ok((at, _)) => {
            let from = at.sequence;
            let mut w = compare_after_until(current, new, at, &events[last + 1..], cancel);
            w.events = events.len() as u64;
            w.compared += last as u64 + 1;
            (w, from)
        }
        Err((i, rejection)) => {
            let why = format!(
                "the log does not replay on the versions it ran on: {}",
                rejection.reason
            );
            (
                unreplayable(events, i, &at_end(&start), why, Some(rejection)),
                0,
            )
        }
    }
}

fn unreplayable(
    events: &[Event],
    at: usize,
    stopped: &End,
    why: String,
    rejection: Option<InvalidTransition>,
) -> WhatIf {
    let event = events.get(at);
    WhatIf {
        verdict: Verdict::Unreplayable,
        events: events.len() as u64,
        compared: at as u64,
        divergence: Some(Divergence {
            sequence: event.map_or(0, |e| e.sequence),
            event: event.map(|e| e.kind.clone()).unwrap_or_default(),
            state_before: stopped.state.clone(),
            kind: Kind::RecordedRejected,
            recorded: None,
            would: None,
            why,
            rejection,
            candidates: Vec::new(),
        }),
        recorded: stopped.clone(),
        replayed: stopped.clone(),
    }
}

fn compare_between(
    old: &Definition,
    new: &Definition,
    mut recorded: RunState,
    mut replayed: RunState,
    events: &[Event],
    from_start: bool,
    cancel: &Cancel,
) -> WhatIf {
    let total = events.len() as u64;
    // The recorded run goes on past the divergence, to the end of its log.
    let diverge = |recorded: &RunState, replayed: &RunState, compared: u64, d: Divergence| {
        let mut last = recorded.clone();
        if d.kind != Kind::RecordedRejected {
            for event in cancel.until_cancelled(events.iter().skip(compared as usize)) {
                match apply(old, &last, event) {
                    Ok(next) => last = next,
                    Err(_) => break,
                }
            }
        }
        WhatIf {
            verdict: d.kind.verdict(),
            events: total,
            compared,
            recorded: end(old, &last),
            replayed: end(new, replayed),
            divergence: Some(d),
        }
    };
    if from_start && old.initial_state() != new.initial_state() {
        let d = Divergence {
            sequence: 0,
            event: String::new(),
            state_before: String::new(),
            kind: Kind::InitialState,
            recorded: Some(step(old, &recorded, &[])),
            would: Some(step(new, &replayed, &[])),
            why: format!(
                "{} starts runs in {}, the run started in {}",
                version_of(new),
                new.initial_state(),
                old.initial_state()
            ),
            rejection: None,
            candidates: Vec::new(),
        };
        return diverge(&recorded, &replayed, 0, d);
    }
    for (i, event) in cancel.until_cancelled(events.iter()).enumerate() {
        let compared = i as u64 + 1;
        let before = replayed.state.clone();
        let engine = EngineEvent::parse(&event.kind).is_some();
        let old_candidates = if engine {
            Vec::new()
        } else {
            explain::candidates(old, &recorded, event)
        };
        let next_recorded = match apply(old, &recorded, event) {
            Ok(next) => next,
            Err(rejection) => {
                let d = Divergence {
                    sequence: event.sequence,
                    event: event.kind.clone(),
                    state_before: before,
                    kind: Kind::RecordedRejected,
                    recorded: None,
                    would: None,
                    why: format!(
                        "the log does not replay on the run's own definition {}: {}",
                        version_of(old),
                        rejection.reason
                    ),
                    rejection: Some(rejection),
                    candidates: old_candidates,
                };
                return diverge(&recorded, &replayed, compared, d);
            }
        };
        let recorded_step = step(old, &next_recorded, &old_candidates);
        let divergence = |kind, would, why, rejection, candidates| Divergence {
            sequence: event.sequence,
            event: event.kind.clone(),
            state_before: before.clone(),
            kind,
            recorded: Some(recorded_step.clone()),
            would,
            why,
            rejection,
            candidates,
        };
        if new.state(&replayed.state).is_none() {
            let why = format!(
                "{} has no state {}, which the run is in",
                version_of(new),
                replayed.state
            );
            let d = divergence(Kind::MissingState, None, why, None, Vec::new());
            return diverge(&next_recorded, &replayed, compared, d);
        }
        if let Some((kind, why)) = decision_divergence((old, &recorded), (new, &replayed), event) {
            let d = divergence(kind, None, why, None, Vec::new());
            return diverge(&next_recorded, &replayed, compared, d);
        }
        let new_candidates = if engine {
            Vec::new()
        } else {
            explain::candidates(new, &replayed, event)
        };
        let next_replayed = match apply(new, &replayed, event) {
            Ok(next) => next,
            Err(rejection) => {
                let mut why = format!("{} refuses it: {}", version_of(new), rejection.reason);
                if let Some(c) = new_candidates.iter().find(|c| c.to == recorded_step.state) {
                    why.push_str(&format!(
                        " ({} + {} -> {}: {})",
                        c.from,
                        c.event,
                        c.to,
                        guard_words(c)
                    ));
                }
                let d = divergence(Kind::Rejected, None, why, Some(rejection), new_candidates);
                return diverge(&next_recorded, &replayed, compared, d);
            }
        };
        let would = step(new, &next_replayed, &new_candidates);
        let judged = if next_replayed.state != next_recorded.state {
            let same_way = new_candidates
                .iter()
                .find(|c| c.to == next_recorded.state && !c.holds);
            Some(match same_way {
                Some(c) => (
                    Kind::Guard,
                    format!(
                        "in {}, {} + {} -> {} does not fire: {}; {} + {} -> {} fires instead",
                        version_of(new),
                        c.from,
                        c.event,
                        c.to,
                        guard_words(c),
                        before,
                        event.kind,
                        next_replayed.state
                    ),
                ),
                None => (
                    Kind::TargetState,
                    format!(
                        "{} takes {} + {} to {}, the recorded run went to {}",
                        version_of(new),
                        before,
                        event.kind,
                        next_replayed.state,
                        next_recorded.state
                    ),
                ),
            })
        } else if next_replayed.status(new) != next_recorded.status(old) {
            Some((
                Kind::Status,
                format!(
                    "state {} makes the run {} in {}, it was {}",
                    next_replayed.state,
                    next_replayed.status(new).as_str(),
                    version_of(new),
                    next_recorded.status(old).as_str()
                ),
            ))
        } else {
            let fields = differing_fields(&next_recorded, &next_replayed);
            let (old_follow, new_follow) = (
                follow_up(old, &next_recorded).map(|(kind, _)| kind),
                follow_up(new, &next_replayed).map(|(kind, _)| kind),
            );
            if !fields.is_empty() {
                Some((
                    Kind::Projection,
                    format!(
                        "same state, but the run's {} would differ after it in {}",
                        fields.join(", "),
                        version_of(new)
                    ),
                ))
            } else if old_follow != new_follow {
                let said = |f: &Option<String>| f.clone().unwrap_or_else(|| "nothing".to_owned());
                Some((
                    Kind::FollowUp,
                    format!(
                        "the engine would commit {} after it in {}, the recorded run {}",
                        said(&new_follow),
                        version_of(new),
                        said(&old_follow)
                    ),
                ))
            } else {
                None
            }
        };
        if let Some((kind, why)) = judged {
            let d = divergence(kind, Some(would), why, None, new_candidates);
            return diverge(&next_recorded, &replayed, compared, d);
        }
        recorded = next_recorded;
        replayed = next_replayed;
    }
    WhatIf {
        verdict: Verdict::Same,
        events: total,
        compared: total,
        divergence: None,
        recorded: end(old, &recorded),
        replayed: end(new, &replayed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Format, GuardRegistry};
    use serde_json::json;

    /// An order is checked, then approved automatically up to `limit` or sent to review.
    /// SHIPPED takes an approved order to `shipped_to`; without `review`, REVIEWED is not an
    /// event and a reviewed order can only be shipped.
    fn order(version: u32, limit: u32, shipped_to: &str, review: bool) -> Definition {
        let (reviewed, review_exit) = if review {
            (r#", "REVIEWED""#, "event = \"REVIEWED\"\nto = \"APPROVED\"")
        } else {
            ("", "event = \"SHIPPED\"\nto = \"SHIPPED_OK\"")
        };
        let text = format!(
            r#"
name = "order"
version = {version}
events = ["CHECKED", "SHIPPED"{reviewed}]
cancel_state = "CANCELLED"

[[states]]
name = "CHECKING"
kind = "waiting"
initial = true

[[states]]
name = "REVIEW"
kind = "waiting"

[[states]]
name = "APPROVED"
kind = "waiting"

[[states]]
name = "SHIPPED_OK"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "CHECKING"
event = "CHECKED"
to = "APPROVED"
priority = 10
guard = "run.data.amount <= {limit}"

[[transitions]]
from = "CHECKING"
event = "CHECKED"
to = "REVIEW"
priority = 1

[[transitions]]
from = "REVIEW"
{review_exit}

[[transitions]]
from = "APPROVED"
event = "SHIPPED"
to = "{shipped_to}"
"#
        );
        Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("valid")
    }

    fn log(kinds: &[&str]) -> Vec<Event> {
        kinds
            .iter()
            .enumerate()
            .map(|(i, k)| Event::new(i as u64 + 1, *k, json!({})))
            .collect()
    }

    #[test]
    fn a_cancelled_comparison_stops_at_its_next_look_at_the_flag() {
        let looping = |version: u32| {
            let text = format!(
                "name = \"loop\"\nversion = {version}\nevents = [\"PING\"]\n\
                 cancel_state = \"DONE\"\n[[states]]\nname = \"DONE\"\nkind = \"terminal\"\n\
                 [[states]]\nname = \"A\"\nkind = \"waiting\"\ninitial = true\n\
                 [[transitions]]\nfrom = \"A\"\nevent = \"PING\"\nto = \"A\"\n"
            );
            Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("valid")
        };
        let (v1, v2) = (looping(1), looping(2));
        let events = log(&["PING"; 1_000]);
        let watched = Cancel::new();
        let (out, _) = compare_across_until(&|_| None, &v1, &v2, json!({}), &events, &watched)
            .expect("not cancelled");
        assert_eq!((out.verdict, out.compared), (Verdict::Same, 1_000));
        assert_eq!(watched.events(), 1_000);
        let cancelled = Cancel::new();
        cancelled.cancel();
        let out = compare_across_until(&|_| None, &v1, &v2, json!({}), &events, &cancelled);
        assert!(out.is_none());
        assert!(
            cancelled.events() <= crate::replay_cost::CANCEL_CHECK_EVERY,
            "{} events replayed after the flag was set",
            cancelled.events()
        );
    }

    #[test]
    fn the_same_definition_decides_every_event_the_same() {
        let v1 = order(1, 100, "SHIPPED_OK", true);
        let v2 = order(2, 100, "SHIPPED_OK", true);
        let out = compare(
            &v1,
            &v2,
            json!({"amount": 50}),
            &log(&["CHECKED", "SHIPPED"]),
        );
        assert_eq!(out.verdict, Verdict::Same, "{out:?}");
        assert_eq!((out.events, out.compared), (2, 2));
        assert!(out.divergence.is_none());
        assert_eq!(out.recorded, out.replayed);
        assert_eq!(out.replayed.state, "SHIPPED_OK");
        assert_eq!(out.replayed.status, RunStatus::Terminal);
    }

    #[test]
    fn a_lower_threshold_diverges_at_the_guarded_event() {
        let v1 = order(1, 100, "SHIPPED_OK", true);
        let v2 = order(2, 40, "SHIPPED_OK", true);
        let out = compare(
            &v1,
            &v2,
            json!({"amount": 50}),
            &log(&["CHECKED", "SHIPPED"]),
        );
        assert_eq!(out.verdict, Verdict::Diverged);
        let d = out.divergence.expect("a divergence");
        assert_eq!((d.sequence, d.event.as_str()), (1, "CHECKED"));
        assert_eq!(d.kind, Kind::Guard);
        assert_eq!(d.state_before, "CHECKING");
        assert_eq!(
            d.recorded.as_ref().map(|s| s.state.as_str()),
            Some("APPROVED")
        );
        let would = d.would.expect("the other would take it somewhere");
        assert_eq!(would.state, "REVIEW");
        assert_eq!(would.transition.map(|t| t.index), Some(1));
        assert!(
            d.why.contains("`run.data.amount <= 40` is false"),
            "{}",
            d.why
        );
        assert_eq!(d.candidates[0].guards[0].value, GuardValue::False);
        assert_eq!(
            out.compared, 1,
            "events after the divergence are not compared"
        );
        assert_eq!(out.recorded.state, "SHIPPED_OK", "the recorded run's end");
        assert_eq!(out.replayed.state, "CHECKING", "the other stops before it");
        // Below both thresholds nothing changes.
        let small = compare(
            &v1,
            &v2,
            json!({"amount": 10}),
            &log(&["CHECKED", "SHIPPED"]),
        );
        assert_eq!(small.verdict, Verdict::Same);
    }

    #[test]
    fn an_event_the_other_definition_lacks_is_refused_with_the_reducers_reason() {
        let v1 = order(1, 100, "SHIPPED_OK", true);
        let v2 = order(2, 10, "SHIPPED_OK", true);
        let no_review = order(3, 100, "SHIPPED_OK", false);
        let events = log(&["CHECKED", "REVIEWED", "SHIPPED"]);
        let out = compare(&v1, &v2, json!({"amount": 500}), &events);
        assert_eq!(out.verdict, Verdict::Same, "{out:?}");
        let out = compare(&v1, &no_review, json!({"amount": 500}), &events);
        assert_eq!(out.verdict, Verdict::Refused);
        let d = out.divergence.expect("refused");
        assert_eq!((d.sequence, d.kind), (2, Kind::Rejected));
        assert!(d.would.is_none());
        let rejection = d.rejection.expect("the reducer's reason");
        assert_eq!(rejection.reason.code(), "unknown_event");
        assert_eq!(rejection.state, "REVIEW");
    }

    #[test]
    fn another_target_state_is_reported_with_both_sides() {
        let v1 = order(1, 100, "SHIPPED_OK", true);
        let v2 = order(2, 100, "CANCELLED", false);
        let out = compare(
            &v1,
            &v2,
            json!({"amount": 5}),
            &log(&["CHECKED", "SHIPPED"]),
        );
        let d = out.divergence.expect("diverges");
        assert_eq!((d.sequence, d.kind), (2, Kind::TargetState));
        assert_eq!(d.recorded.map(|s| s.state), Some("SHIPPED_OK".to_owned()));
        assert_eq!(d.would.map(|s| s.state), Some("CANCELLED".to_owned()));
        assert_eq!(out.verdict, Verdict::Diverged);
    }

    #[test]
    fn engine_events_and_missing_states_never_panic() {
        let v1 = order(1, 100, "SHIPPED_OK", true);
        let v2 = order(2, 100, "SHIPPED_OK", true);
        let mut events = log(&["CHECKED"]);
        events.push(Event::new(2, "MODEL_REPLIED", json!({"reply": {}})));
        events.push(Event::new(3, "CANCEL", json!({"reason": "stop"})));
        let out = compare(&v1, &v2, json!({"amount": 1}), &events);
        assert_eq!(out.verdict, Verdict::Same, "{out:?}");
        assert_eq!(
            out.replayed.terminal_reason.as_deref(),
            Some("cancelled: stop")
        );
        // A log its own definition refuses is unreplayable, not a divergence.
        let bad = log(&["SHIPPED"]);
        let out = compare(&v1, &v2, json!({}), &bad);
        assert_eq!(out.verdict, Verdict::Unreplayable);
        assert_eq!(out.divergence.map(|d| d.kind), Some(Kind::RecordedRejected));
    }

    /// A refund of 150 recorded with its approval request, on a refund-agent whose text is
    /// changed by `edit`.
    fn refund_with(edit: (&str, &str)) -> WhatIf {
        let old = crate::builtin::refund_agent();
        let text = crate::builtin::REFUND_AGENT
            .replace("version = 2", "version = 3")
            .replace(edit.0, edit.1);
        let new = Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("valid");
        let args = json!({"order_id": "A1", "amount": 150});
        let events = vec![
            Event::new(
                1,
                "APPROVAL_REQUESTED",
                json!({"approval_id": "a1", "tool": "refund", "args": args}),
            ),
            Event::new(
                2,
                "APPROVAL_REQUIRED",
                json!({"tool": "refund", "args": args, "approval_id": "a1"}),
            ),
        ];
        compare(&old, &new, json!({}), &events)
    }

    #[test]
    fn a_recorded_decision_the_other_definition_would_refuse_or_not_ask_about() {
        let looser = refund_with(("args.amount > 100", "args.amount > 200"));
        assert_eq!(looser.verdict, Verdict::Diverged);
        let d = looser.divergence.expect("diverges");
        assert_eq!((d.sequence, d.kind), (1, Kind::Approval));
        let stricter = refund_with(("maximum = 1000000", "maximum = 100"));
        assert_eq!(stricter.verdict, Verdict::Refused);
        let d = stricter.divergence.expect("refused");
        assert_eq!((d.sequence, d.kind), (1, Kind::DecisionRefused));
        assert!(d.why.contains("schema step"), "{}", d.why);
        let same = refund_with(("args.amount > 100", "args.amount > 120"));
        assert_eq!(same.verdict, Verdict::Same, "{same:?}");
    }
}
