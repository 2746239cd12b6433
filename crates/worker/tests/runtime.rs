//! The worker runtime and the scheduler against a real PostgreSQL (SPEC X1–X8, S1–S3, M9).
//! Only external tools are faked (the handlers below); the database is real.

// The fixtures are the store tests' own: one copy for both crates.
use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::{assert_replays, enqueue, event_types, store, wait_state, wait_until};
use rein_core::{Definition, EngineEvent, Format, GuardRegistry};
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{EnqueueRequest, SendOutcome, Sender, Store, StoreError, counters};
use rein_worker::{
    ActionContext, BoxFuture, NodeHandler, Outcome, Reconciled, Registry, Worker, WorkerConfig,
    builtin_registry,
};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(30);

fn lifecycle() -> Definition {
    rein_core::builtin::lifecycle()
}

fn config(id: &str, lease_ttl_ms: u64) -> WorkerConfig {
    let mut c = WorkerConfig::new(id);
    c.lease_ttl_ms = lease_ttl_ms;
    c.poll_interval_ms = 20;
    c.shutdown_grace_ms = 1_000;
    c
}

struct Running {
    worker: Worker,
    stop: CancellationToken,
    task: JoinHandle<Result<(), StoreError>>,
}

impl Running {
    fn start(store: &Store, config: WorkerConfig, registry: Registry) -> Running {
        let worker = Worker::new(store.clone(), config, registry);
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (worker, stop) = (worker.clone(), stop.clone());
            async move { worker.run(stop).await }
        });
        Running { worker, stop, task }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.expect("worker task").expect("worker run");
    }
}

fn background_scheduler(store: &Store) -> (CancellationToken, JoinHandle<()>) {
    let stop = CancellationToken::new();
    let mut config = SchedulerConfig::new("sched-bg");
    config.tick_ms = 50;
    let mut scheduler = Scheduler::new(store.clone(), config);
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            scheduler.run(stop).await.expect("scheduler run");
        }
    });
    (stop, task)
}

async fn db_bool(store: &Store, sql: &str, run: Uuid) -> bool {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(run)
        .fetch_one(store.pool())
        .await
        .expect("query")
}

/// True while the run's timer is not yet due by the database clock.
async fn timer_pending(store: &Store, run: Uuid) -> bool {
    db_bool(
        store,
        "SELECT wake_at > clock_timestamp() FROM rein_runs WHERE run_id = $1",
        run,
    )
    .await
}

async fn count_events(store: &Store, run: Uuid, kind: &str) -> usize {
    event_types(store, run)
        .await
        .iter()
        .filter(|k| *k == kind)
        .count()
}

async fn effects(store: &Store, run: Uuid) -> Vec<String> {
    sqlx::query_scalar("SELECT worker FROM rein_sim_effects WHERE run_id = $1")
        .bind(run)
        .fetch_all(store.pool())
        .await
        .expect("effects")
}

async fn expire_lease(store: &Store, run: Uuid) {
    sqlx::query("UPDATE rein_runs SET lease_until = now() - interval '1 s' WHERE run_id = $1")
        .bind(run)
        .execute(store.pool())
        .await
        .expect("expire lease");
}

/// `lifecycle` at the next version with a 1.5 s first backoff, so "before the timer is due"
/// is a window a busy machine can observe. Named `lifecycle` so the built-in `sim` drives it.
async fn slow_retry_lifecycle(store: &Store) -> Definition {
    let next = rein_core::builtin::lifecycle().version() + 1;
    let text = rein_core::builtin::source_at_version("lifecycle", next)
        .expect("a built-in")
        .replacen("initial_interval_ms = 200", "initial_interval_ms = 1500", 1);
    let def = Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("parse");
    store.register_definition(&def).await.expect("register");
    def
}

fn chrono_ms(ms: i64) -> chrono::TimeDelta {
    chrono::TimeDelta::milliseconds(ms)
}

fn complete_with(result: Value) -> Outcome {
    Outcome::event("complete", json!({ "result": result }))
}

/// A fake external tool for `lifecycle`: `planned` emits `start`; `running` is a side
/// effect applied by idempotency key on the sim ledger. The worker named `blocked` announces
/// its call and then waits for `release` before applying it.
struct SlowTool {
    store: Store,
    blocked: &'static str,
    started: mpsc::UnboundedSender<(String, CancellationToken)>,
    release: Arc<Notify>,
}

impl NodeHandler for SlowTool {
    fn side_effect(&self, ctx: &ActionContext) -> bool {
        ctx.node == "running"
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let (store, started, release) = (
            self.store.clone(),
            self.started.clone(),
            self.release.clone(),
        );
        let blocked = ctx.worker_id == self.blocked;
        Box::pin(async move {
            if ctx.node == "planned" {
                return Outcome::event("start", json!({}));
            }
            let _ = started.send((ctx.worker_id.clone(), ctx.cancel.clone()));
            if blocked {
                release.notified().await;
            }
            let result = json!({ "paid": 10 });
            match store
                .sim_apply(
                    ctx.run_id,
                    &ctx.node,
                    ctx.step as i32,
                    &ctx.idempotency_key,
                    &ctx.worker_id,
                    &result,
                )
                .await
            {
                Ok((first, _)) => complete_with(first),
                Err(e) => Outcome::InDoubt(e.to_string()),
            }
        })
    }

