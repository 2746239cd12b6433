//! `rein api`: the HTTP API (SPEC I3) with bearer tokens and scopes (SPEC Z1) and input limits
//! (SPEC Z2). Handlers live in `routes.rs`; this module holds the server, authentication, the
//! error shape and the body limit.

pub mod error;
mod routes;
pub mod schema;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use rein_store::{Scope, Store, TokenInfo};
use tower_http::limit::RequestBodyLimitLayer;

use crate::{DbArgs, exit, init_logging, ops};
pub use error::ApiError;

/// Request bodies larger than this are refused with 413 unless `--body-limit-bytes` says
/// otherwise.
pub const BODY_LIMIT_DEFAULT: u64 = 1024 * 1024;
/// Routes anyone may call: liveness and readiness probes, and Prometheus metrics (counts
/// and ages, no run data).
const PUBLIC_PATHS: [&str; 3] = ["/healthz", "/readyz", "/metrics"];
/// The subject recorded for calls made with `--insecure-dev`.
const INSECURE_SUBJECT: &str = "insecure-dev";

#[derive(clap::Args)]
pub struct ApiArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Address to listen on; port 0 picks a free one. The bound address is printed alone on
    /// the first line of stdout.
    #[arg(long, default_value = "127.0.0.1:7878")]
    listen: SocketAddr,
    /// Serve without authentication: every caller gets every scope. For local development
    /// only.
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
    #[command(flatten)]
    redis: crate::RedisArgs,
}

/// What every handler shares.
pub struct App {
    pub store: Store,
    insecure_dev: bool,
    /// The OpenAPI document, set once the router is built.
    pub openapi: OnceLock<utoipa::openapi::OpenApi>,
}

/// The authenticated caller of a request.
#[derive(Clone)]
pub struct Caller(pub TokenInfo);

impl Caller {
    /// The caller, if the token carries `scope`; 403 otherwise.
    pub fn require(&self, scope: Scope) -> Result<&TokenInfo, ApiError> {
        if self.0.allows(scope) {
            Ok(&self.0)
        } else {
            Err(ApiError::forbidden(scope))
        }
    }
}

/// The API's router and its OpenAPI document, around a store.
pub fn router(store: Store, insecure_dev: bool, body_limit: usize) -> axum::Router {
    let app = Arc::new(App {
        store,
        insecure_dev,
        openapi: OnceLock::new(),
    });
    let (router, doc) = routes::router().split_for_parts();
    let _ = app.openapi.set(doc);
    router
        .fallback(|| async { ApiError::not_found("no such route".to_owned()) })
        .layer(middleware::from_fn(refuse_nul))
        .layer(middleware::from_fn_with_state(app.clone(), authenticate))
        // The limit layer governs; axum's own 2 MB default for buffered bodies is off.
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(body_limit))
        .layer(middleware::map_response(json_errors))
        .with_state(app)
}

pub async fn serve(args: ApiArgs) -> u8 {
    init_logging(true);
    let store = match ops::connect(&args.db, false).await {
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
    let stop = ops::shutdown_signal();
    println!("http://{bound}");
    {
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
    tracing::info!(address = %bound, auth = !args.insecure_dev, "rein api listening");
    crate::telemetry::install("api");
    let store = args
        .redis
        .publishing(store, &stop)
        .with_approver_separation(args.approver_may_not_be_enqueuer);
    let app = router(store, args.insecure_dev, args.body_limit_bytes as usize);
    match axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
    {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("error: the server stopped: {e}");
            exit::DATABASE
        }
    }
}

/// Checks the bearer token of every request but the probes and records the caller.
async fn authenticate(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    if PUBLIC_PATHS.contains(&req.uri().path()) {
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
            Err(e) => return e.into_response(),
        };
        match app.store.verify_token(&secret).await {
            Ok(Some(info)) => info,
            Ok(None) => {
                return ApiError::unauthorized("the bearer token is unknown or revoked")
                    .into_response();
            }
            Err(e) => return ApiError::from(e).into_response(),
        }
    };
    req.extensions_mut().insert(Caller(caller));
    next.run(req).await
}

/// Refuses a path or query parameter with a NUL character (`%00`), which PostgreSQL cannot
/// store, naming it, before any handler sees it (SPEC Z2). Bodies are checked where they
/// are stored.
async fn refuse_nul(req: Request, next: Next) -> Response {
    match nul_free(req.uri()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

fn nul_free(uri: &axum::http::Uri) -> Result<(), ApiError> {
    // A NUL byte can only come from `%00` once the path is decoded.
    if uri.path().to_ascii_lowercase().contains("%00") {
        return Err(ApiError::validation(
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

fn bearer(header: Option<&HeaderValue>) -> Result<String, ApiError> {
    let Some(value) = header else {
        return Err(ApiError::unauthorized(
            "an `Authorization: Bearer TOKEN` header is required",
        ));
    };
    let text = value
        .to_str()
        .map_err(|_| ApiError::unauthorized("the Authorization header is not ASCII"))?;
    match text.split_once(' ') {
        Some((scheme, token))
            if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() =>
        {
            Ok(token.trim().to_owned())
        }
        _ => Err(ApiError::unauthorized(
            "the Authorization header must be `Bearer TOKEN`",
        )),
    }
}

/// Turns the plain-text refusals of the layers below (body too large, method not allowed)
/// into the API's JSON error shape.
async fn json_errors(response: Response) -> Response {
    let is_json = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return response;
    }
    match response.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::payload_too_large().into_response(),
        StatusCode::METHOD_NOT_ALLOWED => {
            let allow = response.headers().get(axum::http::header::ALLOW).cloned();
            let mut json = ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route does not take that method".to_owned(),
            )
            .into_response();
            if let Some(allow) = allow {
                json.headers_mut().insert(axum::http::header::ALLOW, allow);
            }
            json
        }
        _ => response,
    }
}
