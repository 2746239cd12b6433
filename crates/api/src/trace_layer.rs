//! A server span per API request (SPEC O3), named and described by the OpenTelemetry HTTP
//! semantic conventions: `METHOD ROUTE` with `http.request.method`, `http.route` (the
//! route's template, not the path), `url.path` and `http.response.status_code`; a 5xx
//! answer is an error. An incoming W3C `traceparent` makes it a child of the caller's span,
//! so the caller's trace shows the request; the run it creates keeps its own trace and
//! links back (`rein_store::trace::RunRoot::traceparent`).

use axum::extract::{MatchedPath, Request};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry::trace::TraceContextExt;
use tracing::Instrument;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The header carrying the caller's trace context (W3C Trace Context).
pub const TRACEPARENT: &str = "traceparent";

/// The request's `traceparent` header, when it is readable text.
pub fn traceparent(headers: &HeaderMap) -> Option<&str> {
    headers.get(TRACEPARENT)?.to_str().ok()
}

/// Runs the request inside its span and records the answer's status on it.
pub async fn trace_request(request: Request, next: Next) -> Response {
    let method = request.method().as_str().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned());
    let name = match &route {
        Some(route) => format!("{method} {route}"),
        None => method.clone(),
    };
    let span = tracing::info_span!("http.request", otel.name = %name, otel.kind = "server",
        http.request.method = %method, http.route = route.as_deref(),
        url.path = %request.uri().path(), http.response.status_code = Empty,
        otel.status_code = Empty);
    if let Some(caller) =
        traceparent(request.headers()).and_then(rein_store::trace::parse_traceparent)
    {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(caller));
    }
    let response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    response
}
