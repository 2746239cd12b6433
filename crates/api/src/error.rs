//! Errors as HTTP: the operations' one error ([`rein_ops::Error`]) with the status its code
//! stands for, as a JSON response or as the raw bytes of one.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rein_ops::{Code, Error};
use rein_store::StoreError;

/// An operation's error on its way to an HTTP client.
#[derive(Debug)]
pub struct ApiError {
    pub error: Error,
    /// The status answered: the code's own ([`status_of`]), or the one a lower layer refused
    /// with.
    pub status: StatusCode,
}

/// The HTTP status each code is answered with.
pub fn status_of(code: Code) -> StatusCode {
    match code {
        Code::ValidationFailed => StatusCode::UNPROCESSABLE_ENTITY,
        Code::InvalidTransition | Code::Fenced | Code::Conflict => StatusCode::CONFLICT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::Unauthorized => StatusCode::UNAUTHORIZED,
        Code::Forbidden | Code::EventNotAllowed => StatusCode::FORBIDDEN,
        Code::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        Code::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        Code::QuotaExceeded | Code::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
        Code::BadRequest => StatusCode::BAD_REQUEST,
        Code::UriTooLong => StatusCode::URI_TOO_LONG,
        Code::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        Code::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        Code::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl From<Error> for ApiError {
    fn from(error: Error) -> ApiError {
        ApiError {
            status: status_of(error.code),
            error,
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        Error::from(e).into()
    }
}

impl ApiError {
    /// A refusal made below the handlers (by HTTP parsing, routing, a body or connection
    /// limit), in the API's shape: the code and a message that says what to change, from the
    /// status; `said` is what the layer that refused said, when it said something.
    pub fn transport(status: StatusCode, said: Option<String>) -> ApiError {
        let (code, message) = match status.as_u16() {
            400 => (
                Code::BadRequest,
                "the request is not well-formed HTTP: its request line or a header (such as Content-Length) cannot be read",
            ),
            404 => (Code::NotFound, "no such route"),
            405 => (
                Code::MethodNotAllowed,
                "this route does not take that method",
            ),
            408 => (
                Code::RequestTimeout,
                "the request did not arrive in time (--body-read-timeout-ms); send the body without pausing",
            ),
            413 => (
                Code::PayloadTooLarge,
                "the request body is larger than this server accepts (--body-limit-bytes)",
            ),
            414 => (
                Code::UriTooLong,
                "the request URI is too long; send large values in the request body",
            ),
            415 => (
                Code::UnsupportedMediaType,
                "this route does not take a body of that Content-Type",
            ),
            429 => (
                Code::TooManyRequests,
                "too many connections from this client (--max-connections-per-client); reuse or close some and retry",
            ),
            431 => (
                Code::HeadersTooLarge,
                "the request line and headers are larger than this server accepts",
            ),
            503 => (
                Code::Unavailable,
                "the server is at its connection limit (--max-connections); retry shortly",
            ),
            s if s >= 500 => (Code::Internal, "internal error; see the server log"),
            _ => (Code::BadRequest, "the request cannot be served as sent"),
        };
        let message = match said.map(|s| s.trim().to_owned()) {
            Some(said) if !said.is_empty() && !said.chars().any(char::is_control) => {
                format!("{message}: {said}")
            }
            _ => message.to_owned(),
        };
        ApiError {
            error: Error::new(code, message),
            status,
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
        let body = serde_json::to_vec(&self.error.body()).unwrap_or_default();
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status;
        let retry_after_s = self.error.retry_after_s;
        let mut response = (status, Json(self.error.body())).into_response();
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
