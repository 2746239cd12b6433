//! Runaway runs in the pure core: the ceiling on a run's events ends a loop as a failure
//! with reason `step_limit`, judged by sequence alone so old logs replay the same; timer-only
//! cycles are warned about when a definition is validated; agent loops are not.

use proptest::prelude::*;
use rein_core::limits::RUN_EVENTS_DEFAULT;
use rein_core::{
    Definition, DefinitionError, Event, Format, GuardRegistry, RejectReason, RunState, apply,
    builtin, follow_up, replay,
};
use serde_json::{Value, json};

const SELF_LOOP: &str = include_str!("fixtures/self-loop.toml");
const PING_PONG: &str = include_str!("fixtures/timer-ping-pong.toml");

/// `text` with `extra` TOML after its `version` line.
fn with_top(text: &str, extra: &str) -> String {
    assert!(
        text.contains("version = 1\n"),
        "the fixture names its version"
    );
    text.replacen("version = 1\n", &format!("version = 1\n{extra}\n"), 1)
}

/// An active state whose transition returns to itself, with `extra` TOML at the top.
fn self_loop(extra: &str) -> String {
    with_top(SELF_LOOP, extra)
}

/// Two waiting states whose 1 ms timeouts send the run to each other.
fn ping_pong(extra: &str) -> String {
    with_top(PING_PONG, extra)
}

fn load(text: &str) -> Definition {
    Definition::parse(text, Format::Toml, &GuardRegistry::new()).expect("valid definition")
}

/// What storage commits for `events` written at once: the events, then what the engine
/// commits on its own after them (as `plan_commit` does). Appends to `log`.
fn commit(
    def: &Definition,
    run: RunState,
    events: &[(&str, Value)],
    log: &mut Vec<Event>,
) -> RunState {
    let mut run = run;
    for (kind, payload) in events {
        let event = Event::new(run.sequence + 1, *kind, payload.clone());
        run = apply(def, &run, &event).unwrap_or_else(|e| panic!("{kind} refused: {e}"));
        log.push(event);
    }
    for _ in 0..3 {
        let Some((kind, payload)) = follow_up(def, &run) else {
            break;
        };
        let event = Event::new(run.sequence + 1, kind, payload);
        let Ok(next) = apply(def, &run, &event) else {
            break;
        };
        log.push(event);
        run = next;
    }
    run
}

/// Drives `run` with commits of `per_commit` AGAIN events until it ends (or 100,000
/// commits, which would be a runaway).
fn spin(def: &Definition, per_commit: usize) -> (RunState, Vec<Event>) {
    let mut log = Vec::new();
    let mut run = RunState::initial(def, json!({}));
    let batch: Vec<(&str, Value)> = (0..per_commit).map(|_| ("AGAIN", json!({}))).collect();
    for _ in 0..100_000 {
        if def.is_terminal(&run.state) {
            break;
        }
        run = commit(def, run, &batch, &mut log);
    }
    (run, log)
}

#[test]
fn an_active_state_that_returns_to_itself_ends_failed_at_its_ceiling() {
    let def = load(&self_loop("max_events = 50"));
    assert_eq!(def.max_events(), 50);
    let (run, log) = spin(&def, 1);
    assert_eq!(
        run.sequence, 50,
        "one event per commit ends exactly at the ceiling"
    );
    assert_eq!(run.state, "CANCELLED", "the cancel state");
    assert_eq!(run.terminal_reason.as_deref(), Some("step_limit"));
    let last = log.last().expect("a log");
    assert_eq!(last.kind, "STEP_LIMIT_REACHED");
    assert_eq!(last.payload["reason"], "step_limit");
    assert_eq!(last.payload["max_events"], 50);
    assert_eq!(last.payload["state"], "LOOP");
    assert_eq!(
        log.iter().filter(|e| e.kind == "AGAIN").count(),
        49,
        "every step but the last one the ceiling took"
    );
    let replayed = replay(&def, RunState::initial(&def, json!({})), log.iter()).expect("replays");
    assert_eq!(replayed, run);
}

