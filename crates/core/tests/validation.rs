//! Definition loading and validation (SPEC M1, M5, M8, M9, Z2): every rejection names the
//! offending item and says why.

use rein_core::definition::DefinitionSpec;
use rein_core::limits::DEFINITION_BYTES_MAX;
use rein_core::{
    Definition, DefinitionError, Event, Format, GuardKind, GuardRegistry, RejectReason, RunState,
    apply,
};
use serde_json::json;

/// The smallest valid definition: start -go-> work -finish-> done, CANCEL -> cancelled.
const BASE: &str = r#"
name = "mini"
version = 1
cancel_state = "cancelled"
events = ["go", "finish"]

[[states]]
name = "start"
kind = "active"
initial = true

[[states]]
name = "work"
kind = "active"

[[states]]
name = "done"
kind = "terminal"

[[states]]
name = "cancelled"
kind = "terminal"

[[transitions]]
from = "start"
event = "go"
to = "work"

[[transitions]]
from = "work"
event = "finish"
to = "done"
"#;

/// BASE with `extra` TOML appended (more states or transitions).
fn with(extra: &str) -> String {
    format!("{BASE}\n{extra}")
}

/// BASE with `from` replaced by `to`; `from` must occur, or the fixture would silently be
/// the valid BASE.
fn replaced(from: &str, to: &str) -> String {
    assert!(BASE.contains(from), "fixture does not contain {from:?}");
    BASE.replace(from, to)
}

fn parse(text: &str) -> Result<Definition, DefinitionError> {
    Definition::parse(text, Format::Toml, &GuardRegistry::new())
}

fn invalid(text: &str) -> DefinitionError {
    match parse(text) {
        Ok(def) => panic!("{def:?} should have been rejected"),
        Err(e) => e,
    }
}

#[track_caller]
fn assert_problem(err: &DefinitionError, item: &str, reason: &str) {
    let problems = err.problems();
    assert!(
        problems
            .iter()
            .any(|p| p.item.contains(item) && p.reason.contains(reason)),
        "no problem with item containing {item:?} and reason containing {reason:?} in:\n{err}"
    );
}

#[test]
fn base_fixture_is_valid() {
    let def = parse(BASE).expect("BASE is valid");
    assert_eq!(def.name(), "mini");
    assert_eq!(def.initial_state(), "start");
    assert_eq!(def.cancel_state(), "cancelled");
}

#[test]
fn definition_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Definition>();
}

#[test]
fn builtin_definitions_are_valid() {
    for (name, text) in rein_core::builtin::ALL {
        if let Err(e) = parse(text) {
            panic!("{name}: {e}");
        }
    }
}

#[test]
fn transition_from_an_unknown_state_is_rejected() {
    let err = invalid(&with(
        "[[transitions]]\nfrom = \"nowhere\"\nevent = \"go\"\nto = \"work\"\n",
    ));
    assert_problem(
        &err,
        "nowhere + go -> work",
        "unknown state `nowhere` in `from`",
    );
}

#[test]
fn transition_to_an_unknown_state_is_rejected() {
    let err = invalid(&with(
        "[[transitions]]\nfrom = \"work\"\nevent = \"go\"\nto = \"limbo\"\n",
    ));
    assert_problem(&err, "work + go -> limbo", "unknown state `limbo` in `to`");
}

#[test]
fn transition_on_an_undeclared_event_is_rejected() {
    let err = invalid(&with(
        "[[transitions]]\nfrom = \"work\"\nevent = \"jump\"\nto = \"done\"\n",
    ));
    assert_problem(&err, "work + jump -> done", "unknown event `jump`");
}

#[test]
fn unreachable_state_is_rejected() {
    let err = invalid(&with("[[states]]\nname = \"island\"\nkind = \"active\"\n"));
    assert_problem(&err, "island", "unreachable state");
}

