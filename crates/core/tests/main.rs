//! The core crate's tests in one binary, one module per area: one binary links the
//! crate once instead of once per file.

mod agents_at_scale;
mod checkpoint;
mod decisions;
mod external_events;
mod formats;
mod fuzz_inputs;
mod guard_budget;
mod hashing;
mod lifecycle_table;
mod limits;
mod migration;
mod properties;
mod research_agent_table;
mod retry_after;
mod retry_decision;
mod runaway;
mod timers;
mod validation;
