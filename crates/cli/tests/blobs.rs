//! Large payloads stored by hash (SPEC E5), read back: a tool result too large to stay in its
//! event is stored once as a blob; the next step's handler gets the value, not the
//! reference; `GET /v1/blobs/{sha256}` and `rein blobs get` return it to whoever may read a
//! run that refers to it, and answer 404 to everyone else, as for an unknown hash.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Api, code, json_of, rein_with, stderr, stdout, token_with, wait_for};
use rein_core::{Definition, Format, GuardRegistry};
use rein_worker::{ActionContext, BoxFuture, NodeHandler, Outcome, Registry, Worker, WorkerConfig};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const FETCHER: &str = r#"
name = "fetcher"
version = 1
cancel_state = "CANCELLED"
events = ["FETCHED", "USED", "NOTE"]
external_events = ["NOTE"]

[[states]]
name = "FETCH"
kind = "active"
initial = true
action = "fetch"

[[states]]
name = "USE"
kind = "active"
action = "use"

[[states]]
name = "WAIT"
kind = "waiting"

[[states]]
name = "DONE"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "FETCH"
event = "FETCHED"
to = "USE"
effects = ["append_result"]

[[transitions]]
from = "USE"
event = "USED"
to = "WAIT"

[[transitions]]
from = "WAIT"
event = "NOTE"
to = "DONE"
"#;

/// A page-sized result: well over the 64 KiB a payload field keeps inline.
fn big_result(queue: &str) -> Value {
    let lines: Vec<String> = (0..4000)
        .map(|i| format!("{queue} line {i}: the quick brown fox"))
        .collect();
    json!({ "queue": queue, "lines": lines })
}

/// `fetch` returns the big result of its run's queue; `use` records what it was given as
/// the newest result.
struct Fake {
    action: &'static str,
    seen: Arc<Mutex<Vec<Value>>>,
}

impl NodeHandler for Fake {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let action = self.action;
        let seen = self.seen.clone();
        Box::pin(async move {
            if action == "fetch" {
                let queue = ctx.run.data["queue"].as_str().unwrap_or("").to_owned();
                return Outcome::event("FETCHED", json!({ "result": big_result(&queue) }));
            }
            let newest = ctx.run.results.last().cloned().unwrap_or(Value::Null);
            seen.lock().expect("seen").push(newest["value"].clone());
            Outcome::event("USED", json!({}))
        })
    }
}

fn sha256_of(value: &Value) -> String {
    rein_core::hash::sha256_hex(rein_core::hash::canonical_json(value).as_bytes())
}