#[test]
fn state_reachable_only_from_an_unreachable_state_is_rejected() {
    let err = invalid(&with(
        "[[states]]\nname = \"island\"\nkind = \"active\"\n\
         [[states]]\nname = \"beach\"\nkind = \"active\"\n\
         [[transitions]]\nfrom = \"island\"\nevent = \"go\"\nto = \"beach\"\n",
    ));
    assert_problem(&err, "beach", "unreachable state");
}

#[test]
fn terminal_state_with_an_outgoing_transition_is_rejected() {
    let err = invalid(&with(
        "[[transitions]]\nfrom = \"done\"\nevent = \"go\"\nto = \"work\"\n",
    ));
    assert_problem(
        &err,
        "done + go -> work",
        "terminal state `done` cannot have outgoing transitions",
    );
}

#[test]
fn two_transitions_for_one_pair_without_priority_are_ambiguous() {
    let err = invalid(&with(
        "[[transitions]]\nfrom = \"work\"\nevent = \"finish\"\nto = \"start\"\n",
    ));
    assert_problem(&err, "work + finish", "ambiguous");
}

#[test]
fn exact_duplicate_transition_is_rejected() {
    let err = invalid(&with(
        "[[transitions]]\nfrom = \"work\"\nevent = \"finish\"\nto = \"done\"\n",
    ));
    assert_problem(
        &err,
        "transitions[2] (work + finish -> done)",
        "duplicate of transitions[1]",
    );
}

#[test]
fn transition_behind_a_stronger_unguarded_one_is_rejected() {
    let err = invalid(&with(
        "[[transitions]]\nfrom = \"work\"\nevent = \"finish\"\nto = \"start\"\npriority = -1\n",
    ));
    assert_problem(&err, "work + finish -> start", "unreachable");
}

#[test]
fn transitions_separated_by_priority_and_guard_are_accepted() {
    let text = with(
        "[[transitions]]\nfrom = \"work\"\nevent = \"finish\"\nto = \"cancelled\"\n\
         priority = 1\nguard = \"payload.abort == true\"\n",
    );
    let def = parse(&text).expect("a guarded, stronger transition is not ambiguous");
    let mut run = RunState::initial(&def, json!({}));
    run.state = "work".into();
    let abort = apply(&def, &run, &Event::new(1, "finish", json!({"abort": true}))).unwrap();
    assert_eq!(abort.state, "cancelled");
    let normal = apply(
        &def,
        &run,
        &Event::new(1, "finish", json!({"abort": false})),
    )
    .unwrap();
    assert_eq!(normal.state, "done");
}

#[test]
fn missing_initial_state_is_rejected() {
    let err = invalid(&replaced("initial = true", "initial = false"));
    assert_problem(&err, "states", "missing initial state");
}

#[test]
fn two_initial_states_are_rejected() {
    let err = invalid(&replaced(
        "name = \"work\"\nkind = \"active\"",
        "name = \"work\"\nkind = \"active\"\ninitial = true",
    ));
    assert_problem(&err, "states", "duplicate initial state");
    assert_problem(&err, "states", "start, work");
}

#[test]
fn timeout_whose_event_is_not_accepted_in_its_state_is_rejected() {
    let err = invalid(&replaced(
        "name = \"work\"\nkind = \"active\"",
        "name = \"work\"\nkind = \"active\"\ntimeout = { after_ms = 1000, event = \"go\" }",
    ));
    assert_problem(
        &err,
        "(work).timeout",
        "timeout event `go` does not leave state `work`",
    );
}

#[test]
fn timeout_whose_event_is_a_self_loop_is_rejected() {
    let text = replaced(
        "name = \"work\"\nkind = \"active\"",
        "name = \"work\"\nkind = \"active\"\ntimeout = { after_ms = 1000, event = \"go\" }",
    ) + "\n[[transitions]]\nfrom = \"work\"\nevent = \"go\"\nto = \"work\"\n";
    let err = invalid(&text);
    assert_problem(&err, "(work).timeout", "does not leave state `work`");
}

