//! The bounds of paged lists, which the operations enforce and the OpenAPI document states.

/// Page sizes accepted by list operations.
pub const PAGE_MIN: i64 = 1;
pub const PAGE_MAX: i64 = 1000;
pub const PAGE_DEFAULT: i64 = 50;
/// Events in a page of a run's log when the request does not say.
pub const EVENTS_PAGE_DEFAULT: i64 = 100;
/// About the most bytes of rows in one page of runs or events, unless `rein api
/// --page-bytes-max` says otherwise: a few pages at once stay far below the API's memory.
pub const PAGE_BYTES_MAX_DEFAULT: usize = 2 * 1024 * 1024;
/// Most digits of a cursor's instant (microseconds since 1970): 18 reach the year 33658,
/// inside what both chrono and PostgreSQL represent, so every such cursor can be compared.
pub const CURSOR_MICROS_DIGITS_MAX: usize = 18;
/// Hex digits of a cursor's run id.
pub const CURSOR_ID_DIGITS: usize = 32;
/// The regular expression every cursor matches: `MICROS_RUNID`, the creation instant in
/// microseconds since 1970 and the run id as 32 lowercase hex digits. Opaque to clients, safe
/// in headers and query strings; every string it matches is a cursor [`crate::service::decode_cursor`] takes.
pub fn cursor_pattern() -> String {
    format!("^[0-9]{{1,{CURSOR_MICROS_DIGITS_MAX}}}_[0-9a-f]{{{CURSOR_ID_DIGITS}}}$")
}
