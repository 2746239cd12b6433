//! `rein chaos`: a short seeded run against a private PostgreSQL that it crash-restarts, with a
//! private Redis that it kills and starts again, must inject every kind of fault and still
//! end with every run terminal and no invariant broken;
//! `--check-only` must report each kind of violation planted in a database under its own
//! field, and exit 3 for it.

use crate::common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

use common::{REIN, stderr, stdout};
use rein_store::EnqueueRequest;
use serde_json::{Value, json};
use uuid::Uuid;

/// Every field the JSON report promises.
const FIELDS: [&str; 17] = [
    "runs_enqueued",
    "runs_terminal",
    "runs_unfinished",
    "integrity_violations",
    "sequence_gaps",
    "stale_token_events",
    "token_regressions",
    "fenced_writes_rejected",
    "duplicate_effects",
    "replay_mismatches",
    "denied_but_applied",
    "terminal_without_reason",
    "faults",
    "recovery_ms",
    "violations",
    "seed",
    "params",
];

fn rein(args: &[&str], database_url: Option<&str>) -> Output {
    let mut cmd = Command::new(REIN);
    cmd.args(args).env_remove("DATABASE_URL");
    if let Some(url) = database_url {
        cmd.env("DATABASE_URL", url);
    }
    cmd.output().expect("run the rein binary")
}

fn report_of(out: &Output) -> Value {
    serde_json::from_str(stdout(out).trim()).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}):\n{}\nstderr:\n{}",
            stdout(out),
            stderr(out)
        )
    })
}