async fn run_in(api: &Api, def: &Definition, queue: &str) -> Uuid {
    let mut request = rein_store::EnqueueRequest::new(def.clone(), json!({ "queue": queue }));
    request.queue = queue.to_owned();
    api.store.enqueue(request).await.expect("enqueue").run_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_result_reads_back_by_hash_for_those_who_may_read_its_run() {
    let api = Api::start("blobs", &[]).await;
    let def = Definition::parse(FETCHER, Format::Toml, &GuardRegistry::new()).expect("valid");
    api.store.register_definition(&def).await.expect("register");
    let run_a = run_in(&api, &def, "a").await;
    let run_b = run_in(&api, &def, "b").await;

    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    for action in ["fetch", "use"] {
        registry.register(
            action,
            Fake {
                action,
                seen: seen.clone(),
            },
        );
    }
    let mut config = WorkerConfig::new("blobs-w1");
    config.poll_interval_ms = 20;
    config.queues = vec!["a".into(), "b".into()];
    let worker = Worker::new(api.store.clone(), config, registry);
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await }
    });
    let waits = |run: Uuid| {
        let store = api.store.clone();
        wait_for(
            "the run waits",
            Duration::from_secs(30),
            Duration::from_millis(50),
            move || {
                let store = store.clone();
                async move { store.run(run).await.is_ok_and(|r| r.state == "WAIT") }
            },
        )
    };
    for run in [run_a, run_b] {
        waits(run).await;
    }
    // A fork of A after its fetch stored nothing itself, and reads its source's blob: its
    // `use` handler is given the value, and the API answers for it.
    let fetched_at = api
        .store
        .history(run_a)
        .await
        .expect("history")
        .iter()
        .find(|e| e.kind == "FETCHED")
        .expect("FETCHED")
        .sequence;
    let operate = api.token("forker", &["operate", "read"]);
    let (status, body) = api
        .post_json(
            &format!("/v1/runs/{run_a}/fork"),
            &operate,
            &json!({ "at": fetched_at }),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let fork: Uuid = body["run_id"]
        .as_str()
        .expect("run_id")
        .parse()
        .expect("uuid");
    waits(fork).await;
    stop.cancel();
    task.await.expect("worker task").expect("worker");

    // The event holds a reference, and the next step's handler got the value itself.
    let expected = big_result("a");
    let hash = sha256_of(&expected);
    let events = api.store.history(run_a).await.expect("history");
    let fetched = events
        .iter()
        .find(|e| e.kind == "FETCHED")
        .expect("FETCHED");
    let reference = rein_core::blob::reference_of(&fetched.payload["result"])
        .expect("the result is stored by hash");
    assert_eq!(reference.sha256, hash);
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(
        seen.iter().filter(|v| **v == expected).count(),
        2,
        "the run's and its fork's `use` handlers were given the value"
    );
    assert!(
        seen.contains(&expected),
        "the `use` handler was given the value, not its reference: {:?}",
        seen.iter()
            .map(|v| v.to_string().chars().take(120).collect::<String>())
            .collect::<Vec<_>>()
    );

    let reader = api.token("reader", &["read"]);
    let in_a = token_with(&api.url, "in-a", &["read"], &["--queue", "a"]);
    let in_b = token_with(&api.url, "in-b", &["read", "operate"], &["--queue", "b"]);
    let path = format!("/v1/blobs/{hash}");

    for token in [&reader, &in_a] {
        let (status, body) = api.get_json(&path, token).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["sha256"], hash.as_str());
        assert_eq!(
            body["bytes"],
            rein_core::hash::canonical_json(&expected).len()
        );
        assert_eq!(body["value"], expected, "the value reads back whole");
    }

    // A token bounded to another queue is told nothing, as for a hash nobody stored.
    let (status, hidden) = api.get_json(&path, &in_b).await;
    assert_eq!(status, 404, "{hidden}");
    assert_eq!(code(&hidden), "not_found");
    let unknown = format!("/v1/blobs/{}", "0".repeat(64));
    let (status, missing) = api.get_json(&unknown, &reader).await;
    assert_eq!(status, 404, "{missing}");
    assert_eq!(
        hidden["error"]["message"]
            .as_str()
            .map(|m| m.replace(&hash, "H")),
        missing["error"]["message"]
            .as_str()
            .map(|m| m.replace(&"0".repeat(64), "H")),
        "the same answer for hidden and unknown"
    );
    // Read as the fork's, which refers to it through its source.
    let (status, body) = api.get_json(&format!("{path}?run={fork}"), &in_a).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["value"], expected);
    let (status, body) = api.get_json(&format!("{path}?run={run_b}"), &reader).await;
    assert_eq!(status, 404, "B's run does not refer to it: {body}");
    // Its own run's blob it reads.
    let own = sha256_of(&big_result("b"));
    let (status, body) = api.get_json(&format!("/v1/blobs/{own}"), &in_b).await;
    assert_eq!(status, 200, "{body}");

    // A reference sent from outside into a run it may reach is refused, naming the field,
    // at any depth; so is one in an enqueue's input. The blob stays unreadable to it.
    let planted = json!({ "$blob": { "sha256": hash, "bytes": reference.bytes } });
    for (payload, field) in [
        (json!({ "see": planted }), "payload.see"),
        (
            json!({ "deep": [1, { "x": planted }] }),
            "payload.deep[1].x",
        ),
    ] {
        let sent = json!({ "type": "NOTE", "payload": payload });
        let (status, body) = api
            .post_json(&format!("/v1/runs/{run_b}/events"), &in_b, &sent)
            .await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(code(&body), "validation_failed");
        assert_eq!(body["error"]["details"]["field"], field, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("`$blob` key")),
            "{body}"
        );
    }
    let enqueuer = api.token("enqueuer", &["enqueue"]);
    let (status, body) = api
        .post_json(
            "/v1/runs",
            &enqueuer,
            &json!({ "definition": "fetcher", "input": { "queue": "b", "doc": planted } }),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["details"]["field"], "input.doc", "{body}");
    let (status, body) = api.get_json(&path, &in_b).await;
    assert_eq!(status, 404, "a planted reference reads nothing: {body}");

    // Not a hash: refused like any malformed path, with what a hash is.
    for bad in [
        "abc".to_owned(),
        hash.to_uppercase(),
        format!("{hash}0"),
        format!("{}g", &hash[..63]),
    ] {
        let (status, body) = api.get_json(&format!("/v1/blobs/{bad}"), &reader).await;
        assert_eq!(status, 422, "{bad}: {body}");
        assert_eq!(code(&body), "validation_failed");
        assert_eq!(body["error"]["details"]["field"], "sha256");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("64 lowercase hex")),
            "{body}"
        );
    }
    // Reading needs the read scope.
    let (status, body) = json_of(
        api.get(&path, Some(&api.token("sender", &["operate"])))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 403, "{body}");

    // `rein blobs get` on the database prints the value; --json the whole view; --out
    // writes it.
    let on_db = |args: &[&str]| rein_with(args, &[("DATABASE_URL", &api.url)]);
    let out = on_db(&["blobs", "get", &hash]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let printed: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(printed, expected);
    let out = on_db(&["blobs", "get", &hash, "--json"]);
    let view: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(view["sha256"], hash.as_str());
    assert_eq!(view["value"], expected);
    let file = common::tmp_dir("blobs").join("value.json");
    let out = on_db(&["blobs", "get", &hash, "--out", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("written")).expect("JSON");
    assert_eq!(written, expected);
    let out = on_db(&["blobs", "get", "nothex"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("64 lowercase hex"),
        "{}",
        stderr(&out)
    );
    let out = on_db(&["blobs", "stats", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let stats: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(stats["blobs"], 2, "one blob per queue's result: {stats}");

    // Through the API, the token decides.
    let via = |token: &str, args: &[&str]| {
        rein_with(args, &[("REIN_URL", &api.base), ("REIN_TOKEN", token)])
    };
    let out = via(&in_a, &["blobs", "get", &hash]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let printed: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(printed, expected);
    let out = via(&in_b, &["blobs", "get", &hash]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stderr(&out).contains("no blob"), "{}", stderr(&out));
}

/// Two http nodes: FETCH answers the run's result, USE records what it was given.
const RELAY: &str = r#"
name = "relay"
version = 1
cancel_state = "CANCELLED"
events = ["FETCHED", "USED", "BROKE"]
call_results = ["FETCHED", "USED", "BROKE"]

[[states]]
name = "FETCH"
kind = "active"
initial = true
action = "http"

[states.http]
url = "{{BASE}}/nodes/FETCH"
transient_event = "BROKE"
fatal_event = "BROKE"

[[states]]
name = "USE"
kind = "active"
action = "http"

[states.http]
url = "{{BASE}}/nodes/USE"
transient_event = "BROKE"
fatal_event = "BROKE"

[[states]]
name = "DONE"
kind = "terminal"

[[states]]
name = "FAILED"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "FETCH"
event = "FETCHED"
to = "USE"
effects = ["append_result"]

[[transitions]]
from = "FETCH"
event = "BROKE"
to = "FAILED"

[[transitions]]
from = "USE"
event = "USED"
to = "DONE"

[[transitions]]
from = "USE"
event = "BROKE"
to = "FAILED"
"#;

/// A node service standing in for two tenants' agents: FETCH answers queue `a` with its big
/// result and any other queue with `forged` (what a hostile node replies); every request
/// it receives is kept, with the node it was sent to.
#[derive(Clone)]
struct Nodes {
    forged: Arc<Mutex<Value>>,
    requests: Arc<Mutex<Vec<(String, Value)>>>,
}

impl Nodes {
    async fn start() -> (Nodes, String) {
        let nodes = Nodes {
            forged: Arc::new(Mutex::new(Value::Null)),
            requests: Arc::new(Mutex::new(Vec::new())),
        };
        let answer = |node: &'static str| {
            let nodes = nodes.clone();
            axum::routing::post(move |axum::Json(body): axum::Json<Value>| {
                let nodes = nodes.clone();
                async move {
                    nodes
                        .requests
                        .lock()
                        .expect("requests")
                        .push((node.to_owned(), body.clone()));
                    let queue = body["data"]["queue"].as_str().unwrap_or("").to_owned();
                    axum::Json(match node {
                        "FETCH" if queue == "a" => json!({ "events": [
                            { "type": "FETCHED", "payload": { "result": big_result("a") } }] }),
                        "FETCH" => json!({ "events": [
                            { "type": "FETCHED",
                              "payload": { "result": nodes.forged.lock().expect("forged").clone() } }] }),
                        _ => json!({ "events": [{ "type": "USED", "payload": {} }] }),
                    })
                }
            })
        };
        let app = axum::Router::new()
            .route("/nodes/FETCH", answer("FETCH"))
            .route("/nodes/USE", answer("USE"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("address"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        (nodes, base)
    }

    /// What USE was given as the newest result, by the run's queue, in order.
    fn used(&self) -> Vec<(String, Value)> {
        self.requests
            .lock()
            .expect("requests")
            .iter()
            .filter(|(node, _)| node == "USE")
            .map(|(_, body)| {
                let queue = body["data"]["queue"].as_str().unwrap_or("").to_owned();
                let results = body["results"].as_array().cloned().unwrap_or_default();
                let newest = results.last().map(|r| r["value"].clone());
                (queue, newest.unwrap_or(Value::Null))
            })
            .collect()
    }
}

async fn ended(api: &Api, run: Uuid) -> rein_store::RunRow {
    let store = api.store.clone();
    wait_for(
        "the run ends",
        Duration::from_secs(30),
        Duration::from_millis(50),
        move || {
            let store = store.clone();
            async move { store.run(run).await.is_ok_and(|r| r.status == "terminal") }
        },
    )
    .await;
    api.store.run(run).await.expect("run")
}

/// A tenant that learnt another's blob hash from its events and has its own node answer
/// `{"$blob": {"sha256": H}}` gets nothing: the reply is rejected at step `parse`, the
/// blob stays 404 to it, and its nodes never see the content. A run refers only to the
/// blobs its own commits stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_blob_reference_reads_nothing_of_another_tenant() {
    let api = Api::start("blobs_forged", &[]).await;
    let (nodes, base) = Nodes::start().await;
    let def = Definition::parse(
        &RELAY.replace("{{BASE}}", &base),
        Format::Toml,
        &GuardRegistry::new(),
    )
    .expect("valid");
    api.store.register_definition(&def).await.expect("register");
    let mut config = WorkerConfig::new("blobs-forged-w1");
    config.poll_interval_ms = 20;
    config.queues = vec!["a".into(), "b".into()];
    let worker = Worker::new(
        api.store.clone(),
        config,
        rein_worker::builtin_registry(api.store.clone()),
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await }
    });

    // Tenant A's run stores its result as a blob; its own USE node is given the value.
    let secret = big_result("a");
    let hash = sha256_of(&secret);
    let run_a = run_in(&api, &def, "a").await;
    assert_eq!(ended(&api, run_a).await.state, "DONE");
    let history = api.store.history(run_a).await.expect("history");
    let fetched = history
        .iter()
        .find(|e| e.kind == "FETCHED")
        .expect("FETCHED");
    let reference =
        rein_core::blob::reference_of(&fetched.payload["result"]).expect("stored by hash");
    assert_eq!(reference.sha256, hash);
    assert_eq!(nodes.used(), vec![("a".to_owned(), secret.clone())]);

    // Tenant B's node answers with A's reference, as read from A's events.
    *nodes.forged.lock().expect("forged") = rein_core::blob::reference(&reference);
    let run_b = run_in(&api, &def, "b").await;
    let row = ended(&api, run_b).await;
    assert_eq!(row.state, "FAILED", "the forged reply is not a result");
    let history = api.store.history(run_b).await.expect("history");
    let broke = history.iter().find(|e| e.kind == "BROKE").expect("BROKE");
    assert_eq!(broke.payload["error"]["step"], "parse", "{}", broke.payload);
    assert!(
        broke.payload["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("`$blob` key at $.events[0].payload.result")),
        "{}",
        broke.payload
    );
    assert!(!history.iter().any(|e| e.kind == "FETCHED"));
    let leaked = nodes
        .requests
        .lock()
        .expect("requests")
        .iter()
        .any(|(_, body)| body["data"]["queue"] == "b" && body.to_string().contains("a line 0"));
    assert!(!leaked, "A's content reached B's node");

    let in_a = token_with(&api.url, "in-a", &["read"], &["--queue", "a"]);
    let in_b = token_with(&api.url, "in-b", &["read"], &["--queue", "b"]);
    let reader = api.token("reader", &["read"]);
    let path = format!("/v1/blobs/{hash}");
    let (status, body) = api.get_json(&path, &in_b).await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = api.get_json(&format!("{path}?run={run_b}"), &reader).await;
    assert_eq!(status, 404, "B's run does not refer to it: {body}");
    let (status, body) = api.get_json(&format!("{path}?run={run_a}"), &in_a).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["value"], secret);
    let (status, body) = api.get_json(&format!("{path}?run={run_a}"), &in_b).await;
    assert_eq!(status, 404, "a run outside the token's queues: {body}");

    stop.cancel();
    task.await.expect("worker task").expect("worker");
}
