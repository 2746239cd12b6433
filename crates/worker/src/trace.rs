//! Traces (SPEC O3): a span per run step (`rein.step`) and per action attempt
//! (`rein.action`). Every span of a run belongs to one trace whose id is the run id, so the
//! steps a run took on different workers, before and after a crash, line up in one trace
//! without passing anything between processes. When no OpenTelemetry layer is installed
//! these are plain `tracing` spans and cost next to nothing.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use uuid::Uuid;

/// The trace of `run_id`: its 128 bits are the trace id.
pub fn trace_id(run_id: Uuid) -> TraceId {
    TraceId::from_bytes(*run_id.as_bytes())
}

/// Makes `span` a child of the run's trace (a remote parent standing for the run itself).
pub fn link_to_run(span: &tracing::Span, run_id: Uuid) {
    let bytes = run_id.as_bytes();
    let mut root = [0u8; 8];
    root.copy_from_slice(&bytes[8..]);
    if root == [0; 8] {
        root[7] = 1; // an all-zero span id is invalid
    }
    let parent = SpanContext::new(
        trace_id(run_id),
        SpanId::from_bytes(root),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
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
