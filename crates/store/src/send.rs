//! Runs and events from outside: enqueue (SPEC I3) and send (SPEC X3a).

use rein_core::{Definition, EngineEvent, Event, InvalidTransition, RejectReason, RunState, apply};
use serde_json::Value;
use sqlx::Row;
use uuid::Uuid;

use crate::commit::{
    CommitOutcome, CommitPlan, NewEvent, Writer, commit_on, jitter_from, plan_commit,
};
use crate::{Sender, Store, StoreError};

/// Longest client idempotency key accepted.
pub const CLIENT_KEY_LEN_MAX: usize = 256;
/// Largest run input accepted, in bytes.
pub const INPUT_BYTES_MAX: usize = 256 * 1024;
/// Most runs one enqueue call may create.
pub const ENQUEUE_BATCH_MAX: usize = 10_000;
/// How long an inbox entry waits for the lease holder before it is recorded as expired.
pub const INBOX_TTL_MS_DEFAULT: u64 = 24 * 3600 * 1000;

#[derive(Debug, Clone)]
pub struct EnqueueRequest {
    pub definition: Definition,
    /// The definition version the caller named; `None` when it asked for the current one.
    /// Part of the request a client key stands for, so a retry after the current version
    /// moved still finds the run the key made.
    pub version_asked: Option<u32>,
    pub input: Value,
    pub client_key: Option<ClientKey>,
    pub priority: i32,
    pub queue: String,
    pub parent_run_id: Option<Uuid>,
    /// The API token whose call creates the run (SPEC Z4): what its quotas count. `None`
    /// on the database route and for the engine's own runs.
    pub enqueued_token: Option<Uuid>,
    /// Who enqueues the run (an API token's subject, the CLI's `--as` name), recorded with
    /// it: an approval policy may refuse that person's grants on it.
    pub enqueued_by: Option<String>,
    /// The W3C `traceparent` of the caller (an API request's header): the run's root span
    /// links to it ([`crate::trace::RunRoot::traceparent`]).
    pub traceparent: Option<String>,
}

/// A client's idempotency key for an enqueue (SPEC I3, Z4), scoped to its caller: the same
/// key from another caller is another key, so keys can neither be squatted nor used to
/// learn another caller's run ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientKey {
    /// Who enqueues: an API token's subject (`api:SUBJECT`), or the CLI on the database.
    pub caller: String,
    pub key: String,
}

impl ClientKey {
    pub fn new(caller: impl Into<String>, key: impl Into<String>) -> ClientKey {
        ClientKey {
            caller: caller.into(),
            key: key.into(),
        }
    }
}

impl EnqueueRequest {
    pub fn new(definition: Definition, input: Value) -> EnqueueRequest {
        EnqueueRequest {
            version_asked: Some(definition.version()),
            definition,
            input,
            client_key: None,
            priority: 0,
            queue: "default".to_owned(),
            parent_run_id: None,
            enqueued_token: None,
            enqueued_by: None,
            traceparent: None,
        }
    }

    /// Sends the root span of the run this request created (SPEC O3).
    pub(crate) fn root_span(&self, done: &Enqueued) {
        if done.created {
            crate::trace::run_root_span(crate::trace::RunRoot {
                run_id: done.run_id,
                definition: self.definition.name(),
                queue: &self.queue,
                parent_run_id: self.parent_run_id,
                traceparent: self.traceparent.as_deref(),
            });
        }
    }

