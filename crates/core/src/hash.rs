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
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &serde_json::Value, out: &mut String) {
    match value {
        serde_json::Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(&map[key], out);
            }
            out.push('}');
        }
        serde_json::Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}
