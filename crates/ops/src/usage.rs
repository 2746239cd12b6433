//! What a run's model calls used: the sums every run view shows (`usage`, all models
//! together) and `GET /v1/runs/{id}/usage` answers by model.

use rein_core::model_usage::{self, ModelUsage};
use rein_store::Store;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::error::Error;

/// What model calls used, summed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct UsageSums {
    /// Replies recorded.
    pub calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Reasoning tokens; null until a server reports them (and for calls recorded before
    /// Rein read them).
    pub reasoning_tokens: Option<u64>,
    /// Input tokens served from the server's prompt cache; null until a server reports them.
    pub cached_tokens: Option<u64>,
    /// From the model's `price` in the definition; null when no call was priced.
    pub cost: Option<f64>,
}

/// The calls to one model (the one the definition asked for) and what they used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelUsageView {
    /// The model the definition named; empty for a reply that named none.
    pub model: String,
    #[serde(flatten)]
    pub sums: UsageSums,
}

/// A run's model usage, by model and in all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct UsageView {
    pub run_id: Uuid,
    /// All models together; null for a run with no model call.
    pub total: Option<UsageSums>,
    /// By model, in name order.
    pub models: Vec<ModelUsageView>,
}

fn sums(m: &ModelUsage) -> UsageSums {
    UsageSums {
        calls: m.calls,
        input_tokens: m.input_tokens,
        output_tokens: m.output_tokens,
        reasoning_tokens: m.reasoning_tokens,
        cached_tokens: m.cached_tokens,
        cost: m.cost,
    }
}

fn total(models: &[ModelUsage]) -> Option<UsageSums> {
    model_usage::total(models).as_ref().map(sums)
}

/// `run_id`'s usage by model; not found when there is no such run.
pub async fn usage(store: &Store, run_id: Uuid) -> Result<UsageView, Error> {
    store.run(run_id).await?;
    let models = store.run_usage(run_id).await?;
    Ok(UsageView {
        run_id,
        total: total(&models),
        models: models
            .iter()
            .map(|m| ModelUsageView {
                model: m.model.clone(),
                sums: sums(m),
            })
            .collect(),
    })
}

/// Sets each run document's `usage` (all models summed, or null) in one read; `ids` are the
/// documents' runs, in the same order.
pub async fn with_usage(store: &Store, runs: &mut [Value], ids: &[Uuid]) -> Result<(), Error> {
    let mut by_run = store.runs_usage(ids).await?;
    for (run, id) in runs.iter_mut().zip(ids) {
        let sums = by_run.remove(id).and_then(|models| total(&models));
        if let Some(run) = run.as_object_mut() {
            run.insert("usage".to_owned(), json!(sums));
        }
    }
    Ok(())
}