#[test]
fn without_max_events_a_run_ends_at_the_default_ceiling() {
    let def = load(&self_loop(""));
    assert_eq!(def.max_events(), RUN_EVENTS_DEFAULT);
    let (run, _) = spin(&def, 1);
    assert_eq!(run.sequence, RUN_EVENTS_DEFAULT);
    assert_eq!(run.terminal_reason.as_deref(), Some("step_limit"));
}

#[test]
fn two_waiting_states_whose_timers_point_at_each_other_end_at_the_ceiling() {
    let def = load(&ping_pong("max_events = 500"));
    let mut log = Vec::new();
    let mut run = commit(
        &def,
        RunState::initial(&def, json!({})),
        &[("GO", json!({}))],
        &mut log,
    );
    // The scheduler fires whatever timer is due, as often as it is due.
    for _ in 0..100_000 {
        if def.is_terminal(&run.state) {
            break;
        }
        let fired = rein_core::timer::fired_events(&def, &run, 1, 0);
        let (kind, payload) = fired.first().cloned().expect("a due timer");
        run = commit(&def, run, &[(&kind, payload)], &mut log);
    }
    assert_eq!(run.sequence, 500);
    assert_eq!(run.state, "CANCELLED");
    assert_eq!(run.terminal_reason.as_deref(), Some("step_limit"));
    assert_eq!(
        log.last().map(|e| e.kind.as_str()),
        Some("STEP_LIMIT_REACHED")
    );
}

#[test]
fn the_ceiling_event_is_refused_before_the_ceiling() {
    let def = load(&self_loop("max_events = 50"));
    let mut run = RunState::initial(&def, json!({}));
    for _ in 0..48 {
        run = apply(
            &def,
            &run,
            &Event::new(run.sequence + 1, "AGAIN", json!({})),
        )
        .expect("AGAIN");
    }
    let early = apply(
        &def,
        &run,
        &Event::new(49, "STEP_LIMIT_REACHED", json!({ "reason": "step_limit" })),
    )
    .expect_err("sequence 49 is under the ceiling of 50");
    assert!(
        matches!(&early.reason, RejectReason::BadPayload { message } if message.contains("ceiling")),
        "{early}"
    );
    let run = apply(&def, &run, &Event::new(49, "AGAIN", json!({}))).expect("AGAIN");
    let ended = apply(&def, &run, &Event::new(50, "STEP_LIMIT_REACHED", json!({}))).expect("at 50");
    assert_eq!(ended.terminal_reason.as_deref(), Some("step_limit"));
    let after = apply(
        &def,
        &ended,
        &Event::new(51, "STEP_LIMIT_REACHED", json!({})),
    )
    .expect_err("a terminal run takes nothing");
    assert_eq!(after.reason, RejectReason::Terminal);
}

#[test]
fn a_log_longer_than_the_ceiling_written_before_it_replays_exactly_as_before() {
    // A log of 80 events of a run whose definition now has a ceiling of 50: replay applies
    // every event as it always did; the ceiling is only ever a follow-up of a commit.
    let def = load(&self_loop("max_events = 50"));
    let log: Vec<Event> = (1..=80)
        .map(|n| Event::new(n, "AGAIN", json!({})))
        .collect();
    let replayed = replay(&def, RunState::initial(&def, json!({})), log.iter()).expect("replays");
    assert_eq!(replayed.sequence, 80);
    assert_eq!(replayed.state, "LOOP");
    assert_eq!(replayed.terminal_reason, None);
}

