//! The worker runtime: claim loop, lease renewal, action execution outside transactions,
//! batched commits under the fencing token, inbox application, in-doubt reconciliation and
//! graceful shutdown (SPEC X1–X8).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rein_core::decision::{ToolCall, Valid};
use rein_core::retry::{Failure, LostAttempt, kind as retry_kind};
use rein_core::{ActionStatus, Definition, EngineEvent, RunState, RunStatus};
use rein_store::{
    ClaimedRun, CommitOutcome, CommitPlan, CommitRequest, NewEvent, Store, StoreError, Writer,
    counters, plan_commit,
};
use serde_json::{Value, json};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, warn};
use uuid::Uuid;

use crate::handler::{ActionContext, Outcome, Reconciled, Registry};

mod commit;
mod driver;
mod renew;
mod tools;

use commit::committer;
use driver::drive;
use renew::renewer;

/// How long a busy worker waits for more free slots before a small claim
/// ([`WorkerConfig::claim_gather_ms`]).
pub const CLAIM_GATHER_MS_DEFAULT: u64 = 10;

/// How many free slots a busy worker gathers before it claims: a whole claim batch, as a
/// claim statement's cost is mostly per statement (the claim index's entries of runs just
/// taken are stepped over by every claim until a vacuum removes them, whatever its size),
/// but never more than half the worker's slots, so gathering never leaves most of them idle.
fn claim_gather_target(claim_batch: u32, concurrency: usize) -> u32 {
    let half = u32::try_from(concurrency / 2).unwrap_or(u32::MAX);
    claim_batch.min(half).max(1)
}

/// What a model call books against a `tpm` limit when its table sets no `max_tokens`.
pub const MODEL_TOKENS_BOOKED_DEFAULT: u64 = 1024;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub worker_id: String,
    /// Runs driven at once.
    pub concurrency: usize,
    pub lease_ttl_ms: u64,
    /// Most runs taken per claim query.
    pub claim_batch: u32,
    /// Idle wait between claim queries when nothing was found.
    pub poll_interval_ms: u64,
    /// Group claiming: a busy worker (its last claim got all it asked for) with fewer free
    /// slots than a claim batch (or than half its slots, when that is fewer) waits up to
    /// this long for more to free before it claims, so one claim statement takes many runs
    /// instead of one or two. A worker with room, or an idle queue, claims at once. 0: claim
    /// as soon as a slot is free.
    pub claim_gather_ms: u64,
    pub queues: Vec<String>,
    /// How long in-flight actions may take to finish after SIGTERM.
    pub shutdown_grace_ms: u64,
    /// Most steps driven per claim before the run is handed back to the queue (fairness).
    pub steps_per_claim_max: u32,
    /// Group commits of many runs into one statement.
    pub commit_batching: bool,
    /// Payload fields larger than this are stored once as content-addressed blobs and the
    /// event keeps their reference (SPEC E5).
    pub payload_inline_bytes: usize,
    /// Fleet-wide limits by key (SPEC K1); they override a definition's values for the key.
    pub limits: std::collections::BTreeMap<String, rein_core::LimitSpec>,
    /// Longest an action waits in process for a limit before its run is handed back until
    /// the limit allows it.
    pub limit_wait_max_ms: u64,
    /// Where fleet-wide limits are kept; without it each process applies them on its own.
    pub redis: Option<rein_accel::RedisConfig>,
    /// Environment variables a `model` state may name as its `api_key_env`.
    pub model_key_envs: Vec<String>,
    /// Where each model key may be sent; reported with the heartbeat (names and URLs).
    pub model_keys: rein_core::model_keys::KeyBindings,
}

