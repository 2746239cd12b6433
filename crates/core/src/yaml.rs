//! YAML definitions in JSON's data model (SPEC M1): one document, whichever language it is
//! written in, loads as the same definition or is refused the same way.

use serde_json::{Map, Number, Value};
use serde_norway::Value as Yaml;

/// `text` read as YAML and turned into the JSON value it stands for. Scalars keep their YAML
/// type (`false` is a boolean, `3` a number), keys that are numbers or booleans become the text
/// JSON would need (`200:` is `"200"`), and what JSON cannot hold — a tag, a key that is a list
/// or a map, a float that is not finite — is refused with where to look.
pub(crate) fn to_json(text: &str) -> Result<Value, String> {
    // serde_norway bounds nesting and alias expansion, so a small document cannot unfold into
    // a huge one, and refuses duplicate keys; its errors name the line and column.
    let yaml: Yaml = serde_norway::from_str(text).map_err(|e| e.to_string())?;
    convert(yaml, &mut String::new())
}

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
}
