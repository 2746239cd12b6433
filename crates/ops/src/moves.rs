//! Changing runs in flight (SPEC V1, E6): moving the runs of one definition version to
//! another (`rein definitions migrate`, `POST /v1/definitions/{name}/migrate`) and forking a
//! run from a sequence of its log (`rein fork`, `POST /v1/runs/{id}/fork`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rein_core::checkpoint::Migrations;
use rein_core::migration::{Unmovable, fork_snapshot, plan};
use rein_core::replay_cost::Cancel;
use rein_core::{Definition, RunState};
use rein_store::{EnqueueRequest, MIGRATION_PAGE_MAX, Moved, Store, StoreError, TokenInfo};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::error::{Code, Error};
use crate::recovery::{Replayed, replay_budget};

/// Most runs one migration moves (or lists in a dry run).
pub const MIGRATE_RUNS_MAX: usize = 100_000;
/// Most run ids a migration may be limited to.
pub const MIGRATE_RUN_IDS_MAX: usize = 10_000;
pub use rein_core::limits::{MIGRATE_WAIT_S_MAX, MOVE_REASON_BYTES_MAX as REASON_BYTES_MAX};

/// What to move.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrateBody {
    /// The version whose runs move.
    #[serde(default, deserialize_with = "crate::schema::integral")]
    #[schema(value_type = crate::schema::Version, required = true)]
    pub from: Option<u32>,
    /// The version they move to; it (or the versions between) declares `[migration]`.
    #[serde(default, deserialize_with = "crate::schema::integral")]
    #[schema(value_type = crate::schema::Version, required = true)]
    pub to: Option<u32>,
    /// Only list what would move and what would not, and why.
    #[serde(default)]
    pub dry_run: bool,
    /// Only these runs (at most 10,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runs: Option<Vec<Uuid>>,
    /// How long to wait for runs a worker holds or that are between a call and its result
    /// (default 0: report them as `busy`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::schema::integral"
    )]
    #[schema(value_type = Option<crate::schema::WaitSeconds>)]
    pub wait_s: Option<u64>,
    /// Why, recorded with every move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::schema::Reason>)]
    pub reason: Option<String>,
}

/// One run's fate in a migration.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct MigratedRun {
    pub run_id: Uuid,
    /// Its state on the old version.
    pub from_state: String,
    /// Its state on the new one, when it moves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_state: Option<String>,
    /// `moved`, `would_move` (dry run), `not_migratable` or `busy` (held by a worker or in
    /// the middle of a call past the wait).
    pub outcome: String,
    /// Why it did not move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// The sequence of its DEFINITION_MIGRATED event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<i64>,
}

/// The result of a migration or its dry run.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct MigrateResponse {
    /// Live workers of a release that reads no moved run's log (they predate engine
    /// protocols): a migration is refused while any is at work; a dry run names them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub old_workers: Vec<String>,
    pub definition: String,
    pub from: u32,
    pub to: u32,
    pub dry_run: bool,
    pub moved: usize,
    pub would_move: usize,
    pub not_migratable: usize,
    pub busy: usize,
    pub runs: Vec<MigratedRun>,
}

fn check_reason(reason: Option<&str>) -> Result<(), Error> {
    match reason {
        Some(r) if r.len() > REASON_BYTES_MAX => Err(Error::validation(format!(
            "reason is {} bytes; the limit is {REASON_BYTES_MAX}",
            r.len()
        ))
        .with_details(json!({ "field": "reason" }))),
        Some(r) => Ok(rein_store::input::check_text("reason", r)?),
        None => Ok(()),
    }
}

