//! One fleet shared by a hostile tenant and an unrelated team at once (SPEC Z1–Z4, M5, P1).
//!
//! The tenant publishes a definition whose guard is as expensive as registration allows and
//! pokes its runs with it, starts a definition that forks into copies of itself, and holds
//! hundreds of half-sent connections open against the API. Meanwhile another team's runs, on
//! their own queue, must all finish and the API must keep answering. Latencies are printed,
//! not asserted: the assertions are that the unrelated work finishes, every probe of the API
//! is answered, and the fork bomb stays inside its bound.

use crate::common;

use std::time::{Duration, Instant};

use common::{Api, code, wait_for};
use rein_core::{Definition, Format, GuardRegistry};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

/// Runs of the unrelated team.
const TEAM_RUNS: usize = 20;
/// Half-open connections the hostile client holds (the report's attack).
const HALF_OPEN: usize = 300;
/// Concurrent senders of the expensive event.
const POKERS: usize = 4;
/// How long the other team probes the API under attack (longer than its 10 s header timeout).
const PROBE_FOR: Duration = Duration::from_secs(15);

/// A waiting state that takes `POKE` from outside, back into itself, behind `guard`.
fn spin(guard: &str) -> String {
    format!(
        r#"
name = "tenant-spin"
version = 1
cancel_state = "CANCELLED"
events = ["POKE"]
call_results = []
external_events = ["POKE"]

[[states]]
name = "WAIT"
kind = "waiting"
initial = true

[[states]]
name = "CANCELLED"
kind = "terminal"
outcome = "failed"

[[transitions]]
from = "WAIT"
event = "POKE"
to = "WAIT"
guards = [{{ expr = "{guard}" }}]
"#
    )
}

/// A definition that fans out into two copies of itself, without end but for the bounds.
const FORK: &str = r#"
name = "tenant-fork"
version = 1
cancel_state = "CANCELLED"
events = ["next", "JOINED", "JOIN_FAILED"]
call_results = []
external_events = []

[[states]]
name = "START"
kind = "active"
initial = true
action = "noop"

[[states]]
name = "FORK"
kind = "waiting"

[states.fan_out]
joined_event = "JOINED"
failed_event = "JOIN_FAILED"
join = { policy = "all" }
branches = [
  { name = "left", definition = "tenant-fork", succeed_on = ["DONE"] },
  { name = "right", definition = "tenant-fork", succeed_on = ["DONE"] },
]

[[states]]
name = "DONE"
kind = "terminal"
outcome = "succeeded"

[[states]]
name = "FAILED"
kind = "terminal"
outcome = "failed"

[[states]]
name = "CANCELLED"
kind = "terminal"
outcome = "failed"

[[transitions]]
from = "START"
event = "next"
to = "FORK"

[[transitions]]
from = "FORK"
event = "JOINED"
to = "DONE"

[[transitions]]
from = "FORK"
event = "JOIN_FAILED"
to = "FAILED"
"#;

