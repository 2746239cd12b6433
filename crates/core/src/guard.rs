//! Guards (SPEC M5): executable predicates over structured run state and event payload.
//!
//! A guard is either a CEL expression written in the definition or a named Rust function
//! registered in a [`GuardRegistry`]. CEL (Common Expression Language) is a small,
//! side-effect-free, terminating language made for exactly this; we evaluate it with the
//! `cel` crate behind this module so the rest of the engine never sees that crate's types.
//!
//! Variables visible to an expression:
//! - `run`: `state`, `attempt`, `sequence`, `steps_completed`, `results` (list),
//!   `pending_call` (string or null), `data` (the run's business data);
//! - `event`: `type` and `payload`; `payload` is also bound on its own, and `args` is
//!   `payload.args` (or `{}`) for safety guards over tool arguments;
//! - `retry`: the retry policy in force in the source state (`max_retries`, ...);
//! - `def`: the definition's constants;
//! - `budget`: the definition's budget limits; `run.tokens_used`, `run.cost_used` and
//!   `run.steps_used` are what the run has used.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use crate::guard_cost::{DataSize, GuardCost, STRING_BYTES_PER_UNIT};
use crate::limits;

/// Evaluation order of guards on one transition: legality first, then safety, then
/// business (SPEC M5). A transition fires only when every guard holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardKind {
    Legality,
    Safety,
    Business,
}

impl fmt::Display for GuardKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GuardKind::Legality => "legality",
            GuardKind::Safety => "safety",
            GuardKind::Business => "business",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardSpec {
    #[serde(default = "GuardSpec::default_kind")]
    pub kind: GuardKind,
    /// A label for messages; defaults to the expression or function name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A CEL expression that must evaluate to `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expr: Option<String>,
    /// The name of a Rust guard function registered with the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
}

impl GuardSpec {
    fn default_kind() -> GuardKind {
        GuardKind::Business
    }

    pub fn business(expr: &str) -> GuardSpec {
        GuardSpec {
            kind: GuardKind::Business,
            name: None,
            expr: Some(expr.to_owned()),
            function: None,
        }
    }

    pub(crate) fn compile(&self, registry: &GuardRegistry) -> Result<CompiledGuard, String> {
        let body = match (&self.expr, &self.function) {
            (Some(expr), None) => GuardBody::Expr(Arc::new(compile_expr(expr)?)),
            (None, Some(function)) => match registry.functions.get(function) {
                Some(f) => GuardBody::Function(f.clone()),
                None => {
                    return Err(format!(
                        "unknown guard function `{function}`: register it with the engine"
                    ));
                }
            },
            (Some(_), Some(_)) => {
                return Err("a guard has either `expr` or `function`, not both".into());
            }
            (None, None) => return Err("a guard needs `expr` or `function`".into()),
        };
        let name = self
            .name
            .clone()
            .or_else(|| self.expr.clone())
            .or_else(|| self.function.clone())
            .unwrap_or_default();
        Ok(CompiledGuard {
            kind: self.kind,
            name,
            body,
        })
    }
}

/// A compiled CEL program; checked for size and nesting before it reaches the parser, and
/// bounded in cost ([`GuardCost`]) once parsed.
pub struct Expr {
    source: String,
    program: cel::Program,
    cost: GuardCost,
    /// Which of [`VARIABLES`] the expression names: only those are measured and converted.
    reads: [bool; VARIABLES.len()],
}

/// The variables a guard expression may read, in the order of [`GuardScope::value`].
const VARIABLES: [&str; 7] = ["run", "event", "payload", "args", "retry", "def", "budget"];

impl fmt::Debug for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Expr({})", self.source)
    }
}

