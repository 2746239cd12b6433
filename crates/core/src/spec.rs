//! The data format of a state-machine definition (SPEC M1): what a TOML or JSON document
//! declares, exactly as serde reads it, and the problems validation reports. The validated
//! form every other module works with is `definition::Definition`; the checks that
//! produce it are in `compile`.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::guard::GuardSpec;
use crate::limits;
use crate::retry_policy::RetryPolicy;

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
    /// (see the `runaway` module).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_events: Option<u64>,
    /// Who may do what with the definition's runs (`[policy]`); absent: no rule beyond the
    /// scopes of the callers' tokens.
    #[serde(default, skip_serializing_if = "PolicySpec::is_empty")]
    pub policy: PolicySpec,
    /// How runs of an older version move to this one (`[migration]`, SPEC V1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationSpec>,
}

/// Most entries in each of a migration's maps and lists.
pub const MIGRATION_ENTRIES_MAX: usize = 256;

/// How runs of version `from` move to the version that declares this (`[migration]`).
/// Applied in this order: the state map, then `rename`, `drop` and `default` on the top-level
/// keys of the run's business data.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationSpec {
    /// The older version whose runs this moves.
    pub from: u32,
    /// Old control state -> new control state. A state not named keeps its name, which must
    /// exist in the new version.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub states: BTreeMap<String, String>,
    /// Old states whose runs stay on the old version (e.g. a step whose meaning changed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_migratable: Vec<String>,
    /// Data key renames, old -> new.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rename: BTreeMap<String, String>,
    /// Data keys removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drop: Vec<String>,
    /// Values for data keys a run lacks.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub default: BTreeMap<String, serde_json::Value>,
}

impl MigrationSpec {
    /// What is wrong with this migration as part of `def` (the version declaring it), as
    /// (item, reason) pairs.
    pub fn problems(
        &self,
        def_version: u32,
        states: &std::collections::BTreeSet<&str>,
    ) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut p = |item: String, reason: String| out.push((item, reason));
        if self.from == 0 || self.from >= def_version {
            p(
                "migration.from".into(),
                format!("must name an older version (1..{def_version})"),
            );
        }
        let sizes = [
            ("states", self.states.len()),
            ("not_migratable", self.not_migratable.len()),
            ("rename", self.rename.len()),
            ("drop", self.drop.len()),
            ("default", self.default.len()),
        ];
        for (name, n) in sizes {
            if n > MIGRATION_ENTRIES_MAX {
                p(
                    format!("migration.{name}"),
                    format!("{n} entries; the limit is {MIGRATION_ENTRIES_MAX}"),
                );
            }
        }
        for (old, new) in &self.states {
            let item = format!("migration.states.{old}");
            if let Some(reason) = name_problem(old).or_else(|| name_problem(new)) {
                p(item, reason);
            } else if !states.contains(new.as_str()) {
                p(
                    item,
                    format!("maps to `{new}`, which this version does not declare"),
                );
            }
        }
        for state in &self.not_migratable {
            if let Some(reason) = name_problem(state) {
                p(format!("migration.not_migratable ({state})"), reason);
            }
            if self.states.contains_key(state) {
                p(
                    format!("migration.not_migratable ({state})"),
                    "is also in `states`: a state either moves or stays".into(),
                );
            }
        }
        let mut targets = std::collections::BTreeSet::new();
        for (old, new) in &self.rename {
            let item = format!("migration.rename.{old}");
            if let Some(reason) = key_problem(old).or_else(|| key_problem(new)) {
                p(item, reason);
            } else if !targets.insert(new.as_str()) {
                p(item, format!("a second key is renamed to `{new}`"));
            } else if self.drop.contains(new) {
                p(item, format!("renames to `{new}`, which `drop` removes"));
            }
        }
        for key in &self.drop {
            if let Some(reason) = key_problem(key) {
                p(format!("migration.drop ({key})"), reason);
            }
        }
        for key in self.default.keys() {
            if let Some(reason) = key_problem(key) {
                p(format!("migration.default.{key}"), reason);
            }
        }
        out
    }
}

