//! The `--metrics-listen` endpoint of workers and schedulers (`/metrics`, `/healthz`,
//! `/readyz`), served with the API's connection discipline, and `GET /metrics` itself.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use rein_process::exit;
use rein_process::telemetry::render;
use rein_store::Store;
use tokio_util::sync::CancellationToken;

/// `GET /metrics` in the Prometheus text format.
pub async fn metrics_handler(store: &Store) -> impl IntoResponse + use<> {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        render(store),
    )
}

/// Connections to a role's metrics endpoint: a scraper or two, and probes.
const METRICS_CONN_LIMITS: crate::server::ConnLimits = crate::server::ConnLimits {
    header_read_timeout: std::time::Duration::from_secs(10),
    idle_timeout: std::time::Duration::from_secs(60),
    connections_max: 32,
    connections_per_client_max: 8,
};

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` until `stop`; logs the bound
/// address. Errors are printed and returned as exit codes.
pub async fn serve(addr: SocketAddr, store: Store, stop: CancellationToken) -> Result<(), u8> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        eprintln!("error: cannot listen for metrics on {addr}: {e}");
        exit::INPUT
    })?;
    let bound = listener.local_addr().map_err(|e| {
        eprintln!("error: cannot read the metrics address: {e}");
        exit::INPUT
    })?;
    tracing::info!(address = %bound, "metrics, /healthz and /readyz listening");
    crate::server::register_metrics();
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(store): State<Store>| async move { metrics_handler(&store).await }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(store): State<Store>| async move {
                match store.check_schema().await {
                    Ok(()) => (StatusCode::OK, "ready".to_owned()),
                    Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}")),
                }
            }),
        )
        .with_state(store);
    // The same connection discipline as `rein api`: a half-sent request or a client holding
    // many connections cannot tie up a worker's file descriptors.
    tokio::spawn(crate::server::serve(
        listener,
        app,
        METRICS_CONN_LIMITS,
        stop,
    ));
    Ok(())
}
