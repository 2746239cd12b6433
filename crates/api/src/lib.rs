//! `rein api`: the HTTP API (SPEC I3) with bearer tokens and scopes (SPEC Z1) and input limits
//! (SPEC Z2). Handlers live in `routes.rs`, the connection handling in `server.rs`; this module
//! holds the command, authentication, the error shape and the body's limits.

pub mod console;
pub mod error;
mod extract;
pub(crate) mod http_metrics;
pub mod metrics_endpoint;
mod moves;
mod recovery;
pub mod replays;
mod routes;
pub mod server;
pub mod stream;
mod trace_layer;
mod webhooks;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::{ALLOW, AUTHORIZATION, CONNECTION, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use rein_store::{Scope, Store, TokenInfo};
use tower_http::limit::RequestBodyLimitLayer;

pub use error::ApiError;
use rein_ops::Error;
use rein_process::{DbArgs, RedisArgs, exit, init_logging};

/// Request bodies larger than this are refused with 413 unless `--body-limit-bytes` says
/// otherwise.
pub const BODY_LIMIT_DEFAULT: u64 = 1024 * 1024;
/// Routes anyone may call: liveness and readiness probes, Prometheus metrics (counts and
/// ages, no run data) and the OpenAPI document (the API's shape, no tenant's data), so
/// client generators can read it from the URL.
const PUBLIC_PATHS: [&str; 4] = ["/healthz", "/readyz", "/metrics", "/openapi.json"];
/// The subject recorded for calls made with `--insecure-dev`.
const INSECURE_SUBJECT: &str = "insecure-dev";
/// Most bytes of a lower layer's plain-text refusal quoted in the JSON error that replaces it.
const REFUSAL_TEXT_BYTES_MAX: usize = 1024;

#[derive(clap::Args)]
pub struct ApiArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Address to listen on; port 0 picks a free one. The bound address is printed alone on
    /// the first line of stdout.
    #[arg(long, default_value = "127.0.0.1:7878")]
    listen: SocketAddr,
    /// Serve without authentication: every caller gets every scope. For local development
    /// only, so only on a loopback address (127.0.0.1, [::1]).
    #[arg(long)]
    insecure_dev: bool,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = BODY_LIMIT_DEFAULT,
          value_parser = clap::value_parser!(u64).range(1024..=64 * 1024 * 1024))]
    body_limit_bytes: u64,
    /// Separation of duties for every definition: whoever enqueued a run may not grant its
    /// approvals (as a definition's `[policy] approver_may_not_be_enqueuer = true` does for
    /// its own runs).
    #[arg(long)]
    approver_may_not_be_enqueuer: bool,
    /// A request's line and headers must arrive within this long of their first byte; a
    /// connection that sends half a request head is closed then.
    #[arg(long, value_name = "MS", default_value_t = server::HEADER_READ_TIMEOUT_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    header_read_timeout_ms: u64,
    /// A request's body must arrive whole within this long of its head (408 and the
    /// connection closed otherwise).
    #[arg(long, value_name = "MS", default_value_t = server::BODY_READ_TIMEOUT_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    body_read_timeout_ms: u64,
    /// A connection on which nothing moves for this long while no request is being answered
    /// is closed: one that never sends a request, an idle kept-alive one, or one whose client
    /// stopped reading its answer.
    #[arg(long, value_name = "MS", default_value_t = server::IDLE_TIMEOUT_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    idle_timeout_ms: u64,
    /// Connections open at once; one more is answered 503 (`Retry-After: 1`) and closed.
    /// Default: what the file-descriptor limit (`ulimit -n`) leaves after the database pool
    /// and a reserve of 32, at most 1024.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100_000))]
    max_connections: Option<u64>,
    /// Connections open at once from one client (an IPv4 address or an IPv6 /64); one more
    /// is answered 429 (`Retry-After: 1`) and closed. As each connection carries one request
    /// at a time, this is also how many requests a client has in flight.
    #[arg(long, value_name = "N", default_value_t = server::CONNECTIONS_PER_CLIENT_MAX_DEFAULT as u64,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    max_connections_per_client: u64,
    /// About the largest page `GET /v1/runs` and `GET /v1/runs/{id}/events` answer, in bytes:
    /// a page ends before the row that would pass it (always holding one row) and says so in
    /// `Rein-Page-Truncated`, with the cursor of the rest.
    #[arg(long, value_name = "BYTES", default_value_t = rein_ops::service::PAGE_BYTES_MAX_DEFAULT as u64,
          value_parser = clap::value_parser!(u64).range(64 * 1024..=64 * 1024 * 1024))]
    page_bytes_max: u64,
    /// Run streams (`GET /v1/runs/{id}/stream`) open at once; one more is answered 503
    /// (`Retry-After: 1`). Each holds a connection, so keep it below --max-connections.
    #[arg(long, value_name = "N", default_value_t = stream::STREAMS_MAX_DEFAULT as u64,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    max_streams: u64,
    /// Replays of runs' logs (`GET /v1/runs/{id}/whatif`, `/verify`, `POST
    /// /v1/runs/{id}/fork`) running at once, each on a thread of its own at a lower priority
    /// than requests; one more is answered 503 (`Retry-After`).
    #[arg(long, value_name = "N", default_value_t = replays::REPLAYS_MAX_DEFAULT as u64,
          value_parser = clap::value_parser!(u64).range(1..=256))]
    max_replays: u64,
    /// Replays one token may have running at once; one more is answered 429 (`Retry-After`).
    #[arg(long, value_name = "N", default_value_t = replays::REPLAYS_PER_TOKEN_MAX_DEFAULT as u64,
          value_parser = clap::value_parser!(u64).range(1..=256))]
    max_replays_per_token: u64,
    /// How often an open run stream reads the run's row for new events, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = rein_ops::stream::POLL_INTERVAL_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(20..=10_000))]
    stream_poll_ms: u64,
    /// Serve the web console's files from this directory, read on every request, instead
    /// of the copies built into the binary (to see changes to them without a build).
    #[arg(long, value_name = "DIR", conflicts_with = "no_console")]
    console_dir: Option<std::path::PathBuf>,
    /// Serve no web console: `/` and `/console/...` answer 404; the API is unchanged.
    #[arg(long)]
    no_console: bool,
    // Redis: wake-ups after commits, the fleet-wide limits `GET /v1/limits` shows, and the
    // live deltas a run stream carries (without it, streams carry committed events only).
    #[command(flatten)]
    redis: RedisArgs,
    // Where each model key may be sent: a definition whose model state would send a key
    // elsewhere is refused at registration.
    #[command(flatten)]
    model_keys: rein_process::ModelKeyArgs,
}

