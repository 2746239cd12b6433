//! Checkpoints and migrations (SPEC E4, V1, C10): a checkpoint is a shortcut bound to one
//! definition version; the log is the truth.

use rein_core::checkpoint::{Checkpoint, Migrations, RecoveryError};
use rein_core::{Definition, Event, Format, GuardRegistry, RunState, builtin, replay};
use serde_json::{Value, json};

/// The built-in research agent as version `version`.
fn research_agent_v(version: u32) -> Definition {
    let text = builtin::source_at_version("research-agent", version).expect("a built-in");
    let def = Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("valid");
    assert_eq!(def.version(), version);
    def
}

fn dispatched(call_id: &str, step: u32) -> Value {
    json!({
        "action_id": format!("act-{step}"),
        "call_id": call_id,
        "node": "ACTING",
        "step": step,
        "idempotency_key": format!("key-{step}"),
        "tool": "search",
    })
}

/// A realistic research-agent log: one retried tool call, a second step, a user
/// clarification and a committed output.
fn log() -> Vec<(&'static str, Value)> {
    vec![
        ("TASK_ACCEPTED", json!({"data": {"question": "why"}})),
        ("NEED_CLARIFICATION", json!({})),
        ("USER_REPLY", json!({"data": {"detail": "more"}})),
        (
            "PLAN_READY",
            json!({"data": {"plan": ["search", "search"]}}),
        ),
        ("ACTION_DISPATCHED", dispatched("c1", 1)),
        (
            "TOOL_RETRYABLE_FAILED",
            json!({"call_id": "c1", "error": "503"}),
        ),
        ("RETRY_DUE", json!({})),
        ("ACTION_DISPATCHED", dispatched("c2", 1)),
        (
            "TOOL_SUCCEEDED",
            json!({"call_id": "c2", "result": {"hits": 3}}),
        ),
        ("DECISION_REJECTED", json!({"reason": "tool not allowed"})),
        ("CONTINUE", json!({})),
        ("ACTION_DISPATCHED", dispatched("c3", 2)),
        (
            "TOOL_SUCCEEDED",
            json!({"call_id": "c3", "result": {"hits": 5}}),
        ),
        ("TASK_READY", json!({})),
        ("OUTPUT_COMMITTED", json!({"reason": "answered"})),
    ]
}

fn events() -> Vec<Event> {
    log()
        .into_iter()
        .enumerate()
        .map(|(i, (kind, payload))| Event::new(i as u64 + 1, kind, payload))
        .collect()
}

fn initial(def: &Definition) -> RunState {
    RunState::initial(def, json!({"topic": "rust"}))
}

#[test]
fn the_test_log_is_a_complete_successful_run() {
    let def = research_agent_v(1);
    let events = events();
    let run = replay(&def, initial(&def), &events).expect("the log is legal");
    assert_eq!(run.state, "SUCCEEDED");
    assert_eq!(run.sequence, events.len() as u64);
    assert_eq!(run.steps_completed, 2);
    assert_eq!(run.results.len(), 2);
    assert_eq!(run.terminal_reason.as_deref(), Some("answered"));
}

#[test]
fn recovery_from_any_checkpoint_plus_tail_equals_full_replay() {
    let def = research_agent_v(1);
    let events = events();
    let full = replay(&def, initial(&def), &events).expect("the log is legal");
    for cut in 0..=events.len() {
        let at = replay(&def, initial(&def), &events[..cut]).expect("prefix is legal");
        let checkpoint = Checkpoint::of(&at);
        assert_eq!(checkpoint.sequence, cut as u64);
        let recovered = checkpoint
            .recover(&def, &events[cut..])
            .unwrap_or_else(|e| panic!("checkpoint at {cut}: {e}"));
        assert_eq!(recovered, full, "checkpoint at {cut}");
    }
}

#[test]
fn checkpoint_survives_serialisation() {
    let def = research_agent_v(1);
    let events = events();
    let at = replay(&def, initial(&def), &events[..8]).expect("prefix is legal");
    let checkpoint = Checkpoint::of(&at);
    let stored = serde_json::to_string(&checkpoint).expect("serialises");
    let loaded: Checkpoint = serde_json::from_str(&stored).expect("deserialises");
    assert_eq!(loaded, checkpoint);
    let full = replay(&def, initial(&def), &events).expect("the log is legal");
    assert_eq!(loaded.recover(&def, &events[8..]).expect("recovers"), full);
}