    fn reconcile(&self, ctx: ActionContext) -> Option<BoxFuture<Result<Reconciled, String>>> {
        let store = self.store.clone();
        Some(Box::pin(async move {
            match store.sim_lookup(&ctx.idempotency_key).await {
                Ok(Some(result)) => Ok(Reconciled::Applied(vec![(
                    "complete".into(),
                    json!({ "result": result }),
                )])),
                Ok(None) => Ok(Reconciled::NotApplied),
                Err(e) => Err(e.to_string()),
            }
        }))
    }
}

/// `planned` waits for `release` before emitting `start`; `running` completes at once.
struct Gate {
    started: mpsc::UnboundedSender<()>,
    release: Arc<Notify>,
}

impl NodeHandler for Gate {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let (started, release) = (self.started.clone(), self.release.clone());
        Box::pin(async move {
            if ctx.node == "planned" {
                let _ = started.send(());
                release.notified().await;
                return Outcome::event("start", json!({}));
            }
            Outcome::event("complete", json!({}))
        })
    }
}

/// `running` runs until cancelled; a watcher reports the cancellation it observed.
struct UntilCancelled {
    observed: mpsc::UnboundedSender<()>,
    started: mpsc::UnboundedSender<()>,
}

impl NodeHandler for UntilCancelled {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let (observed, started) = (self.observed.clone(), self.started.clone());
        Box::pin(async move {
            if ctx.node == "planned" {
                return Outcome::event("start", json!({}));
            }
            let cancel = ctx.cancel.clone();
            tokio::spawn(async move {
                cancel.cancelled().await;
                let _ = observed.send(());
            });
            let _ = started.send(());
            ctx.cancel.cancelled().await;
            Outcome::event("complete", json!({}))
        })
    }
}

/// `running` applies its effect, then loses the answer.
struct LosesAnswer {
    store: Store,
    hook: bool,
    calls: Arc<AtomicU32>,
}

impl NodeHandler for LosesAnswer {
    fn side_effect(&self, ctx: &ActionContext) -> bool {
        ctx.node == "running"
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let (store, calls) = (self.store.clone(), self.calls.clone());
        Box::pin(async move {
            if ctx.node == "planned" {
                return Outcome::event("start", json!({}));
            }
            calls.fetch_add(1, Ordering::SeqCst);
            store
                .sim_apply(
                    ctx.run_id,
                    &ctx.node,
                    ctx.step as i32,
                    &ctx.idempotency_key,
                    &ctx.worker_id,
                    &json!({ "paid": 5 }),
                )
                .await
                .expect("sim ledger");
            Outcome::InDoubt("connection reset before the answer".into())
        })
    }

    fn reconcile(&self, ctx: ActionContext) -> Option<BoxFuture<Result<Reconciled, String>>> {
        if !self.hook {
            return None;
        }
        let store = self.store.clone();
        Some(Box::pin(async move {
            match store.sim_lookup(&ctx.idempotency_key).await {
                Ok(Some(result)) => Ok(Reconciled::Applied(vec![(
                    "complete".into(),
                    json!({ "result": result }),
                )])),
                Ok(None) => Ok(Reconciled::NotApplied),
                Err(e) => Err(e.to_string()),
            }
        }))
    }
}

fn registry_with(handler: impl NodeHandler + 'static) -> Registry {
    let mut registry = Registry::new();
    registry.register("sim", handler);
    registry
}

