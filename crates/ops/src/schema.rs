//! Schemas of the OpenAPI document built from the constants the server checks against, so
//! the document states exactly the bounds the API enforces: a request the document allows is
//! not refused for its shape, and one it forbids is refused with 422. (utoipa's validation
//! attributes take only literals, so the bounded types below build their schemas in code.)

use rein_core::limits::{NAME_LEN_MAX, VERSION_MAX};
use rein_core::{NAME_PATTERN, RunStatus};
use serde::Deserialize;
use utoipa::openapi::link::LinkBuilder;
use utoipa::openapi::path::{Operation, ParameterIn, PathItem};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{
    AdditionalProperties, KnownFormat, ObjectBuilder, Schema, SchemaFormat, Type,
};
use utoipa::openapi::{Content, ContentBuilder, OpenApi, Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use rein_store::CLIENT_KEY_LEN_MAX;

use crate::paging::{
    CURSOR_ID_DIGITS, CURSOR_MICROS_DIGITS_MAX, PAGE_MAX, PAGE_MIN, cursor_pattern,
};

/// Declares a schema-only type: fields keep their Rust type and name it with
/// `value_type = ...` (query and path parameters add `inline`), so they keep their doc
/// comment as description and their optionality. Body fields refer to it as a component:
/// utoipa wraps an inline schema with a description in an `allOf` with an `object`, which
/// no string satisfies.
macro_rules! schema_type {
    ($(#[$doc:meta])* $name:ident => $schema:expr) => {
        $(#[$doc])*
        pub struct $name;

        impl PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                RefOr::T(Schema::Object($schema.build()))
            }
        }

        impl ToSchema for $name {}
    };
}

fn string() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String)
}

fn integer(format: KnownFormat) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(SchemaFormat::KnownFormat(format)))
}

schema_type! {
    /// A name (of a definition, event or queue): [`rein_core::name_problem`]'s rule.
    Name => string()
        .min_length(Some(1))
        .max_length(Some(NAME_LEN_MAX))
        .pattern(Some(NAME_PATTERN))
}

schema_type! {
    /// A definition version: 1..=[`VERSION_MAX`].
    Version => integer(KnownFormat::Int32)
        .minimum(Some(1))
        .maximum(Some(VERSION_MAX))
}

schema_type! {
    /// A run's priority: any 32-bit integer.
    Priority => integer(KnownFormat::Int32)
        .minimum(Some(i32::MIN))
        .maximum(Some(i32::MAX))
}

schema_type! {
    /// A page size: [`PAGE_MIN`]..=[`PAGE_MAX`].
    PageLimit => integer(KnownFormat::Int64)
        .minimum(Some(PAGE_MIN))
        .maximum(Some(PAGE_MAX))
}

schema_type! {
    /// A position in a run's log: a sequence number, 0 before the first event.
    Sequence => integer(KnownFormat::Int64)
        .minimum(Some(0))
        .maximum(Some(i64::MAX))
}

schema_type! {
    /// A run's status (SPEC M9), apart from its state: one of [`RunStatus::ALL`].
    Status => string().enum_values(Some(RunStatus::ALL.map(RunStatus::as_str)))
}

schema_type! {
    /// A JSON object whose keys are the caller's or the definition's (a run's input and
    /// data, an event's payload, a tool's arguments): any keys, any values.
    JsonObject => ObjectBuilder::new()
        .schema_type(Type::Object)
        .additional_properties(Some(AdditionalProperties::<Schema>::FreeForm(true)))
}

schema_type! {
    /// A stable error code: one of [`crate::Code::ALL`].
    ErrorCode => string().enum_values(Some(crate::Code::ALL.map(crate::Code::as_str)))
}

schema_type! {
    /// What became of an event sent from outside or of a decision: `applied` (in the run's
    /// log) or `queued` (in its inbox, for the worker holding its lease).
    Outcome => string().enum_values(Some(OUTCOMES))
}

/// Every [`Outcome`].
pub const OUTCOMES: [&str; 2] = ["applied", "queued"];

