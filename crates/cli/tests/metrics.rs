//! `/metrics` of real `rein worker`, `rein scheduler` and `rein api` processes: the counters
//! add up to what the database holds, the fleet gauges read from it, each refused transition
//! is counted by the process that refused it, and finished runs carry their real outcome.

use crate::common;

use std::time::Duration;

use common::{Fleet, free_port, stderr, stdout};
use rein_store::EnqueueRequest;
use serde_json::json;

/// The sum of the samples of `name` whose labels contain every one of `labels`
/// (`key="value"` text), from Prometheus text.
fn sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn scrape(port: u16, path: &str) -> (u16, String) {
    scrape_at(&format!("http://127.0.0.1:{port}"), path).await
}

async fn scrape_at(base: &str, path: &str) -> (u16, String) {
    let r = reqwest::get(format!("{base}{path}"))
        .await
        .unwrap_or_else(|e| panic!("GET {path} on {base}: {e}"));
    (r.status().as_u16(), r.text().await.unwrap_or_default())
}

/// Starts `rein worker` as `id`, polling every 20 ms with `extra` flags, serving `/metrics`
/// on a free port; the port.
fn spawn_metrics_worker(fleet: &mut Fleet, id: &str, extra: &[&str]) -> u16 {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec![
        "worker",
        "--poll-interval-ms",
        "20",
        "--metrics-listen",
        &addr,
    ];
    args.extend_from_slice(extra);
    fleet.spawn(id, &args);
    port
}

