//! Moving a run between versions and forking it, as pure functions (SPEC V1, E6).

use rein_core::checkpoint::Migrations;
use rein_core::migration::{Unmovable, fork_snapshot, plan};
use rein_core::{Definition, Event, Format, GuardRegistry, RunState, apply, replay};
use serde_json::json;

const V1: &str = r#"
name = "m"
version = 1
cancel_state = "X"
events = ["GO", "END"]
[[states]]
name = "A"
kind = "waiting"
initial = true
[[states]]
name = "B"
kind = "waiting"
[[states]]
name = "Z"
kind = "terminal"
[[states]]
name = "X"
kind = "terminal"
[[transitions]]
from = "A"
event = "GO"
to = "B"
[[transitions]]
from = "B"
event = "END"
to = "Z"
"#;

fn def(text: &str) -> Definition {
    Definition::parse(text, Format::Toml, &GuardRegistry::new()).unwrap()
}

fn v2(migration: &str) -> Definition {
    def(&(V1
        .replace("version = 1", "version = 2")
        .replace("\"B\"", "\"C\"")
        + migration))
}

fn after_go(v1: &Definition) -> RunState {
    let start = RunState::initial(v1, json!({"n": 1, "old": true}));
    replay(v1, start, &[Event::new(1, "GO", json!({}))]).unwrap()
}