async fn recv<T>(rx: &mut mpsc::UnboundedReceiver<T>, what: &str) -> T {
    tokio::time::timeout(LONG, rx.recv())
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .unwrap_or_else(|| panic!("channel closed waiting for {what}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_drives_runs_of_both_builtins_to_terminal() {
    let store = store("drives_builtins").await;
    let research = rein_core::builtin::research_agent();
    let mut runs = Vec::new();
    for failures in [0, 1, 2] {
        let input = json!({ "sim": { "transient_failures": failures, "amount": 3 } });
        runs.push((enqueue(&store, &lifecycle(), input).await, "done", 1));
    }
    for (failures, steps) in [(0, 1), (1, 1), (0, 2)] {
        let input = json!({ "sim": { "transient_failures": failures, "steps": steps } });
        runs.push((enqueue(&store, &research, input).await, "SUCCEEDED", steps));
    }
    let (sched_stop, sched) = background_scheduler(&store);
    let worker = Running::start(
        &store,
        config("worker-a", 5_000),
        builtin_registry(store.clone()),
    );

    wait_until("every run is terminal", Duration::from_secs(60), || async {
        let mut all = true;
        for (run, _, _) in &runs {
            all &= store.run(*run).await.unwrap().status == "terminal";
        }
        all
    })
    .await;
    worker.stop().await;
    sched_stop.cancel();
    sched.await.unwrap();

    for (run, terminal, steps) in &runs {
        let row = store.run(*run).await.unwrap();
        assert_eq!(&row.state, terminal, "run {run}: {:?}", row.terminal_reason);
        assert_eq!(
            effects(&store, *run).await.len(),
            *steps as usize,
            "run {run}: one effect per step, never two"
        );
        assert_replays(&store, *run).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduler_fires_retry_due_after_backoff_by_the_database_clock() {
    let store = store("retry_due").await;
    let def = slow_retry_lifecycle(&store).await;
    let run = enqueue(&store, &def, json!({ "sim": { "transient_failures": 1 } })).await;
    let worker = Running::start(
        &store,
        config("worker-a", 5_000),
        builtin_registry(store.clone()),
    );
    wait_state(&store, run, "retrying").await;

    let row = store.run(run).await.unwrap();
    assert_eq!(row.status, "parked");
    let wake_at = row.wake_at.expect("a retrying run has a timer");
    let backoff_ms = (wake_at - row.state_entered_at).num_milliseconds();
    assert!(
        (1_200..=1_800).contains(&backoff_ms),
        "first backoff 1500 ms ± 20 %, got {backoff_ms} ms"
    );

    let mut sched = Scheduler::new(store.clone(), SchedulerConfig::new("sched-1"));
    assert!(
        timer_pending(&store, run).await,
        "setup too slow: the backoff elapsed before the early tick"
    );
    assert_eq!(sched.tick().await.unwrap(), 0, "nothing is due yet");
    assert_eq!(count_events(&store, run, "retry").await, 0);

    wait_until(
        "the backoff elapsed by the database clock",
        LONG,
        || async { !timer_pending(&store, run).await },
    )
    .await;
    assert_eq!(sched.tick().await.unwrap(), 1);
    assert_eq!(count_events(&store, run, "retry").await, 1);
    assert_eq!(
        sched.tick().await.unwrap(),
        0,
        "a fired timer does not fire again"
    );

    wait_state(&store, run, "done").await;
    worker.stop().await;
    assert_eq!(count_events(&store, run, "retry").await, 1);
    assert_eq!(store.run(run).await.unwrap().projection.attempt, 0);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schedulers_racing_produce_one_event() {
    let store = store("schedulers_race").await;
    let mut runs = Vec::new();
    for _ in 0..10 {
        let run = enqueue(&store, &lifecycle(), json!({})).await;
        store
            .send(run, "start", json!({}), &engine(), 60_000)
            .await
            .unwrap();
        store
            .send(run, "transient_error", json!({}), &engine(), 60_000)
            .await
            .unwrap();
        runs.push(run);
    }
    wait_until("every retry timer is due", LONG, || async {
        store.due_timers(100).await.unwrap().len() == runs.len()
    })
    .await;

    let mut a = Scheduler::new(store.clone(), SchedulerConfig::new("sched-a"));
    let mut b = Scheduler::new(store.clone(), SchedulerConfig::new("sched-b"));
    let (ra, rb) = tokio::join!(a.tick(), b.tick());
    assert_eq!(
        ra.unwrap() + rb.unwrap(),
        runs.len(),
        "each timer fired once in total"
    );
    let fired =
        a.stats.timers_fired.load(Ordering::Relaxed) + b.stats.timers_fired.load(Ordering::Relaxed);
    assert_eq!(fired, runs.len() as u64);
    for run in &runs {
        assert_eq!(count_events(&store, *run, "retry").await, 1, "run {run}");
        assert_eq!(store.run(*run).await.unwrap().state, "running");
        assert_replays(&store, *run).await;
    }
}

const WAIT_TIMEOUT_DEF: &str = r#"
name = "wait-timeout"
version = 1
cancel_state = "cancelled"
events = ["wait", "answer", "expired"]
call_results = []

[[states]]
name = "idle"
kind = "active"
initial = true

[[states]]
name = "waiting"
kind = "waiting"
timeout = { after_ms = 800, event = "expired" }

[[states]]
name = "answered"
kind = "terminal"

[[states]]
name = "timed_out"
kind = "terminal"

[[states]]
name = "cancelled"
kind = "terminal"

[[transitions]]
from = "idle"
event = "wait"
to = "waiting"

[[transitions]]
from = "waiting"
event = "answer"
to = "answered"

[[transitions]]
from = "waiting"
event = "expired"
to = "timed_out"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_state_timeout_fires_at_deadline() {
    let store = store("wait_timeout").await;
    let def = Definition::parse(WAIT_TIMEOUT_DEF, Format::Toml, &GuardRegistry::new())
        .expect("the test definition validates");
    store.register_definition(&def).await.unwrap();
    let run = enqueue(&store, &def, json!({})).await;
    assert_eq!(
        store
            .send(run, "wait", json!({}), &engine(), 60_000)
            .await
            .unwrap(),
        SendOutcome::Applied { sequence: 1 }
    );
    let row = store.run(run).await.unwrap();
    assert_eq!(
        (row.state.as_str(), row.status.as_str()),
        ("waiting", "parked")
    );
    let entered = row.state_entered_at;
    let wake_at = row
        .wake_at
        .expect("a waiting state with a timeout has a timer");
    let after_ms = (wake_at - entered).num_microseconds().unwrap() as f64 / 1000.0;
    assert!(
        (after_ms - 800.0).abs() < 1.0,
        "timer at {after_ms} ms, not 800"
    );

    let mut sched = Scheduler::new(store.clone(), SchedulerConfig::new("sched-1"));
    assert!(
        timer_pending(&store, run).await,
        "setup too slow: the deadline passed before the early tick"
    );
    assert_eq!(sched.tick().await.unwrap(), 0);
    assert_eq!(event_types(&store, run).await, vec!["wait"]);

    wait_until(
        "the deadline passed by the database clock",
        LONG,
        || async { !timer_pending(&store, run).await },
    )
    .await;
    // Due by `wake_at`; the firing itself may take one more tick (see the report on
    // `in_state_ms` rounding), so tick until it fires.
    let end = tokio::time::Instant::now() + LONG;
    while sched.tick().await.unwrap() == 0 {
        assert!(tokio::time::Instant::now() < end, "the timeout never fired");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let history = store.history(run).await.unwrap();
    assert_eq!(event_types(&store, run).await, vec!["wait", "expired"]);
    assert!(
        history[1].occurred_at - entered >= chrono_ms(800),
        "fired before its deadline"
    );
    let row = store.run(run).await.unwrap();
    assert_eq!(row.state, "timed_out");
    assert_eq!(row.terminal_reason.as_deref(), Some("timeout"));
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expired_while_action_runs_fences_the_old_worker() {
    let store = store("lease_expired_action").await;
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let tool = |store: &Store| SlowTool {
        store: store.clone(),
        blocked: "worker-a",
        started: started_tx.clone(),
        release: release.clone(),
    };
    let run = enqueue(&store, &lifecycle(), json!({})).await;
    let mut config_a = config("worker-a", 30_000);
    config_a.concurrency = 1;
    let a = Running::start(&store, config_a, registry_with(tool(&store)));
    let (who, cancel_a) = recv(&mut started, "worker A's call").await;
    assert_eq!(who, "worker-a");
    let token_a = store.run(run).await.unwrap().fencing_token;

    // A stalls past its lease; a scheduler recovers the run and B takes over.
    expire_lease(&store, run).await;
    let mut sched = Scheduler::new(store.clone(), SchedulerConfig::new("sched-1"));
    assert_eq!(sched.tick().await.unwrap(), 1);
    let types = event_types(&store, run).await;
    assert!(types.ends_with(&[
        EngineEvent::LeaseExpired.as_str().to_owned(),
        EngineEvent::ActionResultInDoubt.as_str().to_owned()
    ]));
    // B finds A's call not applied: dispatching it again is a retry, which takes the
    // definition's retry path (its backoff fired by a scheduler).
    let (sched_stop, sched_task) = background_scheduler(&store);
    let b = Running::start(
        &store,
        config("worker-b", 10_000),
        registry_with(tool(&store)),
    );
    wait_state(&store, run, "done").await;
    let (who, _) = recv(&mut started, "worker B's call").await;
    assert_eq!(who, "worker-b");
    let types = event_types(&store, run).await;
    let not_applied = types
        .iter()
        .position(|t| t == "ACTION_NOT_APPLIED")
        .expect("B reconciled A's call");
    assert_eq!(
        &types[not_applied + 1..not_applied + 3],
        ["transient_error", "retry"],
        "{types:?}"
    );

    // A's call finally returns: its commit is refused and its action cancelled.
    assert!(!cancel_a.is_cancelled());
    release.notify_one();
    wait_until("A's stale commit is fenced", LONG, || async {
        a.worker.stats().fenced.load(Ordering::Relaxed) >= 1
    })
    .await;
    assert!(
        cancel_a.is_cancelled(),
        "a fenced writer cancels its action"
    );
    wait_until("the fenced write is counted", LONG, || async {
        store.counter(counters::FENCED_WRITES).await.unwrap() >= 1
    })
    .await;
    a.stop().await;
    b.stop().await;
    sched_stop.cancel();
    sched_task.await.expect("scheduler task");

    assert_eq!(
        effects(&store, run).await,
        vec!["worker-b".to_owned()],
        "applied once"
    );
    let history = store.history(run).await.unwrap();
    assert!(
        history
            .iter()
            .filter(|e| e.worker == "worker-a")
            .all(|e| e.token == token_a),
        "A wrote nothing under a later token"
    );
    let done = history.last().unwrap();
    assert_eq!(
        (done.kind.as_str(), done.worker.as_str()),
        ("complete", "worker-b")
    );
    assert_eq!(count_events(&store, run, "complete").await, 1);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_lost_on_renewal_cancels_the_running_action() {
    let store = store("lease_lost_renewal").await;
    let (observed_tx, mut observed) = mpsc::unbounded_channel();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let run = enqueue(&store, &lifecycle(), json!({})).await;
    let mut config_a = config("worker-a", 900);
    config_a.concurrency = 1;
    let a = Running::start(
        &store,
        config_a,
        registry_with(UntilCancelled {
            observed: observed_tx,
            started: started_tx,
        }),
    );
    recv(&mut started, "the action to start").await;
    let token_a = store.run(run).await.unwrap().fencing_token;
    expire_lease(&store, run).await;
    let mut sched = Scheduler::new(store.clone(), SchedulerConfig::new("sched-1"));
    assert_eq!(sched.tick().await.unwrap(), 1);

    recv(&mut observed, "the action to observe its cancellation").await;
    wait_until("A notices the lost lease", LONG, || async {
        a.worker.stats().leases_lost.load(Ordering::Relaxed) >= 1
    })
    .await;
    a.stop().await;
    let history = store.history(run).await.unwrap();
    assert!(
        history
            .iter()
            .filter(|e| e.worker == "worker-a")
            .all(|e| e.token == token_a)
    );
    assert_eq!(count_events(&store, run, "complete").await, 0);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_sent_while_leased_is_applied_from_the_inbox_by_the_holder() {
    let store = store("inbox_holder").await;
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let run = enqueue(&store, &lifecycle(), json!({})).await;
    let a = Running::start(
        &store,
        config("worker-a", 10_000),
        registry_with(Gate {
            started: started_tx,
            release: release.clone(),
        }),
    );
    recv(&mut started, "the planned action").await;
    let token = store.run(run).await.unwrap().fencing_token;
    let sent = store
        .send(
            run,
            "pause_for_approval",
            json!({ "data": { "why": "review" } }),
            &engine(),
            60_000,
        )
        .await
        .unwrap();
    assert!(matches!(sent, SendOutcome::Queued { .. }), "{sent:?}");
    let entry = store.inbox(run).await.unwrap().remove(0);

    release.notify_one();
    wait_state(&store, run, "paused").await;
    let history = store.history(run).await.unwrap();
    let types: Vec<&str> = history.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(types, vec!["start", "pause_for_approval"]);
    let applied = &history[1];
    assert_eq!(applied.event_id, entry.event_id);
    assert_eq!(
        (applied.worker.as_str(), applied.token),
        ("worker-a", token)
    );
    assert!(store.inbox(run).await.unwrap().is_empty());
    assert_eq!(
        store.run(run).await.unwrap().projection.data["why"],
        "review"
    );

    // Parked and unleased now: an approval applies at once, and the worker finishes.
    assert!(matches!(
        store
            .send(
                run,
                "approval_granted",
                json!({}),
                &Sender::Approver("alice".into()),
                60_000
            )
            .await
            .unwrap(),
        SendOutcome::Applied { .. }
    ));
    wait_state(&store, run, "done").await;
    a.stop().await;
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_sent_mid_action_cancels_it_and_ends_in_the_cancel_state() {
    let store = store("cancel_mid_action").await;
    let (observed_tx, mut observed) = mpsc::unbounded_channel();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let run = enqueue(&store, &lifecycle(), json!({})).await;
    let a = Running::start(
        &store,
        config("worker-a", 900),
        registry_with(UntilCancelled {
            observed: observed_tx,
            started: started_tx,
        }),
    );
    recv(&mut started, "the running action").await;
    let sent = store
        .send(
            run,
            "CANCEL",
            json!({ "reason": "user asked" }),
            &Sender::outside("api"),
            60_000,
        )
        .await
        .unwrap();
    assert!(matches!(sent, SendOutcome::Queued { .. }), "{sent:?}");
    recv(&mut observed, "the action to observe its cancellation").await;
    wait_state(&store, run, "failed").await;
    a.stop().await;

    let row = store.run(run).await.unwrap();
    assert_eq!(row.status, "terminal");
    let reason = row.terminal_reason.unwrap_or_default();
    assert!(reason.starts_with("cancelled"), "terminal reason {reason}");
    assert_eq!(
        event_types(&store, run).await.last().map(String::as_str),
        Some("CANCEL")
    );
    assert_eq!(count_events(&store, run, "complete").await, 0);
    assert!(store.inbox(run).await.unwrap().is_empty());
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_of_a_research_agent_mid_action_ends_in_cancelled() {
    let store = store("cancel_research").await;
    let run = enqueue(
        &store,
        &rein_core::builtin::research_agent(),
        json!({ "sim": { "work_ms": 60_000 } }),
    )
    .await;
    let began = std::time::Instant::now();
    let a = Running::start(
        &store,
        config("worker-a", 900),
        builtin_registry(store.clone()),
    );
    wait_until("the run is leased", LONG, || async {
        store.run(run).await.unwrap().lease_live
    })
    .await;
    let sent = store
        .send(
            run,
            "CANCEL",
            json!({ "reason": "user asked" }),
            &Sender::outside("api"),
            60_000,
        )
        .await
        .unwrap();
    assert!(matches!(sent, SendOutcome::Queued { .. }), "{sent:?}");
    wait_state(&store, run, "CANCELLED").await;
    assert!(
        began.elapsed() < Duration::from_secs(30),
        "the 60 s action was not cut short"
    );
    a.stop().await;
    let reason = store
        .run(run)
        .await
        .unwrap()
        .terminal_reason
        .unwrap_or_default();
    assert!(reason.starts_with("cancelled"), "terminal reason {reason}");
    assert_eq!(event_types(&store, run).await, vec!["CANCEL"]);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_doubt_action_with_reconcile_hook_is_resolved() {
    let store = store("in_doubt_hook").await;
    let calls = Arc::new(AtomicU32::new(0));
    let run = enqueue(&store, &lifecycle(), json!({})).await;
    let a = Running::start(
        &store,
        config("worker-a", 10_000),
        registry_with(LosesAnswer {
            store: store.clone(),
            hook: true,
            calls: calls.clone(),
        }),
    );
    wait_state(&store, run, "done").await;
    a.stop().await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the call is not sent again"
    );
    assert_eq!(effects(&store, run).await.len(), 1);
    let types = event_types(&store, run).await;
    assert_eq!(
        types,
        vec![
            "start",
            EngineEvent::ActionDispatched.as_str(),
            EngineEvent::ActionResultInDoubt.as_str(),
            "complete"
        ]
    );
    let ledger: Vec<(String, Option<Value>)> =
        sqlx::query_as("SELECT status, result FROM rein_actions WHERE run_id = $1")
            .bind(run)
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(
        ledger,
        vec![("SUCCEEDED".to_owned(), Some(json!({ "paid": 5 })))],
        "the reconciled result is recorded in the ledger"
    );
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_doubt_without_hook_needs_operator() {
    let store = store("in_doubt_no_hook").await;
    let calls = Arc::new(AtomicU32::new(0));
    let run = enqueue(&store, &lifecycle(), json!({})).await;
    let a = Running::start(
        &store,
        config("worker-a", 10_000),
        registry_with(LosesAnswer {
            store: store.clone(),
            hook: false,
            calls: calls.clone(),
        }),
    );
    wait_until("the run needs an operator", LONG, || async {
        store.run(run).await.unwrap().status == "needs_operator"
    })
    .await;
    a.stop().await;
    let row = store.run(run).await.unwrap();
    assert_eq!(row.state, "running");
    assert!(row.lease_owner.is_none(), "the lease is given back");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "never a blind retry of a side effect"
    );
    assert_eq!(effects(&store, run).await.len(), 1);
    assert_eq!(
        event_types(&store, run).await.last().map(String::as_str),
        Some(EngineEvent::OperatorRequired.as_str())
    );
    assert_replays(&store, run).await;
}

/// `planned` reports each call and runs until cancelled; `running` completes at once.
struct PlannedUntilCancelled {
    calls: mpsc::UnboundedSender<(i64, CancellationToken)>,
}

impl NodeHandler for PlannedUntilCancelled {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let calls = self.calls.clone();
        Box::pin(async move {
            if ctx.node != "planned" {
                return Outcome::event("complete", json!({}));
            }
            let _ = calls.send((ctx.fencing_token, ctx.cancel.clone()));
            ctx.cancel.cancelled().await;
            Outcome::event("start", json!({}))
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_action_is_cancelled_when_the_same_worker_reclaims_the_run() {
    let store = store("reclaim_same_worker").await;
    let (calls_tx, mut calls) = mpsc::unbounded_channel();
    let run = enqueue(&store, &lifecycle(), json!({})).await;
    let a = Running::start(
        &store,
        config("worker-a", 3_000),
        registry_with(PlannedUntilCancelled { calls: calls_tx }),
    );
    let (first_token, first_cancel) = recv(&mut calls, "the first call").await;

    // The lease lapses (a stall); the scheduler recovers the run and the same worker,
    // having free slots, claims it again under a new token.
    expire_lease(&store, run).await;
    let mut sched = Scheduler::new(store.clone(), SchedulerConfig::new("sched-1"));
    assert_eq!(sched.tick().await.unwrap(), 1);
    let (second_token, _) = recv(&mut calls, "the call under the new claim").await;
    assert!(second_token > first_token);

    // The first call's lease is gone: within a few renewal periods (1 s) it must be
    // cancelled, not left running beside its successor.
    wait_until(
        "the superseded call is cancelled",
        Duration::from_secs(5),
        || async { first_cancel.is_cancelled() },
    )
    .await;
    a.stop().await;
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_waiting_state_timeout_fires_at_deadline() {
    let store = store("initial_wait_timeout").await;
    let text = WAIT_TIMEOUT_DEF
        .replace("name = \"wait-timeout\"", "name = \"wait-first\"")
        .replace("events = [\"wait\", ", "events = [")
        .replace(
            "[[states]]\nname = \"idle\"\nkind = \"active\"\ninitial = true\n\n",
            "",
        )
        .replace(
            "[[transitions]]\nfrom = \"idle\"\nevent = \"wait\"\nto = \"waiting\"\n\n",
            "",
        )
        .replace(
            "name = \"waiting\"\nkind = \"waiting\"",
            "name = \"waiting\"\nkind = \"waiting\"\ninitial = true",
        );
    let def = Definition::parse(&text, Format::Toml, &GuardRegistry::new())
        .expect("the test definition validates");
    store.register_definition(&def).await.unwrap();
    let run = enqueue(&store, &def, json!({})).await;
    let row = store.run(run).await.unwrap();
    assert_eq!(
        (row.state.as_str(), row.status.as_str()),
        ("waiting", "parked")
    );
    assert!(
        row.wake_at.is_some(),
        "a run created in a waiting state with a timeout has no timer: it would wait forever"
    );
    let mut sched = Scheduler::new(store.clone(), SchedulerConfig::new("sched-1"));
    let end = tokio::time::Instant::now() + LONG;
    while sched.tick().await.unwrap() == 0 {
        assert!(tokio::time::Instant::now() < end, "the timeout never fired");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(store.run(run).await.unwrap().state, "timed_out");
    assert_replays(&store, run).await;
}

/// Enqueues `n` runs of the built-in chain4 in one statement.
async fn enqueue_chains(store: &Store, n: usize) {
    let chain = rein_core::builtin::load("chain4")
        .expect("chain4 is built in")
        .expect("chain4 is valid");
    let requests: Vec<EnqueueRequest> = (0..n)
        .map(|_| EnqueueRequest::new(chain.clone(), json!({})))
        .collect();
    store.enqueue_batch(&requests).await.expect("enqueue");
}

/// Runs that have not ended yet.
async fn runs_left(store: &Store) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM rein_runs WHERE status <> 'terminal'")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// Renewals race with claims and commits. A renewal must judge only the leases it asked
/// about (runs claimed or released while it was in flight were once taken for lost leases),
/// and a renewal and a commit batch touching the same runs must not deadlock (they once
/// locked rows in different orders; the commits that lost gave up and their runs stalled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_never_loses_leases_claimed_while_it_was_in_flight() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("warn")
        .with_test_writer()
        .try_init();
    let store = store("renewal_race").await;
    enqueue_chains(&store, 6000).await;
    // Renewals every second while claims of 8 runs happen every few ms; the lease is long
    // enough that a busy machine does not let it lapse for real.
    let mut c = config("renewal-race", 1_000);
    c.claim_batch = 8;
    c.concurrency = 64;
    let worker = Running::start(&store, c, builtin_registry(store.clone()));
    wait_until("every run is terminal", Duration::from_secs(60), || async {
        runs_left(&store).await == 0
            || worker.worker.stats().leases_lost.load(Ordering::Relaxed) > 0
    })
    .await;
    let lost = worker.worker.stats().leases_lost.load(Ordering::Relaxed);
    worker.stop().await;
    assert_eq!(
        lost, 0,
        "no fault was injected, yet leases were taken for lost"
    );
}

/// A step that takes a time of its own for each run (0 to 375 ms, from the run id), so a
/// busy worker's slots free one at a time.
struct Staggered;

impl NodeHandler for Staggered {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let ms = u64::from(ctx.run_id.as_bytes()[15] % 16) * 25;
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Outcome::event("next", json!({}))
        })
    }
}

/// Claims that took runs while a worker of `slots` slots, claiming at most `batch` runs a
/// statement, drove 64 runs through chain4.
async fn claims_for_a_backlog(name: &str, slots: usize, batch: u32, gather_ms: u64) -> u64 {
    let store = store(name).await;
    enqueue_chains(&store, 64).await;
    let mut c = config(name, 10_000);
    c.concurrency = slots;
    c.claim_batch = batch;
    c.claim_gather_ms = gather_ms;
    let mut registry = Registry::new();
    registry.register("noop", Staggered);
    let worker = Running::start(&store, c, registry);
    wait_until("every run is terminal", Duration::from_secs(60), || async {
        runs_left(&store).await == 0
    })
    .await;
    let stats = worker.worker.stats();
    let (claimed, taking) = (
        stats.claimed.load(Ordering::Relaxed),
        stats.claims_taking.load(Ordering::Relaxed),
    );
    worker.stop().await;
    assert_eq!(claimed, 64, "each run is claimed once");
    taking
}

/// Group claiming: a busy worker whose slots free one at a time waits for half its slots
/// (4 of 8, when its claim batch is 8) before it claims again, so a backlog of 64 runs is
/// taken in at most 1 + 56 / 4 claims. Without the wait it claims as each slot frees, one
/// or two runs a statement; that is what the bound is there to catch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_gathers_free_slots_into_few_claims() {
    let gathered = claims_for_a_backlog("claims_gathered", 8, 8, 10_000).await;
    assert!(
        gathered <= 15,
        "{gathered} claims took runs; waiting for 4 free slots allows at most 15"
    );
    let at_once = claims_for_a_backlog("claims_at_once", 8, 8, 0).await;
    println!("claims that took runs: {gathered} gathered, {at_once} at once");
    assert!(
        at_once > 15,
        "claiming as each slot frees took only {at_once} claims: the bound above would not \
         notice a worker that stopped gathering"
    );
}

/// A worker with more slots than twice its claim batch gathers a whole batch, not half of
/// one: a claim statement's cost is mostly per statement, so 16 slots claiming 4 at a time
/// take a backlog of 64 runs in 4 claims to fill their slots and 48 / 4 more, 16 at most.
/// Gathering half a batch (2 slots) takes up to 28.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_gathers_a_whole_claim_batch_when_it_has_the_slots() {
    let gathered = claims_for_a_backlog("claims_whole_batch", 16, 4, 10_000).await;
    assert!(
        gathered <= 16,
        "{gathered} claims took runs; waiting for a batch of 4 free slots allows at most 16"
    );
}

/// A worker that starts on a backlog drives a whole claim batch at once, and every slot
/// needs the run's definition before its first step. The slots wait for one lookup: each
/// used to make its own, so a worker of 64 slots started with up to 64 identical
/// statements, each compiling the same definition again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_worker_looks_up_each_definition_once() {
    let store = store("definition_once").await;
    enqueue_chains(&store, 64).await;
    // A process of its own: nothing compiled yet.
    let worker_store = Store::from_pool(store.pool().clone());
    let mut c = config("definition-once", 30_000);
    c.concurrency = 64;
    c.claim_batch = 32;
    let worker = Running::start(&worker_store, c, builtin_registry(worker_store.clone()));
    wait_until("every run is terminal", LONG, || async {
        runs_left(&store).await == 0
    })
    .await;
    worker.stop().await;
    assert_eq!(
        worker_store.definitions_compiled(),
        1,
        "64 runs of one definition version were driven; it was compiled more than once"
    );
}

/// A writer without a lease delivering what the engine decided (a scheduler, or a test
/// standing in for a node's action).
fn engine() -> Sender {
    Sender::Engine("sched-test".into())
}

/// What a client sent PostgreSQL through a [`count_round_trips`] proxy: statements (an
/// Execute or a simple Query) and lone Syncs, the round trips a connection pool makes to
/// check a connection it hands out or takes back.
#[derive(Default)]
struct Sent {
    statements: std::sync::atomic::AtomicU64,
    lone_syncs: std::sync::atomic::AtomicU64,
}

/// A loopback proxy to the database of `url` that reads the frontend protocol its clients
/// send (after the startup packets, each message is a type byte and a length) and counts
/// it in the returned [`Sent`]; bytes go through unchanged. Returns the URL to use instead.
async fn count_round_trips(url: &str) -> (String, Arc<Sent>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let options: sqlx::postgres::PgConnectOptions = url.parse().expect("database URL");
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let sent = Arc::new(Sent::default());
    let counts = sent.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let counts = counts.clone();
            tokio::spawn(async move {
                let (mut from_client, mut to_server) = (client.into_split(), server.into_split());
                let back = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut to_server.0, &mut from_client.1).await;
                });
                let (mut reader, mut writer) = (from_client.0, to_server.1);
                // Untyped packets until the StartupMessage (protocol 3.0); an SSLRequest
                // comes before it and is answered with one byte.
                let mut started = false;
                let mut since_sync = 0u32;
                loop {
                    let mut kind = [0u8; 1];
                    if started && reader.read_exact(&mut kind).await.is_err() {
                        break;
                    }
                    let mut len = [0u8; 4];
                    if reader.read_exact(&mut len).await.is_err() {
                        break;
                    }
                    let mut body = vec![0u8; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
                    if reader.read_exact(&mut body).await.is_err() {
                        break;
                    }
                    if started {
                        match kind[0] {
                            b'E' | b'Q' => {
                                counts.statements.fetch_add(1, Ordering::Relaxed);
                            }
                            b'S' if since_sync == 0 => {
                                counts.lone_syncs.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {}
                        }
                        since_sync = if kind[0] == b'S' { 0 } else { since_sync + 1 };
                        writer.write_all(&kind).await.ok();
                    } else {
                        started = body.starts_with(&196_608u32.to_be_bytes());
                    }
                    if writer.write_all(&len).await.is_err()
                        || writer.write_all(&body).await.is_err()
                    {
                        break;
                    }
                }
                back.abort();
            });
        }
    });
    let url = format!(
        "postgres://{}@127.0.0.1:{port}/{}",
        options.get_username(),
        options.get_database().expect("the URL names a database")
    );
    (url, sent)
}

/// A worker keeps the connection it commits on, and the one it claims on, while it is busy:
/// each statement is one round trip to the database. A pool checks every connection it
/// hands out and every one it takes back with a round trip of its own, so a worker that
/// took a connection from the pool for each statement made three round trips a statement;
/// on 2 cores that cost about a sixth of the steps a second (`rein bench`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_makes_one_round_trip_a_statement() {
    let url = rein_devdb::test_database("one_round_trip", env!("CARGO_TARGET_TMPDIR"))
        .expect("a test database");
    let store = Store::connect(&url, 4).await.expect("connect and migrate");
    let (proxied, sent) = count_round_trips(&url).await;
    let worker_store = Store::connect_without_migrating(&proxied, 4)
        .await
        .expect("connect through the proxy");
    let mut c = config("one-round-trip", 30_000);
    c.concurrency = 64;
    c.claim_batch = 32;
    let mut registry = Registry::new();
    registry.register("noop", Staggered);
    let worker = Running::start(&worker_store, c, registry);
    // Counted after a first batch of runs: what a worker does once at its start (its
    // definition's lookup, its first claims) is not the steady state measured.
    enqueue_chains(&store, 64).await;
    wait_until("the first runs are terminal", LONG, || async {
        runs_left(&store).await == 0
    })
    .await;
    let before = (
        sent.statements.load(Ordering::Relaxed),
        sent.lone_syncs.load(Ordering::Relaxed),
    );
    enqueue_chains(&store, 200).await;
    wait_until("every run is terminal", LONG, || async {
        runs_left(&store).await == 0
    })
    .await;
    let (statements, lone_syncs) = (
        sent.statements.load(Ordering::Relaxed) - before.0,
        sent.lone_syncs.load(Ordering::Relaxed) - before.1,
    );
    worker.stop().await;
    println!("through the proxy: {statements} statements, {lone_syncs} connection checks");
    assert!(
        statements >= 30,
        "the worker's statements were counted: {statements}"
    );
    assert!(
        lone_syncs * 10 <= statements,
        "{lone_syncs} connection checks for {statements} statements: the worker takes a \
         connection from the pool for its statements again"
    );
}