/// How many lines of the log file of process `id` contain `text`.
fn log_lines(fleet: &Fleet, id: &str, text: &str) -> usize {
    std::fs::read_to_string(fleet.log_dir.join(format!("{id}.err")))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(text))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_and_scheduler_metrics_add_up_to_the_database() {
    let (url, store) = common::fresh_store("metrics").await;
    let mut fleet = Fleet::new(&url, "metrics");
    let def = store.load_definition("lifecycle", None).await.unwrap();
    const RUNS: usize = 12;
    // A slow run that a first worker holds when it is killed: its lease expires, the
    // scheduler recovers it and the metrics worker runs it again.
    let slow = store
        .enqueue(EnqueueRequest::new(
            def.clone(),
            json!({ "sim": { "work_ms": 3_000 } }),
        ))
        .await
        .unwrap()
        .run_id;
    let (w_port, s_port) = (free_port(), free_port());
    let (w_addr, s_addr) = (format!("127.0.0.1:{w_port}"), format!("127.0.0.1:{s_port}"));
    fleet.spawn(
        "victim",
        &[
            "worker",
            "--lease-ttl-ms",
            "1500",
            "--poll-interval-ms",
            "20",
        ],
    );
    common::wait_for(
        "the victim to hold the slow run",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async {
            store
                .run(slow)
                .await
                .is_ok_and(|r| r.lease_owner.as_deref() == Some("victim"))
        },
    )
    .await;
    fleet.kill("victim");
    let requests: Vec<EnqueueRequest> = (0..RUNS)
        .map(|i| {
            let sim = if i % 3 == 0 {
                json!({ "work_ms": 5, "transient_failures": 1 })
            } else {
                json!({ "work_ms": 5 })
            };
            EnqueueRequest::new(def.clone(), json!({ "sim": sim }))
        })
        .collect();
    store.enqueue_batch(&requests).await.unwrap();
    fleet.spawn(
        "metrics-worker",
        &[
            "worker",
            "--lease-ttl-ms",
            "1500",
            "--poll-interval-ms",
            "20",
            "--metrics-listen",
            &w_addr,
        ],
    );
    fleet.spawn(
        "metrics-scheduler",
        &["scheduler", "--tick-ms", "50", "--metrics-listen", &s_addr],
    );
    common::wait_for(
        "every run to finish",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            store
                .count_by_state()
                .await
                .is_ok_and(|c| c.iter().all(|(_, _, status, _)| status == "terminal"))
        },
    )
    .await;

    for port in [w_port, s_port] {
        assert_eq!(scrape(port, "/healthz").await.0, 200);
        assert_eq!(scrape(port, "/readyz").await.0, 200);
    }
    // The fleet gauges are read every few seconds: wait for a reading with every run done.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let scheduler_text = loop {
        let text = scrape(s_port, "/metrics").await.1;
        if sum(&text, "rein_runs", &["status=\"terminal\""]) == (RUNS + 1) as f64 {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the fleet gauges never showed every run finished:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let (_, worker_text) = scrape(w_port, "/metrics").await;

    // Every event the two processes wrote is counted as a transition by the process that
    // wrote it (the victim's died with it).
    let events: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM rein_events WHERE worker IN ('metrics-worker', 'metrics-scheduler')",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    let counted = sum(&worker_text, "rein_transitions_total", &[])
        + sum(&scheduler_text, "rein_transitions_total", &[]);
    assert_eq!(
        counted, events as f64,
        "transitions counted by the processes = events they wrote\n{worker_text}\n{scheduler_text}"
    );
    assert!(
        sum(
            &worker_text,
            "rein_transitions_total",
            &["definition=\"lifecycle\"", "event=\"complete\""]
        ) > 0.0
    );
    let finished = sum(&worker_text, "rein_runs_finished_total", &[])
        + sum(&scheduler_text, "rein_runs_finished_total", &[]);
    assert_eq!(finished, (RUNS + 1) as f64, "{worker_text}");
    // A retry is lifecycle's `retry` event (it increments the attempt).
    let retry_events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rein_events WHERE type = 'retry'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert!(retry_events >= (RUNS / 3) as i64);
    let retries = sum(&worker_text, "rein_retries_total", &[])
        + sum(&scheduler_text, "rein_retries_total", &[]);
    assert_eq!(
        retries, retry_events as f64,
        "{worker_text}\n{scheduler_text}"
    );
    assert!(sum(&worker_text, "rein_lease_claims_total", &[]) >= RUNS as f64);
    assert!(sum(&worker_text, "rein_claim_latency_seconds_count", &[]) > 0.0);
    assert!(
        sum(
            &worker_text,
            "rein_time_in_state_seconds_count",
            &["definition=\"lifecycle\""]
        ) > 0.0
    );
    assert_eq!(sum(&worker_text, "rein_actions_in_flight", &[]), 0.0);
    assert_eq!(
        sum(&worker_text, "rein_build_info", &["role=\"worker\""]),
        1.0
    );
    assert!(sum(&worker_text, "rein_db_pool_max", &[]) >= 1.0);
    assert_eq!(
        sum(&scheduler_text, "rein_lease_expiries_total", &[]),
        1.0,
        "{scheduler_text}"
    );
    assert_eq!(
        sum(&scheduler_text, "rein_recovery_seconds_count", &[]),
        1.0
    );
    assert!(sum(&scheduler_text, "rein_timers_fired_total", &[]) >= (RUNS / 3) as f64);
    assert_eq!(sum(&scheduler_text, "rein_queue_depth", &[]), 0.0);
    assert_eq!(sum(&scheduler_text, "rein_approvals_pending", &[]), 0.0);
    assert_eq!(
        sum(&scheduler_text, "rein_build_info", &["role=\"scheduler\""]),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_api_refuses_is_counted_and_warned_by_the_api() {
    let (url, store) = common::fresh_store("refused_api").await;
    let mut fleet = Fleet::new(&url, "refused_api");
    let api = fleet.spawn_server("api", &["api", "--insecure-dev", "--listen", "127.0.0.1:0"]);
    let def = store.load_definition("lifecycle", None).await.unwrap();
    let run = store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .unwrap()
        .run_id;
    // The engine ends the run; an outside caller then sends an event it may send
    // (`dependency_resolved` is one of lifecycle's external events) that a finished run
    // cannot take.
    common::as_the_engine(&store, run, &["start", "complete"]).await;
    let refused = |text: &str| {
        sum(
            text,
            "rein_invalid_transitions_total",
            &["definition=\"lifecycle\"", "event=\"dependency_resolved\""],
        )
    };

    // Straight to the API: a finished run takes no event.
    let response = reqwest::Client::new()
        .post(format!("{api}/v1/runs/{run}/events"))
        .json(&json!({ "type": "dependency_resolved", "payload": {} }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 409);
    let (_, text) = scrape_at(&api, "/metrics").await;
    assert_eq!(refused(&text), 1.0, "{text}");
    assert_eq!(log_lines(&fleet, "api", "transition refused"), 1);

    // `rein send` through the API: the API refuses it, counts it and warns.
    let out = common::rein(&[
        "send",
        &run.to_string(),
        "dependency_resolved",
        "--api-url",
        &api,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let (_, text) = scrape_at(&api, "/metrics").await;
    assert_eq!(refused(&text), 2.0, "{text}");
    let warned = std::fs::read_to_string(fleet.log_dir.join("api.err")).unwrap();
    let lines: Vec<&str> = warned
        .lines()
        .filter(|l| l.contains("transition refused"))
        .collect();
    assert_eq!(lines.len(), 2, "{warned}");
    for line in lines {
        assert!(line.contains("WARN"), "{line}");
        assert!(line.contains(&run.to_string()), "{line}");
        assert!(
            line.contains("\"terminal\"") || line.contains("code=terminal"),
            "{line}"
        );
    }

    // `rein send` straight to the database: that process refuses it and warns on stderr.
    let out = common::rein(&[
        "send",
        &run.to_string(),
        "dependency_resolved",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.lines()
            .any(|l| l.contains("WARN") && l.contains("transition refused")),
        "{err}"
    );
    assert!(err.contains("dependency_resolved in state done"), "{err}");
    assert!(stdout(&out).is_empty(), "{}", stdout(&out));
    assert_eq!(store.run(run).await.unwrap().last_sequence, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reply_no_state_takes_is_counted_and_warned_by_the_worker() {
    let (url, store) = common::fresh_store("refused_node").await;
    let mut fleet = Fleet::new(&url, "refused_node");
    // A node endpoint that answers every call with an event its state has no transition for.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let node_port = listener.local_addr().unwrap().port();
    let node = axum::Router::new()
        .fallback(|| async { axum::Json(json!({ "events": [{ "type": "PLAN_READY" }] })) });
    tokio::spawn(async move { axum::serve(listener, node).await });
    let text = include_str!("../../../examples/research-agent-http.toml")
        .replace("{{PORT}}", &node_port.to_string());
    let def = rein_core::Definition::parse(
        &text,
        rein_core::Format::Toml,
        &rein_core::GuardRegistry::new(),
    )
    .unwrap();
    store.register_definition(&def).await.unwrap();
    let run = store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .unwrap()
        .run_id;

    let port = spawn_metrics_worker(&mut fleet, "node-worker", &[]);
    common::wait_for(
        "the refused reply to hand the run to an operator",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || async {
            store
                .run(run)
                .await
                .is_ok_and(|r| r.status == "needs_operator")
        },
    )
    .await;
    let (_, text) = scrape(port, "/metrics").await;
    assert_eq!(
        sum(
            &text,
            "rein_invalid_transitions_total",
            &["definition=\"research-agent-http\"", "event=\"PLAN_READY\""]
        ),
        1.0,
        "{text}"
    );
    let warned = std::fs::read_to_string(fleet.log_dir.join("node-worker.err")).unwrap();
    let line = warned
        .lines()
        .find(|l| l.contains("transition refused"))
        .unwrap_or_else(|| panic!("no WARN for the refused reply:\n{warned}"));
    assert!(
        line.contains("WARN") && line.contains("PLAN_READY"),
        "{line}"
    );
    assert!(line.contains("INTAKE"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_runs_count_as_failed_and_only_a_cancel_counts_as_cancelled() {
    let (url, store) = common::fresh_store("outcomes").await;
    let mut fleet = Fleet::new(&url, "outcomes");
    let def = store.load_definition("lifecycle", None).await.unwrap();
    // lifecycle's cancel state is also where its failures end.
    assert_eq!(def.cancel_state(), "failed");
    const FAILING: usize = 6;
    const SUCCEEDING: usize = 4;
    // A run the worker holds for a long while, cancelled as it runs.
    let held = store
        .enqueue(EnqueueRequest::new(
            def.clone(),
            json!({ "sim": { "work_ms": 60_000 } }),
        ))
        .await
        .unwrap()
        .run_id;
    let port = spawn_metrics_worker(&mut fleet, "outcome-worker", &["--lease-ttl-ms", "2000"]);
    common::wait_for(
        "the worker to hold the long run",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async {
            store
                .run(held)
                .await
                .is_ok_and(|r| r.lease_owner.as_deref() == Some("outcome-worker"))
        },
    )
    .await;
    let requests: Vec<EnqueueRequest> = (0..FAILING + SUCCEEDING)
        .map(|i| {
            let sim = if i < FAILING {
                json!({ "work_ms": 5, "fatal_at_step": 1 })
            } else {
                json!({ "work_ms": 5 })
            };
            EnqueueRequest::new(def.clone(), json!({ "sim": sim }))
        })
        .collect();
    store.enqueue_batch(&requests).await.unwrap();
    let out = common::rein(&[
        "cancel",
        &held.to_string(),
        "--reason",
        "not needed any more",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("cancel queued"), "{}", stdout(&out));
    common::await_all_terminal(&store, Duration::from_secs(60)).await;

    let (_, text) = scrape(port, "/metrics").await;
    let finished = |outcome: &str| {
        sum(
            &text,
            "rein_runs_finished_total",
            &[
                "definition=\"lifecycle\"",
                &format!("outcome=\"{outcome}\""),
            ],
        )
    };
    assert_eq!(finished("failed"), FAILING as f64, "{text}");
    assert_eq!(finished("succeeded"), SUCCEEDING as f64, "{text}");
    assert_eq!(finished("cancelled"), 1.0, "{text}");
    // What ReinFailureRatioHigh computes: 6 of the 10 runs that ended on their own.
    let ratio = finished("failed") / (finished("failed") + finished("succeeded"));
    assert!((ratio - 0.6).abs() < 1e-9, "failure ratio {ratio}");
    // The database agrees: seven runs in `failed`, one of them by the CANCEL.
    let by_state: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM rein_runs GROUP BY state ORDER BY state")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(
        by_state,
        vec![
            ("done".to_owned(), SUCCEEDING as i64),
            ("failed".to_owned(), FAILING as i64 + 1)
        ]
    );
    let reason = store.run(held).await.unwrap().terminal_reason;
    assert_eq!(reason.as_deref(), Some("cancelled: not needed any more"));
}

/// A role's metrics endpoint closes a half-sent request head (as `rein api` does) and caps
/// what one client holds, so a slow or greedy client cannot tie up a worker's descriptors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_metrics_endpoint_drops_half_sent_requests_and_caps_one_client() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (url, _store) = common::fresh_store("metrics_slow").await;
    let mut fleet = Fleet::new(&url, "metrics_slow");
    let port = spawn_metrics_worker(&mut fleet, "w1", &[]);
    common::wait_for(
        "the metrics endpoint",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || async move {
            reqwest::get(format!("http://127.0.0.1:{port}/healthz"))
                .await
                .is_ok()
        },
    )
    .await;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let connect = || async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut s = socket.connect(addr).await.expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        s
    };
    let mut greedy = Vec::new();
    for _ in 0..20 {
        greedy.push(connect().await);
    }
    // A scrape from another address is still answered.
    let (status, body) = scrape(port, "/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("rein_"), "{body}");
    // The half-sent heads are closed (after the header timeout, or at once past the
    // per-client cap), not held for ever.
    for mut s in greedy {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut buf)).await;
        assert!(
            read.is_ok(),
            "a half-sent request head was still open after 30 s"
        );
    }
}

/// The findings of `promtool check metrics` on `text` (empty when it finds nothing), and
/// whether it exited successfully. promtool comes with Prometheus (Debian's `prometheus`
/// package, which `scripts/test.sh` installs); without it this check cannot pass.
fn promtool_check(text: &str) -> (bool, String) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let spawned = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("promtool is missing in CI ({e}): scripts/test.sh installs it")
        }
        Err(e) => panic!(
            "promtool is not on PATH ({e}): install Prometheus' tools \
             (`apt-get install prometheus` on Debian, `brew install prometheus` on macOS)"
        ),
    };
    let mut stdin = child.stdin.take().expect("promtool's stdin");
    stdin.write_all(text.as_bytes()).expect("write to promtool");
    drop(stdin);
    let out = child.wait_with_output().expect("promtool ran");
    let findings = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), findings.trim().to_owned())
}

/// The sample lines of family `name` (its own name, or `name_bucket`, `_sum`, `_count`).
fn samples<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                let rest = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| rest.strip_prefix(s))
                    .unwrap_or(rest);
                rest.starts_with('{') || rest.starts_with(' ')
            })
        })
        .collect()
}

