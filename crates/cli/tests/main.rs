//! The cli crate's tests in one binary: one module per area, shared fixtures in
//! `common`. One binary links the workspace once instead of once per file.

mod common;

mod api;
mod api_connections;
mod approvals;
mod audit_catches;
mod bench;
mod blobs;
mod chaos;
mod cli_db;
mod cli_offline;
mod clocks;
mod console;
mod contract;
mod conventions;
mod demo;
mod fleet;
mod fuzz_api;
mod hostile;
mod layering;
mod leader;
mod limits;
mod metrics;
mod model;
mod moves;
mod openapi_tools;
mod publish;
mod redact;
mod redis;
mod refund_story;
mod remote;
mod retention;
mod roles;
mod senders;
mod shutdown;
mod stream;
mod tokens;
mod traces;
mod twice;
mod webhooks;
mod whatif;
mod why;
mod workers;
