//! The trace of a run (SPEC O3). A run is one trace whose id is the run id, and whose root
//! span `rein.run` is sent once, when the run is created; its span id is derived from the
//! run id too, so a worker or scheduler anywhere, any time later, parents its spans to it
//! without reading anything. A run may wait days and move between workers: it still renders
//! as one tree.
//!
//! The root span goes through the process's global tracer provider (a no-op until
//! OpenTelemetry export is installed). Its ids are chosen here, which an SDK tracer does not
//! let a span builder do, so the provider must use [`RunIds`] as its id generator.

use std::cell::Cell;

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use uuid::Uuid;

/// The instrumentation scope of every span Rein sends.
pub const SCOPE: &str = "rein";

/// The trace of `run_id`: its 128 bits are the trace id.
pub fn trace_id(run_id: Uuid) -> TraceId {
    TraceId::from_bytes(*run_id.as_bytes())
}

/// The span id of the run's root span: the low 64 bits of the run id (a UUIDv7's random
/// part), never zero.
pub fn root_span_id(run_id: Uuid) -> SpanId {
    let mut id = [0u8; 8];
    id.copy_from_slice(&run_id.as_bytes()[8..]);
    if id == [0; 8] {
        id[7] = 1; // an all-zero span id is invalid
    }
    SpanId::from_bytes(id)
}

/// The run's root span, as a parent seen from another process.
pub fn root_span_context(run_id: Uuid) -> SpanContext {
    SpanContext::new(
        trace_id(run_id),
        root_span_id(run_id),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    )
}

/// Makes `span` a child of the run's root span.
pub fn parent_to_run(span: &tracing::Span, run_id: Uuid) {
    let parent = Context::new().with_remote_span_context(root_span_context(run_id));
    let _ = span.set_parent(parent);
}

/// A W3C `traceparent` header value (version 00) as a span context; `None` when it is not
/// one (a malformed header is ignored, as the W3C recommendation asks).
pub fn parse_traceparent(value: &str) -> Option<SpanContext> {
    let mut parts = value.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    // Version ff is invalid; a later version may add fields after the four known ones.
    if !hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
        return None;
    }
    let context = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        TraceState::default(),
    );
    context.is_valid().then_some(context)
}

/// What the root span of a new run says.
#[derive(Debug, Clone, Copy)]
pub struct RunRoot<'a> {
    pub run_id: Uuid,
    pub definition: &'a str,
    pub queue: &'a str,
    /// The run that started this one (a fan-out's branch): linked, as its own trace.
    pub parent_run_id: Option<Uuid>,
    /// The `traceparent` of whoever asked for the run (an agent calling the API): linked,
    /// not made the parent, so the run's trace id stays its run id.
    pub traceparent: Option<&'a str>,
}

thread_local! {
    /// Ids [`RunIds`] hands out next on this thread instead of random ones.
    static PINNED: Cell<(Option<TraceId>, Option<SpanId>)> = const { Cell::new((None, None)) };
}

/// Sends the root span `rein.run` of a run just created (a moment long, at its creation).
pub fn run_root_span(root: RunRoot<'_>) {
    let tracer = opentelemetry::global::tracer(SCOPE);
    let mut attributes = vec![
        KeyValue::new("rein.run.id", root.run_id.to_string()),
        KeyValue::new("rein.definition", root.definition.to_owned()),
        KeyValue::new("rein.queue", root.queue.to_owned()),
    ];
    let mut links = Vec::new();
    if let Some(parent) = root.parent_run_id {
        attributes.push(KeyValue::new("rein.parent_run.id", parent.to_string()));
        links.push(Link::with_context(root_span_context(parent)));
    }
    if let Some(caller) = root.traceparent.and_then(parse_traceparent) {
        links.push(Link::with_context(caller));
    }
    let builder = tracer
        .span_builder("rein.run")
        .with_kind(SpanKind::Producer)
        .with_attributes(attributes)
        .with_links(links);
    PINNED.with(|p| p.set((Some(trace_id(root.run_id)), Some(root_span_id(root.run_id)))));
    // No parent: the run's trace starts here, whatever span the caller is in.
    let mut span = tracer.build_with_context(builder, &Context::new());
    PINNED.with(|p| p.set((None, None)));
    span.end();
    // And the other way: the span that created the run (an API request, a parent's step)
    // points at the new run's trace.
    tracing::Span::current().add_link(root_span_context(root.run_id));
}

/// The id generator of a tracer provider that sends root spans: random ids, except for the
/// root span [`run_root_span`] is building on this thread.
#[derive(Debug, Default)]
pub struct RunIds(opentelemetry_sdk::trace::RandomIdGenerator);

impl opentelemetry_sdk::trace::IdGenerator for RunIds {
    fn new_trace_id(&self) -> TraceId {
        let pinned = PINNED.with(|p| {
            let (trace, span) = p.get();
            p.set((None, span));
            trace
        });
        pinned.unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        let pinned = PINNED.with(|p| {
            let (trace, span) = p.get();
            p.set((trace, None));
            span
        });
        pinned.unwrap_or_else(|| self.0.new_span_id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_w3c_traceparent_parses_and_anything_else_is_ignored() {
        let good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let context = parse_traceparent(good).expect("valid");
        assert_eq!(
            context.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(context.span_id().to_string(), "b7ad6b7169203331");
        assert!(context.is_sampled());
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
        // A later version may carry more fields.
        assert!(parse_traceparent(&format!("01-{}-01-more", &good[3..52])).is_some());
    }

    #[test]
    fn the_root_span_id_is_the_run_ids_low_half_and_never_zero() {
        let run = Uuid::parse_str("0190f2a4-1b2c-7d3e-8f40-5a6b7c8d9e0f").unwrap();
        assert_eq!(root_span_id(run).to_string(), "8f405a6b7c8d9e0f");
        assert_eq!(
            trace_id(run).to_string(),
            "0190f2a41b2c7d3e8f405a6b7c8d9e0f"
        );
        let low_zero = Uuid::from_u128(0xabcd_u128 << 64);
        assert_eq!(root_span_id(low_zero).to_string(), "0000000000000001");
    }
}
