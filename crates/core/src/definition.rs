//! State-machine definitions (SPEC M1): the data format, its validation, and the validated
//! [`Definition`] every other module works with.
//!
//! A definition is written as TOML (primary) or JSON, or built in Rust as a
//! [`DefinitionSpec`]. [`Definition::from_spec`] is the only way to get a `Definition`, so
//! holding one proves it passed every check below.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::event::EngineEvent;
use crate::guard::{CompiledGuard, GuardRegistry, GuardSpec};
use crate::limits;
use crate::retry::RetryPolicy;

/// The serialised form of a definition, exactly as a file declares it (with defaults filled
/// in by serde). `Serialize` gives the normalised JSON of `rein definitions show`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DefinitionSpec {
    pub name: String,
    pub version: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    pub states: Vec<StateSpec>,
    pub events: Vec<String>,
    pub transitions: Vec<TransitionSpec>,
    /// Where CANCEL (an engine event, SPEC M8) takes a run from any non-terminal state.
    #[serde(default)]
    pub cancel_state: Option<String>,
    /// Competing candidate events, highest priority first (SPEC M6).
    #[serde(default)]
    pub priority: Vec<String>,
    /// Events that report the result of a dispatched action; they must name the pending
    /// call (SPEC X5) when one is pending.
    #[serde(default)]
    pub call_results: Vec<String>,
    /// Default retry policy for states that declare none.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// Constants visible to guards as `def.NAME`.
    #[serde(default)]
    pub constants: BTreeMap<String, serde_json::Value>,
    /// Per-run limits on model usage, wall time and steps; exhausting one fires `event`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetSpec>,
    /// Fleet-wide limits by key (SPEC K1), e.g. `"tool:search" = { rate = 10, per_ms = 1000 }`;
    /// states name the keys their action takes in `limits`. A worker's `--limit` overrides.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, LimitSpec>,
    /// Events a caller outside the engine may send (SPEC Z3): the replies, approvals and
    /// dependency notices the runs wait for. Engine events, call results and whatever else
    /// the definition declares are written only by the engine; CANCEL is always accepted.
    /// Absent (definitions stored before the field existed): the events some waiting state
    /// takes that the engine does not commit itself, and the approval events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_events: Option<Vec<String>>,
    /// The ceiling on a run's events (default `limits::RUN_EVENTS_DEFAULT`): the commit that
    /// reaches it ends the run in the cancel state with reason `step_limit`
    /// ([`crate::runaway`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_events: Option<u64>,
    /// Who may do what with the definition's runs (`[policy]`); absent: no rule beyond the
    /// scopes of the callers' tokens.
    #[serde(default, skip_serializing_if = "PolicySpec::is_empty")]
    pub policy: PolicySpec,
}

/// Separation-of-duties rules of a definition (`[policy]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// Whoever enqueued a run may not grant its approvals (a grant request or an approval
    /// event they send is refused); someone else must. Denying stays allowed.
    #[serde(default, skip_serializing_if = "is_false")]
    pub approver_may_not_be_enqueuer: bool,
}

impl PolicySpec {
    fn is_empty(&self) -> bool {
        self == &PolicySpec::default()
    }
}

/// A fleet-wide limit on one key: a rate (`rate` actions per `per_ms`, with bursts of up to
/// `burst`), a cap on actions in flight at once (`concurrency`), or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<u32>,
    /// The period `rate` is counted over (default one second).
    #[serde(default = "LimitSpec::default_per_ms")]
    pub per_ms: u64,
    /// How many actions may start at once after a quiet spell (the bucket's size, at least
    /// 1). No window of `per_ms` sees more than `rate + burst` starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
}

impl LimitSpec {
    fn default_per_ms() -> u64 {
        1000
    }

    /// The bucket's size: `burst`, at least 1.
    pub fn bucket(&self) -> u32 {
        self.burst.unwrap_or(1).max(1)
    }

    /// What is wrong with these values, if anything.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.rate.is_none() && self.concurrency.is_none() {
            out.push("declare `rate`, `concurrency` or both".to_owned());
        }
        if self.rate == Some(0) {
            out.push("`rate` must be at least 1".to_owned());
        }
        if self.rate.is_some_and(|r| r > limits::LIMIT_RATE_MAX) {
            out.push(format!("`rate` may be at most {}", limits::LIMIT_RATE_MAX));
        }
        if !(1..=limits::LIMIT_PERIOD_MS_MAX).contains(&self.per_ms) {
            out.push(format!(
                "`per_ms` must be 1..={} (one day)",
                limits::LIMIT_PERIOD_MS_MAX
            ));
        }
        if self.burst.is_some_and(|b| b > limits::LIMIT_RATE_MAX) {
            out.push(format!("`burst` may be at most {}", limits::LIMIT_RATE_MAX));
        }
        if self.burst.is_some() && self.rate.is_none() {
            out.push("`burst` needs a `rate`".to_owned());
        }
        if self.concurrency == Some(0)
            || self.concurrency.is_some_and(|c| c > limits::LIMIT_RATE_MAX)
        {
            out.push(format!(
                "`concurrency` must be 1..={}",
                limits::LIMIT_RATE_MAX
            ));
        }
        out
    }

    /// Parses the command-line form `10/s`, `60/min,burst=5`, `concurrency=4` or
    /// `10/s,burst=2,concurrency=4` (periods: ms, s, min, h, or a number of ms).
    pub fn parse(text: &str) -> Result<LimitSpec, String> {
        let mut spec = LimitSpec {
            rate: None,
            per_ms: LimitSpec::default_per_ms(),
            burst: None,
            concurrency: None,
        };
        let number = |what: &str, v: &str| -> Result<u32, String> {
            v.trim()
                .parse::<u32>()
                .map_err(|_| format!("{what} `{v}` is not a whole number"))
        };
        for part in text.split(',').map(str::trim) {
            if let Some((rate, per)) = part.split_once('/') {
                if spec.rate.is_some() {
                    return Err("give one rate".into());
                }
                spec.rate = Some(number("rate", rate)?);
                spec.per_ms = match per.trim() {
                    "ms" => 1,
                    "s" | "sec" => 1000,
                    "m" | "min" => 60_000,
                    "h" => 3_600_000,
                    n => n
                        .strip_suffix("ms")
                        .unwrap_or(n)
                        .parse::<u64>()
                        .map_err(|_| {
                            format!("period `{per}` is not one of ms, s, min, h or a number of ms")
                        })?,
                };
            } else if let Some(v) = part.strip_prefix("burst=") {
                spec.burst = Some(number("burst", v)?);
            } else if let Some(v) = part.strip_prefix("concurrency=") {
                spec.concurrency = Some(number("concurrency", v)?);
            } else {
                return Err(format!(
                    "`{part}` is not a rate (`10/s`), `burst=N` or `concurrency=N`"
                ));
            }
        }
        match spec.problems().into_iter().next() {
            Some(problem) => Err(problem),
            None => Ok(spec),
        }
    }
}

