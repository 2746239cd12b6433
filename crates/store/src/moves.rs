//! Moving runs between versions of their definition (SPEC V1) and forking a run from a
//! sequence of its log (SPEC E6). What to write is planned in `rein_core::migration`; here it
//! is committed the usual fenced way: a writer without a lease takes the token only while no
//! live lease is held and only if the token and sequence are still the ones it read.

use std::collections::BTreeMap;

use rein_core::{Definition, EngineEvent, Event, RunState};
use serde_json::Value;
use uuid::Uuid;

use crate::commit::{CommitOutcome, CommitPlan, NewEvent, Writer, commit_on, plan_commit};
use crate::send::{EnqueueRequest, enqueue_on};
use crate::{Store, StoreError};

/// The protocol a log holding DEFINITION_MIGRATED or RUN_FORKED needs (`rein_runs.protocol`).
pub const PROTOCOL_MOVES: i16 = 2;

/// Most forks of forks followed back when a fork's inherited history is read.
pub const FORK_DEPTH_MAX: usize = 32;

/// Most runs one migration reads per page.
pub const MIGRATION_PAGE_MAX: i64 = 1_000;

/// A run a migration may move: the state it is in and whether a live lease holds it now.
#[derive(Debug, Clone)]
pub struct MigrationCandidate {
    pub run_id: Uuid,
    pub status: String,
    pub state: RunState,
    pub token: i64,
    pub lease_live: bool,
}

/// What became of one run's move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Moved {
    /// DEFINITION_MIGRATED committed at this sequence.
    Committed { sequence: i64 },
    /// A worker holds the run, or wrote to it since it was read: try again.
    Busy { why: String },
}

