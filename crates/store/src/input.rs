//! Checks on text that reaches the database (SPEC Z2). PostgreSQL refuses a NUL character
//! in `text` and in a `jsonb` string or key; without these checks such input failed deep
//! in a statement as an internal error instead of being refused as invalid, by name.

use serde_json::Value;

use crate::StoreError;

/// Refuses `value` when it holds a NUL character; `field` names it in the error.
pub fn check_text(field: &str, value: &str) -> Result<(), StoreError> {
    if value.contains('\0') {
        return Err(nul_in(field.to_owned()));
    }
    Ok(())
}

/// Refuses a JSON document with a NUL character in any string or object key, naming the
/// first one's path (`input.customer.name`, `payload.items[2]`). One pass over the document
/// with an explicit stack, so deep nesting cannot exhaust the call stack; every caller has
/// already bounded the document's size, which bounds the walk.
pub fn check_json(field: &str, value: &Value) -> Result<(), StoreError> {
    // Each value's step from its parent (an index into `steps`), to name a hit's path.
    let mut steps: Vec<(usize, Step<'_>)> = Vec::new();
    let mut stack: Vec<(&Value, usize)> = vec![(value, ROOT)];
    while let Some((v, at)) = stack.pop() {
        match v {
            Value::String(s) if s.contains('\0') => {
                return Err(nul_in(path(field, &steps, at)));
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    steps.push((at, Step::Index(i)));
                    stack.push((item, steps.len() - 1));
                }
            }
            Value::Object(map) => {
                for (key, item) in map {
                    steps.push((at, Step::Key(key)));
                    if key.contains('\0') {
                        let named = path(field, &steps, steps.len() - 1);
                        return Err(nul_in(format!("{named} (a key)")));
                    }
                    stack.push((item, steps.len() - 1));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// [`check_json`] for a run's data from outside (an enqueue's input, a sent payload), which
/// also may not hold a `$blob` key anywhere: only the engine writes blob references, for
/// content it stored for the run (SPEC E5), so a hash learnt from another run's events
/// cannot be made to look like one of this run's references.
pub fn check_data(field: &str, value: &Value) -> Result<(), StoreError> {
    check_json(field, value)?;
    match rein_core::blob::key_at(value) {
        Some(at) => {
            let named = format!("{field}{}", at.strip_prefix('$').unwrap_or(&at));
            Err(StoreError::InvalidField {
                reason: rein_core::blob::key_refused(&format!("`{field}`"), &format!("`{named}`")),
                field: named,
            })
        }
        None => Ok(()),
    }
}

/// Whether `c` would act on a terminal or a log reader instead of showing as itself: the
/// control characters (C0 with newline and ESC, DEL, C1) and the invisible format characters
/// that reorder or hide the text around them (bidirectional overrides and isolates,
/// zero-width characters, the byte-order mark).
pub fn is_unprintable(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2069}' | '\u{FEFF}'
        )
}

/// Refuses a name that is printed into logs, tables and histories (a token's subject, an
/// event's sender) when it holds a character [`is_unprintable`] finds; `field` names it.
pub fn check_printable(field: &str, value: &str) -> Result<(), StoreError> {
    match value.chars().find(|c| is_unprintable(*c)) {
        Some(c) => Err(StoreError::InvalidField {
            field: field.to_owned(),
            reason: format!(
                "`{field}` contains the control character {} (it would reach logs and tables \
                 raw); use printable text",
                c.escape_unicode()
            ),
        }),
        None => Ok(()),
    }
}

fn nul_in(field: String) -> StoreError {
    StoreError::InvalidField {
        reason: format!("`{field}` contains a NUL character (\\u0000), which cannot be stored"),
        field,
    }
}

#[derive(Clone, Copy)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

/// The parent of the document's root in [`check_json`]'s steps.
const ROOT: usize = usize::MAX;

/// `field` and the steps from the root to step `at`.
fn path(field: &str, steps: &[(usize, Step<'_>)], at: usize) -> String {
    let mut chain = Vec::new();
    let mut at = at;
    while let Some((parent, step)) = steps.get(at) {
        chain.push(*step);
        at = *parent;
    }
    let mut out = field.to_owned();
    for step in chain.into_iter().rev() {
        match step {
            Step::Key(k) => {
                out.push('.');
                out.push_str(&k.replace('\0', "\\u0000"));
            }
            Step::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn field_of(r: Result<(), StoreError>) -> String {
        match r {
            Err(StoreError::InvalidField { field, .. }) => field,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn clean_documents_pass() {
        check_json("input", &json!({"a": ["b", {"c": 1}], "d": null})).unwrap();
        check_text("queue", "default").unwrap();
    }

    #[test]
    fn names_that_would_drive_a_terminal_are_refused() {
        for bad in [
            "a\nb",
            "\u{1b}[31mred",
            "tab\there",
            "del\u{7f}",
            "c1\u{85}",
            "rtl\u{202e}txt",
        ] {
            assert_eq!(
                field_of(check_printable("subject", bad)),
                "subject",
                "{bad:?}"
            );
        }
        for good in ["alice@example.com", "Zoë Ünal", "ci bot (prod)", "名前"] {
            check_printable("subject", good).unwrap();
        }
    }

    #[test]
    fn a_nul_anywhere_is_named_by_its_path() {
        assert_eq!(field_of(check_text("queue", "a\0b")), "queue");
        assert_eq!(field_of(check_json("input", &json!("x\u{0}"))), "input");
        assert_eq!(
            field_of(check_json(
                "input",
                &json!({"customer": {"name": "a\u{0}"}})
            )),
            "input.customer.name"
        );
        assert_eq!(
            field_of(check_json(
                "payload",
                &json!({"items": ["ok", "ok", "b\u{0}"]})
            )),
            "payload.items[2]"
        );
        assert_eq!(
            field_of(check_json("payload", &json!({"k\u{0}": 1}))),
            "payload.k\\u0000 (a key)"
        );
    }

    #[test]
    fn deep_nesting_is_walked_without_recursion() {
        let mut v = json!({"end": "x\u{0}"});
        for _ in 0..1000 {
            v = Value::Array(vec![json!(1), v]);
        }
        let field = field_of(check_json("input", &v));
        assert_eq!(field, format!("input{}.end", "[1]".repeat(1000)));
    }
}
