//! The built-in `sim` tool's external system: applies an effect at most once per
//! idempotency key, the way a payment API does, and records every application so tests and
//! chaos runs can audit it.

use serde_json::Value;
use uuid::Uuid;

use crate::{Store, StoreError};

impl Store {
    /// Applies the effect for `idempotency_key` unless it was applied before; returns the
    /// first application's result either way, and whether this call applied it.
    pub async fn sim_apply(
        &self,
        run_id: Uuid,
        node: &str,
        step: i32,
        idempotency_key: &str,
        worker: &str,
        result: &Value,
    ) -> Result<(Value, bool), StoreError> {
        let applied: Option<Value> = sqlx::query_scalar(
            "WITH ins AS (
                 INSERT INTO rein_sim_idempotency (idempotency_key, run_id, result) VALUES ($1, $2, $3)
                 ON CONFLICT (idempotency_key) DO NOTHING RETURNING result
             ), effect AS (
                 INSERT INTO rein_sim_effects (run_id, node, step, idempotency_key, worker)
                 SELECT $2, $4, $5, $1, $6 WHERE EXISTS (SELECT 1 FROM ins)
             )
             SELECT result FROM ins",
        )
        .bind(idempotency_key)
        .bind(run_id)
        .bind(result)
        .bind(node)
        .bind(step)
        .bind(worker)
        .fetch_optional(self.pool())
        .await?;
        if let Some(result) = applied {
            return Ok((result, true));
        }
        let first = self.sim_lookup(idempotency_key).await?.ok_or_else(|| {
            StoreError::Corrupt(format!(
                "sim key {idempotency_key} neither inserted nor found"
            ))
        })?;
        Ok((first, false))
    }

    /// The reconcile query: was the effect for this key applied, and with what result?
    pub async fn sim_lookup(&self, idempotency_key: &str) -> Result<Option<Value>, StoreError> {
        Ok(
            sqlx::query_scalar(
                "SELECT result FROM rein_sim_idempotency WHERE idempotency_key = $1",
            )
            .bind(idempotency_key)
            .fetch_optional(self.pool())
            .await?,
        )
    }
}