schema_type! {
    /// An approval request's status: pending, granted, denied, or void (its action changed
    /// before it was carried out).
    ApprovalStatus => string().enum_values(Some(["pending", "granted", "denied", "void"]))
}

schema_type! {
    /// The start of a run id: 1 to 32 hex digits, dashes anywhere, at most 36 characters
    /// ([`rein_store::id_prefix_range`]'s rule).
    IdPrefix => string()
        .min_length(Some(1))
        .max_length(Some(rein_store::ID_PREFIX_LEN_MAX))
        .pattern(Some("^-*(?:[0-9a-fA-F]-*){1,32}$"))
}

schema_type! {
    /// A page cursor as `Rein-Next-Cursor` carries it.
    Cursor => string()
        .min_length(Some(1 + 1 + CURSOR_ID_DIGITS))
        .max_length(Some(CURSOR_MICROS_DIGITS_MAX + 1 + CURSOR_ID_DIGITS))
        .pattern(Some(cursor_pattern()))
}

schema_type! {
    /// A client's `Idempotency-Key`: 1..=[`CLIENT_KEY_LEN_MAX`] visible ASCII characters, with
    /// spaces and tabs only inside (HTTP drops them at the ends), as a header value the API
    /// reads as text.
    IdempotencyKey => string()
        .min_length(Some(1))
        .max_length(Some(CLIENT_KEY_LEN_MAX))
        .pattern(Some("^[!-~]([\\t -~]*[!-~])?$"))
}

schema_type! {
    /// A blob's name: the sha256 of its content, 64 lowercase hex digits.
    Sha256 => string()
        .min_length(Some(64))
        .max_length(Some(64))
        .pattern(Some("^[0-9a-f]{64}$"))
}

schema_type! {
    /// An approval decision's comment: at most [`rein_store::COMMENT_BYTES_MAX`] bytes (a
    /// schema counts characters; an ASCII comment reaches the bound exactly).
    Comment => string().max_length(Some(rein_store::COMMENT_BYTES_MAX))
}

schema_type! {
    /// A sequence of a run's log that names an event: 1 or more.
    EventSequence => integer(KnownFormat::Int64)
        .minimum(Some(1))
        .maximum(Some(i64::MAX))
}

schema_type! {
    /// How long a migration waits for runs held by a worker, in seconds:
    /// 0..=[`rein_core::limits::MIGRATE_WAIT_S_MAX`].
    WaitSeconds => integer(KnownFormat::Int64)
        .minimum(Some(0))
        .maximum(Some(rein_core::limits::MIGRATE_WAIT_S_MAX as i64))
}

schema_type! {
    /// Why a migration or a fork was made: at most [`rein_core::limits::MOVE_REASON_BYTES_MAX`] bytes.
    Reason => string().max_length(Some(rein_core::limits::MOVE_REASON_BYTES_MAX))
}

/// An optional integer field of a body as JSON Schema reads `integer`: any number without a
/// fractional part, so `3.0` is 3 like `3` (serde alone refuses a number written with a
/// decimal point), and one outside `T` is refused.
pub fn integral<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64>,
{
    use serde::de::Error;
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    let whole = match (number.as_i64(), number.as_f64()) {
        (Some(n), _) => Some(n),
        // Without a fraction and within ±2^63, the float names an i64 exactly.
        (None, Some(f)) if f.fract() == 0.0 && f.abs() < 2f64.powi(63) => Some(f as i64),
        _ => None,
    };
    whole
        .and_then(|n| T::try_from(n).ok())
        .map(Some)
        .ok_or_else(|| {
            D::Error::custom(format!(
                "{number} is not a whole number that fits in {}",
                std::any::type_name::<T>()
            ))
        })
}

/// Every operation of a path.
fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.options,
        &mut item.head,
        &mut item.patch,
        &mut item.trace,
        &mut item.query,
    ]
    .into_iter()
    .flatten()
    .chain(item.additional_operations.values_mut())
}

/// What a malformed path parameter answers, for the document.
const BAD_PATH: &str =
    "A path parameter is malformed (an id that is not a UUID, a name that breaks the name rule)";

