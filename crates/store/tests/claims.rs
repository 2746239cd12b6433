//! Claims shared fairly among a worker's queues (SPEC X1, Z4), against a real PostgreSQL: one
//! queue's backlog never starves another, and fairness keeps every claim rule (no run claimed
//! twice, priority within a queue).

use crate::common;

use std::collections::{HashMap, HashSet};

use common::store;
use rein_store::{ClaimedRun, EnqueueRequest, Store};
use serde_json::json;
use uuid::Uuid;

/// Enqueues `n` lifecycle runs on `queue`, with priority `priority(i)` for the i-th, in one
/// statement.
async fn backlog(
    store: &Store,
    queue: &str,
    n: usize,
    priority: impl Fn(usize) -> i32,
) -> Vec<Uuid> {
    let requests: Vec<EnqueueRequest> = (0..n)
        .map(|i| {
            let mut r = EnqueueRequest::new(rein_core::builtin::lifecycle(), json!({ "i": i }));
            r.queue = queue.to_owned();
            r.priority = priority(i);
            r
        })
        .collect();
    common::enqueue_all(store, &requests).await
}

async fn queue_of(store: &Store, claimed: &[ClaimedRun]) -> Vec<String> {
    let ids: Vec<Uuid> = claimed.iter().map(|c| c.run_id).collect();
    let mut queues: Vec<String> =
        sqlx::query_scalar("SELECT queue FROM rein_runs WHERE run_id = ANY($1)")
            .bind(&ids)
            .fetch_all(store.pool())
            .await
            .expect("queues");
    queues.sort();
    queues
}

