//! The API's one error shape: `{"error": {"code", "message", "details"}}` with a stable code.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rein_store::{OutOfBounds, Scope, StoreError};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub details: Option<Value>,
    /// What went wrong underneath (a store error's own text). Never sent to API clients;
    /// the CLI prints it when it runs an operation against the database itself.
    pub cause: Option<String>,
    /// Sent as `Retry-After` (seconds): when asking again may succeed.
    pub retry_after_s: Option<u64>,
}

/// Every error code the API answers with.
pub const CODES: [&str; 19] = [
    "validation_failed",
    "invalid_transition",
    "fenced",
    "conflict",
    "not_found",
    "unauthorized",
    "forbidden",
    "event_not_allowed",
    "payload_too_large",
    "method_not_allowed",
    "quota_exceeded",
    "bad_request",
    "uri_too_long",
    "headers_too_large",
    "unsupported_media_type",
    "request_timeout",
    "too_many_requests",
    "unavailable",
    "internal",
];

/// The body of every error response.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable: what a client branches on.
    #[schema(value_type = super::schema::ErrorCode)]
    pub code: String,
    /// For a person: what went wrong and what to change.
    pub message: String,
    /// Facts about the refusal, by code (e.g. `field`, `required_scope`, `run_id`).
    #[schema(value_type = Option<super::schema::JsonObject>)]
    pub details: Option<Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: String) -> ApiError {
        ApiError {
            status,
            code,
            message,
            details: None,
            cause: None,
            retry_after_s: None,
        }
    }

    fn caused_by(mut self, cause: &StoreError) -> ApiError {
        self.cause = Some(cause.to_string());
        self
    }

    pub fn with_details(mut self, details: Value) -> ApiError {
        self.details = Some(details);
        self
    }

    pub fn validation(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            message.into(),
        )
    }

    pub fn not_found(message: String) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn conflict(message: String) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "conflict", message)
    }

    pub fn unauthorized(message: &str) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message.to_owned())
    }

    pub fn forbidden(scope: Scope) -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("this token lacks the `{}` scope", scope.as_str()),
        )
        .with_details(json!({ "required_scope": scope.as_str() }))
    }

    pub fn payload_too_large() -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            "the request body is larger than this server accepts (--body-limit-bytes)".to_owned(),
        )
    }

    /// A refusal made below the handlers (by HTTP parsing, routing, a body or connection
    /// limit), in the API's shape: the code and a message that says what to change, from the
    /// status; `said` is what the layer that refused said, when it said something.
    pub fn transport(status: StatusCode, said: Option<String>) -> ApiError {
        let (code, message) = match status.as_u16() {
            400 => (
                "bad_request",
                "the request is not well-formed HTTP: its request line or a header (such as Content-Length) cannot be read",
            ),
            404 => ("not_found", "no such route"),
            405 => ("method_not_allowed", "this route does not take that method"),
            408 => (
                "request_timeout",
                "the request did not arrive in time (--body-read-timeout-ms); send the body without pausing",
            ),
            413 => (
                "payload_too_large",
                "the request body is larger than this server accepts (--body-limit-bytes)",
            ),
            414 => (
                "uri_too_long",
                "the request URI is too long; send large values in the request body",
            ),
            415 => (
                "unsupported_media_type",
                "this route does not take a body of that Content-Type",
            ),
            429 => (
                "too_many_requests",
                "too many connections from this client (--max-connections-per-client); reuse or close some and retry",
            ),
            431 => (
                "headers_too_large",
                "the request line and headers are larger than this server accepts",
            ),
            503 => (
                "unavailable",
                "the server is at its connection limit (--max-connections); retry shortly",
            ),
            s if s >= 500 => ("internal", "internal error; see the server log"),
            _ => ("bad_request", "the request cannot be served as sent"),
        };
        let message = match said.map(|s| s.trim().to_owned()) {
            Some(said) if !said.is_empty() && !said.chars().any(char::is_control) => {
                format!("{message}: {said}")
            }
            _ => message.to_owned(),
        };
        ApiError::new(status, code, message)
    }

    fn body(self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
                details: self.details,
            },
        }
    }

    /// This error as a whole HTTP/1.1 response that closes the connection, for the server to
    /// write on a socket no handler serves (a refused connection, a request hyper could not
    /// parse); `version` is the response's protocol, e.g. `HTTP/1.1`.
    pub fn http_bytes(self, version: &str) -> Vec<u8> {
        let status = self.status;
        let retry = if matches!(status.as_u16(), 429 | 503) {
            "retry-after: 1\r\n"
        } else {
            ""
        };
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        let mut bytes = format!(
            "{version} {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{retry}connection: close\r\n\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            body.len()
        )
        .into_bytes();
        bytes.extend_from_slice(&body);
        bytes
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        match e {
            StoreError::RunNotFound(id) => ApiError::not_found(format!("run {id} not found"))
                .with_details(json!({ "run_id": id })),
            // A well-formed request naming a definition (version) nobody registered.
            StoreError::UnknownDefinition { name, version } => ApiError::not_found(format!(
                "{}",
                StoreError::UnknownDefinition {
                    name: name.clone(),
                    version
                }
            ))
            .with_details(json!({ "definition": name, "version": version })),
            StoreError::Invalid(message) => ApiError::validation(message),
            StoreError::InvalidField { field, reason } => {
                ApiError::validation(reason).with_details(json!({ "field": field }))
            }
            ref e @ StoreError::NotAllowed {
                ref event,
                ref sender,
                ..
            } => ApiError::new(StatusCode::FORBIDDEN, "event_not_allowed", e.to_string())
                .with_details(json!({ "event": event, "sender": sender })),
            ref e @ StoreError::NeedsApprover { ref event } => {
                ApiError::new(StatusCode::FORBIDDEN, "forbidden", e.to_string()).with_details(
                    json!({ "required_scope": Scope::Approve.as_str(), "event": event }),
                )
            }
            StoreError::OutOfBounds(beyond) => {
                let details = match &beyond {
                    OutOfBounds::Queue { queue, allowed } => {
                        json!({ "queue": queue, "allowed_queues": allowed })
                    }
                    OutOfBounds::Priority { priority, max } => {
                        json!({ "priority": priority, "priority_max": max })
                    }
                };
                ApiError::new(StatusCode::FORBIDDEN, "forbidden", beyond.to_string())
                    .with_details(details)
            }
            StoreError::QuotaExceeded(q) => {
                let mut e = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "quota_exceeded",
                    q.to_string(),
                )
                .with_details(json!({
                    "quota": q.quota.as_str(),
                    "limit": q.limit,
                    "retry_after_s": q.retry_after_s,
                }));
                e.retry_after_s = Some(q.retry_after_s);
                e
            }
            ref e @ StoreError::ApproverIsEnqueuer {
                run_id,
                ref approver,
                ref rule,
            } => ApiError::new(StatusCode::FORBIDDEN, "forbidden", e.to_string())
                .with_details(json!({ "run_id": run_id, "approver": approver,
                        "policy": "approver_may_not_be_enqueuer", "rule": rule })),
            ref e @ StoreError::KeyConflict { ref key, .. } => {
                ApiError::conflict(e.to_string()).with_details(json!({ "idempotency_key": key }))
            }
            StoreError::InvalidTransition(t) => {
                ApiError::new(StatusCode::CONFLICT, "invalid_transition", t.to_string())
                    .with_details(json!({
                        "state": t.state,
                        "event": t.event,
                        "sequence": t.sequence,
                        "reason": t.reason,
                    }))
            }
            e @ StoreError::DefinitionConflict { .. } => ApiError::conflict(e.to_string()),
            e @ StoreError::Unreachable(_) => {
                tracing::error!(error = %e, "database unreachable");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "the database is unreachable; retry later".to_owned(),
                )
                .caused_by(&e)
            }
            e => {
                tracing::error!(error = %e, "request failed in the store");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "internal error; see the server log".to_owned(),
                )
                .caused_by(&e)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status;
        let retry_after_s = self.retry_after_s;
        let mut response = (status, Json(self.body())).into_response();
        if let Some(seconds) = retry_after_s {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds),
            );
        }
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}
