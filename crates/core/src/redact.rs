//! Forgetting what must be forgotten (GDPR-style erasure): named keys of a run's business data
//! replaced, wherever the log carries them, by a marker holding a keyed hash of the value
//! (HMAC-SHA256 under the deployment's redaction key), so nobody who reads the log can guess
//! the value back by hashing candidates. Pure: the store reads the log, calls these, checks
//! the redacted log still replays to the redacted projection, and writes it back.

use hmac::{KeyInit, Mac};
use serde_json::{Value, json};

use crate::definition::Definition;
use crate::hash::canonical_json;

/// The key of a redaction marker: `{"$redacted": {"sha256": HEX}}`.
pub const MARKER_KEY: &str = "$redacted";
/// Most keys one redaction names.
pub const REDACT_FIELDS_MAX: usize = 64;
/// The environment variable holding the redaction key.
pub const REDACTION_KEY_ENV: &str = "REIN_REDACTION_KEY";
/// Fewest bytes of a redaction key: a guessable key would make the markers guessable again.
pub const REDACTION_KEY_BYTES_MIN: usize = 32;
/// What a marker made before the key was used is hashed with, to tell it from a value.
const UNKEYED_MARKER_CONTEXT: &[u8] = b"rein unkeyed redaction marker:";

type HmacSha256 = hmac::Hmac<hmac_sha2::Sha256>;

/// The secret a deployment's redaction markers are keyed with (`REIN_REDACTION_KEY`): the
/// same for every process that redacts, so one value gets one marker. Never printed.
#[derive(Clone)]
pub struct RedactionKey(Vec<u8>);

impl std::fmt::Debug for RedactionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RedactionKey(..)")
    }
}

/// How to set a redaction key, for the errors that ask for one.
pub fn key_advice() -> String {
    format!(
        "set {REDACTION_KEY_ENV} to a secret of at least {REDACTION_KEY_BYTES_MIN} bytes \
         (generate one with `openssl rand -hex 32`), the same for every `rein api` and \
         `rein runs redact`, and keep it secret: a marker is a keyed hash of the value, so \
         that nobody who reads the log can guess the value back"
    )
}

impl RedactionKey {
    /// The key `secret` spells; refused when shorter than [`REDACTION_KEY_BYTES_MIN`].
    pub fn new(secret: &str) -> Result<RedactionKey, String> {
        let secret = secret.trim();
        if secret.len() < REDACTION_KEY_BYTES_MIN {
            return Err(format!(
                "{REDACTION_KEY_ENV} is {} bytes, too short to key redaction markers: {}",
                secret.len(),
                key_advice()
            ));
        }
        Ok(RedactionKey(secret.as_bytes().to_vec()))
    }

    fn hash(&self, parts: &[&[u8]]) -> String {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC accepts any key length");
        for part in parts {
            mac.update(part);
        }
        hex::encode(mac.finalize().into_bytes())
    }
}

fn marker_of(hash: String) -> Value {
    json!({ MARKER_KEY: { "sha256": hash } })
}

/// The marker that stands for `value` once it is forgotten: HMAC-SHA256 under `key` of its
/// canonical JSON, never the value. The field keeps its old name, `sha256`, so stored markers
/// and new ones have one shape.
pub fn marker(key: &RedactionKey, value: &Value) -> Value {
    marker_of(key.hash(&[canonical_json(value).as_bytes()]))
}

/// The keyed marker that replaces `old`, a marker made before redaction was keyed (a plain
/// sha256 of the value, which a reader can reverse for a guessable value): a keyed hash of
/// that hash, so the old one is no longer stored anywhere.
pub fn rekeyed(key: &RedactionKey, old: &Value) -> Value {
    let hash = old[MARKER_KEY]["sha256"].as_str().unwrap_or_default();
    marker_of(key.hash(&[UNKEYED_MARKER_CONTEXT, hash.as_bytes()]))
}

