//! Graceful shutdown with real processes (SPEC X8): a `rein worker` told to stop with SIGTERM
//! while its sim actions run stops claiming, lets the actions finish (or, past its grace
//! period, stops them and lets their leases lapse), and exits 0; another worker then finishes
//! every run with no duplicated side effect and the audit finds nothing broken. `rein
//! scheduler` and `rein api` exit 0 on SIGTERM too.

use crate::common;

use std::time::{Duration, Instant};

use common::{Fleet, wait_for};
use rein_store::Store;
use serde_json::json;
use uuid::Uuid;

const POLL: Duration = Duration::from_millis(20);
/// How long after SIGTERM beyond its grace period a process may take to exit (connection
/// close, deregistering, a last commit).
const EXIT_SLACK: Duration = Duration::from_secs(3);

/// `n` lifecycle runs whose every step (start, then the side-effect step) takes `work_ms`.
async fn slow_runs(store: &Store, n: usize, work_ms: u64) -> Vec<Uuid> {
    let input = json!({ "sim": { "work_ms": work_ms, "side_effect": true } });
    common::enqueue_many(store, "lifecycle", input, "default", n).await
}

/// Starts worker `w1` and waits until it runs the side-effect action of every run.
async fn w1_running_actions(
    fleet: &mut Fleet,
    store: &Store,
    runs: &[Uuid],
    lease_ttl_ms: &str,
    grace_ms: &str,
) {
    fleet.spawn(
        "w1",
        &[
            "worker",
            "--lease-ttl-ms",
            lease_ttl_ms,
            "--poll-interval-ms",
            "20",
            "--shutdown-grace-ms",
            grace_ms,
        ],
    );
    wait_for(
        "w1 running every side-effect action",
        Duration::from_secs(30),
        Duration::from_millis(5),
        || all_dispatched_by(store, runs, "w1"),
    )
    .await;
}

/// Whether every run's newest event is the dispatch of its side-effect step, by `worker`: the
/// action is running right now.
async fn all_dispatched_by(store: &Store, runs: &[Uuid], worker: &str) -> bool {
    for run in runs {
        let Ok(history) = store.history(*run).await else {
            return false;
        };
        let in_flight = history
            .last()
            .is_some_and(|e| e.kind == "ACTION_DISPATCHED" && e.worker == worker);
        if !in_flight {
            return false;
        }
    }
    true
}