#[test]
fn the_ceiling_waits_for_the_result_of_a_call_in_flight() {
    let def = load(&self_loop("max_events = 5\ncall_results = [\"AGAIN\"]"));
    let mut log = Vec::new();
    let mut run = RunState::initial(&def, json!({}));
    for _ in 0..3 {
        run = commit(&def, run, &[("AGAIN", json!({}))], &mut log);
    }
    let dispatch = json!({ "action_id": "step-1", "call_id": "c1", "node": "LOOP", "step": 1,
                           "idempotency_key": "k1" });
    run = commit(&def, run, &[("ACTION_DISPATCHED", dispatch)], &mut log);
    assert_eq!(run.sequence, 4, "no ceiling while the call is in flight");
    assert_eq!(run.state, "LOOP");
    run = commit(
        &def,
        run,
        &[("AGAIN", json!({ "call_id": "c1" }))],
        &mut log,
    );
    assert_eq!(run.sequence, 6, "its result, then the ceiling");
    assert_eq!(run.terminal_reason.as_deref(), Some("step_limit"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the ceiling and however many events each commit writes, the run ends with
    /// STEP_LIMIT_REACHED at or past the ceiling by less than one commit, in the cancel
    /// state, and its log replays to that state.
    #[test]
    fn every_runaway_ends_at_its_ceiling_by_sequence(max_events in 2u64..400, per_commit in 1usize..4) {
        let def = load(&self_loop(&format!("max_events = {max_events}")));
        let (run, log) = spin(&def, per_commit);
        prop_assert_eq!(run.state.as_str(), "CANCELLED");
        prop_assert_eq!(run.terminal_reason.as_deref(), Some("step_limit"));
        prop_assert!(run.sequence >= max_events);
        prop_assert!(run.sequence < max_events + per_commit as u64, "{} for {max_events}", run.sequence);
        prop_assert_eq!(log.iter().filter(|e| e.kind == "STEP_LIMIT_REACHED").count(), 1);
        let replayed = replay(&def, RunState::initial(&def, json!({})), log.iter());
        prop_assert_eq!(replayed.ok(), Some(run));
    }
}

#[test]
fn max_events_out_of_bounds_is_rejected_with_its_item() {
    for bad in ["max_events = 0", "max_events = 1", "max_events = 1000001"] {
        let err =
            Definition::parse(&self_loop(bad), Format::Toml, &GuardRegistry::new()).expect_err(bad);
        let DefinitionError::Invalid(problems) = &err else {
            panic!("{err}");
        };
        assert!(
            problems
                .iter()
                .any(|p| p.item == "max_events" && p.reason.contains("2..=1000000")),
            "{bad}: {err}"
        );
    }
    assert_eq!(
        load(&self_loop("max_events = 1000000")).max_events(),
        1_000_000
    );
}

#[test]
fn a_cycle_of_timers_alone_is_warned_about_and_the_definition_still_loads() {
    let def = load(&ping_pong(""));
    let warnings = def.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].item, "states (PING, PONG)");
    assert!(
        warnings[0].reason.contains("PING + TO_PONG -> PONG")
            && warnings[0].reason.contains("PONG + TO_PING -> PING")
            && warnings[0].reason.contains("10000 events"),
        "{}",
        warnings[0].reason
    );
}

#[test]
fn a_cycle_that_passes_through_an_active_state_is_not_warned_about() {
    // PONG's timer goes to an active state: a worker runs each round, as in a retry loop.
    let text = ping_pong("").replace(
        "[[transitions]]\nfrom = \"PONG\"\nevent = \"TO_PING\"\nto = \"PING\"",
        "[[transitions]]\nfrom = \"PONG\"\nevent = \"TO_PING\"\nto = \"START\"\n\n[[transitions]]\nfrom = \"START\"\nevent = \"TO_PING\"\nto = \"PING\"",
    );
    assert_ne!(text, ping_pong(""), "the fixture changed");
    let def = load(&text);
    assert!(def.warnings().is_empty(), "{:?}", def.warnings());
}

#[test]
fn agent_loops_and_the_built_in_definitions_give_no_warning() {
    // refund-agent's ACTING -> ACTING is how an agent works: the ceiling, not validation,
    // stops one that never ends.
    let refund = builtin::refund_agent();
    assert!(
        refund
            .transitions()
            .iter()
            .any(|t| t.from == "ACTING" && t.to == "ACTING"),
        "the fixture loops"
    );
    for (name, _) in builtin::ALL {
        let def = builtin::load(name).expect("built in").expect("valid");
        assert!(def.warnings().is_empty(), "{name}: {:?}", def.warnings());
    }
    assert!(load(&self_loop("")).warnings().is_empty());
}