    fn check(&self) -> Result<(), StoreError> {
        let size = self.input.to_string().len();
        if size > INPUT_BYTES_MAX {
            return Err(StoreError::Invalid(format!(
                "run input is {size} bytes; the limit is {INPUT_BYTES_MAX}"
            )));
        }
        crate::input::check_data("input", &self.input)?;
        if let Some(key) = &self.client_key {
            check_client_key(&key.key)?;
            crate::input::check_text("caller", &key.caller)?;
            if key.caller.is_empty() || key.caller.len() > crate::SENDER_BYTES_MAX {
                return Err(StoreError::InvalidField {
                    field: "caller".into(),
                    reason: format!(
                        "the caller a key belongs to must be 1..={} bytes",
                        crate::SENDER_BYTES_MAX
                    ),
                });
            }
        }
        if let Some(by) = &self.enqueued_by {
            crate::input::check_text("enqueued_by", by)?;
            if by.trim().is_empty() || by.len() > crate::SENDER_BYTES_MAX {
                return Err(StoreError::InvalidField {
                    field: "enqueued_by".into(),
                    reason: format!(
                        "who enqueues a run must be named in 1..={} bytes",
                        crate::SENDER_BYTES_MAX
                    ),
                });
            }
        }
        crate::input::check_text("queue", &self.queue)?;
        if self.queue.is_empty() || self.queue.len() > rein_core::limits::NAME_LEN_MAX {
            return Err(StoreError::Invalid(
                "queue name must be 1 to 64 bytes".into(),
            ));
        }
        Ok(())
    }

    /// The hash of what a client key stands for: definition (and the version named),
    /// input, queue, priority and parent.
    fn body_hash(&self) -> String {
        let body = serde_json::json!({
            "definition": self.definition.name(),
            "version": self.version_asked,
            "input": self.input,
            "queue": self.queue,
            "priority": self.priority,
            "parent_run_id": self.parent_run_id,
        });
        rein_core::hash::sha256_hex(rein_core::hash::canonical_json(&body).as_bytes())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    pub run_id: Uuid,
    /// False when the client key named a run that already existed.
    pub created: bool,
}

/// What happened to an event sent from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    /// Committed at once at this sequence (no live lease was held).
    Applied { sequence: i64 },
    /// Queued in the run's inbox for the lease holder (or for a later state).
    Queued { inbox_id: i64 },
}

#[derive(Debug, Clone)]
pub struct InboxEntry {
    pub id: i64,
    pub event_id: Uuid,
    pub kind: String,
    pub payload: Value,
    pub sender: String,
    pub expired: bool,
}

impl Store {
    pub async fn enqueue(&self, request: EnqueueRequest) -> Result<Enqueued, StoreError> {
        let mut conn = self.pool().acquire().await?;
        let mut out = enqueue_on(&mut conn, std::slice::from_ref(&request)).await?;
        self.woke(Some(&request.queue));
        let done = out
            .pop()
            .ok_or_else(|| StoreError::Corrupt("enqueue returned no row".into()))?;
        request.root_span(&done);
        Ok(done)
    }

    /// Enqueues many runs in one statement.
    pub async fn enqueue_batch(
        &self,
        requests: &[EnqueueRequest],
    ) -> Result<Vec<Enqueued>, StoreError> {
        let mut conn = self.pool().acquire().await?;
        let out = enqueue_on(&mut conn, requests).await?;
        for (request, done) in requests.iter().zip(&out) {
            request.root_span(done);
        }
        let mut queues: Vec<&str> = requests.iter().map(|r| r.queue.as_str()).collect();
        queues.sort_unstable();
        queues.dedup();
        for q in queues {
            self.woke(Some(q));
        }
        Ok(out)
    }

    /// Enqueues inside the caller's transaction, atomically with its own business data.
    /// The run's root span is the caller's to send once the transaction commits
    /// ([`crate::trace::run_root_span`]).
    pub async fn enqueue_in(
        tx: &mut sqlx::PgConnection,
        request: EnqueueRequest,
    ) -> Result<Enqueued, StoreError> {
        let mut out = enqueue_on(tx, std::slice::from_ref(&request)).await?;
        out.pop()
            .ok_or_else(|| StoreError::Corrupt("enqueue returned no row".into()))
    }