/// Whether `key` is a usable limit key: 1..=128 bytes of letters, digits and `:_-./`.
pub fn limit_key_problem(key: &str) -> Option<String> {
    if key.is_empty() || key.len() > limits::LIMIT_KEY_LEN_MAX {
        return Some(format!(
            "limit key `{key}` must be 1..={} bytes",
            limits::LIMIT_KEY_LEN_MAX
        ));
    }
    if !key
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, ':' | '_' | '-' | '.' | '/'))
    {
        return Some(format!(
            "limit key `{key}` may use only letters, digits, `:`, `_`, `-`, `.` and `/`"
        ));
    }
    None
}

/// Per-run budgets (declared limits are optional; at least one is needed). Usage is what
/// handlers report in `payload.usage = {tokens, cost}` of the events they produce, and steps
/// are the definition events applied; guards see `run.tokens_used`, `run.cost_used`,
/// `run.steps_used` and `budget.NAME`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    /// Measured by the database clock from the run's creation; the scheduler fires it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_time_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    /// The event committed when a budget is exhausted, instead of the run spending on.
    pub event: String,
}

/// A waiting state that fans out into named branches (SPEC P1): entering it starts one child
/// run per branch, and the state's join policy decides when to go on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FanOutSpec {
    pub branches: Vec<BranchSpec>,
    pub join: JoinSpec,
    /// Committed when the join policy is met.
    pub joined_event: String,
    /// Committed when the join policy can no longer be met.
    pub failed_event: String,
    /// Cancel the branches still running once the join is decided (CANCEL with reason
    /// `join_decided`); `false` lets them run to their end.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub cancel_losers: bool,
}

fn yes() -> bool {
    true
}

fn is_true(value: &bool) -> bool {
    *value
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BranchSpec {
    pub name: String,
    /// The definition the branch's child run follows.
    pub definition: String,
    /// Its version; the name's current version when absent (resolved when the branch
    /// starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// The child's input; the parent's `data.branch_inputs.NAME` (an object) is merged in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// Terminal states of the child that count as success; any other end is a failure.
    pub succeed_on: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinPolicy {
    /// Every branch succeeds; one failure fails the join.
    All,
    /// At least `k` branches succeed.
    AtLeast,
    /// `guard` (CEL over `run`, with `run.data.branches`) holds; failed once every branch
    /// finished without it holding.
    Guard,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinSpec {
    pub policy: JoinPolicy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    /// The run has work to do: a worker claims it and runs the state's action.
    Active,
    /// The run is parked: it waits for a timer, a human or a dependency.
    Waiting,
    /// No ordinary event is accepted any more.
    Terminal,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateSpec {
    pub name: String,
    pub kind: StateKind,
    #[serde(default, skip_serializing_if = "is_false")]
    pub initial: bool,
    /// Name of the node action a worker runs in this state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<TimeoutSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalPolicy>,
    /// A retry-wait state: after the backoff the scheduler commits `due` if its guards
    /// allow, else `exhausted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<BackoffSpec>,
    /// The state's transient-failure event for an attempt that ended without a result: the
    /// scheduler commits it when a worker's lease on a run in this state expires with no
    /// action pending (SPEC S2), and a worker when its reconcile finds an in-doubt call not
    /// applied (an `http` node's `transient_event` comes first there), so the attempt is
    /// counted on the definition's retry path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_lease_expired: Option<String>,
    /// The decisions a model may make here (SPEC D1): events it may name. Empty: any event
    /// this state has a transition for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<String>,
    /// Where an `http` action posts the run context (SPEC I2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpSpec>,
    /// Committed after DECISION_REJECTED when a model's decision here fails validation;
    /// without it the run waits for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_rejected_decision: Option<String>,
    /// Parallel branches started on entering this (waiting) state, and their join.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fan_out: Option<FanOutSpec>,
    /// Fleet-wide limit keys this state's action takes (SPEC K1), besides the implicit
    /// `action:NAME` (and `tool:NAME` for a tool a model calls).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<String>,
    /// Terminal states only: whether a run that ends here succeeded or failed (SPEC O2, the
    /// `outcome` of `rein_runs_finished_total`). A run that a CANCEL ended counts as
    /// cancelled wherever it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<TerminalOutcome>,
}

/// How a run that ends in a terminal state counts: [`StateSpec::outcome`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalOutcome {
    Succeeded,
    Failed,
}

/// An `http` node: Rein POSTs the run context to `url` and commits what the reply says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSpec {
    pub url: String,
    /// How long a call may take; past it, a sent call is in doubt.
    #[serde(default = "HttpSpec::default_timeout_ms")]
    pub timeout_ms: u64,
    /// Committed on a transient failure (connect error, 429, 5xx, a call in doubt that its
    /// reconcile found not applied), with the error and any Retry-After in its payload.
    pub transient_event: String,
    /// Committed on a fatal failure (400, 403, 404, 422 and other 4xx).
    pub fatal_event: String,
    /// Asked, with the idempotency key, whether an in-doubt call was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconcile_url: Option<String>,
}

impl HttpSpec {
    fn default_timeout_ms() -> u64 {
        10_000
    }
}

fn is_false(value: &bool) -> bool {
    !*value
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackoffSpec {
    pub due: String,
    pub exhausted: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutSpec {
    pub after_ms: u64,
    pub event: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    pub name: String,
    /// JSON Schema of the tool's arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<serde_json::Value>,
    #[serde(default)]
    pub side_effect: bool,
    #[serde(default)]
    pub retryable: bool,
    #[serde(default)]
    pub requires_idempotency_key: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// When a call needs a human's approval first: `always`, `never` (default), or a guard
    /// expression over the call's arguments such as `args.amount > 100`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
    /// The event that takes the run to its approval wait (default `APPROVAL_REQUIRED`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_event: Option<String>,
    /// A permission the run's caller must hold (listed in the run input's `permissions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permission: Option<String>,
}

impl ToolSpec {
    pub fn approval_event(&self) -> &str {
        self.approval_event
            .as_deref()
            .unwrap_or("APPROVAL_REQUIRED")
    }

    /// Whether some call of this tool can need an approval.
    pub fn may_need_approval(&self) -> bool {
        self.approval.as_deref().is_some_and(|a| a != "never")
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalPolicy {
    pub expires_after_ms: u64,
    /// How long before expiry the reminder event fires; none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remind_before_ms: Option<u64>,
    /// Event committed as a reminder (may be a self-loop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reminder_event: Option<String>,
    /// Event committed when the approval expires; it must leave the state.
    pub expiry_event: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<String>,
    /// Event a grant delivers (default `APPROVED`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granted_event: Option<String>,
    /// Event a denial delivers (default `REJECTED`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied_event: Option<String>,
}

impl ApprovalPolicy {
    pub fn granted_event(&self) -> &str {
        self.granted_event.as_deref().unwrap_or("APPROVED")
    }

    pub fn denied_event(&self) -> &str {
        self.denied_event.as_deref().unwrap_or("REJECTED")
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransitionSpec {
    pub from: String,
    pub event: String,
    pub to: String,
    /// Shorthand for a single business guard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guards: Vec<GuardSpec>,
    /// Among transitions for the same (from, event), the highest priority whose guards pass
    /// wins. Required to tell such transitions apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub effects: Vec<Effect>,
}

/// What a transition does to the run's data besides moving it (the `Δd` of seed 000 §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// `attempt += 1` (a retry is being made).
    IncrementAttempt,
    /// `attempt = 0` (a new logical step starts fresh).
    ResetAttempt,
    /// Append `payload.result` to the run's results.
    AppendResult,
    /// The dispatched action is finished for good (success or fatal): the next action is a
    /// new logical step.
    CompleteStep,
}

/// Input formats for definition documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Toml,
    Json,
}

impl Format {
    /// Picks the format from a file name's extension; TOML unless it ends in `.json`.
    pub fn from_path(path: &str) -> Format {
        if path.to_ascii_lowercase().ends_with(".json") {
            Format::Json
        } else {
            Format::Toml
        }
    }
}

/// One thing wrong with a definition: where it is and why it is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefinitionProblem {
    /// Path to the offending item, e.g. `transitions[3] (ACTING + FOO -> BAR)`.
    pub item: String,
    pub reason: String,
}

impl fmt::Display for DefinitionProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.item, self.reason)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DefinitionError {
    #[error("definition is {size} bytes; the limit is {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    #[error("definition does not parse: {0}")]
    Parse(String),
    #[error("definition is invalid ({} problem{}):\n{}", .0.len(), if .0.len() == 1 { "" } else { "s" }, list(.0))]
    Invalid(Vec<DefinitionProblem>),
}

fn list(problems: &[DefinitionProblem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl DefinitionError {
    pub fn problems(&self) -> Vec<DefinitionProblem> {
        match self {
            DefinitionError::Invalid(problems) => problems.clone(),
            other => vec![DefinitionProblem {
                item: "document".to_owned(),
                reason: other.to_string(),
            }],
        }
    }
}

/// Which rules a spec is validated with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rules {
    /// Every rule: a definition being registered.
    Registration,
    /// The rules every stored definition met when it was registered.
    Stored,
}

/// A transition after validation: guards compiled, names checked.
#[derive(Clone)]
pub struct Transition {
    pub index: usize,
    pub from: String,
    pub event: String,
    pub to: String,
    pub priority: i32,
    /// Sorted by kind: legality, then safety, then business (SPEC M5).
    pub guards: Vec<CompiledGuard>,
    pub effects: Vec<Effect>,
}

impl fmt::Debug for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} + {} -> {}", self.from, self.event, self.to)
    }
}

/// A validated definition. Cheap to clone (shared inside).
#[derive(Clone)]
pub struct Definition {
    inner: Arc<Inner>,
}

struct Inner {
    spec: DefinitionSpec,
    states: HashMap<String, StateSpec>,
    events: BTreeSet<String>,
    call_results: BTreeSet<String>,
    /// Candidates for each (state, event), highest priority first.
    table: HashMap<(String, String), Vec<Transition>>,
    priority: HashMap<String, usize>,
    initial: String,
    cancel_state: String,
    hash: String,
    /// Compiled argument schemas by (state, tool), built once.
    schemas: HashMap<(String, String), Arc<jsonschema::Validator>>,
    /// Compiled approval rules (guard expressions) by (state, tool), built once.
    approval_rules: HashMap<(String, String), Arc<crate::guard::Expr>>,
    /// Compiled join guards by fan-out state.
    join_guards: HashMap<String, Arc<crate::guard::Expr>>,
    /// What outside callers and approvers may send.
    senders: crate::external::Senders,
    /// What validation found doubtful but not wrong (the definition loads and runs).
    warnings: Vec<DefinitionProblem>,
}

impl fmt::Debug for Definition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Definition({}@v{})", self.name(), self.version())
    }
}