fn both() -> Vec<String> {
    // The backlog's queue sorts first: a claim in queue order would drain it first.
    vec!["a-backlog".to_owned(), "b-small".to_owned()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serving_two_queues_claims_from_the_small_one_despite_the_others_backlog() {
    let store = store("claim_fair").await;
    // The backlog is older and of the same priority: by age alone it would go first.
    backlog(&store, "a-backlog", 500, |_| 0).await;
    let small = backlog(&store, "b-small", 3, |_| 0).await;

    let first = store.claim("w1", 4, 60_000, &both()).await.expect("claim");
    assert_eq!(
        queue_of(&store, &first).await,
        ["a-backlog", "a-backlog", "b-small", "b-small"],
        "a claim of 4 takes an equal share of each queue"
    );

    // Claims of one alternate between the queues, so the small one's last run is claimed
    // within two more claims.
    let mut claimed_small: HashSet<Uuid> = first.iter().map(|c| c.run_id).collect();
    let mut per_queue: HashMap<String, usize> = HashMap::new();
    for _ in 0..2 {
        let one = store.claim("w1", 1, 60_000, &both()).await.expect("claim");
        assert_eq!(one.len(), 1);
        claimed_small.insert(one[0].run_id);
        for q in queue_of(&store, &one).await {
            *per_queue.entry(q).or_default() += 1;
        }
    }
    assert_eq!(per_queue.get("a-backlog"), Some(&1), "{per_queue:?}");
    assert_eq!(per_queue.get("b-small"), Some(&1), "{per_queue:?}");
    assert!(
        small.iter().all(|r| claimed_small.contains(r)),
        "every small run claimed"
    );

    // With the small queue empty, its share goes to the backlog.
    let rest = store.claim("w1", 6, 60_000, &both()).await.expect("claim");
    assert_eq!(queue_of(&store, &rest).await, vec!["a-backlog"; 6]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_fair_claims_take_each_run_exactly_once() {
    let store = store("claim_fair_concurrent").await;
    // Queues of different sizes: claims go through both the shares and the fill.
    let mut runs = backlog(&store, "a-backlog", 120, |i| (i % 3) as i32).await;
    runs.extend(backlog(&store, "b-small", 40, |i| (i % 2) as i32).await);

    let claimers: Vec<_> = (0..4)
        .map(|w| {
            let store = store.clone();
            tokio::spawn(async move {
                let worker = format!("w{w}");
                let mut taken: Vec<Uuid> = Vec::new();
                loop {
                    let claimed = store
                        .claim(&worker, 5, 60_000, &both())
                        .await
                        .expect("claim");
                    if claimed.is_empty() {
                        return taken;
                    }
                    taken.extend(claimed.into_iter().map(|c| c.run_id));
                }
            })
        })
        .collect();
    let mut taken: Vec<Uuid> = Vec::new();
    for claimer in claimers {
        taken.extend(claimer.await.expect("claimer"));
    }
    assert_eq!(taken.len(), runs.len(), "no run is claimed twice");
    assert_eq!(
        taken.into_iter().collect::<HashSet<_>>(),
        runs.into_iter().collect::<HashSet<_>>(),
        "every run is claimed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn within_a_queue_a_fair_claim_takes_the_highest_priority_first() {
    let store = store("claim_fair_priority").await;
    backlog(&store, "a-backlog", 30, |i| (i % 3) as i32).await;
    backlog(&store, "b-small", 7, |i| (i % 2) as i32).await;
    let mut seen: HashMap<String, Vec<i32>> = HashMap::new();
    loop {
        let claimed = store.claim("w1", 4, 60_000, &both()).await.expect("claim");
        if claimed.is_empty() {
            break;
        }
        let ids: Vec<Uuid> = claimed.iter().map(|c| c.run_id).collect();
        let mut rows: Vec<(String, i32)> =
            sqlx::query_as("SELECT queue, priority FROM rein_runs WHERE run_id = ANY($1)")
                .bind(&ids)
                .fetch_all(store.pool())
                .await
                .expect("rows");
        // The order within one claim is not part of the contract; across claims it is.
        rows.sort_by_key(|r| std::cmp::Reverse(r.1));
        for (queue, priority) in rows {
            seen.entry(queue).or_default().push(priority);
        }
    }
    for (queue, priorities) in &seen {
        let mut sorted = priorities.clone();
        sorted.sort_by(|a, b| b.cmp(a));
        assert_eq!(priorities, &sorted, "queue {queue} is claimed by priority");
    }
    assert_eq!(seen["a-backlog"].len(), 30);
    assert_eq!(seen["b-small"].len(), 7);
}

/// Scans of `rein_runs` so far, read once the statistics show `updated` row updates in it.
async fn run_scans_after(watch: &Store, updated: i64) -> i64 {
    common::statistics_once(
        watch,
        "SELECT seq_scan, n_tup_upd FROM pg_stat_user_tables WHERE relname = 'rein_runs'",
        updated,
    )
    .await
}

/// A worker's connection keeps a claim plan made when `rein_runs` was empty and had no
/// statistics: it scanned the whole table for the runs it had picked, at every claim, however
/// large the table grew, until autovacuum's first ANALYZE. Taking the first statistics once
/// the table holds runs (what a leading scheduler does) makes it plan again: a probe by key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_probe_by_key_once_the_first_statistics_are_taken() {
    let url = rein_devdb::test_database("first_statistics", env!("CARGO_TARGET_TMPDIR"))
        .expect("a test database");
    // One connection, so every claim runs on the plan the first one made.
    let worker = Store::connect(&url, 1).await.expect("connect");
    let watch = Store::connect_without_migrating(&url, 1)
        .await
        .expect("connect");
    // As before autovacuum comes by (it would analyze the table in its own time).
    sqlx::query("ALTER TABLE rein_runs SET (autovacuum_enabled = false)")
        .execute(watch.pool())
        .await
        .expect("autovacuum off");
    let queues = vec!["default".to_owned()];
    assert!(
        worker
            .claim("w1", 8, 60_000, &queues)
            .await
            .unwrap()
            .is_empty(),
        "nothing to claim yet: the plan is made on an empty table"
    );
    assert!(
        !worker.first_statistics(1_000).await.unwrap(),
        "no statistics are taken of an empty table"
    );
    backlog(&worker, "default", 2_000, |_| 0).await;

    // Scans of rein_runs by five claims of one run, made once `updated` updates show.
    let five_claims_scan = |updated: i64| {
        let (worker, watch, queues) = (&worker, &watch, &queues);
        async move {
            let before = run_scans_after(watch, updated).await;
            for _ in 0..5 {
                let claimed = worker.claim("w1", 1, 60_000, queues).await.unwrap();
                assert_eq!(claimed.len(), 1);
            }
            run_scans_after(watch, updated + 5).await - before
        }
    };
    let scanned = five_claims_scan(0).await;
    assert!(
        scanned >= 5,
        "the plan made on the empty table scanned rein_runs {scanned} times for 5 claims: \
         the check below could not tell it from a probe"
    );

    assert!(worker.first_statistics(1_000).await.unwrap());
    // One claim more, so the counters read next include what taking the statistics read.
    assert_eq!(
        worker.claim("w1", 1, 60_000, &queues).await.unwrap().len(),
        1
    );
    assert_eq!(
        five_claims_scan(6).await,
        0,
        "claims still scan rein_runs after its first statistics were taken"
    );
    assert!(
        worker.first_statistics(1_000).await.unwrap(),
        "statistics taken stay taken"
    );
}