impl WorkerConfig {
    pub fn new(worker_id: impl Into<String>) -> WorkerConfig {
        WorkerConfig {
            worker_id: worker_id.into(),
            concurrency: 32,
            lease_ttl_ms: 10_000,
            claim_batch: 16,
            poll_interval_ms: 100,
            claim_gather_ms: CLAIM_GATHER_MS_DEFAULT,
            queues: vec!["default".to_owned()],
            shutdown_grace_ms: 10_000,
            steps_per_claim_max: 64,
            commit_batching: true,
            payload_inline_bytes: rein_core::limits::PAYLOAD_INLINE_BYTES_DEFAULT,
            limits: Default::default(),
            limit_wait_max_ms: 2_000,
            redis: None,
            model_key_envs: rein_core::model::KEY_ENV_DEFAULTS
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            model_keys: Default::default(),
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.concurrency == 0 || self.concurrency > 10_000 {
            return Err("concurrency must be 1..=10000".into());
        }
        if self.lease_ttl_ms < 300 || self.lease_ttl_ms > 3_600_000 {
            return Err("lease TTL must be 300 ms ..= 1 h".into());
        }
        if self.claim_batch == 0 || self.claim_batch > 1000 {
            return Err("claim batch must be 1..=1000".into());
        }
        if self.claim_gather_ms > 10_000 {
            return Err("claim gather wait must be 0..=10000 ms".into());
        }
        if self.queues.is_empty() || self.queues.len() > 64 {
            return Err("give 1..=64 queues".into());
        }
        if self.payload_inline_bytes < 1024
            || self.payload_inline_bytes > rein_core::limits::EVENT_PAYLOAD_BYTES_MAX / 2
        {
            return Err(format!(
                "the inline payload threshold must be 1024..={} bytes",
                rein_core::limits::EVENT_PAYLOAD_BYTES_MAX / 2
            ));
        }
        if let Some(q) = self.queues.iter().find(|q| q.is_empty() || q.len() > 128) {
            return Err(format!("queue name `{q}` must be 1..=128 bytes"));
        }
        if self.limit_wait_max_ms > 60_000 {
            return Err("the longest wait for a limit must be 0..=60000 ms".into());
        }
        crate::model::ModelOptions {
            key_envs: self.model_key_envs.clone(),
            default_base_url: None,
            keys: self.model_keys.clone(),
        }
        .validate()?;
        if self.limits.len() > 256 {
            return Err("give at most 256 limits".into());
        }
        for (key, spec) in &self.limits {
            if let Some(problem) = rein_core::limit_key_problem(key) {
                return Err(problem);
            }
            if let Some(problem) = spec.problems().into_iter().next() {
                return Err(format!("limit `{key}`: {problem}"));
            }
        }
        Ok(())
    }
}

/// Counters a worker keeps about itself.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub claimed: AtomicU64,
    pub steps: AtomicU64,
    pub events_committed: AtomicU64,
    pub commits: AtomicU64,
    pub commit_statements: AtomicU64,
    pub fenced: AtomicU64,
    pub leases_lost: AtomicU64,
    pub claim_queries: AtomicU64,
    /// Claim queries that took at least one run.
    pub claims_taking: AtomicU64,
    /// Runs this worker committed into a terminal state.
    pub runs_finished: AtomicU64,
    /// Round-trip time of each claim query in µs (the first [`CLAIM_SAMPLES_MAX`]).
    claim_us: std::sync::Mutex<Vec<u32>>,
}

/// How long a worker waits after a failed reconcile before handing the run back.
const RECONCILE_PAUSE: Duration = Duration::from_secs(1);

/// Claim timings a worker keeps for its summary: enough for a long benchmark, bounded memory.
pub const CLAIM_SAMPLES_MAX: usize = 200_000;

impl WorkerStats {
    fn record_claim(&self, elapsed: Duration) {
        self.claim_queries.fetch_add(1, Ordering::Relaxed);
        metrics::histogram!(rein_store::metrics::CLAIM_LATENCY).record(elapsed.as_secs_f64());
        if let Ok(mut samples) = self.claim_us.lock()
            && samples.len() < CLAIM_SAMPLES_MAX
        {
            samples.push(u32::try_from(elapsed.as_micros()).unwrap_or(u32::MAX));
        }
    }

