//! Stand-ins for the external parties of an agent run, for demos and tests: a scripted
//! "model" that answers with decisions, and tools backed by the sim ledger (an external
//! system that, like a payment API, applies each idempotency key at most once).
//!
//! The run input says what they do:
//!
//! ```json
//! {"agent": {
//!    "script": [
//!      {"decision": "call_tool", "tool": "refund", "args": {"order_id": "A1", "amount": 150}},
//!      {"decision": "FINISH"}],
//!    "timeout_after_apply": false,
//!    "fail_first": 0,
//!    "no_reconcile": false}}
//! ```
//!
//! The model answers step N (completed tool calls so far) with `script[N]` (the last entry
//! once the script runs out). A call a person approved is run by the engine itself, so the
//! model is not asked again until that call has its result.

use std::time::Duration;

use rein_store::Store;
use serde_json::{Value, json};

use crate::handler::{ActionContext, BoxFuture, NodeHandler, Outcome, Reconciled};

/// How long `timeout_after_apply` keeps a tool call hanging after applying it: past any
/// tool timeout a definition would set for a test.
const HANG: Duration = Duration::from_secs(30);

fn agent_input(ctx: &ActionContext) -> &Value {
    ctx.run.data.get("agent").unwrap_or(&Value::Null)
}

/// The scripted model: registered as the `agent` action.
pub struct ScriptedModel;

impl NodeHandler for ScriptedModel {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        Box::pin(async move {
            let Some(script) = agent_input(&ctx).get("script").and_then(Value::as_array) else {
                return Outcome::Decision(json!({ "decision": "" }));
            };
            let Some(entry) = script
                .get(ctx.run.steps_completed as usize)
                .or_else(|| script.last())
            else {
                return Outcome::Decision(json!({ "decision": "" }));
            };
            Outcome::Decision(entry.clone())
        })
    }
}

/// A tool backed by the sim ledger: registered as `tool:NAME`. `refund` applies its
/// arguments under the call's idempotency key; `lookup_order` only reads.
pub struct SimTool {
    pub store: Store,
    pub name: &'static str,
    pub side_effect: bool,
}

impl NodeHandler for SimTool {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        self.side_effect
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let store = self.store.clone();
        let (name, side_effect) = (self.name, self.side_effect);
        Box::pin(async move {
            let result = json!({ "tool": name, "args": ctx.args, "step": ctx.step });
            if !side_effect {
                return Outcome::event(
                    "TOOL_SUCCEEDED",
                    json!({ "result": { "tool": name, "order": ctx.args, "found": true } }),
                );
            }
            // A transient failure before anything is applied, on the first `fail_first`
            // attempts: the call is retried under the same key.
            if agent_input(&ctx)["fail_first"].as_u64().unwrap_or(0) > u64::from(ctx.run.attempt) {
                let failure = rein_core::retry::Failure::transient(
                    rein_core::retry::kind::HTTP_5XX,
                    &format!(
                        "{name}: the ledger answered 503 (attempt {})",
                        ctx.run.attempt
                    ),
                );
                return Outcome::event(
                    "TOOL_RETRYABLE_FAILED",
                    json!({ "reason": "transient", "error": failure.to_json() }),
                );
            }
            let applied = match crate::sim::apply_to_ledger(&store, &ctx, &result).await {
                Ok(first) => first,
                Err(e) => return Outcome::InDoubt(format!("{name}: ledger unreachable: {e}")),
            };
            if agent_input(&ctx)["timeout_after_apply"] == json!(true) && ctx.run.attempt == 0 {
                // Applied, but the answer never comes back: the call is in doubt.
                tokio::time::sleep(HANG).await;
            }
            Outcome::event("TOOL_SUCCEEDED", json!({ "result": applied }))
        })
    }

    fn reconcile(&self, ctx: ActionContext) -> Option<BoxFuture<Result<Reconciled, String>>> {
        if agent_input(&ctx)["no_reconcile"] == json!(true) {
            return None;
        }
        let store = self.store.clone();
        Some(Box::pin(async move {
            match store.sim_lookup(&ctx.idempotency_key).await {
                Ok(Some(result)) => Ok(Reconciled::Applied(vec![(
                    "TOOL_SUCCEEDED".to_owned(),
                    json!({ "result": result, "reconciled": true }),
                )])),
                Ok(None) => Ok(Reconciled::NotApplied),
                Err(e) => Err(e.to_string()),
            }
        }))
    }
}
