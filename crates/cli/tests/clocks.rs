//! Clocks that disagree (SPEC X3, S1): two workers and two schedulers run with their wall
//! clocks a minute ahead of and behind the database's (libfaketime, Debian package
//! `faketime`), and nothing changes, because every lease, backoff and deadline is judged by
//! the database clock: every run ends, the audit finds no violation, no lease is granted for
//! longer than its TTL, and each retry waits its backoff — not a minute less or more.

use crate::common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::Fleet;
use rein_store::EnqueueRequest;
use serde_json::json;

const RUNS: u32 = 150;
const LEASE_TTL_MS: u64 = 1_500;
const SKEW_S: i64 = 60;
const DEADLINE: Duration = Duration::from_secs(180);
/// lifecycle's first backoff is 200 ms with 20% jitter.
const BACKOFF_MIN_MS: f64 = 150.0;
/// Far below the skew: a retry fired by a skewed clock would wait a minute more (or none).
const BACKOFF_MAX_MS: f64 = 20_000.0;

/// libfaketime's multi-threaded build (the roles run tokio's threads).
fn libfaketime() -> PathBuf {
    let candidates = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|arch| arch.path().join("faketime/libfaketimeMT.so.1"))
        .chain([PathBuf::from("/usr/lib/faketime/libfaketimeMT.so.1")]);
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .expect("libfaketime is not installed: apt-get install faketime (scripts/test.sh installs it when root)")
}

