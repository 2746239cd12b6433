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
