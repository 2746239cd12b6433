//! What runs' model calls used, by model (`rein_run_usage`, kept by the insert of each
//! MODEL_REPLIED event): what run views show for every run, budget or not.

use std::collections::HashMap;

use rein_core::model_usage::ModelUsage;
use uuid::Uuid;

use crate::{Store, StoreError};

type UsageRow = (
    Uuid,
    String,
    i64,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    Option<f64>,
);

impl Store {
    /// Each of `runs`' sums by model, in model order; a run with no model call is absent.
    /// One read for a whole page of runs.
    pub async fn runs_usage(
        &self,
        runs: &[Uuid],
    ) -> Result<HashMap<Uuid, Vec<ModelUsage>>, StoreError> {
        let rows: Vec<UsageRow> = sqlx::query_as(
            "SELECT run_id, model, calls, input_tokens, output_tokens, reasoning_tokens,
                    cached_tokens, cost
             FROM rein_run_usage WHERE run_id = ANY($1) ORDER BY run_id, model",
        )
        .bind(runs)
        .fetch_all(self.pool())
        .await?;
        let mut out: HashMap<Uuid, Vec<ModelUsage>> = HashMap::new();
        let count = |n: i64| n.max(0) as u64;
        for (run_id, model, calls, input, output, reasoning, cached, cost) in rows {
            out.entry(run_id).or_default().push(ModelUsage {
                model,
                calls: count(calls),
                input_tokens: count(input),
                output_tokens: count(output),
                reasoning_tokens: reasoning.map(count),
                cached_tokens: cached.map(count),
                cost,
            });
        }
        Ok(out)
    }

    /// One run's sums by model ([`Store::runs_usage`]).
    pub async fn run_usage(&self, run_id: Uuid) -> Result<Vec<ModelUsage>, StoreError> {
        Ok(self
            .runs_usage(&[run_id])
            .await?
            .remove(&run_id)
            .unwrap_or_default())
    }
}
