//! The worker role: drives runs claimed under fenced leases (SPEC X1–X8, I1).

pub mod agent;
pub mod handler;
pub mod http;
pub mod runtime;
pub mod sim;
pub mod trace;

pub use handler::{ActionContext, BoxFuture, NodeHandler, Outcome, Reconciled, Registry};
pub use runtime::{Worker, WorkerConfig, WorkerStats};

/// Names of the actions [`builtin_registry`] handles.
pub fn builtin_registry_actions() -> &'static [&'static str] {
    &["sim", "noop", "http", "agent"]
}

/// The handlers every `rein worker` has: `sim`, `noop` and `http` (SPEC I2), and the
/// scripted model `agent` with its sim-ledger tools (`tool:refund`, `tool:lookup_order`).
pub fn builtin_registry(store: rein_store::Store) -> Registry {
    let mut registry = Registry::new();
    registry.register("agent", agent::ScriptedModel);
    registry.register(
        "tool:refund",
        agent::SimTool {
            store: store.clone(),
            name: "refund",
            side_effect: true,
        },
    );
    registry.register(
        "tool:lookup_order",
        agent::SimTool {
            store: store.clone(),
            name: "lookup_order",
            side_effect: false,
        },
    );
    registry.register("sim", sim::Sim { store });
    registry.register("noop", sim::Noop);
    registry.register("http", http::Http::new());
    registry
}
