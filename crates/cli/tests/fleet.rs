//! The multi-process crash test: a real fleet of `rein` processes (3 workers, 2 schedulers)
//! drives 1,000 sim runs while one worker is killed with SIGKILL mid-action and another is
//! frozen with SIGSTOP past its lease TTL; afterwards the database audit must find every run
//! terminal and no invariant broken (SPEC X1–X8, S1–S3, C1–C12).

use crate::common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{Fleet, wait_for};
use rein_store::{EnqueueRequest, Store};
use serde_json::{Value, json};
use uuid::Uuid;

const RUNS: u32 = 1_000;
const LEASE_TTL_MS: u64 = 1_500;
const WORKER_CONCURRENCY: &str = "16";
const SCHEDULER_TICK_MS: &str = "100";
const ALL_TERMINAL_DEADLINE: Duration = Duration::from_secs(240);
const POLL: Duration = Duration::from_millis(20);

/// Run `i` of the workload: half lifecycle, half research-agent; 30% with transient
/// failures; 95% with a side effect; actions of 20–80 ms so several are always in flight; a
/// few approvals, granted or denied by the test.
fn workload(
    i: u32,
    lifecycle: &rein_core::Definition,
    research: &rein_core::Definition,
) -> EnqueueRequest {
    let lifecycle_run = i.is_multiple_of(2);
    let def = if lifecycle_run { lifecycle } else { research };
    // research-agent runs always take the side effect: a side-effect-free tool step never
    // counts as completed (see the report on `rein_core::reducer`), so it would loop forever.
    let side_effect = !lifecycle_run || i % 10 != 8;
    let mut sim = json!({ "work_ms": 20 + (i * 37) % 61, "side_effect": side_effect });
    if i % 10 < 3 {
        sim["transient_failures"] = json!(1 + i % 2);
    }
    match i % 50 {
        4 | 5 => {
            sim["approval"] = json!("grant");
            sim["amount"] = json!(150);
        }
        14 | 15 => {
            sim["approval"] = json!("deny");
            sim["amount"] = json!(500);
        }
        _ => {}
    }
    if i % 7 == 1 {
        sim["steps"] = json!(2);
    }
    EnqueueRequest::new(def.clone(), json!({ "sim": sim }))
}

/// Decides the approvals parked runs wait for, as each run's input asks. Returns how many
/// decisions were delivered now.
async fn approve(store: &Store, decided: &mut HashSet<Uuid>) -> usize {
    let Ok(waiting) = store
        .runs_in_states(&rein_worker::sim::APPROVAL_WAIT_STATES, 200)
        .await
    else {
        return 0;
    };
    let mut n = 0;
    for row in waiting {
        if decided.contains(&row.run_id) {
            continue;
        }
        let Some((event, deny)) =
            rein_worker::sim::approver_answer(&row.definition, &row.projection.data)
        else {
            continue;
        };
        let payload =
            json!({ "approver": "fleet-test", "reason": if deny { "denied" } else { "granted" } });
        if store
            .send(
                row.run_id,
                event,
                payload,
                &rein_store::Sender::Approver("fleet-test".into()),
                60_000,
            )
            .await
            .is_ok()
        {
            decided.insert(row.run_id);
            n += 1;
        }
    }
    n
}

/// Runs `worker` holds with an action DISPATCHED and no result yet.
async fn dispatched_held_by(store: &Store, worker: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM rein_actions a JOIN rein_runs r USING (run_id)
         WHERE a.status = 'DISPATCHED' AND r.lease_owner = $1 AND r.lease_until > clock_timestamp()",
    )
    .bind(worker)
    .fetch_one(store.pool())
    .await
    .expect("query dispatched actions")
}

async fn leases_held_by(store: &Store, worker: &str) -> Vec<(Uuid, i64)> {
    sqlx::query_as("SELECT run_id, fencing_token FROM rein_runs WHERE lease_owner = $1")
        .bind(worker)
        .fetch_all(store.pool())
        .await
        .expect("query leases")
}