    /// Delivers an event from outside (SPEC X3a). With no live lease on the run, the event is
    /// committed at once, taking the token; with a live lease, or when the run's current
    /// state cannot take it yet, it waits in the inbox. An event no reachable state could
    /// accept is refused, and so is one the sender may not send (SPEC Z3, [`Sender`]).
    pub async fn send(
        &self,
        run_id: Uuid,
        kind: &str,
        payload: Value,
        sender: &Sender,
        inbox_ttl_ms: u64,
    ) -> Result<SendOutcome, StoreError> {
        self.deliver(run_id, kind, payload, sender, None, inbox_ttl_ms)
            .await
    }

    /// [`Store::send`] made idempotent by the sender's `key` (SPEC E2): the event's id is a
    /// function of (run, sender, key), so sending it again returns what became of the first
    /// send (applied at its sequence, or still queued) instead of applying it twice. The same
    /// key with another event type or payload is refused ([`StoreError::KeyConflict`]).
    pub async fn send_once(
        &self,
        run_id: Uuid,
        kind: &str,
        payload: Value,
        sender: &Sender,
        key: &str,
        inbox_ttl_ms: u64,
    ) -> Result<SendOutcome, StoreError> {
        self.deliver(run_id, kind, payload, sender, Some(key), inbox_ttl_ms)
            .await
    }

    async fn deliver(
        &self,
        run_id: Uuid,
        kind: &str,
        payload: Value,
        sender: &Sender,
        key: Option<&str>,
        inbox_ttl_ms: u64,
    ) -> Result<SendOutcome, StoreError> {
        crate::input::check_text("type", kind)?;
        sender.check_name()?;
        if let Some(key) = key {
            check_client_key(key)?;
        }
        let size = payload.to_string().len();
        if size > rein_core::limits::EVENT_PAYLOAD_BYTES_MAX {
            return Err(StoreError::Invalid(format!(
                "event payload is {size} bytes; the limit is {}",
                rein_core::limits::EVENT_PAYLOAD_BYTES_MAX
            )));
        }
        crate::input::check_data("payload", &payload)?;
        if EngineEvent::is_engine_only(kind) {
            return Err(StoreError::Invalid(format!(
                "{kind} is delivered by the engine when a branch's run ends; it cannot be sent"
            )));
        }
        if EngineEvent::is_operation_only(kind) {
            return Err(StoreError::Invalid(format!(
                "{kind} is written by `rein definitions migrate` or `rein fork`; it cannot be sent"
            )));
        }
        if kind == EngineEvent::ActionDeferred.as_str() {
            return Err(StoreError::Invalid(format!(
                "{kind} is written by the worker a fleet-wide limit holds back; it cannot be sent"
            )));
        }
        let event_id = match key {
            Some(key) => sent_event_id(run_id, sender.name(), key),
            None => Uuid::now_v7(),
        };
        let mut tx = self.pool().begin().await?;
        let outcome = self
            .send_on(
                &mut tx,
                run_id,
                Outgoing {
                    kind,
                    payload,
                    event_id,
                    key,
                },
                sender,
                inbox_ttl_ms,
            )
            .await?;
        tx.commit().await?;
        if matches!(outcome, SendOutcome::Applied { .. }) {
            self.woke(None);
        }
        Ok(outcome)
    }

