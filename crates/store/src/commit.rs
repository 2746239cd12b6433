//! Claims, renewals and commits: the fencing protocol (SPEC X1–X4).

use std::collections::HashMap;

use rein_core::join::TreeBounds;
use rein_core::{Definition, Event, InvalidTransition, RunState, RunStatus, apply};
use serde_json::Value;
use sqlx::Row;
use sqlx::types::Json;
use uuid::Uuid;

use crate::{Store, StoreError};

/// A checkpoint is written whenever a commit crosses a multiple of this many sequences, and
/// when a run at least this long ends.
pub const CHECKPOINT_EVERY: u64 = 64;
/// Most runs one commit statement carries.
pub const COMMIT_BATCH_MAX: usize = 512;
/// Most events one run may commit at once.
pub const EVENTS_PER_COMMIT_MAX: usize = 64;
/// Largest `data.result` of a branch's child delivered to its parent; a larger one arrives
/// as `{"too_large_bytes": N}` (store it as a blob instead).
pub const BRANCH_RESULT_BYTES_MAX: i32 = 64 * 1024;

/// Who is writing, which decides the fencing check (SPEC X3, X3a).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// A worker holding a live lease with this token.
    Leased,
    /// A writer without a lease (scheduler, API): takes the token itself, only when no live
    /// lease is held, and only if the token is still the one it read.
    TakeToken,
}

#[derive(Debug, Clone)]
pub struct NewEvent {
    pub event_id: Uuid,
    pub kind: String,
    pub payload: Value,
    pub node: Option<String>,
    /// Who sent it from outside the engine (SPEC Z3); `None` for the engine's own events.
    pub sender: Option<String>,
}

impl NewEvent {
    pub fn new(kind: impl Into<String>, payload: Value) -> NewEvent {
        NewEvent {
            event_id: Uuid::now_v7(),
            kind: kind.into(),
            payload,
            node: None,
            sender: None,
        }
    }

    pub fn at_node(mut self, node: Option<&str>) -> NewEvent {
        self.node = node.map(str::to_owned);
        self
    }
}

/// An update of the side-effect ledger (`rein_actions`).
#[derive(Debug, Clone)]
pub struct LedgerOp {
    pub action_id: String,
    pub node: String,
    pub step: i32,
    pub idempotency_key: String,
    pub call_id: Option<String>,
    pub status: &'static str,
    pub tool: Option<String>,
    pub result: Option<Value>,
}

/// Everything one run's commit writes, computed purely from the definition, the state the
/// writer read and the events it wants to append.
#[derive(Debug, Clone)]
pub struct CommitRequest {
    pub run_id: Uuid,
    pub token: i64,
    pub writer: Writer,
    pub base_sequence: u64,
    pub events: Vec<NewEvent>,
    pub state: RunState,
    pub status: RunStatus,
    pub release: bool,
    pub timer_ms: Option<u64>,
    pub inbox_consumed: Vec<i64>,
    pub ledger: Vec<LedgerOp>,
    pub checkpoint: bool,
    /// A granted approval this commit consumes (SPEC H2): the commit lands only if the grant
    /// is still granted and unused, and uses it up in the same statement.
    pub approval: Option<Uuid>,
    /// The control state the run leaves with this commit (for the time-in-state metric).
    pub left_state: Option<String>,
    /// Retries of the current step this commit begins.
    pub retries: u32,
    /// How the run ends, when this commit ends it.
    pub finish: Option<crate::metrics::Finish>,
    /// Content the events refer to by hash (SPEC E5); stored once, with the commit.
    pub blobs: Vec<rein_core::blob::Blob>,
    /// Child runs of a fan-out this commit opens (SPEC P1), created only if it lands.
    pub children: Vec<rein_core::join::ChildRun>,
    /// A fleet-wide limit deferred the run's action (SPEC K1): it becomes claimable again
    /// this long after the commit, by the database clock.
    pub defer_ms: Option<u64>,
    /// This commit starts the first try of an action: the run's `first_try_at` becomes now,
    /// by the database clock (what a retry policy's `deadline_ms` counts from).
    pub first_try: bool,
    /// Branches of a join this commit decides that are still running (SPEC P1): each child
    /// gets CANCEL with reason `join_decided` in its inbox, only if this commit lands.
    pub cancel_children: Vec<rein_core::join::Loser>,
}

/// Options of [`plan_commit`].
#[derive(Debug, Clone, Copy)]
pub struct CommitPlan {
    pub writer: Writer,
    /// Give up the lease even if the run stays runnable (graceful shutdown, hand-over).
    pub release: bool,
    /// Sample in [0, 1) for the backoff jitter of a retry-wait timer.
    pub jitter_sample: f64,
}

/// A deterministic jitter sample from an id (uuid v7 has random low bits).
pub fn jitter_from(id: Uuid) -> f64 {
    let bytes = id.as_bytes();
    let low = u32::from_be_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
    f64::from(low) / (f64::from(u32::MAX) + 1.0)
}

/// Applies `events` to `base` with the reducer and derives every row the commit writes.
/// Fails, writing nothing, on the first event the definition refuses.
pub fn plan_commit(
    def: &Definition,
    run_id: Uuid,
    token: i64,
    base: &RunState,
    events: Vec<NewEvent>,
    inbox_consumed: Vec<i64>,
    plan: CommitPlan,
) -> Result<CommitRequest, InvalidTransition> {
    let mut state = base.clone();
    let mut ledger: Vec<LedgerOp> = Vec::new();
    let mut retries = 0;
    for e in &events {
        let event = Event::new(state.sequence + 1, e.kind.clone(), e.payload.clone());
        let next = match apply(def, &state, &event) {
            Ok(next) => next,
            Err(refused) => {
                crate::metrics::invalid_transition(def.name(), &e.kind);
                tracing::warn!(%run_id, token, event = %e.kind, state = %state.state,
                    sequence = state.sequence + 1, reason = %refused, "transition refused");
                return Err(refused);
            }
        };
        if next.attempt > state.attempt {
            retries += next.attempt - state.attempt;
        }
        if let Some(op) = ledger_op(&state, &next, &event) {
            ledger.retain(|o| o.action_id != op.action_id);
            ledger.push(op);
        }
        state = next;
    }
    let mut request = CommitRequest {
        run_id,
        token,
        writer: plan.writer,
        base_sequence: base.sequence,
        events,
        status: state.status(def),
        state,
        release: plan.release,
        timer_ms: None,
        inbox_consumed,
        ledger,
        checkpoint: false,
        approval: None,
        left_state: None,
        retries,
        finish: None,
        blobs: Vec::new(),
        children: Vec::new(),
        defer_ms: None,
        first_try: false,
        cancel_children: Vec::new(),
    };
    settle(def, &mut request, base, &base.state, plan, None);
    Ok(request)
}

