//! All of Rein's SQL. Every statement lives in `queries/*.sql` (or, for one-liners, in this
//! crate) and every caller goes through [`Store`]. The pure engine (`rein-core`) decides
//! what to write; this crate writes it under the fencing rules of SPEC X1–X3a and reads it
//! back.
//!
//! Every lease and deadline comparison is made by the database clock (`clock_timestamp()`).

mod approvals;
mod audit;
mod bench;
mod blobs;
mod commit;
mod definitions;
mod error;
mod gauges;
pub mod input;
mod leader;
pub mod metrics;
mod moves;
mod operate;
mod reads;
mod redact;
mod retention;
mod scans;
mod schema;
mod send;
mod sender;
mod sim;
mod tokens;
pub mod trace;
mod usage;
mod webhooks;
mod whatif;
mod why;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

pub use approvals::{Approval, ApprovalAsk, COMMENT_BYTES_MAX};
pub use audit::*;
pub use bench::{
    DbCost, FLOOR_EVENTS_PER_LIFE, FloorShape, FloorStatement, Percentiles, QueueStats, RunCopies,
    StatementCost, StatementKind, first_run_id_at,
};
pub use blobs::BlobStats;
pub use commit::{
    ClaimedRun, CommitOutcome, CommitPlan, CommitRequest, Committed, FenceReason, HeldConnection,
    LedgerOp, NewEvent, Renewed, Writer, jitter_from, plan_commit,
};
pub use definitions::{
    BUILTIN_PUBLISHER, CurrentMoved, DEFINITION_CACHE_BYTES_MAX, DEFINITION_CACHE_ENTRIES_MAX,
    DefinitionRow, OPERATOR, Publication, Published,
};
pub use error::{StoreError, is_unreachable};
pub use gauges::{FleetGauges, RETRYING_ATTEMPTS_MIN};
pub use leader::{LEADER_TTL_MS_MAX, LEADER_TTL_MS_MIN, LeaderInfo, LeaderLease};
pub use moves::{
    FORK_DEPTH_MAX, ForkedBy, MIGRATION_PAGE_MAX, MigrationCandidate, Moved, PROTOCOL_MOVES,
};

/// The protocol a run of a definition with a model state's `tool_choice` other than
/// `required` needs: a worker of an older release would send `required` regardless.
pub const PROTOCOL_TOOL_CHOICE: i16 = 3;

/// The newest engine protocol this binary reads (`rein_runs.protocol`): it claims no run whose
/// log needs a newer one, so old and new workers can run side by side during an upgrade.
pub const PROTOCOL_VERSION: i16 = PROTOCOL_TOOL_CHOICE;

/// The engine protocol a run of `def` needs from its first event: the first one, unless the
/// definition uses a feature older workers would not honour.
pub fn definition_protocol(def: &rein_core::Definition) -> i16 {
    if def.sets_tool_choice() {
        PROTOCOL_TOOL_CHOICE
    } else {
        1
    }
}
pub use operate::Member;
pub use reads::{
    Budgeted, EventAt, EventTime, ID_PREFIX_LEN_MAX, PageView, ROW_BYTES_BESIDES_JSON, Recovered,
    RunFilter, RunRow, StoredEvent, id_prefix_range,
};
pub use redact::{REDACT_REASON_BYTES_MAX, Redacted, UnkeyedRedaction, redact_request_checked};
pub use retention::{
    ARCHIVE_BATCH_MAX, ArchiveCandidates, ArchivedBatch, EventRange, EventsTableSize,
    MonthCandidate, MonthMoved,
};
pub use scans::{NextLook, SCAN_BACKOFF_MS_MAX, SCAN_BACKOFF_MS_MIN, Seen};
pub use schema::{
    Blocker, CONTRACT_MIGRATOR, ContractPlan, Pending, application_name, application_name_of,
    schema_version,
};
pub use send::{
    CLIENT_KEY_LEN_MAX, ClientKey, EnqueueRequest, Enqueued, INBOX_READ_MAX, INBOX_TTL_MS_DEFAULT,
    INPUT_BYTES_MAX, InboxEntry, SendOutcome, plan_inbox, sent_event_id,
};
pub use sender::{API_SENDER_PREFIX, SENDER_BYTES_MAX, Sender};
pub use tokens::{
    IN_FLIGHT_RETRY_AFTER_S, OutOfBounds, Quota, QuotaExceeded, SCOPES, SUBJECT_BYTES_MAX, Scope,
    TOKEN_QUEUES_MAX, TOKEN_QUOTA_MAX, TOKENS_LIST_MAX, TokenBounds, TokenInfo, TokenListing,
    check_token_request,
};
pub use webhooks::{
    AttemptFailed, DueDelivery, NewWebhook, WEBHOOK_CLAIM_MAX, WEBHOOK_DELIVERIES_LIST_MAX,
    WEBHOOK_KINDS, WEBHOOK_SECRET_BYTES_MAX, WEBHOOK_SECRET_BYTES_MIN, Webhook, WebhookDelivery,
};
pub use whatif::{HISTORIES_RUNS_MAX, WHATIF_PAGE_MAX, WhatIfRun, WhatIfRuns};
pub use why::{
    HEARTBEAT_FRESH_MS, WHY_ROWS_MAX, WhyAction, WhyApproval, WhyEvent, WhyFacts, WhyFleet,
    WhyInbox, WhyRun, WhySimEffect,
};