    /// Delivers the wall-time budget event of a run whose deadline passed by the database
    /// clock (the scheduler's job), at most once: the deadline is cleared in the same
    /// transaction. `Ok(false)` when another scheduler got there first or the run has no
    /// deadline due.
    pub async fn fire_deadline(&self, run_id: Uuid, sender: &str) -> Result<bool, StoreError> {
        let mut tx = self.pool().begin().await?;
        let due: Option<(String, i32)> = sqlx::query_as(
            "UPDATE rein_runs SET deadline_at = NULL
             WHERE run_id = $1 AND deadline_at <= clock_timestamp() AND status <> 'terminal'
             RETURNING definition, version",
        )
        .bind(run_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((definition, version)) = due else {
            return Ok(false);
        };
        let def = self
            .load_definition_on(&mut tx, &definition, version as u32)
            .await?;
        let Some(budget) = def.budget() else {
            tx.commit().await?;
            return Ok(false);
        };
        let payload = rein_core::budget::wall_time_payload(budget.wall_time_ms.unwrap_or(0));
        match self
            .send_on(
                &mut tx,
                run_id,
                Outgoing {
                    kind: &budget.event,
                    payload,
                    event_id: Uuid::now_v7(),
                    key: None,
                },
                &Sender::Engine(sender.to_owned()),
                INBOX_TTL_MS_DEFAULT,
            )
            .await
        {
            Ok(_) => {}
            // No state the run can still reach takes the event: the deadline is spent.
            Err(StoreError::InvalidTransition(e)) => {
                tracing::warn!(%run_id, reason = %e, "wall-time budget event cannot be applied");
            }
            Err(e) => return Err(e),
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Delivers `event` under the run's row lock.
    async fn send_on(
        &self,
        tx: &mut sqlx::PgConnection,
        run_id: Uuid,
        event: Outgoing<'_>,
        sender: &Sender,
        inbox_ttl_ms: u64,
    ) -> Result<SendOutcome, StoreError> {
        let Outgoing {
            kind,
            payload,
            event_id,
            key,
        } = event;
        let row = sqlx::query(
            "SELECT definition, version, projection, fencing_token, enqueued_by,
                    COALESCE(lease_until > clock_timestamp(), false) AS lease_live
             FROM rein_runs WHERE run_id = $1 FOR UPDATE",
        )
        .bind(run_id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::RunNotFound(run_id))?;
        let definition: String = row.try_get("definition")?;
        let version: i32 = row.try_get("version")?;
        let state: RunState = serde_json::from_value(row.try_get("projection")?)
            .map_err(|e| StoreError::Corrupt(format!("projection: {e}")))?;
        let token: i64 = row.try_get("fencing_token")?;
        let lease_live: bool = row.try_get("lease_live")?;
        let enqueued_by: Option<String> = row.try_get("enqueued_by")?;
        let def = self
            .load_definition_on(&mut *tx, &definition, version as u32)
            .await?;
        let payload = sender.recorded_payload(&def, kind, payload);
        // The run's row lock orders sends with the same key: a repeat sees the first.
        if let Some(key) = key
            && let Some(first) = sent_before(tx, run_id, (event_id, key), kind, &payload).await?
        {
            return Ok(first);
        }

        let refuse = |reason| {
            let refused = InvalidTransition {
                state: state.state.clone(),
                event: kind.to_owned(),
                sequence: state.sequence + 1,
                reason,
            };
            crate::metrics::transition_refused(def.name(), run_id, &refused, sender.name());
            StoreError::InvalidTransition(refused)
        };
        if !def.has_event(kind) && !EngineEvent::is_reserved(kind) {
            return Err(refuse(RejectReason::UnknownEvent));
        }
        sender.may_send(&def, &state, kind, &payload)?;
        if def.is_approval_grant(kind)
            && let Some(person) = sender.person()
        {
            self.check_separation(&def, run_id, enqueued_by.as_deref(), person)?;
        }
        if !def.could_ever_accept(&state.state, kind) {
            let reason = if def.is_terminal(&state.state) {
                RejectReason::Terminal
            } else {
                RejectReason::NotInTable
            };
            return Err(refuse(reason));
        }
        let event = NewEvent {
            event_id,
            kind: kind.to_owned(),
            payload: payload.clone(),
            node: None,
            sender: sender.recorded().map(str::to_owned),
        };
        let acceptable_now = apply(
            &def,
            &state,
            &Event::new(state.sequence + 1, kind, payload.clone()),
        )
        .is_ok();
        if !lease_live && acceptable_now {
            let plan = CommitPlan {
                writer: Writer::TakeToken,
                release: false,
                jitter_sample: jitter_from(event.event_id),
            };
            let request = plan_commit(&def, run_id, token, &state, vec![event], Vec::new(), plan)?;
            let outcome = commit_on(
                tx,
                &self.definitions,
                sender.name(),
                std::slice::from_ref(&request),
                self.tree_bounds(),
            )
            .await?;
            return match outcome.into_iter().next() {
                Some(CommitOutcome::Committed(c)) => Ok(SendOutcome::Applied {
                    sequence: c.sequence,
                }),
                other => Err(StoreError::Corrupt(format!(
                    "commit under the row lock did not apply: {other:?}"
                ))),
            };
        }
        let inbox_id: i64 = sqlx::query_scalar(
            "INSERT INTO rein_inbox (run_id, event_id, type, payload, sender, expires_at)
             VALUES ($1, $2, $3, $4, $5, now() + $6 * interval '1 millisecond') RETURNING id",
        )
        .bind(run_id)
        .bind(event.event_id)
        .bind(kind)
        .bind(&payload)
        .bind(sender.name())
        .bind(inbox_ttl_ms as i64)
        .fetch_one(&mut *tx)
        .await?;
        Ok(SendOutcome::Queued { inbox_id })
    }

    /// The run's inbox, oldest first; `expired` by the database clock.
    pub async fn inbox(&self, run_id: Uuid) -> Result<Vec<InboxEntry>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {INBOX_COLUMNS} FROM rein_inbox WHERE run_id = $1 ORDER BY id LIMIT {INBOX_READ_MAX}"
        )))
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(InboxEntry::from_row).collect()
    }
}

