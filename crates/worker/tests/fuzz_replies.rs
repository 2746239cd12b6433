//! Fuzzed http node replies (SPEC I2, Z2): any bytes a node answers with, and any JSON shaped
//! like a reply or a reconcile answer, parse to events, a decision, or an error that says
//! what is wrong — never a panic. `PROPTEST_CASES=20000` runs them longer.

use proptest::prelude::*;
use rein_worker::http::{Reply, parse_reconcile_reply, parse_reply};
use serde_json::{Value, json};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(256),
        ..ProptestConfig::default()
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        "\\PC{0,12}".prop_map(Value::String),
        Just(json!("a\u{0}b")),
        prop_oneof![
            Just("TOOL_SUCCEEDED"),
            Just("CANCEL"),
            Just("call_tool"),
            Just("")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(4, 40, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("events".to_owned()),
                    Just("decision".to_owned()),
                    Just("type".to_owned()),
                    Just("payload".to_owned()),
                    Just("applied".to_owned()),
                    "[a-z]{1,6}",
                ],
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_bytes_are_a_reply_or_a_clear_error(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        if let Err(e) = parse_reply(&bytes) {
            prop_assert!(!e.is_empty());
        }
        if let Err(e) = parse_reconcile_reply(&bytes) {
            prop_assert!(!e.is_empty());
        }
    }

    #[test]
    fn any_json_is_a_reply_or_a_clear_error(value in json_value(), events in json_value()) {
        for body in [
            value.clone(),
            json!({ "events": events.clone() }),
            json!({ "events": [{ "type": "TOOL_SUCCEEDED", "payload": value.clone() }] }),
            json!({ "decision": value.clone() }),
            json!({ "applied": true, "events": events.clone() }),
            json!({ "applied": value.clone() }),
        ] {
            let bytes = serde_json::to_vec(&body).unwrap();
            match parse_reply(&bytes) {
                // What is accepted holds no NUL, which PostgreSQL cannot store.
                Ok(Reply::Events(events)) => {
                    for (kind, payload) in events {
                        prop_assert!(!kind.contains('\0'));
                        prop_assert!(!payload.to_string().contains("\\u0000"));
                    }
                }
                Ok(Reply::Decision(d)) => prop_assert!(!d.to_string().contains("\\u0000")),
                Err(e) => prop_assert!(!e.is_empty()),
            }
            let _ = parse_reconcile_reply(&bytes);
        }
    }
}
