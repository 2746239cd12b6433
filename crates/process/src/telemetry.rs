//! Prometheus metrics for every role (SPEC O2): the exporter (metrics-exporter-prometheus,
//! rendering on request, no HTTP server of its own; `rein_api::metrics_endpoint` serves it),
//! and the fleet gauges a scheduler reads from the database. And traces (SPEC O3): OTLP export of the worker's
//! spans when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` variable is set.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;
use std::time::Duration;

use metrics::gauge;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use rein_store::Store;
use rein_store::metrics as m;
use tokio_util::sync::CancellationToken;

/// Histogram buckets in seconds, from a fast claim (1 ms) to a long approval wait (4 h).
const BUCKETS_S: [f64; 19] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, 1800.0, 3600.0, 14_400.0,
];

/// How often a scheduler reads the fleet gauges from the database.
pub const FLEET_GAUGES_EVERY: Duration = Duration::from_secs(5);

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder (once) and records `rein_build_info` for `role`.
pub fn install(role: &str) -> Option<&'static PrometheusHandle> {
    install_with(role, &[])
}

/// Like [`install`], with histogram buckets of their own for the named families (seconds).
pub fn install_with(role: &str, buckets: &[(&str, &[f64])]) -> Option<&'static PrometheusHandle> {
    if HANDLE.get().is_none() {
        let built = PrometheusBuilder::new()
            .set_buckets(&BUCKETS_S)
            .and_then(|builder| {
                buckets.iter().try_fold(builder, |b, (name, values)| {
                    b.set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Full((*name).to_owned()),
                        values,
                    )
                })
            })
            .map(|b| b.install_recorder());
        match built {
            Ok(Ok(handle)) => {
                let _ = HANDLE.set(handle);
            }
            Ok(Err(e)) | Err(e) => {
                tracing::warn!(error = %e, "metrics are off: cannot install the exporter");
                return None;
            }
        }
    }
    m::describe();
    rein_accel::describe_metrics();
    metrics_process::Collector::default().describe();
    // Every family at 0 from the start (the role's own register theirs as they start).
    m::register_engine();
    rein_accel::register_metrics();
    gauge!(m::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "role" => role.to_owned())
        .set(1.0);
    HANDLE.get()
}

/// The Prometheus text of everything recorded so far (empty when no recorder is installed),
/// with the pool gauges of `store` read now.
pub fn render(store: &Store) -> String {
    m::record_pool(store);
    metrics_process::Collector::default().collect();
    HANDLE
        .get()
        .map(PrometheusHandle::render)
        .unwrap_or_default()
}

/// A gauge with its labels.
type Series = (&'static str, Vec<(&'static str, String)>);

/// The fleet gauges as series, their labels capped ([`m::label`]): the values that fall
/// into one series add up (counts) or keep the largest (ages).
fn fleet_series(g: &rein_store::FleetGauges) -> BTreeMap<Series, f64> {
    let mut series: BTreeMap<Series, f64> = BTreeMap::new();
    let mut add = |name: &'static str, labels: &[(&'static str, &str)], v: f64, sum: bool| {
        let labels = labels
            .iter()
            .map(|(k, value)| (*k, m::label(name, k, value)))
            .collect();
        let slot = series
            .entry((name, labels))
            .or_insert(if sum { 0.0 } else { v });
        *slot = if sum { *slot + v } else { slot.max(v) };
    };
    for (d, s, n) in &g.runs {
        add(
            m::RUNS,
            &[("definition", d), ("status", s)],
            *n as f64,
            true,
        );
    }
    for (d, s, secs) in &g.oldest_in_state {
        add(
            m::RUNS_OLDEST_IN_STATE,
            &[("definition", d), ("status", s)],
            *secs,
            false,
        );
    }
    for (d, n) in &g.retrying {
        add(m::RUNS_RETRYING, &[("definition", d)], *n as f64, true);
    }
    for (q, depth, age) in &g.queues {
        add(m::QUEUE_DEPTH, &[("queue", q)], *depth as f64, true);
        add(m::QUEUE_OLDEST_AGE, &[("queue", q)], *age, false);
    }
    add(m::APPROVALS_PENDING, &[], g.approvals_pending as f64, true);
    add(m::APPROVALS_OLDEST_AGE, &[], g.approvals_oldest_s, false);
    series
}