#[test]
fn seeded_chaos_run_injects_every_fault_and_keeps_every_invariant() {
    let started = Instant::now();
    let out = rein(
        &[
            "chaos",
            "--allow-db-restart",
            "--runs",
            "150",
            "--workers",
            "3",
            "--seed",
            "7",
            "--duration-s",
            "12",
            "--timeout-s",
            "120",
            "--json",
        ],
        // A shared server named here must be ignored: only a private one is restarted.
        Some("postgres://postgres@127.0.0.1:1/never_used"),
    );
    let err = stderr(&out);
    eprintln!("{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("DATABASE_URL is ignored"), "{err}");
    let r = report_of(&out);
    for field in FIELDS {
        assert!(r.get(field).is_some(), "no `{field}` in {r}");
    }
    assert_eq!(r["seed"], 7);
    assert_eq!(r["runs_enqueued"], 150, "{r}");
    assert_eq!(r["runs_terminal"], 150, "{r}");
    assert_eq!(r["violations"], 0, "{r}");
    for field in [
        "sequence_gaps",
        "stale_token_events",
        "token_regressions",
        "duplicate_effects",
        "replay_mismatches",
        "denied_but_applied",
        "terminal_without_reason",
    ] {
        assert_eq!(r[field], 0, "{field} in {r}");
    }
    for kind in [
        "worker_kill",
        "worker_stop",
        "scheduler_kill",
        "db_restart",
        "redis_stop",
        "session_kill",
        "lock_stall",
        "leader_stop",
        "clock_skew",
        "net_partition",
        "net_latency",
        "net_reset",
        "backend_stop",
        "statement_timeout",
        "late_result",
        "event_twice",
    ] {
        assert!(
            r["faults"][kind].as_u64().is_some_and(|n| n >= 1),
            "no {kind} injected: {r}"
        );
    }
    // Every kind that fired has its recovery measured: the fleet moved on after it.
    for (kind, n) in r["faults"].as_object().unwrap() {
        if n.as_u64() > Some(0) {
            let measured = r["recovery_by_kind"][kind]["measured"]
                .as_u64()
                .unwrap_or(0);
            assert!(measured >= 1, "no recovery measured for {kind}: {r}");
            assert!(
                r["recovery_by_kind"][kind]["p50"].as_u64().is_some(),
                "{kind}: {r}"
            );
        }
    }
    // After each Redis outage every worker subscribed to wake-ups again, as Redis saw it.
    assert_eq!(r["redis"]["enabled"], true, "{r}");
    assert_eq!(r["redis"]["not_resubscribed"], 0, "{r}");
    assert_eq!(
        r["redis"]["resubscribed_ms"]["count"].as_u64(),
        r["faults"]["redis_stop"].as_u64(),
        "{r}"
    );
    // Each worker kill or stop that hit a worker holding leases was recovered.
    let recovered = r["recovery_ms"]["count"].as_u64().unwrap_or(0);
    assert!(recovered >= 1, "no recovery measured: {r}");
    assert!(r["recovery_ms"]["p50"].as_u64().is_some(), "{r}");
    assert!(
        r["recovery_ms"]["max"].as_u64() >= r["recovery_ms"]["p50"].as_u64(),
        "{r}"
    );
    assert_eq!(r["recovery_ms"]["unresolved"], 0, "{r}");
    // Approvals were decided both ways and left to expire (the scheduler fired the expiry).
    assert!(r["approvals"]["granted"].as_u64() > Some(0), "{r}");
    assert!(r["approvals"]["denied"].as_u64() > Some(0), "{r}");
    assert!(r["approval_timers_fired"].as_u64() > Some(0), "{r}");
    // On success the child logs are removed.
    let log_dir = r["log_dir"].as_str().expect("log_dir");
    assert!(!Path::new(log_dir).exists(), "{log_dir} left behind");
    eprintln!("chaos run took {:?}", started.elapsed());
}

fn check_only(url: &str) -> Output {
    rein(&["chaos", "--check-only", "--json"], Some(url))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_only_reports_each_planted_violation_under_its_field() {
    let f = common::finished_runs("chaos_check").await;

    let out = check_only(&f.url);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let mut before = report_of(&out);
    assert_eq!(before["violations"], 0, "{before}");
    assert_eq!(before["runs_enqueued"], 7, "{before}");
    assert_eq!(before["runs_terminal"], 7, "{before}");

    // Each violation on a run of its own, planted one after another: each check must see
    // the new one under its field (earlier ones stay counted).
    let plants: [(&str, &str, Uuid); 6] = [
        (
            "sequence_gaps",
            "DELETE FROM rein_events WHERE run_id = $1 AND sequence = 2",
            f.done[0],
        ),
        (
            "stale_token_events",
            "INSERT INTO rein_events (run_id, sequence, event_id, type, payload, fencing_token, worker)
             SELECT run_id, last_sequence + 1, md5(run_id::text || 'stale')::uuid, 'LEASE_EXPIRED',
                    '{}', fencing_token - 1, 'stale-intruder'
             FROM rein_runs WHERE run_id = $1",
            f.done[1],
        ),
        (
            "duplicate_effects",
            "INSERT INTO rein_sim_effects (run_id, node, step, idempotency_key, worker)
             SELECT run_id, node, step, idempotency_key, 'second-application'
             FROM rein_sim_effects WHERE run_id = $1 LIMIT 1",
            f.done[2],
        ),
        (
            "replay_mismatches",
            "UPDATE rein_runs SET projection = jsonb_set(projection, '{attempt}', '9') WHERE run_id = $1",
            f.done[3],
        ),
        (
            "terminal_without_reason",
            "UPDATE rein_runs SET terminal_reason = NULL WHERE run_id = $1",
            f.done[4],
        ),
        (
            "denied_but_applied",
            "INSERT INTO rein_sim_effects (run_id, node, step, idempotency_key, worker)
             VALUES ($1, 'running', 1, 'applied-after-the-denial', 'intruder')",
            f.denied,
        ),
    ];
    for (field, sql, run_id) in plants {
        let planted = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .bind(run_id)
            .execute(f.store.pool())
            .await
            .expect("plant a violation")
            .rows_affected();
        assert!(planted > 0, "nothing planted for {field}");
        let out = check_only(&f.url);
        assert_eq!(out.status.code(), Some(3), "{field}: {}", stderr(&out));
        let after = report_of(&out);
        assert!(
            after[field].as_i64() > before[field].as_i64(),
            "{field} not reported: before {before}, after {after}"
        );
        assert!(
            after["violations"].as_i64() > before["violations"].as_i64(),
            "{field}: {after}"
        );
        before = after;
    }

    // A run not finished yet is reported as such, not as a violation.
    let def = f
        .store
        .load_definition("lifecycle", None)
        .await
        .expect("def");
    f.store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .expect("enqueue");
    let out = check_only(&f.url);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let after = report_of(&out);
    assert_eq!(after["runs_enqueued"], 8, "{after}");
    assert_eq!(after["runs_terminal"], 7, "{after}");
    assert_eq!(after["runs_unfinished"]["queued"], 1, "{after}");
    assert_eq!(after["violations"], before["violations"], "{after}");

    // The table names the failed checks.
    let out = rein(&["chaos", "--check-only"], Some(&f.url));
    assert_eq!(out.status.code(), Some(3));
    let table = stdout(&out);
    assert!(
        table.contains("VIOLATED") && table.contains("runs with sequence gaps"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_only_passes_a_live_database_and_reports_its_unfinished_runs_apart() {
    let f = common::finished_runs("chaos_live").await;
    let def = f
        .store
        .load_definition("lifecycle", None)
        .await
        .expect("def");
    let enqueue = || async {
        f.store
            .enqueue(EnqueueRequest::new(def.clone(), json!({})))
            .await
            .expect("enqueue")
            .run_id
    };
    // One run a worker holds, one parked on a dependency, one waiting for a worker.
    let running = enqueue().await;
    let claimed = f
        .store
        .claim("busy-worker", 1, 60_000, &["default".to_owned()])
        .await
        .expect("claim");
    assert_eq!(claimed.first().map(|c| c.run_id), Some(running));
    let parked = enqueue().await;
    common::as_the_engine(&f.store, parked, &["start", "block_on_dependency"]).await;
    assert_eq!(f.store.run(parked).await.unwrap().status, "parked");
    enqueue().await;

    let out = check_only(&f.url);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report_of(&out);
    assert_eq!(r["violations"], 0, "{r}");
    assert_eq!(r["integrity_violations"], 0, "{r}");
    assert_eq!(
        r["runs_unfinished"],
        json!({ "total": 3, "queued": 1, "running": 1, "parked": 1, "needs_operator": 0 }),
        "{r}"
    );
    assert_eq!(
        (&r["runs_in_database"], &r["runs_terminal"]),
        (&json!(10), &json!(7))
    );
    let out = rein(&["chaos", "--check-only"], Some(&f.url));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(!table.contains("VIOLATED"), "{table}");
    assert!(table.contains("runs not finished yet"), "{table}");

    // A broken invariant still fails the audit of a live database.
    sqlx::query("DELETE FROM rein_events WHERE run_id = $1 AND sequence = 2")
        .bind(f.done[0])
        .execute(f.store.pool())
        .await
        .expect("plant a sequence gap");
    let out = check_only(&f.url);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let r = report_of(&out);
    assert!(r["sequence_gaps"].as_i64() >= Some(1), "{r}");
    assert!(r["violations"].as_i64() >= Some(1), "{r}");
    assert_eq!(r["runs_unfinished"]["total"], 3, "{r}");
}

#[test]
fn chaos_refuses_bad_input_and_says_why() {
    let cases: [(&[&str], &str); 10] = [
        (&["chaos", "--runs", "0"], "--runs must be 1..=100000"),
        (&["chaos", "--workers", "17"], "--workers must be 1..=16"),
        (
            &["chaos", "--duration-s", "0"],
            "--duration-s must be 1..=3600",
        ),
        (
            &["chaos", "--lease-ttl-ms", "100"],
            "--lease-ttl-ms must be 300..=60000",
        ),
        (
            &["chaos", "--check-only", "--allow-db-restart"],
            "cannot be combined",
        ),
        (&["chaos", "--check-only"], "no database"),
        (
            &["chaos", "--old-bin", "/nonexistent/rein"],
            "--old-bin /nonexistent/rein: no such file",
        ),
        (
            &["chaos", "--old-bin", "/bin/sh", "--old-workers", "4"],
            "--old-workers must be 1..=3",
        ),
        (
            &["chaos", "--faults", "worker_kill,db_restart", "--runs", "1"],
            "--faults db_restart needs --allow-db-restart",
        ),
        (
            &["chaos", "--faults", "worker_stop", "--workers", "1"],
            "--faults worker_stop needs --workers 2 or more",
        ),
    ];
    for (args, message) in cases {
        let out = rein(args, None);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(message), "{args:?}: {}", stderr(&out));
        // Refused before anything starts: no private server is left behind for a look.
        assert!(
            !stderr(&out).contains("private PostgreSQL"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn check_only_exits_3_when_the_database_is_unreachable_or_has_no_schema() {
    let out = rein(
        &["chaos", "--check-only"],
        Some("postgres://postgres@127.0.0.1:1/nothing_here"),
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot reach PostgreSQL"),
        "{}",
        stderr(&out)
    );

    let empty = common::fresh_database("chaos_noschema");
    let out = rein(&["chaos", "--check-only"], Some(&empty));
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("schema"), "{}", stderr(&out));
}

#[test]
fn faults_picks_the_kinds_injected_and_refuses_unknown_ones() {
    let out = rein(
        &[
            "chaos",
            "--faults",
            "lock_stall,session_kill",
            "--runs",
            "60",
            "--workers",
            "2",
            "--seed",
            "3",
            "--duration-s",
            "4",
            "--timeout-s",
            "120",
            "--json",
        ],
        None,
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let r = report_of(&out);
    assert_eq!(r["violations"], 0, "{r}");
    assert_eq!(r["runs_terminal"], 60, "{r}");
    let faults = r["faults"].as_object().expect("faults");
    for (kind, n) in faults {
        let picked = kind == "lock_stall" || kind == "session_kill";
        assert_eq!(n.as_u64().unwrap() >= 1, picked, "{kind}: {r}");
    }
    let out = rein(&["chaos", "--faults", "meteor", "--runs", "1"], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("lock_stall"), "{}", stderr(&out));
    let out = rein(&["chaos", "--faults", "db_restart", "--runs", "1"], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--allow-db-restart"),
        "{}",
        stderr(&out)
    );
}
