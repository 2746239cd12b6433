//! Property tests of the pure core (SPEC E3, M4, C4, C5, R1): replay determinism,
//! reachability, terminal states, sequence counting and backoff bounds.

use std::collections::{BTreeSet, VecDeque};

use proptest::prelude::*;
use rein_core::retry::RetryPolicy;
use rein_core::{Definition, Event, RejectReason, RunState, apply, builtin, replay};
use serde_json::{Value, json};

const CASES: u32 = 256;

/// Engine events mixed into the random logs besides the definition's own events.
const ENGINE_EVENTS: [&str; 3] = ["CANCEL", "DECISION_REJECTED", "ACTION_DISPATCHED"];

fn payloads() -> Vec<Value> {
    vec![
        json!({}),
        json!({"reason": "x"}),
        json!({"call_id": "c1", "result": 1}),
        json!({"data": {"k": 1}, "error": "boom"}),
        json!({
            "action_id": "a1",
            "call_id": "c1",
            "node": "n",
            "step": 1,
            "idempotency_key": "k1",
        }),
    ]
}

fn definitions() -> [Definition; 2] {
    [builtin::lifecycle(), builtin::research_agent()]
}

fn vocabulary(def: &Definition) -> Vec<String> {
    def.events()
        .cloned()
        .chain(ENGINE_EVENTS.iter().map(|e| (*e).to_owned()))
        .collect()
}

/// States reachable from the initial state through the transition table, plus the cancel
/// state (CANCEL reaches it from anywhere).
fn reachable(def: &Definition) -> BTreeSet<String> {
    let transitions = def.transitions();
    let mut seen = BTreeSet::from([
        def.initial_state().to_owned(),
        def.cancel_state().to_owned(),
    ]);
    let mut queue = VecDeque::from([def.initial_state().to_owned()]);
    while let Some(state) = queue.pop_front() {
        for t in transitions.iter().filter(|t| t.from == state) {
            if seen.insert(t.to.clone()) {
                queue.push_back(t.to.clone());
            }
        }
    }
    seen
}

/// Random (event, payload) picks, as indexes into the vocabulary and the payload set.
fn picks() -> impl Strategy<Value = (usize, Vec<(usize, usize)>)> {
    (
        0..2usize,
        prop::collection::vec((0..64usize, 0..payloads().len()), 0..60),
    )
}

/// Applies every pick in order, skipping rejected ones. Checks on the way that a
/// rejection is a pure error (input untouched, same answer twice). Returns the accepted
/// events and every accepted state, `X_0` first.
fn run_log(def: &Definition, picks: &[(usize, usize)]) -> (Vec<Event>, Vec<RunState>) {
    let vocabulary = vocabulary(def);
    let payloads = payloads();
    let mut run = RunState::initial(def, json!({"topic": "t"}));
    let mut accepted = Vec::new();
    let mut states = vec![run.clone()];
    for &(e, p) in picks {
        let event = Event::new(
            run.sequence + 1,
            vocabulary[e % vocabulary.len()].clone(),
            payloads[p].clone(),
        );
        let before = run.clone();
        let result = apply(def, &run, &event);
        assert_eq!(run, before, "apply changed its input");
        assert_eq!(
            result,
            apply(def, &run, &event),
            "apply is not deterministic"
        );
        if let Ok(next) = result {
            run = next;
            accepted.push(event);
            states.push(run.clone());
        }
    }
    (accepted, states)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn replaying_the_accepted_log_twice_gives_the_incremental_state((d, picks) in picks()) {
        let def = &definitions()[d];
        let (events, states) = run_log(def, &picks);
        let x0 = RunState::initial(def, json!({"topic": "t"}));
        let first = replay(def, x0.clone(), &events).expect("accepted events replay");
        let second = replay(def, x0, &events).expect("accepted events replay");
        prop_assert_eq!(&first, &second);
        prop_assert_eq!(&first, states.last().expect("X_0 is always there"));
    }

    #[test]
    fn every_accepted_prefix_ends_in_a_reachable_state((d, picks) in picks()) {
        let def = &definitions()[d];
        let reachable = reachable(def);
        let (_, states) = run_log(def, &picks);
        for run in &states {
            prop_assert!(reachable.contains(&run.state), "{} is not reachable", run.state);
            prop_assert!(def.state(&run.state).is_some(), "{} is not declared", run.state);
        }
    }

    #[test]
    fn once_terminal_every_ordinary_event_is_rejected((d, picks) in picks()) {
        let def = &definitions()[d];
        let (_, states) = run_log(def, &picks);
        for run in states.iter().filter(|r| def.is_terminal(&r.state)) {
            for kind in def.events() {
                let event = Event::new(run.sequence + 1, kind.clone(), json!({}));
                let err = apply(def, run, &event).expect_err("terminal state");
                prop_assert_eq!(err.reason, RejectReason::Terminal);
            }
            let cancel = Event::new(run.sequence + 1, "CANCEL", json!({}));
            prop_assert!(apply(def, run, &cancel).is_err());
        }
    }

    #[test]
    fn terminal_state_is_never_left((d, picks) in picks()) {
        let def = &definitions()[d];
        let (_, states) = run_log(def, &picks);
        if let Some(first) = states.iter().position(|r| def.is_terminal(&r.state)) {
            for later in &states[first..] {
                prop_assert_eq!(&later.state, &states[first].state);
                prop_assert!(later.terminal_reason.is_some());
            }
        }
    }

    #[test]
    fn sequence_counts_the_accepted_events((d, picks) in picks()) {
        let def = &definitions()[d];
        let (events, states) = run_log(def, &picks);
        for (n, run) in states.iter().enumerate() {
            prop_assert_eq!(run.sequence, n as u64);
        }
        prop_assert_eq!(states.last().map(|r| r.sequence), Some(events.len() as u64));
    }

    #[test]
    fn event_skipping_a_sequence_number_is_always_out_of_order(
        (d, picks) in picks(),
        e in 0..64usize,
        gap in 2..5u64,
    ) {
        let def = &definitions()[d];
        let (_, states) = run_log(def, &picks);
        let run = states.last().expect("X_0 is always there");
        let vocabulary = vocabulary(def);
        let event = Event::new(run.sequence + gap, vocabulary[e % vocabulary.len()].clone(), json!({}));
        let err = apply(def, run, &event).expect_err("gap");
        prop_assert_eq!(err.reason, RejectReason::OutOfOrder { expected: run.sequence + 1 });
    }
}