/// The database's schema against this binary's migrations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaState {
    /// No Rein schema at all (a new database).
    Missing,
    /// Migrations this binary knows are not applied yet.
    Older,
    /// Every expand migration this binary knows is applied; what it does not know is a newer
    /// release's expand step (which keeps this binary working), and its own contract steps
    /// may be pending.
    Current,
    /// A newer release's contract step is applied: it took away what this binary may use.
    Newer,
}

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// Defaults sized for 2 cores and Postgres' default 100 connections shared by a fleet of a
/// few processes.
pub const POOL_MAX_DEFAULT: u32 = 8;
/// How long a pooled statement waits for a connection of its pool.
pub const CONNECT_TIMEOUT_MS: u64 = 10_000;
/// How long a command's first connection may take, by default, before it gives up: a
/// server that refuses connections is asked again until then (it may be restarting).
pub const CONNECT_FIRST_TIMEOUT_MS_DEFAULT: u64 = 5_000;
/// Pause between connection attempts while the server refuses them.
const CONNECT_RETRY_MS: u64 = 100;

/// Told, after a commit, that work became runnable on a queue (`None`: on some queue). It
/// must not block; Rein uses it to publish wake-ups (SPEC K1). Nothing depends on it.
pub type WakeHook = std::sync::Arc<dyn Fn(Option<&str>) + Send + Sync>;

#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    wake: Option<WakeHook>,
    /// Compiled definitions, shared by the clones of this store.
    definitions: std::sync::Arc<definitions::DefinitionCache>,
    /// Whether nobody may grant an approval of a run they enqueued, whatever the
    /// definition's policy says ([`Store::with_approver_separation`]).
    approver_separation: bool,
    /// The bounds on a tree of fan-outs every commit of this store enforces (SPEC Z4).
    tree_bounds: rein_core::join::TreeBounds,
    /// Which of its queues a claim serves first this time (round robin, SPEC Z4).
    claim_turn: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The key redaction markers are made with ([`Store::with_redaction_key`]); without
    /// one, this store does not redact.
    redaction_key: Option<std::sync::Arc<rein_core::redact::RedactionKey>>,
}

impl Store {
    /// Connects and applies pending migrations (safe when many processes start at once:
    /// the migrator serialises itself with an advisory lock).
    pub async fn connect(url: &str, pool_max: u32) -> Result<Store, StoreError> {
        let store = Store::connect_without_migrating(url, pool_max).await?;
        store.migrate().await?;
        Ok(store)
    }

    pub async fn connect_without_migrating(url: &str, pool_max: u32) -> Result<Store, StoreError> {
        Store::connect_within(url, pool_max, CONNECT_TIMEOUT_MS).await
    }

    /// A pool on the database, schema unchecked, once a first connection is made within
    /// `connect_timeout_ms`: a server that refuses connections (or resets them) is asked
    /// again until then, one that does not answer is given up on then, and one that answers
    /// with an error (authentication, an unknown database) fails at once.
    pub async fn connect_within(
        url: &str,
        pool_max: u32,
        connect_timeout_ms: u64,
    ) -> Result<Store, StoreError> {
        let options = connect_options(url)?;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(connect_timeout_ms);
        let target = format!("{}:{}", options.get_host(), options.get_port());
        let gave_up = |last: &str| {
            StoreError::Unreachable(format!(
                "no connection to {target} within {connect_timeout_ms} ms (the connect timeout){}",
                if last.is_empty() {
                    ": the server did not answer".to_owned()
                } else {
                    format!("; last attempt: {last}")
                }
            ))
        };
        let mut last = String::new();
        loop {
            match tokio::time::timeout_at(deadline, options.connect()).await {
                Ok(Ok(first)) => {
                    // It was only a probe: the pool opens its own.
                    let _ = first.close().await;
                    break;
                }
                // Refused or reset, or "the database system is starting up" (57P03).
                Ok(Err(e))
                    if is_unreachable(&e)
                        || e.as_database_error().and_then(|d| d.code()).as_deref()
                            == Some("57P03") =>
                {
                    last = e.to_string()
                }
                Ok(Err(e)) => return Err(StoreError::from_connect(e)),
                Err(_) => return Err(gave_up(&last)),
            }
            let pause = Duration::from_millis(CONNECT_RETRY_MS);
            if tokio::time::Instant::now() + pause >= deadline {
                return Err(gave_up(&last));
            }
            tokio::time::sleep(pause).await;
        }
        let pool = PgPoolOptions::new()
            .max_connections(pool_max.max(1))
            .acquire_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .connect_with(options)
            .await
            .map_err(StoreError::from_connect)?;
        Ok(Store::from_pool(pool))
    }