/// What one request may take.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub body_bytes_max: usize,
    pub body_read_timeout: Duration,
    /// About the most bytes of rows one page of a list carries.
    pub page_bytes_max: usize,
    /// Run streams open at once.
    pub streams_max: usize,
    /// How often an open run stream reads the run's row.
    pub stream_poll_ms: u64,
    /// How often a quiet run stream sends a comment: well inside the connection's idle
    /// timeout, which would otherwise close it.
    pub stream_keep_alive_ms: u64,
    /// Replays of runs' logs (what-if, verify, fork) at once, and for one token.
    pub replays_max: usize,
    pub replays_per_token_max: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            body_bytes_max: BODY_LIMIT_DEFAULT as usize,
            body_read_timeout: Duration::from_millis(server::BODY_READ_TIMEOUT_MS_DEFAULT),
            page_bytes_max: rein_ops::service::PAGE_BYTES_MAX_DEFAULT,
            streams_max: stream::STREAMS_MAX_DEFAULT,
            stream_poll_ms: rein_ops::stream::POLL_INTERVAL_MS_DEFAULT,
            stream_keep_alive_ms: stream::keep_alive_ms(server::IDLE_TIMEOUT_MS_DEFAULT),
            replays_max: replays::REPLAYS_MAX_DEFAULT,
            replays_per_token_max: replays::REPLAYS_PER_TOKEN_MAX_DEFAULT,
        }
    }
}

