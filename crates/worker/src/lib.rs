//! The worker role: drives runs claimed under fenced leases (SPEC X1–X8, I1).

pub mod agent;
pub mod handler;
pub mod http;
pub mod model;
pub mod runtime;
pub mod sim;
pub mod trace;

/// Where calls may connect: the policy lives in `rein-egress`, shared with the scheduler's
/// webhook deliveries.
pub use rein_egress as egress;

pub use handler::{
    ActionContext, BoxFuture, ModelReply, NodeHandler, Outcome, Reconciled, Registry,
};
pub use runtime::{CLAIM_GATHER_MS_DEFAULT, Worker, WorkerConfig, WorkerStats};

/// Names of the actions [`builtin_registry`] handles.
pub fn builtin_registry_actions() -> &'static [&'static str] {
    &["sim", "noop", "http", "agent", "model"]
}

/// The handlers every `rein worker` has: `sim`, `noop` and `http` (SPEC I2), and the
/// scripted model `agent` with its sim-ledger tools (`tool:refund`, `tool:lookup_order`).
/// Http nodes may call anything but the ranges [`egress::Policy`] refuses and the store's
/// own database.
pub fn builtin_registry(store: rein_store::Store) -> Registry {
    let http = http::HttpOptions {
        egress: egress::Policy::new(),
        quote_error_bodies: false,
    };
    builtin_registry_with(store, http)
}

/// [`builtin_registry`] with http nodes configured by `options`; the store's database is added
/// to the services its egress policy protects.
pub fn builtin_registry_with(store: rein_store::Store, options: http::HttpOptions) -> Registry {
    builtin_registry_full(store, options, model::ModelOptions::default())
}

/// [`builtin_registry_with`] with `model` actions configured by `model_options` (the key
/// variables definitions may name, the default endpoint); they call out through the same
/// egress policy as http nodes.
pub fn builtin_registry_full(
    store: rein_store::Store,
    mut options: http::HttpOptions,
    model_options: model::ModelOptions,
) -> Registry {
    if let Some((host, port)) = store.database_address() {
        options.egress = options.egress.protect(egress::rule::DATABASE, &host, port);
    }
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
    registry.register(
        "sim",
        sim::Sim {
            store: store.clone(),
        },
    );
    registry.register("noop", sim::Noop);
    let http = http::Http::with_options(options);
    registry.register(
        "model",
        model::Model::new(store, http.clone(), model_options),
    );
    registry.register("http", http);
    registry
}