    /// Claim query round trips in µs, as recorded so far.
    pub fn claim_samples_us(&self) -> Vec<u32> {
        self.claim_us.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Every counter and the claim latency percentiles, as one JSON object (logged when the
    /// worker stops, read by `rein bench`).
    pub fn summary(&self) -> Value {
        let mut claims = self.claim_samples_us();
        claims.sort_unstable();
        let pct = |p: f64| -> f64 {
            if claims.is_empty() {
                return 0.0;
            }
            let i = ((claims.len() - 1) as f64 * p).round() as usize;
            f64::from(claims[i]) / 1000.0
        };
        json!({
            "claimed": self.claimed.load(Ordering::Relaxed),
            "steps": self.steps.load(Ordering::Relaxed),
            "events_committed": self.events_committed.load(Ordering::Relaxed),
            "commits": self.commits.load(Ordering::Relaxed),
            "commit_statements": self.commit_statements.load(Ordering::Relaxed),
            "fenced": self.fenced.load(Ordering::Relaxed),
            "leases_lost": self.leases_lost.load(Ordering::Relaxed),
            "claim_queries": self.claim_queries.load(Ordering::Relaxed),
            "claims_taking": self.claims_taking.load(Ordering::Relaxed),
            "runs_finished": self.runs_finished.load(Ordering::Relaxed),
            "claim_ms_p50": pct(0.50),
            "claim_ms_p99": pct(0.99),
        })
    }
}

struct Held {
    token: i64,
    /// Fires when the lease is lost or the worker stops hard: stop without writing.
    lost: CancellationToken,
    /// Fires when a CANCEL waits in the inbox: stop the action, then apply the inbox.
    interrupt: CancellationToken,
    inbox_pending: AtomicBool,
    /// A commit that releases the lease is under way: a renewal that no longer finds the
    /// lease is seeing that release, not a loss.
    releasing: AtomicBool,
}

struct CommitJob {
    request: CommitRequest,
    /// The request comes back with its outcome: a retry sends it again, a commit keeps its
    /// projection, and nothing is copied on the way.
    reply: oneshot::Sender<(CommitRequest, Result<CommitOutcome, StoreError>)>,
}

#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

struct Inner {
    store: Store,
    config: WorkerConfig,
    registry: Registry,
    /// Compiled definitions by (name, version), each looked up once: the slots of a claim
    /// that need one wait for the first lookup instead of making their own.
    definitions: std::sync::Mutex<HashMap<(String, u32), OnceDefinition>>,
    held: std::sync::Mutex<HashMap<Uuid, Arc<Held>>>,
    commits: mpsc::Sender<CommitJob>,
    commit_rx: Mutex<Option<mpsc::Receiver<CommitJob>>>,
    stats: WorkerStats,
    /// Stop claiming; finish or hand back what is held.
    draining: CancellationToken,
    /// Stop everything now; leases lapse.
    hard_stop: CancellationToken,
    /// Signalled when work may have become runnable (a wake-up): cuts the idle wait short.
    /// One stored permit, so a burst of wake-ups becomes at most one extra claim round.
    wakeups: Arc<tokio::sync::Notify>,
    /// Fleet-wide rate and concurrency limits on actions (SPEC K1).
    limiter: rein_accel::limits::Limiter,
    deltas: rein_accel::stream::Deltas,
}

/// Registers at 0 the families a worker records (the limiter registers its own), so an idle
/// worker exports them all.
fn register_metrics() {
    use rein_store::metrics as m;
    for family in [m::LEASE_CLAIMS, m::LEASE_RENEWALS, m::LEASES_LOST] {
        metrics::counter!(family).increment(0);
    }
    metrics::counter!(rein_accel::WAKEUPS_RECEIVED).increment(0);
    let _ = metrics::histogram!(m::CLAIM_LATENCY);
    metrics::gauge!(m::ACTIONS_IN_FLIGHT).increment(0.0);
}

impl Worker {
    pub fn new(store: Store, config: WorkerConfig, registry: Registry) -> Worker {
        register_metrics();
        let (tx, rx) = mpsc::channel(4096);
        let limiter = rein_accel::limits::Limiter::new(
            config.redis.clone(),
            config.limits.clone(),
            Duration::from_millis(config.limit_wait_max_ms),
            config.lease_ttl_ms,
        );
        let hard_stop = CancellationToken::new();
        let deltas = match &config.redis {
            Some(redis) => rein_accel::stream::Deltas::start(redis.clone(), hard_stop.clone()),
            None => rein_accel::stream::Deltas::none(),
        };
        Worker {
            inner: Arc::new(Inner {
                limiter,
                deltas,
                store,
                config,
                registry,
                definitions: std::sync::Mutex::new(HashMap::new()),
                held: std::sync::Mutex::new(HashMap::new()),
                commits: tx,
                commit_rx: Mutex::new(Some(rx)),
                stats: WorkerStats::default(),
                draining: CancellationToken::new(),
                hard_stop,
                wakeups: Arc::new(tokio::sync::Notify::new()),
            }),
        }
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.inner.stats
    }

    /// Signal this to make an idle worker claim at once (wake-ups, SPEC K1).
    pub fn wakeups(&self) -> Arc<tokio::sync::Notify> {
        self.inner.wakeups.clone()
    }

    pub fn id(&self) -> &str {
        &self.inner.config.worker_id
    }

    /// Number of runs this worker holds right now.
    pub fn held(&self) -> usize {
        self.inner.held.lock().map(|h| h.len()).unwrap_or(0)
    }

    /// Runs until `shutdown` fires, then drains: stops claiming, lets held runs reach a
    /// commit point within the grace period, and stops hard after it.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), StoreError> {
        let inner = &self.inner;
        let rx = inner
            .commit_rx
            .lock()
            .await
            .take()
            .ok_or_else(|| StoreError::Invalid("a worker runs once".into()))?;
        let committer = tokio::spawn(committer(inner.clone(), rx));
        let renewer = tokio::spawn(renewer(inner.clone()));
        let _ = inner
            .store
            .heartbeat(
                &inner.config.worker_id,
                "worker",
                json!({
                    "concurrency": inner.config.concurrency,
                    "ttl_ms": inner.config.lease_ttl_ms,
                    "model_keys": inner.config.model_keys.to_json(),
                }),
            )
            .await;
        let mut tasks = tokio::task::JoinSet::new();
        let mut idle_ms = inner.config.poll_interval_ms;
        let mut last_heartbeat = tokio::time::Instant::now();
        // Group claiming: whether the last claim took all it asked for (the queue has more),
        // and since when a few slots have been waiting for company.
        let mut backlog = false;
        let mut gathering_since: Option<tokio::time::Instant> = None;
        let gather = Duration::from_millis(inner.config.claim_gather_ms);
        let claim_min = claim_gather_target(inner.config.claim_batch, inner.config.concurrency);
        let mut claim_connection = rein_store::HeldConnection::default();
        info!(worker = %inner.config.worker_id, concurrency = inner.config.concurrency, "worker started");
        loop {
            while tasks.try_join_next().is_some() {}
            if shutdown.is_cancelled() {
                break;
            }
            if last_heartbeat.elapsed() > Duration::from_millis(inner.config.lease_ttl_ms / 3) {
                last_heartbeat = tokio::time::Instant::now();
                let _ = inner
                    .store
                    .heartbeat(
                        &inner.config.worker_id,
                        "worker",
                        json!({
                            "held": self.held(),
                            "ttl_ms": inner.config.lease_ttl_ms,
                            "model_keys": inner.config.model_keys.to_json(),
                        }),
                    )
                    .await;
            }
            let free = inner.config.concurrency.saturating_sub(tasks.len());
            if backlog && free > 0 && (free as u32) < claim_min && !gather.is_zero() {
                let since = *gathering_since.get_or_insert_with(tokio::time::Instant::now);
                let until = since + gather;
                if tokio::time::Instant::now() < until {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep_until(until) => {}
                        Some(_) = tasks.join_next() => {}
                    }
                    continue;
                }
            }
            gathering_since = None;
            let mut claimed_any = false;
            if free > 0 {
                let n = (free as u32).min(inner.config.claim_batch);
                let asked = tokio::time::Instant::now();
                let claimed = inner
                    .store
                    .claim_holding(
                        &inner.config.worker_id,
                        n,
                        inner.config.lease_ttl_ms,
                        &inner.config.queues,
                        &mut claim_connection,
                    )
                    .await;
                inner.stats.record_claim(asked.elapsed());
                match claimed {
                    Ok(runs) => {
                        claimed_any = !runs.is_empty();
                        backlog = runs.len() as u32 == n;
                        if claimed_any {
                            inner.stats.claims_taking.fetch_add(1, Ordering::Relaxed);
                        }
                        metrics::counter!(rein_store::metrics::LEASE_CLAIMS)
                            .increment(runs.len() as u64);
                        for run in runs {
                            inner.stats.claimed.fetch_add(1, Ordering::Relaxed);
                            let inner = inner.clone();
                            tasks.spawn(async move { drive(inner, run).await });
                        }
                    }
                    Err(e) => {
                        backlog = false;
                        warn!(error = %e, "claim failed; retrying after a pause")
                    }
                }
            }
            if claimed_any {
                idle_ms = inner.config.poll_interval_ms;
                tokio::task::yield_now().await;
                continue;
            }
            let wait = if free == 0 {
                Duration::from_millis(5)
            } else {
                let d = Duration::from_millis(idle_ms);
                idle_ms = (idle_ms * 2).min(inner.config.poll_interval_ms * 4).max(1);
                d
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
                _ = inner.wakeups.notified(), if free > 0 => idle_ms = inner.config.poll_interval_ms,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
        info!(worker = %inner.config.worker_id, held = tasks.len(), "draining");
        // The runs still held need connections to finish: no more claims.
        drop(claim_connection);
        inner.draining.cancel();
        let grace = Duration::from_millis(inner.config.shutdown_grace_ms);
        if tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} })
            .await
            .is_err()
        {
            warn!("grace period over; stopping actions, their leases will lapse");
            inner.hard_stop.cancel();
            while tasks.join_next().await.is_some() {}
        }
        inner.hard_stop.cancel();
        renewer.abort();
        drop(tasks);
        committer.abort();
        let _ = inner.store.deregister(&inner.config.worker_id).await;
        info!(worker = %inner.config.worker_id, stats = %inner.stats.summary(), "worker stopped");
        Ok(())
    }
}

/// Why driving a run stopped.
enum Stop {
    /// Committed a state where this worker has nothing more to do, or handed it back.
    Released,
    /// The lease is gone: do not write anything more.
    Lost,
}

struct Driver {
    inner: Arc<Inner>,
    def: Definition,
    run_id: Uuid,
    token: i64,
    state: RunState,
    held: Arc<Held>,
    /// The next commit goes straight to the database instead of queueing behind other
    /// runs' batch: a dispatch a rate limit timed lands when the limit said (SPEC K1).
    direct: bool,
    /// Content-addressed values (a model's prompt messages) stored with the next commit.
    blobs: Vec<rein_core::blob::Blob>,
}

/// A definition version's entry: filled by the first lookup, which the others wait for.
type OnceDefinition = Arc<tokio::sync::OnceCell<Definition>>;

/// Most bytes of blob content read back into one action's context (`Driver::resolved`).
pub const RESOLVED_BYTES_MAX: usize = 16 * 1024 * 1024;