impl Definition {
    /// Parses and validates a definition document, with the rules that apply when one is
    /// registered on top of [`Definition::from_spec`]'s: an http node's URLs name a host and
    /// hold no credentials ([`crate::http_url`]).
    pub fn parse(
        text: &str,
        format: Format,
        guards: &GuardRegistry,
    ) -> Result<Definition, DefinitionError> {
        if text.len() > limits::DEFINITION_BYTES_MAX {
            return Err(DefinitionError::TooLarge {
                size: text.len(),
                limit: limits::DEFINITION_BYTES_MAX,
            });
        }
        let spec: DefinitionSpec = match format {
            Format::Toml => toml::from_str(text).map_err(|e| DefinitionError::Parse(e.to_string())),
            Format::Json if !crate::text::json_text_is_object(text.as_bytes()) => Err(
                DefinitionError::Parse("a JSON definition is an object (`{...}`)".to_owned()),
            ),
            Format::Json => {
                serde_json::from_str(text).map_err(|e| DefinitionError::Parse(e.to_string()))
            }
        }?;
        // Rules for documents being registered; stored definitions keep loading without them.
        let url_problems = crate::http_url::problems(&spec);
        match Definition::from_spec(spec, guards) {
            Ok(_) if !url_problems.is_empty() => Err(DefinitionError::Invalid(url_problems)),
            Err(DefinitionError::Invalid(mut problems)) => {
                problems.extend(url_problems);
                Err(DefinitionError::Invalid(problems))
            }
            other => other,
        }
    }

    /// Validates a spec built in Rust or parsed from a file, with every rule a definition
    /// being registered must meet. Every problem is reported, not only the first.
    pub fn from_spec(
        spec: DefinitionSpec,
        guards: &GuardRegistry,
    ) -> Result<Definition, DefinitionError> {
        Definition::validate(spec, guards, Rules::Registration)
    }

    /// Validates a spec that was registered before: rules that only apply to new
    /// registrations (the cost bound of guard expressions) are not checked, so definitions
    /// already stored keep loading. Their guards stay safe to run: an expression over budget
    /// is refused when it is evaluated, the same way on every replay.
    pub fn from_stored_spec(
        spec: DefinitionSpec,
        guards: &GuardRegistry,
    ) -> Result<Definition, DefinitionError> {
        Definition::validate(spec, guards, Rules::Stored)
    }

