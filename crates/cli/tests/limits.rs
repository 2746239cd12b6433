//! Fleet-wide limits (SPEC K1) across real `rein worker` processes, a private Redis and real
//! PostgreSQL: a rate holds across three workers by the database clock, a concurrency cap
//! holds fleet-wide and a `kill -9`ed holder's slots expire within the lease TTL, and with
//! Redis gone every process applies the limits on its own and says so.

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use common::{
    Fleet, PrivateRedis, await_all_terminal, enqueue_many, free_port, fresh_store, tmp_dir,
};
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::{EventTime, Store};
use serde_json::json;

const KEY: &str = "api:charge";

/// The next version of the lifecycle definition (the sim actions know its states), its
/// `running` action taking `api:charge`, plus `extra` (e.g. a `[limits]` table), made the
/// current version, which enqueues of `lifecycle` take.
async fn register_limited(store: &Store, extra: &str) -> Definition {
    let next = rein_core::builtin::lifecycle().version() + 1;
    let base = rein_core::builtin::source_at_version("lifecycle", next).expect("a built-in");
    let marker = "name = \"running\"\nkind = \"active\"\naction = \"sim\"\n";
    assert!(base.contains(marker), "lifecycle.toml changed shape");
    let text = base.replace(marker, &format!("{marker}limits = [\"{KEY}\"]\n")) + extra;
    let def = Definition::parse(&text, Format::Toml, &GuardRegistry::default()).expect("parse");
    store
        .publish_definition(
            &def,
            rein_store::Publication {
                by: rein_store::OPERATOR,
                make_current: true,
            },
        )
        .await
        .expect("register");
    def
}

/// Starts a one-second window of commit times may hold beyond what the limiter admitted in
/// one second of its own clock: a start admitted at a second's end commits in the next.
const COMMIT_JITTER_STARTS: usize = 1;

/// The most starts in any one-second window `[t, t + 1 s)`, by the database clock.
fn most_in_a_second(times: &[i64]) -> usize {
    let mut sorted = times.to_vec();
    sorted.sort_unstable();
    let mut most = 0;
    let mut j = 0;
    for i in 0..sorted.len() {
        while j < sorted.len() && sorted[j] < sorted[i] + 1_000_000 {
            j += 1;
        }
        most = most.max(j - i);
    }
    most
}

/// The most intervals `[start, start + len)` open at once.
fn most_at_once(starts: &[i64], len_us: i64) -> usize {
    let mut edges: Vec<(i64, i32)> = starts
        .iter()
        .flat_map(|&s| [(s, 1), (s + len_us, -1)])
        .collect();
    // An interval that ends where another starts does not overlap it.
    edges.sort_unstable_by_key(|&(t, d)| (t, d));
    let (mut open, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        open += d;
        most = most.max(open);
    }
    most as usize
}

fn worker_args<'a>(id_redis: &'a [&'a str], extra: &'a [&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "worker",
        "--lease-ttl-ms",
        "1500",
        "--poll-interval-ms",
        "20",
        "--concurrency",
        "16",
        // Two of these tests run at once, each with three workers: stay well inside
        // Postgres' 100 connections.
        "--db-pool-max",
        "4",
    ];
    args.extend(id_redis);
    args.extend(extra);
    args
}

/// Enqueues `n` runs of the current lifecycle version whose sim actions take `work_ms`.
async fn lifecycle_runs<W: serde::Serialize>(
    store: &Store,
    n: usize,
    work_ms: W,
) -> Vec<uuid::Uuid> {
    let input = json!({ "sim": { "work_ms": work_ms } });
    enqueue_many(store, "lifecycle", input, "default", n).await
}

/// SIGTERMs each process and checks it exits 0.
fn stop_all(fleet: &mut Fleet, ids: &[&str]) {
    for id in ids {
        let code = fleet.terminate(id, Duration::from_secs(20));
        assert_eq!(code, Some(0), "{id} exit");
    }
}