    pub fn from_pool(pool: PgPool) -> Store {
        Store {
            pool,
            wake: None,
            definitions: Default::default(),
            approver_separation: false,
            tree_bounds: rein_core::join::TreeBounds::default(),
            claim_turn: Default::default(),
            redaction_key: None,
        }
    }

    /// Makes every definition's runs follow `approver_may_not_be_enqueuer` (SPEC H1): whoever
    /// enqueued a run may not grant its approvals through this store (a deployment's rule,
    /// `rein api --approver-may-not-be-enqueuer`).
    pub fn with_approver_separation(mut self, on: bool) -> Store {
        self.approver_separation = on;
        self
    }

    /// Redacts with `key` (`REIN_REDACTION_KEY`): its markers are keyed hashes of the values.
    pub fn with_redaction_key(mut self, key: Option<rein_core::redact::RedactionKey>) -> Store {
        self.redaction_key = key.map(std::sync::Arc::new);
        self
    }

    pub fn redaction_key(&self) -> Option<&rein_core::redact::RedactionKey> {
        self.redaction_key.as_deref()
    }

    /// Holds every fan-out this store commits to `bounds` (by default 4 deep and 1,000
    /// runs per root): a fan-out past them takes its failure path instead.
    pub fn with_tree_bounds(mut self, bounds: rein_core::join::TreeBounds) -> Store {
        self.tree_bounds = bounds;
        self
    }

    pub fn tree_bounds(&self) -> rein_core::join::TreeBounds {
        self.tree_bounds
    }

    /// Calls `hook` after each commit that makes work runnable (enqueue, a sent event applied
    /// at once, a fired timer, a recovered or released lease with the run still runnable).
    pub fn with_wake_hook(mut self, hook: WakeHook) -> Store {
        self.wake = Some(hook);
        self
    }