    fn validate(
        spec: DefinitionSpec,
        guards: &GuardRegistry,
        rules: Rules,
    ) -> Result<Definition, DefinitionError> {
        let mut problems = Vec::new();
        let mut p =
            |item: String, reason: String| problems.push(DefinitionProblem { item, reason });
        // Guards read the constants as `def`: they are part of the data a bound must cover.
        let guard_data =
            crate::guard::DataSize::of(&serde_json::to_value(&spec.constants).unwrap_or_default())
                .max(crate::guard::DataSize::reference());
        let cost_of = |expr: &crate::guard::Expr| match rules {
            Rules::Registration => expr.check_cost(guard_data),
            Rules::Stored => Ok(0),
        };

        check_name(&mut p, "name", &spec.name);
        if !(1..=limits::VERSION_MAX).contains(&spec.version) {
            p(
                "version".into(),
                format!("must be 1..={}", limits::VERSION_MAX),
            );
        }
        if spec.states.len() > limits::STATES_MAX {
            p(
                "states".into(),
                format!(
                    "{} states; the limit is {}",
                    spec.states.len(),
                    limits::STATES_MAX
                ),
            );
        }
        if spec.events.len() > limits::EVENTS_MAX {
            p(
                "events".into(),
                format!(
                    "{} events; the limit is {}",
                    spec.events.len(),
                    limits::EVENTS_MAX
                ),
            );
        }
        if spec.transitions.len() > limits::TRANSITIONS_MAX {
            p(
                "transitions".into(),
                format!(
                    "{} transitions; the limit is {}",
                    spec.transitions.len(),
                    limits::TRANSITIONS_MAX
                ),
            );
        }

        // States.
        let mut states: HashMap<String, StateSpec> = HashMap::new();
        let mut initials = Vec::new();
        // Tool approval rules, compiled once here and kept for every call.
        let mut approval_rules: HashMap<(String, String), Arc<crate::guard::Expr>> = HashMap::new();
        for (i, state) in spec.states.iter().enumerate() {
            let item = format!("states[{i}] ({})", state.name);
            check_name(&mut p, &item, &state.name);
            if states.insert(state.name.clone(), state.clone()).is_some() {
                p(item.clone(), format!("duplicate state `{}`", state.name));
            }
            if state.initial {
                initials.push(state.name.clone());
                if state.kind == StateKind::Terminal {
                    p(item.clone(), "the initial state cannot be terminal".into());
                }
            }
            if state.outcome.is_some() && state.kind != StateKind::Terminal {
                p(
                    format!("{item}.outcome"),
                    "only a terminal state has an outcome (how a run that ends there counts)"
                        .into(),
                );
            }
            if let Some(action) = &state.action {
                check_name(&mut p, &format!("{item}.action"), action);
                if state.kind == StateKind::Terminal {
                    p(
                        format!("{item}.action"),
                        "a terminal state runs no action".into(),
                    );
                }
            }
            if let Some(retry) = &state.retry
                && let Err(reason) = retry.validate()
            {
                p(format!("{item}.retry"), reason);
            }
            let mut tool_names = BTreeSet::new();
            for (t, tool) in state.tools.iter().enumerate() {
                let tool_item = format!("{item}.tools[{t}] ({})", tool.name);
                check_name(&mut p, &tool_item, &tool.name);
                if !tool_names.insert(tool.name.clone()) {
                    p(tool_item.clone(), format!("duplicate tool `{}`", tool.name));
                }
                if let Some(when) = &tool.approval
                    && when != "always"
                    && when != "never"
                {
                    match crate::guard::compile_expr(when) {
                        Ok(rule) => {
                            if let Err(reason) = cost_of(&rule) {
                                p(format!("{tool_item}.approval"), reason);
                            }
                            approval_rules
                                .insert((state.name.clone(), tool.name.clone()), Arc::new(rule));
                        }
                        Err(reason) => p(format!("{tool_item}.approval"), reason),
                    }
                }
                if let Some(schema) = &tool.schema
                    && !schema.is_object()
                    && !schema.is_boolean()
                {
                    p(
                        format!("{tool_item}.schema"),
                        "a JSON Schema must be an object or a boolean".into(),
                    );
                }
                if tool.side_effect && tool.retryable && !tool.requires_idempotency_key {
                    p(
                        tool_item.clone(),
                        "a side-effect tool is retried only with an idempotency key: set `requires_idempotency_key = true` or `retryable = false` (SPEC X6)".into(),
                    );
                }
            }
        }
        if let Err(reason) = spec.retry.validate() {
            p("retry".into(), reason);
        }
        match initials.len() {
            0 => p(
                "states".into(),
                "missing initial state: mark exactly one state `initial = true`".into(),
            ),
            1 => {}
            _ => p(
                "states".into(),
                format!(
                    "duplicate initial state: {} are all marked initial",
                    initials.join(", ")
                ),
            ),
        }

        // Events.
        let mut events = BTreeSet::new();
        for (i, event) in spec.events.iter().enumerate() {
            let item = format!("events[{i}] ({event})");
            check_name(&mut p, &item, event);
            if EngineEvent::is_reserved(event) {
                p(
                    item.clone(),
                    format!("`{event}` is an engine event name and cannot be declared"),
                );
            }
            if !events.insert(event.clone()) {
                p(item, format!("duplicate event `{event}`"));
            }
        }
        let mut call_results = BTreeSet::new();
        for (i, event) in spec.call_results.iter().enumerate() {
            if !events.contains(event) {
                p(
                    format!("call_results[{i}] ({event})"),
                    format!("unknown event `{event}`"),
                );
            }
            call_results.insert(event.clone());
        }
        let mut priority = HashMap::new();
        for (i, event) in spec.priority.iter().enumerate() {
            if !events.contains(event) {
                p(
                    format!("priority[{i}] ({event})"),
                    format!("unknown event `{event}`"),
                );
            }
            if priority.insert(event.clone(), i).is_some() {
                p(
                    format!("priority[{i}] ({event})"),
                    format!("`{event}` is listed twice"),
                );
            }
        }
        for (name, value) in &spec.constants {
            if !(value.is_number() || value.is_boolean() || value.is_string()) {
                p(
                    format!("constants.{name}"),
                    "a constant must be a number, boolean or string".into(),
                );
            }
        }

        // Transitions.
        let mut table: HashMap<(String, String), Vec<Transition>> = HashMap::new();
        for (i, t) in spec.transitions.iter().enumerate() {
            let item = format!("transitions[{i}] ({} + {} -> {})", t.from, t.event, t.to);
            let from = states.get(&t.from);
            if from.is_none() {
                p(
                    item.clone(),
                    format!("unknown state `{}` in `from`", t.from),
                );
            }
            if !states.contains_key(&t.to) {
                p(item.clone(), format!("unknown state `{}` in `to`", t.to));
            }
            if !events.contains(&t.event) {
                p(item.clone(), format!("unknown event `{}`", t.event));
            }
            if from.is_some_and(|s| s.kind == StateKind::Terminal) {
                p(
                    item.clone(),
                    format!(
                        "terminal state `{}` cannot have outgoing transitions",
                        t.from
                    ),
                );
            }
            let mut specs: Vec<GuardSpec> = t.guards.clone();
            if let Some(expr) = &t.guard {
                specs.push(GuardSpec::business(expr));
            }
            if specs.len() > limits::GUARDS_PER_TRANSITION_MAX {
                p(
                    item.clone(),
                    format!(
                        "{} guards; the limit is {}",
                        specs.len(),
                        limits::GUARDS_PER_TRANSITION_MAX
                    ),
                );
            }
            let mut compiled = Vec::new();
            for (g, guard) in specs.iter().enumerate() {
                match guard.compile(guards) {
                    Ok(c) => {
                        if let Some(Err(reason)) = c.expr().map(cost_of) {
                            p(format!("{item}.guards[{g}]"), reason);
                        }
                        compiled.push(c);
                    }
                    Err(reason) => p(format!("{item}.guards[{g}]"), reason),
                }
            }
            compiled.sort_by_key(|g| g.kind);
            let mut effects = t.effects.clone();
            effects.dedup();
            table
                .entry((t.from.clone(), t.event.clone()))
                .or_default()
                .push(Transition {
                    index: i,
                    from: t.from.clone(),
                    event: t.event.clone(),
                    to: t.to.clone(),
                    priority: t.priority.unwrap_or(0),
                    guards: compiled,
                    effects,
                });
        }
        let mut keys: Vec<_> = table.keys().cloned().collect();
        keys.sort();
        for key in keys {
            let Some(candidates) = table.get_mut(&key) else {
                continue;
            };
            candidates.sort_by(|a, b| b.priority.cmp(&a.priority).then(a.index.cmp(&b.index)));
            // One event may run every guard of its candidates: together they share one budget.
            let steps: u64 = candidates
                .iter()
                .flat_map(|t| t.guards.iter())
                .filter_map(|g| g.expr().and_then(|e| cost_of(e).ok()))
                .fold(0u64, u64::saturating_add);
            if steps > limits::GUARD_STEPS_MAX {
                p(
                    format!("transitions from `{}` on `{}`", key.0, key.1),
                    format!(
                        "their guards may take up to {steps} evaluation steps together over data \
                         with lists of {} entries (each one event may run); the limit is {}: \
                         use fewer or cheaper guards for this event",
                        guard_data.longest,
                        limits::GUARD_STEPS_MAX
                    ),
                );
            }
            for pair in candidates.windows(2) {
                let (a, b) = (&pair[0], &pair[1]);
                let item = format!(
                    "transitions[{}] ({} + {} -> {})",
                    b.index, b.from, b.event, b.to
                );
                if a.to == b.to && a.guards.is_empty() && b.guards.is_empty() {
                    p(item, format!("duplicate of transitions[{}]", a.index));
                } else if a.priority == b.priority {
                    p(
                        item,
                        format!(
                            "ambiguous with transitions[{}]: both could fire for ({}, {}); give them different `priority` values",
                            a.index, a.from, a.event
                        ),
                    );
                } else if a.guards.is_empty() {
                    p(
                        item,
                        format!(
                            "unreachable: transitions[{}] has a higher priority and no guard, so it always wins for ({}, {})",
                            a.index, a.from, a.event
                        ),
                    );
                }
            }
        }

        // Cancel state.
        let cancel_state = match &spec.cancel_state {
            None => {
                p(
                    "cancel_state".into(),
                    "missing cancel state: name the state CANCEL moves a run to".into(),
                );
                String::new()
            }
            Some(name) => {
                match states.get(name) {
                    None => p("cancel_state".into(), format!("unknown state `{name}`")),
                    Some(s) if s.kind != StateKind::Terminal => p(
                        "cancel_state".into(),
                        format!("`{name}` must be a terminal state"),
                    ),
                    Some(_) => {}
                }
                name.clone()
            }
        };

        let mut schemas: HashMap<(String, String), Arc<jsonschema::Validator>> = HashMap::new();
        // Per-state timeouts and approval events must leave the state.
        let leaves = |state: &str, event: &str| {
            table
                .get(&(state.to_owned(), event.to_owned()))
                .is_some_and(|c| c.iter().any(|t| t.to != state))
        };
        let accepts =
            |state: &str, event: &str| table.contains_key(&(state.to_owned(), event.to_owned()));
        for (i, state) in spec.states.iter().enumerate() {
            let item = format!("states[{i}] ({})", state.name);
            if let Some(timeout) = &state.timeout {
                if timeout.after_ms == 0 {
                    p(
                        format!("{item}.timeout"),
                        "after_ms must be greater than 0".into(),
                    );
                }
                if !leaves(&state.name, &timeout.event) {
                    p(
                        format!("{item}.timeout"),
                        format!(
                            "timeout event `{}` does not leave state `{}`",
                            timeout.event, state.name
                        ),
                    );
                }
            }
            if let Some(approval) = &state.approval {
                if state.kind != StateKind::Waiting {
                    p(
                        format!("{item}.approval"),
                        "an approval is waited for in a `waiting` state".into(),
                    );
                }
                if approval.expires_after_ms == 0 {
                    p(
                        format!("{item}.approval"),
                        "expires_after_ms must be greater than 0".into(),
                    );
                }
                if !leaves(&state.name, &approval.expiry_event) {
                    p(
                        format!("{item}.approval"),
                        format!(
                            "expiry event `{}` does not leave state `{}`",
                            approval.expiry_event, state.name
                        ),
                    );
                }
                if let Some(reminder) = &approval.reminder_event
                    && !accepts(&state.name, reminder)
                {
                    p(
                        format!("{item}.approval"),
                        format!(
                            "reminder event `{reminder}` is not accepted in state `{}`",
                            state.name
                        ),
                    );
                }
                if approval
                    .remind_before_ms
                    .is_some_and(|r| r >= approval.expires_after_ms)
                {
                    p(
                        format!("{item}.approval"),
                        "remind_before_ms must be less than expires_after_ms".into(),
                    );
                }
            }
            if let Some(backoff) = &state.backoff {
                if state.kind != StateKind::Waiting {
                    p(
                        format!("{item}.backoff"),
                        "a backoff is waited for in a `waiting` state".into(),
                    );
                }
                for event in [&backoff.due, &backoff.exhausted] {
                    if !leaves(&state.name, event) {
                        p(
                            format!("{item}.backoff"),
                            format!(
                                "backoff event `{event}` does not leave state `{}`",
                                state.name
                            ),
                        );
                    }
                }
            }
            if let Some(event) = &state.on_lease_expired
                && !accepts(&state.name, event)
            {
                p(
                    format!("{item}.on_lease_expired"),
                    format!("event `{event}` is not accepted in state `{}`", state.name),
                );
            }
            if state.kind == StateKind::Terminal && state.timeout.is_some() {
                p(
                    format!("{item}.timeout"),
                    "a terminal state has no timeout".into(),
                );
            }
            if let Some(event) = &state.on_rejected_decision
                && !accepts(&state.name, event)
            {
                p(
                    format!("{item}.on_rejected_decision"),
                    format!("event `{event}` is not accepted in state `{}`", state.name),
                );
            }
            for (d, decision) in state.decisions.iter().enumerate() {
                if decision == crate::decision::CALL_TOOL {
                    if state.tools.is_empty() {
                        p(
                            format!("{item}.decisions[{d}] ({decision})"),
                            format!("state `{}` declares no tools to call", state.name),
                        );
                    }
                } else if !accepts(&state.name, decision) {
                    p(
                        format!("{item}.decisions[{d}] ({decision})"),
                        format!("state `{}` has no transition on `{decision}`", state.name),
                    );
                }
            }
            for (t, tool) in state.tools.iter().enumerate() {
                let tool_item = format!("{item}.tools[{t}] ({})", tool.name);
                if tool.may_need_approval() && !leaves(&state.name, tool.approval_event()) {
                    p(
                        format!("{tool_item}.approval_event"),
                        format!(
                            "event `{}` does not leave state `{}`; a call needing approval cannot wait for it",
                            tool.approval_event(),
                            state.name
                        ),
                    );
                }
                if let Some(schema) = &tool.schema {
                    match jsonschema::validator_for(schema) {
                        Ok(v) => {
                            schemas.insert((state.name.clone(), tool.name.clone()), Arc::new(v));
                        }
                        Err(e) => p(
                            format!("{tool_item}.schema"),
                            format!("not a valid JSON Schema: {e}"),
                        ),
                    }
                }
            }
            match (&state.http, state.action.as_deref()) {
                (Some(http), Some("http")) => {
                    let item = format!("{item}.http");
                    for (what, url) in
                        std::iter::once(("url", &http.url)).chain(http.reconcile_url.iter().map(|u| ("reconcile_url", u)))
                    {
                        if !(url.starts_with("http://") || url.starts_with("https://"))
                            || url.len() > limits::URL_LEN_MAX
                        {
                            p(
                                format!("{item}.{what}"),
                                format!(
                                    "`{url}` must be an http:// or https:// URL of at most {} bytes",
                                    limits::URL_LEN_MAX
                                ),
                            );
                        }
                    }
                    if http.timeout_ms == 0 || http.timeout_ms > 600_000 {
                        p(
                            format!("{item}.timeout_ms"),
                            "must be 1 ..= 600000".into(),
                        );
                    }
                    for (what, event) in [
                        ("transient_event", &http.transient_event),
                        ("fatal_event", &http.fatal_event),
                    ] {
                        if !leaves(&state.name, event) {
                            p(
                                format!("{item}.{what}"),
                                format!(
                                    "event `{event}` does not leave state `{}`",
                                    state.name
                                ),
                            );
                        }
                    }
                }
                (Some(_), _) => p(
                    format!("{item}.http"),
                    "only a state whose action is `http` takes an `http` table".into(),
                ),
                (None, Some("http")) => p(
                    format!("{item}.action"),
                    "an `http` action needs an `http` table with `url`, `transient_event` and `fatal_event`".into(),
                ),
                (None, _) => {}
            }
        }

        let mut join_guards: HashMap<String, Arc<crate::guard::Expr>> = HashMap::new();
        for (i, state) in spec.states.iter().enumerate() {
            if let Some(fan_out) = &state.fan_out {
                let item = format!("states[{i}] ({}).fan_out", state.name);
                check_fan_out(&mut p, &item, state, fan_out, &leaves, &mut join_guards);
                if let Some(Err(reason)) = join_guards.get(&state.name).map(|e| cost_of(e)) {
                    p(format!("{item}.join.guard"), reason);
                }
            }
        }
        if let Some(budget) = &spec.budget {
            check_budget(&mut p, budget, &events, &table);
        }
        for (key, limit) in &spec.limits {
            if let Some(problem) = limit_key_problem(key) {
                p(format!("limits.{key}"), problem);
            }
            for problem in limit.problems() {
                p(format!("limits.{key}"), problem);
            }
        }
        for (i, state) in spec.states.iter().enumerate() {
            if state.limits.len() > limits::LIMITS_PER_STATE_MAX {
                p(
                    format!("states[{i}] ({}).limits", state.name),
                    format!("at most {} keys", limits::LIMITS_PER_STATE_MAX),
                );
            }
            for key in &state.limits {
                if let Some(problem) = limit_key_problem(key) {
                    p(format!("states[{i}] ({}).limits", state.name), problem);
                }
            }
            if !state.limits.is_empty() && state.action.is_none() {
                p(
                    format!("states[{i}] ({}).limits", state.name),
                    "only a state with an `action` takes limits".into(),
                );
            }
        }

        // Reachability from the initial state. CANCEL reaches the cancel state.
        if let [initial] = initials.as_slice() {
            let mut seen = BTreeSet::new();
            let mut queue = VecDeque::from([initial.clone()]);
            seen.insert(initial.clone());
            while let Some(state) = queue.pop_front() {
                for t in spec.transitions.iter().filter(|t| t.from == state) {
                    if seen.insert(t.to.clone()) {
                        queue.push_back(t.to.clone());
                    }
                }
            }
            if states.contains_key(&cancel_state) {
                seen.insert(cancel_state.clone());
            }
            for (i, state) in spec.states.iter().enumerate() {
                if !seen.contains(&state.name) {
                    p(
                        format!("states[{i}] ({})", state.name),
                        format!("unreachable state: no path leads to it from `{initial}`"),
                    );
                }
            }
        }
        if !spec.states.iter().any(|s| s.kind == StateKind::Terminal) {
            p(
                "states".into(),
                "no terminal state: a run could never end".into(),
            );
        }

        let senders = crate::external::resolve(&spec, &events, &call_results, &table, &mut p);
        if let Some(problem) = spec.max_events.and_then(crate::runaway::max_events_problem) {
            p("max_events".into(), problem);
        }

        if !problems.is_empty() {
            return Err(DefinitionError::Invalid(problems));
        }
        let mut warnings = crate::runaway::timer_cycle_warnings(&spec);
        warnings.extend(crate::budget::warnings(&spec));
        let hash = crate::hash::sha256_hex(
            crate::hash::canonical_json(&serde_json::to_value(&spec).unwrap_or_default())
                .as_bytes(),
        );
        Ok(Definition {
            inner: Arc::new(Inner {
                initial: initials.remove(0),
                cancel_state,
                states,
                events,
                call_results,
                table,
                priority,
                hash,
                spec,
                schemas,
                approval_rules,
                join_guards,
                senders,
                warnings,
            }),
        })
    }