/// The environment that moves a process's wall clock by `offset_s` (monotonic time, which
/// timers use, stays real).
fn skewed(lib: &std::path::Path, offset_s: i64) -> Vec<(String, String)> {
    vec![
        ("LD_PRELOAD".to_owned(), lib.display().to_string()),
        ("FAKETIME".to_owned(), format!("{offset_s:+}s")),
        ("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
        ("FAKETIME_NO_CACHE".to_owned(), "1".to_owned()),
    ]
}

/// Seconds by which a process under `env` sees the wall clock off from this one's: the
/// proof that the fault is in place.
fn observed_skew_s(env: &[(String, String)]) -> i64 {
    let out = Command::new("date")
        .arg("+%s")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .expect("run date");
    let theirs: i64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("date +%s prints seconds");
    let ours = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    theirs - ours
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_and_schedulers_a_minute_off_change_nothing() {
    let lib = libfaketime();
    let ahead = skewed(&lib, SKEW_S);
    let behind = skewed(&lib, -SKEW_S);
    for (env, want) in [(&ahead, SKEW_S), (&behind, -SKEW_S)] {
        let seen = observed_skew_s(env);
        assert!(
            (seen - want).abs() <= 2,
            "libfaketime moved the clock by {seen} s, not {want} s"
        );
    }

    let (url, store) = common::fresh_store("clocks").await;
    let lifecycle = store.load_definition("lifecycle", None).await.unwrap();
    let requests: Vec<EnqueueRequest> = (0..RUNS)
        .map(|i| {
            let mut sim = json!({ "work_ms": 10 + i % 20 });
            if i % 5 < 2 {
                sim["transient_failures"] = json!(1 + i % 2);
            }
            if i % 3 == 0 {
                sim["steps"] = json!(2);
            }
            EnqueueRequest::new(lifecycle.clone(), json!({ "sim": sim }))
        })
        .collect();
    store.enqueue_batch(&requests).await.unwrap();

    let ttl = LEASE_TTL_MS.to_string();
    let worker = [
        "worker",
        "--concurrency",
        "8",
        "--lease-ttl-ms",
        &ttl,
        "--poll-interval-ms",
        "50",
    ];
    let scheduler = ["scheduler", "--tick-ms", "100"];
    let as_refs = |env: &Vec<(String, String)>| -> Vec<(String, String)> { env.clone() };
    let mut fleet = Fleet::new(&url, "clocks");
    let spawned_at = chrono::Utc::now();
    for (id, args, env) in [
        ("clocks-w-ahead", &worker[..], as_refs(&ahead)),
        ("clocks-w-behind", &worker[..], as_refs(&behind)),
        ("clocks-s-ahead", &scheduler[..], as_refs(&ahead)),
        ("clocks-s-behind", &scheduler[..], as_refs(&behind)),
    ] {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        fleet.spawn_env(id, args, &env);
    }

    // While the runs move, no lease reaches further than its TTL past the database's now.
    let started = Instant::now();
    let mut longest_lease_s: f64 = 0.0;
    loop {
        let (left, lease_s): (i64, Option<f64>) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status <> 'terminal'),
                    max(extract(epoch FROM lease_until - clock_timestamp()))::float8
             FROM rein_runs",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        longest_lease_s = longest_lease_s.max(lease_s.unwrap_or(0.0));
        if left == 0 {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{left} runs not terminal after {DEADLINE:?}; logs in {}",
            fleet.log_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ttl_s = LEASE_TTL_MS as f64 / 1000.0;
    assert!(
        longest_lease_s <= ttl_s + 0.5,
        "a lease reached {longest_lease_s:.1} s ahead of the database clock (TTL {ttl_s} s)"
    );

    // The roles themselves ran on the skewed clocks: their logs' first timestamps say so.
    for (id, want) in [
        ("clocks-w-ahead", SKEW_S),
        ("clocks-w-behind", -SKEW_S),
        ("clocks-s-ahead", SKEW_S),
        ("clocks-s-behind", -SKEW_S),
    ] {
        let log = std::fs::read_to_string(fleet.log_dir.join(format!("{id}.err"))).unwrap();
        let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
        let at: chrono::DateTime<chrono::Utc> =
            first["timestamp"].as_str().unwrap().parse().unwrap();
        let off = (at - spawned_at).num_seconds();
        assert!(
            (off - want).abs() <= 10,
            "{id} logged its start {off} s from when it was started, not about {want} s"
        );
    }

    // Both skewed workers did the work, and both schedulers were up.
    let by_worker: Vec<(String, i64)> = sqlx::query_as(
        "SELECT worker, count(*) FROM rein_events WHERE worker LIKE 'clocks-%' GROUP BY 1",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    for id in ["clocks-w-ahead", "clocks-w-behind"] {
        assert!(
            by_worker.iter().any(|(w, n)| w == id && *n > 0),
            "{id} committed nothing: {by_worker:?}"
        );
    }
    for id in [
        "clocks-w-ahead",
        "clocks-w-behind",
        "clocks-s-ahead",
        "clocks-s-behind",
    ] {
        assert!(fleet.proc(id).is_running(), "{id} exited on its own");
    }

    // Each retry waited its backoff by the database clock: from the failure it follows to
    // the `retry` a scheduler fired (lifecycle's names for them).
    let gaps: Vec<f64> = sqlx::query_scalar(
        "SELECT (extract(epoch FROM due.occurred_at - failed.occurred_at) * 1000)::float8
         FROM rein_events due
         JOIN rein_events failed ON failed.run_id = due.run_id AND failed.sequence = due.sequence - 1
         WHERE due.type = 'retry' AND failed.type = 'transient_error'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert!(
        gaps.len() as u32 >= RUNS / 5,
        "only {} retries fired",
        gaps.len()
    );
    let shortest = gaps.iter().copied().fold(f64::INFINITY, f64::min);
    let longest = gaps.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "clocks: {} retries, backoff by the database clock {shortest:.0}..{longest:.0} ms; longest lease {longest_lease_s:.2} s",
        gaps.len()
    );
    assert!(
        shortest >= BACKOFF_MIN_MS,
        "a retry fired {shortest:.0} ms after its failure, before its backoff"
    );
    assert!(
        longest <= BACKOFF_MAX_MS,
        "a retry waited {longest:.0} ms: a skewed clock decided it"
    );

    let report = store.audit().await.unwrap();
    eprintln!("clocks: audit {}", serde_json::to_string(&report).unwrap());
    assert_eq!(report.runs, i64::from(RUNS));
    assert_eq!(report.runs_terminal, report.runs);
    assert_eq!(report.violations(), 0, "{report:?}");
}
