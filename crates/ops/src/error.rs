//! The one error of every operation: a stable [`Code`] (which the API maps to an HTTP status
//! and the CLI to an exit code), a message that says what to do, and details.

use rein_store::{OutOfBounds, Scope, StoreError};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

#[derive(Debug)]
pub struct Error {
    pub code: Code,
    pub message: String,
    pub details: Option<Value>,
    /// What went wrong underneath (a store error's own text). Never sent to API clients;
    /// the CLI prints it when it runs an operation against the database itself.
    pub cause: Option<String>,
    /// Sent as `Retry-After` (seconds): when asking again may succeed.
    pub retry_after_s: Option<u64>,
}

/// Every error code an operation or the API answers with: stable, part of the contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    ValidationFailed,
    InvalidTransition,
    Fenced,
    Conflict,
    NotFound,
    Unauthorized,
    Forbidden,
    EventNotAllowed,
    PayloadTooLarge,
    MethodNotAllowed,
    QuotaExceeded,
    BadRequest,
    UriTooLong,
    HeadersTooLarge,
    UnsupportedMediaType,
    RequestTimeout,
    TooManyRequests,
    Unavailable,
    Internal,
}

impl Code {
    /// Every code, in the order the contract lists them.
    pub const ALL: [Code; 19] = [
        Code::ValidationFailed,
        Code::InvalidTransition,
        Code::Fenced,
        Code::Conflict,
        Code::NotFound,
        Code::Unauthorized,
        Code::Forbidden,
        Code::EventNotAllowed,
        Code::PayloadTooLarge,
        Code::MethodNotAllowed,
        Code::QuotaExceeded,
        Code::BadRequest,
        Code::UriTooLong,
        Code::HeadersTooLarge,
        Code::UnsupportedMediaType,
        Code::RequestTimeout,
        Code::TooManyRequests,
        Code::Unavailable,
        Code::Internal,
    ];

    /// The code as the API and `--json` output spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::ValidationFailed => "validation_failed",
            Code::InvalidTransition => "invalid_transition",
            Code::Fenced => "fenced",
            Code::Conflict => "conflict",
            Code::NotFound => "not_found",
            Code::Unauthorized => "unauthorized",
            Code::Forbidden => "forbidden",
            Code::EventNotAllowed => "event_not_allowed",
            Code::PayloadTooLarge => "payload_too_large",
            Code::MethodNotAllowed => "method_not_allowed",
            Code::QuotaExceeded => "quota_exceeded",
            Code::BadRequest => "bad_request",
            Code::UriTooLong => "uri_too_long",
            Code::HeadersTooLarge => "headers_too_large",
            Code::UnsupportedMediaType => "unsupported_media_type",
            Code::RequestTimeout => "request_timeout",
            Code::TooManyRequests => "too_many_requests",
            Code::Unavailable => "unavailable",
            Code::Internal => "internal",
        }
    }

    /// The code spelled `text`, if it is one.
    pub fn parse(text: &str) -> Option<Code> {
        Code::ALL.into_iter().find(|c| c.as_str() == text)
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The body of every error response.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable: what a client branches on.
    #[schema(value_type = crate::schema::ErrorCode)]
    pub code: String,
    /// For a person: what went wrong and what to change.
    pub message: String,
    /// Facts about the refusal, by code (e.g. `field`, `required_scope`, `run_id`).
    #[schema(value_type = Option<crate::schema::JsonObject>)]
    pub details: Option<Value>,
}

impl Error {
    pub fn new(code: Code, message: String) -> Error {
        Error {
            code,
            message,
            details: None,
            cause: None,
            retry_after_s: None,
        }
    }

    pub fn caused_by(mut self, cause: &StoreError) -> Error {
        self.cause = Some(cause.to_string());
        self
    }

    pub fn with_details(mut self, details: Value) -> Error {
        self.details = Some(details);
        self
    }

    pub fn validation(message: impl Into<String>) -> Error {
        Error::new(Code::ValidationFailed, message.into())
    }

    pub fn not_found(message: String) -> Error {
        Error::new(Code::NotFound, message)
    }

    pub fn conflict(message: String) -> Error {
        Error::new(Code::Conflict, message)
    }

    pub fn unauthorized(message: &str) -> Error {
        Error::new(Code::Unauthorized, message.to_owned())
    }

    pub fn forbidden(scope: Scope) -> Error {
        Error::new(
            Code::Forbidden,
            format!("this token lacks the `{}` scope", scope.as_str()),
        )
        .with_details(json!({ "required_scope": scope.as_str() }))
    }

    /// The error as the document the API answers with.
    pub fn body(self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.as_str().to_owned(),
                message: self.message,
                details: self.details,
            },
        }
    }

    pub fn payload_too_large() -> Error {
        Error::new(
            Code::PayloadTooLarge,
            "the request body is larger than this server accepts (--body-limit-bytes)".to_owned(),
        )
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Error {
        match e {
            StoreError::RunNotFound(id) => Error::not_found(format!("run {id} not found"))
                .with_details(json!({ "run_id": id })),
            // A well-formed request naming a definition (version) nobody registered.
            StoreError::UnknownDefinition { name, version } => Error::not_found(format!(
                "{}",
                StoreError::UnknownDefinition {
                    name: name.clone(),
                    version
                }
            ))
            .with_details(json!({ "definition": name, "version": version })),
            StoreError::Invalid(message) => Error::validation(message),
            StoreError::Conflict(message) => Error::conflict(message),
            StoreError::InvalidField { field, reason } => {
                Error::validation(reason).with_details(json!({ "field": field }))
            }
            ref e @ StoreError::NotAllowed {
                ref event,
                ref sender,
                ..
            } => Error::new(Code::EventNotAllowed, e.to_string())
                .with_details(json!({ "event": event, "sender": sender })),
            ref e @ StoreError::NeedsApprover { ref event } => {
                Error::new(Code::Forbidden, e.to_string()).with_details(
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
                Error::new(Code::Forbidden, beyond.to_string()).with_details(details)
            }
            StoreError::QuotaExceeded(q) => {
                let mut e = Error::new(Code::QuotaExceeded, q.to_string()).with_details(json!({
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
            } => Error::new(Code::Forbidden, e.to_string())
                .with_details(json!({ "run_id": run_id, "approver": approver,
                        "policy": "approver_may_not_be_enqueuer", "rule": rule })),
            ref e @ StoreError::KeyConflict { ref key, .. } => {
                Error::conflict(e.to_string()).with_details(json!({ "idempotency_key": key }))
            }
            StoreError::InvalidTransition(t) => Error::new(Code::InvalidTransition, t.to_string())
                .with_details(json!({
                    "state": t.state,
                    "event": t.event,
                    "sequence": t.sequence,
                    "reason": t.reason,
                })),
            e @ StoreError::DefinitionConflict { .. } => Error::conflict(e.to_string()),
            e @ StoreError::Unreachable(_) => {
                tracing::error!(error = %e, "database unreachable");
                Error::new(
                    Code::Unavailable,
                    "the database is unreachable; retry later".to_owned(),
                )
                .caused_by(&e)
            }
            e => {
                tracing::error!(error = %e, "request failed in the store");
                Error::new(
                    Code::Internal,
                    "internal error; see the server log".to_owned(),
                )
                .caused_by(&e)
            }
        }
    }
}