/// Three nested comprehensions over an `n`-element literal list.
fn nested(n: usize) -> String {
    let list = format!(
        "[{}]",
        (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
    );
    format!("{list}.all(a, {list}.all(b, {list}.all(c, true)))")
}

/// The most expensive guard of that shape registration accepts.
fn guard_at_the_bound() -> String {
    let accepted = |n| Definition::parse(&spin(&nested(n)), Format::Toml, &GuardRegistry::new());
    assert!(accepted(10).is_ok(), "{:?}", accepted(10).err());
    let mut n = 10;
    while accepted(n + 1).is_ok() {
        n += 1;
    }
    assert!(accepted(n + 1).is_err(), "the bound refuses {}", n + 1);
    nested(n)
}

async fn publish(api: &Api, token: &str, toml: &str) {
    let (s, v) = api.post_toml("/v1/definitions", token, toml).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

async fn enqueue(api: &Api, token: &str, definition: &str) -> String {
    let (s, v) = api
        .post_json(
            "/v1/runs",
            token,
            &json!({ "definition": definition, "input": {} }),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["run_id"].as_str().expect("run_id").to_owned()
}

/// Milliseconds of a GET that must be answered with `expect`.
async fn probe(http: &reqwest::Client, url: &str, token: Option<&str>, expect: StatusCode) -> f64 {
    let started = Instant::now();
    let mut req = http.get(url).timeout(Duration::from_secs(30));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("{url} not answered: {e}"));
    assert_eq!(r.status(), expect, "{url}");
    started.elapsed().as_secs_f64() * 1e3
}

fn summary(name: &str, mut ms: Vec<f64>) {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    println!(
        "{name}: {} probes, p50 {:.1} ms, p95 {:.1} ms, max {:.1} ms",
        ms.len(),
        at(0.5),
        at(0.95),
        at(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_definition_and_client_leave_another_teams_runs_finishing_and_the_api_answering()
{
    let api = Api::start("hostile", &[]).await;
    let tenant = common::token_with(
        &api.url,
        "tenant",
        &["read", "enqueue", "operate", "publish"],
        &["--queue", "tenant"],
    );
    let team = common::token_with(
        &api.url,
        "team-b",
        &["read", "enqueue"],
        &["--queue", "team-b"],
    );
    let mut fleet = common::Fleet::new(&api.url, "hostile-fleet");
    fleet.spawn(
        "worker",
        &[
            "worker",
            "--queue",
            "tenant",
            "--queue",
            "team-b",
            "--poll-interval-ms",
            "20",
        ],
    );
    fleet.spawn("scheduler", &["scheduler", "--tick-ms", "100"]);

    // The tenant's definitions: the 10^8 guard of the report is refused outright ...
    let big = format!(
        "[{}]",
        (0..=99)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    let ten_to_the_eight = format!("{big}.all(a,{big}.all(b,{big}.all(c,{big}.all(d,true))))");
    let (s, v) = api
        .post_toml("/v1/definitions", &tenant, &spin(&ten_to_the_eight))
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
        "{v}"
    );
    // ... so it takes the most expensive one allowed, and a fork bomb.
    let guard = guard_at_the_bound();
    println!("guard at the bound: {} bytes", guard.len());
    publish(&api, &tenant, &spin(&guard)).await;
    publish(&api, &tenant, FORK).await;
    let spinning: Vec<String> = {
        let mut runs = Vec::new();
        for _ in 0..POKERS {
            runs.push(enqueue(&api, &tenant, "tenant-spin").await);
        }
        runs
    };
    let bomb = enqueue(&api, &tenant, "tenant-fork").await;

    // The hostile client, from its own address: half-sent request heads, opened again as
    // the API closes them, for as long as the test lasts.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let addr: std::net::SocketAddr = api.base.trim_start_matches("http://").parse().unwrap();
    let attacker = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut most = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut held = Vec::new();
                for _ in 0..HALF_OPEN {
                    let socket = tokio::net::TcpSocket::new_v4().unwrap();
                    socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
                    if let Ok(mut s) = socket.connect(addr).await
                        && s.write_all(b"GET /v1/runs HTTP/1.1\r\nHost: x\r\n")
                            .await
                            .is_ok()
                    {
                        held.push(s);
                    }
                }
                most = most.max(held.len());
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            most
        })
    };
    // ... and senders of the expensive event, as fast as the API answers them.
    let mut pokers = Vec::new();
    for run in spinning.clone() {
        let (http, base, token, stop) = (
            api.http.clone(),
            api.base.clone(),
            tenant.clone(),
            stop.clone(),
        );
        pokers.push(tokio::spawn(async move {
            let (mut answered, mut applied) = (0u64, 0u64);
            let mut ms = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let started = Instant::now();
                let r = http
                    .post(format!("{base}/v1/runs/{run}/events"))
                    .bearer_auth(&token)
                    .json(&json!({ "type": "POKE", "payload": {} }))
                    .timeout(Duration::from_secs(30))
                    .send()
                    .await;
                if let Ok(r) = r {
                    applied += u64::from(r.status().is_success());
                    let _ = r.bytes().await;
                    answered += 1;
                    ms.push(started.elapsed().as_secs_f64() * 1e3);
                }
            }
            (answered, applied, ms)
        }));
    }

    // The other team works as usual once the attack is under way, and probes the API for
    // a while (past the API's header timeout, so closed connections are opened again).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let started = Instant::now();
    let mut theirs = Vec::new();
    for _ in 0..TEAM_RUNS {
        theirs.push(enqueue(&api, &team, "chain4").await);
    }
    let (mut health, mut reads) = (Vec::new(), Vec::new());
    let http = reqwest::Client::new();
    let mut finished_after = None;
    while started.elapsed() < Duration::from_secs(180) {
        health.push(
            probe(
                &http,
                &format!("{}/healthz", api.base),
                None,
                StatusCode::OK,
            )
            .await,
        );
        reads.push(
            probe(
                &http,
                &format!("{}/v1/runs?limit=50", api.base),
                Some(&team),
                StatusCode::OK,
            )
            .await,
        );
        let mut done = 0;
        for run in &theirs {
            let (s, v) = api.get_json(&format!("/v1/runs/{run}"), &team).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            if v["status"] == "terminal" {
                assert_eq!(v["state"], "done", "{v}");
                done += 1;
            }
        }
        if done == theirs.len() && finished_after.is_none() {
            finished_after = Some(started.elapsed());
        }
        if finished_after.is_some() && started.elapsed() >= PROBE_FOR {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let finished_after = finished_after.expect("the other team's runs all finished");
    let (mut pokes, mut poke_ms, mut applied) = (0, Vec::new(), 0);
    for p in pokers {
        let (n, a, ms) = p.await.unwrap();
        pokes += n;
        applied += a;
        poke_ms.extend(ms);
    }
    let held = attacker.await.unwrap();
    println!(
        "{TEAM_RUNS} unrelated chain4 runs finished in {:.2} s while one client opened {HALF_OPEN} half-sent connections every 2 s (up to {held} connected) and {pokes} expensive sends were answered ({applied} applied)",
        finished_after.as_secs_f64(),
    );
    summary("GET /healthz", health);
    summary("GET /v1/runs (other team)", reads);
    if !poke_ms.is_empty() {
        summary("POST POKE (guard at the bound)", poke_ms);
    }

    // The fork bomb stayed inside its bound and its root says which bound it hit.
    let tree: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rein_runs WHERE definition = 'tenant-fork'")
            .fetch_one(api.store.pool())
            .await
            .unwrap();
    println!("fork bomb: {tree} runs");
    assert!(
        tree <= 31,
        "a depth-4 binary tree holds 31 runs, not {tree}"
    );
    wait_for(
        "the fork bomb's root to fail",
        Duration::from_secs(120),
        Duration::from_millis(100),
        || async {
            let (_, v) = api.get_json(&format!("/v1/runs/{bomb}"), &tenant).await;
            v["status"] == "terminal"
        },
    )
    .await;
    let (_, v): (StatusCode, Value) = api.get_json(&format!("/v1/runs/{bomb}"), &tenant).await;
    assert_eq!(v["state"], "FAILED", "{v}");
    assert!(v.to_string().contains("fan_out_depth_exceeded"), "{v}");
}