#[test]
fn checkpoint_bound_to_another_version_is_refused() {
    let v1 = research_agent_v(1);
    let v2 = research_agent_v(2);
    let at = replay(&v1, initial(&v1), &events()[..5]).expect("prefix is legal");
    let err = Checkpoint::of(&at)
        .recover(&v2, &events()[5..])
        .expect_err("v1 checkpoint, v2 definition");
    assert_eq!(
        err,
        RecoveryError::VersionMismatch {
            found_name: "research-agent".into(),
            found_version: 1,
            expected_name: "research-agent".into(),
            expected_version: 2,
        }
    );
}

#[test]
fn checkpoint_of_another_definition_is_refused() {
    let lifecycle = builtin::lifecycle();
    let agent = research_agent_v(1);
    let checkpoint = Checkpoint::of(&initial(&lifecycle));
    let err = checkpoint
        .recover(&agent, &[])
        .expect_err("other definition");
    assert!(
        matches!(&err, RecoveryError::VersionMismatch { found_name, .. } if found_name == "lifecycle"),
        "{err}"
    );
}

#[test]
fn checkpoint_whose_state_disagrees_with_its_sequence_is_refused() {
    let def = research_agent_v(1);
    let at = replay(&def, initial(&def), &events()[..3]).expect("prefix is legal");
    let mut checkpoint = Checkpoint::of(&at);
    checkpoint.sequence = 2;
    let err = checkpoint
        .recover(&def, &events()[2..])
        .expect_err("inconsistent");
    assert_eq!(
        err,
        RecoveryError::Inconsistent {
            checkpoint: 2,
            state: 3
        }
    );
}

#[test]
fn tail_that_does_not_continue_the_checkpoint_is_refused() {
    let def = research_agent_v(1);
    let events = events();
    let at = replay(&def, initial(&def), &events[..6]).expect("prefix is legal");
    let err = Checkpoint::of(&at)
        .recover(&def, &events[7..])
        .expect_err("event 7 is missing");
    assert!(matches!(err, RecoveryError::Tail(_)), "{err}");
}

fn mark(step: &'static str) -> impl Fn(RunState) -> Result<RunState, String> {
    move |mut run: RunState| {
        let applied = run.data.as_object_mut().ok_or("data is not an object")?;
        let list = applied.entry("migrated").or_insert_with(|| json!([]));
        list.as_array_mut()
            .ok_or("migrated is not a list")?
            .push(json!(step));
        Ok(run)
    }
}

fn v1_checkpoint() -> Checkpoint {
    let def = research_agent_v(1);
    let at = replay(&def, initial(&def), &events()[..9]).expect("prefix is legal");
    Checkpoint::of(&at)
}

#[test]
fn migrations_chain_v1_to_v2_to_v3_in_order() {
    let mut migrations = Migrations::new();
    migrations
        .register("research-agent", 2, mark("2->3"))
        .register("research-agent", 1, mark("1->2"));
    let migrated = migrations
        .migrate(&v1_checkpoint(), 3)
        .expect("both steps registered");
    assert_eq!(migrated.version, 3);
    assert_eq!(migrated.state.version, 3);
    assert_eq!(migrated.sequence, 9);
    assert_eq!(migrated.state.data["migrated"], json!(["1->2", "2->3"]));
}

#[test]
fn migrated_checkpoint_recovers_under_the_new_version() {
    let mut migrations = Migrations::new();
    migrations
        .register("research-agent", 1, mark("1->2"))
        .register("research-agent", 2, mark("2->3"));
    let migrated = migrations
        .migrate(&v1_checkpoint(), 3)
        .expect("both steps registered");
    let v3 = research_agent_v(3);
    let run = migrated.recover(&v3, &events()[9..]).expect("bound to v3");
    assert_eq!(run.state, "SUCCEEDED");
    assert_eq!(run.version, 3);
}

