//! How the CLI prints: a command's document as JSON (`--json`) or for a person, its errors
//! with the exit code their code stands for, and text from callers made safe for a terminal.

use rein_ops::{Code, Error};
use rein_process::exit;
use serde_json::Value;

/// Prints a JSON document on one line.
pub fn print_json(value: &Value) {
    println!("{value}");
}

/// Prints a command's answer: the document itself with `--json`, `human(document)` otherwise;
/// an error with its exit code.
pub fn answer(result: Result<Value, Error>, json: bool, human: impl FnOnce(&Value)) -> u8 {
    match result {
        Ok(v) if json => {
            print_json(&v);
            exit::OK
        }
        Ok(v) => {
            human(&v);
            exit::OK
        }
        Err(e) => fail(&e),
    }
}

/// `key` of a JSON document as text ("" when absent).
pub fn text<'v>(v: &'v Value, key: &str) -> &'v str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// `text` as it may be printed to a terminal: a control or invisible format character (a
/// newline, ESC, a bidirectional override) shows as its escape (`\u{1b}`) instead of acting
/// on the terminal or forging a line of output.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    use rein_store::input::is_unprintable;
    if !text.chars().any(is_unprintable) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if is_unprintable(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `key` of a JSON document as it reads in a table: text without quotes (its control
/// characters escaped), a missing or null value as "-", anything else as JSON.
pub fn cell(v: &Value, key: &str) -> String {
    match v.get(key) {
        Some(Value::String(s)) => printable(s).into_owned(),
        Some(Value::Null) | None => "-".to_owned(),
        Some(other) => other.to_string(),
    }
}

/// Prints an error and picks its exit code: refusals 2, an unreachable or failing service 3,
/// authentication 4, bad input 1.
pub fn fail(e: &Error) -> u8 {
    eprintln!("error: {}", e.message);
    if let Some(cause) = &e.cause {
        eprintln!("       ({cause})");
    }
    if let Some(problems) = e
        .details
        .as_ref()
        .and_then(|d| d.get("problems"))
        .and_then(Value::as_array)
    {
        for p in problems {
            eprintln!(
                "  {}: {}",
                p.get("item").and_then(Value::as_str).unwrap_or("?"),
                p.get("reason").and_then(Value::as_str).unwrap_or("?")
            );
        }
    }
    exit_code(e.code)
}

/// The exit code each error code ends a command with.
pub fn exit_code(code: Code) -> u8 {
    match code {
        Code::InvalidTransition
        | Code::Fenced
        | Code::Conflict
        | Code::EventNotAllowed
        | Code::QuotaExceeded => exit::REFUSED,
        Code::Unavailable | Code::Internal | Code::RequestTimeout | Code::TooManyRequests => {
            exit::DATABASE
        }
        Code::Unauthorized | Code::Forbidden => exit::AUTH,
        Code::ValidationFailed
        | Code::NotFound
        | Code::PayloadTooLarge
        | Code::MethodNotAllowed
        | Code::BadRequest
        | Code::UriTooLong
        | Code::HeadersTooLarge
        | Code::UnsupportedMediaType => exit::INPUT,
    }
}

/// `2026-11-30 04:08:21` from an RFC 3339 timestamp (the text itself if it is not one).
pub fn short_time(rfc3339: &str) -> String {
    chrono::DateTime::parse_from_rfc3339(rfc3339)
        .map(|t| {
            t.with_timezone(&chrono::Utc)
                .format("%Y-%m-%d %H:%M:%S")
                .to_string()
        })
        .unwrap_or_else(|_| rfc3339.to_owned())
}

/// The header of `rein runs history`'s table (and `rein runs watch`'s).
pub fn print_history_header() {
    println!(
        "{:>5}  {:<26}  {:>5}  {:<28}  {:<28}  occurred_at",
        "seq", "type", "token", "worker", "sender"
    );
}

/// One event as a row of `rein runs history`'s table.
pub fn print_history_row(e: &Value) {
    println!(
        "{:>5}  {:<26}  {:>5}  {:<28}  {:<28}  {}",
        cell(e, "sequence"),
        text(e, "type"),
        cell(e, "token"),
        text(e, "worker"),
        cell(e, "sender"),
        text(e, "occurred_at")
    );
}

/// A run's `usage` (all models summed) on one line: calls, tokens in and out, reasoning and
/// cached where known, cost where priced; what a run with no model call says instead.
pub fn usage_line(usage: &Value) -> String {
    let Ok(sums) = serde_json::from_value::<rein_ops::usage::UsageSums>(usage.clone()) else {
        return "no model calls".to_owned();
    };
    sums_text(&sums)
}

fn sums_text(s: &rein_ops::usage::UsageSums) -> String {
    let mut line = format!(
        "{} call{}, {} input + {} output tokens",
        s.calls,
        if s.calls == 1 { "" } else { "s" },
        s.input_tokens,
        s.output_tokens
    );
    let known: Vec<String> = [
        ("reasoning", s.reasoning_tokens),
        ("cached", s.cached_tokens),
    ]
    .into_iter()
    .filter_map(|(name, n)| Some(format!("{name} {}", n?)))
    .collect();
    if !known.is_empty() {
        line.push_str(&format!(" ({})", known.join(", ")));
    }
    match s.cost {
        Some(cost) => line.push_str(&format!(", cost {cost:.6}")),
        None => line.push_str(", cost unknown (no price)"),
    }
    line
}

/// `rein runs usage`: one line per model, then the total.
pub fn usage_table(view: &rein_ops::usage::UsageView) {
    if view.models.is_empty() {
        println!("run {} made no model calls", view.run_id);
        return;
    }
    for m in &view.models {
        let name = if m.model.is_empty() {
            "(unnamed)".to_owned()
        } else {
            printable(&m.model).into_owned()
        };
        println!("{name:<28} {}", sums_text(&m.sums));
    }
    if let Some(total) = &view.total
        && view.models.len() > 1
    {
        println!("{:<28} {}", "total", sums_text(total));
    }
}