pub fn is_marker(value: &Value) -> bool {
    value.get(MARKER_KEY).is_some() && value.as_object().is_some_and(|m| m.len() == 1)
}

/// How one redaction replaces values: by `key`'s markers, and, in the keys of `rekey`, the
/// markers made before redaction was keyed by keyed ones ([`rekeyed`]).
#[derive(Debug, Clone, Copy)]
pub struct Redaction<'a> {
    pub key: &'a RedactionKey,
    pub fields: &'a [String],
    /// Keys whose stored markers are unkeyed: replaced too.
    pub rekey: &'a [String],
}

impl Redaction<'_> {
    /// Replaces the keys of the object `data` by markers; what it replaced, as (field,
    /// hash) pairs. A value that is already a marker stays as it is, unless its key is one of
    /// `rekey`.
    pub fn object(&self, data: &mut Value) -> Vec<(String, String)> {
        let mut done = Vec::new();
        let Some(map) = data.as_object_mut() else {
            return done;
        };
        for field in self.fields {
            let Some(value) = map.get_mut(field) else {
                continue;
            };
            let m = if !is_marker(value) {
                marker(self.key, value)
            } else if self.rekey.contains(field) {
                rekeyed(self.key, value)
            } else {
                continue;
            };
            done.push((
                field.clone(),
                m[MARKER_KEY]["sha256"].as_str().unwrap_or("").to_owned(),
            ));
            *value = m;
        }
        done
    }

    /// Redacts an event's payload where the reducer reads business data from
    /// (`payload.data`, merged into the run's data).
    pub fn payload(&self, payload: &mut Value) -> Vec<(String, String)> {
        match payload.get_mut("data") {
            Some(data) => self.object(data),
            None => Vec::new(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::sha256_hex;

    fn key(c: char) -> RedactionKey {
        RedactionKey::new(&c.to_string().repeat(REDACTION_KEY_BYTES_MIN)).unwrap()
    }

    #[test]
    fn a_marker_is_a_keyed_hash_of_the_value_not_its_sha256() {
        let phone = json!("+44 20 7946 0000");
        let unkeyed = sha256_hex(canonical_json(&phone).as_bytes());
        let (a, b) = (marker(&key('a'), &phone), marker(&key('b'), &phone));
        assert_ne!(a[MARKER_KEY]["sha256"], json!(unkeyed), "{a}");
        assert_ne!(a, b, "another key, another marker");
        assert_eq!(a, marker(&key('a'), &phone), "one key, one marker");
        // The shape `rein_apply_redaction` accepts: one key, 64 lowercase hex digits.
        assert!(is_marker(&a));
        let hash = a[MARKER_KEY]["sha256"].as_str().unwrap();
        assert_eq!(hash.len(), 64);
        assert!(
            hash.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
    }

    #[test]
    fn a_short_key_is_refused_saying_what_to_set() {
        let e = RedactionKey::new("secret").unwrap_err();
        assert!(
            e.contains(REDACTION_KEY_ENV) && e.contains("openssl rand -hex 32"),
            "{e}"
        );
        assert!(format!("{:?}", key('a')).contains(".."), "never printed");
    }

    #[test]
    fn unkeyed_markers_are_replaced_only_in_the_keys_to_rekey() {
        let old = json!({ MARKER_KEY: { "sha256": "0".repeat(64) } });
        let mut data = json!({"email": old, "phone": old, "name": "Ada"});
        let fields = ["email".to_owned(), "phone".to_owned(), "name".to_owned()];
        let rekey = ["email".to_owned()];
        let k = key('a');
        let redaction = Redaction {
            key: &k,
            fields: &fields,
            rekey: &rekey,
        };
        let done = redaction.object(&mut data);
        assert_eq!(data["email"], rekeyed(&k, &old));
        assert_ne!(data["email"], old);
        assert_eq!(data["phone"], old, "a marker outside rekey stays");
        assert_eq!(data["name"], marker(&k, &json!("Ada")));
        assert_eq!(done.len(), 2, "{done:?}");
    }
}