/// What every handler shares.
pub struct App {
    pub store: Store,
    insecure_dev: bool,
    pub limits: Limits,
    /// The OpenAPI document, set once the router is built.
    pub openapi: OnceLock<utoipa::openapi::OpenApi>,
    /// Where the fleet-wide limits live, when this API was given a Redis.
    pub redis: Option<rein_accel::RedisConfig>,
    /// One permit per open run stream.
    pub streams: Arc<tokio::sync::Semaphore>,
    /// The threads that replay runs' logs, and their caps.
    pub replays: Arc<replays::Replays>,
    /// Where each model key may be sent (`--model-key`), checked at registration.
    pub model_keys: rein_core::model_keys::KeyBindings,
}

/// The authenticated caller of a request.
#[derive(Clone)]
pub struct Caller(pub TokenInfo);

impl Caller {
    /// The caller, if the token carries `scope`; 403 otherwise.
    pub fn require(&self, scope: Scope) -> Result<&TokenInfo, Error> {
        if self.0.allows(scope) {
            Ok(&self.0)
        } else {
            Err(Error::forbidden(scope))
        }
    }
}

/// The API's router and its OpenAPI document, around a store.
pub fn router(
    store: Store,
    insecure_dev: bool,
    limits: Limits,
    redis: Option<rein_accel::RedisConfig>,
) -> axum::Router {
    router_with_console(
        store,
        insecure_dev,
        limits,
        redis,
        console::Console::Embedded,
        Default::default(),
    )
}

/// [`router`], serving the web console from `console`.
pub fn router_with_console(
    store: Store,
    insecure_dev: bool,
    limits: Limits,
    redis: Option<rein_accel::RedisConfig>,
    console: console::Console,
    model_keys: rein_core::model_keys::KeyBindings,
) -> axum::Router {
    let replays = replays::Replays::new(limits.replays_max, limits.replays_per_token_max);
    router_with_replays(
        store,
        insecure_dev,
        limits,
        redis,
        console,
        model_keys,
        replays,
    )
}

/// [`router_with_console`] on the replay threads `replays` (which a test or a measurement
/// can hold and count).
pub fn router_with_replays(
    store: Store,
    insecure_dev: bool,
    limits: Limits,
    redis: Option<rein_accel::RedisConfig>,
    console: console::Console,
    model_keys: rein_core::model_keys::KeyBindings,
    replays: Arc<replays::Replays>,
) -> axum::Router {
    let app = Arc::new(App {
        store,
        insecure_dev,
        limits,
        openapi: OnceLock::new(),
        redis,
        streams: Arc::new(tokio::sync::Semaphore::new(limits.streams_max)),
        replays,
        model_keys,
    });
    let (router, doc) = routes::router().split_for_parts();
    http_metrics::register(&doc);
    let _ = app.openapi.set(doc);
    let console_routes = axum::Router::new()
        .route(console::PAGE_PATH, axum::routing::get(console::page))
        .route("/console/{*path}", axum::routing::get(console::asset))
        .with_state(console);
    router
        .merge(console_routes)
        .fallback(|| async { ApiError::from(Error::not_found("no such route".to_owned())) })
        .layer(middleware::from_fn_with_state(app.clone(), read_body))
        .layer(middleware::from_fn(refuse_nul))
        .layer(middleware::from_fn_with_state(app.clone(), authenticate))
        // The limit layer governs; axum's own 2 MB default for buffered bodies is off.
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(limits.body_bytes_max))
        .layer(middleware::map_response(json_errors))
        .layer(middleware::from_fn(trace_layer::trace_request))
        .layer(middleware::from_fn(http_metrics::record))
        .with_state(app)
}