/// Reads the fleet gauges every [`FLEET_GAUGES_EVERY`] until `stop`. A label set that
/// disappears (no run left in that state) is set to 0 rather than left at its last value.
pub async fn fleet_gauges(store: Store, stop: CancellationToken) {
    m::register_fleet();
    let mut seen: BTreeSet<Series> = BTreeSet::new();
    loop {
        match store.fleet_gauges().await {
            Ok(g) => {
                let now = fleet_series(&g);
                for ((name, labels), v) in &now {
                    gauge!(*name, to_labels(labels)).set(*v);
                }
                for (name, labels) in seen.iter().filter(|s| !now.contains_key(*s)) {
                    gauge!(*name, to_labels(labels)).set(0.0);
                }
                seen = now.into_keys().collect();
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the fleet gauges; retrying"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(FLEET_GAUGES_EVERY) => {}
        }
    }
}

fn to_labels(labels: &[(&'static str, String)]) -> Vec<metrics::Label> {
    labels
        .iter()
        .map(|(k, v)| metrics::Label::new(*k, v.clone()))
        .collect()
}

static TRACER: OnceLock<opentelemetry_sdk::trace::SdkTracerProvider> = OnceLock::new();

/// The OpenTelemetry layer exporting spans over OTLP/HTTP, when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set;
/// `OTEL_EXPORTER_OTLP_PROTOCOL` picks `http/protobuf` (default) or `http/json`, and
/// `OTEL_SERVICE_NAME` names the service (default `rein`). Spans go out in batches from a
/// thread of their own; [`flush_traces`] sends what is left at exit.
pub fn otel_layer<S>() -> Option<impl tracing_subscriber::Layer<S>>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    if !set("OTEL_EXPORTER_OTLP_ENDPOINT") && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        return None;
    }
    let protocol = match std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .as_deref()
    {
        Ok("http/json") => Protocol::HttpJson,
        Ok("http/protobuf") | Err(_) => Protocol::HttpBinary,
        Ok(other) => {
            eprintln!(
                "warning: OTEL_EXPORTER_OTLP_PROTOCOL={other} is not supported; exporting traces as http/protobuf"
            );
            Protocol::HttpBinary
        }
    };
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol)
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            eprintln!("warning: traces are off: cannot set up the OTLP exporter: {e}");
            return None;
        }
    };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name("rein");
    }
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(Reporting::new(exporter))
        .with_id_generator(rein_store::trace::RunIds::default())
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer(rein_store::trace::SCOPE);
    // Root spans of new runs are sent through the global provider (`rein_store::trace`).
    opentelemetry::global::set_tracer_provider(provider.clone());
    let _ = TRACER.set(provider);
    Some(tracing_opentelemetry::layer().with_tracer(tracer))
}

/// An exporter that says when the collector cannot be reached: once at WARN when exports
/// start failing, once at INFO when they work again, not once per batch.
#[derive(Debug)]
struct Reporting<E> {
    inner: E,
    failing: std::sync::atomic::AtomicBool,
}

impl<E> Reporting<E> {
    fn new(inner: E) -> Reporting<E> {
        Reporting {
            inner,
            failing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn report(&self, result: &opentelemetry_sdk::error::OTelSdkResult) {
        use std::sync::atomic::Ordering;
        match result {
            Err(e) => {
                if !self.failing.swap(true, Ordering::AcqRel) {
                    tracing::warn!(error = %e,
                        "cannot send traces to the OTLP collector; their spans are lost until it is reachable again");
                }
            }
            Ok(()) => {
                if self.failing.swap(false, Ordering::AcqRel) {
                    tracing::info!("traces reach the OTLP collector again");
                }
            }
        }
    }
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for Reporting<E>
{
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let result = self.inner.export(batch).await;
        self.report(&result);
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// Sends the spans still buffered (at exit).
pub fn flush_traces() {
    if let Some(provider) = TRACER.get()
        && let Err(e) = provider.shutdown()
    {
        eprintln!("warning: could not send the last traces: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fleet_gauges_of_many_definitions_and_queues_keep_a_bounded_number_of_series() {
        let max = rein_core::limits::METRIC_LABEL_VALUES_MAX;
        let n = max + 50;
        let g = rein_store::FleetGauges {
            runs: (0..n)
                .map(|i| (format!("tenant-{i}"), "runnable".to_owned(), 2))
                .collect(),
            oldest_in_state: (0..n)
                .map(|i| (format!("tenant-{i}"), "runnable".to_owned(), i as f64))
                .collect(),
            retrying: (0..n).map(|i| (format!("tenant-{i}"), 1)).collect(),
            queues: (0..n).map(|i| (format!("q-{i}"), 3, i as f64)).collect(),
            approvals_pending: 0,
            approvals_oldest_s: 0.0,
        };
        let series = fleet_series(&g);
        for name in [
            m::RUNS,
            m::RUNS_OLDEST_IN_STATE,
            m::RUNS_RETRYING,
            m::QUEUE_DEPTH,
            m::QUEUE_OLDEST_AGE,
        ] {
            let of: Vec<(&Vec<(&str, String)>, f64)> = series
                .iter()
                .filter(|((n, _), _)| *n == name)
                .map(|((_, labels), v)| (labels, *v))
                .collect();
            assert_eq!(of.len(), max + 1, "{name}: {} series", of.len());
            let other = of
                .iter()
                .find(|(labels, _)| labels.iter().any(|(_, v)| v == "other"))
                .map(|(_, v)| *v)
                .unwrap_or_else(|| panic!("{name} has an `other` series"));
            let expected = match name {
                // Counts add up; ages keep the oldest.
                n if n == m::RUNS => 2.0 * 50.0,
                n if n == m::RUNS_RETRYING => 50.0,
                n if n == m::QUEUE_DEPTH => 3.0 * 50.0,
                _ => (n - 1) as f64,
            };
            assert_eq!(other, expected, "{name}");
        }
    }
}