/// The migrations from `from` to `to` of `name`: every registered version's `[migration]`,
/// plus `extra` (closures registered by a program embedding Rein).
async fn migrations_of(
    store: &Store,
    name: &str,
    from: u32,
    to: u32,
    extra: &Migrations,
) -> Result<Migrations, Error> {
    let mut all = extra.clone();
    for v in from.min(to) + 1..=from.max(to) {
        match store.load_definition(name, Some(v)).await {
            Ok(def) => {
                // A closure the embedding program registered for the same step wins.
                let declared_from = def.spec().migration.as_ref().map(|m| m.from);
                if declared_from.is_some_and(|from| !extra.has_step(name, from)) {
                    rein_core::migration::declare(&mut all, &def);
                }
            }
            Err(StoreError::UnknownDefinition { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(all)
}

/// Moves (or with `dry_run` lists) the unfinished runs of `name`@`from` to `to` with the
/// migrations the versions declare and `extra`. A run a worker holds, or one between a call
/// and its result, is retried until `wait_s` has passed; `progress` hears of each run.
pub async fn migrate(
    store: &Store,
    name: &str,
    body: &MigrateBody,
    by: &str,
    extra: &Migrations,
    progress: &(dyn Fn(&MigratedRun) + Sync),
) -> Result<MigrateResponse, Error> {
    crate::service::name("definition", Some(name.to_owned()))?;
    check_reason(body.reason.as_deref())?;
    let version = |what: &str, v: Option<u32>| match v {
        Some(v) if (1..=rein_core::limits::VERSION_MAX).contains(&v) => Ok(v),
        Some(v) => Err(Error::validation(format!(
            "{what} is {v}; a version is 1..={}",
            rein_core::limits::VERSION_MAX
        ))
        .with_details(json!({ "field": what }))),
        None => Err(Error::validation(format!("name the version `{what}`"))
            .with_details(json!({ "field": what }))),
    };
    let (from, to) = (version("from", body.from)?, version("to", body.to)?);
    let wait_s = body.wait_s.unwrap_or(0);
    if wait_s > MIGRATE_WAIT_S_MAX {
        return Err(Error::validation(format!(
            "wait_s is {wait_s}; the limit is {MIGRATE_WAIT_S_MAX}"
        ))
        .with_details(json!({ "field": "wait_s" })));
    }
    if let Some(runs) = &body.runs
        && runs.len() > MIGRATE_RUN_IDS_MAX
    {
        return Err(Error::validation(format!(
            "{} run ids; the limit is {MIGRATE_RUN_IDS_MAX}",
            runs.len()
        )));
    }
    if from == to {
        return Err(Error::conflict(format!(
            "from and to are the same version (v{from}): nothing to move"
        )));
    }
    if to < from {
        return Err(Error::conflict(format!(
            "a migration moves runs to a newer version; v{to} is older than v{from}"
        )));
    }
    store.load_definition(name, Some(from)).await?;
    let to_def = store.load_definition(name, Some(to)).await?;
    let old_workers = old_workers(store).await?;
    if !body.dry_run && !old_workers.is_empty() {
        return Err(Error::conflict(format!(
            "{} live worker(s) of an older release ({}) could claim moved runs without reading \
             their logs; upgrade them first (`rein workers` shows each one's protocol)",
            old_workers.len(),
            old_workers.join(", ")
        )));
    }
    let migrations = migrations_of(store, name, from, to, extra).await?;
    let deadline = Instant::now() + Duration::from_secs(wait_s);
    let mut runs: Vec<MigratedRun> = Vec::new();
    let mut after = None;
    let mut waiting: Vec<Uuid> = Vec::new();
    loop {
        let page = store
            .migration_candidates(name, from, body.runs.as_deref(), after, MIGRATION_PAGE_MAX)
            .await?;
        let Some(last) = page.last() else { break };
        after = Some(last.run_id);
        for candidate in page {
            if runs.len() >= MIGRATE_RUNS_MAX {
                break;
            }
            let fate = move_one(store, &to_def, &migrations, &candidate, body, by).await?;
            if fate.outcome == "busy" && wait_s > 0 {
                waiting.push(candidate.run_id);
                continue;
            }
            progress(&fate);
            runs.push(fate);
        }
    }
    // Runs held by a worker or in a call: again, until they move or the wait is over.
    while !waiting.is_empty() {
        let retry_all = Instant::now() >= deadline;
        let page = store
            .migration_candidates(name, from, Some(&waiting), None, MIGRATION_PAGE_MAX)
            .await?;
        let mut still = Vec::new();
        for candidate in page {
            let fate = move_one(store, &to_def, &migrations, &candidate, body, by).await?;
            if fate.outcome == "busy" && !retry_all {
                still.push(candidate.run_id);
                continue;
            }
            progress(&fate);
            runs.push(fate);
        }
        // A waiting run that finished or moved meanwhile is no longer a candidate.
        waiting = still;
        if retry_all {
            break;
        }
        if !waiting.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let count = |what: &str| runs.iter().filter(|r| r.outcome == what).count();
    Ok(MigrateResponse {
        old_workers,
        definition: name.to_owned(),
        from,
        to,
        dry_run: body.dry_run,
        moved: count("moved"),
        would_move: count("would_move"),
        not_migratable: count("not_migratable"),
        busy: count("busy"),
        runs,
    })
}

/// Live workers that read no protocol newer than 1 (they predate `rein_runs.protocol`, so
/// their claims do not filter on it either).
async fn old_workers(store: &Store) -> Result<Vec<String>, Error> {
    Ok(store
        .members()
        .await?
        .into_iter()
        .filter(|m| m.role == "worker")
        .filter(|m| {
            m.info["protocol"]
                .as_i64()
                .is_none_or(|p| p < i64::from(rein_store::PROTOCOL_MOVES))
        })
        .map(|m| m.worker_id)
        .collect())
}

async fn move_one(
    store: &Store,
    to: &rein_core::Definition,
    migrations: &Migrations,
    candidate: &rein_store::MigrationCandidate,
    body: &MigrateBody,
    by: &str,
) -> Result<MigratedRun, Error> {
    let mut fate = MigratedRun {
        run_id: candidate.run_id,
        from_state: candidate.state.state.clone(),
        to_state: None,
        outcome: String::new(),
        why: None,
        sequence: None,
    };
    let planned = match plan(to, migrations, &candidate.state) {
        Ok(p) => p,
        Err(why) => {
            fate.outcome = if why.later() {
                "busy"
            } else {
                "not_migratable"
            }
            .into();
            fate.why = Some(why.to_string());
            return Ok(fate);
        }
    };
    fate.to_state = Some(planned.to_state.clone());
    if body.dry_run {
        fate.outcome = "would_move".into();
        if candidate.lease_live {
            fate.why = Some("a worker holds it now; it moves once the worker lets go".into());
        }
        return Ok(fate);
    }
    let payload = planned.payload(by, body.reason.as_deref());
    match store.commit_migration(candidate, to, payload, by).await {
        Ok(Moved::Committed { sequence }) => {
            fate.outcome = "moved".into();
            fate.sequence = Some(sequence);
        }
        Ok(Moved::Busy { why }) => {
            fate.outcome = "busy".into();
            fate.why = Some(why);
        }
        Err(StoreError::InvalidTransition(e)) => {
            fate.outcome = "not_migratable".into();
            fate.why = Some(e.to_string());
        }
        Err(e) => return Err(e.into()),
    }
    Ok(fate)
}

/// A fork (SPEC E6).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// The sequence of the source's log the fork starts after (its state there).
    #[serde(default, deserialize_with = "crate::schema::integral")]
    #[schema(value_type = crate::schema::EventSequence, required = true)]
    pub at: Option<i64>,
    /// Another version of the source's definition to continue on (default: the version the
    /// source was on at that sequence).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::schema::integral"
    )]
    #[schema(value_type = Option<crate::schema::Version>)]
    pub version: Option<u32>,
    /// Merged into the fork's business data key by key (`null` removes a key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::schema::JsonObject>)]
    pub input_patch: Option<Value>,
    /// Why, recorded in the fork's first event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::schema::Reason>)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ForkResponse {
    /// The new run.
    pub run_id: Uuid,
    /// The run it was forked from (unchanged).
    pub forked_from: Uuid,
    /// The source's sequence the fork starts after.
    pub at_sequence: i64,
    pub definition: String,
    pub version: u32,
    /// The control state the fork starts in.
    pub state: String,
}

/// Forks `source` at `body.at` as `by`; the new run is created within `token`'s bounds. The
/// source's log is replayed up to there on the calling thread, whatever it costs (`rein
/// fork`); the API checks [`fork_budget`] first and replays with [`ForkReplay`] on threads
/// of its own.
pub async fn fork(
    store: &Store,
    source: Uuid,
    body: &ForkBody,
    by: &str,
    token: Option<&TokenInfo>,
) -> Result<ForkResponse, Error> {
    let at_sequence = fork_checked(body)?;
    let replay = ForkReplay::load(store, source, at_sequence).await?;
    let at = replay
        .replay(&Cancel::new())?
        .ok_or_else(|| Error::new(Code::Internal, "the fork's replay was cancelled".to_owned()))?;
    fork_at(store, at, body, by, token).await
}

/// The sequence a fork starts after, once `body` is found valid (before anything is read).
pub fn fork_checked(body: &ForkBody) -> Result<i64, Error> {
    check_reason(body.reason.as_deref())?;
    if let Some(patch) = &body.input_patch {
        if !patch.is_object() {
            return Err(Error::validation("input_patch must be a JSON object"));
        }
        let size = patch.to_string().len();
        if size > rein_store::INPUT_BYTES_MAX {
            return Err(Error::validation(format!(
                "input_patch is {size} bytes; the limit is {}",
                rein_store::INPUT_BYTES_MAX
            )));
        }
        rein_store::input::check_data("input_patch", patch)?;
    }
    let at_sequence = match body.at {
        Some(at) if at >= 1 => at,
        _ => {
            return Err(Error::validation(
                "at must name a sequence of the source's log (1 or more)",
            )
            .with_details(json!({ "field": "at" })));
        }
    };
    if let Some(v) = body.version
        && !(1..=rein_core::limits::VERSION_MAX).contains(&v)
    {
        return Err(Error::validation(format!(
            "version is {v}; a version is 1..={}",
            rein_core::limits::VERSION_MAX
        ))
        .with_details(json!({ "field": "version" })));
    }
    Ok(at_sequence)
}

/// A sequence past the log names no event yet: the run is there, its log is not that long
/// (a conflict with its state, not a missing resource).
fn check_sequence(row: &rein_store::RunRow, at_sequence: i64) -> Result<(), Error> {
    if at_sequence > row.last_sequence {
        return Err(Error::conflict(format!(
            "run {} has events 1..={}; sequence {at_sequence} is not one of them",
            row.run_id, row.last_sequence
        ))
        .with_details(json!({ "field": "at" })));
    }
    Ok(())
}

/// [`replay_budget`] of forking `source` at `at_sequence`, from its row alone (before its
/// log is read): the events up to there on the version the run is on now.
pub async fn fork_budget(store: &Store, source: Uuid, at_sequence: i64) -> Result<u64, Error> {
    let row = store.run(source).await?;
    check_sequence(&row, at_sequence)?;
    let def = store
        .load_definition(&row.definition, Some(row.version))
        .await?;
    replay_budget(Replayed::Fork, source, at_sequence.max(0) as u64, &[&def])
}

/// A fork's replay of its source's log up to the fork's sequence, read from the store and
/// ready to run: the replay itself touches nothing but memory, so it can run wherever its
/// caller likes (SPEC E3).
pub struct ForkReplay {
    row: rein_store::RunRow,
    at_sequence: i64,
    input: Value,
    /// The source's events up to `at_sequence`.
    events: Vec<rein_core::Event>,
    /// Every version those events ran on, and the run's current one, by number.
    versions: BTreeMap<u32, Definition>,
}

/// Where a fork starts: the source's state right after its sequence, and what the new run
/// takes from the source.
pub struct ForkAt {
    row: rein_store::RunRow,
    at_sequence: i64,
    input: Value,
    state: RunState,
}

impl ForkReplay {
    /// Reads `source`'s events up to `at_sequence`, its input and the versions they ran on.
    pub async fn load(store: &Store, source: Uuid, at_sequence: i64) -> Result<ForkReplay, Error> {
        let row = store.run(source).await?;
        check_sequence(&row, at_sequence)?;
        let events: Vec<rein_core::Event> = store
            .history(source)
            .await?
            .iter()
            .filter(|e| e.sequence <= at_sequence)
            .map(rein_store::StoredEvent::as_event)
            .collect();
        let versions = store
            .log_definitions(&row.definition, row.version, &events)
            .await?;
        let input = store.run_input(source).await?;
        Ok(ForkReplay {
            row,
            at_sequence,
            input,
            events,
            versions,
        })
    }

    /// [`replay_budget`] of this replay, now that the versions its events ran on are known:
    /// its events on the costliest of them.
    pub fn budget(&self) -> Result<u64, Error> {
        let costliest: Vec<&Definition> = self
            .versions
            .values()
            .max_by_key(|d| rein_core::replay_cost::guard_steps_bound(d))
            .into_iter()
            .collect();
        replay_budget(
            Replayed::Fork,
            self.row.run_id,
            self.events.len() as u64,
            &costliest,
        )
    }

    /// The source's state right after the fork's sequence, or `None` when `cancel` was set
    /// before the replay ended.
    pub fn replay(self, cancel: &Cancel) -> Result<Option<ForkAt>, Error> {
        let first = rein_core::migration::first_version(self.row.version, self.events.iter());
        let def = self.versions.get(&first).ok_or_else(|| {
            Error::from(StoreError::Corrupt(format!("version {first} not loaded")))
        })?;
        let def_of = |v: u32| self.versions.get(&v);
        let (state, _) = rein_core::checkpoint::replay_judging_across(
            &def_of,
            RunState::initial(def, self.input.clone()),
            cancel.until_cancelled(self.events.iter()),
            &[],
        )
        .map_err(|(i, e)| {
            Error::from(StoreError::Corrupt(format!(
                "event {} does not replay: {e}",
                i + 1
            )))
        })?;
        if cancel.is_cancelled() {
            return Ok(None);
        }
        Ok(Some(ForkAt {
            row: self.row,
            at_sequence: self.at_sequence,
            input: self.input,
            state,
        }))
    }
}

/// Creates the fork of `at` (the rest of [`fork`], after the replay) as `by`, within
/// `token`'s bounds.
pub async fn fork_at(
    store: &Store,
    at: ForkAt,
    body: &ForkBody,
    by: &str,
    token: Option<&TokenInfo>,
) -> Result<ForkResponse, Error> {
    let ForkAt {
        row,
        at_sequence,
        input,
        state,
    } = at;
    let source = row.run_id;
    let version = body.version.unwrap_or(state.version);
    let to = store
        .load_definition(&row.definition, Some(version))
        .await?;
    let migrations = if version > state.version {
        migrations_of(
            store,
            &row.definition,
            state.version,
            version,
            &Migrations::new(),
        )
        .await?
    } else {
        Migrations::new()
    };
    let snapshot = fork_snapshot(&state, &to, &migrations, body.input_patch.as_ref()).map_err(
        |why| match why {
            Unmovable::Refused(m) => Error::conflict(format!("cannot fork there: {m}")),
            other => Error::conflict(format!(
                "cannot fork at sequence {at_sequence}: {other}; pick a sequence between steps"
            )),
        },
    )?;
    let old = old_workers(store).await?;
    if !old.is_empty() {
        return Err(Error::conflict(format!(
            "{} live worker(s) of an older release ({}) could claim the fork without reading \
             its log; upgrade them first (`rein workers` shows each one's protocol)",
            old.len(),
            old.join(", ")
        )));
    }
    // The fork is stored with its input as patched, so what a worker rebuilds from the input
    // (a model's task message) says what the fork was patched to; the log it continues is
    // the source's, byte for byte.
    let input = match &body.input_patch {
        Some(Value::Object(patch)) => rein_core::migration::patched(&input, patch),
        _ => input,
    };
    let mut request = EnqueueRequest::new(to.clone(), input);
    request.queue = row.queue.clone();
    request.priority = row.priority;
    request.enqueued_by = Some(by.to_owned());
    let run_id = store
        .fork(
            token,
            source,
            at_sequence,
            request,
            &snapshot,
            rein_store::ForkedBy {
                by,
                reason: body.reason.as_deref(),
            },
        )
        .await?;
    Ok(ForkResponse {
        run_id,
        forked_from: source,
        at_sequence,
        definition: to.name().to_owned(),
        version: to.version(),
        state: snapshot.state,
    })
}

/// What to forget of a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"fields": ["email", "phone"], "reason": "erasure request #1182"}))]
pub struct RedactBody {
    /// Top-level keys of the run's data to replace by their markers.
    #[serde(default)]
    #[schema(value_type = crate::schema::RedactFields, required = true)]
    pub fields: Vec<String>,
    /// Why, recorded with the redaction.
    #[serde(default)]
    #[schema(value_type = crate::schema::RedactReason, required = true)]
    pub reason: String,
}

/// One value a redaction replaced: its key and the sha256 its marker holds.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RedactedValue {
    pub field: String,
    pub sha256: String,
}

/// What a redaction changed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RedactResponse {
    pub run_id: Uuid,
    pub fields: Vec<String>,
    /// Events whose payload changed.
    pub events: usize,
    /// Every value replaced, in the input, the events, the projection and checkpoints.
    pub hashes: Vec<RedactedValue>,
    /// Whether the run had finished: only then are the blobs it refers to forgotten.
    pub finished: bool,
    /// Blobs deleted because only finished, redacted runs referred to them.
    pub blobs_deleted: Vec<String>,
}

