//! Redis as an accelerator (SPEC K1), against real Redis and real PostgreSQL: wake-ups make
//! an idle worker claim at once, and a private Redis stopped in the middle of a load loses
//! nothing, duplicates nothing, and wake-ups resume when it comes back.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    Fleet, PrivateRedis, await_all_terminal, enqueue_many, free_port, fresh_store, tmp_dir,
};
use rein_store::Store;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Long enough that a run finishing well under it was claimed on a wake-up, not a poll
/// (idle waits grow to four times this).
const POLL_MS: &str = "1500";
/// A probe run counts as woken when it finishes within this.
const WOKEN_WITHIN: Duration = Duration::from_millis(900);

/// Enqueues one run at a time through a store that publishes wake-ups and returns how long
/// each took to finish.
async fn probe(store: &Store, n: usize) -> Vec<Duration> {
    let mut took = Vec::new();
    for _ in 0..n {
        let started = Instant::now();
        let ids = enqueue_many(
            store,
            "lifecycle",
            json!({ "sim": { "work_ms": 1 } }),
            "default",
            1,
        )
        .await;
        loop {
            let row = store.run(ids[0]).await.expect("read run");
            if row.status == "terminal" {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "probe run never finished"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        took.push(started.elapsed());
        // Let the workers fall back to their longest idle wait.
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_load_loses_nothing_and_wakeups_resume() {
    let dir = tmp_dir("redis-stop");
    let port = free_port();
    let redis = PrivateRedis::start(port, &dir);
    let url_redis = redis.url();
    let prefix = format!("rein-test-{}", std::process::id());
    let (url, store) = fresh_store("redis_stop").await;
    let stop = CancellationToken::new();
    let publisher = rein_accel::Publisher::start(
        rein_accel::RedisConfig::new(url_redis.clone()).with_prefix(prefix.clone()),
        stop.clone(),
    );
    let store = store.with_wake_hook(Arc::new(move |q| publisher.wake(q)));

    let mut fleet = Fleet::new(&url, "redis-stop");
    let redis_args = [
        "--redis-url",
        url_redis.as_str(),
        "--redis-prefix",
        prefix.as_str(),
    ];
    for id in ["w1", "w2"] {
        let mut args = vec![
            "worker",
            "--lease-ttl-ms",
            "2000",
            "--poll-interval-ms",
            POLL_MS,
        ];
        args.extend(redis_args);
        fleet.spawn(id, &args);
    }
    let mut args = vec!["scheduler", "--tick-ms", "100"];
    args.extend(redis_args);
    fleet.spawn("s1", &args);
    tokio::time::sleep(Duration::from_secs(3)).await;

    let before = probe(&store, 3).await;
    println!("redis-stop: probe runs with Redis up took {before:?}");
    assert!(
        before.iter().all(|d| *d < WOKEN_WITHIN),
        "idle workers were not woken by Redis: {before:?}"
    );

    // A load with retries (timers fired by the scheduler), Redis killed in the middle.
    let load = enqueue_many(
        &store,
        "lifecycle",
        json!({ "sim": { "work_ms": 5, "transient_failures": 1 } }),
        "default",
        300,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.stop();
    let stopped_at = Instant::now();
    await_all_terminal(&store, Duration::from_secs(180)).await;
    println!(
        "redis-stop: {} runs terminal {:?} after Redis was stopped",
        load.len(),
        stopped_at.elapsed()
    );

    // Back on the same port: the subscriptions reconnect and wake-ups resume.
    let redis = PrivateRedis::start(port, &dir);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = probe(&store, 3).await;
    println!("redis-stop: probe runs after Redis returned took {after:?}");
    assert!(
        after.iter().all(|d| *d < WOKEN_WITHIN),
        "wake-ups did not resume after Redis returned: {after:?}"
    );

    let report = store.audit().await.expect("audit");
    println!("redis-stop: audit {report:?}");
    assert_eq!(report.violations(), 0, "audit: {report:?}");
    assert_eq!(report.runs, report.runs_terminal);
    assert_eq!(report.runs, 306);

    for id in ["w1", "w2", "s1"] {
        assert_eq!(
            fleet.terminate(id, Duration::from_secs(20)),
            Some(0),
            "{id} exit"
        );
    }
    let log = std::fs::read_to_string(fleet.log_dir.join("w1.err")).unwrap_or_default();
    assert!(
        log.contains("Redis unreachable"),
        "w1 did not warn that Redis was gone"
    );
    assert!(
        log.contains("Redis reachable again"),
        "w1 did not say Redis was back"
    );
    stop.cancel();
    drop(redis);
}
