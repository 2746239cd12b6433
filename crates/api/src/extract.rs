//! What every handler reads from a request the same way: a JSON body, an id or name in the
//! path, a query string, the `Idempotency-Key` header; and the paging headers it answers with.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use rein_ops::Error;
use rein_ops::service::PAGE_TRUNCATED;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use uuid::Uuid;

/// Parses a JSON body (any content type); an empty body reads as `{}`. Only an object is a
/// body: serde reads a struct from an array of its fields in order too, which would make
/// `["lifecycle", null, {}]` an enqueue.
pub(crate) fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, Error> {
    let text: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    if !rein_core::json_text_is_object(text) {
        return Err(Error::validation(
            "the request body must be a JSON object (`{...}`), with the fields this route documents",
        ));
    }
    serde_json::from_slice(text)
        .map_err(|e| Error::validation(format!("the request body is not valid: {e}")))
}

/// Sets the paging headers of a list response: where the next page starts, and whether
/// this one stopped short at the byte bound.
pub(crate) fn paging_headers(
    response: &mut Response,
    next: (&'static str, Option<String>),
    truncated: bool,
) {
    let (header, next) = next;
    // Digits, `_` and hex digits are always a valid header value.
    if let Some(value) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        response.headers_mut().insert(header, value);
    }
    if truncated {
        response
            .headers_mut()
            .insert(PAGE_TRUNCATED, HeaderValue::from_static("bytes"));
    }
}

pub(crate) fn path_id(id: Result<Path<Uuid>, PathRejection>) -> Result<Uuid, Error> {
    id.map(|Path(id)| id)
        .map_err(|e| Error::validation(format!("the id in the path is not a UUID: {e}")))
}

/// The `{name}` path parameter of the definition routes, as the document describes it.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct DefinitionPath {
    /// Definition name.
    #[param(value_type = rein_ops::schema::Name, inline)]
    name: String,
}

/// The definition name in the path (checked against the name rule where it is used).
pub(crate) fn definition_name(name: Result<Path<String>, PathRejection>) -> Result<String, Error> {
    name.map(|Path(n)| n)
        .map_err(|e| Error::validation(format!("bad definition name: {e}")))
}

pub(crate) fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, Error> {
    q.map(|Query(q)| q)
        .map_err(|e| Error::validation(format!("bad query string: {e}")))
}

/// The `Idempotency-Key` header, when given.
pub(crate) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Error> {
    headers
        .get("idempotency-key")
        .map(|v| {
            v.to_str().map(str::to_owned).map_err(|_| {
                Error::validation("the Idempotency-Key header is not ASCII")
                    .with_details(json!({ "field": "Idempotency-Key" }))
            })
        })
        .transpose()
}

/// Who a token's requests are recorded as (sender, key owner).
pub(crate) fn caller_name(subject: &str) -> String {
    format!("{}{subject}", rein_store::API_SENDER_PREFIX)
}

/// A list page's body: its rows as an array, or with `envelope` an object that holds them
/// under their name with where the next page starts and whether the byte bound cut it short
/// (what the paging headers say).
pub(crate) fn page_body<T: Serialize>(
    envelope: bool,
    (rows_name, rows): (&str, T),
    (next_name, next): (&str, Value),
    truncated: bool,
) -> Response {
    if !envelope {
        return Json(rows).into_response();
    }
    let mut body = serde_json::Map::new();
    body.insert(rows_name.to_owned(), json!(rows));
    body.insert(next_name.to_owned(), next);
    body.insert("truncated".to_owned(), Value::Bool(truncated));
    Json(Value::Object(body)).into_response()
}
