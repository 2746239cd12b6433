//! Redacting a run (`rein runs redact`): named data keys replaced by their markers in the
//! run's input, every event that carries them, its projection and its checkpoints, in one
//! transaction, and only if the redacted log still replays to the redacted projection.
//! Markers are keyed ([`rein_core::redact::RedactionKey`]); those a redaction wrote before
//! they were (`rein_redactions.keyed` false) are listed by [`Store::unkeyed_redactions`] and
//! replaced by keyed ones the next time the run's key is redacted.

use rein_core::redact::{Redaction, RedactionKey, fields_problem, refusal};
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
    /// Whether the run had finished: only then are its blobs forgotten.
    pub finished: bool,
    /// Blobs deleted because only finished, redacted runs referred to them. Their
    /// references stay in the log; reading one says it was forgotten.
    pub blobs_deleted: Vec<String>,
}

/// A key of a run whose stored markers are unkeyed ([`Store::unkeyed_redactions`]).
#[derive(Debug, Clone, Serialize)]
pub struct UnkeyedRedaction {
    pub run_id: Uuid,
    pub field: String,
    /// When the last unkeyed redaction of the key was recorded.
    pub redacted_at: chrono::DateTime<chrono::Utc>,
}

fn moved(run_id: Uuid) -> StoreError {
    StoreError::Conflict(format!(
        "run {run_id} gained events while it was being redacted; nothing was redacted: try again"
    ))
}

