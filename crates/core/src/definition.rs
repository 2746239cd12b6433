//! The validated [`Definition`] every other module works with (SPEC M1), and the compiled
//! [`Transition`]s it holds.
//!
//! A definition is written as TOML (primary) or JSON, or built in Rust as a
//! [`DefinitionSpec`] (the data format, re-exported here). [`Definition::from_spec`] is the
//! only way to get a `Definition`, so holding one proves it passed every check (those are in
//! `compile`).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use crate::event::EngineEvent;
use crate::guard::CompiledGuard;
use crate::limits;
use crate::retry_policy::RetryPolicy;
pub use crate::spec::{
    ApprovalPolicy, BackoffSpec, BranchSpec, BudgetSpec, DefinitionError, DefinitionProblem,
    DefinitionSpec, Effect, FanOutSpec, Format, HttpSpec, JoinPolicy, JoinSpec, LimitSpec,
    ModelPrice, ModelSpec, NAME_PATTERN, PolicySpec, StateKind, StateSpec, TerminalOutcome,
    TimeoutSpec, ToolChoice, ToolSpec, TransitionSpec, limit_key_problem, name_problem,
};

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
    pub(crate) inner: Arc<Inner>,
}

/// What a validated definition holds; only `compile` builds one.
pub(crate) struct Inner {
    pub(crate) spec: DefinitionSpec,
    pub(crate) states: HashMap<String, StateSpec>,
    pub(crate) events: BTreeSet<String>,
    pub(crate) call_results: BTreeSet<String>,
    /// Candidates for each (state, event), highest priority first.
    pub(crate) table: HashMap<(String, String), Vec<Transition>>,
    pub(crate) priority: HashMap<String, usize>,
    pub(crate) initial: String,
    pub(crate) cancel_state: String,
    pub(crate) hash: String,
    /// Compiled argument schemas by (state, tool), built once.
    pub(crate) schemas: HashMap<(String, String), Arc<jsonschema::Validator>>,
    /// Compiled approval rules (guard expressions) by (state, tool), built once.
    pub(crate) approval_rules: HashMap<(String, String), Arc<crate::guard::Expr>>,
    /// Compiled join guards by fan-out state.
    pub(crate) join_guards: HashMap<String, Arc<crate::guard::Expr>>,
    /// What outside callers and approvers may send.
    pub(crate) senders: Senders,
    /// What validation found doubtful but not wrong (the definition loads and runs).
    pub(crate) warnings: Vec<DefinitionProblem>,
}

impl fmt::Debug for Definition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Definition({}@v{})", self.name(), self.version())
    }
}

/// Who may send what, for one validated definition.
#[derive(Debug, Clone, Default)]
pub(crate) struct Senders {
    /// Events accepted from outside callers (besides CANCEL).
    pub external: BTreeSet<String>,
    /// The events that deliver an approval decision: each approval policy's granted and
    /// denied event. Only an approver sends them.
    pub approval: BTreeSet<String>,
}

impl Definition {
    /// What validation found doubtful but not wrong, e.g. a cycle only timers drive. Shown
    /// when a definition is checked or registered; it loads and runs regardless.
    pub fn warnings(&self) -> &[DefinitionProblem] {
        &self.inner.warnings
    }

    /// The ceiling on a run's events (see the `runaway` module).
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
        // A model node's call also takes `model:NAME`, so one `--limit model:NAME=...` holds
        // every definition that calls that model (a name no key can spell takes none).
        if tool.is_none()
            && let Some(model) = &spec.model
        {
            let key = format!("model:{}", model.model);
            if crate::spec::limit_key_problem(&key).is_none() {
                keys.push(key);
            }
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
    /// Whether a model state asks for a `tool_choice` other than the default `required`:
    /// such a definition's runs need a worker that sends it (engine protocol 3).
    pub fn sets_tool_choice(&self) -> bool {
        self.inner
            .spec
            .states
            .iter()
            .filter_map(|s| s.model.as_ref())
            .any(|m| !m.tool_choice.is_required())
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
