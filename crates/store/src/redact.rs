//! Redacting a run (`rein runs redact`): named data keys replaced by their markers in the
//! run's input, every event that carries them, its projection and its checkpoints, in one
//! transaction, and only if the redacted log still replays to the redacted projection.

use rein_core::redact::{redact_object, redact_payload, refusal};
use rein_core::{Event, RunState};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::{Store, StoreError};

/// Longest reason recorded with a redaction.
pub const REDACT_REASON_BYTES_MAX: usize = 1_024;

/// What a redaction changed.
#[derive(Debug, Clone, Serialize)]
pub struct Redacted {
    pub run_id: Uuid,
    pub fields: Vec<String>,
    /// Events whose payload changed.
    pub events: usize,
    /// (field, sha256) of every value replaced, in the input, events and projection.
    pub hashes: Vec<(String, String)>,
}

impl Store {
    /// Redacts `fields` of run `run_id` as `by`, for `reason`. Refused while a worker holds
    /// the run, when the definition reads a field, or when the redacted log would not replay
    /// to the redacted projection (nothing is written then).
    pub async fn redact_run(
        &self,
        run_id: Uuid,
        fields: &[String],
        by: &str,
        reason: &str,
    ) -> Result<Redacted, StoreError> {
        if reason.trim().is_empty() || reason.len() > REDACT_REASON_BYTES_MAX {
            return Err(StoreError::Invalid(format!(
                "say why in 1..={REDACT_REASON_BYTES_MAX} bytes (--reason)"
            )));
        }
        crate::input::check_text("by", by)?;
        let row = self.run(run_id).await?;
        let events: Vec<Event> = self
            .history(run_id)
            .await?
            .iter()
            .map(crate::reads::StoredEvent::as_event)
            .collect();
        let defs = self
            .log_definitions(&row.definition, row.version, &events)
            .await?;
        for def in defs.values() {
            if let Some(why) = refusal(def, fields) {
                return Err(StoreError::Invalid(why));
            }
        }
        let mut tx = self.pool().begin().await?;
        let (projection, lease_live, input): (Value, bool, Value) = sqlx::query_as(
            "SELECT projection, COALESCE(lease_until > clock_timestamp(), false), input
             FROM rein_runs WHERE run_id = $1 FOR UPDATE",
        )
        .bind(run_id)
        .fetch_one(&mut *tx)
        .await?;
        if lease_live {
            return Err(StoreError::Invalid(format!(
                "a worker holds run {run_id} now; redact it once the lease is released"
            )));
        }
        let mut hashes = Vec::new();
        let mut input = input;
        hashes.extend(redact_object(&mut input, fields));
        let mut changed: Vec<&Event> = Vec::new();
        let mut redacted_events = events.clone();
        for e in &mut redacted_events {
            let done = redact_payload(&mut e.payload, fields);
            if !done.is_empty() {
                hashes.extend(done);
            }
        }
        for (before, after) in events.iter().zip(&redacted_events) {
            if before.payload != after.payload {
                changed.push(after);
            }
        }
        let mut state: RunState = serde_json::from_value(projection)
            .map_err(|e| StoreError::Corrupt(format!("projection: {e}")))?;
        hashes.extend(redact_object(&mut state.data, fields));
        // The promise of a redaction: the reducer sees the markers and still reaches the
        // (redacted) projection, so `rein runs verify` keeps holding.
        let first = rein_core::migration::first_version(row.version, redacted_events.iter());
        let first_def = defs
            .get(&first)
            .ok_or_else(|| StoreError::Corrupt(format!("version {first} not loaded")))?;
        let def_of = |v: u32| defs.get(&v);
        let replayed = rein_core::checkpoint::replay_judging_across(
            &def_of,
            RunState::initial(first_def, input.clone()),
            redacted_events.iter(),
            &[],
        )
        .map_err(|(i, e)| {
            StoreError::Invalid(format!(
                "the redacted log does not replay (event {}: {e}); nothing was redacted",
                i + 1
            ))
        })?
        .0;
        if replayed != state {
            return Err(StoreError::Invalid(
                "the redacted log would not replay to the redacted projection; nothing was redacted"
                    .into(),
            ));
        }
        sqlx::query("SET LOCAL rein.redacting = 'on'")
            .execute(&mut *tx)
            .await?;
        for e in &changed {
            let hot = sqlx::query(
                "UPDATE rein_events SET payload = $3 WHERE run_id = $1 AND sequence = $2",
            )
            .bind(run_id)
            .bind(e.sequence as i64)
            .bind(&e.payload)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if hot == 0 {
                sqlx::query(
                    "UPDATE rein_events_archive SET payload = $3 WHERE run_id = $1 AND sequence = $2",
                )
                .bind(run_id)
                .bind(e.sequence as i64)
                .bind(&e.payload)
                .execute(&mut *tx)
                .await?;
            }
        }
        let projection = serde_json::to_value(&state)
            .map_err(|e| StoreError::Corrupt(format!("projection: {e}")))?;
        sqlx::query("UPDATE rein_runs SET input = $2, projection = $3 WHERE run_id = $1")
            .bind(run_id)
            .bind(&input)
            .bind(&projection)
            .execute(&mut *tx)
            .await?;
        // A checkpoint is a copy of a state: its data is redacted the same way.
        let checkpoints: Vec<(i64, Value)> =
            sqlx::query_as("SELECT sequence, state FROM rein_checkpoints WHERE run_id = $1")
                .bind(run_id)
                .fetch_all(&mut *tx)
                .await?;
        for (sequence, mut state) in checkpoints {
            if let Some(data) = state.get_mut("data")
                && !redact_object(data, fields).is_empty()
            {
                sqlx::query(
                    "UPDATE rein_checkpoints SET state = $3 WHERE run_id = $1 AND sequence = $2",
                )
                .bind(run_id)
                .bind(sequence)
                .bind(&state)
                .execute(&mut *tx)
                .await?;
            }
        }
        hashes.sort();
        hashes.dedup();
        sqlx::query(
            "INSERT INTO rein_redactions (run_id, fields, hashes, redacted_by, reason)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(run_id)
        .bind(fields)
        .bind(json!(hashes))
        .bind(by)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Redacted {
            run_id,
            fields: fields.to_vec(),
            events: changed.len(),
            hashes,
        })
    }
}
