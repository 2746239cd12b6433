//! Shared fixtures: a fresh database per test and waiting on a condition with a deadline.

#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

use rein_store::Store;
use uuid::Uuid;

/// A store on a fresh, migrated database of its own.
pub async fn store(name: &str) -> Store {
    let url = rein_devdb::test_database(name, env!("CARGO_TARGET_TMPDIR"))
        .expect("a test database (set DATABASE_URL or install PostgreSQL)");
    Store::connect(&url, 4).await.expect("connect and migrate")
}

/// Polls `condition` until it holds; panics naming `what` once `deadline` has passed.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if condition().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "timed out after {deadline:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the run is in control state `state`.
pub async fn wait_state(store: &Store, run: Uuid, state: &str) {
    wait_until(
        &format!("run {run} is in {state}"),
        Duration::from_secs(30),
        || async { store.run(run).await.expect("run").state == state },
    )
    .await;
}

/// Waits until the run's lease has expired by the database clock.
pub async fn wait_lease_expired(store: &Store, run: Uuid) {
    wait_until(
        "the lease expired by the database clock",
        Duration::from_secs(10),
        || async { !store.run(run).await.expect("run").lease_live },
    )
    .await;
}

/// Asserts that the run's log replays to its stored projection (SPEC E3).
pub async fn assert_replays(store: &Store, run: Uuid) {
    assert_eq!(
        store.verify_run(run).await.expect("verify_run"),
        None,
        "run {run}: log does not replay to the stored projection"
    );
}

/// The run's events of type `kind`, in order.
pub async fn events_of(store: &Store, run: Uuid, kind: &str) -> Vec<rein_store::StoredEvent> {
    store
        .history(run)
        .await
        .expect("history")
        .into_iter()
        .filter(|e| e.kind == kind)
        .collect()
}

/// Starts the runs `requests` ask for, in one statement; their ids, in order.
pub async fn enqueue_all(store: &Store, requests: &[rein_store::EnqueueRequest]) -> Vec<Uuid> {
    store
        .enqueue_batch(requests)
        .await
        .expect("enqueue")
        .into_iter()
        .map(|e| e.run_id)
        .collect()
}

/// Starts a run of `def` with `input`.
pub async fn enqueue(store: &Store, def: &rein_core::Definition, input: serde_json::Value) -> Uuid {
    store
        .enqueue(rein_store::EnqueueRequest::new(def.clone(), input))
        .await
        .expect("enqueue")
        .run_id
}

pub async fn event_types(store: &Store, run: Uuid) -> Vec<String> {
    store
        .history(run)
        .await
        .expect("history")
        .into_iter()
        .map(|e| e.kind)
        .collect()
}

/// Reads `(value, progress)` with `query` until `progress` reaches `at_least`, and returns
/// `value`. Each backend sends its statistics to the shared counters in its own time (about
/// a second after it goes idle), so a figure is read only once the work it follows shows.
pub async fn statistics_once(store: &Store, query: &'static str, at_least: i64) -> i64 {
    let end = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (value, progress): (i64, i64) = sqlx::query_as(query)
            .fetch_one(store.pool())
            .await
            .expect("statistics");
        if progress >= at_least {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "the statistics never reached {at_least} (they show {progress}): {query}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