#[test]
fn a_declared_migration_maps_the_state_and_transforms_the_data() {
    let v1 = def(V1);
    let v2 = v2(r#"
[migration]
from = 1
states = { B = "C" }
rename = { n = "count" }
drop = ["old"]
default = { unit = "kg", count = 99 }
"#);
    let mut migrations = Migrations::new();
    rein_core::migration::declare(&mut migrations, &v2);
    let run = after_go(&v1);
    let planned = plan(&v2, &migrations, &run).unwrap();
    assert_eq!(
        (planned.from_state.as_str(), planned.to_state.as_str()),
        ("B", "C")
    );
    assert_eq!(
        planned.data,
        json!({"count": 1, "unit": "kg"}),
        "defaults fill only what is missing"
    );
    // The event the plan gives is what the reducer applies, with v2.
    let moved = apply(
        &v2,
        &run,
        &Event::new(2, "DEFINITION_MIGRATED", planned.payload("op", None)),
    )
    .unwrap();
    assert_eq!(
        (
            moved.version,
            moved.state.as_str(),
            moved.entered_at_sequence
        ),
        (2, "C", 2)
    );
    let end = apply(&v2, &moved, &Event::new(3, "END", json!({}))).unwrap();
    assert_eq!(end.state, "Z");
    // Reduced with the old version, or twice, it is refused.
    assert!(
        apply(
            &v1,
            &run,
            &Event::new(2, "DEFINITION_MIGRATED", planned.payload("op", None))
        )
        .is_err()
    );
    assert!(
        apply(
            &v2,
            &moved,
            &Event::new(3, "DEFINITION_MIGRATED", planned.payload("op", None))
        )
        .is_err()
    );
}

#[test]
fn what_cannot_move_says_why() {
    let v1 = def(V1);
    let stays = v2("\n[migration]\nfrom = 1\nnot_migratable = [\"B\"]\n");
    let mut migrations = Migrations::new();
    rein_core::migration::declare(&mut migrations, &stays);
    let why = plan(&stays, &migrations, &after_go(&v1)).unwrap_err();
    assert!(
        why.to_string().contains("`B` is declared not migratable"),
        "{why}"
    );
    // Unmapped and missing in the new version.
    let unmapped = v2("\n[migration]\nfrom = 1\n");
    let mut migrations = Migrations::new();
    rein_core::migration::declare(&mut migrations, &unmapped);
    let why = plan(&unmapped, &migrations, &after_go(&v1)).unwrap_err();
    assert!(
        why.to_string().contains("`B` does not exist in v2"),
        "{why}"
    );
    // No migration declared at all.
    let why = plan(&unmapped, &Migrations::new(), &after_go(&v1)).unwrap_err();
    assert!(why.to_string().contains("no migration"), "{why}");
    // A run in a call waits.
    let mut busy = after_go(&v1);
    busy = apply(
        &v1,
        &busy,
        &Event::new(2, "ACTION_DISPATCHED", json!({"action_id": "a", "call_id": "c", "node": "n", "step": 1, "idempotency_key": "k"})),
    )
    .unwrap();
    let why = plan(&unmapped, &migrations, &busy).unwrap_err();
    assert!(
        matches!(why, Unmovable::OpenCall(_)) && why.later(),
        "{why}"
    );
}

#[test]
fn a_migration_that_points_nowhere_does_not_validate() {
    for (migration, says) in [
        ("from = 2", "migration.from"),
        ("from = 1\nstates = { B = \"NOPE\" }", "migration.states.B"),
        ("from = 1\nstates = { B = \"Z\" }", "terminal"),
        (
            "from = 1\nrename = { a = \"x\", b = \"x\" }",
            "a second key",
        ),
        (
            "from = 1\nrename = { a = \"x\" }\ndrop = [\"x\"]",
            "which `drop` removes",
        ),
        ("from = 1\nsurprise = 1", "unknown field"),
    ] {
        let text = V1.replace("version = 1", "version = 2") + "\n[migration]\n" + migration + "\n";
        let err = Definition::parse(&text, Format::Toml, &GuardRegistry::new()).unwrap_err();
        assert!(err.to_string().contains(says), "{migration}: {err}");
    }
}

#[test]
fn a_fork_starts_from_the_snapshot_and_only_as_a_first_event() {
    let v1 = def(V1);
    let at = after_go(&v1);
    let snapshot = fork_snapshot(
        &at,
        &v1,
        &Migrations::new(),
        Some(&json!({"n": 5, "old": null})),
    )
    .unwrap();
    assert_eq!(snapshot.data, json!({"n": 5}));
    let payload = rein_core::migration::fork_payload("src", 1, 1, &snapshot, "op", Some("why"));
    let start = RunState::initial(&v1, json!({"n": 1}));
    let forked = apply(&v1, &start, &Event::new(1, "RUN_FORKED", payload.clone())).unwrap();
    assert_eq!(
        (
            forked.state.as_str(),
            forked.sequence,
            forked.entered_at_sequence
        ),
        ("B", 1, 1)
    );
    assert!(apply(&v1, &forked, &Event::new(2, "RUN_FORKED", payload)).is_err());
    let bad = fork_snapshot(&at, &v1, &Migrations::new(), Some(&json!([1]))).unwrap_err();
    assert!(bad.to_string().contains("JSON object"), "{bad}");
    let done = apply(&v1, &at, &Event::new(2, "END", json!({}))).unwrap();
    assert_eq!(
        fork_snapshot(&done, &v1, &Migrations::new(), None).unwrap_err(),
        Unmovable::Terminal
    );
}

#[test]
fn a_log_that_moved_replays_across_its_versions() {
    let v1 = def(V1);
    let v2 = v2("\n[migration]\nfrom = 1\nstates = { B = \"C\" }\n");
    let mut migrations = Migrations::new();
    rein_core::migration::declare(&mut migrations, &v2);
    let run = after_go(&v1);
    let planned = plan(&v2, &migrations, &run).unwrap();
    let log = [
        Event::new(1, "GO", json!({})),
        Event::new(2, "DEFINITION_MIGRATED", planned.payload("op", None)),
        Event::new(3, "END", json!({})),
    ];
    assert_eq!(
        rein_core::migration::versions_in_log(2, log.iter()),
        vec![1, 2]
    );
    let def_of = |v: u32| match v {
        1 => Some(&v1),
        2 => Some(&v2),
        _ => None,
    };
    let (end, problems) = rein_core::checkpoint::replay_judging_across(
        &def_of,
        RunState::initial(&v1, json!({"n": 1, "old": true})),
        log.iter(),
        &[],
    )
    .unwrap();
    assert!(problems.is_empty());
    assert_eq!((end.version, end.state.as_str()), (2, "Z"));
    // With one version for the whole log, it does not replay.
    assert!(replay(&v2, RunState::initial(&v2, json!({})), log.iter()).is_err());
}