#[test]
fn timeout_whose_event_leaves_its_state_is_accepted() {
    let text = replaced(
        "name = \"work\"\nkind = \"active\"",
        "name = \"work\"\nkind = \"active\"\ntimeout = { after_ms = 1000, event = \"finish\" }",
    );
    parse(&text).expect("finish leaves work");
}

#[test]
fn a_terminal_state_declares_whether_its_runs_succeeded_or_failed() {
    use rein_core::definition::TerminalOutcome;
    let text = replaced(
        "name = \"done\"\nkind = \"terminal\"\n",
        "name = \"done\"\nkind = \"terminal\"\noutcome = \"succeeded\"\n",
    )
    .replace(
        "name = \"cancelled\"\nkind = \"terminal\"\n",
        "name = \"cancelled\"\nkind = \"terminal\"\noutcome = \"failed\"\n",
    );
    let def = parse(&text).expect("valid");
    let outcome = |state: &str| def.state(state).and_then(|s| s.outcome);
    assert_eq!(outcome("done"), Some(TerminalOutcome::Succeeded));
    assert_eq!(outcome("cancelled"), Some(TerminalOutcome::Failed));
    // Without the field (definitions written before it existed) it is simply absent.
    assert_eq!(parse(BASE).unwrap().state("done").unwrap().outcome, None);
    // Only the two outcomes exist.
    let err = parse(&replaced(
        "name = \"done\"\nkind = \"terminal\"\n",
        "name = \"done\"\nkind = \"terminal\"\noutcome = \"cancelled\"\n",
    ))
    .expect_err("cancelled is not a state's outcome");
    assert!(err.to_string().contains("succeeded"), "{err}");
}

#[test]
fn an_outcome_on_a_state_that_is_not_terminal_is_rejected() {
    let err = invalid(&replaced(
        "name = \"work\"\nkind = \"active\"\n",
        "name = \"work\"\nkind = \"active\"\noutcome = \"failed\"\n",
    ));
    assert_problem(&err, "states[1] (work).outcome", "only a terminal state");
}

#[test]
fn every_terminal_state_of_the_built_ins_declares_its_outcome() {
    use rein_core::definition::TerminalOutcome;
    for (name, _) in rein_core::builtin::ALL {
        let def = rein_core::builtin::load(name).unwrap().unwrap();
        for state in def.states().filter(|s| def.is_terminal(&s.name)) {
            assert!(
                state.outcome.is_some(),
                "{name}: {} has no outcome",
                state.name
            );
        }
    }
    let lifecycle = rein_core::builtin::lifecycle();
    // lifecycle's cancel state is where its failures end too: they are failures.
    assert_eq!(lifecycle.cancel_state(), "failed");
    assert_eq!(
        lifecycle.state("failed").unwrap().outcome,
        Some(TerminalOutcome::Failed)
    );
    assert_eq!(
        lifecycle.state("done").unwrap().outcome,
        Some(TerminalOutcome::Succeeded)
    );
}

#[test]
fn missing_cancel_state_is_rejected() {
    let err = invalid(&replaced("cancel_state = \"cancelled\"\n", ""));
    assert_problem(&err, "cancel_state", "missing cancel state");
}

#[test]
fn cancel_state_that_is_not_terminal_is_rejected() {
    let err = invalid(&replaced(
        "cancel_state = \"cancelled\"",
        "cancel_state = \"work\"",
    ));
    assert_problem(&err, "cancel_state", "`work` must be a terminal state");
}

#[test]
fn cancel_state_that_is_not_declared_is_rejected() {
    let err = invalid(&replaced(
        "cancel_state = \"cancelled\"",
        "cancel_state = \"gone\"",
    ));
    assert_problem(&err, "cancel_state", "unknown state `gone`");
}

#[test]
fn guard_expression_that_does_not_parse_is_rejected() {
    let err = invalid(&replaced(
        "event = \"finish\"\nto = \"done\"",
        "event = \"finish\"\nto = \"done\"\nguard = \"run.attempt < \"",
    ));
    assert_problem(&err, "(work + finish -> done).guards[0]", "does not parse");
}

