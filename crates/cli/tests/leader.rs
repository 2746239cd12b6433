//! Scheduler leader election (SPEC S3) with real processes: two `rein scheduler`s, one leads;
//! killed with SIGKILL, the other leads within the lease TTL and fires the timers that come
//! due; stopped with SIGSTOP past its TTL, it is replaced, and when continued it steps down,
//! and nothing is applied twice.

use crate::common;

use std::time::{Duration, Instant};

use common::{Fleet, rein, stderr, stdout, wait_for};
use rein_store::Store;
use serde_json::{Value, json};
use uuid::Uuid;

const POLL: Duration = Duration::from_millis(10);
const TICK_MS: u64 = 50;
const LEADER_TTL_MS: u64 = 1_500;
/// Room for two processes and PostgreSQL sharing a busy machine when measuring by polling.
const MEASURE_SLACK: Duration = Duration::from_millis(1_000);

fn start_schedulers(fleet: &mut Fleet, ids: &[&str]) {
    let tick = TICK_MS.to_string();
    let ttl = LEADER_TTL_MS.to_string();
    for id in ids {
        fleet.spawn(
            id,
            &["scheduler", "--tick-ms", &tick, "--leader-ttl-ms", &ttl],
        );
    }
}

/// The holder of a live scheduler lease, once there is one.
async fn await_leader(store: &Store, among: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(l)) = store.leader(rein_scheduler::LEADER_LEASE).await
            && l.live
            && among.contains(&l.holder.as_str())
        {
            return l.holder;
        }
        assert!(Instant::now() < deadline, "no scheduler leads");
        tokio::time::sleep(POLL).await;
    }
}

/// Waits for `holder` to lead, prints how long that took after `what`, and checks it was
/// within one lease TTL plus a tick.
async fn assert_takes_over(store: &Store, holder: &str, what: &str) {
    let started = Instant::now();
    let deadline = Duration::from_millis(LEADER_TTL_MS) + MEASURE_SLACK + Duration::from_secs(5);
    wait_for(&format!("{holder} to lead"), deadline, POLL, || async {
        store
            .leader(rein_scheduler::LEADER_LEASE)
            .await
            .is_ok_and(|l| l.is_some_and(|l| l.live && l.holder == holder))
    })
    .await;
    let took = started.elapsed();
    println!(
        "{what}: {holder} leads after {took:?} (leader TTL {LEADER_TTL_MS} ms, tick {TICK_MS} ms)"
    );
    assert!(
        took <= Duration::from_millis(LEADER_TTL_MS + TICK_MS) + MEASURE_SLACK,
        "the follower leads within one lease TTL plus a tick: took {took:?}"
    );
}

/// Research-agent runs whose tool step fails transiently `failures` times: each retry is a
/// timer only a scheduler fires.
async fn retrying_runs(store: &Store, n: usize, failures: u32) -> Vec<Uuid> {
    let input = json!({ "sim": { "work_ms": 5, "transient_failures": failures } });
    common::enqueue_many(store, "research-agent", input, "default", n).await
}

async fn retries_fired(store: &Store, run: Uuid) -> Vec<String> {
    store
        .history(run)
        .await
        .expect("history")
        .into_iter()
        .filter(|e| e.kind == "RETRY_DUE")
        .map(|e| e.worker)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_within_its_ttl_and_timers_still_fire() {
    let (url, store) = common::fresh_store("leader_kill").await;
    let mut fleet = Fleet::new(&url, "leader-kill");
    start_schedulers(&mut fleet, &["s1", "s2"]);
    let leader = await_leader(&store, &["s1", "s2"]).await;
    let follower = if leader == "s1" { "s2" } else { "s1" };

    // `rein workers` names the leader.
    wait_for(
        "both schedulers registered",
        Duration::from_secs(20),
        POLL,
        || async { store.members().await.is_ok_and(|m| m.len() == 2) },
    )
    .await;
    let out = rein(&["workers", "--database-url", &url, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let members: Value = serde_json::from_str(&stdout(&out)).expect("json");
    let leading: Vec<&str> = members
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["leader"] == true)
        .filter_map(|m| m["worker_id"].as_str())
        .collect();
    assert_eq!(leading, vec![leader.as_str()], "{members}");
    let table = stdout(&rein(&["workers", "--database-url", &url]));
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(leader.as_str()) && l.contains("scheduler (leader)")),
        "{table}"
    );

    fleet.kill(&leader);
    assert_takes_over(&store, follower, "failover after kill -9 of the leader").await;

    // Timers that come due after the kill are fired, by the new leader.
    let runs = retrying_runs(&store, 3, 1).await;
    fleet.spawn_worker("w1", "2000");
    common::await_all_terminal(&store, Duration::from_secs(60)).await;
    for run in &runs {
        let fired = retries_fired(&store, *run).await;
        assert_eq!(fired, vec![follower.to_owned()], "run {run}");
        assert_eq!(store.run(*run).await.expect("run").state, "SUCCEEDED");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_is_replaced_and_steps_down_when_continued() {
    let (url, store) = common::fresh_store("leader_stop").await;
    let mut fleet = Fleet::new(&url, "leader-stop");
    start_schedulers(&mut fleet, &["s1", "s2"]);
    let leader = await_leader(&store, &["s1", "s2"]).await;
    let follower = if leader == "s1" { "s2" } else { "s1" };
    // Timers keep coming due the whole time, so the leader is likely stopped mid-tick.
    let runs = retrying_runs(&store, 40, 2).await;
    fleet.spawn_worker("w1", "2000");
    wait_for(
        "a first retry fired",
        Duration::from_secs(30),
        POLL,
        || async {
            for run in &runs {
                if !retries_fired(&store, *run).await.is_empty() {
                    return true;
                }
            }
            false
        },
    )
    .await;

    fleet.proc(&leader).signal(libc::SIGSTOP);
    assert_takes_over(&store, follower, "takeover from a stopped leader").await;

    fleet.proc(&leader).signal(libc::SIGCONT);
    let log = fleet.log_dir.join(format!("{leader}.err"));
    wait_for(
        "the old leader to step down",
        Duration::from_secs(10),
        POLL,
        || async { std::fs::read_to_string(&log).is_ok_and(|l| l.contains("stepped down")) },
    )
    .await;
    let now = store
        .leader(rein_scheduler::LEADER_LEASE)
        .await
        .expect("leader")
        .expect("a lease");
    assert_eq!((now.holder.as_str(), now.live), (follower, true));

    common::await_all_terminal(&store, Duration::from_secs(90)).await;
    let audit = store.audit().await.expect("audit");
    assert_eq!(audit.violations(), 0, "{audit:?}");
    for run in &runs {
        let fired = retries_fired(&store, *run).await;
        assert_eq!(
            fired.len(),
            2,
            "run {run}: each retry fired once: {fired:?}"
        );
        assert_eq!(store.run(*run).await.expect("run").state, "SUCCEEDED");
    }
}