/// Waits for process `id` to exit; returns its exit code and how long it took.
async fn exit_of(fleet: &mut Fleet, id: &str, bound: Duration) -> (Option<i32>, Duration) {
    let started = Instant::now();
    loop {
        if let Some(status) = fleet.proc(id).child.try_wait().expect("try_wait") {
            return (status.code(), started.elapsed());
        }
        assert!(
            started.elapsed() < bound,
            "{id} did not exit within {bound:?} of SIGTERM; its log is in {}",
            fleet.log_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Starts a second worker and a scheduler, waits until every run is terminal, and checks the
/// whole database: contiguous sequences, replay, tokens, and each side effect applied once.
async fn finish_and_audit(fleet: &mut Fleet, store: &Store, lease_ttl_ms: &str) {
    fleet.spawn_worker("w2", lease_ttl_ms);
    fleet.spawn("s1", &["scheduler", "--tick-ms", "50"]);
    common::await_all_terminal(store, Duration::from_secs(60)).await;
    let audit = store.audit().await.expect("audit");
    assert_eq!(audit.violations(), 0, "{audit:?}");
    assert_eq!(audit.duplicate_effects, 0, "{audit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_inflight_actions_finish_commits_releases_and_exits_0() {
    let (url, store) = common::fresh_store("shutdown_drain").await;
    let runs = slow_runs(&store, 4, 1_500).await;
    let mut fleet = Fleet::new(&url, "shutdown-drain");
    let grace = Duration::from_millis(8_000);
    w1_running_actions(&mut fleet, &store, &runs, "3000", "8000").await;

    fleet.proc("w1").signal(libc::SIGTERM);
    let (code, took) = exit_of(&mut fleet, "w1", grace + EXIT_SLACK).await;
    println!("worker shutdown with actions finishing: exited {code:?} after {took:?}");
    assert_eq!(code, Some(0), "exit code of w1");

    for run in &runs {
        let row = store.run(*run).await.expect("run");
        assert_eq!(row.lease_owner, None, "run {run}: w1 released its lease");
        let history = store.history(*run).await.expect("history");
        let dispatched = history
            .iter()
            .rposition(|e| e.kind == "ACTION_DISPATCHED")
            .expect("a dispatch");
        assert!(
            history[dispatched + 1..].iter().any(|e| e.worker == "w1"),
            "run {run}: w1 committed the action's result before exiting: {:?}",
            history.iter().map(|e| &e.kind).collect::<Vec<_>>()
        );
        assert_eq!(
            history.iter().filter(|e| e.kind == "LEASE_EXPIRED").count(),
            0,
            "run {run}: nothing was left to lapse"
        );
    }
    finish_and_audit(&mut fleet, &store, "3000").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_past_the_grace_period_exits_0_and_the_run_is_recovered_once() {
    let (url, store) = common::fresh_store("shutdown_grace").await;
    let runs = slow_runs(&store, 2, 2_500).await;
    let mut fleet = Fleet::new(&url, "shutdown-grace");
    let grace = Duration::from_millis(500);
    w1_running_actions(&mut fleet, &store, &runs, "1500", "500").await;
    let held: Vec<(Uuid, i64)> = store.live_leases_of("w1").await.expect("leases");
    assert_eq!(held.len(), runs.len(), "w1 holds every run: {held:?}");

    fleet.proc("w1").signal(libc::SIGTERM);
    let (code, took) = exit_of(&mut fleet, "w1", grace + EXIT_SLACK).await;
    println!("worker shutdown with actions past the grace period: exited {code:?} after {took:?}");
    assert_eq!(code, Some(0), "exit code of w1");
    for run in &runs {
        let history = store.history(*run).await.expect("history");
        assert_eq!(
            history.last().map(|e| e.kind.as_str()),
            Some("ACTION_DISPATCHED"),
            "run {run}: the stopped action committed nothing"
        );
    }

    finish_and_audit(&mut fleet, &store, "1500").await;
    assert_eq!(
        store.not_taken_over(&held).await.expect("taken over"),
        0,
        "every run w1 held moved on under a newer token"
    );
    for run in &runs {
        let history = store.history(*run).await.expect("history");
        let kinds: Vec<&str> = history.iter().map(|e| e.kind.as_str()).collect();
        assert!(
            kinds.contains(&"LEASE_EXPIRED"),
            "run {run}: recovered after its lease lapsed: {kinds:?}"
        );
        assert_eq!(
            store.run(*run).await.expect("run").state,
            "done",
            "run {run}: {kinds:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduler_exits_0_on_sigterm() {
    let (url, store) = common::fresh_store("shutdown_scheduler").await;
    let mut fleet = Fleet::new(&url, "shutdown-scheduler");
    fleet.spawn("s1", &["scheduler", "--tick-ms", "50"]);
    wait_for("s1 registered", Duration::from_secs(20), POLL, || async {
        store
            .members()
            .await
            .is_ok_and(|m| m.iter().any(|m| m.worker_id == "s1"))
    })
    .await;
    fleet.proc("s1").signal(libc::SIGTERM);
    let (code, took) = exit_of(&mut fleet, "s1", EXIT_SLACK).await;
    println!("scheduler shutdown: exited {code:?} after {took:?}");
    assert_eq!(code, Some(0), "exit code of s1");
    let members = store.members().await.expect("members");
    assert!(
        members.iter().all(|m| m.worker_id != "s1"),
        "s1 deregistered on its way out: {members:?}"
    );
}

/// A request whose body is still arriving when SIGTERM comes is served to the end; the
/// listener closes at once, and the API exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_drains_an_inflight_request_on_sigterm_and_exits_0() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let (url, store) = common::fresh_store("shutdown_api").await;
    let token = common::token(&url, "drain-test", &["enqueue"]);
    let mut fleet = Fleet::new(&url, "shutdown-api");
    let address = fleet.spawn_server("api", &["api", "--listen", "127.0.0.1:0"]);
    let host = address.trim_start_matches("http://").to_owned();

    let body = br#"{"definition": "lifecycle", "input": {}}"#;
    let mut conn = tokio::net::TcpStream::connect(&host)
        .await
        .expect("connect");
    // `Expect: 100-continue`: the server answers `100 Continue` once the handler asks for the
    // body, so the test knows the request is in flight before it sends SIGTERM.
    let request = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(request.as_bytes())
        .await
        .expect("write head");
    let mut interim = Vec::new();
    while !interim.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = conn.read(&mut byte).await.expect("read 100 Continue");
        assert_eq!(n, 1, "the connection closed early: {interim:?}");
        interim.push(byte[0]);
    }
    assert!(
        interim.starts_with(b"HTTP/1.1 100"),
        "{}",
        String::from_utf8_lossy(&interim)
    );

    fleet.proc("api").signal(libc::SIGTERM);
    wait_for(
        "the API to stop accepting connections",
        EXIT_SLACK,
        POLL,
        || {
            let host = host.clone();
            async move { tokio::net::TcpStream::connect(&host).await.is_err() }
        },
    )
    .await;
    let status = fleet.proc("api").child.try_wait().expect("try_wait");
    assert_eq!(status, None, "the API waits for the request in flight");

    conn.write_all(body).await.expect("write the body");
    let mut response = String::new();
    conn.read_to_string(&mut response)
        .await
        .expect("read the response");
    assert!(
        response.starts_with("HTTP/1.1 201"),
        "the request in flight was served: {response}"
    );
    let (code, took) = exit_of(&mut fleet, "api", EXIT_SLACK).await;
    println!("api shutdown after its last request: exited {code:?} after {took:?}");
    assert_eq!(code, Some(0), "exit code of the API");
    assert_eq!(
        store.run_totals().await.expect("totals").0,
        1,
        "the drained request enqueued its run"
    );
}