#[test]
fn unknown_guard_function_is_rejected() {
    let err = invalid(&replaced(
        "event = \"finish\"\nto = \"done\"",
        "event = \"finish\"\nto = \"done\"\nguards = [{ function = \"nope\" }]",
    ));
    assert_problem(
        &err,
        "(work + finish -> done).guards[0]",
        "unknown guard function `nope`",
    );
}

#[test]
fn definition_name_with_illegal_characters_is_rejected() {
    let err = invalid(&replaced("name = \"mini\"", "name = \"mini agent!\""));
    assert_problem(&err, "name", "`mini agent!` may use only letters, digits");
}

#[test]
fn state_name_with_illegal_characters_is_rejected() {
    let err = invalid(&BASE.replace("\"work\"", "\"wo/rk\""));
    assert_problem(&err, "(wo/rk)", "may use only letters, digits");
}

#[test]
fn event_name_with_illegal_characters_is_rejected() {
    let err = invalid(&BASE.replace("\"finish\"", "\"fin ish\""));
    assert_problem(&err, "events[1] (fin ish)", "may use only letters, digits");
}

#[test]
fn a_version_the_database_cannot_store_is_rejected() {
    use rein_core::limits::VERSION_MAX;
    for bad in [0, u64::from(VERSION_MAX) + 1] {
        let err = invalid(&replaced("version = 1", &format!("version = {bad}")));
        assert_problem(&err, "version", &format!("must be 1..={VERSION_MAX}"));
    }
    let top = parse(&replaced(
        "version = 1",
        &format!("version = {VERSION_MAX}"),
    ))
    .expect("the highest version is valid");
    assert_eq!(top.version(), VERSION_MAX);
}

#[test]
fn the_name_rule_takes_letters_digits_and_three_marks_up_to_the_limit() {
    for ok in [
        "a",
        "Mini_agent-2.0",
        &"x".repeat(rein_core::limits::NAME_LEN_MAX),
    ] {
        assert_eq!(rein_core::name_problem(ok), None, "{ok}");
    }
    for bad in [
        "",
        "a b",
        "ä",
        "a/b",
        "a\n",
        &"x".repeat(rein_core::limits::NAME_LEN_MAX + 1),
    ] {
        assert!(rein_core::name_problem(bad).is_some(), "{bad:?}");
    }
}

#[test]
fn declaring_an_engine_event_is_rejected() {
    let err = invalid(&replaced(
        "events = [\"go\", \"finish\"]",
        "events = [\"go\", \"finish\", \"CANCEL\"]",
    ));
    assert_problem(&err, "events[2] (CANCEL)", "engine event");
}

#[test]
fn document_that_does_not_parse_is_a_parse_error() {
    let err = parse("name = \"mini\"\nversion = [").expect_err("broken TOML");
    assert!(matches!(err, DefinitionError::Parse(_)), "{err:?}");
    assert_problem(&err, "document", "does not parse");
}

#[test]
fn misspelled_field_is_a_parse_error_naming_it() {
    let err = parse(&replaced("kind = \"terminal\"", "knid = \"terminal\"")).expect_err("typo");
    assert!(matches!(err, DefinitionError::Parse(_)), "{err:?}");
    assert_problem(&err, "document", "knid");
}

#[test]
fn oversize_document_is_too_large() {
    let padding = format!("# {}\n", "x".repeat(DEFINITION_BYTES_MAX));
    let text = format!("{BASE}{padding}");
    let err = parse(&text).expect_err("over the limit");
    assert_eq!(
        err,
        DefinitionError::TooLarge {
            size: text.len(),
            limit: DEFINITION_BYTES_MAX
        }
    );
}

#[test]
fn every_problem_of_a_document_is_reported() {
    let text = replaced(
        "events = [\"go\", \"finish\"]",
        "events = [\"go\", \"finish\", \"LEASE_EXPIRED\"]",
    ) + "\n[[states]]\nname = \"island\"\nkind = \"active\"\n\
           [[transitions]]\nfrom = \"work\"\nevent = \"jump\"\nto = \"done\"\n";
    let err = invalid(&text);
    assert_problem(&err, "events[2] (LEASE_EXPIRED)", "engine event");
    assert_problem(&err, "island", "unreachable state");
    assert_problem(&err, "work + jump -> done", "unknown event `jump`");
    assert_eq!(err.problems().len(), 3, "{err}");
}