    /// What validation found doubtful but not wrong, e.g. a cycle only timers drive. Shown
    /// when a definition is checked or registered; it loads and runs regardless.
    pub fn warnings(&self) -> &[DefinitionProblem] {
        &self.inner.warnings
    }

    /// The ceiling on a run's events ([`crate::runaway`]).
    pub fn max_events(&self) -> u64 {
        self.inner
            .spec
            .max_events
            .unwrap_or(limits::RUN_EVENTS_DEFAULT)
    }

    /// The compiled join guard of fan-out state `state`, when its policy is `guard`.
    pub fn join_guard(&self, state: &str) -> Option<&crate::guard::Expr> {
        self.inner.join_guards.get(state).map(|e| e.as_ref())
    }

    /// Whether the enqueuer of a run of this definition may not grant its approvals.
    pub fn approver_may_not_be_enqueuer(&self) -> bool {
        self.inner.spec.policy.approver_may_not_be_enqueuer
    }

    pub fn budget(&self) -> Option<&BudgetSpec> {
        self.inner.spec.budget.as_ref()
    }

    /// The fleet-wide limits this definition declares, by key.
    pub fn limits(&self) -> &BTreeMap<String, LimitSpec> {
        &self.inner.spec.limits
    }

    /// The limit keys an action in `state` takes: `action:NAME`, `tool:TOOL` when a model's
    /// decision calls a tool, and the keys the state declares.
    pub fn limit_keys(&self, state: &str, tool: Option<&str>) -> Vec<String> {
        let Some(spec) = self.state(state) else {
            return Vec::new();
        };
        let mut keys: Vec<String> = Vec::new();
        if let Some(action) = &spec.action {
            keys.push(format!("action:{action}"));
        }
        if let Some(tool) = tool {
            keys.push(format!("tool:{tool}"));
        }
        for key in &spec.limits {
            if !keys.contains(key) {
                keys.push(key.clone());
            }
        }
        keys
    }