/// Waits until `url` answers.
async fn await_up(url: &str) {
    common::wait_for(
        "the endpoint to answer",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || async { reqwest::get(url).await.is_ok() },
    )
    .await;
}

/// Starts a worker and a scheduler serving `/metrics` and `rein api`; their base URLs.
async fn spawn_roles(fleet: &mut Fleet, worker_extra: &[&str]) -> [String; 3] {
    let w_port = spawn_metrics_worker(fleet, "w1", worker_extra);
    let s_port = free_port();
    let s_addr = format!("127.0.0.1:{s_port}");
    fleet.spawn(
        "s1",
        &["scheduler", "--tick-ms", "50", "--metrics-listen", &s_addr],
    );
    let api = fleet.spawn_server("api", &["api", "--insecure-dev", "--listen", "127.0.0.1:0"]);
    let roles = [
        format!("http://127.0.0.1:{w_port}"),
        format!("http://127.0.0.1:{s_port}"),
        api,
    ];
    // The API is up once it prints its address; asking it would count a request.
    for base in &roles[..2] {
        await_up(&format!("{base}/healthz")).await;
    }
    roles
}

/// The `process_*` families every role exports.
const PROCESS_FAMILIES: [&str; 6] = [
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_roles_metrics_pass_promtool_after_a_run() {
    let (url, store) = common::fresh_store("promtool").await;
    let mut fleet = Fleet::new(&url, "promtool");
    let [worker, scheduler, api] = spawn_roles(&mut fleet, &[]).await;
    let http = reqwest::Client::new();
    // A run through the API (one transient failure: a retry the scheduler fires), and a
    // path no route matches.
    let enqueued = http
        .post(format!("{api}/v1/runs"))
        .json(&json!({ "definition": "lifecycle",
                       "input": { "sim": { "work_ms": 5, "transient_failures": 1 } } }))
        .send()
        .await
        .unwrap();
    assert_eq!(enqueued.status().as_u16(), 201);
    let run = enqueued.json::<serde_json::Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    common::await_all_terminal(&store, Duration::from_secs(60)).await;
    let got = http
        .get(format!("{api}/v1/runs/{run}"))
        .send()
        .await
        .unwrap();
    assert_eq!(got.status().as_u16(), 200);
    let missing = http
        .get(format!("{api}/nowhere/{run}"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status().as_u16(), 404);

    for (role, base) in [
        ("worker", &worker),
        ("scheduler", &scheduler),
        ("api", &api),
    ] {
        let (status, text) = scrape_at(base, "/metrics").await;
        assert_eq!(status, 200);
        let (ok, findings) = promtool_check(&text);
        assert!(
            ok && findings.is_empty(),
            "promtool on the {role}'s /metrics:\n{findings}\n\n{text}"
        );
        for family in PROCESS_FAMILIES {
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{role} lacks {family}:\n{text}"
            );
        }
        assert!(
            sum(&text, "process_resident_memory_bytes", &[]) > 1e6,
            "{text}"
        );
        assert!(sum(&text, "process_max_fds", &[]) >= 64.0, "{text}");
        assert!(
            sum(&text, "process_start_time_seconds", &[]) > 1.6e9,
            "{text}"
        );
    }
    // The API counted its requests by route template, never by the path sent.
    let (_, text) = scrape_at(&api, "/metrics").await;
    let requests = |labels: &[&str]| sum(&text, "rein_http_requests_total", labels);
    assert_eq!(
        requests(&["method=\"POST\"", "route=\"/v1/runs\"", "status=\"201\""]),
        1.0,
        "{text}"
    );
    assert_eq!(
        requests(&[
            "method=\"GET\"",
            "route=\"/v1/runs/{id}\"",
            "status=\"200\""
        ]),
        1.0,
        "{text}"
    );
    assert_eq!(
        requests(&["method=\"GET\"", "route=\"unmatched\"", "status=\"404\""]),
        1.0,
        "{text}"
    );
    assert!(!text.contains(&run), "a run id became a label:\n{text}");
    assert_eq!(
        sum(
            &text,
            "rein_http_request_duration_seconds_count",
            &["route=\"/v1/runs/{id}\"", "status=\"200\""]
        ),
        1.0,
        "{text}"
    );
    // Buckets for an API's latencies, not the engine's (which reach 4 h).
    let buckets: Vec<&str> = samples(&text, "rein_http_request_duration_seconds")
        .into_iter()
        .filter(|l| l.contains("_bucket{") && l.contains("route=\"/v1/runs\""))
        .collect();
    assert!(buckets.iter().any(|l| l.contains("le=\"0.005\"")), "{text}");
    assert!(buckets.iter().any(|l| l.contains("le=\"10\"")), "{text}");
    assert!(
        !buckets.iter().any(|l| l.contains("le=\"14400\"")),
        "{text}"
    );
}

/// Families every role exports, idle or not.
const COMMON_FAMILIES: [&str; 13] = [
    "rein_transitions_total",
    "rein_invalid_transitions_total",
    "rein_fenced_writes_total",
    "rein_retries_total",
    "rein_runs_finished_total",
    "rein_time_in_state_seconds",
    "rein_definitions_compiled_total",
    "rein_fan_outs_refused_total",
    "rein_wakeups_published_total",
    "rein_api_connections_refused_total",
    "rein_db_pool_connections",
    "rein_db_pool_max",
    "rein_build_info",
];

const WORKER_FAMILIES: [&str; 8] = [
    "rein_lease_claims_total",
    "rein_lease_renewals_total",
    "rein_leases_lost_total",
    "rein_claim_latency_seconds",
    "rein_actions_in_flight",
    "rein_wakeups_received_total",
    "rein_limit_wait_seconds",
    "rein_limit_deferred_total",
];

const SCHEDULER_FAMILIES: [&str; 11] = [
    "rein_lease_expiries_total",
    "rein_recovery_seconds",
    "rein_timers_fired_total",
    "rein_scheduler_backoffs_total",
    "rein_runs",
    "rein_queue_depth",
    "rein_queue_oldest_age_seconds",
    "rein_runs_oldest_in_state_seconds",
    "rein_runs_retrying",
    "rein_approvals_pending",
    "rein_approvals_oldest_pending_age_seconds",
];

/// Families whose samples an idle process moves.
const MOVE_WHEN_IDLE: [&str; 4] = [
    "rein_claim_latency_seconds",
    "rein_db_pool_connections",
    "rein_db_pool_max",
    "rein_build_info",
];

const API_FAMILIES: [&str; 2] = [
    "rein_http_requests_total",
    "rein_http_request_duration_seconds",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_role_exports_every_family_at_zero() {
    let (url, _store) = common::fresh_store("idle_families").await;
    let mut fleet = Fleet::new(&url, "idle_families");
    let [worker, scheduler, api] = spawn_roles(&mut fleet, &["--limit", "tool:search=10/s"]).await;
    let (_, api_text) = scrape_at(&api, "/metrics").await;
    let (_, worker_text) = scrape_at(&worker, "/metrics").await;
    // The fleet gauges are set when the scheduler first reads them.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let scheduler_text = loop {
        let text = scrape_at(&scheduler, "/metrics").await.1;
        if text.contains("rein_runs{") || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let roles = [
        ("worker", &worker_text, &WORKER_FAMILIES[..]),
        ("scheduler", &scheduler_text, &SCHEDULER_FAMILIES[..]),
        ("api", &api_text, &API_FAMILIES[..]),
    ];
    for (role, text, own) in roles {
        let families = COMMON_FAMILIES.iter().chain(own).chain(&PROCESS_FAMILIES);
        for family in families {
            assert!(
                text.contains(&format!("# TYPE {family} ")) && !samples(text, family).is_empty(),
                "an idle {role} lacks {family}:\n{text}"
            );
            // Nothing happened: every sample is 0 but the gauges of the process itself
            // and the latency of its idle claim polls.
            if !MOVE_WHEN_IDLE.contains(family) && !family.starts_with("process_") {
                for line in samples(text, family) {
                    assert!(line.ends_with(" 0"), "an idle {role}: {line}");
                }
            }
        }
    }

    // The label values known at start are there at 0: the built-in definitions' events,
    // states and outcomes, timer events, scans, the fleet's statuses and default queue, the
    // `--limit` given, the API's documented operations.
    let zero = |text: &str, name: &str, labels: &[&str]| {
        let found: Vec<&str> = samples(text, name)
            .into_iter()
            .filter(|l| {
                l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name}_count{{"))
            })
            .filter(|l| !l.contains("_bucket{"))
            .filter(|l| labels.iter().all(|want| l.contains(want)))
            .collect();
        assert!(
            !found.is_empty() && found.iter().all(|l| l.ends_with(" 0")),
            "{name} {labels:?} at 0:\n{text}"
        );
    };
    for text in [&worker_text, &scheduler_text, &api_text] {
        zero(
            text,
            "rein_transitions_total",
            &["definition=\"lifecycle\"", "event=\"complete\""],
        );
        zero(
            text,
            "rein_transitions_total",
            &["definition=\"refund-agent\"", "event=\"LEASE_EXPIRED\""],
        );
        for outcome in ["succeeded", "failed", "cancelled"] {
            zero(
                text,
                "rein_runs_finished_total",
                &[
                    "definition=\"lifecycle\"",
                    &format!("outcome=\"{outcome}\""),
                ],
            );
        }
        zero(
            text,
            "rein_time_in_state_seconds",
            &["definition=\"lifecycle\"", "state=\"running\""],
        );
        zero(
            text,
            "rein_fan_outs_refused_total",
            &["reason=\"fan_out_depth_exceeded\""],
        );
    }
    zero(
        &worker_text,
        "rein_limit_deferred_total",
        &["key=\"tool:search\"", "limit=\"rate\""],
    );
    zero(
        &scheduler_text,
        "rein_timers_fired_total",
        &["kind=\"retry\""],
    );
    zero(
        &scheduler_text,
        "rein_scheduler_backoffs_total",
        &["scan=\"lease\""],
    );
    zero(
        &scheduler_text,
        "rein_runs",
        &["definition=\"lifecycle\"", "status=\"runnable\""],
    );
    zero(&scheduler_text, "rein_queue_depth", &["queue=\"default\""]);
    zero(
        &api_text,
        "rein_http_requests_total",
        &["method=\"POST\"", "route=\"/v1/runs\"", "status=\"201\""],
    );
    zero(
        &api_text,
        "rein_http_request_duration_seconds",
        &[
            "method=\"GET\"",
            "route=\"/v1/runs/{id}\"",
            "status=\"200\"",
        ],
    );
}