#[test]
fn spec_built_in_rust_is_validated_like_a_file() {
    let mut spec: DefinitionSpec = parse(BASE).expect("BASE is valid").spec().clone();
    let mut bad = spec.transitions[1].clone();
    bad.to = "limbo".into();
    spec.transitions.push(bad);
    let err = Definition::from_spec(spec, &GuardRegistry::new()).expect_err("unknown target");
    assert_problem(
        &err,
        "work + finish -> limbo",
        "unknown state `limbo` in `to`",
    );
}

const BASE_JSON: &str = r#"{
  "name": "mini", "version": 1, "cancel_state": "cancelled", "events": ["go", "finish"],
  "states": [
    {"name": "start", "kind": "active", "initial": true},
    {"name": "work", "kind": "active"},
    {"name": "done", "kind": "terminal"},
    {"name": "cancelled", "kind": "terminal"}
  ],
  "transitions": [
    {"from": "start", "event": "go", "to": "work"},
    {"from": "work", "event": "finish", "to": "done"}
  ]
}"#;

#[test]
fn json_definition_loads_and_runs() {
    let def =
        Definition::parse(BASE_JSON, Format::Json, &GuardRegistry::new()).expect("valid JSON");
    let run = RunState::initial(&def, json!({}));
    let run = apply(&def, &run, &Event::new(1, "go", json!({}))).unwrap();
    let run = apply(&def, &run, &Event::new(2, "finish", json!({}))).unwrap();
    assert_eq!(run.state, "done");
}

#[test]
fn json_and_toml_of_the_same_definition_hash_the_same() {
    let from_json = Definition::parse(BASE_JSON, Format::Json, &GuardRegistry::new()).unwrap();
    let from_toml = parse(BASE).unwrap();
    assert_eq!(from_json.hash(), from_toml.hash());
    let other = parse(&replaced("version = 1", "version = 2")).unwrap();
    assert_ne!(other.hash(), from_toml.hash());
}

#[test]
fn invalid_json_definition_reports_its_problems() {
    let text = BASE_JSON.replace("\"to\": \"done\"", "\"to\": \"limbo\"");
    let err = Definition::parse(&text, Format::Json, &GuardRegistry::new()).expect_err("limbo");
    assert_problem(
        &err,
        "work + finish -> limbo",
        "unknown state `limbo` in `to`",
    );
}

#[test]
fn format_is_picked_from_the_file_extension() {
    assert_eq!(Format::from_path("defs/agent.JSON"), Format::Json);
    assert_eq!(Format::from_path("defs/agent.toml"), Format::Toml);
}

#[test]
fn registered_rust_guard_decides_the_transition() {
    let mut guards = GuardRegistry::new();
    guards.register("small_amount", |input| {
        input
            .payload
            .get("amount")
            .and_then(|a| a.as_f64())
            .is_some_and(|a| a <= 100.0)
    });
    let text = replaced(
        "event = \"finish\"\nto = \"done\"",
        "event = \"finish\"\nto = \"done\"\n\
         guards = [{ kind = \"safety\", function = \"small_amount\" }]",
    );
    let def = Definition::parse(&text, Format::Toml, &guards).expect("guard is registered");
    let mut run = RunState::initial(&def, json!({}));
    run.state = "work".into();

    let ok = apply(&def, &run, &Event::new(1, "finish", json!({"amount": 40}))).unwrap();
    assert_eq!(ok.state, "done");

    let err = apply(&def, &run, &Event::new(1, "finish", json!({"amount": 400}))).unwrap_err();
    assert_eq!(
        err.reason,
        RejectReason::GuardFailed {
            kind: GuardKind::Safety,
            guard: "small_amount".into()
        }
    );
}

