//! Named bounds on everything a definition or an event may carry. Hitting one is an explicit
//! error that names the limit, never a silent truncation.

/// Largest definition document accepted, in bytes.
pub const DEFINITION_BYTES_MAX: usize = 1024 * 1024;
/// Longest name of a definition, state, event, node action, tool or guard.
pub const NAME_LEN_MAX: usize = 64;
/// Highest definition version: versions are stored as a PostgreSQL `integer`.
pub const VERSION_MAX: u32 = i32::MAX as u32;
pub const STATES_MAX: usize = 256;
pub const EVENTS_MAX: usize = 512;
pub const TRANSITIONS_MAX: usize = 4096;
pub const GUARDS_PER_TRANSITION_MAX: usize = 16;
/// Longest guard expression, in bytes. CEL parsing is recursive; short inputs keep it cheap.
pub const GUARD_EXPR_LEN_MAX: usize = 2048;
/// Deepest nesting of parentheses/brackets in a guard expression.
pub const GUARD_EXPR_DEPTH_MAX: usize = 32;
/// Most evaluation steps the guards of one decision may take together (the guards one event
/// runs in one state, one tool's approval rule, one join guard). A step is one node of an
/// expression, or one unit of the weight of a value it copies, compares or searches. Checked
/// against a static bound of each expression, never a clock: when a definition is registered,
/// at [`GUARD_DATA_REF`], and before each evaluation, at the size of the data given.
pub const GUARD_STEPS_MAX: u64 = 1_000_000;
/// The data size guards must handle when their definition is registered: lists and maps of
/// up to this many entries, data of this weight, strings of this weight (one unit per value,
/// list or map, and per 8 bytes of a string; any payload of 8 KiB fits).
pub const GUARD_DATA_REF: u64 = 4_096;
/// Largest serialized payload of a single event, in bytes.
pub const EVENT_PAYLOAD_BYTES_MAX: usize = 256 * 1024;
/// Payload fields larger than this (canonical JSON) are stored as content-addressed blobs
/// by default; workers may set another threshold.
pub const PAYLOAD_INLINE_BYTES_DEFAULT: usize = 64 * 1024;
/// Largest single value stored as a blob.
pub const BLOB_BYTES_MAX: usize = 64 * 1024 * 1024;
/// Most results a run keeps in its projection (older ones are still in the event log).
pub const RESULTS_KEPT_MAX: usize = 1000;
/// Longest URL an `http` node may call.
pub const URL_LEN_MAX: usize = 2048;
/// Largest model decision (JSON) the engine parses.
pub const DECISION_BYTES_MAX: usize = 256 * 1024;
/// Most branches one fan-out state starts.
pub const BRANCHES_MAX: usize = 64;
/// Longest fleet-wide limit key (`tool:search`, `model:gpt-x`).
pub const LIMIT_KEY_LEN_MAX: usize = 128;
/// Largest rate, burst or concurrency of a limit.
pub const LIMIT_RATE_MAX: u32 = 1_000_000;
/// Largest tokens-per-minute limit.
pub const LIMIT_TPM_MAX: u32 = 1_000_000_000;
/// Longest period a rate is counted over: one day.
pub const LIMIT_PERIOD_MS_MAX: u64 = 86_400_000;
/// Most limit keys one state's action takes.
pub const LIMITS_PER_STATE_MAX: usize = 8;
/// The ceiling on a run's events when its definition declares no `max_events`: reaching it
/// ends a runaway run as a failure (reason `step_limit`).
pub const RUN_EVENTS_DEFAULT: u64 = 10_000;
/// The highest `max_events` a definition may declare.
pub const RUN_EVENTS_MAX: u64 = 1_000_000;
/// The lowest: room for one event and the failure that ends the run.
pub const RUN_EVENTS_MIN: u64 = 2;
/// Most distinct values one label of one metric family takes; later ones are recorded as
/// `other` (see the `labels` module).
pub const METRIC_LABEL_VALUES_MAX: usize = 100;

/// Longest a migration waits for runs a worker holds (`--wait-s`), in seconds.
pub const MIGRATE_WAIT_S_MAX: u64 = 3_600;
/// Longest reason recorded with a migration or a fork, in bytes.
pub const MOVE_REASON_BYTES_MAX: usize = 1_024;
