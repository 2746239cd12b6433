//! `rein workers` lists the living only: a worker killed with SIGKILL disappears within its
//! lease TTL, while one still running stays.

use crate::common;

use std::time::{Duration, Instant};

use common::{Fleet, rein, stderr, stdout};
use serde_json::Value;

fn listed(url: &str) -> Vec<String> {
    let out = rein(&["workers", "--json", "--database-url", url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let members: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    members
        .as_array()
        .expect("an array")
        .iter()
        .filter_map(|m| m["worker_id"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_disappears_from_rein_workers_within_its_ttl() {
    const TTL_MS: u64 = 1500;
    let (url, _store) = common::fresh_store("workers_ttl").await;
    let mut fleet = Fleet::new(&url, "workers_ttl");
    let ttl = TTL_MS.to_string();
    fleet.spawn("doomed", &["worker", "--lease-ttl-ms", &ttl]);
    fleet.spawn("steady", &["worker", "--lease-ttl-ms", &ttl]);
    common::wait_for(
        "both workers to be listed",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async { listed(&url).len() == 2 },
    )
    .await;
    fleet.kill("doomed");
    let killed = Instant::now();
    loop {
        let now = listed(&url);
        assert!(
            now.contains(&"steady".to_owned()),
            "a live worker stays: {now:?}"
        );
        if !now.contains(&"doomed".to_owned()) {
            break;
        }
        // Its last heartbeat was at most a third of the TTL before the kill.
        assert!(
            killed.elapsed() < Duration::from_millis(TTL_MS + 1000),
            "still listed {:?} after the kill: {now:?}",
            killed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "gone from `rein workers` {:?} after SIGKILL",
        killed.elapsed()
    );
}

/// A worker and a scheduler whose output pipes were closed (`rein worker | head -1`, a log
/// shipper that died) keep working: the long-running roles keep SIGPIPE ignored, drop what
/// they cannot write, finish every run and stop cleanly when asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_long_running_roles_survive_a_closed_output_pipe() {
    use common::DieWithParent;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    let (url, store) = common::fresh_store("workers_pipe").await;
    let mut fleet = Fleet::new(&url, "workers_pipe");
    for (id, role) in [("piped-w", "worker"), ("piped-s", "scheduler")] {
        let mut child = Command::new(common::REIN)
            .args([role, "--database-url", &url, "--id", id])
            .env("REIN_LOG", "debug,sqlx=warn")
            .env_remove("REDIS_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .die_with_parent()
            .spawn()
            .expect("spawn rein");
        // Both read ends closed at once: every later write fails with EPIPE.
        drop(child.stdout.take());
        drop(child.stderr.take());
        fleet.procs.push(common::Proc {
            name: id.to_owned(),
            child,
        });
    }
    // Runs with a retry: the worker's steps and the scheduler's timers both log as they go.
    let runs = common::enqueue_many(
        &store,
        "lifecycle",
        serde_json::json!({ "sim": { "work_ms": 1, "transient_failures": 1 } }),
        "default",
        20,
    )
    .await;
    common::await_all_terminal(&store, Duration::from_secs(120)).await;
    assert_eq!(runs.len(), 20);
    for id in ["piped-w", "piped-s"] {
        assert!(
            fleet.proc(id).is_running(),
            "{id} died writing to a closed pipe"
        );
        let status = fleet.terminate(id, Duration::from_secs(30));
        assert_eq!(status, Some(0), "{id} did not stop cleanly after SIGTERM");
    }
}
