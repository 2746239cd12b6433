//! Rein's pure engine.
//!
//! Everything here is a function of its arguments: no clock, no randomness, no I/O, no
//! globals. Workers, schedulers and the API call into this crate to decide where a run may
//! go; storage and networking live elsewhere.
//!
//! Reading order: [`definition`] (what a state machine is),
//! [`state`] and [`event`] (the run projection and the facts that change it), [`reducer`]
//! (the pure `R(X, e)`), [`guard`], [`retry`], [`hash`], [`checkpoint`], [`builtin`];
//! [`blob`] (large payloads by reference), [`brief`] (the resume brief), [`join`] (parallel
//! branches), [`budget`] (usage limits), [`text`] (text PostgreSQL can store) and
//! [`runaway`] (the ceiling on a run's events); [`http_url`] (what an http node's URL may
//! name); [`explain`] (each candidate transition's guard values) and [`whatif`] (a recorded
//! log replayed on another definition, up to where it decides differently).
//!
//! Files import each other downward only, never in a loop: the data format (`spec`, with
//! `retry_policy`) lies under the validated [`definition`], why an event is refused
//! (`reject`) under the [`reducer`] and the rules it calls, and validation (`compile`) above
//! the helpers it runs. The public paths (`definition::StateSpec`, `reducer::RejectReason`,
//! `retry::RetryPolicy`, ...) re-export what moved down.

pub mod blob;
pub mod brief;
pub mod budget;
pub mod builtin;
pub mod checkpoint;
mod compile;
pub mod decision;
pub mod definition;
pub mod event;
pub mod explain;
mod external;
pub mod guard;
mod guard_cost;
pub mod hash;
pub mod http_url;
pub mod join;
pub mod labels;
pub mod limits;
pub mod migration;
pub mod model;
pub mod model_keys;
pub mod model_usage;
mod movable;
pub mod redact;
pub mod reducer;
mod reject;
pub mod replay_cost;
pub mod retry;
mod retry_policy;
pub mod runaway;
mod spec;
pub mod state;
pub mod text;
pub mod timer;
pub mod whatif;
mod yaml;

pub use definition::{
    Definition, DefinitionError, DefinitionProblem, Format, LimitSpec, NAME_PATTERN, StateKind,
    limit_key_problem, name_problem,
};
pub use event::{EngineEvent, Event};
pub use guard::{GuardInput, GuardKind, GuardRegistry};
pub use reducer::{InvalidTransition, RejectReason, apply, decide, follow_up, replay};
pub use state::{ActionSlot, ActionStatus, JoinState, RunState, RunStatus, Usage};
pub use text::json_text_is_object;