async fn non_terminal(store: &Store) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM rein_runs WHERE status <> 'terminal'")
        .fetch_one(store.pool())
        .await
        .expect("count non-terminal runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_survives_kill_and_stop_with_every_invariant_intact() {
    let started = Instant::now();
    let (url, store) = common::fresh_store("fleet").await;
    let lifecycle = store
        .load_definition("lifecycle", None)
        .await
        .expect("lifecycle");
    let research = store
        .load_definition("research-agent", None)
        .await
        .expect("research-agent");
    let requests: Vec<EnqueueRequest> = (0..RUNS)
        .map(|i| workload(i, &lifecycle, &research))
        .collect();
    let enqueued = store.enqueue_batch(&requests).await.expect("enqueue");
    assert_eq!(enqueued.len(), RUNS as usize);

    let ttl = LEASE_TTL_MS.to_string();
    let worker_args = [
        "worker",
        "--concurrency",
        WORKER_CONCURRENCY,
        "--lease-ttl-ms",
        &ttl,
        "--poll-interval-ms",
        "50",
    ];
    let mut fleet = Fleet::new(&url, "fleet");
    for id in ["fleet-w1", "fleet-w2", "fleet-w3"] {
        fleet.spawn(id, &worker_args);
    }
    for id in ["fleet-s1", "fleet-s2"] {
        fleet.spawn(id, &["scheduler", "--tick-ms", SCHEDULER_TICK_MS]);
    }
    let mut decided = HashSet::new();

    // Fault 1: SIGKILL worker 1 while it holds an action dispatched and unfinished.
    wait_for(
        "worker 1 to hold a dispatched action",
        Duration::from_secs(60),
        POLL,
        || async { dispatched_held_by(&store, "fleet-w1").await > 0 },
    )
    .await;
    let in_flight_at_kill = dispatched_held_by(&store, "fleet-w1").await;
    fleet.kill("fleet-w1");
    let kills = 1;
    eprintln!("fleet: killed fleet-w1 (SIGKILL) holding {in_flight_at_kill} dispatched action(s)");
    fleet.spawn("fleet-w1b", &worker_args);

    // Fault 2: SIGSTOP worker 2 while it holds a dispatched action, past twice its lease TTL
    // and until the scheduler recovered every run it held; then let it resume, stale.
    wait_for(
        "worker 2 to hold a dispatched action",
        Duration::from_secs(60),
        POLL,
        || async { dispatched_held_by(&store, "fleet-w2").await > 0 },
    )
    .await;
    fleet.proc("fleet-w2").signal(libc::SIGSTOP);
    let stopped_at = Instant::now();
    let held_when_stopped = leases_held_by(&store, "fleet-w2").await;
    assert!(
        !held_when_stopped.is_empty(),
        "worker 2 held no lease when stopped"
    );
    let stops = 1;
    eprintln!(
        "fleet: stopped fleet-w2 (SIGSTOP) holding {} lease(s)",
        held_when_stopped.len()
    );
    let held_ids: Vec<Uuid> = held_when_stopped.iter().map(|(id, _)| *id).collect();
    let held_tokens: Vec<i64> = held_when_stopped.iter().map(|(_, t)| *t).collect();
    wait_for(
        "worker 2's leases to expire and be recovered",
        Duration::from_secs(60),
        POLL,
        || async {
            // A run counts until its token moved on, unless worker 2 no longer holds it: a
            // commit it sent just before the stop may have released it (parked or ended)
            // after the snapshot above was read, and such a run needs no recovery.
            let not_taken_over: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM rein_runs r
             JOIN unnest($1::uuid[], $2::bigint[]) AS h(run_id, token) USING (run_id)
             WHERE r.fencing_token <= h.token AND r.lease_owner = 'fleet-w2'",
            )
            .bind(&held_ids)
            .bind(&held_tokens)
            .fetch_one(store.pool())
            .await
            .expect("query recovery");
            stopped_at.elapsed() > Duration::from_millis(2 * LEASE_TTL_MS) && not_taken_over == 0
        },
    )
    .await;
    let stopped_for = stopped_at.elapsed();
    fleet.proc("fleet-w2").signal(libc::SIGCONT);
    eprintln!("fleet: continued fleet-w2 after {stopped_for:?}");

    // Drive everything to the end, deciding approvals as they come up.
    let deadline = started + ALL_TERMINAL_DEADLINE;
    let mut left = non_terminal(&store).await;
    while left > 0 {
        assert!(
            Instant::now() < deadline,
            "{left} runs still not terminal after {ALL_TERMINAL_DEADLINE:?}; logs in {}",
            fleet.log_dir.display()
        );
        approve(&store, &mut decided).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = non_terminal(&store).await;
    }
    let wall = started.elapsed();

    for id in ["fleet-w2", "fleet-w3", "fleet-w1b", "fleet-s1", "fleet-s2"] {
        assert!(
            fleet.proc(id).is_running(),
            "{id} exited on its own; see {}",
            fleet.log_dir.display()
        );
    }

    let report = store.audit().await.expect("audit");
    let by_state: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT definition, state, count(*) FROM rein_runs GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(store.pool())
    .await
    .expect("runs by state");
    let recovered = store
        .counter(rein_store::counters::LEASES_RECOVERED)
        .await
        .expect("counter");
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_sim_effects")
        .fetch_one(store.pool())
        .await
        .expect("effects");
    eprintln!(
        "fleet: runs {} ({} terminal) in {wall:?}",
        report.runs, report.runs_terminal
    );
    for (def, state, n) in &by_state {
        eprintln!("fleet:   {def:<15} {state:<10} {n}");
    }
    eprintln!(
        "fleet: kills {kills}, stops {stops} ({stopped_for:?}), fenced writes rejected {}, leases recovered {recovered}, approvals decided {}, side effects applied {effects}",
        report.fenced_writes_rejected,
        decided.len()
    );
    eprintln!(
        "fleet: audit {}",
        serde_json::to_string(&report).unwrap_or_default()
    );

    assert_eq!(report.runs, i64::from(RUNS));
    assert_eq!(report.runs_terminal, report.runs, "every run terminal");
    assert_eq!(report.sequence_gaps, 0, "sequence gaps");
    assert_eq!(report.stale_token_events, 0, "events under a stale token");
    assert!(
        report.fenced_writes_rejected >= 1,
        "the stopped worker was never fenced"
    );
    assert_eq!(report.duplicate_effects, 0, "side effects applied twice");
    assert_eq!(
        report.replay_mismatches, 0,
        "logs that do not replay to the projection"
    );
    assert_eq!(
        report.terminal_without_reason, 0,
        "terminal runs without a reason"
    );
    assert_eq!(report.denied_but_applied, 0, "side effects after a denial");
    assert_eq!(report.violations(), 0);
    let _: Value = json!(report);
}