/// Documents that `operation` may answer `status` with an error body for `reason`: added
/// where the route lists no such response; where it lists one for its own reasons, `reason`
/// joins its description when `distinct`.
fn document_error(operation: &mut Operation, status: &str, reason: &str, distinct: bool) {
    let responses = &mut operation.responses.responses;
    match responses.get_mut(status) {
        Some(RefOr::T(existing)) => {
            if distinct && !existing.description.contains(reason) {
                existing.description = format!("{}; or: {reason}", existing.description);
            }
        }
        Some(RefOr::Ref(_)) => {}
        None => {
            let body = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build();
            let response = ResponseBuilder::new()
                .description(reason)
                .content("application/json", body)
                .build();
            responses.insert(status.to_owned(), RefOr::T(response));
        }
    }
}

/// Documents the 422 every operation with a path parameter answers when it is malformed,
/// in one place rather than in each route's annotation: added where a route lists no 422,
/// mentioned in the description where it lists one for other reasons.
pub fn document_bad_path_parameters(doc: &mut OpenApi) {
    for item in doc.paths.paths.values_mut() {
        for operation in operations(item) {
            let has_path_parameter =
                operation.parameters.iter().flatten().any(
                    |p| matches!(p, RefOr::T(p) if matches!(p.parameter_in, ParameterIn::Path)),
                );
            if has_path_parameter {
                document_error(operation, "422", BAD_PATH, true);
            }
        }
    }
}

/// The refusals any request may meet whatever its route, made below the handlers (HTTP
/// parsing, the body and connection limits) or by the server's own failure, as
/// [`super::ApiError::transport`] and the store's errors answer them: status, reason, and
/// whether a route's own response for that status is for another reason.
const ANY_ROUTE: [(&str, &str, bool); 8] = [
    (
        "400",
        "The request is not well-formed HTTP (bad_request)",
        false,
    ),
    (
        "408",
        "The request did not arrive whole in time (request_timeout; --body-read-timeout-ms)",
        false,
    ),
    (
        "413",
        "The request body is larger than this server accepts (payload_too_large; --body-limit-bytes)",
        false,
    ),
    ("414", "The request URI is too long (uri_too_long)", false),
    (
        "429",
        "Too many connections from this client (too_many_requests; --max-connections-per-client), with Retry-After",
        true,
    ),
    (
        "431",
        "The request line and headers are too large (headers_too_large)",
        false,
    ),
    (
        "500",
        "Internal error; the server log says more (internal)",
        false,
    ),
    (
        "503",
        "The database is unreachable, or the server is at its connection limit (unavailable; --max-connections), with Retry-After for the latter",
        true,
    ),
];

/// Documents on every operation the error responses any request may get ([`ANY_ROUTE`]) and,
/// on every operation that needs a token, 401, so a generated client reads every error as
/// the error body instead of as an undocumented status.
pub fn document_errors(doc: &mut OpenApi) {
    let needs_token_by_default = doc.security.as_ref().is_some_and(|s| !s.is_empty());
    for item in doc.paths.paths.values_mut() {
        for operation in operations(item) {
            let public = operation
                .security
                .as_ref()
                .map_or(!needs_token_by_default, |s| {
                    s.iter().any(|requirement| {
                        serde_json::to_value(requirement).is_ok_and(|v| v == serde_json::json!({}))
                    })
                });
            if !public {
                document_error(
                    operation,
                    "401",
                    "No token, or one unknown or revoked (unauthorized)",
                    false,
                );
            }
            for (status, reason, distinct) in ANY_ROUTE {
                document_error(operation, status, reason, distinct);
            }
        }
    }
}

