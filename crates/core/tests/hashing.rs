//! Stable hashes (SPEC H1, H2, X2, C2): action hashes bind approvals to exactly one action;
//! idempotency keys name one logical action forever.

use proptest::prelude::*;
use rein_core::hash::{ActionIdentity, action_hash, canonical_json, idempotency_key};
use serde_json::{Value, json};

fn parsed(text: &str) -> Value {
    serde_json::from_str(text).expect("test JSON parses")
}

fn refund(args: &Value) -> String {
    action_hash(ActionIdentity {
        tool: "refund",
        args,
        tool_version: Some("1"),
        policy_version: Some("1"),
    })
}

#[test]
fn action_hash_ignores_key_order_and_whitespace() {
    let a = parsed(r#"{"order_id":"o-1","amount":150}"#);
    let b = parsed("{\n  \"amount\" :  150,\n\t\"order_id\": \"o-1\"  }");
    assert_eq!(refund(&a), refund(&b));
}

#[test]
fn action_hash_canonicalises_nested_objects() {
    let a = parsed(r#"{"order":{"id":"o-1","lines":[{"sku":"a","qty":2}]},"amount":150}"#);
    let b = parsed(r#"{"amount":150,"order":{"lines":[{"qty":2,"sku":"a"}],"id":"o-1"}}"#);
    assert_eq!(refund(&a), refund(&b));
}

#[test]
fn action_hash_of_fixed_inputs_is_stable() {
    let args = json!({"order_id": "o-1", "amount": 150});
    assert_eq!(
        refund(&args),
        "a59d01186a166e756110bd13b7c3c0e7e1a832fe1c4aa49344010b898e125d05"
    );
}

#[test]
fn action_hash_changes_with_an_argument_value() {
    let a = json!({"order_id": "o-1", "amount": 150});
    let b = json!({"order_id": "o-1", "amount": 151});
    assert_ne!(refund(&a), refund(&b));
}

#[test]
fn action_hash_changes_with_a_nested_argument_value() {
    let a = json!({"order": {"lines": [{"qty": 2}]}});
    let b = json!({"order": {"lines": [{"qty": 3}]}});
    assert_ne!(refund(&a), refund(&b));
}

#[test]
fn action_hash_changes_with_array_order() {
    let a = json!({"ids": [1, 2]});
    let b = json!({"ids": [2, 1]});
    assert_ne!(refund(&a), refund(&b));
}

#[test]
fn action_hash_changes_with_the_tool() {
    let args = json!({"order_id": "o-1", "amount": 150});
    let other = action_hash(ActionIdentity {
        tool: "charge",
        args: &args,
        tool_version: Some("1"),
        policy_version: Some("1"),
    });
    assert_ne!(refund(&args), other);
}

#[test]
fn action_hash_changes_with_the_tool_version() {
    let args = json!({"order_id": "o-1", "amount": 150});
    for version in [Some("2"), None] {
        let other = action_hash(ActionIdentity {
            tool: "refund",
            args: &args,
            tool_version: version,
            policy_version: Some("1"),
        });
        assert_ne!(refund(&args), other, "tool_version {version:?}");
    }
}

#[test]
fn action_hash_changes_with_the_policy_version() {
    let args = json!({"order_id": "o-1", "amount": 150});
    for version in [Some("2"), None] {
        let other = action_hash(ActionIdentity {
            tool: "refund",
            args: &args,
            tool_version: Some("1"),
            policy_version: version,
        });
        assert_ne!(refund(&args), other, "policy_version {version:?}");
    }
}

#[test]
fn action_hash_does_not_confuse_tool_version_with_policy_version() {
    let args = json!({});
    let tool_only = action_hash(ActionIdentity {
        tool: "refund",
        args: &args,
        tool_version: Some("1"),
        policy_version: None,
    });
    let policy_only = action_hash(ActionIdentity {
        tool: "refund",
        args: &args,
        tool_version: None,
        policy_version: Some("1"),
    });
    assert_ne!(tool_only, policy_only);
}

/// An approval is bound to the hash computed when it was requested; the worker recomputes
/// it from the arguments it reads back from storage (SPEC H1, H2). A float that does not
/// survive that round trip voids the approval.
#[test]
fn action_hash_survives_storing_and_reloading_the_arguments() {
    let args = json!({"order_id": "o-1", "amount": 1823.3521453552403_f64});
    let stored = serde_json::to_string(&args).expect("serialises");
    let reloaded = parsed(&stored);
    assert_eq!(refund(&reloaded), refund(&args));
}

#[test]
fn canonical_json_sorts_keys_and_drops_whitespace() {
    let value = parsed("{ \"b\" : [ 1 , {\"z\":1, \"a\":2} ], \"a\" : \"x y\" }");
    assert_eq!(
        canonical_json(&value),
        r#"{"a":"x y","b":[1,{"a":2,"z":1}]}"#
    );
}

#[test]
fn canonical_json_escapes_keys_and_strings() {
    let value = json!({"quote\"key": "line\nbreak"});
    let canonical = canonical_json(&value);
    assert_eq!(parsed(&canonical), value);
}

#[test]
fn idempotency_key_of_fixed_inputs_is_stable() {
    assert_eq!(
        idempotency_key("run-1", "ACTING", "act-1"),
        "d47df2d6256e4663b87e6ed5481a26f6a8eb1b86f37e7e214a23c4da52ee483b"
    );
}

#[test]
fn idempotency_key_is_the_same_for_the_same_action() {
    assert_eq!(
        idempotency_key("run-1", "ACTING", "act-1"),
        idempotency_key("run-1", "ACTING", "act-1")
    );
}

#[test]
fn idempotency_key_differs_for_each_part() {
    let key = idempotency_key("run-1", "ACTING", "act-1");
    assert_ne!(key, idempotency_key("run-2", "ACTING", "act-1"));
    assert_ne!(key, idempotency_key("run-1", "PLANNING", "act-1"));
    assert_ne!(key, idempotency_key("run-1", "ACTING", "act-2"));
}

#[test]
fn idempotency_key_parts_cannot_run_into_each_other() {
    assert_ne!(
        idempotency_key("ab", "c", "x"),
        idempotency_key("a", "bc", "x")
    );
    assert_ne!(
        idempotency_key("r", "ab", "c"),
        idempotency_key("r", "a", "bc")
    );
    assert_ne!(
        idempotency_key("r", "", "ab"),
        idempotency_key("r", "ab", "")
    );
}

#[test]
fn idempotency_key_is_lowercase_sha256_hex() {
    let key = idempotency_key("run-1", "ACTING", "act-1");
    assert_eq!(key.len(), 64);
    assert!(
        key.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')),
        "{key}"
    );
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn canonical_json_is_a_fixed_point_of_parsing(value in json_value()) {
        let canonical = canonical_json(&value);
        let reparsed: Value = serde_json::from_str(&canonical).expect("canonical JSON parses");
        prop_assert_eq!(canonical_json(&reparsed), canonical);
    }

    #[test]
    fn canonical_json_ignores_pretty_printing(value in json_value()) {
        let pretty = serde_json::to_string_pretty(&value).expect("serialises");
        let reparsed: Value = serde_json::from_str(&pretty).expect("pretty JSON parses");
        prop_assert_eq!(canonical_json(&reparsed), canonical_json(&value));
    }
}
