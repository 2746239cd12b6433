//! Fleet-wide limits in the pure core (SPEC K1): how a limit is written on the command line
//! and in a definition, which keys an action takes, and ACTION_DEFERRED, which holds an
//! action back without changing anything but the sequence.

use rein_core::{Definition, Event, Format, GuardRegistry, LimitSpec, RunState, apply};
use serde_json::json;

fn def(extra_top: &str, state_extra: &str) -> Result<Definition, rein_core::DefinitionError> {
    let text = format!(
        r#"
name = "limited"
version = 1
cancel_state = "END"
events = ["DONE"]
{extra_top}

[[states]]
name = "WORK"
kind = "active"
initial = true
action = "charge"
{state_extra}

[[states]]
name = "END"
kind = "terminal"

[[transitions]]
from = "WORK"
event = "DONE"
to = "END"
"#
    );
    Definition::parse(&text, Format::Toml, &GuardRegistry::default())
}

#[test]
fn the_command_line_form_reads_rates_bursts_and_caps() {
    let s = LimitSpec::parse("10/s").unwrap();
    assert_eq!(
        (s.rate, s.per_ms, s.burst, s.concurrency),
        (Some(10), 1000, None, None)
    );
    assert_eq!(s.bucket(), 1);
    let s = LimitSpec::parse("60/min, burst=5").unwrap();
    assert_eq!((s.rate, s.per_ms, s.bucket()), (Some(60), 60_000, 5));
    let s = LimitSpec::parse("concurrency=4").unwrap();
    assert_eq!((s.rate, s.concurrency), (None, Some(4)));
    let s = LimitSpec::parse("3/250ms,burst=2,concurrency=9").unwrap();
    assert_eq!(
        (s.rate, s.per_ms, s.burst, s.concurrency),
        (Some(3), 250, Some(2), Some(9))
    );
    assert_eq!(LimitSpec::parse("1/h").unwrap().per_ms, 3_600_000);
}

#[test]
fn a_malformed_limit_is_refused_with_what_to_write_instead() {
    for (text, says) in [
        ("", "is not a rate"),
        ("ten/s", "not a whole number"),
        ("10/fortnight", "period `fortnight`"),
        ("0/s", "at least 1"),
        ("burst=3", "declare `rate`"),
        ("concurrency=0", "`concurrency` must be"),
        ("10/s,10/min", "one rate"),
        ("10/s,speed=3", "is not a rate"),
        ("10/0", "`per_ms` must be"),
        ("2000000/s", "at most"),
    ] {
        let err = LimitSpec::parse(text).expect_err(text);
        assert!(err.contains(says), "{text:?}: {err}");
    }
    assert!(rein_core::limit_key_problem("tool:search").is_none());
    assert!(rein_core::limit_key_problem("model/gpt-4.1_mini").is_none());
    assert!(rein_core::limit_key_problem("").is_some());
    assert!(rein_core::limit_key_problem("has space").is_some());
    assert!(rein_core::limit_key_problem(&"k".repeat(129)).is_some());
}

#[test]
fn a_definition_declares_limit_values_and_the_keys_each_action_takes() {
    let d = def(
        "[limits.\"model:gpt-x\"]\nrate = 60\nper_ms = 60000\nburst = 5\n\n[limits.\"api:charge\"]\nconcurrency = 2\n",
        "limits = [\"model:gpt-x\", \"api:charge\"]",
    )
    .unwrap();
    assert_eq!(d.limits().len(), 2);
    assert_eq!(d.limits()["model:gpt-x"].bucket(), 5);
    assert_eq!(d.limits()["api:charge"].concurrency, Some(2));
    assert_eq!(
        d.limit_keys("WORK", None),
        ["action:charge", "model:gpt-x", "api:charge"]
    );
    assert_eq!(
        d.limit_keys("WORK", Some("search")),
        ["action:charge", "tool:search", "model:gpt-x", "api:charge"]
    );
    assert!(d.limit_keys("END", None).is_empty());
    // Limits add nothing to the stored form of definitions without them.
    let plain = def("", "").unwrap();
    let body = serde_json::to_value(plain.spec()).unwrap();
    assert!(body.get("limits").is_none());
    assert!(body["states"][0].get("limits").is_none());
}

#[test]
fn a_definition_with_bad_limits_names_each_problem() {
    let err = def(
        "[limits.\"bad key\"]\nrate = 0\n\n[limits.\"ok\"]\nburst = 2\n",
        "",
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("limits.bad key"), "{text}");
    assert!(text.contains("at least 1"), "{text}");
    assert!(text.contains("needs a `rate`"), "{text}");
    let err = def("", "limits = [\"a b\"]").unwrap_err().to_string();
    assert!(err.contains("may use only"), "{err}");
    let err = def("[limits.\"x\"]\nspeed = 3\n", "")
        .unwrap_err()
        .to_string();
    assert!(err.contains("speed"), "{err}");
}

#[test]
fn action_deferred_changes_nothing_but_the_sequence_and_counts_no_retry() {
    let d = def("", "").unwrap();
    let run = RunState::initial(&d, json!({"amount": 3}));
    let deferred = Event::new(
        1,
        "ACTION_DEFERRED",
        json!({ "key": "action:charge", "limit": "rate", "wait_ms": 250, "node": "WORK" }),
    );
    let next = apply(&d, &run, &deferred).unwrap();
    assert_eq!(next.sequence, 1);
    let mut same = next.clone();
    same.sequence = 0;
    assert_eq!(same, run, "only the sequence moved");
    assert_eq!(next.attempt, 0);

    // It needs its key and wait, and cannot hold back a call already in flight or a run
    // that has ended.
    let missing = Event::new(1, "ACTION_DEFERRED", json!({ "key": "k" }));
    assert!(apply(&d, &run, &missing).is_err());
    let dispatched = Event::new(
        1,
        "ACTION_DISPATCHED",
        json!({ "action_id": "step-1", "call_id": "c1", "node": "WORK", "step": 1, "idempotency_key": "k" }),
    );
    let in_flight = apply(&d, &run, &dispatched).unwrap();
    let again = Event::new(2, "ACTION_DEFERRED", json!({ "key": "k", "wait_ms": 5 }));
    assert!(apply(&d, &in_flight, &again).is_err());
    let done = apply(&d, &run, &Event::new(1, "DONE", json!({}))).unwrap();
    assert!(
        apply(
            &d,
            &done,
            &Event::new(2, "ACTION_DEFERRED", json!({ "key": "k", "wait_ms": 5 }))
        )
        .is_err()
    );
}