#[test]
fn guards_run_legality_before_safety_before_business() {
    let text = replaced(
        "event = \"finish\"\nto = \"done\"",
        "event = \"finish\"\nto = \"done\"\nguards = [\
         { kind = \"business\", name = \"b\", expr = \"false\" },\
         { kind = \"safety\", name = \"s\", expr = \"false\" },\
         { kind = \"legality\", name = \"l\", expr = \"false\" }]",
    );
    let def = parse(&text).unwrap();
    let mut run = RunState::initial(&def, json!({}));
    run.state = "work".into();
    let err = apply(&def, &run, &Event::new(1, "finish", json!({}))).unwrap_err();
    assert_eq!(
        err.reason,
        RejectReason::GuardFailed {
            kind: GuardKind::Legality,
            guard: "l".into()
        }
    );
    // With legality passing, safety is judged before business, whatever the listed order.
    let text = replaced(
        "event = \"finish\"\nto = \"done\"",
        "event = \"finish\"\nto = \"done\"\nguards = [\
         { kind = \"business\", name = \"b\", expr = \"false\" },\
         { kind = \"safety\", name = \"s\", expr = \"false\" },\
         { kind = \"legality\", name = \"l\", expr = \"true\" }]",
    );
    let def = parse(&text).unwrap();
    let err = apply(&def, &run, &Event::new(1, "finish", json!({}))).unwrap_err();
    assert_eq!(
        err.reason,
        RejectReason::GuardFailed {
            kind: GuardKind::Safety,
            guard: "s".into()
        }
    );
}

#[test]
fn guard_that_does_not_evaluate_to_a_boolean_fails_closed() {
    let text = replaced(
        "event = \"finish\"\nto = \"done\"",
        "event = \"finish\"\nto = \"done\"\nguard = \"payload.missing.deeper > 1\"",
    );
    let def = parse(&text).unwrap();
    let mut run = RunState::initial(&def, json!({}));
    run.state = "work".into();
    let err = apply(&def, &run, &Event::new(1, "finish", json!({}))).unwrap_err();
    assert!(
        matches!(err.reason, RejectReason::GuardError { .. }),
        "{err}"
    );
}

#[test]
fn a_json_definition_is_an_object_not_an_array_of_its_fields() {
    let object = serde_json::to_string(parse(BASE).expect("the base fixture").spec()).unwrap();
    assert!(Definition::parse(&object, Format::Json, &GuardRegistry::new()).is_ok());
    for text in [r#"["mini", 1]"#, "  \n[]", "null", r#""mini""#] {
        match Definition::parse(text, Format::Json, &GuardRegistry::new()) {
            Err(DefinitionError::Parse(reason)) => {
                assert!(reason.contains("is an object"), "{text}: {reason}")
            }
            other => panic!("{text}: {other:?}"),
        }
    }
    assert!(rein_core::json_text_is_object(b" \t\r\n{}"));
    assert!(!rein_core::json_text_is_object(b""));
}

/// A `model` state whose model call's transient failures have `transient` as their event
/// (none when `None`), with a retry wait and a fatal path.
fn model_state(transient: Option<&str>) -> String {
    let transient = transient
        .map(|e| format!("transient_event = \"{e}\"\n"))
        .unwrap_or_default();
    format!(
        r#"
name = "asker"
version = 1
cancel_state = "CANCELLED"
events = ["FINISH", "MODEL_RETRYABLE_FAILED", "MODEL_FATAL_FAILED", "RETRY_DUE", "RETRY_EXHAUSTED"]

[[states]]
name = "ASK"
kind = "active"
initial = true
action = "model"
decisions = ["FINISH"]

[states.model]
model = "gpt-test"
{transient}fatal_event = "MODEL_FATAL_FAILED"

[[states]]
name = "RETRY_WAIT"
kind = "waiting"
backoff = {{ due = "RETRY_DUE", exhausted = "RETRY_EXHAUSTED" }}

[[states]]
name = "DONE"
kind = "terminal"

[[states]]
name = "FAILED"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "ASK"
event = "FINISH"
to = "DONE"

[[transitions]]
from = "ASK"
event = "MODEL_RETRYABLE_FAILED"
to = "RETRY_WAIT"
effects = ["increment_attempt"]

[[transitions]]
from = "ASK"
event = "MODEL_FATAL_FAILED"
to = "FAILED"

[[transitions]]
from = "RETRY_WAIT"
event = "RETRY_DUE"
to = "ASK"

[[transitions]]
from = "RETRY_WAIT"
event = "RETRY_EXHAUSTED"
to = "FAILED"
"#
    )
}

