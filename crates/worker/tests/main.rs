//! The worker crate's tests in one binary: one module per area, shared fixtures in
//! `common`. One binary links the workspace once instead of once per file.

#[path = "../../store/tests/common/mod.rs"]
mod common;
mod fleet;

mod agent;
mod agents_at_scale;
mod fan_out_trees;
mod fuzz_replies;
mod http_node;
mod retry_policy;
mod runtime;