/// Most inbox entries one read returns (the oldest).
pub const INBOX_READ_MAX: i64 = 100;

pub(crate) const INBOX_COLUMNS: &str =
    "id, event_id, type, payload, sender, expires_at <= clock_timestamp() AS expired";

impl InboxEntry {
    pub(crate) fn from_row(row: &sqlx::postgres::PgRow) -> Result<InboxEntry, StoreError> {
        Ok(InboxEntry {
            id: row.try_get("id")?,
            event_id: row.try_get("event_id")?,
            kind: row.try_get("type")?,
            payload: row.try_get("payload")?,
            sender: row.try_get("sender")?,
            expired: row.try_get("expired")?,
        })
    }
}

/// One event on its way into a run.
struct Outgoing<'a> {
    kind: &'a str,
    payload: Value,
    event_id: Uuid,
    /// The sender's idempotency key the id was made from: this very event may be stored
    /// already.
    key: Option<&'a str>,
}

/// The id of the event `sender` sends to `run_id` with idempotency key `key`: the same for
/// every repeat (a UUID of version 8 from SHA-256; E2 makes the stored event unique by it).
pub fn sent_event_id(run_id: Uuid, sender: &str, key: &str) -> Uuid {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    for part in [run_id.to_string().as_str(), sender, key] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// What became of an event sent before with the same id: in the log (applied) or still in
/// the inbox (queued). The same id with another type or payload is a reused key.
async fn sent_before(
    tx: &mut sqlx::PgConnection,
    run_id: Uuid,
    (event_id, key): (Uuid, &str),
    kind: &str,
    payload: &Value,
) -> Result<Option<SendOutcome>, StoreError> {
    let found: Option<(String, Value, i64, bool)> = sqlx::query_as(
        "SELECT type, payload, sequence, true FROM rein_events_all
         WHERE run_id = $1 AND event_id = $2
         UNION ALL
         SELECT type, payload, id, false FROM rein_inbox WHERE run_id = $1 AND event_id = $2
         LIMIT 1",
    )
    .bind(run_id)
    .bind(event_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((stored_kind, stored_payload, at, applied)) = found else {
        return Ok(None);
    };
    if stored_kind != kind {
        return Err(StoreError::KeyConflict {
            key: key.to_owned(),
            what: format!("event ({stored_kind})"),
        });
    }
    if &stored_payload != payload {
        return Err(StoreError::KeyConflict {
            key: key.to_owned(),
            what: "payload".to_owned(),
        });
    }
    Ok(Some(if applied {
        SendOutcome::Applied { sequence: at }
    } else {
        SendOutcome::Queued { inbox_id: at }
    }))
}

fn check_client_key(key: &str) -> Result<(), StoreError> {
    crate::input::check_text("idempotency_key", key)?;
    if key.is_empty() || key.len() > CLIENT_KEY_LEN_MAX {
        return Err(StoreError::InvalidField {
            field: "idempotency_key".into(),
            reason: format!("an idempotency key must be 1 to {CLIENT_KEY_LEN_MAX} bytes"),
        });
    }
    Ok(())
}

/// Which inbox entries the run accepts now, in order, and which expired ones to record as
/// INBOX_EXPIRED; entries neither accepted nor expired stay for a later state. Pure.
pub fn plan_inbox(
    def: &Definition,
    state: &RunState,
    entries: Vec<InboxEntry>,
) -> (Vec<NewEvent>, Vec<i64>) {
    let mut state = state.clone();
    let mut events = Vec::new();
    let mut consumed = Vec::new();
    for entry in entries {
        let as_sent = NewEvent {
            event_id: entry.event_id,
            kind: entry.kind.clone(),
            payload: entry.payload.clone(),
            node: None,
            sender: Some(entry.sender.clone()),
        };
        let record = match apply(def, &state, &as_event(&state, &as_sent)) {
            Ok(next) => {
                state = next;
                events.push(as_sent);
                consumed.push(entry.id);
                continue;
            }
            // A branch result the run can no longer take (its join fired): recorded as
            // rejected, never applied (SPEC P1).
            Err(rejection) if EngineEvent::is_engine_only(&entry.kind) => NewEvent {
                event_id: entry.event_id,
                kind: EngineEvent::BranchRejected.as_str().to_owned(),
                payload: serde_json::json!({
                    "event": entry.kind,
                    "branch": entry.payload.get("branch"),
                    "fan_out": entry.payload.get("fan_out"),
                    "child_run_id": entry.payload.get("child_run_id"),
                    "reason": rejection.reason.to_string(),
                }),
                node: None,
                sender: Some(entry.sender.clone()),
            },
            Err(_) if entry.expired => NewEvent::new(
                EngineEvent::InboxExpired.as_str(),
                serde_json::json!({ "event": entry.kind, "sender": entry.sender,
                                    "reason": "expired before the run could accept it" }),
            ),
            Err(_) => continue,
        };
        if let Ok(next) = apply(def, &state, &as_event(&state, &record)) {
            state = next;
            events.push(record);
            consumed.push(entry.id);
        }
    }
    (events, consumed)
}

/// `event` as the next event of `state`.
fn as_event(state: &RunState, event: &NewEvent) -> Event {
    Event::new(
        state.sequence + 1,
        event.kind.clone(),
        event.payload.clone(),
    )
}

pub(crate) async fn enqueue_on(
    conn: &mut sqlx::PgConnection,
    requests: &[EnqueueRequest],
) -> Result<Vec<Enqueued>, StoreError> {
    if requests.len() > ENQUEUE_BATCH_MAX {
        return Err(StoreError::Invalid(format!(
            "{} runs in one enqueue; the limit is {ENQUEUE_BATCH_MAX}",
            requests.len()
        )));
    }
    let mut keys = std::collections::HashSet::new();
    for r in requests {
        r.check()?;
        if let Some(k) = &r.client_key
            && !keys.insert((&k.caller, &k.key))
        {
            return Err(StoreError::Invalid(format!(
                "idempotency key `{}` appears twice in one batch",
                k.key
            )));
        }
    }
    // A reused key with another body refuses the whole call: nothing it wrote may stay.
    if keys.is_empty() {
        return enqueue_rows(conn, requests).await;
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let out = enqueue_rows(&mut tx, requests).await?;
    tx.commit().await?;
    Ok(out)
}

async fn enqueue_rows(
    conn: &mut sqlx::PgConnection,
    requests: &[EnqueueRequest],
) -> Result<Vec<Enqueued>, StoreError> {
    let mut ids = Vec::new();
    let mut defs = Vec::new();
    let mut versions = Vec::new();
    let mut states = Vec::new();
    let mut statuses = Vec::new();
    let mut projections = Vec::new();
    let mut inputs = Vec::new();
    let mut priorities = Vec::new();
    let mut queues = Vec::new();
    let mut parents = Vec::new();
    let mut client_keys = Vec::new();
    let mut callers = Vec::new();
    let mut body_hashes = Vec::new();
    let mut enqueuers = Vec::new();
    let mut timers: Vec<Option<i64>> = Vec::new();
    let mut deadlines: Vec<Option<i64>> = Vec::new();
    let mut tokens = Vec::new();
    let mut protocols = Vec::new();
    for r in requests {
        tokens.push(r.enqueued_token);
        protocols.push(crate::definition_protocol(&r.definition));
        deadlines.push(
            r.definition
                .budget()
                .and_then(|b| b.wall_time_ms)
                .map(|ms| ms as i64),
        );
        let state = RunState::initial(&r.definition, r.input.clone());
        // An initial waiting state's deadline starts now.
        timers.push(
            rein_core::timer::next_timer(&r.definition, &state, 0.5).map(|t| t.after_ms as i64),
        );
        ids.push(Uuid::now_v7());
        defs.push(r.definition.name().to_owned());
        versions.push(r.definition.version() as i32);
        statuses.push(state.status(&r.definition).as_str().to_owned());
        states.push(state.state.clone());
        projections
            .push(serde_json::to_value(&state).map_err(|e| StoreError::Corrupt(e.to_string()))?);
        inputs.push(r.input.clone());
        priorities.push(r.priority);
        queues.push(r.queue.clone());
        parents.push(r.parent_run_id);
        client_keys.push(r.client_key.as_ref().map(|k| k.key.clone()));
        callers.push(r.client_key.as_ref().map(|k| k.caller.clone()));
        body_hashes.push(r.client_key.as_ref().map(|_| r.body_hash()));
        enqueuers.push(r.enqueued_by.clone());
    }
    let rows = sqlx::query(include_str!("../queries/enqueue.sql"))
        .bind(&ids)
        .bind(&defs)
        .bind(&versions)
        .bind(&states)
        .bind(&statuses)
        .bind(&projections)
        .bind(&inputs)
        .bind(&priorities)
        .bind(&queues)
        .bind(&parents)
        .bind(&client_keys)
        .bind(&timers)
        .bind(&deadlines)
        .bind(&callers)
        .bind(&body_hashes)
        .bind(&tokens)
        .bind(&enqueuers)
        .bind(&protocols)
        .fetch_all(&mut *conn)
        .await?;
    let mut out = Vec::with_capacity(rows.len());
    for ((row, r), hash) in rows.iter().zip(requests).zip(&body_hashes) {
        let run_id: Option<Uuid> = row.try_get("run_id")?;
        let mut stored_hash: Option<String> = row.try_get("body_hash")?;
        let run_id = match (run_id, &r.client_key) {
            (Some(id), _) => id,
            // A concurrent enqueue with the same key committed after this statement's
            // snapshot was taken; a new statement sees it.
            (None, Some(key)) => {
                let (id, hash): (Uuid, Option<String>) = sqlx::query_as(
                    "SELECT run_id, body_hash FROM rein_enqueue_keys
                     WHERE client_key = $1 AND (caller = $2 OR caller IS NULL)",
                )
                .bind(&key.key)
                .bind(&key.caller)
                .fetch_one(&mut *conn)
                .await?;
                stored_hash = hash;
                id
            }
            (None, None) => return Err(StoreError::Corrupt("enqueue returned no run id".into())),
        };
        let created: bool = row.try_get("created")?;
        // A key stored before keys kept their body's hash stands for any body.
        if let (false, Some(key), Some(stored)) = (created, &r.client_key, &stored_hash)
            && Some(stored) != hash.as_ref()
        {
            return Err(StoreError::KeyConflict {
                key: key.key.clone(),
                what: "request (definition, version, input, queue or priority)".to_owned(),
            });
        }
        out.push(Enqueued { run_id, created });
    }
    Ok(out)
}
