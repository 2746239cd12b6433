//! Forgetting what must be forgotten (GDPR-style erasure): named keys of a run's business data
//! replaced, wherever the log carries them, by a marker holding the value's hash. Pure: the
//! store reads the log, calls these, checks the redacted log still replays to the redacted
//! projection, and writes it back.

use serde_json::{Value, json};

use crate::definition::Definition;
use crate::hash::{canonical_json, sha256_hex};

/// The key of a redaction marker: `{"$redacted": {"sha256": HEX}}`.
pub const MARKER_KEY: &str = "$redacted";
/// Most keys one redaction names.
pub const REDACT_FIELDS_MAX: usize = 64;

/// The marker that stands for `value` once it is forgotten: its hash, never the value.
pub fn marker(value: &Value) -> Value {
    json!({ MARKER_KEY: { "sha256": sha256_hex(canonical_json(value).as_bytes()) } })
}

pub fn is_marker(value: &Value) -> bool {
    value.get(MARKER_KEY).is_some() && value.as_object().is_some_and(|m| m.len() == 1)
}

/// Replaces `fields` (top-level keys) of the object `data` by markers; what it replaced, as
/// (field, sha256) pairs. A value that is already a marker stays as it is.
pub fn redact_object(data: &mut Value, fields: &[String]) -> Vec<(String, String)> {
    let mut done = Vec::new();
    let Some(map) = data.as_object_mut() else {
        return done;
    };
    for field in fields {
        if let Some(value) = map.get_mut(field)
            && !is_marker(value)
        {
            let m = marker(value);
            done.push((
                field.clone(),
                m[MARKER_KEY]["sha256"].as_str().unwrap_or("").to_owned(),
            ));
            *value = m;
        }
    }
    done
}

/// Redacts `fields` in an event's payload where the reducer reads business data from
/// (`payload.data`, merged into the run's data).
pub fn redact_payload(payload: &mut Value, fields: &[String]) -> Vec<(String, String)> {
    match payload.get_mut("data") {
        Some(data) => redact_object(data, fields),
        None => Vec::new(),
    }
}

/// What is wrong with `fields` as a list of data keys to redact, whatever the run: none, too
/// many, or one that is not a plain key.
pub fn fields_problem(fields: &[String]) -> Option<String> {
    if fields.is_empty() {
        return Some("name at least one data key to redact".into());
    }
    if fields.len() > REDACT_FIELDS_MAX {
        return Some(format!(
            "{} keys; the limit is {REDACT_FIELDS_MAX}",
            fields.len()
        ));
    }
    fields.iter().find_map(|field| {
        crate::spec::name_problem(field).map(|problem| format!("`{field}`: {problem}"))
    })
}

/// Why `fields` cannot be redacted in runs of `def`: each must be a plain data key
/// ([`fields_problem`]), and none may be read by the definition itself (a guard, an approval
/// rule, a join guard, a prompt template), since a replay would then decide on the marker
/// instead of the value.
pub fn refusal(def: &Definition, fields: &[String]) -> Option<String> {
    if let Some(problem) = fields_problem(fields) {
        return Some(problem);
    }
    let spec = serde_json::to_string(def.spec()).unwrap_or_default();
    for field in fields {
        // As the spec's JSON text spells them: `data.F`, `data["F"]`, `data['F']`, and a
        // template's `{{input.F}}` / `{{data.F}}`.
        let reads = [
            format!("data.{field}"),
            format!("data[\\\"{field}\\\"]"),
            format!("data['{field}']"),
            format!("input.{field}"),
        ];
        if reads.iter().any(|r| spec.contains(r.as_str())) {
            return Some(format!(
                "{}@v{} reads `{field}` (a guard, rule or template): its runs' replay would \
                 decide on the marker instead of the value, so it cannot be redacted",
                def.name(),
                def.version()
            ));
        }
    }
    None
}
