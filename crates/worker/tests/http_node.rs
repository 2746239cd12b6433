//! The `http` node action (SPEC I2, X6, X7, R2) against a real PostgreSQL and the example
//! node server (`examples/node_server.py`), which stands in for an external agent service.

// The fixtures are the store tests' own: one copy for both crates.
use crate::common;

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_replays, event_types, events_of, store, wait_until};
use rein_core::{Definition, Format, GuardRegistry};
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{EnqueueRequest, Store};
use rein_worker::egress::{Allow, Policy};
use rein_worker::http::HttpOptions;
use rein_worker::{Registry, Worker, WorkerConfig, builtin_registry, builtin_registry_with};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(30);
const EXAMPLE: &str = include_str!("../../../examples/research-agent-http.toml");

/// `examples/node_server.py` as a child process in its own process group, killed with its
/// group when dropped. Its output goes to a file under the target's temporary directory.
struct NodeServer {
    child: Child,
    port: u16,
    log: PathBuf,
    http: reqwest::Client,
}

impl NodeServer {
    fn start(name: &str) -> NodeServer {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("http_node");
        std::fs::create_dir_all(&dir).expect("log dir");
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/node_server.py");
        let child = Command::new("python3")
            .arg("-u")
            .arg(&script)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("start python3 examples/node_server.py");
        let mut server = NodeServer {
            child,
            port: 0,
            log,
            http: reqwest::Client::new(),
        };
        let started = Instant::now();
        server.port = loop {
            let text = std::fs::read_to_string(&server.log).unwrap_or_default();
            if let Some(port) = text
                .lines()
                .find_map(|l| l.strip_prefix("listening on http://127.0.0.1:"))
            {
                break port.trim().parse().expect("a port number");
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("the node server exited ({status}): {text}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "the node server did not start; its log {}: {text}",
                server.log.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        server
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Scripts the next replies of `node` (see the server's docstring).
    async fn script(&self, node: &str, steps: Value) {
        let reply = self
            .http
            .post(self.url("/control"))
            .json(&json!({ "node": node, "script": steps }))
            .send()
            .await
            .expect("control");
        assert!(reply.status().is_success());
    }

    async fn get(&self, path: &str) -> Value {
        self.http
            .get(self.url(path))
            .send()
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON")
    }

    /// Every node and reconcile request the server received, in order.
    async fn requests(&self) -> Vec<Value> {
        self.get("/requests")
            .await
            .as_array()
            .expect("a list")
            .clone()
    }

    /// How often each applied idempotency key was delivered.
    async fn deliveries(&self, key: &str) -> u64 {
        self.get("/applied").await[key]["deliveries"]
            .as_u64()
            .unwrap_or(0)
    }
}

impl Drop for NodeServer {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) with a negative pid signals the process group the server
            // leads (it was spawned with process_group(0)); no memory is touched.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
        let _ = self.child.wait();
    }
}

/// The example definition with the server's port in place of `{{PORT}}`.
fn definition_text(server: &NodeServer) -> String {
    EXAMPLE.replace("{{PORT}}", &server.port.to_string())
}

/// The `[[states]]` block of `state`, as a byte range of `text`.
fn state_block(text: &str, state: &str) -> std::ops::Range<usize> {
    let start = text
        .find(&format!("[[states]]\nname = \"{state}\""))
        .expect("the state's block");
    let rest = &text[start + 1..];
    let end = ["\n[[states]]", "\n[[transitions]]"]
        .iter()
        .filter_map(|marker| rest.find(marker))
        .min()
        .map_or(text.len(), |i| start + 1 + i);
    start..end
}

/// Applies `edit` to the `[[states]]` block of `state` only.
fn edit_state(text: &str, state: &str, edit: impl Fn(&str) -> String) -> String {
    let block = state_block(text, state);
    format!(
        "{}{}{}",
        &text[..block.start],
        edit(&text[block.clone()]),
        &text[block.end..]
    )
}

/// ACTING with a short call timeout (and, optionally, no reconcile hook).
fn short_acting_timeout(text: &str, reconcile: bool) -> String {
    edit_state(text, "ACTING", |block| {
        assert!(block.contains("timeout_ms = 5000\n"));
        let block = block.replace("timeout_ms = 5000\n", "timeout_ms = 400\n");
        if reconcile {
            block
        } else {
            block
                .lines()
                .filter(|l| !l.starts_with("reconcile_url"))
                .map(|l| format!("{l}\n"))
                .collect()
        }
    })
}

async fn register(store: &Store, text: &str) -> Definition {
    let def = Definition::parse(text, Format::Toml, &GuardRegistry::new()).expect("parse");
    store.register_definition(&def).await.expect("register");
    def
}

/// A worker with the built-in handlers and a background scheduler (for RETRY_DUE).
struct Fleet {
    stop: CancellationToken,
    worker: JoinHandle<()>,
    scheduler: JoinHandle<()>,
}

impl Fleet {
    fn start(store: &Store) -> Fleet {
        Fleet::start_with(store, builtin_registry(store.clone()))
    }

    /// A fleet whose worker's http nodes are configured by `http`.
    fn start_with_http(store: &Store, http: HttpOptions) -> Fleet {
        Fleet::start_with(store, builtin_registry_with(store.clone(), http))
    }

    fn start_with(store: &Store, registry: Registry) -> Fleet {
        let stop = CancellationToken::new();
        let mut config = WorkerConfig::new("http-worker");
        config.lease_ttl_ms = 5_000;
        config.poll_interval_ms = 20;
        config.shutdown_grace_ms = 1_000;
        let worker = Worker::new(store.clone(), config, registry);
        let mut sched_config = SchedulerConfig::new("http-scheduler");
        sched_config.tick_ms = 50;
        let mut scheduler = Scheduler::new(store.clone(), sched_config);
        Fleet {
            worker: tokio::spawn({
                let stop = stop.clone();
                async move { worker.run(stop).await.expect("worker run") }
            }),
            scheduler: tokio::spawn({
                let stop = stop.clone();
                async move { scheduler.run(stop).await.expect("scheduler run") }
            }),
            stop,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.worker.await.expect("worker task");
        self.scheduler.await.expect("scheduler task");
    }
}

async fn enqueue(store: &Store, def: &Definition) -> Uuid {
    store
        .enqueue(EnqueueRequest::new(
            def.clone(),
            json!({ "query": "fencing tokens" }),
        ))
        .await
        .expect("enqueue")
        .run_id
}

/// Waits until the run is terminal or needs an operator; returns its final row.
async fn settle(store: &Store, run: Uuid) -> rein_store::RunRow {
    wait_until(
        &format!("run {run} is terminal or needs an operator"),
        LONG,
        || async {
            let status = store.run(run).await.expect("run").status;
            status == "terminal" || status == "needs_operator"
        },
    )
    .await;
    store.run(run).await.expect("run")
}

/// Enqueues one run of `def`, lets the fleet `start` makes drive it until it settles, and
/// returns the run with its final row.
async fn drive_one(
    store: &Store,
    def: &Definition,
    start: impl FnOnce(&Store) -> Fleet,
) -> (Uuid, rein_store::RunRow) {
    let run = enqueue(store, def).await;
    let fleet = start(store);
    let row = settle(store, run).await;
    fleet.stop().await;
    (run, row)
}

fn node_calls<'a>(requests: &'a [Value], node: &str) -> Vec<&'a Value> {
    let path = format!("/nodes/{node}");
    requests.iter().filter(|r| r["path"] == path).collect()
}

fn header<'a>(request: &'a Value, name: &str) -> &'a str {
    request["headers"][name]
        .as_str()
        .unwrap_or_else(|| panic!("header {name} missing from {request}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_nodes_drive_a_run_to_success_with_rein_headers() {
    let server = NodeServer::start("success");
    let store = store("http_node_success").await;
    let def = register(&store, &definition_text(&server)).await;
    let run = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    let row = settle(&store, run).await;
    fleet.stop().await;

    assert_eq!(
        row.state,
        "SUCCEEDED",
        "{:?}",
        event_types(&store, run).await
    );
    assert_eq!(row.projection.results.len(), 1);
    assert_eq!(row.projection.results[0]["value"]["tool"], "search");
    assert_eq!(row.projection.data["output"], "1 result(s)");

    let requests = server.requests().await;
    let paths: Vec<&str> = requests
        .iter()
        .map(|r| r["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            "/nodes/INTAKE",
            "/nodes/PLANNING",
            "/nodes/ACTING",
            "/nodes/OBSERVING",
            "/nodes/FINALIZING"
        ]
    );
    // Each call was dispatched first, and carries that dispatch's key, call id and token.
    let dispatched = events_of(&store, run, "ACTION_DISPATCHED").await;
    assert_eq!(dispatched.len(), requests.len());
    let mut spans = Vec::new();
    for (request, dispatch) in requests.iter().zip(&dispatched) {
        let node = dispatch.payload["node"].as_str().unwrap();
        assert_eq!(request["path"], format!("/nodes/{node}"));
        let key = rein_core::hash::idempotency_key(
            &run.to_string(),
            node,
            dispatch.payload["action_id"].as_str().unwrap(),
        );
        assert_eq!(dispatch.payload["idempotency_key"], key.as_str());
        assert_eq!(header(request, "idempotency-key"), key);
        assert_eq!(request["body"]["idempotency_key"], key.as_str());
        assert_eq!(header(request, "rein-call-id"), dispatch.payload["call_id"]);
        assert_eq!(header(request, "rein-run-id"), run.to_string());
        assert_eq!(
            header(request, "rein-fencing-token")
                .parse::<i64>()
                .unwrap(),
            dispatch.token,
            "the token the call was dispatched under"
        );
        assert!(dispatch.token >= 1);
        assert_eq!(header(request, "content-type"), "application/json");

        let parts: Vec<&str> = header(request, "traceparent").split('-').collect();
        assert_eq!(parts.len(), 4, "{parts:?}");
        assert_eq!(parts[0], "00");
        assert_eq!(parts[1], run.simple().to_string(), "trace id is the run id");
        assert_eq!(parts[2].len(), 16);
        assert!(
            parts[2]
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(parts[2], "0000000000000000");
        assert_eq!(parts[3], "01", "sampled");
        spans.push(parts[2].to_owned());

        let body = &request["body"];
        assert_eq!(body["run_id"], run.to_string());
        assert_eq!(body["node"], node);
        assert_eq!(body["definition"]["name"], "research-agent-http");
        assert_eq!(body["data"]["query"], "fencing tokens");
        assert!(body["resume"]["steps_completed"].is_u64());
    }
    spans.sort();
    spans.dedup();
    assert_eq!(spans.len(), requests.len(), "a fresh span per call");
    // OBSERVING saw the finished tool step in its resume brief.
    let observing = node_calls(&requests, "OBSERVING");
    assert_eq!(observing[0]["body"]["resume"]["steps_completed"], 1);
    assert_eq!(observing[0]["body"]["results"].as_array().unwrap().len(), 1);
    let brief = &observing[0]["body"]["brief"];
    assert_eq!(brief["steps_completed"], 1);
    assert_eq!(brief["steps_done"].as_array().map(Vec::len), Some(1));
    assert_eq!(brief["pending"]["node"], "OBSERVING");
    assert_eq!(brief["state"], "OBSERVING");
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_503_then_200_retries_with_the_same_idempotency_key() {
    let server = NodeServer::start("retry");
    server
        .script("ACTING", json!([{ "status": 503, "retry_after": "1" }]))
        .await;
    let store = store("http_node_retry").await;
    let def = register(&store, &definition_text(&server)).await;
    let run = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    let row = settle(&store, run).await;
    fleet.stop().await;

    let types = event_types(&store, run).await;
    assert_eq!(row.state, "SUCCEEDED", "{types:?}");
    let failed = events_of(&store, run, "TOOL_RETRYABLE_FAILED").await;
    assert_eq!(failed.len(), 1, "{types:?}");
    let error = &failed[0].payload["error"];
    assert_eq!(error["class"], "transient");
    assert_eq!(error["status"], 503);
    assert_eq!(failed[0].payload["retry_after_ms"], 1000, "Retry-After: 1");
    assert_eq!(events_of(&store, run, "RETRY_DUE").await.len(), 1);

    let requests = server.requests().await;
    let acting = node_calls(&requests, "ACTING");
    assert_eq!(acting.len(), 2);
    let key = header(acting[0], "idempotency-key");
    assert_eq!(
        header(acting[1], "idempotency-key"),
        key,
        "same key on the retry"
    );
    assert_ne!(
        header(acting[0], "rein-call-id"),
        header(acting[1], "rein-call-id"),
        "each attempt is a new call"
    );
    assert_eq!(acting[0]["body"]["attempt"], 0);
    assert_eq!(acting[1]["body"]["attempt"], 1);
    assert_eq!(
        acting[1]["body"]["resume"]["last_error"]["status"], 503,
        "the retry is told what went wrong"
    );
    assert_eq!(server.deliveries(key).await, 1, "applied once");
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_422_takes_the_fatal_path_without_a_retry() {
    let server = NodeServer::start("fatal");
    server.script("ACTING", json!([{ "status": 422 }])).await;
    let store = store("http_node_fatal").await;
    let def = register(&store, &definition_text(&server)).await;
    let run = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    let row = settle(&store, run).await;
    // Give a wrongly scheduled retry the time to happen before looking.
    tokio::time::sleep(Duration::from_millis(500)).await;
    fleet.stop().await;

    let types = event_types(&store, run).await;
    assert_eq!(row.state, "FAILED", "{types:?}");
    assert_eq!(row.terminal_reason.as_deref(), Some("http_status_422"));
    let fatal = events_of(&store, run, "TOOL_FATAL_FAILED").await;
    assert_eq!(fatal.len(), 1);
    assert_eq!(fatal[0].payload["error"]["class"], "fatal");
    assert_eq!(fatal[0].payload["error"]["status"], 422);
    assert!(
        !types
            .iter()
            .any(|t| t == "TOOL_RETRYABLE_FAILED" || t == "RETRY_DUE")
    );
    let requests = server.requests().await;
    assert_eq!(node_calls(&requests, "ACTING").len(), 1, "no retry call");
    assert!(node_calls(&requests, "OBSERVING").is_empty());
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_malformed_reply_takes_the_fatal_event() {
    let server = NodeServer::start("malformed");
    server
        .script("ACTING", json!([{ "raw": "<html>oops</html>" }]))
        .await;
    let store = store("http_node_malformed").await;
    let def = register(&store, &definition_text(&server)).await;
    let run = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    let row = settle(&store, run).await;
    fleet.stop().await;

    assert_eq!(row.state, "FAILED", "{:?}", event_types(&store, run).await);
    assert_eq!(row.terminal_reason.as_deref(), Some("http_bad_reply"));
    let fatal = events_of(&store, run, "TOOL_FATAL_FAILED").await;
    let message = fatal[0].payload["error"]["message"].as_str().unwrap();
    assert!(message.contains("not JSON"), "{message}");
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connect_refused_commits_the_transient_event() {
    let server = NodeServer::start("refused");
    // A port nothing listens on: bound, then let go.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let text = edit_state(&definition_text(&server), "INTAKE", |block| {
        block.replace(
            &format!("127.0.0.1:{}/nodes/INTAKE", server.port),
            &format!("127.0.0.1:{closed}/nodes/INTAKE"),
        )
    });
    let store = store("http_node_refused").await;
    let def = register(&store, &text).await;
    let (run, row) = drive_one(&store, &def, Fleet::start).await;

    // INTAKE's transient event is UNRECOVERABLE in the example definition.
    assert_eq!(row.state, "FAILED", "{:?}", event_types(&store, run).await);
    let failed = events_of(&store, run, "UNRECOVERABLE").await;
    assert_eq!(failed[0].payload["error"]["class"], "transient");
    assert!(failed[0].payload["error"].get("status").is_none());
    let message = failed[0].payload["error"]["message"].as_str().unwrap();
    assert!(message.contains("cannot connect"), "{message}");
    assert!(server.requests().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_timeout_after_send_is_reconciled_before_any_second_call() {
    let server = NodeServer::start("in_doubt");
    // Longer than ACTING's 400 ms timeout; the server applies the call when it wakes.
    server.script("ACTING", json!([{ "sleep_ms": 1500 }])).await;
    let store = store("http_node_in_doubt").await;
    let def = register(
        &store,
        &short_acting_timeout(&definition_text(&server), true),
    )
    .await;
    let run = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    let row = settle(&store, run).await;
    fleet.stop().await;

    let types = event_types(&store, run).await;
    assert_eq!(row.state, "SUCCEEDED", "{types:?}");
    let in_doubt = types
        .iter()
        .position(|t| t == "ACTION_RESULT_IN_DOUBT")
        .expect("the call was in doubt");
    let succeeded = types.iter().position(|t| t == "TOOL_SUCCEEDED").unwrap();
    assert!(in_doubt < succeeded, "{types:?}");
    assert!(!types.iter().any(|t| t == "ACTION_NOT_APPLIED"));
    // The reconciled result settles the call that was in doubt.
    let dispatched = events_of(&store, run, "ACTION_DISPATCHED").await;
    let acting = dispatched
        .iter()
        .find(|e| e.payload["node"] == "ACTING")
        .unwrap();
    let ok = events_of(&store, run, "TOOL_SUCCEEDED").await;
    assert_eq!(ok[0].payload["call_id"], acting.payload["call_id"]);
    assert_eq!(ok[0].payload["result"]["tool"], "search");

    let key = acting.payload["idempotency_key"].as_str().unwrap();
    let requests = server.requests().await;
    let with_key: Vec<&str> = requests
        .iter()
        .filter(|r| r["idempotency_key"] == key)
        .map(|r| r["path"].as_str().unwrap())
        .collect();
    // Reconcile may be asked more than once (a question that times out while the node is
    // still working is asked again), but the node is never called a second time.
    assert_eq!(with_key[0], "/nodes/ACTING", "{with_key:?}");
    assert!(with_key.len() >= 2, "reconcile was asked: {with_key:?}");
    assert!(
        with_key[1..].iter().all(|p| *p == "/reconcile"),
        "reconcile was asked and nothing was sent again: {with_key:?}"
    );
    let reconcile = requests.iter().find(|r| r["path"] == "/reconcile").unwrap();
    assert_eq!(reconcile["body"]["idempotency_key"], key);
    assert_eq!(reconcile["body"]["run_id"], run.to_string());
    assert_eq!(reconcile["body"]["node"], "ACTING");
    assert_eq!(node_calls(&requests, "ACTING").len(), 1);
    assert_eq!(server.deliveries(key).await, 1, "applied once");
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_timeout_without_reconcile_url_needs_an_operator() {
    let server = NodeServer::start("no_reconcile");
    server.script("ACTING", json!([{ "sleep_ms": 1500 }])).await;
    let store = store("http_node_no_reconcile").await;
    let text = short_acting_timeout(&definition_text(&server), false);
    assert!(!text[state_block(&text, "ACTING")].contains("reconcile_url"));
    assert!(text[state_block(&text, "OBSERVING")].contains("reconcile_url"));
    let def = register(&store, &text).await;
    let run = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    let row = settle(&store, run).await;
    // Long enough for the sleeping call to be applied and for a blind retry to show.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    fleet.stop().await;

    let types = event_types(&store, run).await;
    assert_eq!(row.status, "needs_operator", "{types:?}");
    assert_eq!(row.state, "ACTING");
    let row = store.run(run).await.expect("run");
    assert_eq!(
        row.status, "needs_operator",
        "it stays parked for an operator"
    );
    assert!(types.iter().any(|t| t == "ACTION_RESULT_IN_DOUBT"));
    assert!(types.iter().any(|t| t == "OPERATOR_REQUIRED"));
    let requests = server.requests().await;
    assert_eq!(
        node_calls(&requests, "ACTING").len(),
        1,
        "never a blind retry of a side effect"
    );
    assert!(!requests.iter().any(|r| r["path"] == "/reconcile"));
    assert_replays(&store, run).await;
}

/// A node may answer with a model decision instead of events; the engine validates it like
/// any other (SPEC D1): a tool the state does not offer is refused at the `tool` step,
/// recorded with its reason, and moves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_decision_reply_is_validated_and_a_bad_one_is_recorded_not_obeyed() {
    let server = NodeServer::start("decision");
    let decision = json!({ "decision": { "decision": "call_tool", "tool": "wire_money",
                                          "args": { "amount": 1_000_000 } } });
    server
        .script(
            "ACTING",
            json!([{ "raw": decision.to_string(), "status": 200 }]),
        )
        .await;
    let store = store("http_node_decision").await;
    let def = register(&store, &definition_text(&server)).await;
    let run = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    let row = settle(&store, run).await;
    fleet.stop().await;

    assert_eq!(row.status, "needs_operator", "no on_rejected_decision here");
    assert_eq!(row.state, "ACTING", "the decision moved nothing");
    let rejected = events_of(&store, run, "DECISION_REJECTED").await;
    assert_eq!(rejected.len(), 1);
    assert_eq!(rejected[0].payload["step"], "tool");
    assert!(
        rejected[0].payload["reason"]
            .as_str()
            .is_some_and(|r| r.contains("wire_money")),
        "{}",
        rejected[0].payload
    );
    assert_replays(&store, run).await;
}

/// The example definition with its top-level `[retry]` policy replaced by `policy`.
fn with_retry_policy(text: &str, policy: &str) -> String {
    let start = text.find("[retry]\n").expect("a [retry] table");
    let end = start + text[start..].find("\n\n").expect("the table's end");
    format!("{}[retry]\n{policy}{}", &text[..start], &text[end..])
}

/// Waits (up to `LONG`) until the run is terminal or needs an operator. On timeout it fails
/// with what the run did meanwhile: how many events, at which attempt, and their types.
async fn settle_or_report(store: &Store, run: Uuid) -> rein_store::RunRow {
    let deadline = Instant::now() + LONG;
    loop {
        let row = store.run(run).await.expect("run");
        if row.status == "terminal" || row.status == "needs_operator" {
            return row;
        }
        if Instant::now() >= deadline {
            let types = event_types(store, run).await;
            panic!(
                "run {run} still {} in {} after {LONG:?}: {} events, attempt {}: {types:?}",
                row.status,
                row.state,
                types.len(),
                row.projection.attempt
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One run of the example definition (as `edit` changes it) whose ACTING node answers
/// `script`, driven by a worker and a scheduler until it settles.
struct Settled {
    server: NodeServer,
    store: Store,
    def: Definition,
    run: Uuid,
    row: rein_store::RunRow,
}

async fn settle_one(name: &str, script: Value, edit: impl FnOnce(&str) -> String) -> Settled {
    let server = NodeServer::start(name);
    server.script("ACTING", script).await;
    let store = store(&format!("http_node_{name}")).await;
    let def = register(&store, &edit(&definition_text(&server))).await;
    let run = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    let row = settle_or_report(&store, run).await;
    fleet.stop().await;
    Settled {
        server,
        store,
        def,
        run,
        row,
    }
}

/// SPEC X7, R1: a side-effect call that always times out after it was sent, and that its
/// reconcile hook finds not applied, is retried on the definition's own retry path — each
/// re-dispatch a counted attempt after its backoff — and ends on the exhausted path after
/// `max_retries` retries, with a bounded log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_keeps_timing_out_and_is_not_applied_is_retried_with_backoff_until_exhausted() {
    // More hanging calls than the run may make; ACTING gives up on each after 400 ms.
    let Settled {
        server,
        store,
        def,
        run,
        row,
    } = settle_one(
        "not_applied",
        json!(vec![json!({ "hang_ms": 2000 }); 8]),
        |text| short_acting_timeout(text, true),
    )
    .await;

    let history = store.history(run).await.expect("history");
    let types: Vec<&str> = history.iter().map(|e| e.kind.as_str()).collect();
    let policy = def.retry_policy("RETRY_WAIT").clone();
    assert_eq!(policy.max_retries, 3);
    assert_eq!(row.state, "FAILED", "{types:?}");
    assert_eq!(row.terminal_reason.as_deref(), Some("retries_exhausted"));
    assert_eq!(
        row.projection.attempt, 3,
        "every re-dispatch was a counted retry"
    );
    let count = |kind: &str| types.iter().filter(|t| **t == kind).count();
    assert_eq!(count("ACTION_NOT_APPLIED"), 4, "{types:?}");
    assert_eq!(count("TOOL_RETRYABLE_FAILED"), 4, "{types:?}");
    assert_eq!(count("RETRY_DUE"), 3, "{types:?}");
    assert_eq!(count("RETRY_EXHAUSTED"), 1, "{types:?}");
    // INTAKE and PLANNING (2 each), four attempts of ACTING (dispatched, in doubt, not
    // applied, failed), three retries and the end.
    assert_eq!(history.len(), 4 + 4 * 4 + 3 + 1, "{types:?}");
    for failed in history.iter().filter(|e| e.kind == "TOOL_RETRYABLE_FAILED") {
        let prior = &history[failed.sequence as usize - 2];
        assert_eq!(prior.kind, "ACTION_NOT_APPLIED", "{types:?}");
        assert_eq!(failed.payload["reason"], "not_applied");
        assert_eq!(failed.payload["error"]["class"], "transient");
        assert_eq!(
            failed.payload["error"]["kind"], "timeout",
            "why it was lost"
        );
    }
    // Each re-dispatch waited its backoff (at least the policy's lower bound) by the
    // database clock.
    for (attempt, due) in history.iter().filter(|e| e.kind == "RETRY_DUE").enumerate() {
        let failed = &history[due.sequence as usize - 2];
        assert_eq!(failed.kind, "TOOL_RETRYABLE_FAILED");
        let waited = (due.occurred_at - failed.occurred_at).num_milliseconds();
        let least = policy.backoff_ms(attempt as u32, 0.0) as i64;
        assert!(
            waited >= least,
            "retry {attempt} waited {waited} ms, less than its backoff of {least} ms"
        );
    }
    let requests = server.requests().await;
    assert_eq!(
        node_calls(&requests, "ACTING").len(),
        4,
        "1 try + 3 retries"
    );
    assert!(
        requests
            .iter()
            .filter(|r| r["path"] == "/reconcile")
            .count()
            >= 4,
        "each lost answer was reconciled before the next dispatch"
    );
    assert_replays(&store, run).await;
}

/// Replays the recorded log up to its exhausted event, then offers the scheduler's retry in
/// its place with the very inputs the exhausted event recorded (`retry.elapsed_ms`): the
/// reducer refuses it for the same reason, so replay decides as the run did (SPEC R1).
async fn replay_refuses_the_retry_in_place_of(store: &Store, def: &Definition, run: Uuid) {
    let history = store.history(run).await.expect("history");
    let at = history
        .iter()
        .position(|e| e.kind == "RETRY_EXHAUSTED")
        .expect("an exhausted event");
    let exhausted = &history[at];
    // The input `enqueue` gave the run.
    let input = json!({ "query": "fencing tokens" });
    let events: Vec<rein_core::Event> = history[..at].iter().map(|e| e.as_event()).collect();
    let before = rein_core::replay(def, rein_core::RunState::initial(def, input), events.iter())
        .expect("the log replays");
    let retry = rein_core::Event::new(
        exhausted.sequence as u64,
        "RETRY_DUE",
        json!({ "retry": exhausted.payload["retry"] }),
    );
    let refused = rein_core::apply(def, &before, &retry).expect_err("the retry is refused");
    let why = exhausted.payload["reason"].as_str().expect("a reason");
    assert_eq!(refused.reason.code(), "retry_refused", "{refused}");
    assert_eq!(refused.reason.to_string(), format!("no retry: {why}"));
}

/// SPEC R1, R2: a policy that names a fine error class (`http_429`) as non-retryable takes
/// the exhausted path at the first 429, with no second call; replay decides the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_retryable_http_429_takes_the_exhausted_path_without_a_retry() {
    let Settled {
        server,
        store,
        def,
        run,
        row,
    } = settle_one(
        "non_retryable",
        json!([{ "status": 429, "retry_after": "1" }]),
        |text| {
            with_retry_policy(
                text,
                "max_retries = 3\ninitial_interval_ms = 200\nnon_retryable = [\"http_429\"]\n",
            )
        },
    )
    .await;

    let types = event_types(&store, run).await;
    assert_eq!(row.state, "FAILED", "{types:?}");
    assert_eq!(row.terminal_reason.as_deref(), Some("not_retryable"));
    let failed = events_of(&store, run, "TOOL_RETRYABLE_FAILED").await;
    assert_eq!(failed.len(), 1, "{types:?}");
    assert_eq!(failed[0].payload["error"]["class"], "transient");
    assert_eq!(failed[0].payload["error"]["kind"], "http_429");
    assert!(!types.iter().any(|t| t == "RETRY_DUE"), "{types:?}");
    let requests = server.requests().await;
    assert_eq!(node_calls(&requests, "ACTING").len(), 1, "no retry call");
    assert_replays(&store, run).await;
    replay_refuses_the_retry_in_place_of(&store, &def, run).await;
}

/// SPEC R1: once `deadline_ms` has passed since the action's first try (by the database
/// clock), no retry is started: the exhausted path is taken although retries are left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_retry_starts_after_the_policy_deadline() {
    // First retry after 400 ms (inside the deadline), the second would be 1200 ms later.
    let Settled {
        server,
        store,
        def,
        run,
        row,
    } = settle_one("deadline", json!(vec![json!({ "status": 503 }); 6]), |text| {
        with_retry_policy(
            text,
            "max_retries = 5\ninitial_interval_ms = 400\nbackoff_factor = 3.0\ndeadline_ms = 1000\n",
        )
    })
    .await;

    let types = event_types(&store, run).await;
    assert_eq!(row.state, "FAILED", "{types:?}");
    assert_eq!(
        row.terminal_reason.as_deref(),
        Some("retry_deadline_passed")
    );
    let due = events_of(&store, run, "RETRY_DUE").await;
    assert_eq!(due.len(), 1, "{types:?}");
    let inside = due[0].payload["retry"]["elapsed_ms"]
        .as_u64()
        .expect("recorded");
    assert!((400..1000).contains(&inside), "retry at {inside} ms");
    let exhausted = events_of(&store, run, "RETRY_EXHAUSTED").await;
    let past = exhausted[0].payload["retry"]["elapsed_ms"]
        .as_u64()
        .expect("recorded");
    assert!(past >= 1000, "gave up at {past} ms");
    assert_eq!(row.projection.attempt, 1, "retries were left");
    let requests = server.requests().await;
    assert_eq!(node_calls(&requests, "ACTING").len(), 2);
    assert_replays(&store, run).await;
    replay_refuses_the_retry_in_place_of(&store, &def, run).await;
}

/// A run's data for `runs_at_once`: each run gets its own query so they can be told apart.
async fn enqueue_many(store: &Store, def: &Definition, n: usize) -> Vec<Uuid> {
    let mut runs = Vec::new();
    for i in 0..n {
        runs.push(
            store
                .enqueue(EnqueueRequest::new(
                    def.clone(),
                    json!({ "query": format!("q{i}") }),
                ))
                .await
                .expect("enqueue")
                .run_id,
        );
    }
    runs
}

/// The example definition with every `reconcile_url` removed: a result lost by the engine
/// would leave its run waiting for an operator, for everyone to see.
fn without_reconcile(text: &str) -> String {
    text.lines()
        .filter(|l| !l.starts_with("reconcile_url"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// One node answering 500 with a NUL byte in its body costs no run its result: the failure
/// quotes the body (the worker quotes error bodies) with U+FFFD in place of NUL, and every
/// other run of the batch, whose nodes answered 200, gets its own result; nobody's lease
/// lapses, nobody needs an operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_byte_in_one_error_reply_costs_no_run_its_result() {
    let server = NodeServer::start("nul_reply");
    server
        .script("ACTING", json!([{ "status": 500, "raw": "a\u{0}b" }]))
        .await;
    let store = store("http_node_nul_reply").await;
    let def = register(&store, &without_reconcile(&definition_text(&server))).await;
    let runs = enqueue_many(&store, &def, 7).await;
    let quoting = HttpOptions {
        egress: Policy::new(),
        quote_error_bodies: true,
    };
    let fleet = Fleet::start_with_http(&store, quoting);
    let mut rows = Vec::new();
    for run in &runs {
        rows.push(settle_or_report(&store, *run).await);
    }
    fleet.stop().await;

    let mut quoted = 0;
    for (run, row) in runs.iter().zip(&rows) {
        let types = event_types(&store, *run).await;
        assert_eq!(row.state, "SUCCEEDED", "run {run}: {types:?}");
        assert!(
            !types
                .iter()
                .any(|t| t == "LEASE_EXPIRED" || t == "ACTION_RESULT_IN_DOUBT"),
            "run {run} lost a result: {types:?}"
        );
        for failed in events_of(&store, *run, "TOOL_RETRYABLE_FAILED").await {
            let message = failed.payload["error"]["message"].as_str().unwrap();
            assert!(message.contains("a\u{FFFD}b"), "{message:?}");
            assert_eq!(failed.payload["error"]["kind"], "http_5xx");
            quoted += 1;
        }
        assert_replays(&store, *run).await;
    }
    assert_eq!(quoted, 1, "the one 500 was recorded with its body");
}

/// A node reply whose JSON holds `\u0000` (which PostgreSQL cannot store) is a rejected
/// reply, at step `parse`: the state's fatal event records why, and nothing else breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_holding_a_nul_character_is_rejected_at_step_parse() {
    let reply =
        r#"{"events":[{"type":"TOOL_SUCCEEDED","payload":{"result":{"note":"a\u0000b"}}}]}"#;
    let Settled {
        store, run, row, ..
    } = settle_one(
        "nul_json",
        json!([{ "status": 200, "raw": reply }]),
        without_reconcile,
    )
    .await;

    let types = event_types(&store, run).await;
    assert_eq!(row.state, "FAILED", "{types:?}");
    assert_eq!(row.terminal_reason.as_deref(), Some("http_bad_reply"));
    let fatal = events_of(&store, run, "TOOL_FATAL_FAILED").await;
    assert_eq!(fatal.len(), 1, "{types:?}");
    assert_eq!(fatal[0].payload["error"]["step"], "parse");
    let message = fatal[0].payload["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("NUL") && message.contains("$.events[0].payload.result.note"),
        "{message}"
    );
    assert_replays(&store, run).await;
}

/// The example definition as version `version`, with INTAKE calling `url` (its fatal event
/// INVALID_INPUT ends the run in FAILED).
fn intake_calling(server: &NodeServer, version: u32, url: &str) -> String {
    let text =
        definition_text(server).replacen("version = 1\n", &format!("version = {version}\n"), 1);
    edit_state(&text, "INTAKE", |block| {
        block.replace(
            &format!("url = \"http://127.0.0.1:{}/nodes/INTAKE\"", server.port),
            &format!("url = \"{url}\""),
        )
    })
}

/// Asserts that `run` ended on INTAKE's fatal event because the egress policy refused the
/// call by `rule`, naming `says`.
async fn assert_refused(store: &Store, run: Uuid, rule: &str, says: &str) {
    let row = settle(store, run).await;
    let types = event_types(store, run).await;
    assert_eq!(row.state, "FAILED", "{types:?}");
    assert_eq!(
        row.terminal_reason.as_deref(),
        Some("egress_refused"),
        "{types:?}"
    );
    let fatal = events_of(store, run, "INVALID_INPUT").await;
    assert_eq!(fatal.len(), 1, "{types:?}");
    let error = &fatal[0].payload["error"];
    assert_eq!(error["kind"], "egress_refused", "{error}");
    assert_eq!(error["class"], "fatal", "never retried: {error}");
    assert_eq!(error["rule"], rule, "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{message} should say {says}");
    assert!(message.contains("nothing was sent"), "{message}");
}

/// Metadata and link-local addresses and the worker's own database are refused in any
/// spelling (hex, mapped IPv6, a name that resolves to it); nothing is sent, the run takes
/// the state's fatal path with the rule named, and loopback stays callable, by address and
/// by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_nodes_may_not_call_metadata_link_local_or_the_database() {
    let server = NodeServer::start("egress_refused");
    let store = store("http_node_egress").await;
    let (db_host, db_port) = store
        .database_address()
        .expect("the test database is on TCP");
    assert!(
        db_host == "127.0.0.1" || db_host == "localhost",
        "the private test database is on loopback: {db_host}"
    );
    let cases = [
        (
            "http://169.254.169.254/latest/meta-data/iam/".to_owned(),
            "metadata",
            "169.254.169.254:80",
        ),
        (
            "http://0xa9fea9fe/latest/meta-data/".to_owned(),
            "metadata",
            "169.254.169.254:80",
        ),
        (
            "http://[::ffff:169.254.169.254]/".to_owned(),
            "metadata",
            "a cloud metadata endpoint",
        ),
        (
            "http://169.254.10.10:8080/".to_owned(),
            "link_local",
            "a link-local address",
        ),
        (
            format!("http://127.0.0.1:{db_port}/"),
            "database",
            "the worker's own database",
        ),
        (
            format!("http://0x7f000001:{db_port}/"),
            "database",
            &format!("127.0.0.1:{db_port}"),
        ),
        (
            format!("http://[::1]:{db_port}/"),
            "database",
            "the worker's own database",
        ),
        (
            format!("http://localhost:{db_port}/"),
            "database",
            &format!("localhost:{db_port}"),
        ),
    ]
    .map(|(url, rule, says)| (url, rule, says.to_owned()));
    let mut runs = Vec::new();
    for (i, (url, rule, says)) in cases.iter().enumerate() {
        let def = register(&store, &intake_calling(&server, 10 + i as u32, url)).await;
        runs.push((enqueue(&store, &def).await, *rule, says.clone()));
    }
    // Loopback by name, resolved and checked like any name.
    let by_name = format!("http://localhost:{}/nodes/INTAKE", server.port);
    let def = register(&store, &intake_calling(&server, 30, &by_name)).await;
    let allowed = enqueue(&store, &def).await;
    let fleet = Fleet::start(&store);
    for (run, rule, says) in &runs {
        assert_refused(&store, *run, rule, says).await;
    }
    let row = settle(&store, allowed).await;
    fleet.stop().await;
    assert_eq!(
        row.state,
        "SUCCEEDED",
        "{:?}",
        event_types(&store, allowed).await
    );
    let paths: Vec<String> = server
        .requests()
        .await
        .iter()
        .map(|r| r["path"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(paths.first().map(String::as_str), Some("/nodes/INTAKE"));
    assert_eq!(
        paths.iter().filter(|p| *p == "/nodes/INTAKE").count(),
        1,
        "only the loopback run reached a node: {paths:?}"
    );
}

/// A URL with credentials or without a host is refused when its definition is registered;
/// one stored before that rule (loaded as stored) is refused by the worker, and the
/// password never reaches the event log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_node_urls_with_credentials_or_no_host_are_refused() {
    let server = NodeServer::start("egress_userinfo");
    let with_credentials = format!("http://rein:hunter2@127.0.0.1:{}/nodes/INTAKE", server.port);
    for (url, says) in [
        (with_credentials.as_str(), "credentials"),
        ("http://", "no host"),
    ] {
        let err = Definition::parse(
            &intake_calling(&server, 2, url),
            Format::Toml,
            &GuardRegistry::new(),
        )
        .expect_err(url);
        let problems = err.problems();
        assert!(
            problems
                .iter()
                .any(|p| p.item == "states[0] (INTAKE).http.url" && p.reason.contains(says)),
            "{url}: {problems:?}"
        );
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    // A definition stored before the rule existed still loads, and its call is refused.
    let store = store("http_node_userinfo").await;
    let valid = Definition::parse(
        &definition_text(&server),
        Format::Toml,
        &GuardRegistry::new(),
    )
    .expect("valid");
    let mut spec = valid.spec().clone();
    spec.version = 3;
    let intake = spec
        .states
        .iter_mut()
        .find(|s| s.name == "INTAKE")
        .expect("INTAKE");
    intake.http.as_mut().expect("an http node").url = with_credentials.clone();
    let stored = Definition::from_spec(spec, &GuardRegistry::new()).expect("loads as stored");
    store.register_definition(&stored).await.expect("stored");
    let run = enqueue(&store, &stored).await;
    let fleet = Fleet::start(&store);
    assert_refused(&store, run, "userinfo", "credentials").await;
    fleet.stop().await;
    let log = serde_json::to_string(
        &store
            .history(run)
            .await
            .expect("history")
            .iter()
            .map(|e| e.payload.clone())
            .collect::<Vec<_>>(),
    )
    .expect("JSON");
    assert!(!log.contains("hunter2"), "{log}");
    assert!(server.requests().await.is_empty(), "nothing was sent");
}

/// `--http-allow` narrows what http nodes reach: a worker allowing only other hosts refuses
/// the loopback node (`not_allowed`, naming the list); one allowing that host and port calls it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allow_list_narrows_what_http_nodes_reach() {
    let server = NodeServer::start("egress_allow");
    let store = store("http_node_allow").await;
    let def = register(&store, &definition_text(&server)).await;
    let narrowed = |entries: &[String]| HttpOptions {
        egress: Policy::allowing(
            entries
                .iter()
                .map(|e| Allow::parse(e).expect("entry"))
                .collect(),
        )
        .expect("policy"),
        quote_error_bodies: false,
    };

    let elsewhere = narrowed(&["api.example.com".into(), "10.0.0.0/8".into()]);
    let (run, row) = drive_one(&store, &def, |s| Fleet::start_with_http(s, elsewhere)).await;
    assert_eq!(row.state, "FAILED", "{:?}", event_types(&store, run).await);
    assert_eq!(row.terminal_reason.as_deref(), Some("egress_refused"));
    let fatal = events_of(&store, run, "INVALID_INPUT").await;
    assert_eq!(fatal[0].payload["error"]["rule"], "not_allowed");
    let message = fatal[0].payload["error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("api.example.com, 10.0.0.0/8"), "{message}");
    assert!(server.requests().await.is_empty());

    let here = narrowed(&[format!("127.0.0.1:{}", server.port)]);
    let (run, row) = drive_one(&store, &def, |s| Fleet::start_with_http(s, here)).await;
    assert_eq!(
        row.state,
        "SUCCEEDED",
        "{:?}",
        event_types(&store, run).await
    );
}

/// An error reply's body stays out of the event log, which every `read` token can read:
/// the failure records its status, type, length and hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_in_an_error_body_does_not_reach_the_event_log() {
    let server = NodeServer::start("egress_secret");
    let secret = "db_password=hunter2";
    server
        .script("INTAKE", json!([{ "status": 500, "raw": secret }]))
        .await;
    let store = store("http_node_secret").await;
    let def = register(&store, &without_reconcile(&definition_text(&server))).await;
    let (run, row) = drive_one(&store, &def, Fleet::start).await;

    // INTAKE's transient event is UNRECOVERABLE in the example definition.
    assert_eq!(row.state, "FAILED", "{:?}", event_types(&store, run).await);
    let failed = events_of(&store, run, "UNRECOVERABLE").await;
    let error = &failed[0].payload["error"];
    assert_eq!(error["status"], 500);
    assert_eq!(error["body"]["bytes"], secret.len());
    assert_eq!(error["body"]["content_type"], "text/plain");
    assert_eq!(
        error["body"]["sha256_prefix"],
        &rein_core::hash::sha256_hex(secret.as_bytes())[..16]
    );
    let history = store.history(run).await.expect("history");
    let log = serde_json::to_string(
        &history
            .iter()
            .map(|e| e.payload.clone())
            .collect::<Vec<_>>(),
    )
    .expect("JSON");
    assert!(!log.contains("hunter2"), "the secret is in the log: {log}");
    let projection = serde_json::to_string(&row.projection).expect("JSON");
    assert!(!projection.contains("hunter2"), "{projection}");
}
