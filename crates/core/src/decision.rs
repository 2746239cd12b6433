//! Model decisions (SPEC D1, D2, M6): the model proposes, code disposes.
//!
//! A node action may answer with a decision instead of events:
//!
//! ```json
//! {"decision": "call_tool", "tool": "refund", "args": {"order_id": "A1", "amount": 150}}
//! {"decision": "TASK_READY", "payload": {"data": {"summary": "…"}}}
//! ```
//!
//! [`validate`] checks it in a fixed order — parse, decision allowed here, tool allowed here,
//! arguments against the tool's JSON Schema, the caller's permissions, idempotency — and
//! stops at the first failing step, which it names. Nothing here moves a run: a valid
//! decision becomes either a tool call the engine dispatches (and whose *result* events move
//! the run) or a candidate event the reducer still judges by its guards. A model saying
//! "done" is only a proposal.

use serde_json::{Value, json};

use crate::definition::{Definition, StateSpec, ToolSpec};
use crate::guard::GuardInput;
use crate::hash::{ActionIdentity, action_hash, canonical_json};
use crate::limits;
use crate::state::RunState;

/// The decision that asks the engine to call one of the state's tools.
pub const CALL_TOOL: &str = "call_tool";

/// The validation steps, in the order they run (SPEC D1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Parse,
    Decision,
    Tool,
    Schema,
    Permission,
    Idempotency,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Parse => "parse",
            Step::Decision => "decision",
            Step::Tool => "tool",
            Step::Schema => "schema",
            Step::Permission => "permission",
            Step::Idempotency => "idempotency",
        }
    }
}

/// Why a decision was refused: the step that failed and a reason a person can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub step: Step,
    pub reason: String,
}

impl Rejection {
    fn at(step: Step, reason: impl Into<String>) -> Rejection {
        Rejection {
            step,
            reason: reason.into(),
        }
    }

    /// The payload of the DECISION_REJECTED event that records it.
    pub fn payload(&self, decision: &Value) -> Value {
        let mut shown = canonical_json(decision);
        if shown.len() > 2048 {
            let mut cut = 2048;
            while !shown.is_char_boundary(cut) {
                cut -= 1;
            }
            shown.truncate(cut);
        }
        json!({ "step": self.step.as_str(), "reason": self.reason, "decision": shown })
    }
}

/// A tool call a valid decision asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub tool: String,
    pub args: Value,
    pub side_effect: bool,
    /// The tool's contract (SPEC X6): a failure of a tool declared `retryable = false` is
    /// recorded as not retryable, so its run takes the exhausted path instead of a retry.
    pub retryable: bool,
    /// Whether a human must approve this exact call first (SPEC H1).
    pub needs_approval: bool,
    /// The event that takes the run to its approval wait.
    pub approval_event: String,
    /// Tool + canonical arguments + tool version + approval-policy version (SPEC H2).
    pub action_hash: String,
    pub timeout_ms: Option<u64>,
    /// How long a request for this call stays open: the approval wait state's expiry.
    pub approval_expires_after_ms: Option<u64>,
}

/// What a valid decision leads to.
#[derive(Debug, Clone, PartialEq)]
pub enum Valid {
    /// Call a tool; its result events move the run.
    Call(ToolCall),
    /// Propose this event with this payload; the reducer's guards still decide.
    Event { kind: String, payload: Value },
}

