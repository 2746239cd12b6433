//! What a run's model calls cost, by model: the sums of the `usage` its MODEL_REPLIED events
//! record. The database keeps the same sums in `rein_run_usage`, added up by the commit that
//! inserts each event (migration `run_usage`); `verify` recomputes them here from the log and
//! compares. Not part of the projection: a log recorded before these sums existed replays as
//! it always did.
//!
//! The rules are the SQL's, number for number: a token count counts when it is a whole JSON
//! number from 0 to [`COUNT_MAX`], a cost when it is a number from 0 to [`COST_MAX`]; sums
//! stop at those ceilings instead of failing a commit. Reasoning and cached tokens, and
//! cost, stay `None` until a call reports them (a run recorded before Rein read them, or a
//! model without a price): never a made-up 0.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::event::Event;
use crate::model::MODEL_REPLIED;

/// The largest token count kept (PostgreSQL's `bigint`); larger sums stay here.
pub const COUNT_MAX: u64 = i64::MAX as u64;
/// The largest cost kept; larger sums stay here.
pub const COST_MAX: f64 = 1e300;

/// The calls to one model and what they used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ModelUsage {
    /// The model the definition asked for (`requested_model`); empty when the event names
    /// none.
    pub model: String,
    /// Replies recorded.
    pub calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Reasoning tokens, where the server reported them.
    pub reasoning_tokens: Option<u64>,
    /// Input tokens served from the server's prompt cache, where it reported them.
    pub cached_tokens: Option<u64>,
    /// From the definition's `price`; `None` when no reply was priced.
    pub cost: Option<f64>,
}

impl ModelUsage {
    /// Adds one reply's `usage` (absent or malformed: a call that used nothing known).
    pub fn add(&mut self, usage: Option<&Value>) {
        let field = |k: &str| usage.and_then(|u| u.get(k));
        self.merge(&ModelUsage {
            model: String::new(),
            calls: 1,
            input_tokens: count(field("input_tokens")).unwrap_or(0),
            output_tokens: count(field("output_tokens")).unwrap_or(0),
            reasoning_tokens: count(field("reasoning_tokens")),
            cached_tokens: count(field("cached_tokens")),
            cost: cost(field("cost")),
        });
    }

    /// Adds `other`'s sums to these, each held at its ceiling; a field unknown on one side
    /// keeps the other's value.
    fn merge(&mut self, other: &ModelUsage) {
        self.calls = add_count(self.calls, other.calls);
        self.input_tokens = add_count(self.input_tokens, other.input_tokens);
        self.output_tokens = add_count(self.output_tokens, other.output_tokens);
        self.reasoning_tokens = add_known(self.reasoning_tokens, other.reasoning_tokens);
        self.cached_tokens = add_known(self.cached_tokens, other.cached_tokens);
        self.cost = match (self.cost, other.cost) {
            (Some(a), Some(b)) => Some((a + b).min(COST_MAX)),
            (a, b) => a.or(b),
        };
    }

    /// Whether `other` holds the same sums, costs equal to a billionth (the database adds
    /// binary floats parsed by another parser).
    pub fn agrees_with(&self, other: &ModelUsage) -> bool {
        let cost_agrees = match (self.cost, other.cost) {
            (Some(a), Some(b)) => (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-9),
            (a, b) => a.is_none() && b.is_none(),
        };
        cost_agrees
            && ModelUsage {
                cost: None,
                ..self.clone()
            } == ModelUsage {
                cost: None,
                ..other.clone()
            }
    }
}

fn add_count(a: u64, b: u64) -> u64 {
    a.saturating_add(b).min(COUNT_MAX)
}

fn add_known(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(add_count(a, b)),
        (a, b) => a.or(b),
    }
}

/// A token count as the database reads it: a whole number from 0 to [`COUNT_MAX`].
fn count(v: Option<&Value>) -> Option<u64> {
    let n = v?;
    n.as_u64()
        .or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= COUNT_MAX as f64)
                .map(|f| f as u64)
        })
        .filter(|c| *c <= COUNT_MAX)
}

/// A cost as the database reads it: a number from 0 to [`COST_MAX`].
fn cost(v: Option<&Value>) -> Option<f64> {
    v?.as_f64().filter(|c| (0.0..=COST_MAX).contains(c))
}

/// The model an event's calls are counted under: its `requested_model` when that is text.
pub fn model_of(payload: &Value) -> String {
    match payload.get("requested_model") {
        Some(Value::String(m)) => m.clone(),
        _ => String::new(),
    }
}

/// The sums of `events`' MODEL_REPLIED usage, by model, in model order.
pub fn of_log<'a>(events: impl IntoIterator<Item = &'a Event>) -> Vec<ModelUsage> {
    let mut by_model: BTreeMap<String, ModelUsage> = BTreeMap::new();
    for e in events.into_iter().filter(|e| e.kind == MODEL_REPLIED) {
        let model = model_of(&e.payload);
        by_model
            .entry(model.clone())
            .or_insert_with(|| ModelUsage {
                model,
                ..ModelUsage::default()
            })
            .add(e.payload.get("usage"));
    }
    by_model.into_values().collect()
}