fn key_problem(key: &str) -> Option<String> {
    if key.is_empty() {
        Some("a data key is empty".into())
    } else if key.len() > limits::NAME_LEN_MAX {
        Some(format!(
            "data key is {} bytes; the limit is {}",
            key.len(),
            limits::NAME_LEN_MAX
        ))
    } else {
        None
    }
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
    /// Tokens per minute (a model key's `tpm`): a `model` call books its `max_tokens` before
    /// it starts and gives back what its reply did not use. A quiet key lets a minute's
    /// tokens start at once; over any longer span the fleet books at most `tpm` a minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u32>,
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
        if self.rate.is_none() && self.concurrency.is_none() && self.tpm.is_none() {
            out.push("declare `rate`, `concurrency`, `tpm` or several".to_owned());
        }
        if self.tpm == Some(0) || self.tpm.is_some_and(|t| t > limits::LIMIT_TPM_MAX) {
            out.push(format!("`tpm` must be 1..={}", limits::LIMIT_TPM_MAX));
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

    /// Parses the command-line form `10/s`, `60/min,burst=5`, `concurrency=4`, `tpm=90000` or
    /// `10/s,burst=2,concurrency=4` (periods: ms, s, min, h, or a number of ms).
    pub fn parse(text: &str) -> Result<LimitSpec, String> {
        let mut spec = LimitSpec {
            rate: None,
            per_ms: LimitSpec::default_per_ms(),
            burst: None,
            concurrency: None,
            tpm: None,
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
            } else if let Some(v) = part.strip_prefix("tpm=") {
                spec.tpm = Some(number("tpm", v)?);
            } else {
                return Err(format!(
                    "`{part}` is not a rate (`10/s`), `burst=N`, `concurrency=N` or `tpm=N`"
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
    /// The model a `model` action asks (an OpenAI-compatible Chat Completions endpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelSpec>,
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

/// A `model` node (`[states.model]`): Rein asks an OpenAI-compatible Chat Completions
/// endpoint what to do next, offering the state's tools and decisions as function tools.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The endpoint's base, e.g. `https://api.openai.com/v1`; `{base_url}/chat/completions`
    /// is called. Absent: the worker's `REIN_MODEL_URL`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// The model name sent in the request.
    pub model: String,
    /// The environment variable of the worker holding the API key (never the key itself);
    /// it must be on the worker's `--model-key-env` allow-list, and is sent only to an
    /// endpoint it is bound to (`--model-key`, [`crate::model_keys`]). Absent: no key is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// The system prompt: a template where `{{input.x}}` / `{{data.x}}` name run data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// How long one model call may take before it counts as a transient failure.
    #[serde(default = "ModelSpec::default_timeout_ms")]
    pub timeout_ms: u64,
    /// Price per token, for the run's cost budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<ModelPrice>,
    /// Read the reply as server-sent events and publish its deltas to watchers of the run.
    #[serde(default, skip_serializing_if = "is_false")]
    pub stream: bool,
    /// Committed on a transient failure (connect error, timeout, 429, 5xx, a stream cut
    /// short) with the error and any Retry-After; absent: the run waits for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transient_event: Option<String>,
    /// Committed on a fatal failure (400, 401, 403, 404, a key the worker does not have);
    /// absent: the run waits for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fatal_event: Option<String>,
    /// What the request's `tool_choice` asks of the model: `required` (the default), `auto`
    /// (a server that refuses `required`; a reply without a tool call is a rejected decision)
    /// or `function` (name the one function the state offers). Set to anything but
    /// `required`, the definition's runs need engine protocol 3.
    #[serde(default, skip_serializing_if = "ToolChoice::is_required")]
    pub tool_choice: ToolChoice,
}

/// A model state's `tool_choice` (see [`ModelSpec::tool_choice`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolChoice {
    /// `"tool_choice": "required"`: the model must call one of the offered functions.
    #[default]
    Required,
    /// `"tool_choice": "auto"`: the model may answer without a tool call (then refused).
    Auto,
    /// `"tool_choice": {"type": "function", ...}` naming the one function offered.
    Function,
}

impl ToolChoice {
    pub fn is_required(&self) -> bool {
        *self == ToolChoice::Required
    }
}

impl ModelSpec {
    fn default_timeout_ms() -> u64 {
        60_000
    }
}

/// Price per token of a model, in the currency of the run's cost budget.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub input: f64,
    pub output: f64,
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
    /// What the tool does, in words a model reads (offered with a `model` action).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
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

/// Input formats for definition documents. Each parses into the same [`DefinitionSpec`], and
/// a definition's hash is taken over that spec's canonical JSON, so one definition written in
/// any of them has one hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Toml,
    Json,
    Yaml,
}

impl Format {
    /// Picks the format from a file name's extension: `.json` is JSON, `.yaml` and `.yml`
    /// YAML, anything else TOML.
    pub fn from_path(path: &str) -> Format {
        let path = path.to_ascii_lowercase();
        if path.ends_with(".json") {
            Format::Json
        } else if path.ends_with(".yaml") || path.ends_with(".yml") {
            Format::Yaml
        } else {
            Format::Toml
        }
    }

    /// The format's name as `?format=` and error messages spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Toml => "toml",
            Format::Json => "json",
            Format::Yaml => "yaml",
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
