//! The worker role: drives runs claimed under fenced leases (SPEC X1–X8, I1).

pub mod handler;
pub mod runtime;
pub mod sim;

pub use handler::{ActionContext, BoxFuture, NodeHandler, Outcome, Reconciled, Registry};
pub use runtime::{Worker, WorkerConfig, WorkerStats};

/// Names of the actions [`builtin_registry`] handles.
pub fn builtin_registry_actions() -> &'static [&'static str] {
    &["sim", "noop"]
}

/// The handlers every `rein worker` has: `sim` and `noop`.
pub fn builtin_registry(store: rein_store::Store) -> Registry {
    let mut registry = Registry::new();
    registry.register("sim", sim::Sim { store });
    registry.register("noop", sim::Noop);
    registry
}