pub fn compile_expr(source: &str) -> Result<Expr, String> {
    if source.len() > limits::GUARD_EXPR_LEN_MAX {
        return Err(format!(
            "guard expression is {} bytes; the limit is {}",
            source.len(),
            limits::GUARD_EXPR_LEN_MAX
        ));
    }
    let mut depth = 0usize;
    for c in source.chars() {
        match c {
            '(' | '[' | '{' => {
                depth += 1;
                if depth > limits::GUARD_EXPR_DEPTH_MAX {
                    return Err(format!(
                        "guard expression nests deeper than {} levels",
                        limits::GUARD_EXPR_DEPTH_MAX
                    ));
                }
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    let program = cel::Program::compile(source)
        .map_err(|e| format!("guard expression `{source}` does not parse: {e}"))?;
    let references = program.references();
    let named = references.variables();
    let reads = VARIABLES.map(|v| named.iter().any(|n| n.trim_start_matches('.') == v));
    Ok(Expr {
        source: source.to_owned(),
        cost: GuardCost::of(program.expression()),
        reads,
        program,
    })
}

impl Expr {
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the expression reads the event (`event`, `payload` or `args`): its value
    /// depends on what arrives, not only on the run.
    pub fn reads_event(&self) -> bool {
        self.reads[1] || self.reads[2] || self.reads[3]
    }

    /// The bound of this expression's work as a function of the data it reads.
    pub fn cost(&self) -> &GuardCost {
        &self.cost
    }

    /// The registration rule: the bound over data of `reference` size (at least
    /// [`DataSize::reference`]) is within [`limits::GUARD_STEPS_MAX`]. Returns the bound; the
    /// error names it, says why it is high and what to change.
    pub fn check_cost(&self, reference: DataSize) -> Result<u64, String> {
        let reference = reference.max(DataSize::reference());
        let steps = self.cost.steps(reference);
        if steps <= limits::GUARD_STEPS_MAX {
            return Ok(steps);
        }
        let why = if self.cost.superlinear() {
            "its work grows faster than the data it reads (a comprehension over run data nested \
             in another one)"
        } else {
            "it iterates too long over its lists"
        };
        Err(format!(
            "guard expression may take up to {} evaluation steps over data with lists of {} \
             entries; the limit is {}: {why}; iterate over fewer or shorter lists, or compute \
             the result in a node action",
            steps_text(steps),
            reference.longest,
            limits::GUARD_STEPS_MAX,
        ))
    }

    /// Evaluates to a boolean; anything else (an error, a non-boolean) is reported. An
    /// expression whose bound over this data exceeds [`limits::GUARD_STEPS_MAX`] is not run:
    /// that is an error too, the same on every replay.
    pub fn eval(&self, input: &GuardInput<'_>) -> Result<bool, String> {
        self.eval_in(&mut GuardScope::new(input))
    }

    /// [`Expr::eval`] as one of the guards of `scope`'s decision, which share its budget.
    pub fn eval_in(&self, scope: &mut GuardScope<'_, '_>) -> Result<bool, String> {
        let size = scope.size(&self.reads);
        let steps = self.cost.steps(size);
        let total = scope.steps_used.saturating_add(steps);
        if total > limits::GUARD_STEPS_MAX {
            let before = if scope.steps_used == 0 {
                String::new()
            } else {
                format!(
                    " after {} taken by the guards evaluated before it",
                    scope.steps_used
                )
            };
            let over = if size == DataSize::default() {
                String::new()
            } else {
                format!(
                    " over this data (lists of up to {} entries, weight {})",
                    size.longest, size.weight
                )
            };
            return Err(format!(
                "not evaluated: it may take up to {} evaluation steps{over}{before}; the limit \
                 is {}",
                steps_text(steps),
                limits::GUARD_STEPS_MAX
            ));
        }
        scope.steps_used = total;
        scope.bind(&self.reads);
        match self.program.execute(&scope.context) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(format!("evaluated to {other:?}, not a boolean")),
            Err(e) => Err(format!("evaluation failed: {e}")),
        }
    }
}

/// The guards of one decision (the candidates of one event, an approval rule, a join guard):
/// the input measured and converted for CEL once, and the evaluation steps their bounds have
/// taken from [`limits::GUARD_STEPS_MAX`].
pub struct GuardScope<'i, 'a> {
    input: &'i GuardInput<'a>,
    /// `args` when the payload has none.
    no_args: serde_json::Value,
    context: cel::Context<'static, 'static>,
    bound: [bool; VARIABLES.len()],
    sizes: [Option<DataSize>; VARIABLES.len()],
    steps_used: u64,
}

impl<'i, 'a> GuardScope<'i, 'a> {
    pub fn new(input: &'i GuardInput<'a>) -> Self {
        GuardScope {
            input,
            no_args: serde_json::json!({}),
            context: cel::Context::with_env(stdlib()),
            bound: [false; VARIABLES.len()],
            sizes: [None; VARIABLES.len()],
            steps_used: 0,
        }
    }

    pub fn input(&self) -> &GuardInput<'a> {
        self.input
    }

    /// The evaluation steps taken so far (the sum of the bounds of the guards evaluated).
    pub fn steps_used(&self) -> u64 {
        self.steps_used
    }

    /// Variable `i` of [`VARIABLES`].
    fn value(&self, i: usize) -> &serde_json::Value {
        let input = self.input;
        match i {
            0 => &input.run,
            1 => &input.event,
            2 => input.payload,
            3 => input.payload.get("args").unwrap_or(&self.no_args),
            4 => &input.retry,
            5 => &input.constants,
            _ => &input.budget,
        }
    }

    /// The size of the variables `reads` names, as the cost bound counts it.
    fn size(&mut self, reads: &[bool; VARIABLES.len()]) -> DataSize {
        let mut size = DataSize::default();
        for (i, read) in reads.iter().enumerate() {
            if *read {
                let of = match self.sizes[i] {
                    Some(s) => s,
                    None => DataSize::of(self.value(i)),
                };
                self.sizes[i] = Some(of);
                size = size.max(of);
            }
        }
        size
    }

    fn bind(&mut self, reads: &[bool; VARIABLES.len()]) {
        for (i, read) in reads.iter().enumerate() {
            if *read && !self.bound[i] {
                let value = to_cel(self.value(i));
                self.context.add_variable_from_value(VARIABLES[i], value);
                self.bound[i] = true;
            }
        }
    }
}

/// CEL's standard functions, built once: building them is most of what a decision without
/// guards would otherwise cost (every step opens a scope). The environment is immutable, so
/// sharing it keeps evaluation pure.
fn stdlib() -> Arc<cel::Env> {
    static STDLIB: std::sync::OnceLock<Arc<cel::Env>> = std::sync::OnceLock::new();
    STDLIB.get_or_init(|| Arc::new(cel::Env::stdlib())).clone()
}

fn steps_text(steps: u64) -> String {
    if steps == u64::MAX {
        "an unbounded number of".to_owned()
    } else {
        steps.to_string()
    }
}

/// JSON to CEL. Integral numbers become `int` so `run.attempt < 3` works as written.
fn to_cel(value: &serde_json::Value) -> cel::Value {
    use serde_json::Value as J;
    match value {
        J::Null => cel::Value::Null,
        J::Bool(b) => cel::Value::Bool(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => cel::Value::Int(i),
            (None, Some(u)) => cel::Value::UInt(u),
            _ => cel::Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => cel::Value::String(Arc::new(s.clone())),
        J::Array(items) => cel::Value::List(Arc::new(items.iter().map(to_cel).collect())),
        J::Object(map) => {
            let map: HashMap<String, cel::Value> =
                map.iter().map(|(k, v)| (k.clone(), to_cel(v))).collect();
            cel::Value::from(map)
        }
    }
}

/// What a guard sees. Built by the reducer from the run and the event; guards never reach
/// anything else.
pub struct GuardInput<'a> {
    pub run: serde_json::Value,
    pub event: serde_json::Value,
    pub payload: &'a serde_json::Value,
    pub retry: serde_json::Value,
    pub constants: serde_json::Value,
    /// The definition's budget limits (`{}` without a budget).
    pub budget: serde_json::Value,
}

pub type GuardFn = Arc<dyn Fn(&GuardInput<'_>) -> bool + Send + Sync>;

/// Named Rust guard functions a definition may refer to with `function = "NAME"`.
#[derive(Clone, Default)]
pub struct GuardRegistry {
    functions: HashMap<String, GuardFn>,
}

impl GuardRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn register(
        &mut self,
        name: &str,
        f: impl Fn(&GuardInput<'_>) -> bool + Send + Sync + 'static,
    ) -> &mut Self {
        self.functions.insert(name.to_owned(), Arc::new(f));
        self
    }
}

#[derive(Clone)]
pub enum GuardBody {
    Expr(Arc<Expr>),
    Function(GuardFn),
}

#[derive(Clone)]
pub struct CompiledGuard {
    pub kind: GuardKind,
    pub name: String,
    pub body: GuardBody,
}

impl CompiledGuard {
    /// Evaluates the guard as one of those of `scope`'s decision.
    pub fn eval(&self, scope: &mut GuardScope<'_, '_>) -> Result<bool, String> {
        match &self.body {
            GuardBody::Expr(expr) => expr.eval_in(scope),
            GuardBody::Function(f) => Ok(f(scope.input())),
        }
    }

    /// The compiled expression, for a CEL guard.
    pub fn expr(&self) -> Option<&Expr> {
        match &self.body {
            GuardBody::Expr(expr) => Some(expr),
            GuardBody::Function(_) => None,
        }
    }

    pub fn label(&self) -> String {
        self.name.replace('"', "'")
    }
}
