//! Each audit checker catches the violation it exists for: a small database of completed runs
//! audits clean, then one violation planted with raw SQL makes its count positive.

mod common;

use std::time::Duration;

use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{AuditReport, EnqueueRequest, Store};
use rein_worker::{Worker, WorkerConfig};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

struct Fixture {
    store: Store,
    /// A lifecycle run that completed with a side effect.
    done: Uuid,
    /// A lifecycle run whose approval was denied.
    denied: Uuid,
}

/// Drives a few runs to the end with an in-process worker and scheduler, denying the one
/// approval, and checks the audit is clean.
async fn completed_runs(prefix: &str) -> Fixture {
    let (_, store) = common::fresh_store(prefix).await;
    let lifecycle = store.load_definition("lifecycle", None).await.expect("def");
    let research = store
        .load_definition("research-agent", None)
        .await
        .expect("def");
    let inputs = [
        (lifecycle.clone(), json!({ "sim": { "work_ms": 5 } })),
        (
            lifecycle.clone(),
            json!({ "sim": { "work_ms": 5, "approval": "deny", "amount": 500 } }),
        ),
        (
            research.clone(),
            json!({ "sim": { "work_ms": 5, "steps": 2 } }),
        ),
        (
            lifecycle,
            json!({ "sim": { "work_ms": 5, "transient_failures": 1 } }),
        ),
    ];
    let requests: Vec<EnqueueRequest> = inputs
        .into_iter()
        .map(|(d, i)| EnqueueRequest::new(d, i))
        .collect();
    let ids: Vec<Uuid> = store
        .enqueue_batch(&requests)
        .await
        .expect("enqueue")
        .iter()
        .map(|e| e.run_id)
        .collect();

    let shutdown = CancellationToken::new();
    let mut config = WorkerConfig::new(format!("{prefix}-worker"));
    config.lease_ttl_ms = 2_000;
    config.poll_interval_ms = 20;
    config.concurrency = 8;
    let worker = Worker::new(
        store.clone(),
        config,
        rein_worker::builtin_registry(store.clone()),
    );
    let worker_task = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    let mut sconfig = SchedulerConfig::new(format!("{prefix}-scheduler"));
    sconfig.tick_ms = 20;
    let mut scheduler = Scheduler::new(store.clone(), sconfig);
    let scheduler_task = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { scheduler.run(shutdown).await }
    });

    let denied = ids[1];
    common::wait_for(
        "every run terminal",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            let store = store.clone();
            async move {
                if let Ok(row) = store.run(denied).await
                    && row.state == "paused"
                {
                    let _ = store
                        .send(
                            denied,
                            "approval_denied",
                            json!({ "reason": "denied" }),
                            "test",
                            60_000,
                        )
                        .await;
                }
                store.audit().await.is_ok_and(|r| r.runs == r.runs_terminal)
            }
        },
    )
    .await;
    shutdown.cancel();
    worker_task.await.expect("worker task").expect("worker");
    scheduler_task
        .await
        .expect("scheduler task")
        .expect("scheduler");

    let clean = store.audit().await.expect("audit");
    assert_eq!(clean.violations(), 0, "the fixture audits clean: {clean:?}");
    Fixture {
        store,
        done: ids[0],
        denied,
    }
}

async fn plant(store: &Store, sql: &str, run_id: Uuid) -> AuditReport {
    let planted = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(run_id)
        .execute(store.pool())
        .await
        .expect("plant a violation")
        .rows_affected();
    assert!(planted > 0, "nothing planted by {sql}");
    store.audit().await.expect("audit")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_sequence_gap() {
    let f = completed_runs("audit_gap").await;
    let report = plant(
        &f.store,
        "DELETE FROM rein_events WHERE run_id = $1 AND sequence = 2",
        f.done,
    )
    .await;
    assert!(report.sequence_gaps > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_an_event_under_a_stale_token() {
    let f = completed_runs("audit_stale").await;
    let report = plant(
        &f.store,
        "INSERT INTO rein_events (run_id, sequence, event_id, type, payload, fencing_token, worker)
         SELECT run_id, last_sequence + 1, md5(run_id::text)::uuid, 'LEASE_EXPIRED', '{}',
                fencing_token - 1, 'intruder'
         FROM rein_runs WHERE run_id = $1",
        f.done,
    )
    .await;
    assert!(report.stale_token_events > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_duplicate_side_effect() {
    let f = completed_runs("audit_dup").await;
    let report = plant(
        &f.store,
        "INSERT INTO rein_sim_effects (run_id, node, step, idempotency_key, worker)
         SELECT run_id, node, step, idempotency_key, 'intruder'
         FROM rein_sim_effects WHERE run_id = $1 LIMIT 1",
        f.done,
    )
    .await;
    assert!(report.duplicate_effects > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_projection_that_does_not_replay() {
    let f = completed_runs("audit_replay").await;
    let report = plant(
        &f.store,
        "UPDATE rein_runs SET projection = jsonb_set(projection, '{attempt}', '7') WHERE run_id = $1",
        f.done,
    )
    .await;
    assert!(report.replay_mismatches > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_terminal_run_without_reason() {
    let f = completed_runs("audit_reason").await;
    let report = plant(
        &f.store,
        "UPDATE rein_runs SET terminal_reason = NULL WHERE run_id = $1",
        f.done,
    )
    .await;
    assert!(report.terminal_without_reason > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_an_effect_applied_after_a_denial() {
    let f = completed_runs("audit_denied").await;
    let report = plant(
        &f.store,
        "INSERT INTO rein_sim_effects (run_id, node, step, idempotency_key, worker)
         VALUES ($1, 'running', 1, 'planted-after-denial', 'intruder')",
        f.denied,
    )
    .await;
    assert!(report.denied_but_applied > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_run_that_never_ended() {
    let f = completed_runs("audit_open").await;
    let def = f
        .store
        .load_definition("lifecycle", None)
        .await
        .expect("def");
    f.store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .expect("enqueue");
    let report = f.store.audit().await.expect("audit");
    assert!(report.runs > report.runs_terminal, "{report:?}");
    assert!(report.violations() > 0, "{report:?}");
}
