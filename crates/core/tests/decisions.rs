//! Model decisions are validated step by step (SPEC D1, D2, X6, H2): each failing step is
//! named, and what passes is only a proposal — a tool call or an event the reducer judges.

use rein_core::decision::{CALL_TOOL, Step, Valid, validate};
use rein_core::{Definition, Format, GuardRegistry, RunState};
use serde_json::{Value, json};

fn refund_agent() -> Definition {
    rein_core::builtin::refund_agent()
}

fn run(def: &Definition, data: Value) -> RunState {
    RunState::initial(def, data)
}

fn rejected_at(def: &Definition, state: &RunState, decision: Value) -> (Step, String) {
    match validate(def, state, &decision) {
        Err(r) => (r.step, r.reason),
        Ok(v) => panic!("{decision} was accepted: {v:?}"),
    }
}

#[test]
fn each_step_names_what_failed() {
    let def = refund_agent();
    let state = run(&def, json!({}));
    let cases = [
        (json!("refund please"), Step::Parse, "JSON object"),
        (json!({ "tool": "refund" }), Step::Parse, "`decision`"),
        (
            json!({ "decision": CALL_TOOL, "tool": "refund", "args": [1] }),
            Step::Parse,
            "`args`",
        ),
        (
            json!({ "decision": "FINISH", "confidence": 0.9 }),
            Step::Parse,
            "unknown field `confidence`",
        ),
        (
            json!({ "decision": CALL_TOOL, "tool": "refund",
                    "args": { "order_id": "A\u{0}1", "amount": 5 } }),
            Step::Parse,
            "NUL character (\\u0000) at $.args.order_id",
        ),
        (
            json!({ "decision": "TOOL_SUCCEEDED" }),
            Step::Decision,
            "not a decision state `ACTING` allows",
        ),
        (
            json!({ "decision": "SHIP_IT" }),
            Step::Decision,
            "not a decision",
        ),
        (
            json!({ "decision": CALL_TOOL, "tool": "wire_money", "args": {} }),
            Step::Tool,
            "offers no tool `wire_money`",
        ),
        (
            json!({ "decision": CALL_TOOL, "args": {} }),
            Step::Tool,
            "needs `tool`",
        ),
        (
            json!({ "decision": "FINISH", "tool": "refund" }),
            Step::Tool,
            "only `call_tool`",
        ),
        (
            json!({ "decision": CALL_TOOL, "tool": "refund", "args": { "order_id": "A1" } }),
            Step::Schema,
            "amount",
        ),
        (
            json!({ "decision": CALL_TOOL, "tool": "refund",
                    "args": { "order_id": "A1", "amount": -5 } }),
            Step::Schema,
            "/amount",
        ),
        (
            json!({ "decision": CALL_TOOL, "tool": "lookup_order",
                    "args": { "order_id": "A1", "extra": true } }),
            Step::Schema,
            "extra",
        ),
    ];
    for (decision, step, says) in cases {
        let (got, reason) = rejected_at(&def, &state, decision.clone());
        assert_eq!(got, step, "{decision}: {reason}");
        assert!(
            reason.contains(says),
            "{decision}: `{reason}` lacks `{says}`"
        );
    }
}

#[test]
fn a_valid_call_carries_its_approval_need_and_the_hash_of_the_exact_action() {
    let def = refund_agent();
    let state = run(&def, json!({}));
    let call = |amount: f64| match validate(
        &def,
        &state,
        &json!({ "decision": CALL_TOOL, "tool": "refund",
                 "args": { "order_id": "A1", "amount": amount } }),
    ) {
        Ok(Valid::Call(c)) => c,
        other => panic!("{other:?}"),
    };
    let small = call(50.0);
    assert!(!small.needs_approval, "50 is under the 100 threshold");
    assert!(small.side_effect);
    let big = call(150.0);
    assert!(big.needs_approval, "args.amount > 100");
    assert_eq!(big.approval_event, "APPROVAL_REQUIRED");
    assert_eq!(big.approval_expires_after_ms, Some(3_600_000));
    assert_eq!(big.timeout_ms, Some(2000));
    let huge = call(10_000.0);
    assert_ne!(
        big.action_hash, huge.action_hash,
        "a different amount is a different action"
    );
    assert_eq!(
        big.action_hash,
        call(150.0).action_hash,
        "same call, same hash"
    );
    // Key order does not change the action.
    let reordered = match validate(
        &def,
        &state,
        &json!({ "args": { "amount": 150.0, "order_id": "A1" }, "tool": "refund",
                 "decision": CALL_TOOL }),
    ) {
        Ok(Valid::Call(c)) => c,
        other => panic!("{other:?}"),
    };
    assert_eq!(reordered.action_hash, big.action_hash);
}