/// Appends to `request` what the engine commits on its own after its events (a decided
/// join, a used-up budget, the ceiling on the run's events; with `refused`, the failure
/// path of the fan-out the commit opened), and derives what depends on where the run ends
/// up. `from` is the state the events since the last settling started from; `base_state`
/// the control state the commit starts from.
fn settle(
    def: &Definition,
    request: &mut CommitRequest,
    from: &RunState,
    base_state: &str,
    plan: CommitPlan,
    refused: Option<&rein_core::join::Refusal>,
) {
    // These go in the same commit, so a join fires atomically with the result that decides
    // it. One of each at most.
    for _ in 0..3 {
        let state = &request.state;
        let opened_here = state
            .join
            .as_ref()
            .is_some_and(|j| j.fan_out > request.base_sequence);
        let candidates = match refused {
            Some(refusal) if opened_here => rein_core::join::refused_events(def, state, refusal),
            _ => rein_core::follow_up(def, state).into_iter().collect(),
        };
        let Some((kind, payload, next)) = candidates.into_iter().find_map(|(kind, payload)| {
            let event = Event::new(state.sequence + 1, kind.clone(), payload.clone());
            apply(def, state, &event)
                .ok()
                .map(|next| (kind, payload, next))
        }) else {
            break;
        };
        request
            .cancel_children
            .extend(rein_core::join::losers(def, state));
        request.events.push(NewEvent::new(kind, payload));
        request.state = next;
    }
    let state = &request.state;
    request.children = match refused {
        Some(_) => Vec::new(),
        None => rein_core::join::children(def, request.run_id, request.base_sequence, state),
    };
    request.status = state.status(def);
    request.timer_ms =
        rein_core::timer::next_timer(def, state, plan.jitter_sample).map(|t| t.after_ms);
    let crossed = state.sequence / CHECKPOINT_EVERY > request.base_sequence / CHECKPOINT_EVERY;
    // A short log replays in no time: its final state needs no snapshot of its own.
    let long_log_ends = request.status == RunStatus::Terminal && state.sequence >= CHECKPOINT_EVERY;
    request.checkpoint = long_log_ends || (!request.events.is_empty() && crossed);
    let last = request.events.last().map(|e| (e.kind.as_str(), &e.payload));
    request.finish = crate::metrics::Finish::of(def, base_state, &state.state, last);
    request.left_state = (state.state != base_state).then(|| base_state.to_owned());
    request.first_try |= rein_core::retry::starts_first_try(def, from, state);
    request.release = plan.release || request.status != RunStatus::Runnable;
}

/// `request`, whose fan-out may not start its children, with the fan-out's failure path
/// taken in the same commit instead (SPEC Z4). The commit then releases the run: its writer
/// planned a wait for the branches, and whoever claims the run next reads where it went.
pub(crate) fn refuse_fan_out(
    def: &Definition,
    request: &CommitRequest,
    refusal: &rein_core::join::Refusal,
) -> CommitRequest {
    let base_state = request
        .left_state
        .clone()
        .unwrap_or_else(|| request.state.state.clone());
    let mut refused = request.clone();
    let plan = CommitPlan {
        writer: request.writer,
        release: true,
        jitter_sample: jitter_from(request.run_id),
    };
    settle(
        def,
        &mut refused,
        &request.state,
        &base_state,
        plan,
        Some(refusal),
    );
    refused
}

fn ledger_op(before: &RunState, after: &RunState, event: &Event) -> Option<LedgerOp> {
    let op = |slot: &rein_core::ActionSlot, status: &'static str, result: Option<Value>| LedgerOp {
        action_id: slot.action_id.clone(),
        node: slot.node.clone(),
        step: slot.step as i32,
        idempotency_key: slot.idempotency_key.clone(),
        call_id: slot.call_id.clone(),
        status,
        tool: slot.tool.clone(),
        result,
    };
    match (&before.action, &after.action) {
        (_, Some(slot)) if before.action.as_ref() != Some(slot) => {
            let status = match slot.status {
                rein_core::ActionStatus::Dispatched => "DISPATCHED",
                rein_core::ActionStatus::InDoubt => "IN_DOUBT",
                rein_core::ActionStatus::Failed => "FAILED",
            };
            let result =
                (slot.status == rein_core::ActionStatus::Failed).then(|| event.payload.clone());
            Some(op(slot, status, result))
        }
        (Some(slot), None) => {
            let failed = event.payload.get("error").is_some();
            let result = event
                .payload
                .get("result")
                .cloned()
                .or_else(|| Some(event.payload.clone()));
            Some(op(
                slot,
                if failed { "FAILED" } else { "SUCCEEDED" },
                result,
            ))
        }
        _ => None,
    }
}

/// The result of one run's commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    Committed(Committed),
    /// The writer's token is no longer current, its lease expired, or someone else advanced
    /// the log: it must stop and never retry the write (SPEC X3). `reason` names the
    /// condition that refused it.
    Fenced {
        current_token: i64,
        current_sequence: i64,
        owner: Option<String>,
        reason: FenceReason,
    },
    /// These event ids are already stored (a retried commit): nothing was written again.
    AlreadyCommitted {
        sequence: i64,
    },
    RunNotFound,
}

/// Which condition of the commit statement refused a run's write, judged on the row the
/// statement locked (SPEC X3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceReason {
    /// Another writer took the run since: the token is now `current`.
    TokenSuperseded { token: i64, current: i64 },
    /// The token is still the writer's, but its lease ran out at `lease_until` by the
    /// database clock (`db_now` when the statement reported it).
    LeaseExpired {
        lease_until: chrono::DateTime<chrono::Utc>,
        db_now: chrono::DateTime<chrono::Utc>,
    },
    /// The writer holds no lease on the run: it was released, or `owner` holds it.
    LeaseNotHeld { owner: Option<String> },
    /// A writer without a lease found a live one (`owner` until `lease_until`).
    LeaseHeld {
        owner: Option<String>,
        lease_until: Option<chrono::DateTime<chrono::Utc>>,
    },
    /// The log moved past the writer's base: its last sequence is `current`, not `base`.
    SequenceMoved { base: i64, current: i64 },
    /// The run's log was archived: nothing is appended to it any more.
    Archived,
    /// The approval the commit would use is no longer granted and unused.
    ApprovalUnavailable,
    /// The commit's events are already stored (a retried commit).
    AlreadyStored,
}

