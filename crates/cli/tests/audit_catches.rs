//! Each audit checker catches the violation it exists for: a small database of completed runs
//! audits clean, then one violation planted with raw SQL makes its count positive.

use crate::common;

use rein_store::{AuditReport, EnqueueRequest, Store};
use serde_json::json;
use uuid::Uuid;

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
    let f = common::finished_runs("audit_gap").await;
    let report = plant(
        &f.store,
        "DELETE FROM rein_events WHERE run_id = $1 AND sequence = 2",
        f.done[0],
    )
    .await;
    assert!(report.sequence_gaps > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_an_event_under_a_stale_token() {
    let f = common::finished_runs("audit_stale").await;
    // A newer holder was granted the lease, then an event came under the old token: the
    // token is the run's newest before it (no regression), yet not the one in force.
    let report = plant(
        &f.store,
        "WITH granted AS (
             INSERT INTO rein_lease_grants (run_id, fencing_token, worker, at_sequence)
             SELECT run_id, fencing_token + 1, 'newer', last_sequence
             FROM rein_runs WHERE run_id = $1
             RETURNING run_id)
         INSERT INTO rein_events (run_id, sequence, event_id, type, payload, fencing_token, worker)
         SELECT r.run_id, r.last_sequence + 1, md5(r.run_id::text)::uuid, 'LEASE_EXPIRED', '{}',
                r.fencing_token, 'intruder'
         FROM rein_runs r JOIN granted USING (run_id)",
        f.done[0],
    )
    .await;
    assert_eq!(report.stale_token_events, 1, "{report:?}");
    assert_eq!(
        report.token_regressions, 0,
        "only the stale token: {report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_fencing_token_that_went_backwards() {
    // A token lower than an earlier event's is also stale (the token in force only grows),
    // so this plant trips both checkers; the stale one is shown alone above.
    let f = common::finished_runs("audit_backwards").await;
    assert_eq!(f.store.audit().await.unwrap().token_regressions, 0);
    let report = plant(
        &f.store,
        "INSERT INTO rein_events (run_id, sequence, event_id, type, payload, fencing_token, worker)
         SELECT run_id, last_sequence + 1, md5(run_id::text || 'back')::uuid, 'LEASE_EXPIRED',
                '{}', fencing_token - 1, 'intruder'
         FROM rein_runs WHERE run_id = $1",
        f.done[0],
    )
    .await;
    assert!(report.token_regressions > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_duplicate_side_effect() {
    let f = common::finished_runs("audit_dup").await;
    let report = plant(
        &f.store,
        "INSERT INTO rein_sim_effects (run_id, node, step, idempotency_key, worker)
         SELECT run_id, node, step, idempotency_key, 'intruder'
         FROM rein_sim_effects WHERE run_id = $1 LIMIT 1",
        f.done[0],
    )
    .await;
    assert!(report.duplicate_effects > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_projection_that_does_not_replay() {
    let f = common::finished_runs("audit_replay").await;
    let report = plant(
        &f.store,
        "UPDATE rein_runs SET projection = jsonb_set(projection, '{attempt}', '7') WHERE run_id = $1",
        f.done[0],
    )
    .await;
    assert!(report.replay_mismatches > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_a_terminal_run_without_reason() {
    let f = common::finished_runs("audit_reason").await;
    let report = plant(
        &f.store,
        "UPDATE rein_runs SET terminal_reason = NULL WHERE run_id = $1",
        f.done[0],
    )
    .await;
    assert!(report.terminal_without_reason > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_an_effect_applied_after_a_denial() {
    let f = common::finished_runs("audit_denied").await;
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
    let f = common::finished_runs("audit_open").await;
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