#[test]
fn an_event_decision_is_only_a_proposal() {
    let def = refund_agent();
    let state = run(&def, json!({}));
    match validate(
        &def,
        &state,
        &json!({ "decision": "FINISH", "payload": { "data": { "note": "done" } } }),
    ) {
        Ok(Valid::Event { kind, payload }) => {
            assert_eq!(kind, "FINISH");
            assert_eq!(payload["data"]["note"], "done");
        }
        other => panic!("{other:?}"),
    }
    // Validation moved nothing: the run is where it was.
    assert_eq!(state.state, "ACTING");
}

const GUARDED: &str = r#"
name = "guarded"
version = 1
cancel_state = "cancelled"
events = ["DONE", "APPROVAL_REQUIRED", "OK"]
call_results = []

[[states]]
name = "work"
kind = "active"
initial = true
action = "agent"

[[states.tools]]
name = "payout"
side_effect = true
retryable = false
permission = "payments:write"
approval = "always"

[[states.tools]]
name = "notify"
side_effect = true
retryable = false

[[states]]
name = "wait"
kind = "waiting"
approval = { expires_after_ms = 1000, expiry_event = "DONE", policy_version = "7" }

[[states]]
name = "end"
kind = "terminal"

[[states]]
name = "cancelled"
kind = "terminal"

[[transitions]]
from = "work"
event = "OK"
to = "end"

[[transitions]]
from = "work"
event = "APPROVAL_REQUIRED"
to = "wait"

[[transitions]]
from = "wait"
event = "DONE"
to = "end"
"#;

#[test]
fn permissions_and_idempotency_are_checked_last_and_named() {
    let def = Definition::parse(GUARDED, Format::Toml, &GuardRegistry::new()).expect("valid");
    let payout = json!({ "decision": CALL_TOOL, "tool": "payout", "args": {} });
    let without = run(&def, json!({}));
    let (step, reason) = rejected_at(&def, &without, payout.clone());
    assert_eq!(step, Step::Permission, "{reason}");
    assert!(reason.contains("payments:write"), "{reason}");
    let with = run(&def, json!({ "permissions": ["payments:write"] }));
    match validate(&def, &with, &payout) {
        Ok(Valid::Call(c)) => {
            assert!(c.needs_approval, "approval = always");
            assert_eq!(c.approval_expires_after_ms, Some(1000));
        }
        other => panic!("{other:?}"),
    }

    // A side-effect tool without an idempotency key is never repeated automatically.
    let notify = json!({ "decision": CALL_TOOL, "tool": "notify", "args": {} });
    assert!(
        validate(&def, &with, &notify).is_ok(),
        "a first try is fine"
    );
    let mut retry = with.clone();
    retry.attempt = 1;
    let (step, reason) = rejected_at(&def, &retry, notify);
    assert_eq!(step, Step::Idempotency, "{reason}");
}

#[test]
fn the_approval_policy_version_is_part_of_the_action() {
    let def = Definition::parse(GUARDED, Format::Toml, &GuardRegistry::new()).expect("valid");
    let bumped_text = GUARDED
        .replace("version = 1", "version = 2")
        .replace("policy_version = \"7\"", "policy_version = \"8\"");
    let bumped = Definition::parse(&bumped_text, Format::Toml, &GuardRegistry::new()).unwrap();
    let decision = json!({ "decision": CALL_TOOL, "tool": "payout", "args": {} });
    let hash = |d: &Definition| match validate(
        d,
        &run(d, json!({ "permissions": ["payments:write"] })),
        &decision,
    ) {
        Ok(Valid::Call(c)) => c.action_hash,
        other => panic!("{other:?}"),
    };
    assert_ne!(
        hash(&def),
        hash(&bumped),
        "a grant under policy 7 does not cover policy 8"
    );
}

#[test]
fn definitions_refuse_retried_side_effects_without_a_key_and_bad_decision_lists() {
    let bad = GUARDED
        .replace(
            "name = \"notify\"\nside_effect = true\nretryable = false",
            "name = \"notify\"\nside_effect = true\nretryable = true",
        )
        .replace(
            "action = \"agent\"\n",
            "action = \"agent\"\ndecisions = [\"call_tool\", \"NOPE\"]\non_rejected_decision = \"DONE\"\n",
        );
    let err = Definition::parse(&bad, Format::Toml, &GuardRegistry::new())
        .expect_err("invalid")
        .to_string();
    assert!(err.contains("requires_idempotency_key"), "{err}");
    assert!(err.contains("decisions[1] (NOPE)"), "{err}");
    assert!(err.contains("on_rejected_decision"), "{err}");

    let bad_schema = GUARDED.replace(
        "permission = \"payments:write\"",
        "permission = \"payments:write\"\nschema = { type = \"no-such-type\" }",
    );
    let err = Definition::parse(&bad_schema, Format::Toml, &GuardRegistry::new())
        .expect_err("invalid schema")
        .to_string();
    assert!(err.contains("not a valid JSON Schema"), "{err}");
}