impl Store {
    /// The keys of run `run_id` (every run's when `None`) whose stored markers a redaction
    /// wrote before markers were keyed and no keyed redaction of the key has replaced since:
    /// a reader of the log can reverse such a marker of a guessable value. (run, key, when
    /// it was redacted), oldest first.
    pub async fn unkeyed_redactions(
        &self,
        run_id: Option<Uuid>,
    ) -> Result<Vec<UnkeyedRedaction>, StoreError> {
        let rows: Vec<(Uuid, String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
            "SELECT r.run_id, f.field, max(r.redacted_at)
             FROM rein_redactions r CROSS JOIN LATERAL unnest(r.fields) AS f(field)
             WHERE NOT r.keyed AND ($1::uuid IS NULL OR r.run_id = $1)
               AND NOT EXISTS (
                   SELECT 1 FROM rein_redactions k
                   WHERE k.run_id = r.run_id AND k.keyed AND k.redacted_at > r.redacted_at
                     AND f.field = ANY (k.fields))
             GROUP BY r.run_id, f.field
             ORDER BY max(r.redacted_at), r.run_id, f.field",
        )
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(run_id, field, redacted_at)| UnkeyedRedaction {
                run_id,
                field,
                redacted_at,
            })
            .collect())
    }

    /// Redacts `fields` of run `run_id` as `by`, for `reason`, with markers keyed by `key`;
    /// markers of these keys an unkeyed redaction left are replaced by keyed ones. Refused while a worker holds
    /// the run, when the definition reads a field, or when the redacted log would not replay
    /// to the redacted projection (nothing is written then). Of a finished run, the blobs
    /// that only finished, redacted runs refer to are deleted. Needs no privilege on the log:
    /// the writes go through `rein_apply_redaction`, which accepts only markers in place of
    /// the named keys, so `rein api`'s database role can redact too.
    pub async fn redact_run(
        &self,
        run_id: Uuid,
        fields: &[String],
        key: &RedactionKey,
        by: &str,
        reason: &str,
    ) -> Result<Redacted, StoreError> {
        redact_request_checked(fields, by, reason)?;
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
                return Err(StoreError::Conflict(why));
            }
        }
        let (projection, lease_live, input, last_sequence, terminal): (
            Value,
            bool,
            Value,
            i64,
            bool,
        ) = sqlx::query_as(
            "SELECT projection, COALESCE(lease_until > clock_timestamp(), false), input,
                        last_sequence, status = 'terminal'
                 FROM rein_runs WHERE run_id = $1",
        )
        .bind(run_id)
        .fetch_one(self.pool())
        .await?;
        if lease_live {
            return Err(StoreError::Conflict(format!(
                "a worker holds run {run_id} now; redact it once the lease is released"
            )));
        }
        if events.last().map_or(0, |e| e.sequence as i64) != last_sequence {
            return Err(moved(run_id));
        }
        let rekey: Vec<String> = self
            .unkeyed_redactions(Some(run_id))
            .await?
            .into_iter()
            .map(|u| u.field)
            .filter(|f| fields.contains(f))
            .collect();
        let redaction = Redaction {
            key,
            fields,
            rekey: &rekey,
        };
        let mut hashes = Vec::new();
        let mut input = input;
        hashes.extend(redaction.object(&mut input));
        let mut redacted_events = events.clone();
        for e in &mut redacted_events {
            hashes.extend(redaction.payload(&mut e.payload));
        }
        let changed: Vec<Value> = events
            .iter()
            .zip(&redacted_events)
            .filter(|(before, after)| before.payload != after.payload)
            .map(|(_, after)| json!({ "sequence": after.sequence, "payload": after.payload }))
            .collect();
        let events_changed = changed.len();
        let mut state: RunState = serde_json::from_value(projection)
            .map_err(|e| StoreError::Corrupt(format!("projection: {e}")))?;
        hashes.extend(redaction.object(&mut state.data));
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
            StoreError::Conflict(format!(
                "the redacted log does not replay (event {}: {e}); nothing was redacted",
                i + 1
            ))
        })?
        .0;
        if replayed != state {
            return Err(StoreError::Conflict(
                "the redacted log would not replay to the redacted projection; nothing was redacted"
                    .into(),
            ));
        }
        let projection = serde_json::to_value(&state)
            .map_err(|e| StoreError::Corrupt(format!("projection: {e}")))?;
        // A checkpoint is a copy of a state: its data is redacted the same way.
        let stored: Vec<(i64, Value)> =
            sqlx::query_as("SELECT sequence, state FROM rein_checkpoints WHERE run_id = $1")
                .bind(run_id)
                .fetch_all(self.pool())
                .await?;
        let checkpoints: Vec<Value> = stored
            .into_iter()
            .filter_map(|(sequence, mut state)| {
                let data = state.get_mut("data")?;
                (!redaction.object(data).is_empty())
                    .then(|| json!({ "sequence": sequence, "state": state }))
            })
            .collect();
        hashes.sort();
        hashes.dedup();
        // One statement writes it all, under the run's row lock, and only if the run has not
        // moved and no worker took it since it was read (`rein_apply_redaction`).
        let (outcome, blobs_deleted): (String, Vec<String>) = sqlx::query_as(
            "SELECT outcome, blobs_deleted
             FROM rein_apply_keyed_redaction($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(run_id)
        .bind(last_sequence)
        .bind(fields)
        .bind(&input)
        .bind(&projection)
        .bind(Value::Array(changed))
        .bind(Value::Array(checkpoints))
        .bind(json!(hashes))
        .bind(by)
        .bind(reason)
        .fetch_one(self.pool())
        .await?;
        match outcome.as_str() {
            "redacted" => {}
            "not_found" => return Err(StoreError::RunNotFound(run_id)),
            "leased" => {
                return Err(StoreError::Conflict(format!(
                    "a worker took run {run_id} while it was being redacted; nothing was \
                     redacted: try again once the lease is released"
                )));
            }
            _ => return Err(moved(run_id)),
        }
        Ok(Redacted {
            run_id,
            fields: fields.to_vec(),
            events: events_changed,
            hashes,
            finished: terminal,
            blobs_deleted,
        })
    }
}

/// Refuses a redaction request whose fields, reason or actor could not be recorded, before
/// anything is read: a caller answers these first, whatever else would refuse it.
pub fn redact_request_checked(fields: &[String], by: &str, reason: &str) -> Result<(), StoreError> {
    if let Some(problem) = fields_problem(fields) {
        return Err(StoreError::InvalidField {
            field: "fields".into(),
            reason: problem,
        });
    }
    if reason.trim().is_empty() || reason.len() > REDACT_REASON_BYTES_MAX {
        return Err(StoreError::InvalidField {
            field: "reason".into(),
            reason: format!("say why in 1..={REDACT_REASON_BYTES_MAX} bytes (the reason)"),
        });
    }
    crate::input::check_text("reason", reason)?;
    crate::input::check_text("by", by)?;
    Ok(())
}
