//! Built-in node actions so a fleet can drive real runs of the built-in definitions with
//! no code: `sim` (configurable work, failures, approvals and a side effect on an external
//! ledger that honours idempotency keys) and `noop`.
//!
//! Run input, all optional: `{"sim": {"work_ms": 0, "transient_failures": 0,
//! "fatal_at_step": null, "side_effect": true, "approval": "none" | "grant" | "deny" |
//! "expire", "amount": 0, "steps": 1}}` (`steps` at most [`SIM_STEPS_MAX`]).

use std::time::Duration;

use rein_store::Store;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::handler::{ActionContext, BoxFuture, NodeHandler, Outcome, Reconciled};

/// Longest `work_ms` a sim action may ask for.
pub const SIM_WORK_MS_MAX: u64 = 60_000;
/// Most tool steps a sim research run may ask for: three events a step keep the longest
/// one well inside the default ceiling on a run's events.
pub const SIM_STEPS_MAX: u32 = 1_000;

/// What is wrong with a run input's `sim` settings, if anything. Enqueueing a run of a
/// definition whose states run `sim` is refused with it; a research run that still gets
/// one (enqueued by other means) fails at intake with INVALID_INPUT.
pub fn input_problem(input: &Value) -> Option<String> {
    let sim = input.get("sim")?;
    let parsed: SimInput = match serde_json::from_value(sim.clone()) {
        Ok(parsed) => parsed,
        Err(e) => return Some(format!("input.sim does not parse: {e}")),
    };
    match parsed.steps {
        Some(steps) if steps > SIM_STEPS_MAX => Some(format!(
            "input.sim.steps is {steps}; a sim run takes at most {SIM_STEPS_MAX} steps"
        )),
        _ => None,
    }
}

/// Whether `def` runs the `sim` action in any state.
pub fn runs_sim(def: &rein_core::Definition) -> bool {
    def.states().any(|s| s.action.as_deref() == Some("sim"))
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(default)]
pub struct SimInput {
    pub work_ms: u64,
    pub transient_failures: u32,
    pub fatal_at_step: Option<u32>,
    pub side_effect: Option<bool>,
    pub approval: Option<String>,
    pub amount: f64,
    /// Tool steps a research-agent run takes before it is ready.
    pub steps: Option<u32>,
}

impl SimInput {
    pub fn of(ctx: &ActionContext) -> SimInput {
        ctx.run
            .data
            .get("sim")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default()
    }

    fn wants_approval(&self) -> bool {
        matches!(self.approval.as_deref(), Some("grant" | "deny" | "expire"))
    }
}