impl FenceReason {
    /// The reason the statement reported (`fenced_by`), with the row's values.
    fn from_row(row: &sqlx::postgres::PgRow, request: &CommitRequest) -> Result<Self, StoreError> {
        let by: Option<String> = row.try_get("fenced_by")?;
        let owner: Option<String> = row.try_get("current_owner")?;
        let lease_until: Option<chrono::DateTime<chrono::Utc>> =
            row.try_get("current_lease_until")?;
        Ok(match by.as_deref() {
            Some("archived") => FenceReason::Archived,
            Some("token") => FenceReason::TokenSuperseded {
                token: request.token,
                current: row.try_get::<Option<i64>, _>("current_token")?.unwrap_or(0),
            },
            Some("sequence") => FenceReason::SequenceMoved {
                base: request.base_sequence as i64,
                current: row
                    .try_get::<Option<i64>, _>("current_sequence")?
                    .unwrap_or(0),
            },
            Some("already_stored") => FenceReason::AlreadyStored,
            Some("approval") => FenceReason::ApprovalUnavailable,
            Some("lease_held") => FenceReason::LeaseHeld { owner, lease_until },
            Some("lease_not_held") => FenceReason::LeaseNotHeld { owner },
            Some("lease_expired") => match lease_until {
                Some(lease_until) => FenceReason::LeaseExpired {
                    lease_until,
                    db_now: row.try_get("db_now")?,
                },
                None => FenceReason::LeaseNotHeld { owner },
            },
            other => {
                return Err(StoreError::Corrupt(format!(
                    "the commit refused run {} for no reason it knows ({other:?})",
                    request.run_id
                )));
            }
        })
    }
}

impl std::fmt::Display for FenceReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FenceReason::TokenSuperseded { token, current } => write!(
                f,
                "token {token} was superseded by token {current}: another writer took the run"
            ),
            FenceReason::LeaseExpired {
                lease_until,
                db_now,
            } => write!(
                f,
                "the lease expired at {} by the database clock ({} ms before it was checked at {})",
                lease_until.to_rfc3339(),
                (*db_now - *lease_until).num_milliseconds().max(0),
                db_now.to_rfc3339()
            ),
            FenceReason::LeaseNotHeld { owner: None } => {
                write!(f, "the writer holds no lease: it was released")
            }
            FenceReason::LeaseNotHeld { owner: Some(owner) } => {
                write!(f, "the writer holds no lease: {owner} holds it")
            }
            FenceReason::LeaseHeld { owner, lease_until } => write!(
                f,
                "a live lease is held by {} until {}: the event must wait in the run's inbox",
                owner.as_deref().unwrap_or("another worker"),
                lease_until.map_or_else(|| "?".to_owned(), |t| t.to_rfc3339())
            ),
            FenceReason::SequenceMoved { base, current } => write!(
                f,
                "the sequence moved: the write continues sequence {base} but the log is at {current}"
            ),
            FenceReason::Archived => write!(f, "the run is archived: its log takes no more events"),
            FenceReason::ApprovalUnavailable => {
                write!(f, "the approval it uses is no longer granted and unused")
            }
            FenceReason::AlreadyStored => write!(f, "its events are already stored"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    pub token: i64,
    pub sequence: i64,
    /// More events wait in the run's inbox.
    pub inbox_pending: bool,
}

#[derive(Debug, Clone)]
pub struct ClaimedRun {
    pub run_id: Uuid,
    pub definition: String,
    pub version: u32,
    pub state: RunState,
    pub token: i64,
    pub lease_until: chrono::DateTime<chrono::Utc>,
    pub queued_ms: f64,
    pub inbox_pending: bool,
}

#[derive(Debug, Clone)]
pub struct Renewed {
    pub run_id: Uuid,
    pub inbox_pending: bool,
    pub cancel_pending: bool,
}

impl Store {
    /// Claims up to `n` runnable runs for `worker` with a lease of `lease_ttl_ms`, shared
    /// fairly among `queues` (round robin over calls for what does not divide evenly).
    pub async fn claim(
        &self,
        worker: &str,
        n: u32,
        lease_ttl_ms: u64,
        queues: &[String],
    ) -> Result<Vec<ClaimedRun>, StoreError> {
        let mut held = HeldConnection::default();
        self.claim_holding(worker, n, lease_ttl_ms, queues, &mut held)
            .await
    }

    /// [`Store::claim`] on the connection `held` keeps between calls (see
    /// [`HeldConnection`]).
    pub async fn claim_holding(
        &self,
        worker: &str,
        n: u32,
        lease_ttl_ms: u64,
        queues: &[String],
        held: &mut HeldConnection,
    ) -> Result<Vec<ClaimedRun>, StoreError> {
        let mut distinct: Vec<&str> = Vec::with_capacity(queues.len());
        for q in queues {
            if !distinct.contains(&q.as_str()) {
                distinct.push(q);
            }
        }
        // Which queue a share left over goes to first: the next one at each claim.
        let turn = self
            .claim_turn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % distinct.len().max(1) as u64;
        let rows = sqlx::query(include_str!("../queries/claim.sql"))
            .bind(worker)
            .bind(i64::from(n))
            .bind(&distinct)
            .bind(lease_ttl_ms as i64)
            .bind(turn as i64)
            .bind(crate::PROTOCOL_VERSION)
            .fetch_all(held.take_or_acquire(self).await?)
            .await;
        held.used(self, rows.is_ok());
        rows?
            .into_iter()
            .map(|row| {
                // Read straight from the column's bytes, with no JSON tree in between.
                let Json(state) = row
                    .try_get::<Json<RunState>, _>("projection")
                    .map_err(|e| StoreError::Corrupt(format!("projection: {e}")))?;
                let version: i32 = row.try_get("version")?;
                let last_sequence: i64 = row.try_get("last_sequence")?;
                if state.sequence != last_sequence as u64 {
                    return Err(StoreError::Corrupt(format!(
                        "projection of run at sequence {} but the run row says {last_sequence}",
                        state.sequence
                    )));
                }
                Ok(ClaimedRun {
                    run_id: row.try_get("run_id")?,
                    definition: row.try_get("definition")?,
                    version: version as u32,
                    state,
                    token: row.try_get("fencing_token")?,
                    lease_until: row.try_get("lease_until")?,
                    queued_ms: row.try_get("queued_ms")?,
                    inbox_pending: row.try_get("inbox_pending")?,
                })
            })
            .collect()
    }