fn valid_policy() -> impl Strategy<Value = RetryPolicy> {
    (
        0..=1000u32,
        0..=rein_core::retry::INTERVAL_MS_CEILING,
        0.0..1.0f64,
        1.0..16.0f64,
        0.0..=1.0f64,
    )
        .prop_map(
            |(max_retries, max_interval_ms, initial_share, backoff_factor, jitter)| RetryPolicy {
                max_retries,
                initial_interval_ms: (max_interval_ms as f64 * initial_share) as u64,
                backoff_factor,
                max_interval_ms,
                jitter,
                deadline_ms: None,
                non_retryable: Vec::new(),
            },
        )
        .prop_filter("policy must validate", |p| p.validate().is_ok())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn backoff_stays_within_zero_and_max_interval(
        policy in valid_policy(),
        attempt in any::<u32>(),
        sample in 0.0..1.0f64,
    ) {
        let delay = policy.backoff_ms(attempt, sample);
        prop_assert!(delay <= policy.max_interval_ms, "{delay} > {}", policy.max_interval_ms);
    }

    #[test]
    fn backoff_without_jitter_never_decreases_with_attempt(
        policy in valid_policy(),
        a in 0..2000u32,
        b in 0..2000u32,
    ) {
        let policy = RetryPolicy { jitter: 0.0, ..policy };
        let (lo, hi) = (a.min(b), a.max(b));
        prop_assert!(policy.backoff_ms(lo, 0.5) <= policy.backoff_ms(hi, 0.5));
        prop_assert!(policy.backoff_ms(lo, 0.5) <= policy.backoff_ms(lo + 1, 0.5));
    }

    #[test]
    fn backoff_without_jitter_ignores_the_sample(
        policy in valid_policy(),
        attempt in 0..64u32,
        s1 in 0.0..1.0f64,
        s2 in 0.0..1.0f64,
    ) {
        let policy = RetryPolicy { jitter: 0.0, ..policy };
        prop_assert_eq!(policy.backoff_ms(attempt, s1), policy.backoff_ms(attempt, s2));
    }

    #[test]
    fn jitter_moves_the_delay_at_most_its_fraction_either_way(
        policy in valid_policy(),
        attempt in 0..64u32,
        sample in 0.0..1.0f64,
    ) {
        let base = RetryPolicy { jitter: 0.0, ..policy.clone() }.backoff_ms(attempt, 0.0) as f64;
        let delay = policy.backoff_ms(attempt, sample) as f64;
        let low = base * (1.0 - policy.jitter) - 1.0;
        let high = base * (1.0 + policy.jitter) + 1.0;
        prop_assert!(delay >= low && delay <= high, "{delay} not in [{low}, {high}]");
    }
}

#[test]
fn backoff_without_jitter_starts_at_the_initial_interval_and_doubles() {
    let policy = RetryPolicy {
        initial_interval_ms: 200,
        backoff_factor: 2.0,
        max_interval_ms: 5000,
        jitter: 0.0,
        ..RetryPolicy::default()
    };
    let delays: Vec<u64> = (0..6).map(|a| policy.backoff_ms(a, 0.3)).collect();
    assert_eq!(delays, [200, 400, 800, 1600, 3200, 5000]);
}

#[test]
fn jitter_still_spreads_delays_once_the_interval_is_capped() {
    let policy = RetryPolicy {
        initial_interval_ms: 1000,
        backoff_factor: 2.0,
        max_interval_ms: 60_000,
        jitter: 0.5,
        ..RetryPolicy::default()
    };
    assert_eq!(policy.backoff_ms(20, 0.0), 30_000);
    assert!(policy.backoff_ms(20, 0.25) < policy.backoff_ms(20, 0.5));
}

#[test]
fn backoff_for_a_huge_attempt_is_the_max_interval() {
    let policy = RetryPolicy::default();
    assert_eq!(policy.backoff_ms(u32::MAX, 0.5), policy.max_interval_ms);
}