/// The OpenAPI document `GET /openapi.json` serves, built from the same routes.
pub fn document() -> utoipa::openapi::OpenApi {
    routes::router().split_for_parts().1
}

/// Serves `app` on `listener` in this process (`rein demo`) with the default connection
/// limits, until `stop`.
pub async fn serve_in_process(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    stop: tokio_util::sync::CancellationToken,
) {
    let limits = server::ConnLimits {
        header_read_timeout: Duration::from_millis(server::HEADER_READ_TIMEOUT_MS_DEFAULT),
        idle_timeout: Duration::from_millis(server::IDLE_TIMEOUT_MS_DEFAULT),
        connections_max: server::connections_max_default(rein_store::POOL_MAX_DEFAULT),
        connections_per_client_max: server::CONNECTIONS_PER_CLIENT_MAX_DEFAULT,
    };
    server::serve(listener, app, limits, stop).await;
}

/// Whether `ip` reaches only this host.
fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

pub async fn serve(args: ApiArgs) -> u8 {
    if args.insecure_dev && !is_loopback(args.listen.ip()) {
        eprintln!(
            "error: --insecure-dev serves every caller as admin, so it listens only on a loopback address (127.0.0.1 or [::1]), not {}; to serve other hosts, leave out --insecure-dev and give callers tokens (`rein tokens create`)",
            args.listen
        );
        return exit::INPUT;
    }
    let console = match (args.console_dir.clone(), args.no_console) {
        (_, true) => console::Console::Off,
        (Some(dir), false) => {
            if !dir.join("index.html").is_file() {
                eprintln!(
                    "error: --console-dir {}: no index.html there; give the directory that holds the console's files (crates/api/console in the source tree)",
                    dir.display()
                );
                return exit::INPUT;
            }
            console::Console::Dir(dir)
        }
        (None, false) => console::Console::Embedded,
    };
    let redaction_key = match rein_process::redaction_key() {
        Ok(key) => key,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    let model_keys = match args.model_keys.bindings() {
        Ok(keys) => keys,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    init_logging(true);
    if redaction_key.is_none() {
        tracing::info!(
            "no REIN_REDACTION_KEY: POST /v1/runs/{{id}}/redact answers 503 until the API is started with one"
        );
    }
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    if args.insecure_dev {
        let warning = "--insecure-dev: AUTHENTICATION IS OFF; anyone who can reach this address may enqueue, send events and decide approvals. Never use this outside local development.";
        eprintln!("WARNING: {warning}");
        tracing::warn!("{warning}");
    }
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {}: {e}", args.listen);
            return exit::INPUT;
        }
    };
    let bound = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: cannot read the bound address: {e}");
            return exit::INPUT;
        }
    };
    // Before the address is printed: from then on SIGTERM means a graceful stop.
    let stop = rein_process::shutdown_signal();
    println!("http://{bound}");
    {
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
    let connections_max = args.max_connections.map_or_else(
        || server::connections_max_default(args.db.db_pool_max),
        |n| n as usize,
    );
    let conn_limits = server::ConnLimits {
        header_read_timeout: Duration::from_millis(args.header_read_timeout_ms),
        idle_timeout: Duration::from_millis(args.idle_timeout_ms),
        connections_max,
        connections_per_client_max: (args.max_connections_per_client as usize).min(connections_max),
    };
    let limits = Limits {
        body_bytes_max: args.body_limit_bytes as usize,
        body_read_timeout: Duration::from_millis(args.body_read_timeout_ms),
        page_bytes_max: args.page_bytes_max as usize,
        streams_max: args.max_streams as usize,
        stream_poll_ms: args.stream_poll_ms,
        stream_keep_alive_ms: stream::keep_alive_ms(args.idle_timeout_ms),
        replays_max: args.max_replays as usize,
        replays_per_token_max: args.max_replays_per_token as usize,
    };
    tracing::info!(address = %bound, auth = !args.insecure_dev,
        max_connections = conn_limits.connections_max,
        max_connections_per_client = conn_limits.connections_per_client_max,
        "rein api listening");
    rein_process::telemetry::install_with(
        "api",
        &[(
            http_metrics::HTTP_REQUEST_DURATION,
            &http_metrics::DURATION_BUCKETS_S,
        )],
    );
    http_metrics::describe();
    server::register_metrics();
    stream::register_metrics();
    replays::register_metrics();
    let store = args
        .redis
        .publishing(store, &stop)
        .with_approver_separation(args.approver_may_not_be_enqueuer)
        .with_redaction_key(redaction_key);
    let app = router_with_console(
        store,
        args.insecure_dev,
        limits,
        args.redis.config(),
        console,
        model_keys,
    );
    server::serve(listener, app, conn_limits, stop).await;
    exit::OK
}