    /// Renews the leases `worker` holds; runs missing from the answer are lost.
    pub async fn renew(
        &self,
        worker: &str,
        held: &[(Uuid, i64)],
        lease_ttl_ms: u64,
    ) -> Result<Vec<Renewed>, StoreError> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, tokens): (Vec<Uuid>, Vec<i64>) = held.iter().copied().unzip();
        let rows = sqlx::query(include_str!("../queries/renew.sql"))
            .bind(&ids)
            .bind(&tokens)
            .bind(lease_ttl_ms as i64)
            .bind(worker)
            .fetch_all(self.pool())
            .await?;
        rows.into_iter()
            .map(|row| {
                Ok(Renewed {
                    run_id: row.try_get("run_id")?,
                    inbox_pending: row.try_get("inbox_pending")?,
                    cancel_pending: row.try_get("cancel_pending")?,
                })
            })
            .collect()
    }

    /// Commits many runs in one statement; one outcome per request, in order.
    pub async fn commit_batch(
        &self,
        worker: &str,
        requests: &[CommitRequest],
    ) -> Result<Vec<CommitOutcome>, StoreError> {
        self.commit_batch_held(worker, requests, &mut HeldConnection::default())
            .await
    }

    /// [`Store::commit_batch`] on the connection `held` keeps between calls.
    async fn commit_batch_held(
        &self,
        worker: &str,
        requests: &[CommitRequest],
        held: &mut HeldConnection,
    ) -> Result<Vec<CommitOutcome>, StoreError> {
        let outcomes = commit_on(
            held.take_or_acquire(self).await?,
            &self.definitions,
            worker,
            requests,
            self.tree_bounds(),
        )
        .await;
        held.used(self, outcomes.is_ok());
        let outcomes = outcomes?;
        // A run left runnable without a lease (released, or written by a scheduler that
        // fired its timer or recovered its lease) can be claimed by anyone now.
        let runnable = requests.iter().zip(&outcomes).any(|(r, o)| {
            matches!(o, CommitOutcome::Committed(_))
                && r.status == RunStatus::Runnable
                && r.defer_ms.is_none()
                && (r.release || matches!(r.writer, Writer::TakeToken))
        });
        if runnable {
            self.woke(None);
        }
        Ok(outcomes)
    }
}

impl Store {
    /// [`Store::commit_batch`] with one result per request. When PostgreSQL refuses the
    /// statement as a whole for a reason a retry will not cure (one run's data it cannot
    /// store), every run is committed again on its own before anyone is told: one run's bad
    /// data never costs another run its result. A transient failure (connection lost) is
    /// reported to every run as it is; each writer retries its own commit.
    pub async fn commit_runs(
        &self,
        worker: &str,
        requests: &[CommitRequest],
    ) -> Vec<Result<CommitOutcome, StoreError>> {
        self.commit_runs_holding(worker, requests, &mut HeldConnection::default())
            .await
    }

    /// [`Store::commit_runs`] on the connection `held` keeps between calls (see
    /// [`HeldConnection`]).
    pub async fn commit_runs_holding(
        &self,
        worker: &str,
        requests: &[CommitRequest],
        held: &mut HeldConnection,
    ) -> Vec<Result<CommitOutcome, StoreError>> {
        let whole = match self.commit_batch_held(worker, requests, held).await {
            Ok(outcomes) => return outcomes.into_iter().map(Ok).collect(),
            Err(e) => e,
        };
        if requests.len() == 1 || whole.is_transient() {
            let message = whole.to_string();
            let transient = whole.is_transient();
            return requests
                .iter()
                .map(|_| {
                    Err(if transient {
                        StoreError::Unreachable(message.clone())
                    } else {
                        StoreError::Invalid(message.clone())
                    })
                })
                .collect();
        }
        tracing::warn!(error = %whole, worker, runs = requests.len(),
            "commit statement refused as a whole; committing its runs one by one");
        let mut outcomes = Vec::with_capacity(requests.len());
        for request in requests {
            let outcome = self
                .commit_batch_held(worker, std::slice::from_ref(request), held)
                .await
                .and_then(|mut o| {
                    o.pop().ok_or_else(|| {
                        StoreError::Corrupt(format!(
                            "commit returned no row for run {}",
                            request.run_id
                        ))
                    })
                });
            if let Err(e) = &outcome {
                tracing::error!(run_id = %request.run_id, error = %e, worker,
                    "this run's commit is refused on its own");
            }
            outcomes.push(outcome);
        }
        outcomes
    }
}

/// A connection a writer keeps between its statements, so that a statement costs one round
/// trip to the database rather than three: the pool checks every connection it hands out,
/// and every one it takes back, with a round trip of its own. It is kept only while nobody
/// else needs one (the pool has an idle connection or room to open one) and while it is
/// busy: one unused for [`HeldConnection::IDLE_MAX`], or that saw any error, goes back to
/// the pool, which checks it.
#[derive(Default)]
pub struct HeldConnection {
    conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    used_at: Option<std::time::Instant>,
}

impl HeldConnection {
    pub const IDLE_MAX: std::time::Duration = std::time::Duration::from_secs(1);

    async fn take_or_acquire(
        &mut self,
        store: &Store,
    ) -> Result<&mut sqlx::PgConnection, StoreError> {
        if self
            .used_at
            .is_some_and(|at| at.elapsed() >= HeldConnection::IDLE_MAX)
        {
            self.conn = None;
        }
        let conn = match self.conn.take() {
            Some(conn) => conn,
            None => store.pool().acquire().await?,
        };
        Ok(&mut **self.conn.insert(conn))
    }

    fn used(&mut self, store: &Store, ok: bool) {
        self.used_at = Some(std::time::Instant::now());
        let pool = store.pool();
        let others_can_connect =
            pool.num_idle() > 0 || pool.size() < pool.options().get_max_connections();
        if !ok || !others_can_connect {
            self.conn = None;
        }
    }

    /// Whether a connection is held now.
    pub fn is_held(&self) -> bool {
        self.conn.is_some()
    }
}

