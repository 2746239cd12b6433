//! YAML definitions in JSON's data model (SPEC M1): one document, whichever language it is
//! written in, loads as the same definition or is refused the same way.

use serde_json::{Map, Number, Value};
use serde_norway::Value as Yaml;

/// `text` read as YAML and turned into the JSON value it stands for. Scalars keep their YAML
/// type (`false` is a boolean, `3` a number), keys that are numbers or booleans become the text
/// JSON would need (`200:` is `"200"`), and what JSON cannot hold — a tag, a key that is a list
/// or a map, a float that is not finite — is refused with where to look.
pub(crate) fn to_json(text: &str) -> Result<Value, String> {
    // serde_norway bounds nesting and the number of alias *jumps*, not what they expand to: a
    // 2 KB document of aliases to aliases unfolds into gigabytes. A definition has no need for
    // them, so anchors and aliases are refused before serde_norway reads anything.
    refuse_anchors(text)?;
    // serde_norway refuses duplicate keys; its errors name the line and column.
    let yaml: Yaml = serde_norway::from_str(text).map_err(|e| e.to_string())?;
    convert(yaml, &mut String::new())
}

/// The first anchor (`&name`) or alias (`*name`) in `text`, refused with its line and column,
/// found by libyaml's event parser (the one serde_norway reads with), so a `&` or `*` inside
/// quotes, a block scalar or a comment is text as YAML says. Events are read one at a time and
/// dropped; nothing is expanded. A document libyaml cannot parse passes here and is refused by
/// serde_norway with its own message.
fn refuse_anchors(text: &str) -> Result<(), String> {
    use std::mem::MaybeUninit;
    use unsafe_libyaml_norway as unsafe_yaml;

    struct Parser(Box<MaybeUninit<unsafe_yaml::yaml_parser_t>>);
    impl Drop for Parser {
        fn drop(&mut self) {
            // SAFETY: a `Parser` holds only a parser whose initialisation succeeded.
            unsafe { unsafe_yaml::yaml_parser_delete(self.0.as_mut_ptr()) }
        }
    }
    let bytes = text.as_bytes();
    // SAFETY: libyaml keeps a pointer to the parser in the parser (the read handler's data),
    // so it lives in a box that is never moved out of; the input outlives the parser, which is
    // dropped at the end of this function; each event is deleted once, after it is read.
    unsafe {
        let mut raw = Box::new(MaybeUninit::uninit());
        if unsafe_yaml::yaml_parser_initialize(raw.as_mut_ptr()).fail {
            return Err("the YAML parser could not start (out of memory)".to_owned());
        }
        let mut parser = Parser(raw);
        let p = parser.0.as_mut_ptr();
        unsafe_yaml::yaml_parser_set_encoding(p, unsafe_yaml::YAML_UTF8_ENCODING);
        unsafe_yaml::yaml_parser_set_input_string(p, bytes.as_ptr(), bytes.len() as u64);
        loop {
            let mut event = MaybeUninit::<unsafe_yaml::yaml_event_t>::uninit();
            if unsafe_yaml::yaml_parser_parse(p, event.as_mut_ptr()).fail {
                return Ok(());
            }
            let e = event.assume_init_mut();
            let found = match e.type_ {
                unsafe_yaml::YAML_STREAM_END_EVENT => {
                    unsafe_yaml::yaml_event_delete(e);
                    return Ok(());
                }
                unsafe_yaml::YAML_ALIAS_EVENT => {
                    Some("an alias (`*name`) repeats a value written elsewhere")
                }
                unsafe_yaml::YAML_SCALAR_EVENT if !e.data.scalar.anchor.is_null() => Some(ANCHOR),
                unsafe_yaml::YAML_SEQUENCE_START_EVENT
                    if !e.data.sequence_start.anchor.is_null() =>
                {
                    Some(ANCHOR)
                }
                unsafe_yaml::YAML_MAPPING_START_EVENT if !e.data.mapping_start.anchor.is_null() => {
                    Some(ANCHOR)
                }
                _ => None,
            };
            let (line, column) = (e.start_mark.line + 1, e.start_mark.column + 1);
            unsafe_yaml::yaml_event_delete(e);
            if let Some(what) = found {
                return Err(format!(
                    "line {line} column {column}: {what}; a definition has no anchors or \
                     aliases: write the value out where it is used"
                ));
            }
        }
    }
}

const ANCHOR: &str = "an anchor (`&name`) names a value for aliases to repeat";

