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

/// Group commit: takes every job queued right now and commits them in one statement.
async fn committer(inner: Arc<Inner>, mut rx: mpsc::Receiver<CommitJob>) {
    let max = if inner.config.commit_batching { 256 } else { 1 };
    let mut jobs = Vec::with_capacity(max);
    let mut held = rein_store::HeldConnection::default();
    while rx.recv_many(&mut jobs, max).await > 0 {
        let (requests, replies): (Vec<CommitRequest>, Vec<_>) =
            jobs.drain(..).map(|j| (j.request, j.reply)).unzip();
        inner
            .stats
            .commit_statements
            .fetch_add(1, Ordering::Relaxed);
        // A statement refused as a whole is retried run by run in there: one run's data
        // PostgreSQL cannot store never costs the others in the batch their results.
        let outcomes = inner
            .store
            .commit_runs_holding(&inner.config.worker_id, &requests, &mut held)
            .await;
        for ((request, reply), outcome) in requests.into_iter().zip(replies).zip(outcomes) {
            let _ = reply.send((request, outcome));
        }
    }
}

async fn renewer(inner: Arc<Inner>) {
    let period = Duration::from_millis((inner.config.lease_ttl_ms / 3).max(100));
    loop {
        tokio::time::sleep(period).await;
        let held: Vec<(Uuid, i64)> = match inner.held.lock() {
            Ok(h) => h.iter().map(|(id, held)| (*id, held.token)).collect(),
            Err(_) => return,
        };
        if held.is_empty() {
            continue;
        }
        // Concurrency slots live as long as the leases of the actions holding them.
        let limiter = inner.limiter.clone();
        tokio::spawn(async move { limiter.refresh().await });
        let asked = held;
        match inner
            .store
            .renew(&inner.config.worker_id, &asked, inner.config.lease_ttl_ms)
            .await
        {
            Ok(renewed) => {
                metrics::counter!(rein_store::metrics::LEASE_RENEWALS)
                    .increment(renewed.len() as u64);
                let renewed: HashMap<Uuid, rein_store::Renewed> =
                    renewed.into_iter().map(|r| (r.run_id, r)).collect();
                let Ok(map) = inner.held.lock() else { return };
                // Only the leases this renewal asked for: a run claimed since the snapshot
                // was not in it, and a run released since then is no longer held.
                for (run_id, token) in &asked {
                    let Some(held) = map
                        .get(run_id)
                        .filter(|h| h.token == *token && !h.releasing.load(Ordering::Acquire))
                    else {
                        continue;
                    };
                    match renewed.get(run_id) {
                        Some(r) => {
                            if r.inbox_pending {
                                held.inbox_pending.store(true, Ordering::Release);
                            }
                            if r.cancel_pending {
                                held.interrupt.cancel();
                            }
                        }
                        None => {
                            warn!(%run_id, token = held.token, "lease lost; cancelling its action");
                            inner.stats.leases_lost.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!(rein_store::metrics::LEASES_LOST).increment(1);
                            held.lost.cancel();
                        }
                    }
                }
            }
            // Cannot tell whether the leases still stand; the commit check will say.
            Err(e) => warn!(error = %e, "lease renewal failed"),
        }
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

async fn drive(inner: Arc<Inner>, claimed: ClaimedRun) {
    let run_id = claimed.run_id;
    let def = match definition(&inner, &claimed.definition, claimed.version).await {
        Ok(def) => def,
        Err(e) => {
            error!(%run_id, error = %e, "cannot load the run's definition; leaving the lease to lapse");
            return;
        }
    };
    let held = Arc::new(Held {
        token: claimed.token,
        lost: inner.hard_stop.child_token(),
        interrupt: CancellationToken::new(),
        inbox_pending: AtomicBool::new(claimed.inbox_pending),
        releasing: AtomicBool::new(false),
    });
    if let Ok(mut map) = inner.held.lock()
        && let Some(superseded) = map.insert(run_id, held.clone())
    {
        // This worker claimed the run again after losing it: the old action must stop.
        superseded.lost.cancel();
    }
    let mut driver = Driver {
        inner: inner.clone(),
        def,
        run_id,
        token: claimed.token,
        state: claimed.state,
        held,
        direct: false,
        blobs: Vec::new(),
    };
    debug!(%run_id, token = driver.token, queued_ms = claimed.queued_ms, "claimed");
    let _ = driver.run().await;
    if let Ok(mut map) = inner.held.lock()
        && map
            .get(&run_id)
            .is_some_and(|h| Arc::ptr_eq(h, &driver.held))
    {
        map.remove(&run_id);
    }
}

/// The run's definition, compiled once per worker. A lookup that fails leaves the entry
/// empty, so the next run of that version asks the database again.
async fn definition(inner: &Inner, name: &str, version: u32) -> Result<Definition, StoreError> {
    let cell = inner
        .definitions
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .entry((name.to_owned(), version))
        .or_default()
        .clone();
    cell.get_or_try_init(|| inner.store.load_definition(name, Some(version)))
        .await
        .cloned()
}

impl Driver {
    async fn run(&mut self) -> Stop {
        let mut steps = 0u32;
        loop {
            if self.held.lost.is_cancelled() {
                return Stop::Lost;
            }
            if self.held.inbox_pending.swap(false, Ordering::AcqRel)
                && let Err(stop) = self.apply_inbox().await
            {
                return stop;
            }
            let status = self.state.status(&self.def);
            let hand_back = steps >= self.inner.config.steps_per_claim_max
                || self.inner.draining.is_cancelled();
            if status != RunStatus::Runnable || hand_back {
                return self.release().await;
            }
            steps += 1;
            let span = tracing::info_span!(
                "rein.step",
                rein.run.id = %self.run_id,
                rein.definition = %self.def.name(),
                rein.state = %self.state.state,
                rein.sequence = self.state.sequence,
                rein.attempt = self.state.attempt,
                rein.worker.id = %self.inner.config.worker_id,
                rein.fencing_token = self.token,
            );
            crate::trace::parent_to_run(&span, self.run_id);
            let step_result = self.step().instrument(span).await;
            if let Err(stop) = step_result {
                return stop;
            }
        }
    }

    /// One node action: reconcile an in-doubt call, or run the state's action and commit
    /// its outcome.
    async fn step(&mut self) -> Result<(), Stop> {
        let Some(spec) = self.def.state(&self.state.state).cloned() else {
            return self
                .operator_required("the run is in a state its definition does not declare")
                .await;
        };
        let Some(action) = spec.action.clone() else {
            return self
                .operator_required("this active state declares no action")
                .await;
        };
        let Some(handler) = self.inner.registry.get(&action) else {
            return self
                .operator_required(&format!(
                    "no handler registered for action `{action}` on this worker"
                ))
                .await;
        };
        let node = self.state.state.clone();

        // A call dispatched by an earlier holder and never answered is in doubt (SPEC X7).
        if let Some(slot) = self.state.action.clone()
            && matches!(
                slot.status,
                ActionStatus::Dispatched | ActionStatus::InDoubt
            )
        {
            let call_id = slot.call_id.clone().unwrap_or_default();
            if slot.status == ActionStatus::Dispatched {
                self.commit(vec![in_doubt_event(
                    &call_id,
                    retry_kind::IN_DOUBT,
                    "found dispatched without a result after takeover",
                )])
                .await?;
            }
            let ctx = self.context(&slot.node, slot.step, &slot.action_id, &call_id);
            // A tool call dispatched on a model's decision is reconciled by that tool.
            let handler = match slot.tool.as_deref() {
                Some(tool) => match self.inner.registry.get(&format!("tool:{tool}")) {
                    Some(h) => h,
                    None => {
                        return self
                            .operator_required(&format!(
                                "in-doubt call of tool `{tool}`, which has no handler on this worker"
                            ))
                            .await;
                    }
                },
                None => handler,
            };
            let Some(hook) = handler.reconcile(ctx) else {
                return self
                    .operator_required("in-doubt action and its tool has no reconcile hook")
                    .await;
            };
            return match hook.await {
                Ok(Reconciled::Applied(candidates)) => {
                    let candidates = with_call_id(candidates, &call_id);
                    self.commit_decision(candidates, Some(&node)).await
                }
                Ok(Reconciled::NotApplied) => self.not_applied(&slot, &call_id).await,
                Err(e) => {
                    // Pause before handing the run back, so an endpoint that keeps failing
                    // is not asked again at once by whoever claims it next.
                    warn!(run_id = %self.run_id, error = %e, "reconcile failed; handing the run back after a pause");
                    tokio::select! {
                        _ = self.held.lost.cancelled() => return Err(Stop::Lost),
                        _ = tokio::time::sleep(RECONCILE_PAUSE) => {}
                    }
                    Err(self.release().await)
                }
            };
        }

        // The open step's identity is reused by its retries (same idempotency key).
        let (step, action_id) = match &self.state.action {
            Some(slot) if slot.status == ActionStatus::Failed && slot.node == node => {
                (slot.step, slot.action_id.clone())
            }
            _ => {
                let step = self.state.steps_completed + 1;
                (step, format!("step-{step}"))
            }
        };
        // A call a person approved runs as approved: the engine dispatches exactly that call
        // itself (SPEC H2); the model is never asked to make it again.
        if let Some((call, grant)) = self.approved_call(&node).await? {
            info!(run_id = %self.run_id, tool = %call.tool, approval_id = ?grant, "running the approved call");
            return self.call_tool(call, &node, step, &action_id, grant).await;
        }
        let permit = self.admit(&node, None).await?;
        let call_id = Uuid::now_v7().to_string();
        let ctx = self.context(&node, step, &action_id, &call_id);
        let side_effect = handler.side_effect(&ctx);
        if side_effect {
            self.direct = permit.limited();
            self.commit(vec![
                NewEvent::new(
                    EngineEvent::ActionDispatched.as_str(),
                    json!({
                        "action_id": action_id,
                        "call_id": call_id,
                        "node": node,
                        "step": step,
                        "idempotency_key": ctx.idempotency_key,
                    }),
                )
                .at_node(Some(&node)),
            ])
            .await?;
        }
        let timeout = spec
            .timeout
            .as_ref()
            .map(|t| Duration::from_millis(t.after_ms))
            .unwrap_or(Duration::from_secs(3600));
        let cancel = ctx.cancel.clone();
        let in_flight = rein_store::metrics::InFlight::start();
        let attempt_span = tracing::info_span!("rein.action", rein.node = %node,
            rein.action = %action, rein.step = self.state.steps_completed + 1,
            rein.attempt = self.state.attempt);
        let ctx = self.resolved(ctx).await;
        let outcome = tokio::select! {
            outcome = handler.run(ctx).instrument(attempt_span.clone()) => Some(outcome),
            _ = self.held.lost.cancelled() => { cancel.cancel(); return Err(Stop::Lost) }
            _ = self.held.interrupt.cancelled() => { cancel.cancel(); None }
            _ = tokio::time::sleep(timeout) => {
                cancel.cancel();
                if side_effect {
                    Some(Outcome::TimedOut(format!(
                        "execution timeout after {} ms, after the call was sent",
                        timeout.as_millis()
                    )))
                } else {
                    let event = spec.timeout.as_ref().map(|t| t.event.clone()).unwrap_or_default();
                    let failure = Failure::transient(
                        retry_kind::TIMEOUT,
                        &format!("execution timeout after {} ms", timeout.as_millis()),
                    );
                    Some(Outcome::event(&event, json!({ "reason": "timeout", "error": failure.to_json() })))
                }
            }
        };
        if let Some(outcome) = &outcome {
            crate::trace::record_outcome(&attempt_span, outcome);
        }
        drop(attempt_span);
        drop(in_flight);
        if let Some(Outcome::Model(reply)) = &outcome
            && let Some(used) = reply.replied["usage"]["tokens"].as_u64()
        {
            self.inner.limiter.settle_tokens(&permit, used).await;
        }
        drop(permit);
        self.inner.stats.steps.fetch_add(1, Ordering::Relaxed);
        let Some(outcome) = outcome else {
            return self.interrupted(side_effect, &call_id).await;
        };
        match outcome {
            Outcome::Events(candidates) => {
                let candidates = if side_effect {
                    with_call_id(candidates, &call_id)
                } else {
                    candidates
                };
                self.commit_decision(candidates, Some(&node)).await
            }
            Outcome::Decision(decision) => {
                self.commit_model_decision(decision, &node, step, &action_id)
                    .await
            }
            Outcome::Model(reply) => {
                self.commit_model_reply(reply, &node, step, &action_id)
                    .await
            }
            Outcome::InDoubt(reason) => {
                self.answer_lost(side_effect, &call_id, retry_kind::IN_DOUBT, &reason)
                    .await
            }
            Outcome::TimedOut(reason) => {
                self.answer_lost(side_effect, &call_id, retry_kind::TIMEOUT, &reason)
                    .await
            }
        }
    }

    /// No answer came back (`kind` says why): a dispatched call is in doubt; anything else
    /// was never recorded as sent, so only an operator can tell what happened.
    async fn answer_lost(
        &mut self,
        dispatched: bool,
        call_id: &str,
        kind: &str,
        reason: &str,
    ) -> Result<(), Stop> {
        if !dispatched {
            return self.operator_required(reason).await;
        }
        self.commit(vec![in_doubt_event(call_id, kind, reason)])
            .await
    }

    /// An in-doubt call its reconcile hook found not applied: recorded, and followed in the
    /// same commit by the state's failure event, so dispatching it again is a retry on the
    /// definition's retry path (attempt counted, backoff and Retry-After waited, the
    /// exhausted path at the end) rather than an immediate re-dispatch.
    async fn not_applied(
        &mut self,
        slot: &rein_core::ActionSlot,
        call_id: &str,
    ) -> Result<(), Stop> {
        let record = NewEvent::new(
            EngineEvent::ActionNotApplied.as_str(),
            json!({ "call_id": call_id, "by": "reconcile" }),
        );
        // The fine class of why the answer was lost (e.g. `timeout`), as the in-doubt record
        // kept it.
        let lost = slot.lost.as_deref().unwrap_or(retry_kind::IN_DOUBT);
        let failure = Failure::transient(
            lost,
            "the call's answer was lost and its reconcile found it not applied",
        );
        let mut events = vec![record];
        if let Some((kind, mut payload)) = rein_core::retry::lost_attempt_event(
            &self.def,
            &self.state,
            (&events[0].kind, &events[0].payload),
            LostAttempt::NotApplied,
            &failure,
        ) {
            let tool = slot.tool.as_deref();
            if tool
                .and_then(|t| self.def.tool(&slot.node, t))
                .is_some_and(|t| !t.retryable)
            {
                payload["error"]["retryable"] = json!(false);
            }
            events.push(NewEvent::new(kind, payload).at_node(Some(&slot.node)));
        }
        self.commit(events).await
    }

    /// `ctx` with the blob references among the run's results replaced by the values they
    /// name (SPEC E5), newest first, while the content read stays within
    /// [`RESOLVED_BYTES_MAX`]: a handler gets what the tools returned, not where it is
    /// stored. Only a reference the run (or a run it was forked from) recorded when it
    /// stored the blob is read. A reference past the bound, one the run did not record, or
    /// one whose content cannot be read or does not match its hash, stays as it is (and the
    /// latter two are logged).
    async fn resolved(&self, mut ctx: ActionContext) -> ActionContext {
        let mut left = RESOLVED_BYTES_MAX;
        for result in ctx.run.results.iter_mut().rev() {
            let Some(value) = result.get_mut("value") else {
                continue;
            };
            let Some(blob) = rein_core::blob::reference_of(value) else {
                continue;
            };
            if blob.bytes > left {
                continue;
            }
            match self.inner.store.read_blob_of(self.run_id, &blob).await {
                Ok(Some(read)) => {
                    *value = read;
                    left -= blob.bytes;
                }
                Ok(None) => {
                    warn!(run_id = %self.run_id, sha256 = %blob.sha256,
                        "a result refers to a blob this run did not store; the handler gets its reference");
                }
                Err(e) => {
                    warn!(run_id = %self.run_id, sha256 = %blob.sha256, error = %e,
                        "a result's blob cannot be read; the handler gets its reference");
                }
            }
        }
        ctx
    }

    fn context(&self, node: &str, step: u32, action_id: &str, call_id: &str) -> ActionContext {
        ActionContext {
            run_id: self.run_id,
            definition: self.def.clone(),
            node: node.to_owned(),
            run: self.state.clone(),
            step,
            action_id: action_id.to_owned(),
            idempotency_key: rein_core::hash::idempotency_key(
                &self.run_id.to_string(),
                node,
                action_id,
            ),
            call_id: call_id.to_owned(),
            args: json!({}),
            fencing_token: self.token,
            worker_id: self.inner.config.worker_id.clone(),
            cancel: self.held.lost.child_token(),
            deltas: self.inner.deltas.clone(),
        }
    }

    /// Commits the strongest candidate the definition accepts (SPEC M6); when none is
    /// accepted, records DECISION_REJECTED and asks for an operator.
    async fn commit_decision(
        &mut self,
        candidates: Vec<(String, Value)>,
        node: Option<&str>,
    ) -> Result<(), Stop> {
        match rein_core::decide(&self.def, &self.state, &candidates) {
            Ok((i, _)) => {
                let (kind, payload) = candidates[i].clone();
                self.commit(vec![NewEvent::new(kind, payload).at_node(node)])
                    .await
            }
            Err(rejections) => {
                for r in &rejections {
                    rein_store::metrics::transition_refused(
                        self.def.name(),
                        self.run_id,
                        r,
                        node.unwrap_or("handler"),
                    );
                }
                let reasons: Vec<Value> = rejections
                    .iter()
                    .map(|r| json!({ "event": r.event, "reason": r.reason.to_string(), "code": r.reason.code() }))
                    .collect();
                self.commit(vec![
                    NewEvent::new(
                        EngineEvent::DecisionRejected.as_str(),
                        json!({ "step": "transition", "rejections": reasons }),
                    ),
                    NewEvent::new(
                        EngineEvent::OperatorRequired.as_str(),
                        json!({ "reason": "no candidate event was accepted" }),
                    ),
                ])
                .await
            }
        }
    }

    /// An action stopped by a CANCEL waiting in the inbox: the inbox applies it; a call that
    /// was dispatched is recorded as in doubt, since it may have been applied.
    async fn interrupted(&mut self, dispatched: bool, call_id: &str) -> Result<(), Stop> {
        self.held.inbox_pending.store(true, Ordering::Release);
        if dispatched {
            self.commit(vec![in_doubt_event(
                call_id,
                retry_kind::IN_DOUBT,
                "cancelled while running",
            )])
            .await?;
        }
        Ok(())
    }

    /// Validates a model's decision (SPEC D1) and commits what it leads to: a rejection
    /// (DECISION_REJECTED, then the state's `on_rejected_decision` or an operator), a proposed
    /// event the reducer still judges, an approval request, or a tool call.
    async fn commit_model_decision(
        &mut self,
        decision: Value,
        node: &str,
        step: u32,
        action_id: &str,
    ) -> Result<(), Stop> {
        let mut validated = rein_core::decision::validate(&self.def, &self.state, &decision);
        if matches!(validated, Ok(Valid::Call(_))) && self.state.pending_call().is_some() {
            // The node's own call (an `http` node is dispatched) is still open: one step
            // cannot hold two calls.
            validated = Err(rein_core::decision::Rejection {
                step: rein_core::decision::Step::Tool,
                reason: "this node's own call is still open: a node dispatched as a call cannot also call a tool in the same step; let a side-effect-free model node decide".into(),
            });
        }
        let call = match validated {
            Err(rejection) => return self.commit_rejection(&rejection, &decision, node).await,
            Ok(Valid::Event { kind, payload }) => {
                return self
                    .commit_decision(vec![(kind, payload)], Some(node))
                    .await;
            }
            Ok(Valid::Call(call)) => call,
        };
        let mut approval = None;
        if call.needs_approval {
            match self
                .inner
                .store
                .granted_approval(self.run_id, &call.action_hash)
                .await
            {
                Ok(Some(grant)) => approval = Some(grant.approval_id),
                Ok(None) => return self.ask_for_approval(&call, node).await,
                Err(e) => {
                    warn!(run_id = %self.run_id, error = %e, "cannot read approvals; handing the run back");
                    return Err(self.release().await);
                }
            }
        }
        self.call_tool(call, node, step, action_id, approval).await
    }

    /// The call a person approved at `node` that the engine is to run now, with the grant the
    /// dispatch uses up: the run's newest decision granted an unused request of this node
    /// (`Some(grant)`), or an approved call failed in a way that may be retried and its step
    /// is open again (`None`: the same call under the same key, no new approval). The call
    /// is validated again in the current state and must hash to what was approved; anything
    /// else leaves the step to the node's own action.
    async fn approved_call(
        &mut self,
        node: &str,
    ) -> Result<Option<(ToolCall, Option<Uuid>)>, Stop> {
        let store = self.inner.store.clone();
        let found = match &self.state.action {
            Some(slot) if slot.status == ActionStatus::Failed && slot.node == node => {
                match (&slot.tool, &slot.action_hash) {
                    (Some(_), Some(hash)) => store
                        .spent_grant(self.run_id, hash)
                        .await
                        .map(|a| a.map(|a| (a, None))),
                    _ => Ok(None),
                }
            }
            Some(_) => Ok(None),
            None => {
                let last = &self.state.data["last_approval"];
                match last["approval_id"]
                    .as_str()
                    .and_then(|id| id.parse::<Uuid>().ok())
                {
                    Some(id) if last["granted"] == json!(true) => match store.approval(id).await {
                        Ok(a) => Ok(Some((a, Some(id)))),
                        Err(StoreError::Invalid(_)) => Ok(None),
                        Err(e) => Err(e),
                    },
                    _ => Ok(None),
                }
            }
        };
        let (approval, grant) = match found {
            Ok(Some(found)) => found,
            Ok(None) => return Ok(None),
            Err(e) => {
                warn!(run_id = %self.run_id, error = %e, "cannot read approvals; handing the run back");
                return Err(self.release().await);
            }
        };
        let unused = approval.status == "granted" && approval.consumed_at.is_none();
        if approval.run_id != self.run_id || approval.node != node || (grant.is_some() && !unused) {
            return Ok(None);
        }
        let decision = json!({
            "decision": rein_core::decision::CALL_TOOL,
            "tool": approval.tool,
            "args": approval.args,
        });
        match rein_core::decision::validate(&self.def, &self.state, &decision) {
            Ok(Valid::Call(call)) if call.action_hash == approval.action_hash => {
                Ok(Some((call, grant)))
            }
            _ => {
                warn!(run_id = %self.run_id, approval_id = %approval.approval_id,
                    "the approved call no longer validates to what was approved; the node decides again");
                Ok(None)
            }
        }
    }

    /// Records a refused decision (DECISION_REJECTED with its step), then the state's
    /// `on_rejected_decision` or an operator request.
    async fn commit_rejection(
        &mut self,
        rejection: &rein_core::decision::Rejection,
        decision: &Value,
        node: &str,
    ) -> Result<(), Stop> {
        warn!(run_id = %self.run_id, step = rejection.step.as_str(), reason = %rejection.reason, "decision rejected");
        let next = self
            .def
            .state(&self.state.state)
            .and_then(|s| s.on_rejected_decision.clone());
        let reason = format!(
            "the model's decision failed at `{}`: {}",
            rejection.step.as_str(),
            rejection.reason
        );
        let follow = match next {
            Some(event) => NewEvent::new(
                event,
                json!({ "reason": reason, "error": { "class": "decision", "step": rejection.step.as_str() } }),
            ),
            None => NewEvent::new(
                EngineEvent::OperatorRequired.as_str(),
                json!({ "reason": reason }),
            ),
        };
        self.commit(vec![
            NewEvent::new(
                EngineEvent::DecisionRejected.as_str(),
                rejection.payload(decision),
            )
            .at_node(Some(node)),
            follow.at_node(Some(node)),
        ])
        .await
    }

    /// A `model` action's reply: MODEL_REPLIED first (prompt by hash, reply, model, usage —
    /// the run's budgets see the usage there, and a budget it exhausts ends the step), then
    /// the decision it carried on the one decision path, or its rejection at step `parse`.
    async fn commit_model_reply(
        &mut self,
        reply: crate::handler::ModelReply,
        node: &str,
        step: u32,
        action_id: &str,
    ) -> Result<(), Stop> {
        self.blobs = reply.blobs;
        let said = reply.replied.get("reply").cloned().unwrap_or(Value::Null);
        self.commit(vec![
            NewEvent::new(EngineEvent::ModelReplied.as_str(), reply.replied).at_node(Some(node)),
        ])
        .await?;
        if self.state.state != node || self.state.status(&self.def) != RunStatus::Runnable {
            return Ok(());
        }
        match reply.decision {
            Ok(decision) => {
                self.commit_model_decision(decision, node, step, action_id)
                    .await
            }
            Err(reason) => {
                let rejection = rein_core::decision::Rejection {
                    step: rein_core::decision::Step::Parse,
                    reason,
                };
                self.commit_rejection(&rejection, &said, node).await
            }
        }
    }

    /// Opens (or reuses) a request for exactly this call and takes the run to its approval
    /// wait; any request for a different action of the run becomes void (SPEC H2).
    async fn ask_for_approval(&mut self, call: &ToolCall, node: &str) -> Result<(), Stop> {
        let ask = rein_store::ApprovalAsk {
            run_id: self.run_id,
            node,
            tool: &call.tool,
            args: &call.args,
            action_hash: &call.action_hash,
            risk: if call.side_effect { "high" } else { "normal" },
            expires_after_ms: call.approval_expires_after_ms.unwrap_or(3_600_000),
        };
        let request = match self.inner.store.request_approval(ask).await {
            Ok(r) => r,
            Err(e) => {
                warn!(run_id = %self.run_id, error = %e, "cannot open an approval request; handing the run back");
                return Err(self.release().await);
            }
        };
        info!(run_id = %self.run_id, approval_id = %request.approval_id, tool = %call.tool, "approval requested");
        self.commit(vec![
            NewEvent::new(
                EngineEvent::ApprovalRequested.as_str(),
                json!({
                    "approval_id": request.approval_id,
                    "action_hash": call.action_hash,
                    "tool": call.tool,
                    "args": call.args,
                    "expires_at": request.expires_at,
                }),
            )
            .at_node(Some(node)),
            NewEvent::new(
                call.approval_event.clone(),
                json!({ "tool": call.tool, "args": call.args, "approval_id": request.approval_id }),
            )
            .at_node(Some(node)),
        ])
        .await
    }

    /// Runs a validated tool call: recorded as dispatched first when it has side effects or
    /// uses a grant (the grant is used up by that same commit), then executed outside any
    /// transaction, then its result events committed.
    async fn call_tool(
        &mut self,
        call: ToolCall,
        node: &str,
        step: u32,
        action_id: &str,
        approval: Option<Uuid>,
    ) -> Result<(), Stop> {
        let Some(handler) = self.inner.registry.get(&format!("tool:{}", call.tool)) else {
            return self
                .operator_required(&format!(
                    "no handler for tool `{}` on this worker",
                    call.tool
                ))
                .await;
        };
        let permit = self.admit(node, Some(&call.tool)).await?;
        let call_id = Uuid::now_v7().to_string();
        let mut ctx = self.context(node, step, action_id, &call_id);
        ctx.args = call.args.clone();
        let dispatched = call.side_effect || approval.is_some();
        if dispatched {
            self.direct = permit.limited();
            self.commit_with(
                vec![
                    NewEvent::new(
                        EngineEvent::ActionDispatched.as_str(),
                        json!({
                            "action_id": action_id,
                            "call_id": call_id,
                            "node": node,
                            "step": step,
                            "idempotency_key": ctx.idempotency_key,
                            "tool": call.tool,
                            "action_hash": call.action_hash,
                            "approval_id": approval,
                        }),
                    )
                    .at_node(Some(node)),
                ],
                Vec::new(),
                false,
                approval,
                None,
            )
            .await?;
        }
        let timeout = Duration::from_millis(call.timeout_ms.unwrap_or(3_600_000));
        let cancel = ctx.cancel.clone();
        let in_flight = rein_store::metrics::InFlight::start();
        let attempt_span = tracing::info_span!("rein.action", rein.tool = %call.tool,
            rein.step = self.state.steps_completed + 1, rein.attempt = self.state.attempt);
        let ctx = self.resolved(ctx).await;
        let outcome = tokio::select! {
            outcome = handler.run(ctx).instrument(attempt_span.clone()) => outcome,
            _ = self.held.lost.cancelled() => { cancel.cancel(); return Err(Stop::Lost) }
            _ = self.held.interrupt.cancelled() => {
                cancel.cancel();
                return self.interrupted(dispatched, &call_id).await;
            }
            _ = tokio::time::sleep(timeout) => {
                cancel.cancel();
                Outcome::TimedOut(format!("tool `{}` timed out after {} ms", call.tool, timeout.as_millis()))
            }
        };
        crate::trace::record_outcome(&attempt_span, &outcome);
        drop(attempt_span);
        drop(in_flight);
        drop(permit);
        self.inner.stats.steps.fetch_add(1, Ordering::Relaxed);
        match outcome {
            Outcome::Events(candidates) => {
                let candidates = if dispatched {
                    with_call_id(candidates, &call_id)
                } else {
                    candidates
                };
                let candidates = if call.retryable {
                    candidates
                } else {
                    not_retryable(candidates)
                };
                self.commit_decision(candidates, Some(node)).await
            }
            Outcome::InDoubt(reason) => {
                self.answer_lost(dispatched, &call_id, retry_kind::IN_DOUBT, &reason)
                    .await
            }
            Outcome::TimedOut(reason) => {
                self.answer_lost(dispatched, &call_id, retry_kind::TIMEOUT, &reason)
                    .await
            }
            Outcome::Decision(_) | Outcome::Model(_) => {
                self.operator_required(&format!(
                    "tool `{}` answered with a decision; tools answer with events",
                    call.tool
                ))
                .await
            }
        }
    }

    async fn operator_required(&mut self, reason: &str) -> Result<(), Stop> {
        error!(run_id = %self.run_id, state = %self.state.state, reason, "run needs an operator");
        self.commit(vec![NewEvent::new(
            EngineEvent::OperatorRequired.as_str(),
            json!({ "reason": rein_core::text::storable(reason) }),
        )])
        .await
    }

    /// Applies inbox entries the current state accepts; records expired ones.
    async fn apply_inbox(&mut self) -> Result<(), Stop> {
        let entries = match self.inner.store.inbox(self.run_id).await {
            Ok(e) => e,
            Err(e) => {
                warn!(run_id = %self.run_id, error = %e, "cannot read the inbox; will try at the next commit point");
                self.held.inbox_pending.store(true, Ordering::Release);
                return Ok(());
            }
        };
        let (events, consumed) = rein_store::plan_inbox(&self.def, &self.state, entries);
        if events.is_empty() {
            return Ok(());
        }
        self.commit_with(events, consumed, false, None, None).await
    }

    async fn release(&mut self) -> Stop {
        if self.held.lost.is_cancelled() {
            return Stop::Lost;
        }
        match self
            .commit_with(Vec::new(), Vec::new(), true, None, None)
            .await
        {
            Ok(()) => Stop::Released,
            Err(stop) => stop,
        }
    }

    async fn commit(&mut self, events: Vec<NewEvent>) -> Result<(), Stop> {
        self.commit_with(events, Vec::new(), false, None, None)
            .await
    }

    /// What a call of the model node at `node` books against `tpm` limits before it starts:
    /// its `max_tokens` (the reply's ceiling), else [`MODEL_TOKENS_BOOKED_DEFAULT`]; 0 for
    /// any other action.
    fn model_tokens_booked(&self, node: &str) -> u64 {
        match self.def.state(node).and_then(|s| s.model.as_ref()) {
            Some(model) => model
                .max_tokens
                .map_or(MODEL_TOKENS_BOOKED_DEFAULT, u64::from),
            None => 0,
        }
    }

    /// Waits for the fleet-wide limits of the action at `node` (SPEC K1) — the call of `tool`
    /// when given, else the state's own action — at most the configured time. When they will
    /// not allow it by then, records ACTION_DEFERRED and hands the run back until they will:
    /// not a failure, no retry counted, no worker slot held meanwhile.
    async fn admit(
        &mut self,
        node: &str,
        tool: Option<&str>,
    ) -> Result<rein_accel::limits::Permit, Stop> {
        if !self.inner.limiter.any(self.def.limits()) {
            return Ok(rein_accel::limits::Permit::default());
        }
        let keys = match tool {
            Some(tool) => vec![format!("tool:{tool}")],
            None => self.def.limit_keys(node, None),
        };
        let holder = format!("{}/{}", self.inner.config.worker_id, self.run_id);
        // A model call books its reply's ceiling against `tpm` limits; the reply's usage
        // corrects it (see `settle_tokens`).
        let tokens = match tool {
            None => self.model_tokens_booked(node),
            Some(_) => 0,
        };
        let admission = self
            .inner
            .limiter
            .admit(&keys, self.def.limits(), &holder, tokens, &self.held.lost)
            .await;
        if self.held.lost.is_cancelled() {
            return Err(Stop::Lost);
        }
        let (key, limit, wait_ms) = match admission {
            rein_accel::limits::Admission::Go(permit) => return Ok(permit),
            rein_accel::limits::Admission::Defer {
                key,
                limit,
                wait_ms,
            } => (key, limit, wait_ms),
        };
        debug!(run_id = %self.run_id, key, limit, wait_ms, "action deferred by a fleet-wide limit");
        let deferred = NewEvent::new(
            EngineEvent::ActionDeferred.as_str(),
            json!({ "key": key, "limit": limit, "wait_ms": wait_ms, "node": node }),
        )
        .at_node(Some(node));
        let outcome = self
            .commit_with(vec![deferred], Vec::new(), true, None, Some(wait_ms))
            .await;
        // This worker looks again when the run is due, without waiting for its poll.
        let wakeups = self.inner.wakeups.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(wait_ms)).await;
            wakeups.notify_one();
        });
        match outcome {
            Ok(()) => Err(Stop::Released),
            Err(stop) => Err(stop),
        }
    }

    /// Commits under this worker's token, retrying transient database errors until the lease
    /// would have expired (a retry is safe: event ids make it idempotent).
    async fn commit_with(
        &mut self,
        events: Vec<NewEvent>,
        consumed: Vec<i64>,
        release: bool,
        approval: Option<Uuid>,
        defer_ms: Option<u64>,
    ) -> Result<(), Stop> {
        let plan = CommitPlan {
            writer: Writer::Leased,
            release,
            jitter_sample: rand::random::<f64>(),
        };
        let (events, blobs) = match externalize(events, self.inner.config.payload_inline_bytes) {
            Ok(split) => split,
            Err(e) => {
                return Box::pin(
                    self.operator_required(&format!("an action's result cannot be recorded: {e}")),
                )
                .await;
            }
        };
        let n_events = events.len() as u64;
        let request = match plan_commit(
            &self.def,
            self.run_id,
            self.token,
            &self.state,
            events,
            consumed,
            plan,
        ) {
            Ok(mut r) => {
                r.approval = approval;
                r.blobs = blobs;
                for b in std::mem::take(&mut self.blobs) {
                    if !r.blobs.iter().any(|x| x.sha256 == b.sha256) {
                        r.blobs.push(b);
                    }
                }
                r.defer_ms = defer_ms;
                r
            }
            Err(e) => {
                warn!(run_id = %self.run_id, state = %e.state, event = %e.event, reason = %e.reason, "rejected transition");
                return Err(self.release_boxed().await);
            }
        };
        if request.release {
            self.held.releasing.store(true, Ordering::Release);
        }
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(self.inner.config.lease_ttl_ms);
        let mut pause = Duration::from_millis(50);
        let mut request = request;
        loop {
            let outcome = if std::mem::take(&mut self.direct) {
                self.inner
                    .stats
                    .commit_statements
                    .fetch_add(1, Ordering::Relaxed);
                self.inner
                    .store
                    .commit_batch(&self.inner.config.worker_id, std::slice::from_ref(&request))
                    .await
                    .map(|mut o| o.pop().unwrap_or(CommitOutcome::RunNotFound))
            } else {
                let (tx, rx) = oneshot::channel();
                let sent = self
                    .inner
                    .commits
                    .send(CommitJob { request, reply: tx })
                    .await;
                match (sent, rx.await) {
                    (Ok(()), Ok((back, outcome))) => {
                        request = back;
                        outcome
                    }
                    _ => return Err(Stop::Lost),
                }
            };
            match outcome {
                Ok(CommitOutcome::Committed(c)) => {
                    let release = request.release;
                    self.after_commit(request, n_events, c.inbox_pending);
                    // A commit into a parked or terminal state released the lease too.
                    return if release { Err(Stop::Released) } else { Ok(()) };
                }
                Ok(CommitOutcome::AlreadyCommitted { .. }) => {
                    let release = request.release;
                    self.after_commit(request, n_events, true);
                    return if release { Err(Stop::Released) } else { Ok(()) };
                }
                Ok(CommitOutcome::Fenced {
                    current_token,
                    owner,
                    reason,
                    ..
                }) => {
                    warn!(run_id = %self.run_id, token = self.token, current_token, owner = ?owner,
                          %reason, "fenced: {reason}; stopping without writing");
                    // Stop the action first; counting may wait on the database.
                    self.held.lost.cancel();
                    self.inner.stats.fenced.fetch_add(1, Ordering::Relaxed);
                    let _ = self
                        .inner
                        .store
                        .add_counter(counters::FENCED_WRITES, 1)
                        .await;
                    return Err(Stop::Lost);
                }
                Ok(CommitOutcome::RunNotFound) => {
                    error!(run_id = %self.run_id, "run vanished");
                    return Err(Stop::Lost);
                }
                Err(e) if e.is_transient() && tokio::time::Instant::now() < deadline => {
                    warn!(run_id = %self.run_id, error = %e, "commit failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => {
                    error!(run_id = %self.run_id, error = %e, "commit failed; the lease will lapse");
                    return Err(Stop::Lost);
                }
            }
        }
    }

    async fn release_boxed(&mut self) -> Stop {
        Box::pin(self.release()).await
    }

    fn after_commit(&mut self, request: CommitRequest, n_events: u64, inbox_pending: bool) {
        if self.state.state != request.state.state {
            info!(run_id = %self.run_id, from = %self.state.state, to = %request.state.state,
                  sequence = request.state.sequence, token = self.token, "transition");
        }
        let finished = request.status == RunStatus::Terminal;
        self.state = request.state;
        if finished {
            self.inner
                .stats
                .runs_finished
                .fetch_add(1, Ordering::Relaxed);
        }
        self.inner.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.inner
            .stats
            .events_committed
            .fetch_add(n_events, Ordering::Relaxed);
        if inbox_pending {
            self.held.inbox_pending.store(true, Ordering::Release);
        }
    }
}