/// [`Store::commit_batch`] on a given connection (possibly inside the caller's transaction).
/// A commit that starts children is held to the tree's bounds (SPEC Z4): in one
/// transaction, the committing runs and the roots of the fanning ones are locked, each
/// fan-out is judged against its root's count, a refused one takes its failure path instead,
/// and the roots count the children that started. Two writers fanning out under one root
/// queue on the root's row, so together they never pass the bound.
pub(crate) async fn commit_on(
    conn: &mut sqlx::PgConnection,
    definitions: &crate::definitions::DefinitionCache,
    worker: &str,
    requests: &[CommitRequest],
    bounds: TreeBounds,
) -> Result<Vec<CommitOutcome>, StoreError> {
    if requests.iter().all(|r| r.children.is_empty()) {
        return commit_statement(conn, definitions, worker, requests).await;
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let bounded = bound_fan_outs(&mut tx, definitions, requests, bounds).await?;
    let outcomes = commit_statement(&mut tx, definitions, worker, &bounded).await?;
    let started: Vec<(Uuid, i64)> = bounded
        .iter()
        .zip(&outcomes)
        .filter(|(r, o)| !r.children.is_empty() && matches!(o, CommitOutcome::Committed(_)))
        .map(|(r, _)| (r.run_id, r.children.len() as i64))
        .collect();
    if !started.is_empty() {
        let (parents, counts): (Vec<Uuid>, Vec<i64>) = started.into_iter().unzip();
        sqlx::query(include_str!("../queries/count_descendants.sql"))
            .bind(&parents)
            .bind(&counts)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(outcomes)
}

/// `requests` with every fan-out the tree's bounds refuse replanned onto its failure path.
/// Locks the committing runs and the roots of the fanning ones, in run_id order (the order
/// the commit statement locks runs in), until the caller's transaction ends.
async fn bound_fan_outs<'r>(
    conn: &mut sqlx::PgConnection,
    definitions: &crate::definitions::DefinitionCache,
    requests: &'r [CommitRequest],
    bounds: TreeBounds,
) -> Result<std::borrow::Cow<'r, [CommitRequest]>, StoreError> {
    let all: Vec<Uuid> = requests.iter().map(|r| r.run_id).collect();
    let fanning: Vec<Uuid> = requests
        .iter()
        .filter(|r| !r.children.is_empty())
        .map(|r| r.run_id)
        .collect();
    let rows: Vec<(Uuid, Option<Uuid>, i32, i64)> =
        sqlx::query_as(include_str!("../queries/lock_trees.sql"))
            .bind(&all)
            .bind(&fanning)
            .fetch_all(&mut *conn)
            .await?;
    let tree: HashMap<Uuid, (Uuid, i32, i64)> = rows
        .into_iter()
        .map(|(run, root, depth, descendants)| (run, (root.unwrap_or(run), depth, descendants)))
        .collect();
    // Fan-outs earlier in this batch count against the same root.
    let mut started: HashMap<Uuid, u64> = HashMap::new();
    let mut replanned: Option<Vec<CommitRequest>> = None;
    for (i, r) in requests.iter().enumerate() {
        // A run that is not there is reported by the commit statement.
        let Some(&(root, depth, _)) = tree.get(&r.run_id).filter(|_| !r.children.is_empty()) else {
            continue;
        };
        let descendants = tree.get(&root).map_or(0, |t| t.2.max(0) as u64);
        let before = started.get(&root).copied().unwrap_or(0);
        let branches = r.children.len() as u64;
        let refusal = match bounds.check(depth.max(0) as u32, descendants + before, branches) {
            Ok(()) => {
                started.insert(root, before + branches);
                continue;
            }
            Err(refusal) => refusal,
        };
        let def = crate::definitions::load_definition_with(
            &mut *conn,
            definitions,
            &r.state.definition,
            Some(r.state.version),
        )
        .await?;
        tracing::warn!(run_id = %r.run_id, root_run_id = %root, depth, descendants, branches,
            state = %r.state.state, reason = refusal.reason(),
            "fan-out refused: {refusal}; it takes its failure path");
        crate::metrics::fan_out_refused(refusal.reason());
        replanned.get_or_insert_with(|| requests.to_vec())[i] = refuse_fan_out(&def, r, &refusal);
    }
    Ok(replanned.map_or(
        std::borrow::Cow::Borrowed(requests),
        std::borrow::Cow::Owned,
    ))
}

