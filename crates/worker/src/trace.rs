//! Traces (SPEC O3): a span per run step (`rein.step`) and per action attempt
//! (`rein.action`), children of the run's root span `rein.run` (sent when the run was
//! created, see [`rein_store::trace`]). Every span of a run belongs to one trace whose id is
//! the run id, so the steps a run took on different workers, before and after a crash, line
//! up in one tree without passing anything between processes. When no OpenTelemetry layer
//! is installed these are plain `tracing` spans and cost next to nothing.

use opentelemetry::KeyValue;
use opentelemetry::trace::{Status, TraceContextExt};
use serde_json::Value;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use uuid::Uuid;

use crate::handler::Outcome;

pub use rein_store::trace::{parent_to_run, trace_id};

/// How a failed action attempt ended: its fine error class (`error.kind` of the failure
/// the handler recorded, or its coarse class when it named none) and message.
pub fn failure_of(outcome: &Outcome) -> Option<(String, String)> {
    match outcome {
        Outcome::Events(candidates) => candidates.iter().find_map(|(_, payload)| {
            let error = payload.get("error").filter(|e| e.is_object())?;
            let text = |key: &str| error.get(key).and_then(Value::as_str);
            let kind = text("kind").or_else(|| text("class")).unwrap_or("error");
            Some((kind.to_owned(), text("message").unwrap_or("").to_owned()))
        }),
        Outcome::InDoubt(reason) => {
            Some((rein_core::retry::kind::IN_DOUBT.to_owned(), reason.clone()))
        }
        Outcome::TimedOut(reason) => {
            Some((rein_core::retry::kind::TIMEOUT.to_owned(), reason.clone()))
        }
        Outcome::Decision(_) | Outcome::Model(_) => None,
    }
}

/// Marks an action attempt's span failed when `outcome` is a failure: status `Error` with
/// its message, `error.type` its class, and an `exception` event (OpenTelemetry semantic
/// conventions) carrying both.
pub fn record_outcome(span: &tracing::Span, outcome: &Outcome) {
    let Some((kind, message)) = failure_of(outcome) else {
        return;
    };
    span.set_attribute("error.type", kind.clone());
    span.add_event(
        "exception",
        vec![
            KeyValue::new("exception.type", kind),
            KeyValue::new("exception.message", message.clone()),
        ],
    );
    span.set_status(Status::error(message));
}

/// The W3C `traceparent` of the current span when it is exported, or of the run's trace
/// with `fallback_span_id` when it is not.
pub fn current_traceparent(run_id: Uuid, fallback_span_id: u64) -> String {
    let context = tracing::Span::current().context();
    let current = context.span().span_context().clone();
    if current.is_valid() && current.trace_id() == trace_id(run_id) {
        format!("00-{}-{}-01", current.trace_id(), current.span_id())
    } else {
        traceparent(run_id, fallback_span_id)
    }
}

/// A W3C `traceparent`: version 00, the run id as trace id (so every call of a run is one
/// trace), the given span id (never zero) and the sampled flag.
pub fn traceparent(run_id: Uuid, span_id: u64) -> String {
    format!("00-{}-{:016x}-01", run_id.simple(), span_id.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_w3c_version_00_with_the_run_as_trace() {
        let run = Uuid::parse_str("0190f2a4-1b2c-7d3e-8f40-5a6b7c8d9e0f").unwrap();
        assert_eq!(
            traceparent(run, 0xab),
            "00-0190f2a41b2c7d3e8f405a6b7c8d9e0f-00000000000000ab-01"
        );
        // An all-zero span id is invalid in W3C trace context.
        assert!(traceparent(run, 0).ends_with("-0000000000000001-01"));
    }
}
