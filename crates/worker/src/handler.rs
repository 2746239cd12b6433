//! The Rust handler API (SPEC I1): register an async handler per node action name; the
//! runtime owns claims, lease renewal, cancellation, commits and idempotency keys.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use rein_core::retry::Failure;
use rein_core::{Definition, RunState};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// What a handler is told about the action it runs.
#[derive(Clone)]
pub struct ActionContext {
    pub run_id: Uuid,
    pub definition: Definition,
    /// The node (control state) the action belongs to.
    pub node: String,
    pub run: RunState,
    /// Ordinal of the logical action within the run, stable across retries and takeovers.
    pub step: u32,
    pub action_id: String,
    /// `hash(run_id, node, action_id)`: pass it to every external system.
    pub idempotency_key: String,
    /// The call id of this attempt (a retry gets a new one).
    pub call_id: String,
    /// Arguments of a tool call (`tool:NAME` handlers); `{}` for a node action.
    pub args: Value,
    pub fencing_token: i64,
    pub worker_id: String,
    /// Fires when the lease is lost, the run is cancelled, or the worker shuts down hard.
    pub cancel: CancellationToken,
    /// Where the action sends live deltas for watchers of the run (a model's tokens); goes
    /// nowhere without Redis. Never the record: only committed events are.
    pub deltas: rein_accel::stream::Deltas,
}

impl ActionContext {
    /// The resume brief of the run as this action sees it (SPEC D3): task, steps done with
    /// their results (or references), the pending step and the last error. Pass it to a
    /// model that picks the run up after a restart.
    pub fn resume_brief(&self) -> rein_core::brief::ResumeBrief {
        rein_core::brief::resume_brief(&self.definition, &self.run)
    }
}

/// What an action produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Candidate events; the engine commits the strongest one the definition accepts
    /// (SPEC M6). For a dispatched call the runtime adds its `call_id`.
    Events(Vec<(String, Value)>),
    /// The request may have been applied but no answer came back (SPEC X7).
    InDoubt(String),
    /// Sent, and no complete answer came back in time: in doubt like [`Outcome::InDoubt`],
    /// recorded with the fine class `timeout`, which a retry policy's `non_retryable` may
    /// name for the retry that follows if the call turns out not applied.
    TimedOut(String),
    /// A model's decision (SPEC D1): `{"decision": EVENT, "tool": NAME?, "args": {..}?,
    /// "payload": {..}?}`. The engine validates it before anything moves; a failed step
    /// commits DECISION_REJECTED.
    Decision(Value),
    /// A `model` action's reply: the decision it carried (or why none could be read, a
    /// rejection at step `parse`), recorded first as MODEL_REPLIED with the messages it was
    /// asked, each stored once by hash (SPEC E5).
    Model(ModelReply),
}

/// What a `model` action brings back: see [`Outcome::Model`].
#[derive(Debug, Clone, PartialEq)]
pub struct ModelReply {
    pub decision: Result<Value, String>,
    /// The MODEL_REPLIED payload ([`rein_core::model::replied_payload`]).
    pub replied: Value,
    /// Messages of the prompt not stored before.
    pub blobs: Vec<rein_core::blob::Blob>,
}

impl Outcome {
    pub fn event(kind: &str, payload: Value) -> Outcome {
        Outcome::Events(vec![(kind.to_owned(), payload)])
    }

    /// A classified failure (SPEC R2) that the definition records with `event`: the payload
    /// is `{"error": {"class", "kind", "status"?, "message", "retry_after_ms"?},
    /// "retry_after_ms"?}`. A handler names its own fine class in `failure.kind`, e.g.
    /// `Failure::transient("quota_exceeded", "..")`, and a retry policy's `non_retryable` may
    /// name it; a `Retry-After` is honoured by the backoff.
    pub fn failed(event: &str, failure: &Failure) -> Outcome {
        let mut payload = serde_json::Map::new();
        payload.insert("error".into(), failure.to_json());
        if let Some(ms) = failure.retry_after_ms() {
            payload.insert("retry_after_ms".into(), ms.into());
        }
        Outcome::event(event, Value::Object(payload))
    }
}

/// The answer of a reconcile hook about an in-doubt call.
#[derive(Debug, Clone, PartialEq)]
pub enum Reconciled {
    /// It was applied; these are the result events to commit.
    Applied(Vec<(String, Value)>),
    /// It was not applied; the step may be dispatched again with the same key.
    NotApplied,
}

pub trait NodeHandler: Send + Sync {
    /// Whether the action about to run has side effects. If so the runtime commits
    /// ACTION_DISPATCHED (with the idempotency key) before calling [`NodeHandler::run`].
    fn side_effect(&self, ctx: &ActionContext) -> bool;

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome>;

    /// Asks the external system, by idempotency key, what became of an in-doubt call.
    /// `None`: this handler has no reconcile hook, so the run needs an operator.
    fn reconcile(&self, _ctx: ActionContext) -> Option<BoxFuture<Result<Reconciled, String>>> {
        None
    }
}

/// Handlers by node action name.
#[derive(Clone, Default)]
pub struct Registry {
    handlers: HashMap<String, Arc<dyn NodeHandler>>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn register(&mut self, action: &str, handler: impl NodeHandler + 'static) -> &mut Self {
        self.handlers.insert(action.to_owned(), Arc::new(handler));
        self
    }

    pub fn get(&self, action: &str) -> Option<Arc<dyn NodeHandler>> {
        self.handlers.get(action).cloned()
    }
}