/// Most bytes of blob content read back into one action's context (`Driver::resolved`).
pub const RESOLVED_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Moves the large fields of every event's payload to blobs (SPEC E5).
fn externalize(
    events: Vec<NewEvent>,
    threshold_bytes: usize,
) -> Result<(Vec<NewEvent>, Vec<rein_core::blob::Blob>), rein_core::blob::PayloadError> {
    let mut blobs: Vec<rein_core::blob::Blob> = Vec::new();
    let mut out = Vec::with_capacity(events.len());
    for mut e in events {
        let (payload, found) = rein_core::blob::externalize(&e.payload, threshold_bytes)?;
        e.payload = payload;
        for b in found {
            if !blobs.iter().any(|x| x.sha256 == b.sha256) {
                blobs.push(b);
            }
        }
        out.push(e);
    }
    Ok((out, blobs))
}

/// ACTION_RESULT_IN_DOUBT of `call_id`, with why the answer was lost as its error (class
/// `in_doubt`, fine class `kind`).
fn in_doubt_event(call_id: &str, kind: &str, reason: &str) -> NewEvent {
    let failure = Failure::in_doubt(kind, reason);
    NewEvent::new(
        EngineEvent::ActionResultInDoubt.as_str(),
        json!({ "call_id": call_id, "reason": failure.message, "error": failure.to_json() }),
    )
}

/// The failures among a tool's result candidates, marked not retryable: the tool declares
/// `retryable = false` (SPEC X6), so its run takes the exhausted path, not a retry.
fn not_retryable(candidates: Vec<(String, Value)>) -> Vec<(String, Value)> {
    candidates
        .into_iter()
        .map(|(kind, mut payload)| {
            if let Some(Value::Object(error)) = payload.get_mut("error") {
                error.insert("retryable".into(), Value::Bool(false));
            }
            (kind, payload)
        })
        .collect()
}

fn with_call_id(candidates: Vec<(String, Value)>, call_id: &str) -> Vec<(String, Value)> {
    candidates
        .into_iter()
        .map(|(kind, mut payload)| {
            if !payload.is_object() {
                payload = json!({ "value": payload });
            }
            if let Value::Object(map) = &mut payload {
                map.insert("call_id".into(), Value::String(call_id.to_owned()));
            }
            (kind, payload)
        })
        .collect()
}