/// Redacts `body.fields` of run `run_id` as `by` (`rein runs redact`,
/// `POST /v1/runs/{id}/redact`); the run must be within `token`'s bounds.
pub async fn redact(
    store: &Store,
    run_id: Uuid,
    body: &RedactBody,
    by: &str,
    token: Option<&TokenInfo>,
) -> Result<RedactResponse, Error> {
    rein_store::redact_request_checked(&body.fields, by, &body.reason)?;
    if let Some(token) = token {
        let row = store.run(run_id).await?;
        token
            .may_act_on(&row.queue)
            .map_err(StoreError::OutOfBounds)?;
    }
    let Some(key) = store.redaction_key() else {
        return Err(Error::new(
            Code::Unavailable,
            format!(
                "redaction is off here: markers are keyed hashes and no key was given; {}",
                rein_core::redact::key_advice()
            ),
        ));
    };
    let done = store
        .redact_run(run_id, &body.fields, key, by, &body.reason)
        .await?;
    Ok(RedactResponse {
        run_id: done.run_id,
        fields: done.fields,
        events: done.events,
        hashes: done
            .hashes
            .into_iter()
            .map(|(field, sha256)| RedactedValue { field, sha256 })
            .collect(),
        finished: done.finished,
        blobs_deleted: done.blobs_deleted,
    })
}