    /// The declared budget limits as guards see them (`budget.tokens`, ...); `{}` without a
    /// budget.
    pub fn budget_view(&self) -> serde_json::Value {
        let Some(b) = self.budget() else {
            return serde_json::json!({});
        };
        let mut view = serde_json::Map::new();
        if let Some(t) = b.tokens {
            view.insert("tokens".into(), t.into());
        }
        if let Some(c) = b.cost {
            view.insert("cost".into(), c.into());
        }
        if let Some(w) = b.wall_time_ms {
            view.insert("wall_time_ms".into(), w.into());
        }
        if let Some(s) = b.steps {
            view.insert("steps".into(), s.into());
        }
        serde_json::Value::Object(view)
    }

    pub fn name(&self) -> &str {
        &self.inner.spec.name
    }

    /// The compiled approval rule of `tool` in `state`, when it is a guard expression.
    pub fn tool_approval_rule(&self, state: &str, tool: &str) -> Option<&crate::guard::Expr> {
        self.inner
            .approval_rules
            .get(&(state.to_owned(), tool.to_owned()))
            .map(|e| e.as_ref())
    }

    /// The compiled argument schema of `tool` in `state`, if it declares one.
    pub fn tool_schema(&self, state: &str, tool: &str) -> Option<&jsonschema::Validator> {
        self.inner
            .schemas
            .get(&(state.to_owned(), tool.to_owned()))
            .map(|v| v.as_ref())
    }
    pub fn version(&self) -> u32 {
        self.inner.spec.version
    }
    pub fn spec(&self) -> &DefinitionSpec {
        &self.inner.spec
    }
    /// sha256 of the normalised definition; two documents that mean the same hash the same.
    pub fn hash(&self) -> &str {
        &self.inner.hash
    }
    pub fn initial_state(&self) -> &str {
        &self.inner.initial
    }
    pub fn cancel_state(&self) -> &str {
        &self.inner.cancel_state
    }
    pub fn state(&self, name: &str) -> Option<&StateSpec> {
        self.inner.states.get(name)
    }
    pub fn states(&self) -> impl Iterator<Item = &StateSpec> {
        self.inner.spec.states.iter()
    }
    pub fn is_terminal(&self, state: &str) -> bool {
        self.state(state)
            .is_some_and(|s| s.kind == StateKind::Terminal)
    }
    pub fn has_event(&self, event: &str) -> bool {
        self.inner.events.contains(event)
    }
    pub fn events(&self) -> impl Iterator<Item = &String> {
        self.inner.events.iter()
    }
    pub fn is_call_result(&self, event: &str) -> bool {
        self.inner.call_results.contains(event)
    }
    /// Whether a caller outside the engine may send `event` (SPEC Z3): CANCEL or one of the
    /// definition's external events.
    pub fn accepts_from_outside(&self, event: &str) -> bool {
        event == EngineEvent::Cancel.as_str() || self.inner.senders.external.contains(event)
    }
    /// The events outside callers may send besides CANCEL, in name order.
    pub fn external_events(&self) -> impl Iterator<Item = &String> {
        self.inner.senders.external.iter()
    }
    /// Whether `event` delivers an approval decision (an approval policy's granted or denied
    /// event): only an approver sends it.
    pub fn is_approval_event(&self, event: &str) -> bool {
        self.inner.senders.approval.contains(event)
    }