    pub(crate) fn woke(&self, queue: Option<&str>) {
        if let Some(hook) = &self.wake {
            hook(queue);
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The database's host and port as this store connects to them; `None` for a Unix
    /// socket. Outgoing calls of a worker must not reach it (SPEC Z4).
    pub fn database_address(&self) -> Option<(String, u16)> {
        let options = self.pool.connect_options();
        let host = options.get_host();
        (!host.starts_with('/')).then(|| (host.to_owned(), options.get_port()))
    }

    /// Fails with [`StoreError::SchemaMismatch`] when the database was migrated by another
    /// version of Rein (too old or too new for this binary).
    pub async fn check_schema(&self) -> Result<(), StoreError> {
        match self.schema_state().await? {
            SchemaState::Current => Ok(()),
            SchemaState::Missing => Err(StoreError::SchemaMismatch(
                "no Rein schema found: run `rein migrate`".into(),
            )),
            SchemaState::Newer => Err(StoreError::SchemaMismatch(
                "a newer release of Rein has contracted the database schema (removed what this binary may use): upgrade rein".into(),
            )),
            SchemaState::Older => Err(StoreError::SchemaMismatch(
                "the database schema is older than this binary: run `rein migrate`".into(),
            )),
        }
    }

    /// Makes the schema current for a role that starts work (worker, scheduler): migrates
    /// only when the schema is missing or behind, so a role that may use the tables but not
    /// change them starts against a current schema. Returns whether it migrated. A role that
    /// may not migrate a schema that needs it is told to run `rein migrate` as the owner.
    pub async fn prepare_schema(&self) -> Result<bool, StoreError> {
        match self.schema_state().await? {
            SchemaState::Current => {
                self.register_missing_builtins().await?;
                Ok(false)
            }
            SchemaState::Newer => self.check_schema().await.map(|()| false),
            SchemaState::Missing | SchemaState::Older => match self.migrate().await {
                Ok(()) => Ok(true),
                Err(e) if e.is_permission_denied() => Err(StoreError::SchemaMismatch(format!(
                    "the database schema is missing or older than this binary and this database \
                     user may not change it ({e}): run `rein migrate` as the schema owner \
                     (rein_owner), then start this process again"
                ))),
                Err(e) => Err(e),
            },
        }
    }

    /// Registers the built-in definitions this binary ships that the database lacks (a new
    /// built-in version needs no migration). Nothing to do is the usual case and needs only
    /// SELECT; a role that may not insert is told who may.
    async fn register_missing_builtins(&self) -> Result<(), StoreError> {
        let stored: Vec<(String, i32)> =
            sqlx::query_as("SELECT name, version FROM rein_definitions")
                .fetch_all(&self.pool)
                .await?;
        for (name, _) in rein_core::builtin::ALL {
            let Some(Ok(def)) = rein_core::builtin::load(name) else {
                continue;
            };
            let known = stored
                .iter()
                .any(|(n, v)| n == def.name() && *v == def.version() as i32);
            if known {
                continue;
            }
            match self.publish_builtin(&def).await {
                Ok(_) => {}
                Err(e) if e.is_permission_denied() => {
                    return Err(StoreError::SchemaMismatch(format!(
                        "built-in definition {} version {} is not registered and this database \
                         user may not register it: run `rein migrate` as the schema owner \
                         (rein_owner)",
                        def.name(),
                        def.version()
                    )));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Registers every built-in this binary ships and points each built-in name at the
    /// version it ships, unless a person pinned another ([`Store::publish_builtin`]). A
    /// version the database already holds with another body (registered by an older
    /// binary, before the built-in gained a field) is kept as stored, with a warning: runs
    /// of it replay against the body they started with, and the schema can still be
    /// upgraded.
    async fn register_builtins(&self) -> Result<(), StoreError> {
        for (name, _) in rein_core::builtin::ALL {
            if let Some(Ok(def)) = rein_core::builtin::load(name) {
                self.publish_builtin(&def).await?;
            }
        }
        Ok(())
    }

    /// Adds `n` to a named counter (fenced writes refused, ...). Rare path: not batched.
    pub async fn add_counter(&self, name: &str, n: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO rein_counters (name, value) VALUES ($1, $2)
             ON CONFLICT (name) DO UPDATE SET value = rein_counters.value + EXCLUDED.value",
        )
        .bind(name)
        .bind(n)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn counter(&self, name: &str) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT value FROM rein_counters WHERE name = $1")
                .bind(name)
                .fetch_optional(&self.pool)
                .await?
                .unwrap_or(0),
        )
    }

    pub async fn deregister(&self, worker_id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM rein_workers WHERE worker_id = $1")
            .bind(worker_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Records that a worker or scheduler is alive.
    pub async fn heartbeat(
        &self,
        worker_id: &str,
        role: &str,
        mut info: serde_json::Value,
    ) -> Result<(), StoreError> {
        // Every member says which engine protocol it reads, so an operation that writes a
        // newer one can tell whether older binaries are still at work.
        if let Some(map) = info.as_object_mut() {
            map.insert("protocol".into(), PROTOCOL_VERSION.into());
            // And the newest migration it embeds, so a contract step waits for it to go.
            map.insert("schema".into(), schema_version().into());
        }
        sqlx::query(
            "INSERT INTO rein_workers (worker_id, role, info) VALUES ($1, $2, $3)
             ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = now(), info = EXCLUDED.info",
        )
        .bind(worker_id)
        .bind(role)
        .bind(info)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// The connection options of every connection Rein opens.
fn connect_options(url: &str) -> Result<PgConnectOptions, StoreError> {
    let options: PgConnectOptions = url
        .parse()
        .map_err(|e: sqlx::Error| StoreError::BadUrl(e.to_string()))?;
    Ok(options
        .application_name(&schema::application_name())
        // Rein's statements are few, fixed and index-driven: plan each once per
        // connection instead of re-planning the claim on every call.
        //
        // No JIT: a generic plan made while a table has no statistics yet (a fresh database
        // that just took a batch of runs) can carry estimates far past jit_above_cost, and
        // JIT compiles the plan again on every execution: `rein bench` saw each commit spend
        // 8 s compiling (10 events/s instead of thousands). Rein's statements touch a few rows
        // each; compiling never pays.
        .options([("plan_cache_mode", "force_generic_plan"), ("jit", "off")])
        .log_statements(tracing::log::LevelFilter::Trace)
        .log_slow_statements(tracing::log::LevelFilter::Debug, Duration::from_secs(1)))
}

/// Counter names.
pub mod counters {
    pub const FENCED_WRITES: &str = "fenced_writes_rejected";
    pub const LEASES_RECOVERED: &str = "leases_recovered";
}
