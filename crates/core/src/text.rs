//! Text PostgreSQL can store. Its `text` and `jsonb` types cannot hold the NUL character
//! (U+0000, `\u0000` in JSON): one such character in an event refuses the whole statement
//! that carries it. Text the engine writes itself (error messages, quoted reply bodies) has
//! NUL replaced; data that arrives with NUL (a reply, a decision, a result) is refused with
//! the place it was found.

use serde_json::Value;

/// What replaces NUL in text the engine writes: U+FFFD REPLACEMENT CHARACTER.
pub const NUL_REPLACEMENT: char = '\u{FFFD}';

/// `text` with every NUL replaced by [`NUL_REPLACEMENT`].
pub fn storable(text: &str) -> String {
    if text.contains('\0') {
        text.replace('\0', &NUL_REPLACEMENT.to_string())
    } else {
        text.to_owned()
    }
}

/// Whether JSON `text` is an object: its first character past white space is `{`. A document
/// that stands for a record (a request body, a definition) is an object; serde would also
/// read a struct from an array of its fields in order, which no reader would recognise.
pub fn json_text_is_object(text: &[u8]) -> bool {
    text.iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .is_some_and(|b| *b == b'{')
}

/// Where `value` holds a NUL character, in a string or an object key, as a JSON path
/// (`$.events[0].payload.note`); `None` when it holds none.
pub fn nul_at(value: &Value) -> Option<String> {
    fn walk(value: &Value, path: &mut String) -> bool {
        match value {
            Value::String(s) => s.contains('\0'),
            Value::Array(items) => items.iter().enumerate().any(|(i, item)| {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                let found = walk(item, path);
                if !found {
                    path.truncate(len);
                }
                found
            }),
            Value::Object(map) => map.iter().any(|(key, item)| {
                let len = path.len();
                path.push('.');
                path.push_str(&storable(key));
                let found = key.contains('\0') || walk(item, path);
                if !found {
                    path.truncate(len);
                }
                found
            }),
            Value::Null | Value::Bool(_) | Value::Number(_) => false,
        }
    }
    let mut path = String::from("$");
    walk(value, &mut path).then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nul_is_replaced_in_engine_text() {
        assert_eq!(storable("a\0b"), "a\u{FFFD}b");
        assert_eq!(storable("plain"), "plain");
    }

    #[test]
    fn nul_is_found_with_its_path() {
        assert_eq!(
            nul_at(&json!({ "a": [1, "ok", { "b": "x\u{0}" }] })).as_deref(),
            Some("$.a[2].b")
        );
        assert_eq!(
            nul_at(&json!({ "k\u{0}": 1 })).as_deref(),
            Some("$.k\u{FFFD}")
        );
        assert_eq!(nul_at(&json!({ "a": ["fine", 2, null] })), None);
    }
}