#[test]
fn missing_migration_step_is_reported() {
    let mut migrations = Migrations::new();
    migrations.register("research-agent", 1, mark("1->2"));
    let err = migrations
        .migrate(&v1_checkpoint(), 3)
        .expect_err("no 2->3");
    assert_eq!(
        err,
        RecoveryError::NoMigration {
            definition: "research-agent".into(),
            from: 2,
            to: 3
        }
    );
}

#[test]
fn migration_of_another_definition_is_not_used() {
    let mut migrations = Migrations::new();
    migrations.register("lifecycle", 1, mark("1->2"));
    let err = migrations
        .migrate(&v1_checkpoint(), 2)
        .expect_err("wrong definition");
    assert!(
        matches!(err, RecoveryError::NoMigration { from: 1, to: 2, .. }),
        "{err}"
    );
}

#[test]
fn failing_migration_is_reported_with_its_step() {
    let mut migrations = Migrations::new();
    migrations
        .register("research-agent", 1, mark("1->2"))
        .register("research-agent", 2, |_| Err("field gone".to_owned()));
    let err = migrations
        .migrate(&v1_checkpoint(), 3)
        .expect_err("2->3 fails");
    assert_eq!(
        err,
        RecoveryError::MigrationFailed {
            definition: "research-agent".into(),
            from: 2,
            to: 3,
            message: "field gone".into()
        }
    );
}

#[test]
fn migration_to_an_older_version_is_refused() {
    let mut migrations = Migrations::new();
    migrations.register("research-agent", 1, mark("1->2"));
    let mut checkpoint = v1_checkpoint();
    checkpoint.version = 2;
    checkpoint.state.version = 2;
    let err = migrations
        .migrate(&checkpoint, 1)
        .expect_err("no downgrade");
    assert!(matches!(err, RecoveryError::NoMigration { .. }), "{err}");
}

#[test]
fn migration_to_the_same_version_is_the_identity() {
    let checkpoint = v1_checkpoint();
    let same = Migrations::new()
        .migrate(&checkpoint, 1)
        .expect("nothing to do");
    assert_eq!(same, checkpoint);
}

/// The checkpoint a commit would have written after the first `n` events.
fn checkpoint_at(def: &Definition, n: usize) -> Checkpoint {
    let events = events();
    let state = replay(def, initial(def), events[..n].iter()).expect("replays");
    Checkpoint::of(&state)
}

#[test]
fn true_checkpoints_agree_with_the_log_they_snapshot() {
    let def = research_agent_v(1);
    let checkpoints: Vec<Checkpoint> = [0, 4, 9, 15]
        .iter()
        .map(|&n| checkpoint_at(&def, n))
        .collect();
    let (state, problems) =
        rein_core::checkpoint::replay_judging(&def, initial(&def), events().iter(), &checkpoints)
            .expect("replays");
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(state.state, "SUCCEEDED");
}

#[test]
fn a_checkpoint_changed_by_hand_is_named_with_what_differs() {
    let def = research_agent_v(1);
    let mut forged = checkpoint_at(&def, 9);
    forged.state.data["question"] = json!("forged");
    let good = checkpoint_at(&def, 4);
    let (_, problems) = rein_core::checkpoint::replay_judging(
        &def,
        initial(&def),
        events().iter(),
        &[forged, good],
    )
    .expect("the log itself replays");
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("checkpoint at sequence 9") && problems[0].contains("(in data)"),
        "{}",
        problems[0]
    );
}

#[test]
fn a_checkpoint_bound_elsewhere_or_past_the_log_is_named() {
    let def = research_agent_v(1);
    let other = checkpoint_at(&research_agent_v(2), 4);
    let mut beyond = checkpoint_at(&def, 15);
    beyond.sequence = 99;
    beyond.state.sequence = 99;
    let (_, problems) = rein_core::checkpoint::replay_judging(
        &def,
        initial(&def),
        events().iter(),
        &[other, beyond],
    )
    .expect("replays");
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(
        problems[0].contains("bound to research-agent@v2"),
        "{problems:?}"
    );
    assert!(
        problems[1].contains("past the log, which ends at 15"),
        "{problems:?}"
    );
}