fn stored(text: &str) -> Result<Definition, DefinitionError> {
    let spec: DefinitionSpec = toml::from_str(text).expect("parses");
    Definition::from_stored_spec(spec, &GuardRegistry::new())
}

#[test]
fn a_model_state_whose_transient_failures_have_no_event_is_refused_at_registration() {
    parse(&model_state(Some("MODEL_RETRYABLE_FAILED"))).expect("with a transient path");
    let text = model_state(None);
    let err = invalid(&text);
    assert_problem(
        &err,
        "states[0] (ASK).model.transient_event",
        "a transient failure of its model call",
    );
    let said = err.to_string();
    for part in [
        "state `ASK`",
        "the definition has none",
        "add `transient_event = ",
        "to [states.model]",
        "a transition from `ASK` on it",
    ] {
        assert!(said.contains(part), "{part:?} missing from: {said}");
    }
    // Built in Rust rather than parsed, it is refused the same way.
    let spec: DefinitionSpec = toml::from_str(&text).expect("parses");
    let err = Definition::from_spec(spec, &GuardRegistry::new()).expect_err("refused");
    assert_problem(&err, "model.transient_event", "the definition has none");
}

#[test]
fn a_stored_model_state_without_a_transient_event_keeps_loading() {
    let def = stored(&model_state(None)).expect("stored definitions keep loading");
    let ask = def.state("ASK").expect("state");
    assert_eq!(
        ask.model
            .as_ref()
            .and_then(|m| m.transient_event.as_deref()),
        None
    );
}

#[test]
fn a_model_state_whose_transient_event_has_no_transition_is_refused_even_when_stored() {
    // Declared but with no transition from the state on it: no path, whichever the rules.
    let text = model_state(Some("RETRY_DUE"));
    let err = invalid(&text);
    assert_problem(
        &err,
        "states[0] (ASK).model.transient_event",
        "event `RETRY_DUE` does not leave state `ASK`",
    );
    assert!(stored(&text).is_err());
}

#[test]
fn an_http_state_always_has_a_transient_path() {
    // `transient_event` is a required field of the `http` table ...
    let missing = with(
        r#"
[[states]]
name = "CALL"
kind = "active"
action = "http"
http = { url = "https://nodes.example.com/x", fatal_event = "finish" }
"#,
    );
    assert!(
        parse(&missing)
            .unwrap_err()
            .to_string()
            .contains("transient_event"),
    );
    // ... and must leave the state, for stored definitions too.
    let nowhere = replaced(
        "name = \"work\"\nkind = \"active\"\n",
        "name = \"work\"\nkind = \"active\"\naction = \"http\"\nhttp = { url = \"https://nodes.example.com/x\", transient_event = \"go\", fatal_event = \"finish\" }\n",
    );
    assert_problem(
        &invalid(&nowhere),
        "states[1] (work).http.transient_event",
        "event `go` does not leave state `work`",
    );
    assert!(stored(&nowhere).is_err());
}

#[test]
fn every_built_in_model_state_has_a_transient_path() {
    let mut models = 0;
    for (name, text) in rein_core::builtin::ALL {
        let def = parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        for state in def.states() {
            if let Some(model) = &state.model {
                models += 1;
                assert!(model.transient_event.is_some(), "{name}: {}", state.name);
            }
        }
    }
    assert!(models > 0, "a built-in asks a model");
}
