//! Large payloads stored by hash (SPEC E5), read back: a tool result too large to stay in its
//! event is stored once as a blob; the next step's handler gets the value, not the
//! reference; `GET /v1/blobs/{sha256}` and `rein blobs get` return it to whoever may read a
//! run that refers to it, and answer 404 to everyone else, as for an unknown hash.

mod common;

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
    for run in [run_a, run_b] {
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
        .await;
    }
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
    // Its own run's blob it reads.
    let own = sha256_of(&big_result("b"));
    let (status, body) = api.get_json(&format!("/v1/blobs/{own}"), &in_b).await;
    assert_eq!(status, 200, "{body}");

    // A reference sent from outside into a run it may reach does not make the blob its.
    let sent = json!({
        "type": "NOTE",
        "payload": { "see": { "$blob": { "sha256": hash, "bytes": reference.bytes } } }
    });
    let (status, body) = api
        .post_json(&format!("/v1/runs/{run_b}/events"), &in_b, &sent)
        .await;
    assert!(status.is_success(), "{status} {body}");
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