/// Checks the bearer token of every request but the probes and records the caller.
async fn authenticate(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    if PUBLIC_PATHS.contains(&req.uri().path()) || console::is_console_path(req.uri().path()) {
        return next.run(req).await;
    }
    let caller = if app.insecure_dev {
        TokenInfo {
            token_id: uuid::Uuid::nil(),
            subject: INSECURE_SUBJECT.to_owned(),
            scopes: vec![Scope::Admin.as_str().to_owned()],
            bounds: rein_store::TokenBounds::default(),
        }
    } else {
        let secret = match bearer(req.headers().get(AUTHORIZATION)) {
            Ok(s) => s,
            Err(e) => return ApiError::from(e).into_response(),
        };
        match app.store.verify_token(&secret).await {
            Ok(Some(info)) => info,
            Ok(None) => {
                return ApiError::from(Error::unauthorized(
                    "the bearer token is unknown or revoked",
                ))
                .into_response();
            }
            Err(e) => return ApiError::from(e).into_response(),
        }
    };
    req.extensions_mut().insert(Caller(caller));
    next.run(req).await
}

/// Reads the request body whole before any handler runs, within `--body-read-timeout-ms`: a
/// client that stops sending halfway gets 408 and its connection is closed, instead of
/// holding a handler and a connection for as long as it likes.
async fn read_body(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let read = axum::body::to_bytes(body, app.limits.body_bytes_max);
    let closing = |e: ApiError| {
        let mut response = e.into_response();
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
        response
    };
    let bytes = match tokio::time::timeout(app.limits.body_read_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) if exceeds_limit(&e) => {
            return ApiError::from(Error::payload_too_large()).into_response();
        }
        Ok(Err(e)) => {
            return closing(ApiError::transport(
                StatusCode::BAD_REQUEST,
                Some(format!("the body could not be read ({e})")),
            ));
        }
        Err(_) => {
            return closing(ApiError::transport(
                StatusCode::REQUEST_TIMEOUT,
                Some(format!(
                    "the body was not whole after {} ms",
                    app.limits.body_read_timeout.as_millis()
                )),
            ));
        }
    };
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// Whether reading a body failed because it passed the body limit.
fn exceeds_limit(e: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Refuses a path or query parameter with a NUL character (`%00`), which PostgreSQL cannot
/// store, naming it, before any handler sees it (SPEC Z2). Bodies are checked where they
/// are stored.
async fn refuse_nul(req: Request, next: Next) -> Response {
    match nul_free(req.uri()) {
        Ok(()) => next.run(req).await,
        Err(e) => ApiError::from(e).into_response(),
    }
}

fn nul_free(uri: &axum::http::Uri) -> Result<(), Error> {
    // A NUL byte can only come from `%00` once the path is decoded.
    if uri.path().to_ascii_lowercase().contains("%00") {
        return Err(Error::validation(
            "the path contains a NUL character (%00), which cannot be stored",
        )
        .with_details(serde_json::json!({ "field": "path" })));
    }
    if uri.query().is_some()
        && let Ok(axum::extract::Query(pairs)) =
            axum::extract::Query::<Vec<(String, String)>>::try_from_uri(uri)
    {
        for (name, value) in pairs {
            let field = name.replace('\0', "\\u0000");
            rein_store::input::check_text(&field, &name)
                .and_then(|()| rein_store::input::check_text(&field, &value))?;
        }
    }
    Ok(())
}

fn bearer(header: Option<&HeaderValue>) -> Result<String, Error> {
    let Some(value) = header else {
        return Err(Error::unauthorized(
            "an `Authorization: Bearer TOKEN` header is required",
        ));
    };
    let text = value
        .to_str()
        .map_err(|_| Error::unauthorized("the Authorization header is not ASCII"))?;
    match text.split_once(' ') {
        Some((scheme, token))
            if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() =>
        {
            Ok(token.trim().to_owned())
        }
        _ => Err(Error::unauthorized(
            "the Authorization header must be `Bearer TOKEN`",
        )),
    }
}

/// Turns every refusal of the layers below that is not in the API's JSON error shape (a body
/// too large, a method a route does not take, an extractor's rejection) into that shape,
/// quoting the layer's own text where it says more than the status.
async fn json_errors(response: Response) -> Response {
    let is_json = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let status = response.status();
    if is_json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (parts, body) = response.into_parts();
    let said = match status {
        StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED | StatusCode::PAYLOAD_TOO_LARGE => {
            None
        }
        _ => axum::body::to_bytes(body, REFUSAL_TEXT_BYTES_MAX)
            .await
            .ok()
            .and_then(|text| String::from_utf8(text.to_vec()).ok()),
    };
    let mut json = ApiError::transport(status, said).into_response();
    for name in [ALLOW, RETRY_AFTER, CONNECTION] {
        if let Some(value) = parts.headers.get(&name) {
            json.headers_mut().insert(name, value.clone());
        }
    }
    json
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn refused_as(status: StatusCode, text: &str) -> (StatusCode, serde_json::Value) {
        let plain = Response::builder()
            .status(status)
            .header(CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(axum::body::Body::from(text.to_owned()))
            .unwrap();
        let json = json_errors(plain).await;
        assert_eq!(json.headers()[CONTENT_TYPE], "application/json", "{status}");
        let status = json.status();
        let body = axum::body::to_bytes(json.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn every_plain_refusal_of_a_lower_layer_becomes_the_json_error_shape() {
        for (status, code) in [
            (StatusCode::BAD_REQUEST, "bad_request"),
            (StatusCode::NOT_FOUND, "not_found"),
            (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            (StatusCode::URI_TOO_LONG, "uri_too_long"),
            (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type"),
            (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        ] {
            let (s, v) = refused_as(status, "Expected `Content-Type: application/json`").await;
            assert_eq!(s, status);
            assert_eq!(v["error"]["code"], code, "{status}: {v}");
            assert!(
                rein_ops::Code::parse(code).is_some(),
                "{code} is a documented code"
            );
            let message = v["error"]["message"].as_str().unwrap();
            assert!(!message.is_empty(), "{status}: {v}");
            if status == StatusCode::UNSUPPORTED_MEDIA_TYPE {
                assert!(message.contains("Content-Type: application/json"), "{v}");
            }
        }
        // Answers that are not refusals stay as they are.
        let ok = Response::builder()
            .status(StatusCode::OK)
            .header(CONTENT_TYPE, "text/plain")
            .body(axum::body::Body::from("metrics"))
            .unwrap();
        assert_eq!(json_errors(ok).await.headers()[CONTENT_TYPE], "text/plain");
    }

    #[test]
    fn insecure_dev_listens_only_on_loopback_addresses() {
        for (address, loopback) in [
            ("127.0.0.1", true),
            ("127.1.2.3", true),
            ("::1", true),
            ("::ffff:127.0.0.1", true),
            ("0.0.0.0", false),
            ("::", false),
            ("192.168.1.10", false),
            ("::ffff:10.0.0.1", false),
        ] {
            let ip: IpAddr = address.parse().unwrap();
            assert_eq!(is_loopback(ip), loopback, "{address}");
        }
    }
}