fn dispatches_of(all: &[EventTime], runs: &HashSet<uuid::Uuid>) -> Vec<EventTime> {
    all.iter()
        .filter(|e| runs.contains(&e.run_id))
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_holds_across_three_worker_processes_by_the_database_clock() {
    let dir = tmp_dir("limits-rate");
    let redis = PrivateRedis::start(free_port(), &dir);
    let redis_url = redis.url();
    let (url, store) = fresh_store("limits_rate").await;
    register_limited(&store, "").await;

    // 10 per second with bursts of 2, given on the command line of every worker.
    let (rate, burst) = (10usize, 2usize);
    let limit = format!("{KEY}={rate}/s,burst={burst}");
    let redis_args = ["--redis-url", redis_url.as_str(), "--redis-prefix", "lim"];
    let extra = ["--limit", limit.as_str(), "--limit-wait-max-ms", "300"];
    let mut fleet = Fleet::new(&url, "limits-rate");
    for id in ["w1", "w2", "w3"] {
        fleet.spawn(id, &worker_args(&redis_args, &extra));
    }
    fleet.spawn(
        "s1",
        &["scheduler", "--tick-ms", "50", "--db-pool-max", "2"],
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let n = 60;
    let ids = lifecycle_runs(&store, n, 1).await;
    let started = Instant::now();
    await_all_terminal(&store, Duration::from_secs(120)).await;
    let took = started.elapsed();

    let runs: HashSet<uuid::Uuid> = ids.iter().copied().collect();
    let dispatched = dispatches_of(
        &store.event_times("ACTION_DISPATCHED").await.unwrap(),
        &runs,
    );
    assert_eq!(dispatched.len(), n, "one dispatch per run");
    let times: Vec<i64> = dispatched.iter().map(|e| e.at_us).collect();
    let most = most_in_a_second(&times);
    let span_s = (times[times.len() - 1] - times[0]) as f64 / 1e6;
    let achieved = (times.len() - 1) as f64 / span_s;
    let by_worker: BTreeMap<&str, usize> = dispatched.iter().fold(BTreeMap::new(), |mut m, e| {
        *m.entry(e.worker.as_str()).or_default() += 1;
        m
    });
    let deferred = store.event_times("ACTION_DEFERRED").await.unwrap().len();
    println!(
        "limits-rate: {n} runs in {took:?}; limit {rate}/s burst {burst}; busiest second {most} dispatches; \
         achieved {achieved:.2}/s over {span_s:.2} s; by worker {by_worker:?}; {deferred} deferrals"
    );
    // The limiter admits by Redis' clock; the log records a dispatch when its commit lands,
    // a database round trip later. A start admitted at the very end of a second may land in
    // the next, so a one-second window of commits may hold one start more than the limit
    // admits in a second of its own clock (seen on a machine busy with a release build:
    // 13). A limit not shared by the fleet would show up to three times the rate.
    let allowed = rate + burst + COMMIT_JITTER_STARTS;
    assert!(
        most <= allowed,
        "a one-second window saw {most} dispatches; the limit allows {} (+{COMMIT_JITTER_STARTS} for commit latency)",
        rate + burst
    );
    assert!(
        by_worker.len() >= 2,
        "the dispatches were not shared by the workers: {by_worker:?}"
    );
    assert!(
        deferred > 0,
        "60 runs at 10/s with a 300 ms wait must defer some"
    );
    // The limit throttles; it does not stall: 60 starts at 10/s take about 6 s.
    assert!(
        span_s >= (n - rate - burst) as f64 / rate as f64 * 0.9,
        "too fast: {span_s} s"
    );

    // A deferral is no failure: no run retried, every run ended done.
    let report = store.audit().await.expect("audit");
    assert_eq!(report.violations(), 0, "audit: {report:?}");
    for id in &ids {
        let run = store.run(*id).await.expect("run");
        assert_eq!(run.state, "done", "run {id}");
    }
    assert_eq!(
        store.event_times("retry").await.unwrap().len(),
        0,
        "deferrals counted as retries"
    );

    // The checker catches a planted violation: three more starts inside the busiest second.
    let mut planted = times.clone();
    let busiest = times
        .iter()
        .copied()
        .max_by_key(|&t| {
            times
                .iter()
                .filter(|&&u| u >= t && u < t + 1_000_000)
                .count()
        })
        .unwrap();
    planted.extend((1..=(burst + COMMIT_JITTER_STARTS + 1) as i64).map(|k| busiest + k));
    assert!(most_in_a_second(&planted) > allowed);

    stop_all(&mut fleet, &["w1", "w2", "w3", "s1"]);
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_cap_holds_fleet_wide_and_a_killed_holders_slots_expire_within_the_lease_ttl()
{
    let dir = tmp_dir("limits-cap");
    let redis = PrivateRedis::start(free_port(), &dir);
    let redis_url = redis.url();
    let (url, store) = fresh_store("limits_cap").await;
    // Declared by the definition this time: at most 3 charges in flight fleet-wide.
    let cap = 3usize;
    register_limited(
        &store,
        &format!("\n[limits.\"{KEY}\"]\nconcurrency = {cap}\n"),
    )
    .await;

    let redis_args = ["--redis-url", redis_url.as_str(), "--redis-prefix", "cap"];
    let mut fleet = Fleet::new(&url, "limits-cap");
    for id in ["w1", "w2", "w3"] {
        fleet.spawn(id, &worker_args(&redis_args, &[]));
    }
    fleet.spawn(
        "s1",
        &["scheduler", "--tick-ms", "50", "--db-pool-max", "2"],
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let work_ms = 400i64;
    let n = 36;
    let ids = lifecycle_runs(&store, n, work_ms).await;

    // Kill a worker while it holds slots; its slots must expire within the lease TTL.
    let config = rein_accel::RedisConfig::new(redis_url.clone()).with_prefix("cap");
    // The live slots of KEY: holder and ms until it expires.
    let live_slots = || async {
        let mut states = rein_accel::limits::inspect(&config, &[KEY.to_owned()])
            .await
            .expect("read slots");
        states.pop().map(|k| k.slots).unwrap_or_default()
    };
    let looking_since = Instant::now();
    let victim = loop {
        assert!(
            looking_since.elapsed() < Duration::from_secs(30),
            "no worker ever took a slot"
        );
        let slots = live_slots().await;
        if let Some(slot) = slots.first() {
            break slot.holder.split('/').next().unwrap().to_owned();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    fleet.kill(&victim);
    let killed_at = Instant::now();
    // What an operator sees meanwhile: the key, its slots and their holders.
    let shown = common::rein(&[
        "limits",
        "--redis-url",
        &redis_url,
        "--redis-prefix",
        "cap",
        "--json",
    ]);
    assert!(shown.status.success(), "{}", common::stderr(&shown));
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).expect("json");
    let charge = shown
        .as_array()
        .and_then(|keys| keys.iter().find(|k| k["key"] == KEY))
        .unwrap_or_else(|| panic!("rein limits does not list {KEY}: {shown}"));
    let slots = charge["slots"].as_array().expect("slots");
    assert!(
        !slots.is_empty() && slots.len() <= cap,
        "rein limits shows {} slots of {KEY}: {charge}",
        slots.len()
    );
    assert!(
        slots
            .iter()
            .all(|s| s["expires_in_ms"].as_i64().is_some_and(|ms| ms <= 1500))
    );
    let gone_after = loop {
        let slots = live_slots().await;
        if !slots
            .iter()
            .any(|s| s.holder.starts_with(&format!("{victim}/")))
        {
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(10),
            "the killed worker's slots never expired: {slots:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    await_all_terminal(&store, Duration::from_secs(120)).await;

    let runs: HashSet<uuid::Uuid> = ids.iter().copied().collect();
    let dispatched = dispatches_of(
        &store.event_times("ACTION_DISPATCHED").await.unwrap(),
        &runs,
    );
    // Each action runs within [dispatch, dispatch + work] of its slot's lifetime, so no more
    // of these windows may overlap than the cap.
    let starts: Vec<i64> = dispatched.iter().map(|e| e.at_us).collect();
    let most = most_at_once(&starts, work_ms * 1000);
    println!(
        "limits-cap: cap {cap}; most in flight at once {most}; killed {victim}, its slots gone after {gone_after:?} \
         (lease TTL 1500 ms); {} dispatches for {n} runs",
        dispatched.len()
    );
    assert!(
        most <= cap,
        "{most} actions in flight at once; the cap is {cap}"
    );
    assert!(most >= 2, "the cap was never used: at most {most} at once");
    assert!(
        gone_after <= Duration::from_millis(1500 + 300),
        "slots outlived their holder by {gone_after:?}"
    );
    let report = store.audit().await.expect("audit");
    assert_eq!(report.violations(), 0, "audit: {report:?}");
    assert_eq!(report.runs, report.runs_terminal);

    // The overlap checker catches a planted violation: `cap` more starts beside the first.
    let mut planted = starts.clone();
    planted.extend(std::iter::repeat_n(starts[0] + 1, cap));
    assert!(most_at_once(&planted, work_ms * 1000) > cap);

    let alive: Vec<&str> = ["w1", "w2", "w3", "s1"]
        .into_iter()
        .filter(|id| *id != victim)
        .collect();
    stop_all(&mut fleet, &alive);
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_each_worker_applies_the_limit_on_its_own_and_says_so() {
    let dir = tmp_dir("limits-down");
    let port = free_port();
    let redis = PrivateRedis::start(port, &dir);
    let redis_url = redis.url();
    let (url, store) = fresh_store("limits_down").await;
    register_limited(&store, "").await;
    let metrics_port = free_port().to_string();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let redis_args = ["--redis-url", redis_url.as_str(), "--redis-prefix", "down"];
    let extra = [
        "--limit",
        "api:charge=20/s,burst=2",
        "--metrics-listen",
        metrics_addr.as_str(),
    ];
    let mut fleet = Fleet::new(&url, "limits-down");
    fleet.spawn("w1", &worker_args(&redis_args, &extra));
    fleet.spawn(
        "s1",
        &["scheduler", "--tick-ms", "50", "--db-pool-max", "2"],
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // Redis goes away before the load: the runs go on under the per-process limit.
    redis.stop();
    let n = 30;
    let ids = lifecycle_runs(&store, n, 1).await;
    await_all_terminal(&store, Duration::from_secs(120)).await;
    let runs: HashSet<uuid::Uuid> = ids.iter().copied().collect();
    let times: Vec<i64> = dispatches_of(
        &store.event_times("ACTION_DISPATCHED").await.unwrap(),
        &runs,
    )
    .iter()
    .map(|e| e.at_us)
    .collect();
    let most = most_in_a_second(&times);
    let metrics = reqwest::get(format!("http://{metrics_addr}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    let fallback: f64 = metrics
        .lines()
        .filter(|l| l.starts_with(rein_accel::limits::LIMIT_FALLBACK))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    println!(
        "limits-down: {n} runs done without Redis; busiest second {most}; {fallback} local decisions"
    );
    assert_eq!(times.len(), n);
    assert!(
        most <= 22,
        "the per-process limit did not hold: {most} in one second"
    );
    assert!(
        fallback >= n as f64,
        "rein_limit_fallback_total = {fallback}"
    );
    let report = store.audit().await.expect("audit");
    assert_eq!(report.violations(), 0, "audit: {report:?}");

    assert_eq!(fleet.terminate("w1", Duration::from_secs(20)), Some(0));
    assert_eq!(fleet.terminate("s1", Duration::from_secs(20)), Some(0));
    let log = std::fs::read_to_string(fleet.log_dir.join("w1.err")).unwrap_or_default();
    assert!(
        log.contains("Redis unreachable") && log.contains("limits"),
        "w1 did not warn that limits went local:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_run_is_not_claimed_before_the_limit_allows_it_and_why_says_so() {
    let (url, store) = fresh_store("limits_why").await;
    register_limited(&store, "").await;
    // One charge an hour: the first run goes, the second is deferred for about an hour.
    let mut fleet = Fleet::new(&url, "limits-why");
    fleet.spawn(
        "w1",
        &worker_args(
            &[],
            &["--limit", "api:charge=1/h", "--limit-wait-max-ms", "100"],
        ),
    );
    let ids = lifecycle_runs(&store, 2, 1).await;
    common::wait_for(
        "one run done and one deferred",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || {
            let store = store.clone();
            async move {
                store
                    .event_times("ACTION_DEFERRED")
                    .await
                    .is_ok_and(|d| !d.is_empty())
            }
        },
    )
    .await;
    // Long enough for many claim rounds at a 20 ms poll: the deferred run stays unclaimed.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let deferred = store.event_times("ACTION_DEFERRED").await.unwrap();
    assert_eq!(
        deferred.len(),
        1,
        "deferred once, then left alone: {deferred:?}"
    );
    let late = deferred[0].run_id;
    let row = store.run(late).await.unwrap();
    assert_eq!(
        (row.state.as_str(), row.status.as_str()),
        ("running", "runnable")
    );
    assert!(
        row.lease_owner.is_none(),
        "a deferred run was claimed again"
    );
    assert_eq!(row.projection.attempt, 0, "a deferral is not a retry");
    let other = ids.iter().find(|id| **id != late).unwrap();
    assert_eq!(store.run(*other).await.unwrap().state, "done");

    let why = common::rein(&["why", &late.to_string(), "--database-url", &url]);
    let said = common::stdout(&why);
    println!("limits-why: {said}");
    assert!(why.status.success(), "{}", common::stderr(&why));
    assert!(
        said.contains("fleet-wide rate limit on `api:charge`")
            && said.contains("claimable again in"),
        "{said}"
    );
    stop_all(&mut fleet, &["w1"]);
}
