//! LLM-sized payloads (SPEC E5): a top-level payload field whose canonical JSON is larger
//! than a threshold leaves the event and is stored once, content-addressed by its sha256; the
//! event keeps `{"$blob": {"sha256": H, "bytes": N}}` in its place. The reducer treats the
//! reference like any other value, so replay works from the log alone and never needs the
//! tool again; readers that want the content fetch it by hash and check the hash.
//!
//! Pure: hashing and JSON only. Storage keeps the bytes (`rein_blobs`).

use serde_json::{Map, Value, json};

use crate::hash::{canonical_json, canonical_len, sha256_hex};
use crate::limits;

/// The key of a blob reference object.
pub const BLOB_KEY: &str = "$blob";

/// Payload fields that always stay inline: the engine reads them while reducing, or they are
/// small by construction.
const INLINE_FIELDS: [&str; 6] = ["call_id", "data", "usage", "reason", "branch", "error"];

/// A reference to stored content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobRef {
    pub sha256: String,
    pub bytes: usize,
}

/// Content to store: the canonical JSON bytes of a value and their sha256.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub sha256: String,
    pub content: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("payload field `{field}` is {bytes} bytes; the largest value stored is {limit} bytes")]
    FieldTooLarge {
        field: String,
        bytes: usize,
        limit: usize,
    },
    #[error(
        "event payload is {bytes} bytes after moving large fields to blobs; the limit is {limit} bytes"
    )]
    PayloadTooLarge { bytes: usize, limit: usize },
    #[error("blob {sha256} does not match its content (hash {actual})")]
    HashMismatch { sha256: String, actual: String },
    #[error("blob {0} is missing")]
    Missing(String),
    #[error("payload holds a NUL character (\\u0000) at {at}, which PostgreSQL cannot store")]
    Nul { at: String },
}

/// Where `value` holds a [`BLOB_KEY`] key, at any depth (`$.result.items[2]`, the path of
/// the object that has it), when it does. Only the engine writes that key, and only where it
/// stored the content for the run: JSON from outside (an enqueue's input, a sent payload, a
/// node's, tool's or model's reply) that holds one is refused, so nothing stored from outside
/// looks like a reference to a reader at any depth.
pub fn key_at(value: &Value) -> Option<String> {
    // An explicit stack: outside JSON is bounded in size, not in depth.
    let mut stack: Vec<(&Value, String)> = vec![(value, String::from("$"))];
    while let Some((v, at)) = stack.pop() {
        match v {
            Value::Object(map) => {
                if map.contains_key(BLOB_KEY) {
                    return Some(at);
                }
                for (key, item) in map.iter().rev() {
                    stack.push((item, format!("{at}.{}", crate::text::storable(key))));
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate().rev() {
                    stack.push((item, format!("{at}[{i}]")));
                }
            }
            _ => {}
        }
    }
    None
}

/// Why outside JSON holding a [`BLOB_KEY`] key at `at` ([`key_at`]) is refused; `what` names
/// the document ("the reply", "the decision").
pub fn key_refused(what: &str, at: &str) -> String {
    format!(
        "{what} holds a `{BLOB_KEY}` key at {at}: only Rein writes that key (a reference to \
         content it stored for the run); send the value itself, or rename the key"
    )
}

/// The reference in `value`, when `value` is one.
pub fn reference_of(value: &Value) -> Option<BlobRef> {
    let inner = value.as_object().filter(|m| m.len() == 1)?.get(BLOB_KEY)?;
    Some(BlobRef {
        sha256: inner.get("sha256")?.as_str()?.to_owned(),
        bytes: usize::try_from(inner.get("bytes")?.as_u64()?).ok()?,
    })
}

pub fn reference(blob: &BlobRef) -> Value {
    json!({ BLOB_KEY: { "sha256": blob.sha256, "bytes": blob.bytes } })
}

/// Moves every top-level field of `payload` larger than `threshold_bytes` to a blob. Fails
/// with a clear error on a field larger than [`limits::BLOB_BYTES_MAX`], a payload that is
/// still larger than [`limits::EVENT_PAYLOAD_BYTES_MAX`] afterwards, or a payload holding a
/// NUL character (it could not be stored, and would refuse its whole commit statement).
pub fn externalize(
    payload: &Value,
    threshold_bytes: usize,
) -> Result<(Value, Vec<Blob>), PayloadError> {
    if let Some(at) = crate::text::nul_at(payload) {
        return Err(PayloadError::Nul { at });
    }
    let mut blobs: Vec<Blob> = Vec::new();
    let out = match payload {
        Value::Object(map) => {
            let mut out = Map::with_capacity(map.len());
            for (field, value) in map {
                if INLINE_FIELDS.contains(&field.as_str()) || reference_of(value).is_some() {
                    out.insert(field.clone(), value.clone());
                    continue;
                }
                // Measured without writing it: most fields stay inline.
                let bytes = canonical_len(value);
                if bytes <= threshold_bytes {
                    out.insert(field.clone(), value.clone());
                    continue;
                }
                if bytes > limits::BLOB_BYTES_MAX {
                    return Err(PayloadError::FieldTooLarge {
                        field: field.clone(),
                        bytes,
                        limit: limits::BLOB_BYTES_MAX,
                    });
                }
                let text = canonical_json(value);
                let blob = Blob {
                    sha256: sha256_hex(text.as_bytes()),
                    content: text.into_bytes(),
                };
                out.insert(
                    field.clone(),
                    reference(&BlobRef {
                        sha256: blob.sha256.clone(),
                        bytes: blob.content.len(),
                    }),
                );
                if !blobs.iter().any(|b| b.sha256 == blob.sha256) {
                    blobs.push(blob);
                }
            }
            Value::Object(out)
        }
        other => other.clone(),
    };
    let bytes = canonical_len(&out);
    if bytes > limits::EVENT_PAYLOAD_BYTES_MAX {
        return Err(PayloadError::PayloadTooLarge {
            bytes,
            limit: limits::EVENT_PAYLOAD_BYTES_MAX,
        });
    }
    Ok((out, blobs))
}

/// Parses stored content after checking it against the hash it is stored under.
pub fn decode(blob: &BlobRef, content: &[u8]) -> Result<Value, PayloadError> {
    let actual = sha256_hex(content);
    if actual != blob.sha256 {
        return Err(PayloadError::HashMismatch {
            sha256: blob.sha256.clone(),
            actual,
        });
    }
    serde_json::from_slice(content).map_err(|_| PayloadError::HashMismatch {
        sha256: blob.sha256.clone(),
        actual,
    })
}

/// Every blob reference among the top-level fields of `payload`.
pub fn references(payload: &Value) -> Vec<BlobRef> {
    payload
        .as_object()
        .map(|m| m.values().filter_map(reference_of).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_key_is_found_at_any_depth_and_named_by_its_path() {
        assert_eq!(key_at(&json!({ "a": 1, "b": [1, { "c": "x" }] })), None);
        assert_eq!(
            key_at(&json!({ "$blob": { "sha256": "0".repeat(64) } })).as_deref(),
            Some("$")
        );
        assert_eq!(
            key_at(&json!({ "a": { "b": [0, { "$blob": {} }] } })).as_deref(),
            Some("$.a.b[1]")
        );
        // Beside other keys it is no reference, but still the engine's key.
        assert_eq!(
            key_at(&json!({ "x": { "$blob": 1, "y": 2 } })).as_deref(),
            Some("$.x")
        );
        assert_eq!(key_at(&json!({ "blob": { "$blobs": 1 } })), None);
    }
}
