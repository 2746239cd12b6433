//! Stable hashes: idempotency keys and action hashes. Each input is framed with a domain
//! tag and NUL separators so distinct inputs can never concatenate to the same bytes; the
//! format is part of the storage contract and must not change between versions.

use sha2::{Digest, Sha256};

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn framed(tag: &str, parts: &[&str]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(tag.as_bytes());
    for part in parts {
        hasher.update([0u8]);
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hex::encode(hasher.finalize())
}

/// `hash(run_id, node, action_id)` (SPEC X2): the same logical action always gets the same
/// key, whichever worker runs it and however often it is retried.
pub fn idempotency_key(run_id: &str, node: &str, action_id: &str) -> String {
    framed("rein/idempotency/v1", &[run_id, node, action_id])
}

/// What an approval is bound to (SPEC H1, H2).
#[derive(Debug, Clone, Copy)]
pub struct ActionIdentity<'a> {
    pub tool: &'a str,
    pub args: &'a serde_json::Value,
    pub tool_version: Option<&'a str>,
    pub policy_version: Option<&'a str>,
}

/// Hash of tool + canonical arguments (+ tool and approval-policy versions): key order and
/// whitespace do not change it; any argument value does.
pub fn action_hash(action: ActionIdentity<'_>) -> String {
    framed(
        "rein/action/v1",
        &[
            action.tool,
            &canonical_json(action.args),
            action.tool_version.unwrap_or(""),
            action.policy_version.unwrap_or(""),
        ],
    )
}

/// JSON with object keys sorted and no insignificant whitespace.
pub fn canonical_json(value: &serde_json::Value) -> String {
    let mut out = Vec::new();
    write_canonical(value, &mut out);
    // serde_json writes UTF-8 only.
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// The length in bytes of [`canonical_json`]`(value)`, without writing it: the order of an
/// object's keys does not change its length, so this is the length of the compact form.
pub fn canonical_len(value: &serde_json::Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a Value to a sink that never fails cannot fail.
    serde_json::to_writer(&mut count, value).expect("a JSON value always serializes");
    count.0
}

fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key).expect("a string always serializes");
                out.push(b':');
                write_canonical(item, out);
            }
            out.push(b'}');
        }
        serde_json::Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar).expect("a scalar always serializes"),
    }
}

#[cfg(test)]
mod tests {
    use super::{canonical_json, canonical_len};
    use proptest::prelude::*;
    use serde_json::{Value, json};

    fn values() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            (-1e12f64..1e12).prop_map(|f| json!(f)),
            any::<String>().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                prop::collection::btree_map(any::<String>(), inner, 0..8)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    #[test]
    fn canonical_json_sorts_keys_and_escapes_them() {
        let v = json!({"b": [1, {"z": null, "a": "x\"y"}], "a\n": 2.5, "": true});
        assert_eq!(
            canonical_json(&v),
            r#"{"":true,"a\n":2.5,"b":[1,{"a":"x\"y","z":null}]}"#
        );
    }

    proptest! {
        /// The length is that of the canonical text, and the text reads back as the value.
        #[test]
        fn canonical_len_is_the_length_of_canonical_json(v in values()) {
            let text = canonical_json(&v);
            prop_assert_eq!(canonical_len(&v), text.len());
            let back: Value = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(back, v);
        }
    }
}