/// Documents an optional request body (`request_body = Option<T>`) as what the handlers
/// take: a `T` or none at all. utoipa states it as `T` or JSON `null`, which no handler takes
/// (a body is an object) and which generated clients then try to send.
pub fn optional_bodies_without_null(doc: &mut OpenApi) {
    for item in doc.paths.paths.values_mut() {
        for operation in operations(item) {
            let Some(RefOr::T(body)) = operation.request_body.as_mut() else {
                continue;
            };
            let mut without_null = false;
            for content in body.content.values_mut() {
                let RefOr::T(Content {
                    schema: Some(schema),
                    ..
                }) = content
                else {
                    continue;
                };
                let only = match &*schema {
                    RefOr::T(Schema::OneOf(one_of)) => {
                        let mut branches = one_of.items.iter().filter(|b| {
                            !matches!(b, RefOr::T(Schema::Object(o))
                                if o.schema_type == Type::Null.into())
                        });
                        match (branches.next(), branches.next()) {
                            (Some(only), None) => Some(only.clone()),
                            _ => None,
                        }
                    }
                    _ => None,
                };
                if let Some(only) = only {
                    *schema = only;
                    without_null = true;
                }
            }
            if without_null {
                body.required = Some(utoipa::openapi::Required::False);
            }
        }
    }
}

/// Where the operations on one run live; their `{id}` is a run id.
const RUN_PATH: &str = "/v1/runs/{id}";

/// Links every success response whose body names a run (`run_id`, as the one an enqueue or
/// rerun answers) to each operation on that run, so a client (or a stateful API tester)
/// can follow a new run from the response that created it.
pub fn link_runs(doc: &mut OpenApi) {
    let naming_a_run: Vec<String> = doc
        .components
        .iter()
        .flat_map(|c| c.schemas.iter())
        .filter(|(_, schema)| {
            matches!(schema, RefOr::T(Schema::Object(o)) if o.properties.contains_key("run_id"))
        })
        .map(|(name, _)| format!("#/components/schemas/{name}"))
        .collect();
    let mut on_a_run: Vec<String> = Vec::new();
    for (path, item) in doc.paths.paths.iter_mut() {
        if path.starts_with(RUN_PATH) {
            on_a_run.extend(operations(item).filter_map(|o| o.operation_id.clone()));
        }
    }
    for item in doc.paths.paths.values_mut() {
        for operation in operations(item) {
            for (status, response) in &mut operation.responses.responses {
                let RefOr::T(response) = response else {
                    continue;
                };
                let names_a_run = status.starts_with('2')
                    && response.content.values().any(|c| {
                        matches!(c, RefOr::T(Content { schema: Some(RefOr::Ref(r)), .. })
                            if naming_a_run.contains(&r.ref_location))
                    });
                if !names_a_run {
                    continue;
                }
                for target in &on_a_run {
                    let link = LinkBuilder::new()
                        .operation_id(target.as_str())
                        .parameter("id", "$response.body#/run_id")
                        .build();
                    response.links.insert(target.clone(), RefOr::T(link));
                }
            }
        }
    }
}

/// The data keys a redaction forgets: 1..=[`rein_core::redact::REDACT_FIELDS_MAX`] names.
pub struct RedactFields;

impl PartialSchema for RedactFields {
    fn schema() -> RefOr<Schema> {
        RefOr::T(Schema::Array(
            utoipa::openapi::schema::ArrayBuilder::new()
                .items(Name::schema())
                .min_items(Some(1))
                .max_items(Some(rein_core::redact::REDACT_FIELDS_MAX))
                .build(),
        ))
    }
}

impl ToSchema for RedactFields {}

schema_type! {
    /// Why a run was redacted: 1..=[`rein_store::REDACT_REASON_BYTES_MAX`] bytes, not only
    /// blanks.
    RedactReason => string()
        .min_length(Some(1))
        .max_length(Some(rein_store::REDACT_REASON_BYTES_MAX))
        .pattern(Some("\\S"))
}

schema_type! {
    /// A registered definition version to replay on: `NAME@VERSION`, or `NAME` for the
    /// name's current version.
    NamedVersion => string()
        .min_length(Some(1))
        .max_length(Some(NAME_LEN_MAX + 11))
        .pattern(Some("^[A-Za-z0-9_.-]+(@[0-9]{1,10})?$"))
}

schema_type! {
    /// How a what-if replay ended: the same outcome, diverged, refused by the other
    /// definition, or the log does not replay on the versions it ran on.
    WhatIfVerdict => string().enum_values(Some(["same", "diverged", "refused", "unreplayable"]))
}