/// Which role the current state plays for `sim`.
enum Role {
    Emit(&'static str),
    /// The run's sim settings are out of bounds: it fails with this event.
    Refuse(&'static str),
    Tool {
        ok: &'static str,
        transient: &'static str,
        fatal: &'static str,
        approval: &'static str,
    },
    Observe,
    Unknown,
}

fn role(ctx: &ActionContext) -> Role {
    match (ctx.definition.name(), ctx.node.as_str()) {
        (_, "INTAKE") if input_problem(&ctx.run.data).is_some() => Role::Refuse("INVALID_INPUT"),
        ("lifecycle", "planned") => Role::Emit("start"),
        ("lifecycle", "running") => Role::Tool {
            ok: "complete",
            transient: "transient_error",
            fatal: "fatal_error",
            approval: "pause_for_approval",
        },
        (_, "INTAKE") => Role::Emit("TASK_ACCEPTED"),
        (_, "PLANNING") => Role::Emit("PLAN_READY"),
        (_, "ACTING") => Role::Tool {
            ok: "TOOL_SUCCEEDED",
            transient: "TOOL_RETRYABLE_FAILED",
            fatal: "TOOL_FATAL_FAILED",
            approval: "APPROVAL_REQUIRED",
        },
        (_, "OBSERVING") => Role::Observe,
        (_, "FINALIZING") => Role::Emit("OUTPUT_COMMITTED"),
        _ => Role::Unknown,
    }
}

fn approval_pending(ctx: &ActionContext, sim: &SimInput) -> bool {
    sim.wants_approval() && ctx.run.data.get("sim_approval_requested").is_none()
}

pub struct Sim {
    pub store: Store,
}

impl NodeHandler for Sim {
    fn side_effect(&self, ctx: &ActionContext) -> bool {
        let sim = SimInput::of(ctx);
        matches!(role(ctx), Role::Tool { .. })
            && sim.side_effect.unwrap_or(true)
            && !approval_pending(ctx, &sim)
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let store = self.store.clone();
        let side_effect = self.side_effect(&ctx);
        Box::pin(async move {
            let sim = SimInput::of(&ctx);
            let work = Duration::from_millis(sim.work_ms.min(SIM_WORK_MS_MAX));
            if !work.is_zero() {
                tokio::time::sleep(work).await;
            }
            match role(&ctx) {
                Role::Emit(event) => Outcome::event(event, json!({})),
                Role::Refuse(event) => Outcome::event(
                    event,
                    json!({ "reason": "invalid_input",
                            "error": { "class": "fatal", "message": input_problem(&ctx.run.data) } }),
                ),
                Role::Observe => {
                    let wanted = sim.steps.unwrap_or(1).clamp(1, SIM_STEPS_MAX);
                    // Both candidates, so the definition's priority decides (SPEC M6).
                    if ctx.run.steps_completed >= wanted {
                        Outcome::Events(vec![
                            ("CONTINUE".into(), json!({})),
                            ("TASK_READY".into(), json!({})),
                        ])
                    } else {
                        Outcome::event("CONTINUE", json!({}))
                    }
                }
                Role::Tool {
                    ok,
                    transient,
                    fatal,
                    approval,
                } => {
                    if approval_pending(&ctx, &sim) {
                        return Outcome::event(
                            approval,
                            json!({ "data": { "sim_approval_requested": true },
                                    "args": { "amount": sim.amount } }),
                        );
                    }
                    if ctx.run.attempt < sim.transient_failures {
                        return Outcome::event(
                            transient,
                            json!({ "error": { "class": "transient", "message": "sim: transient failure" } }),
                        );
                    }
                    if sim.fatal_at_step == Some(ctx.step) {
                        return Outcome::event(
                            fatal,
                            json!({ "error": { "class": "fatal", "message": "sim: fatal failure" }, "reason": "sim_fatal" }),
                        );
                    }
                    let result = json!({ "step": ctx.step, "amount": sim.amount });
                    if !side_effect {
                        return Outcome::event(ok, json!({ "result": result }));
                    }
                    match apply_to_ledger(&store, &ctx, &result).await {
                        Ok(first) => Outcome::event(ok, json!({ "result": first })),
                        Err(e) => Outcome::InDoubt(format!("sim ledger unreachable: {e}")),
                    }
                }
                Role::Unknown => {
                    Outcome::InDoubt(format!("sim has no behaviour for node {}", ctx.node))
                }
            }
        })
    }

    fn reconcile(&self, ctx: ActionContext) -> Option<BoxFuture<Result<Reconciled, String>>> {
        let store = self.store.clone();
        Some(Box::pin(async move {
            let Role::Tool { ok, .. } = role(&ctx) else {
                return Ok(Reconciled::NotApplied);
            };
            match store.sim_lookup(&ctx.idempotency_key).await {
                Ok(Some(result)) => Ok(Reconciled::Applied(vec![(
                    ok.to_owned(),
                    json!({ "result": result }),
                )])),
                Ok(None) => Ok(Reconciled::NotApplied),
                Err(e) => Err(e.to_string()),
            }
        }))
    }
}

/// Does nothing and moves on with `next` (the benchmark chain).
pub struct Noop;

impl NodeHandler for Noop {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, _ctx: ActionContext) -> BoxFuture<Outcome> {
        Box::pin(async { Outcome::event("next", Value::Object(Default::default())) })
    }
}

/// Applies `result` to the sim ledger under the call's idempotency key; returns what the
/// ledger holds for that key (the first application's result, whoever made it).
pub(crate) async fn apply_to_ledger(
    store: &Store,
    ctx: &ActionContext,
    result: &Value,
) -> Result<Value, rein_store::StoreError> {
    store
        .sim_apply(
            ctx.run_id,
            &ctx.node,
            ctx.step as i32,
            &ctx.idempotency_key,
            &ctx.worker_id,
            result,
        )
        .await
        .map(|(first, _)| first)
}

/// The states where a sim run parks for a person's approval of its plain approval events.
pub const APPROVAL_WAIT_STATES: [&str; 2] = ["paused", "WAITING_APPROVAL"];

/// What a simulated approver answers a sim run parked for approval, as its input's
/// `sim.approval` asks: the event to send and whether it is a denial; `None` for `expire`
/// (left to the expiry timer).
pub fn approver_answer(definition: &str, data: &Value) -> Option<(&'static str, bool)> {
    let deny = match data["sim"]["approval"].as_str() {
        Some("expire") => return None,
        Some("deny") => true,
        _ => false,
    };
    let event = match (definition, deny) {
        ("lifecycle", true) => "approval_denied",
        ("lifecycle", false) => "approval_granted",
        (_, true) => "REJECTED",
        (_, false) => "APPROVED",
    };
    Some((event, deny))
}

/// A copy of `def` whose approvals expire after `expires_after_ms` (reminders, where the
/// definition sends them, `remind_before_ms` before that), registered as version
/// `def.version() + version_offset` of the same name: runs that leave an approval to expire
/// reach the scheduler's expiry within seconds instead of an hour.
pub fn with_fast_approval_expiry(
    def: &rein_core::Definition,
    expires_after_ms: u64,
    remind_before_ms: u64,
    version_offset: u32,
) -> Result<rein_core::Definition, String> {
    let mut spec = def.spec().clone();
    spec.version += version_offset;
    spec.description = format!(
        "{} (approvals expire after {expires_after_ms} ms)",
        spec.description
    );
    for state in &mut spec.states {
        if let Some(approval) = &mut state.approval {
            approval.expires_after_ms = expires_after_ms;
            if approval.remind_before_ms.is_some() {
                approval.remind_before_ms = Some(remind_before_ms);
            }
        }
    }
    rein_core::Definition::from_spec(spec, &rein_core::GuardRegistry::new())
        .map_err(|e| format!("fast-expiry copy of {}: {e}", def.name()))
}