/// Validates `decision`, made by the model in the run's current state.
pub fn validate(def: &Definition, run: &RunState, decision: &Value) -> Result<Valid, Rejection> {
    // 1. Parse.
    let Some(object) = decision.as_object() else {
        return Err(Rejection::at(Step::Parse, "a decision is a JSON object"));
    };
    if let Some(at) = crate::text::nul_at(decision) {
        return Err(Rejection::at(
            Step::Parse,
            format!("the decision holds a NUL character (\\u0000) at {at}; it cannot be stored"),
        ));
    }
    if let Some(at) = crate::blob::key_at(decision) {
        return Err(Rejection::at(
            Step::Parse,
            crate::blob::key_refused("the decision", &at),
        ));
    }
    let size = decision.to_string().len();
    if size > limits::DECISION_BYTES_MAX {
        return Err(Rejection::at(
            Step::Parse,
            format!(
                "the decision is {size} bytes; the limit is {}",
                limits::DECISION_BYTES_MAX
            ),
        ));
    }
    for key in object.keys() {
        if !matches!(
            key.as_str(),
            "decision" | "tool" | "args" | "payload" | "reason"
        ) {
            return Err(Rejection::at(
                Step::Parse,
                format!("unknown field `{key}` (known: decision, tool, args, payload, reason)"),
            ));
        }
    }
    let Some(kind) = object.get("decision").and_then(Value::as_str) else {
        return Err(Rejection::at(
            Step::Parse,
            "`decision` must be a string naming what to do",
        ));
    };
    let tool_name = match object.get("tool") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => Some(t.as_str()),
        Some(_) => return Err(Rejection::at(Step::Parse, "`tool` must be a string")),
    };
    let args = match object.get("args") {
        None | Some(Value::Null) => json!({}),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(_) => return Err(Rejection::at(Step::Parse, "`args` must be an object")),
    };
    let payload = match object.get("payload") {
        None | Some(Value::Null) => json!({}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(Rejection::at(Step::Parse, "`payload` must be an object")),
    };
    let Some(state) = def.state(&run.state) else {
        return Err(Rejection::at(
            Step::Decision,
            format!("the run is in undeclared state `{}`", run.state),
        ));
    };

    // 2. The decision is one this state allows.
    let allowed = |d: &str| {
        if state.decisions.is_empty() {
            if d == CALL_TOOL {
                !state.tools.is_empty()
            } else {
                def.could_ever_accept(&state.name, d)
            }
        } else {
            state.decisions.iter().any(|x| x == d)
        }
    };
    if !allowed(kind) {
        return Err(Rejection::at(
            Step::Decision,
            format!(
                "`{kind}` is not a decision state `{}` allows ({})",
                state.name,
                allowed_list(def, state)
            ),
        ));
    }
    if kind != CALL_TOOL {
        if tool_name.is_some() {
            return Err(Rejection::at(
                Step::Tool,
                format!("only `{CALL_TOOL}` names a tool; `{kind}` does not"),
            ));
        }
        return Ok(Valid::Event {
            kind: kind.to_owned(),
            payload,
        });
    }

    // 3. The tool is one this state offers.
    let Some(tool_name) = tool_name else {
        return Err(Rejection::at(Step::Tool, "`call_tool` needs `tool`"));
    };
    let Some(tool) = state.tools.iter().find(|t| t.name == tool_name) else {
        return Err(Rejection::at(
            Step::Tool,
            format!(
                "state `{}` offers no tool `{tool_name}` (offered: {})",
                state.name,
                state
                    .tools
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    };

    // 4. Arguments against the tool's schema.
    if let Some(schema) = def.tool_schema(&state.name, &tool.name) {
        let problems: Vec<String> = schema
            .iter_errors(&args)
            .take(5)
            .map(|e| {
                let at = e.instance_path().to_string();
                if at.is_empty() {
                    e.to_string()
                } else {
                    format!("{at}: {e}")
                }
            })
            .collect();
        if !problems.is_empty() {
            return Err(Rejection::at(
                Step::Schema,
                format!(
                    "arguments of `{}` do not match its schema: {}",
                    tool.name,
                    problems.join("; ")
                ),
            ));
        }
    }

    // 5. The caller may use the tool.
    if let Some(needed) = &tool.permission {
        let held = run
            .data
            .get("permissions")
            .and_then(Value::as_array)
            .is_some_and(|p| p.iter().any(|x| x.as_str() == Some(needed)));
        if !held {
            return Err(Rejection::at(
                Step::Permission,
                format!(
                    "`{}` needs permission `{needed}`, which the run's caller does not hold",
                    tool.name
                ),
            ));
        }
    }

    // 6. A side effect is never repeated blindly (SPEC X6).
    if tool.side_effect && !tool.requires_idempotency_key && run.attempt > 0 {
        return Err(Rejection::at(
            Step::Idempotency,
            format!(
                "`{}` has side effects and no idempotency key; it is not retried automatically",
                tool.name
            ),
        ));
    }

    let needs_approval = needs_approval(def, run, tool, &args).map_err(|reason| {
        Rejection::at(
            Step::Tool,
            format!("the approval rule of `{}` failed: {reason}", tool.name),
        )
    })?;
    // The approval policy of the state a call would wait in is part of what is approved.
    let wait = def
        .candidates(&state.name, tool.approval_event())
        .first()
        .and_then(|t| def.state(&t.to))
        .and_then(|s| s.approval.as_ref());
    let action_hash = action_hash(ActionIdentity {
        tool: &tool.name,
        args: &args,
        tool_version: tool.version.as_deref(),
        policy_version: wait.and_then(|p| p.policy_version.as_deref()),
    });
    Ok(Valid::Call(ToolCall {
        tool: tool.name.clone(),
        args,
        side_effect: tool.side_effect,
        retryable: tool.retryable,
        needs_approval,
        approval_event: tool.approval_event().to_owned(),
        action_hash,
        timeout_ms: tool.timeout_ms,
        approval_expires_after_ms: wait.map(|p| p.expires_after_ms),
    }))
}

fn allowed_list(def: &Definition, state: &StateSpec) -> String {
    if !state.decisions.is_empty() {
        return state.decisions.join(", ");
    }
    let mut out: Vec<&str> = def
        .transitions()
        .into_iter()
        .filter(|t| t.from == state.name)
        .map(|t| t.event.as_str())
        .collect();
    if !state.tools.is_empty() {
        out.push(CALL_TOOL);
    }
    out.sort_unstable();
    out.dedup();
    out.join(", ")
}

/// Evaluates the tool's approval rule (`always`, `never`, or a guard over `args`); a rule
/// that cannot be evaluated fails closed (approval needed).
fn needs_approval(
    def: &Definition,
    run: &RunState,
    tool: &ToolSpec,
    args: &Value,
) -> Result<bool, String> {
    match tool.approval.as_deref() {
        None | Some("never") => Ok(false),
        Some("always") => Ok(true),
        Some(_) => {
            let program = def
                .tool_approval_rule(&run.state, &tool.name)
                .ok_or_else(|| "the rule was not compiled with the definition".to_owned())?;
            let payload = json!({ "args": args });
            let input = GuardInput {
                run: run.guard_view(),
                event: json!({ "type": CALL_TOOL, "payload": payload }),
                payload: &payload,
                retry: serde_json::to_value(def.retry_policy(&run.state)).unwrap_or_default(),
                constants: serde_json::to_value(def.constants()).unwrap_or_default(),
                budget: def.budget_view(),
            };
            Ok(program.eval(&input).unwrap_or(true))
        }
    }
}
