//! Retry policies enforced at run time with a real worker, scheduler and PostgreSQL (SPEC R1,
//! R2, X6): a tool declared `retryable = false`, and a fine error class a handler gives its
//! failure, take the exhausted path instead of a retry. Only the tool is faked.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::{assert_replays, event_types, events_of, store, wait_until};
use rein_core::{Definition, Format, GuardRegistry};
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{EnqueueRequest, Store};
use rein_worker::{
    ActionContext, BoxFuture, NodeHandler, Outcome, Worker, WorkerConfig, builtin_registry,
};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(30);

/// A tool that fails its first call with the handler's own error class `quota_exceeded`
/// (written as a plain payload, as any handler may), and succeeds after.
struct Flaky {
    calls: Arc<AtomicU32>,
}

impl NodeHandler for Flaky {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, _ctx: ActionContext) -> BoxFuture<Outcome> {
        let calls = self.calls.clone();
        Box::pin(async move {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                return Outcome::event(
                    "TOOL_RETRYABLE_FAILED",
                    json!({ "error": { "class": "transient", "kind": "quota_exceeded",
                                       "message": "quota exceeded for this minute" } }),
                );
            }
            Outcome::event("TOOL_SUCCEEDED", json!({ "result": { "ok": true } }))
        })
    }
}

/// `refund-agent` renamed, with a tool `flaky` (declared `retryable` as given) offered in
/// ACTING and `policy` lines added to the retry policy.
fn flaky_agent(name: &str, retryable: bool, policy: &str) -> Definition {
    let text = rein_core::builtin::REFUND_AGENT
        .replacen("name = \"refund-agent\"", &format!("name = \"{name}\""), 1)
        .replacen("jitter = 0.2\n", &format!("jitter = 0.2\n{policy}"), 1)
        .replacen(
            "[[states.tools]]\nname = \"lookup_order\"",
            &format!(
                "[[states.tools]]\nname = \"flaky\"\nside_effect = false\nretryable = {retryable}\n\n[[states.tools]]\nname = \"lookup_order\""
            ),
            1,
        );
    Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("parse")
}

struct Fleet {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Fleet {
    fn start(store: &Store, calls: Arc<AtomicU32>) -> Fleet {
        let stop = CancellationToken::new();
        let mut config = WorkerConfig::new("retry-worker");
        config.lease_ttl_ms = 5_000;
        config.poll_interval_ms = 20;
        config.shutdown_grace_ms = 1_000;
        let mut registry = builtin_registry(store.clone());
        registry.register("tool:flaky", Flaky { calls });
        let worker = Worker::new(store.clone(), config, registry);
        let mut sconfig = SchedulerConfig::new("retry-scheduler");
        sconfig.tick_ms = 50;
        let mut scheduler = Scheduler::new(store.clone(), sconfig);
        let tasks = vec![
            tokio::spawn({
                let stop = stop.clone();
                async move { worker.run(stop).await.expect("worker run") }
            }),
            tokio::spawn({
                let stop = stop.clone();
                async move { scheduler.run(stop).await.expect("scheduler run") }
            }),
        ];
        Fleet { stop, tasks }
    }

    async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            t.await.expect("fleet task");
        }
    }
}

/// Runs one flaky call then FINISH on `def`; returns the run's final row and the calls made.
async fn run_flaky(name: &str, def: Definition) -> (Store, Uuid, rein_store::RunRow, u32) {
    let store = store(name).await;
    store.register_definition(&def).await.expect("register");
    let input = json!({ "agent": { "script": [
        { "decision": "call_tool", "tool": "flaky", "args": {} },
        { "decision": "FINISH" }] } });
    let run = store
        .enqueue(EnqueueRequest::new(def, input))
        .await
        .expect("enqueue")
        .run_id;
    let calls = Arc::new(AtomicU32::new(0));
    let fleet = Fleet::start(&store, calls.clone());
    wait_until("the run ends", LONG, || async {
        store.run(run).await.expect("run").status == "terminal"
    })
    .await;
    fleet.stop().await;
    let row = store.run(run).await.expect("run");
    (store, run, row, calls.load(Ordering::SeqCst))
}

/// The run took the exhausted path at its first failure, and its log replays.
async fn assert_not_retried(store: &Store, run: Uuid, row: &rein_store::RunRow, calls: u32) {
    let types = event_types(store, run).await;
    assert_eq!(row.state, "FAILED", "{types:?}");
    assert_eq!(row.terminal_reason.as_deref(), Some("not_retryable"));
    assert_eq!(calls, 1, "never retried: {types:?}");
    assert!(!types.iter().any(|t| t == "RETRY_DUE"), "{types:?}");
    assert_replays(store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_tool_is_retried_after_its_failure() {
    let (store, run, row, calls) =
        run_flaky("retry_tool_retried", flaky_agent("flaky-a", true, "")).await;
    let types = event_types(&store, run).await;
    assert_eq!(row.state, "DONE", "{types:?}");
    assert_eq!(calls, 2, "one retry");
    assert_eq!(events_of(&store, run, "RETRY_DUE").await.len(), 1);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_declared_not_retryable_takes_the_exhausted_path() {
    let (store, run, row, calls) = run_flaky(
        "retry_tool_not_retryable",
        flaky_agent("flaky-b", false, ""),
    )
    .await;
    assert_not_retried(&store, run, &row, calls).await;
    let failed = events_of(&store, run, "TOOL_RETRYABLE_FAILED").await;
    assert_eq!(failed[0].payload["error"]["retryable"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_own_error_class_named_non_retryable_takes_the_exhausted_path() {
    let (store, run, row, calls) = run_flaky(
        "retry_class_not_retryable",
        flaky_agent("flaky-c", true, "non_retryable = [\"quota_exceeded\"]\n"),
    )
    .await;
    assert_not_retried(&store, run, &row, calls).await;
}