    /// Whether `event` grants an approval: an approval event that is some approval policy's
    /// granted event.
    pub fn is_approval_grant(&self, event: &str) -> bool {
        self.is_approval_event(event)
            && self
                .states()
                .filter_map(|s| s.approval.as_ref())
                .any(|a| a.granted_event() == event)
    }

    /// Transitions that may fire for `(state, event)`, highest priority first.
    pub fn candidates(&self, state: &str, event: &str) -> &[Transition] {
        self.inner
            .table
            .get(&(state.to_owned(), event.to_owned()))
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }
    /// All transitions in declaration order.
    pub fn transitions(&self) -> Vec<&Transition> {
        let mut all: Vec<&Transition> = self.inner.table.values().flatten().collect();
        all.sort_by_key(|t| t.index);
        all
    }
    /// Rank of an event among competing candidates: lower is stronger. Events the
    /// definition does not rank come after every ranked one.
    pub fn event_rank(&self, event: &str) -> usize {
        self.inner
            .priority
            .get(event)
            .copied()
            .unwrap_or(usize::MAX)
    }
    /// The tool `name` that `state` offers, if it does.
    pub fn tool(&self, state: &str, name: &str) -> Option<&ToolSpec> {
        self.state(state)?.tools.iter().find(|t| t.name == name)
    }
    /// The retry policy in force in `state`: its own, else the definition's default.
    pub fn retry_policy(&self, state: &str) -> &RetryPolicy {
        self.state(state)
            .and_then(|s| s.retry.as_ref())
            .unwrap_or(&self.inner.spec.retry)
    }
    pub fn constants(&self) -> &BTreeMap<String, serde_json::Value> {
        &self.inner.spec.constants
    }
    /// Can any state reachable from `state` (including itself) accept `event`? Used to refuse
    /// at once an event that could never be applied (SPEC X3a).
    pub fn could_ever_accept(&self, state: &str, event: &str) -> bool {
        if EngineEvent::is_reserved(event) {
            return !self.is_terminal(state);
        }
        let mut seen = BTreeSet::from([state.to_owned()]);
        let mut queue = VecDeque::from([state.to_owned()]);
        while let Some(s) = queue.pop_front() {
            if self
                .inner
                .table
                .contains_key(&(s.clone(), event.to_owned()))
            {
                return true;
            }
            for t in self.inner.table.values().flatten().filter(|t| t.from == s) {
                if seen.insert(t.to.clone()) {
                    queue.push_back(t.to.clone());
                }
            }
        }
        false
    }