/// Runs the commit statement for `requests` on `conn`.
async fn commit_statement(
    conn: &mut sqlx::PgConnection,
    definitions: &crate::definitions::DefinitionCache,
    worker: &str,
    requests: &[CommitRequest],
) -> Result<Vec<CommitOutcome>, StoreError> {
    if requests.is_empty() {
        return Ok(Vec::new());
    }
    if requests.len() > COMMIT_BATCH_MAX {
        return Err(StoreError::Invalid(format!(
            "{} runs in one commit; the limit is {COMMIT_BATCH_MAX}",
            requests.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for r in requests {
        if !seen.insert(r.run_id) {
            return Err(StoreError::Invalid(format!(
                "run {} appears twice in one commit",
                r.run_id
            )));
        }
        if r.events.len() > EVENTS_PER_COMMIT_MAX {
            return Err(StoreError::Invalid(format!(
                "{} events for run {}; the limit is {EVENTS_PER_COMMIT_MAX}",
                r.events.len(),
                r.run_id
            )));
        }
        for e in &r.events {
            let size = rein_core::hash::canonical_len(&e.payload);
            if size > rein_core::limits::EVENT_PAYLOAD_BYTES_MAX {
                return Err(StoreError::Invalid(format!(
                    "{} event of run {} has a {size}-byte payload; the limit is {} bytes (large fields belong in blobs)",
                    e.kind,
                    r.run_id,
                    rein_core::limits::EVENT_PAYLOAD_BYTES_MAX
                )));
            }
        }
        // Pair assertion with the reducer: the projection is exactly base + events.
        assert_eq!(
            r.state.sequence,
            r.base_sequence + r.events.len() as u64,
            "commit of run {} does not continue its base sequence",
            r.run_id
        );
    }

    // Content already stored is not sent again: only its reference travels.
    let hashes: Vec<&str> = requests
        .iter()
        .flat_map(|r| r.blobs.iter().map(|b| b.sha256.as_str()))
        .collect();
    let stored: std::collections::HashSet<String> = if hashes.is_empty() {
        Default::default()
    } else {
        sqlx::query_scalar("SELECT sha256 FROM rein_blobs WHERE sha256 = ANY($1)")
            .bind(&hashes)
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .collect()
    };

    let mut child_defs: HashMap<(String, Option<u32>), Definition> = HashMap::new();
    for c in requests.iter().flat_map(|r| r.children.iter()) {
        let key = (c.definition.clone(), c.version);
        if child_defs.contains_key(&key) {
            continue;
        }
        let def = crate::definitions::load_definition_with(
            &mut *conn,
            definitions,
            &c.definition,
            c.version,
        )
        .await
        .map_err(|e| StoreError::Invalid(format!("branch `{}` cannot start: {e}", c.branch)))?;
        child_defs.insert(key, def);
    }

    let mut q = Columns::default();
    for r in requests {
        for c in &r.children {
            let Some(def) = child_defs.get(&(c.definition.clone(), c.version)) else {
                continue;
            };
            let state = RunState::initial(def, c.input.clone());
            q.c_run.push(c.run_id);
            q.c_protocol.push(crate::definition_protocol(def));
            q.c_parent.push(r.run_id);
            q.c_def.push(def.name().to_owned());
            q.c_ver.push(def.version() as i32);
            q.c_status.push(state.status(def).as_str().to_owned());
            q.c_state.push(state.state.clone());
            q.c_projection.push(
                serde_json::to_value(&state).map_err(|e| StoreError::Corrupt(e.to_string()))?,
            );
            q.c_input.push(c.input.clone());
            q.c_branch.push(serde_json::json!({
                "name": c.branch, "fan_out": c.fan_out, "succeed_on": c.succeed_on,
            }));
            q.c_timer
                .push(rein_core::timer::next_timer(def, &state, 0.5).map(|t| t.after_ms as i64));
            q.c_deadline.push(
                def.budget()
                    .and_then(|b| b.wall_time_ms)
                    .map(|ms| ms as i64),
            );
        }
        for loser in &r.cancel_children {
            q.x_branch.push(loser.branch.clone());
            q.x_parent.push(r.run_id);
            q.x_fan_out.push(loser.fan_out as i64);
        }
        for b in &r.blobs {
            q.ref_run.push(r.run_id);
            q.ref_hash.push(b.sha256.clone());
            if !stored.contains(&b.sha256) {
                q.blob_run.push(r.run_id);
                q.blob_hash.push(b.sha256.clone());
                q.blob_content.push(b.content.clone());
            }
        }
        q.run_ids.push(r.run_id);
        q.tokens.push(r.token);
        q.base_seqs.push(r.base_sequence as i64);
        q.new_seqs.push(r.state.sequence as i64);
        // Serialized straight into the statement's buffer, with no JSON tree in between.
        q.projections.push(Json(&r.state));
        q.states.push(&r.state.state);
        q.statuses.push(r.status.as_str().to_owned());
        q.bumps.push(r.writer == Writer::TakeToken);
        q.releases.push(r.release);
        q.approvals.push(r.approval);
        q.timers.push(r.timer_ms.map(|t| t as i64));
        q.defers
            .push(r.defer_ms.map(|t| t.min(i64::MAX as u64) as i64));
        q.first_tries.push(r.first_try);
        q.cancels
            .push(matches!(r.finish, Some(crate::metrics::Finish::Cancelled)));
        q.reasons.push(if r.status == RunStatus::Terminal {
            r.state.terminal_reason.clone()
        } else {
            None
        });
        for (i, e) in r.events.iter().enumerate() {
            q.ev_run.push(r.run_id);
            q.ev_seq.push((r.base_sequence + 1 + i as u64) as i64);
            q.ev_id.push(e.event_id);
            q.ev_type.push(&e.kind);
            q.ev_payload.push(Json(&e.payload));
            q.ev_node.push(e.node.clone());
            q.ev_sender.push(e.sender.clone());
        }
        for id in &r.inbox_consumed {
            q.inbox_run.push(r.run_id);
            q.inbox_id.push(*id);
        }
        for l in &r.ledger {
            q.l_run.push(r.run_id);
            q.l_action.push(l.action_id.clone());
            q.l_node.push(l.node.clone());
            q.l_step.push(l.step);
            q.l_key.push(l.idempotency_key.clone());
            q.l_call.push(l.call_id.clone());
            q.l_status.push(l.status.to_owned());
            q.l_tool.push(l.tool.clone());
            q.l_hash.push(l.result.as_ref().map(|v| {
                rein_core::hash::sha256_hex(rein_core::hash::canonical_json(v).as_bytes())
            }));
            q.l_result.push(l.result.clone());
        }
        if r.checkpoint {
            q.ck_run.push(r.run_id);
            q.ck_seq.push(r.state.sequence as i64);
            q.ck_def.push(r.state.definition.clone());
            q.ck_ver.push(r.state.version as i32);
            q.ck_state.push(Json(&r.state));
        }
    }

    let parts = CommitParts {
        grants: q.bumps.iter().any(|b| *b),
        consumed: !q.inbox_id.is_empty(),
        inbox_due: q.bumps.iter().zip(&q.releases).any(|(b, r)| *b || *r),
        ledger: !q.l_run.is_empty(),
        approvals_used: q.approvals.iter().any(Option::is_some),
        ending: q.statuses.iter().any(|s| s == RunStatus::Terminal.as_str()),
        // Every blob stored or found is referred to: the part runs for either.
        blobs: !q.ref_run.is_empty(),
        children: !q.c_run.is_empty(),
        losers: !q.x_branch.is_empty(),
        descendants: q.cancels.iter().any(|c| *c),
        checkpoints: !q.ck_run.is_empty(),
    };
    let rows = sqlx::query(commit_sql(parts))
        .bind(&q.run_ids)
        .bind(&q.tokens)
        .bind(&q.base_seqs)
        .bind(&q.projections)
        .bind(&q.states)
        .bind(&q.statuses)
        .bind(&q.bumps)
        .bind(&q.releases)
        .bind(&q.timers)
        .bind(&q.reasons)
        .bind(&q.ev_run)
        .bind(&q.ev_seq)
        .bind(&q.ev_id)
        .bind(&q.ev_type)
        .bind(&q.ev_payload)
        .bind(&q.ev_node)
        .bind(worker)
        .bind(&q.inbox_run)
        .bind(&q.inbox_id)
        .bind(&q.l_run)
        .bind(&q.l_action)
        .bind(&q.l_node)
        .bind(&q.l_step)
        .bind(&q.l_key)
        .bind(&q.l_call)
        .bind(&q.l_status)
        .bind(&q.l_tool)
        .bind(&q.l_result)
        .bind(&q.l_hash)
        .bind(&q.ck_run)
        .bind(&q.ck_seq)
        .bind(&q.ck_def)
        .bind(&q.ck_ver)
        .bind(&q.ck_state)
        .bind(&q.approvals)
        .bind(&q.blob_run)
        .bind(&q.blob_hash)
        .bind(&q.blob_content)
        .bind(&q.c_run)
        .bind(&q.c_parent)
        .bind(&q.c_def)
        .bind(&q.c_ver)
        .bind(&q.c_state)
        .bind(&q.c_status)
        .bind(&q.c_projection)
        .bind(&q.c_input)
        .bind(&q.c_branch)
        .bind(&q.c_timer)
        .bind(&q.c_deadline)
        .bind(BRANCH_RESULT_BYTES_MAX)
        .bind(&q.defers)
        .bind(&q.first_tries)
        .bind(&q.ev_sender)
        .bind(&q.x_branch)
        .bind(&q.x_parent)
        .bind(&q.cancels)
        .bind(&q.x_fan_out)
        .bind(&q.new_seqs)
        .bind(&q.ref_run)
        .bind(&q.ref_hash)
        .bind(&q.c_protocol)
        .fetch_all(&mut *conn)
        .await
        .inspect_err(|e| {
            tracing::error!(error = %e, worker, runs = requests.len(),
                "commit failed; nothing was written (the runs stay where they were)");
        })?;

    let mut by_run: HashMap<Uuid, CommitOutcome> = HashMap::with_capacity(rows.len());
    let request_of: HashMap<Uuid, &CommitRequest> =
        requests.iter().map(|r| (r.run_id, r)).collect();
    let mut failed: Vec<Uuid> = Vec::new();
    for row in rows {
        let run_id: Uuid = row.try_get("run_id")?;
        let committed: bool = row.try_get("committed")?;
        if committed && let Some(request) = request_of.get(&run_id) {
            crate::metrics::committed(
                &request.state.definition,
                request.events.iter().map(|e| e.kind.as_str()),
                request
                    .left_state
                    .as_deref()
                    .zip(row.try_get("left_after_s")?),
                request.retries,
                request.finish,
            );
            let token: i64 = row.try_get("new_token")?;
            for (i, e) in request.events.iter().enumerate() {
                tracing::info!(%run_id, sequence = request.base_sequence + 1 + i as u64,
                    event = %e.kind, node = e.node.as_deref().unwrap_or(""), worker,
                    token, from = request.left_state.as_deref().unwrap_or(&request.state.state),
                    to = %request.state.state, "transition");
            }
            // The branches this commit started are runs of their own: each its own trace.
            let queue: String = row.try_get("queue")?;
            for child in &request.children {
                crate::trace::run_root_span(crate::trace::RunRoot {
                    run_id: child.run_id,
                    definition: &child.definition,
                    queue: &queue,
                    parent_run_id: Some(run_id),
                    traceparent: None,
                });
            }
        }
        let outcome = if committed {
            CommitOutcome::Committed(Committed {
                token: row.try_get("new_token")?,
                sequence: row.try_get("new_sequence")?,
                inbox_pending: row.try_get("inbox_pending")?,
            })
        } else {
            let current_token: Option<i64> = row.try_get("current_token")?;
            match (current_token, request_of.get(&run_id)) {
                (Some(current_token), Some(request)) => {
                    failed.push(run_id);
                    CommitOutcome::Fenced {
                        current_token,
                        current_sequence: row
                            .try_get::<Option<i64>, _>("current_sequence")?
                            .unwrap_or(0),
                        owner: row.try_get("current_owner")?,
                        reason: FenceReason::from_row(&row, request)?,
                    }
                }
                _ => CommitOutcome::RunNotFound,
            }
        };
        by_run.insert(run_id, outcome);
    }
    if !failed.is_empty() {
        // A retried commit whose first attempt landed: report the stored result. Looked up
        // by (run_id, event_id), the log's unique key: an index probe per run, however long
        // the history (by event id alone it would read the whole log).
        let (runs, ids): (Vec<Uuid>, Vec<Uuid>) = requests
            .iter()
            .filter(|r| failed.contains(&r.run_id))
            .filter_map(|r| r.events.first().map(|e| (r.run_id, e.event_id)))
            .unzip();
        let stored: Vec<(Uuid, i64)> = sqlx::query_as(
            "SELECT e.run_id, e.sequence
             FROM unnest($1::uuid[], $2::uuid[]) AS wanted(run_id, event_id)
             JOIN rein_events e USING (run_id, event_id)",
        )
        .bind(&runs)
        .bind(&ids)
        .fetch_all(&mut *conn)
        .await?;
        for (run_id, sequence) in stored {
            by_run.insert(run_id, CommitOutcome::AlreadyCommitted { sequence });
        }
        for r in requests {
            if let Some(CommitOutcome::Fenced {
                current_token,
                current_sequence,
                owner,
                reason,
            }) = by_run.get(&r.run_id)
            {
                crate::metrics::fenced();
                tracing::warn!(run_id = %r.run_id, worker, token = r.token, current_token,
                    base_sequence = r.base_sequence, current_sequence,
                    owner = owner.as_deref().unwrap_or(""), %reason,
                    "fenced write refused: {reason}");
            }
        }
    }
    requests
        .iter()
        .map(|r| {
            by_run.remove(&r.run_id).ok_or_else(|| {
                StoreError::Corrupt(format!("commit returned no row for run {}", r.run_id))
            })
        })
        .collect()
}

/// The optional parts of the commit statement a batch needs (`-- [name]` in commit.sql).
/// Each left out would have found nothing to do: its input is empty or no run of the batch
/// can reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
struct CommitParts {
    /// A writer that takes the token (no lease held): its grant is recorded.
    grants: bool,
    /// Inbox entries the batch applied.
    consumed: bool,
    /// A run that releases its lease or takes the token: its inbox is looked at again.
    inbox_due: bool,
    ledger: bool,
    approvals_used: bool,
    /// A run that ends: pending approvals go void, a branch child delivers its result.
    ending: bool,
    blobs: bool,
    children: bool,
    losers: bool,
    descendants: bool,
    checkpoints: bool,
}

impl CommitParts {
    fn wants(&self, part: &str) -> bool {
        match part {
            "grants" => self.grants,
            "consumed" => self.consumed,
            "inbox_due" => self.inbox_due,
            "ledger" => self.ledger,
            "approvals_used" => self.approvals_used,
            "approvals_void" | "branch_results" => self.ending,
            "blobs" => self.blobs,
            "children" => self.children,
            "losers" => self.losers,
            "descendants" => self.descendants,
            "checkpoints" => self.checkpoints,
            other => panic!("commit.sql has a part `{other}` that commit.rs does not know"),
        }
    }
}

/// commit.sql with only the parts `parts` names. Each variant is built once per process
/// (there are few: most batches are plain steps) and prepared once per connection.
fn commit_sql(parts: CommitParts) -> &'static str {
    static BUILT: std::sync::OnceLock<std::sync::Mutex<HashMap<CommitParts, &'static str>>> =
        std::sync::OnceLock::new();
    let built = BUILT.get_or_init(Default::default);
    let mut built = built.lock().unwrap_or_else(|e| e.into_inner());
    built
        .entry(parts)
        .or_insert_with(|| Box::leak(assemble_commit(parts).into_boxed_str()))
}

/// Splits commit.sql at its `-- [name]` lines and joins the head (the CTEs every commit
/// runs), the parts wanted and the result.
fn assemble_commit(parts: CommitParts) -> String {
    let sql = include_str!("../queries/commit.sql");
    let mut head = String::new();
    let mut pieces: Vec<(String, String)> = Vec::new();
    for line in sql.lines() {
        if let Some(name) = line
            .strip_prefix("-- [")
            .and_then(|rest| rest.strip_suffix(']'))
        {
            pieces.push((name.to_owned(), String::new()));
            continue;
        }
        let into = match pieces.last_mut() {
            Some((_, text)) => text,
            None => &mut head,
        };
        into.push_str(line);
        into.push('\n');
    }
    let (result_name, result) = pieces.pop().expect("commit.sql ends with its result");
    assert_eq!(
        result_name, "result",
        "commit.sql's last part is its result"
    );
    // CTEs are joined by commas: each piece's own trailing comma is dropped first.
    let trim = |text: &str| text.trim_end().trim_end_matches(',').to_owned();
    let mut ctes = vec![trim(&head)];
    ctes.extend(
        pieces
            .iter()
            .filter(|(name, _)| parts.wants(name))
            .map(|(_, text)| trim(text)),
    );
    format!("{}\n{result}", ctes.join(",\n"))
}

#[derive(Default)]
struct Columns<'a> {
    run_ids: Vec<Uuid>,
    tokens: Vec<i64>,
    base_seqs: Vec<i64>,
    projections: Vec<Json<&'a RunState>>,
    states: Vec<&'a str>,
    statuses: Vec<String>,
    bumps: Vec<bool>,
    releases: Vec<bool>,
    timers: Vec<Option<i64>>,
    reasons: Vec<Option<String>>,
    approvals: Vec<Option<Uuid>>,
    ev_run: Vec<Uuid>,
    ev_seq: Vec<i64>,
    ev_id: Vec<Uuid>,
    ev_type: Vec<&'a str>,
    ev_payload: Vec<Json<&'a Value>>,
    ev_node: Vec<Option<String>>,
    ev_sender: Vec<Option<String>>,
    inbox_run: Vec<Uuid>,
    inbox_id: Vec<i64>,
    l_run: Vec<Uuid>,
    l_action: Vec<String>,
    l_node: Vec<String>,
    l_step: Vec<i32>,
    l_key: Vec<String>,
    l_call: Vec<Option<String>>,
    l_status: Vec<String>,
    l_tool: Vec<Option<String>>,
    l_result: Vec<Option<Value>>,
    l_hash: Vec<Option<String>>,
    ck_run: Vec<Uuid>,
    ck_seq: Vec<i64>,
    ck_def: Vec<String>,
    ck_ver: Vec<i32>,
    ck_state: Vec<Json<&'a RunState>>,
    blob_run: Vec<Uuid>,
    blob_hash: Vec<String>,
    blob_content: Vec<Vec<u8>>,
    /// The blobs each run's commit stored or found (`rein_blob_refs`).
    ref_run: Vec<Uuid>,
    ref_hash: Vec<String>,
    c_run: Vec<Uuid>,
    c_parent: Vec<Uuid>,
    c_def: Vec<String>,
    c_ver: Vec<i32>,
    c_state: Vec<String>,
    c_status: Vec<String>,
    c_projection: Vec<Value>,
    c_input: Vec<Value>,
    c_branch: Vec<Value>,
    c_timer: Vec<Option<i64>>,
    c_deadline: Vec<Option<i64>>,
    c_protocol: Vec<i16>,
    defers: Vec<Option<i64>>,
    first_tries: Vec<bool>,
    cancels: Vec<bool>,
    x_branch: Vec<String>,
    x_parent: Vec<Uuid>,
    x_fan_out: Vec<i64>,
    new_seqs: Vec<i64>,
}

#[cfg(test)]
mod tests {
    use super::{CommitParts, assemble_commit};

    /// The CTE names of a statement, in order.
    fn ctes(sql: &str) -> Vec<String> {
        sql.lines()
            .filter_map(|l| {
                let l = l.strip_prefix("WITH RECURSIVE ").unwrap_or(l);
                let l = l.replace(" AS MATERIALIZED (", " AS (");
                let (name, _) = l.split_once(" AS (")?;
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_')
                    .then(|| name.to_owned())
            })
            .collect()
    }

    fn all() -> CommitParts {
        CommitParts {
            grants: true,
            consumed: true,
            inbox_due: true,
            ledger: true,
            approvals_used: true,
            ending: true,
            blobs: true,
            children: true,
            losers: true,
            descendants: true,
            checkpoints: true,
        }
    }

    #[test]
    fn every_part_of_the_commit_is_kept_when_a_batch_needs_it() {
        let file = include_str!("../queries/commit.sql");
        let full = assemble_commit(all());
        assert_eq!(ctes(&full), ctes(file));
        // Nothing but the part lines is left out, and the CTEs stay joined by commas.
        let without_marks: String = file
            .lines()
            .filter(|l| !l.starts_with("-- ["))
            .map(|l| format!("{l}\n"))
            .collect();
        let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(squash(&full), squash(&without_marks));
    }

    #[test]
    fn a_plain_step_is_sent_without_the_parts_it_does_not_reach() {
        let plain = assemble_commit(CommitParts::default());
        assert_eq!(
            ctes(&plain),
            ["req", "ev", "t", "moved", "stored", "locked", "upd", "ins"]
        );
        assert!(plain.contains("SELECT q.run_id,"), "{plain}");
        assert!(!plain.contains(",\n-- A refused"), "{plain}");
        let ending = assemble_commit(CommitParts {
            ending: true,
            ..Default::default()
        });
        assert_eq!(
            ctes(&ending)[8..],
            ["approvals_void", "branch_results"].map(String::from)
        );
        let cancelling = assemble_commit(CommitParts {
            descendants: true,
            ..Default::default()
        });
        assert_eq!(
            ctes(&cancelling)[8..],
            ["descendants", "doomed", "cancel_descendants"].map(String::from)
        );
    }
}
