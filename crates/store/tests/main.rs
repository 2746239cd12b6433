//! The store crate's tests in one binary: one module per area, shared fixtures in
//! `common`. One binary links the workspace once instead of once per file.

mod common;

mod bench_reads;
mod claims;
mod definitions;
mod fencing;
mod floor;
mod guard_budget;
mod metric_labels;
mod scaling;
mod scans;
mod senders;
mod tokens;
mod usage;
