//! What drives fleets and measures them: `rein demo` (a private PostgreSQL, a scheduler pair,
//! workers and the API in one go), `rein bench` and `rein chaos`; the supervision of their
//! child processes, and the private PostgreSQL and Redis servers they start.

pub mod backlog;
pub mod bench;
pub mod bench_model;
pub mod chaos;
pub mod demo;
pub mod demo_model;
pub mod model_standin;
pub mod netproxy;
pub mod privdb;
pub mod privredis;
pub mod procs;

/// How many of `events` (type, count) have one of `names` as their type.
pub fn events_of(events: &[(String, i64)], names: &[&str]) -> i64 {
    events
        .iter()
        .filter(|e| names.contains(&e.0.as_str()))
        .map(|e| e.1)
        .sum()
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress_bar(len: u64, template: &str) -> indicatif::ProgressBar {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// `a / b`, or 0 when there is nothing to divide by.
pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}