/// All models' sums together; `None` for a run with no model call.
pub fn total(models: &[ModelUsage]) -> Option<ModelUsage> {
    let (first, rest) = models.split_first()?;
    let mut sum = ModelUsage {
        model: String::new(),
        ..first.clone()
    };
    rest.iter().for_each(|m| sum.merge(m));
    Some(sum)
}

/// Where `stored` (the database's sums) and the sums of the log differ, first difference
/// first; `None` when they agree.
pub fn disagreement(from_log: &[ModelUsage], stored: &[ModelUsage]) -> Option<String> {
    let stored: BTreeMap<&str, &ModelUsage> =
        stored.iter().map(|m| (m.model.as_str(), m)).collect();
    for m in from_log {
        match stored.get(m.model.as_str()) {
            None => {
                return Some(format!(
                    "the log has {} call(s) to model {:?} that the usage table does not count",
                    m.calls, m.model
                ));
            }
            Some(s) if !s.agrees_with(m) => {
                return Some(format!(
                    "the usage table's sums for model {:?} differ from the log's \
                     (stored {s:?}, log {m:?})",
                    m.model
                ));
            }
            Some(_) => {}
        }
    }
    let logged: Vec<&str> = from_log.iter().map(|m| m.model.as_str()).collect();
    stored
        .keys()
        .find(|k| !logged.contains(k))
        .map(|k| format!("the usage table counts calls to model {k:?} that the log does not have"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn replied(seq: u64, model: &str, usage: Value) -> Event {
        Event::new(
            seq,
            MODEL_REPLIED,
            json!({ "requested_model": model, "usage": usage }),
        )
    }

    #[test]
    fn sums_by_model_and_keeps_unknown_fields_unknown() {
        let log = [
            replied(
                1,
                "b",
                json!({"input_tokens": 10, "output_tokens": 2, "cost": 0.5}),
            ),
            Event::new(2, "OTHER", json!({"usage": {"input_tokens": 99}})),
            replied(3, "a", json!({"input_tokens": 1, "output_tokens": 1})),
            replied(
                4,
                "b",
                json!({"input_tokens": 5, "output_tokens": 3, "reasoning_tokens": 7}),
            ),
        ];
        let sums = of_log(&log);
        assert_eq!(sums.len(), 2);
        assert_eq!(sums[0].model, "a");
        assert_eq!(sums[0].cost, None, "no price: no cost, not 0");
        assert_eq!(sums[0].reasoning_tokens, None);
        let b = &sums[1];
        assert_eq!((b.calls, b.input_tokens, b.output_tokens), (2, 15, 5));
        assert_eq!(b.reasoning_tokens, Some(7));
        assert_eq!(b.cached_tokens, None);
        assert_eq!(b.cost, Some(0.5));
        let t = total(&sums).unwrap();
        assert_eq!((t.calls, t.input_tokens, t.output_tokens), (3, 16, 6));
        assert_eq!(total(&[]), None);
    }

    #[test]
    fn malformed_and_huge_numbers_neither_count_nor_overflow() {
        let log = [
            replied(
                1,
                "m",
                json!({"input_tokens": "12", "output_tokens": -3, "cost": -1.0}),
            ),
            replied(
                2,
                "m",
                json!({"input_tokens": u64::MAX, "output_tokens": 2.5}),
            ),
            replied(
                3,
                "m",
                json!({"input_tokens": COUNT_MAX, "output_tokens": 4.0}),
            ),
            replied(4, "m", json!({"input_tokens": COUNT_MAX, "cost": 1e300})),
            replied(5, "m", json!({"cost": 1e300})),
            replied(6, "m", Value::Null),
        ];
        let m = &of_log(&log)[0];
        assert_eq!(m.calls, 6);
        assert_eq!(m.input_tokens, COUNT_MAX, "sums stop at the ceiling");
        assert_eq!(m.output_tokens, 4);
        assert_eq!(m.cost, Some(COST_MAX));
    }

    #[test]
    fn a_planted_difference_is_named() {
        let log = [replied(
            1,
            "m",
            json!({"input_tokens": 3, "output_tokens": 4}),
        )];
        let sums = of_log(&log);
        assert_eq!(disagreement(&sums, &sums), None);
        let mut off = sums.clone();
        off[0].output_tokens += 1;
        assert!(disagreement(&sums, &off).unwrap().contains("differ"));
        assert!(disagreement(&sums, &[]).unwrap().contains("does not count"));
        let mut extra = sums.clone();
        extra.push(ModelUsage {
            model: "ghost".into(),
            calls: 1,
            ..ModelUsage::default()
        });
        assert!(disagreement(&sums, &extra).unwrap().contains("ghost"));
        let mut cost = sums.clone();
        cost[0].cost = Some(0.0);
        assert!(
            disagreement(&sums, &cost).is_some(),
            "a cost where none was recorded"
        );
    }
}