fn convert(yaml: Yaml, path: &mut String) -> Result<Value, String> {
    Ok(match yaml {
        Yaml::Null => Value::Null,
        Yaml::Bool(b) => Value::Bool(b),
        Yaml::Number(n) => number(&n).ok_or_else(|| {
            format!(
                "{}: {n} is not a finite number; write a finite one",
                at(path)
            )
        })?,
        Yaml::String(s) => Value::String(s),
        Yaml::Sequence(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                out.push(convert(item, path)?);
                path.truncate(len);
            }
            Value::Array(out)
        }
        Yaml::Mapping(entries) => {
            let mut out = Map::new();
            for (key, value) in entries {
                let key = match key {
                    Yaml::String(s) => s,
                    Yaml::Bool(b) => b.to_string(),
                    Yaml::Number(n) => n.to_string(),
                    _ => {
                        return Err(format!(
                            "{}: a key is a list, a map, null or tagged; keys are text",
                            at(path)
                        ));
                    }
                };
                let len = path.len();
                path.push('.');
                path.push_str(&key);
                let value = convert(value, path)?;
                path.truncate(len);
                if out.insert(key.clone(), value).is_some() {
                    return Err(format!(
                        "{}: the key `{key}` is written twice (once as text, once not)",
                        at(path)
                    ));
                }
            }
            Value::Object(out)
        }
        Yaml::Tagged(tagged) => {
            return Err(format!(
                "{}: YAML tags (`{}`) are not part of a definition; remove the tag",
                at(path),
                tagged.tag
            ));
        }
    })
}

fn number(n: &serde_norway::Number) -> Option<Value> {
    if let Some(i) = n.as_i64() {
        Some(Value::from(i))
    } else if let Some(u) = n.as_u64() {
        Some(Value::from(u))
    } else {
        n.as_f64().and_then(Number::from_f64).map(Value::Number)
    }
}

fn at(path: &str) -> &str {
    if path.is_empty() {
        "the document"
    } else {
        path.trim_start_matches('.')
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn scalars_keep_their_type_and_keys_become_text() {
        let v = to_json("a: false\nb: 3\nc: 2.5\nd: text\n200: ok\ne: [1, null]\n").unwrap();
        assert_eq!(
            v,
            json!({"a": false, "b": 3, "c": 2.5, "d": "text", "200": "ok", "e": [1, null]})
        );
    }

    #[test]
    fn what_json_cannot_hold_is_refused_with_where() {
        let err = to_json("a:\n  b: .nan\n").unwrap_err();
        assert!(err.contains("a.b"), "{err}");
        let err = to_json("a: !thing 3\n").unwrap_err();
        assert!(err.contains("tags"), "{err}");
        let err = to_json("? [1]\n: x\n").unwrap_err();
        assert!(err.contains("keys are text"), "{err}");
        let err = to_json("1: a\n'1': b\n").unwrap_err();
        assert!(err.contains("written twice"), "{err}");
    }

    /// An anchor of 1,000 items under four levels of ten aliases each: 2 KB of text that
    /// serde_norway would unfold into ten million strings.
    fn alias_bomb() -> String {
        let mut text = format!("l0: &l0 [{}]\n", vec!["x"; 1000].join(","));
        for level in 1..=4 {
            let aliases = vec![format!("*l{}", level - 1); 10].join(",");
            text.push_str(&format!("l{level}: &l{level} [{aliases}]\n"));
        }
        text
    }

    #[test]
    fn anchors_and_aliases_are_refused_before_anything_is_expanded() {
        let bomb = alias_bomb();
        assert!(bomb.len() < 2300, "{}", bomb.len());
        let err = to_json(&bomb).unwrap_err();
        assert!(err.contains("line 1 column 5"), "{err}");
        assert!(err.contains("write the value out"), "{err}");
        let err = to_json("a: 1\nb:\n  - *x\n").unwrap_err();
        assert!(
            err.contains("line 3 column 5") && err.contains("alias"),
            "{err}"
        );
        let err = to_json("a: &x {b: 1}\n").unwrap_err();
        assert!(
            err.contains("line 1 column 4") && err.contains("anchor"),
            "{err}"
        );
    }

    #[test]
    fn ampersands_and_stars_in_text_are_text() {
        let v = to_json("a: '&x *y'\nb: \"*z\"\nc: |\n  &q\n  *r\nd: x&y*z # *c &d\ne: [a*, b&]\n")
            .unwrap();
        assert_eq!(
            v,
            json!({"a": "&x *y", "b": "*z", "c": "&q\n*r\n", "d": "x&y*z", "e": ["a*", "b&"]})
        );
    }
}