impl Store {
    /// Runs of `definition` at `version` that have not finished, in run id order after
    /// `after`, at most `limit` (bounded by [`MIGRATION_PAGE_MAX`]); only those in `only`
    /// when it is given.
    pub async fn migration_candidates(
        &self,
        definition: &str,
        version: u32,
        only: Option<&[Uuid]>,
        after: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<MigrationCandidate>, StoreError> {
        let rows: Vec<(Uuid, String, Value, i64, bool)> = sqlx::query_as(
            "SELECT run_id, status, projection, fencing_token,
                    COALESCE(lease_until > clock_timestamp(), false)
             FROM rein_runs
             WHERE definition = $1 AND version = $2 AND status <> 'terminal'
               AND ($3::uuid[] IS NULL OR run_id = ANY($3))
               AND ($4::uuid IS NULL OR run_id > $4)
             ORDER BY run_id LIMIT $5",
        )
        .bind(definition)
        .bind(version as i32)
        .bind(only)
        .bind(after)
        .bind(limit.clamp(1, MIGRATION_PAGE_MAX))
        .fetch_all(self.pool())
        .await?;
        rows.into_iter()
            .map(|(run_id, status, projection, token, lease_live)| {
                Ok(MigrationCandidate {
                    run_id,
                    status,
                    state: serde_json::from_value(projection).map_err(|e| {
                        StoreError::Corrupt(format!("projection of run {run_id}: {e}"))
                    })?,
                    token,
                    lease_live,
                })
            })
            .collect()
    }

    /// Commits DEFINITION_MIGRATED (`payload`) on `candidate` as it was read, reduced with
    /// `to`, and moves the run's row to `to`'s version in the same transaction.
    pub async fn commit_migration(
        &self,
        candidate: &MigrationCandidate,
        to: &Definition,
        payload: Value,
        by: &str,
    ) -> Result<Moved, StoreError> {
        if candidate.lease_live {
            return Ok(Moved::Busy {
                why: "a worker holds its lease".into(),
            });
        }
        let mut event = NewEvent::new(EngineEvent::DefinitionMigrated.as_str(), payload);
        event.sender = Some(by.to_owned());
        let plan = CommitPlan {
            writer: Writer::TakeToken,
            release: false,
            jitter_sample: crate::commit::jitter_from(event.event_id),
        };
        let request = plan_commit(
            to,
            candidate.run_id,
            candidate.token,
            &candidate.state,
            vec![event],
            Vec::new(),
            plan,
        )?;
        let mut tx = self.pool().begin().await?;
        let outcome = commit_on(
            &mut tx,
            &self.definitions,
            by,
            std::slice::from_ref(&request),
            self.tree_bounds(),
        )
        .await?;
        let moved = match outcome.into_iter().next() {
            Some(CommitOutcome::Committed(c)) => {
                sqlx::query(
                    "UPDATE rein_runs SET version = $2, protocol = GREATEST(protocol, $3)
                     WHERE run_id = $1",
                )
                .bind(candidate.run_id)
                .bind(to.version() as i32)
                .bind(PROTOCOL_MOVES.max(crate::definition_protocol(to)))
                .execute(&mut *tx)
                .await?;
                Moved::Committed {
                    sequence: c.sequence,
                }
            }
            Some(CommitOutcome::Fenced { reason, .. }) => Moved::Busy {
                why: format!("{reason:?}"),
            },
            Some(CommitOutcome::RunNotFound) => {
                return Err(StoreError::RunNotFound(candidate.run_id));
            }
            other => {
                return Err(StoreError::Corrupt(format!(
                    "migration commit did not apply: {other:?}"
                )));
            }
        };
        tx.commit().await?;
        if matches!(moved, Moved::Committed { .. }) {
            self.woke(None);
        }
        Ok(moved)
    }

    /// The definitions a run's log is reduced with, by version: `current` and every version
    /// a DEFINITION_MIGRATED in `events` names.
    pub async fn log_definitions(
        &self,
        name: &str,
        current: u32,
        events: &[Event],
    ) -> Result<BTreeMap<u32, Definition>, StoreError> {
        let mut defs = BTreeMap::new();
        let mut versions = rein_core::migration::versions_in_log(current, events.iter());
        versions.push(current);
        for v in versions {
            if let std::collections::btree_map::Entry::Vacant(slot) = defs.entry(v) {
                slot.insert(self.load_definition(name, Some(v)).await?);
            }
        }
        Ok(defs)
    }

    /// The history a run continues from: for a fork, its source's events up to the fork's
    /// sequence (and so back along forks of forks, at most [`FORK_DEPTH_MAX`]), then its own
    /// after RUN_FORKED; for any other run, its own log. What a model's conversation is
    /// rebuilt from, so a fork asks the model again with what the source had said and seen.
    pub async fn lineage(&self, run_id: Uuid) -> Result<Vec<crate::StoredEvent>, StoreError> {
        let mut parts: Vec<Vec<crate::StoredEvent>> = Vec::new();
        let (mut run, mut upto) = (run_id, i64::MAX);
        for _ in 0..FORK_DEPTH_MAX {
            let mut own: Vec<crate::StoredEvent> = self
                .history(run)
                .await?
                .into_iter()
                .filter(|e| e.sequence <= upto)
                .collect();
            let source = own
                .first()
                .filter(|e| e.kind == EngineEvent::RunForked.as_str())
                .and_then(|e| {
                    let id = e.payload["source_run_id"].as_str()?.parse::<Uuid>().ok()?;
                    Some((id, e.payload["at_sequence"].as_i64()?))
                });
            match source {
                Some((id, at)) => {
                    own.remove(0);
                    parts.push(own);
                    (run, upto) = (id, at);
                }
                None => {
                    parts.push(own);
                    break;
                }
            }
        }
        Ok(parts.into_iter().rev().flatten().collect())
    }

    /// Creates a fork of `source` at `at_sequence` (SPEC E6): a new run made by `request`
    /// (its definition, input, queue; linked to the source as its parent) whose first event
    /// is RUN_FORKED carrying `snapshot` and `why` (who forked it, and why), in one
    /// transaction with its creation, so no worker ever sees it before. It inherits the source's ledger entries of the steps the snapshot
    /// has made (their idempotency keys), so `rein why` shows them and a retried step keeps
    /// its key. The source is not touched.
    pub async fn fork(
        &self,
        token: Option<&crate::TokenInfo>,
        source: Uuid,
        at_sequence: i64,
        mut request: EnqueueRequest,
        snapshot: &RunState,
        why: ForkedBy<'_>,
    ) -> Result<Uuid, StoreError> {
        let ForkedBy { by, reason } = why;
        if let Some(token) = token {
            token
                .may_create(&request.queue, request.priority)
                .map_err(StoreError::OutOfBounds)?;
            if !token.token_id.is_nil() {
                request.enqueued_token = Some(token.token_id);
            }
        }
        request.parent_run_id = Some(source);
        request.client_key = None;
        let def = request.definition.clone();
        let input = request.input.clone();
        let payload = rein_core::migration::fork_payload(
            &source.to_string(),
            at_sequence as u64,
            snapshot.version,
            snapshot,
            by,
            reason,
        );
        let mut tx = self.pool().begin().await?;
        let created = enqueue_on(&mut tx, std::slice::from_ref(&request))
            .await?
            .pop()
            .ok_or_else(|| StoreError::Corrupt("enqueue returned no row".into()))?;
        let mut event = NewEvent::new(EngineEvent::RunForked.as_str(), payload);
        event.sender = Some(by.to_owned());
        let plan = CommitPlan {
            writer: Writer::TakeToken,
            release: false,
            jitter_sample: crate::commit::jitter_from(event.event_id),
        };
        let commit = plan_commit(
            &def,
            created.run_id,
            0,
            &RunState::initial(&def, input),
            vec![event],
            Vec::new(),
            plan,
        )?;
        match commit_on(
            &mut tx,
            &self.definitions,
            by,
            std::slice::from_ref(&commit),
            self.tree_bounds(),
        )
        .await?
        .into_iter()
        .next()
        {
            Some(CommitOutcome::Committed(_)) => {}
            other => {
                return Err(StoreError::Corrupt(format!(
                    "the fork's first event did not apply: {other:?}"
                )));
            }
        }
        sqlx::query("UPDATE rein_runs SET protocol = GREATEST(protocol, $2) WHERE run_id = $1")
            .bind(created.run_id)
            .bind(PROTOCOL_MOVES)
            .execute(&mut *tx)
            .await?;
        // The fork's own RUN_FORKED commit already wrote the ledger row of a call the snapshot
        // holds (failed and due again, or in doubt), as the snapshot has it: that row stays.
        let steps_made = i64::from(snapshot.steps_completed) + i64::from(snapshot.action.is_some());
        sqlx::query(
            "INSERT INTO rein_actions (run_id, action_id, node, step, idempotency_key, call_id,
                                       status, tool, result, result_hash, dispatched_at,
                                       finished_at)
             SELECT $1, action_id, node, step, idempotency_key, call_id, status, tool, result,
                    result_hash, dispatched_at, finished_at
             FROM rein_actions WHERE run_id = $2 AND step <= $3
             ON CONFLICT (run_id, action_id) DO NOTHING",
        )
        .bind(created.run_id)
        .bind(source)
        .bind(steps_made)
        .execute(&mut *tx)
        .await?;
        // The fork reads what its snapshot refers to through its own references, so a
        // redaction of the finished source does not forget a blob the live fork still needs.
        sqlx::query(
            "INSERT INTO rein_blob_refs (sha256, run_id, proven)
             SELECT sha256, $1, proven FROM rein_blob_refs WHERE run_id = $2
             ON CONFLICT DO NOTHING",
        )
        .bind(created.run_id)
        .bind(source)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.woke(Some(&request.queue));
        Ok(created.run_id)
    }
}

/// Who forked a run, and why: recorded on its RUN_FORKED event.
#[derive(Debug, Clone, Copy)]
pub struct ForkedBy<'a> {
    pub by: &'a str,
    pub reason: Option<&'a str>,
}
