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

/// A compiled CEL program; checked for size and nesting before it reaches the parser.
pub struct Expr {
    source: String,
    program: cel::Program,
}

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
    Ok(Expr {
        source: source.to_owned(),
        program,
    })
}

impl Expr {
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluates to a boolean; anything else (an error, a non-boolean) is reported.
    pub fn eval(&self, input: &GuardInput<'_>) -> Result<bool, String> {
        let mut ctx = cel::Context::default();
        ctx.add_variable_from_value("run", to_cel(&input.run));
        ctx.add_variable_from_value("event", to_cel(&input.event));
        ctx.add_variable_from_value("payload", to_cel(input.payload));
        ctx.add_variable_from_value(
            "args",
            to_cel(input.payload.get("args").unwrap_or(&serde_json::json!({}))),
        );
        ctx.add_variable_from_value("retry", to_cel(&input.retry));
        ctx.add_variable_from_value("def", to_cel(&input.constants));
        ctx.add_variable_from_value("budget", to_cel(&input.budget));
        match self.program.execute(&ctx) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(format!("evaluated to {other:?}, not a boolean")),
            Err(e) => Err(format!("evaluation failed: {e}")),
        }
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
    pub fn eval(&self, input: &GuardInput<'_>) -> Result<bool, String> {
        match &self.body {
            GuardBody::Expr(expr) => expr.eval(input),
            GuardBody::Function(f) => Ok(f(input)),
        }
    }

    pub fn label(&self) -> String {
        self.name.replace('"', "'")
    }
}