    /// A `stateDiagram-v2` with every transition (guards shown as `[guard]`).
    pub fn to_mermaid(&self) -> String {
        let mut out = String::from("stateDiagram-v2\n");
        out.push_str(&format!("    [*] --> {}\n", self.initial_state()));
        for t in self.transitions() {
            let guards: Vec<String> = t.guards.iter().map(|g| g.label()).collect();
            if guards.is_empty() {
                out.push_str(&format!("    {} --> {}: {}\n", t.from, t.to, t.event));
            } else {
                out.push_str(&format!(
                    "    {} --> {}: {} [{}]\n",
                    t.from,
                    t.to,
                    t.event,
                    guards.join(" && ")
                ));
            }
        }
        for s in self.states().filter(|s| s.kind == StateKind::Terminal) {
            out.push_str(&format!("    {} --> [*]\n", s.name));
        }
        out
    }
}

fn check_fan_out(
    p: &mut impl FnMut(String, String),
    item: &str,
    state: &StateSpec,
    fan_out: &FanOutSpec,
    leaves: &impl Fn(&str, &str) -> bool,
    join_guards: &mut HashMap<String, Arc<crate::guard::Expr>>,
) {
    if state.kind != StateKind::Waiting {
        p(
            item.to_owned(),
            "a fan-out state waits for its branches: make it a `waiting` state".into(),
        );
    }
    if state.initial {
        p(
            item.to_owned(),
            "the initial state cannot fan out: branches start when a run enters the state".into(),
        );
    }
    let n = fan_out.branches.len();
    if n == 0 || n > limits::BRANCHES_MAX {
        p(
            format!("{item}.branches"),
            format!("{n} branches; a fan-out has 1 to {}", limits::BRANCHES_MAX),
        );
    }
    let mut names = BTreeSet::new();
    for (b, branch) in fan_out.branches.iter().enumerate() {
        let branch_item = format!("{item}.branches[{b}] ({})", branch.name);
        check_name(p, &branch_item, &branch.name);
        if !names.insert(branch.name.as_str()) {
            p(
                branch_item.clone(),
                format!("duplicate branch `{}`", branch.name),
            );
        }
        check_name(p, &format!("{branch_item}.definition"), &branch.definition);
        if branch.version == Some(0) {
            p(
                format!("{branch_item}.version"),
                "must be 1 or greater".into(),
            );
        }
        if branch.input.as_ref().is_some_and(|v| !v.is_object()) {
            p(
                format!("{branch_item}.input"),
                "a branch input is an object".into(),
            );
        }
        if branch.succeed_on.is_empty() {
            p(
                format!("{branch_item}.succeed_on"),
                "name the child's terminal states that count as success".into(),
            );
        }
        for (s, name) in branch.succeed_on.iter().enumerate() {
            check_name(p, &format!("{branch_item}.succeed_on[{s}]"), name);
        }
    }
    let join = &fan_out.join;
    match join.policy {
        JoinPolicy::All => {}
        JoinPolicy::AtLeast => match join.k {
            None => p(
                format!("{item}.join.k"),
                "policy `at_least` needs `k`".into(),
            ),
            Some(k) if k == 0 || k as usize > n => p(
                format!("{item}.join.k"),
                format!("k = {k} but the state has {n} branches: k must be 1 to {n}"),
            ),
            Some(_) => {}
        },
        JoinPolicy::Guard => match &join.guard {
            None => p(
                format!("{item}.join.guard"),
                "policy `guard` needs `guard`".into(),
            ),
            Some(expr) => match crate::guard::compile_expr(expr) {
                Ok(e) => {
                    join_guards.insert(state.name.clone(), Arc::new(e));
                }
                Err(reason) => p(format!("{item}.join.guard"), reason),
            },
        },
    }
    if join.k.is_some() && join.policy != JoinPolicy::AtLeast {
        p(
            format!("{item}.join.k"),
            "`k` goes with policy `at_least`".into(),
        );
    }
    if join.guard.is_some() && join.policy != JoinPolicy::Guard {
        p(
            format!("{item}.join.guard"),
            "`guard` goes with policy `guard`".into(),
        );
    }
    for (what, event) in [
        ("joined_event", &fan_out.joined_event),
        ("failed_event", &fan_out.failed_event),
    ] {
        if !leaves(&state.name, event) {
            p(
                format!("{item}.{what}"),
                format!("event `{event}` does not leave state `{}`", state.name),
            );
        }
    }
}

fn check_budget(
    p: &mut impl FnMut(String, String),
    budget: &BudgetSpec,
    events: &BTreeSet<String>,
    table: &HashMap<(String, String), Vec<Transition>>,
) {
    if budget.tokens.is_none()
        && budget.cost.is_none()
        && budget.wall_time_ms.is_none()
        && budget.steps.is_none()
    {
        p(
            "budget".into(),
            "declare at least one of tokens, cost, wall_time_ms, steps".into(),
        );
    }
    for (what, value) in [
        ("tokens", budget.tokens),
        ("wall_time_ms", budget.wall_time_ms),
        ("steps", budget.steps),
    ] {
        if value == Some(0) {
            p(format!("budget.{what}"), "must be greater than 0".into());
        }
    }
    if budget.cost.is_some_and(|c| !c.is_finite() || c <= 0.0) {
        p(
            "budget.cost".into(),
            "must be a finite number greater than 0".into(),
        );
    }
    if !events.contains(&budget.event) {
        p(
            format!("budget.event ({})", budget.event),
            format!("unknown event `{}`: declare it in `events`", budget.event),
        );
    } else if !table.keys().any(|(_, e)| e == &budget.event) {
        p(
            format!("budget.event ({})", budget.event),
            format!(
                "no transition takes `{}`: a run could never stop on its budget",
                budget.event
            ),
        );
    }
}

fn check_name(p: &mut impl FnMut(String, String), item: &str, name: &str) {
    if let Some(reason) = name_problem(name) {
        p(item.to_owned(), reason);
    }
}

/// The name rule of [`name_problem`] as a regular expression, for documents that describe
/// it (the API's OpenAPI schema): 1..=[`limits::NAME_LEN_MAX`] of these characters.
pub const NAME_PATTERN: &str = "^[A-Za-z0-9_.-]+$";

/// Why `name` is not usable as the name of a definition, state, event, node action, tool or
/// guard: it must be 1..=[`limits::NAME_LEN_MAX`] bytes of letters, digits, `_`, `-` and `.`
/// ([`NAME_PATTERN`]).
pub fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        Some("name is empty".into())
    } else if name.len() > limits::NAME_LEN_MAX {
        Some(format!(
            "name is {} bytes; the limit is {}",
            name.len(),
            limits::NAME_LEN_MAX
        ))
    } else if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        Some(format!(
            "name `{name}` may use only letters, digits, `_`, `-` and `.`"
        ))
    } else {
        None
    }
}
