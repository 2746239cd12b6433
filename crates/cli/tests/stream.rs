//! Following a run live: `GET /v1/runs/{id}/stream` of a real `rein api` (server-sent
//! events), `rein runs watch` and `rein enqueue --wait`, with real workers and schedulers on
//! a fresh database and a private Redis for the deltas.

use crate::common;

use std::process::Output;
use std::time::Duration;

use common::{Api, Fleet, PrivateRedis, free_port, rein_with, stderr, stdout};
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

/// One server-sent event.
#[derive(Debug, Clone)]
struct Sse {
    event: String,
    id: Option<String>,
    data: Value,
}

/// Reads the events of an open stream, one at a time.
struct Reader {
    response: reqwest::Response,
    buffer: String,
}

impl Reader {
    async fn open(api: &Api, run: Uuid, token: &str, last_event_id: Option<&str>) -> Reader {
        let mut req = api.get(&format!("/v1/runs/{run}/stream"), Some(token));
        if let Some(id) = last_event_id {
            req = req.header("last-event-id", id);
        }
        let response = req.send().await.expect("the stream opens");
        assert_eq!(response.status(), StatusCode::OK, "the stream opens");
        assert_eq!(
            response.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        Reader {
            response,
            buffer: String::new(),
        }
    }

    /// The next event; `None` once the server ended the stream.
    async fn next(&mut self) -> Option<Sse> {
        loop {
            if let Some(at) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..at + 2).collect();
                let mut event = String::new();
                let mut id = None;
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        event = v.to_owned();
                    } else if let Some(v) = line.strip_prefix("id: ") {
                        id = Some(v.to_owned());
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data.push_str(v);
                    }
                }
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                let data = serde_json::from_str(&data)
                    .unwrap_or_else(|e| panic!("{event} data is not JSON ({e}): {data}"));
                return Some(Sse { event, id, data });
            }
            match self.response.chunk().await {
                Ok(Some(chunk)) => self.buffer.push_str(&String::from_utf8_lossy(&chunk)),
                Ok(None) | Err(_) => return None,
            }
        }
    }

    /// Every event up to and with `end`; panics if the stream ends without it.
    async fn until_end(&mut self) -> Vec<Sse> {
        let mut all = Vec::new();
        while let Some(e) = self.next().await {
            let end = e.event == "end";
            all.push(e);
            if end {
                return all;
            }
        }
        panic!("the stream ended without an `end` event: {all:?}");
    }
}

/// The sequence numbers of a stream's committed events, checked to follow each other from
/// `after` + 1 without a gap or a repeat, each event's `id` its sequence.
fn no_gap(events: &[Sse], after: i64) -> Result<Vec<i64>, String> {
    let mut last = after;
    let mut seqs = Vec::new();
    for e in events.iter().filter(|e| e.event == "committed") {
        let seq = e.data["sequence"]
            .as_i64()
            .ok_or_else(|| format!("no sequence: {:?}", e.data))?;
        if seq != last + 1 {
            return Err(format!("event {seq} came after event {last}"));
        }
        if e.id.as_deref() != Some(seq.to_string().as_str()) {
            return Err(format!("event {seq} has id {:?}", e.id));
        }
        last = seq;
        seqs.push(seq);
    }
    Ok(seqs)
}

/// The database route, and a fleet: a worker and a scheduler on it.
async fn fleet(prefix: &str, api_extra: &[&str]) -> (Api, String) {
    let mut api = Api::start(prefix, api_extra).await;
    api.fleet.spawn_worker("w1", "2000");
    api.fleet.spawn(
        "s1",
        &["scheduler", "--tick-ms", "20", "--leader-ttl-ms", "1000"],
    );
    let token = api.token("ops", &["admin"]);
    (api, token)
}

/// A research-agent run nobody works on (no worker in these tests that use it), a few
/// events in.
async fn idle_run(store: &rein_store::Store) -> Uuid {
    let def = store.load_definition("research-agent", None).await.unwrap();
    let run = store
        .enqueue(rein_store::EnqueueRequest::new(def, json!({})))
        .await
        .unwrap()
        .run_id;
    common::as_the_engine(store, run, &["TASK_ACCEPTED", "PLAN_READY"]).await;
    run
}

async fn enqueue(api: &Api, token: &str, input: Value) -> Uuid {
    let (s, v) = api
        .post_json(
            "/v1/runs",
            token,
            &json!({"definition": "lifecycle", "input": input}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["run_id"].as_str().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_followed_through_the_api_streams_its_whole_log_in_order_then_how_it_ended() {
    let redis = PrivateRedis::start(free_port(), &common::tmp_dir("stream_follow_redis"));
    let (api, token) = fleet("stream_follow", &["--redis-url", &redis.url()]).await;
    let run = enqueue(
        &api,
        &token,
        json!({"sim": {"work_ms": 30, "transient_failures": 1}}),
    )
    .await;
    let mut stream = Reader::open(&api, run, &token, None).await;
    let events = stream.until_end().await;
    let seqs = no_gap(&events, 0).expect("no gap");
    let (s, history) = api
        .get_json(&format!("/v1/runs/{run}/events?limit=1000"), &token)
        .await;
    assert_eq!(s, StatusCode::OK);
    let history = history.as_array().unwrap();
    assert_eq!(seqs.len(), history.len(), "every event of the log");
    let committed: Vec<&Value> = events
        .iter()
        .filter(|e| e.event == "committed")
        .map(|e| &e.data)
        .collect();
    for (streamed, logged) in committed.iter().zip(history) {
        assert_eq!(
            *streamed, logged,
            "an event as the history route renders it"
        );
    }
    let end = events.last().unwrap();
    assert_eq!(end.event, "end");
    assert_eq!(end.data["outcome"], "succeeded", "{:?}", end.data);
    assert_eq!(end.data["state"], "done");
    assert_eq!(end.data["run_id"], run.to_string());
    assert_eq!(end.data["sequence"].as_i64(), seqs.last().copied());
    assert!(stream.next().await.is_none(), "the stream ends after `end`");

    // The checker is not blind: a stream with one event taken out is caught.
    let middle = events.len() / 2;
    assert_eq!(events[middle].event, "committed");
    let mut planted = events.clone();
    planted.remove(middle);
    let caught = no_gap(&planted, 0).expect_err("a planted gap is caught");
    assert!(caught.contains("came after"), "{caught}");
    let mut repeated = events.clone();
    repeated.insert(middle, events[middle].clone());
    assert!(no_gap(&repeated, 0).is_err(), "a repeat is caught");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_published_on_the_runs_channel_arrive_as_delta_events_while_it_is_live() {
    let redis = PrivateRedis::start(free_port(), &common::tmp_dir("stream_deltas_redis"));
    let api = Api::start("stream_deltas", &["--redis-url", &redis.url()]).await;
    let token = api.token("watcher", &["read"]);
    let run = idle_run(&api.store).await;
    // The API subscribes before it answers: once the stream is open, deltas reach it.
    let mut stream = Reader::open(&api, run, &token, None).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let deltas =
        rein_accel::stream::Deltas::start(rein_accel::RedisConfig::new(redis.url()), stop.clone());
    let sent = [
        json!({"type": "delta", "content": "Hel"}),
        json!({"type": "delta", "content": "lo"}),
        json!({"type": "tool_call_delta", "name": "refund", "arguments": "{\"amount\":"}),
        json!({"type": "reply_done"}),
    ];
    for d in &sent {
        deltas.send(&run.to_string(), d.to_string());
    }
    let mut seen = Vec::new();
    let mut committed = Vec::new();
    while seen.len() < sent.len() {
        let e = stream.next().await.expect("the stream goes on");
        match e.event.as_str() {
            "delta" => {
                assert!(e.id.is_none(), "a delta has no id: {e:?}");
                seen.push(e.data);
            }
            "committed" => committed.push(e),
            other => panic!("{other} before the run ended: {e:?}"),
        }
    }
    assert_eq!(seen, sent, "each delta as published, in order");
    assert_eq!(no_gap(&committed, 0).unwrap(), vec![1, 2]);
    common::cancel(&api.store, run).await;
    let rest = stream.until_end().await;
    assert_eq!(no_gap(&rest, 2).unwrap().first(), Some(&3));
    let end = rest.last().unwrap();
    assert_eq!(end.data["outcome"], "cancelled", "{:?}", end.data);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_event_id_resumes_after_the_event_it_names_without_repeats() {
    let api = Api::start("stream_resume", &[]).await;
    let token = api.token("watcher", &["read"]);
    let run = idle_run(&api.store).await;
    common::cancel(&api.store, run).await;
    let all = Reader::open(&api, run, &token, None)
        .await
        .until_end()
        .await;
    let seqs = no_gap(&all, 0).unwrap();
    assert!(seqs.len() >= 3, "{seqs:?}");
    let resumed = Reader::open(&api, run, &token, Some("2"))
        .await
        .until_end()
        .await;
    assert_eq!(no_gap(&resumed, 2).unwrap(), seqs[2..].to_vec());
    assert_eq!(resumed.last().unwrap().data, all.last().unwrap().data);
    // `after` does the same for a client that cannot set headers.
    let response = api
        .get(&format!("/v1/runs/{run}/stream?after=2"), Some(&token))
        .send()
        .await
        .unwrap();
    let mut after = Reader {
        response,
        buffer: String::new(),
    };
    assert_eq!(
        no_gap(&after.until_end().await, 2).unwrap(),
        seqs[2..].to_vec()
    );
    for bad in ["x", "-1", "1.5"] {
        let (s, v) = common::json_of(
            api.get(&format!("/v1/runs/{run}/stream"), Some(&token))
                .header("last-event-id", bad)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {v}");
        assert_eq!(common::code(&v), "validation_failed");
    }
    // A negative `after` is refused even when a Last-Event-ID would win over it.
    let (s, v) = common::json_of(
        api.get(&format!("/v1/runs/{run}/stream?after=-1"), Some(&token))
            .header("last-event-id", "2")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_eq!(v["error"]["details"]["field"], "after", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_bound_to_another_queue_may_not_stream_the_run() {
    let api = Api::start("stream_queues", &[]).await;
    let run = idle_run(&api.store).await;
    let elsewhere = common::token_with(&api.url, "other-team", &["read"], &["--queue", "other"]);
    let path = format!("/v1/runs/{run}/stream");
    let (s, v) = api.get_json(&path, &elsewhere).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(common::code(&v), "forbidden");
    assert_eq!(v["error"]["details"]["queue"], "default", "{v}");
    let (s, v) = common::json_of(api.get(&path, None).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    let (s, v) = api
        .get_json(&format!("/v1/runs/{}/stream", Uuid::now_v7()), &elsewhere)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    // The run's own queue may.
    let here = common::token_with(&api.url, "this-team", &["read"], &["--queue", "default"]);
    let mut stream = Reader::open(&api, run, &here, None).await;
    assert_eq!(stream.next().await.unwrap().event, "committed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_max_streams_are_refused_counted_and_ended_when_the_api_stops() {
    let mut api = Api::start("stream_cap", &["--max-streams", "1"]).await;
    let token = api.token("watcher", &["read"]);
    let run = idle_run(&api.store).await;
    let mut held = Reader::open(&api, run, &token, None).await;
    assert_eq!(held.next().await.unwrap().event, "committed");
    let response = api
        .get(&format!("/v1/runs/{run}/stream"), Some(&token))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "1");
    let (_, v) = common::json_of(response).await;
    assert_eq!(common::code(&v), "unavailable");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-streams"),
        "{v}"
    );
    let metrics = api
        .get("/metrics", None)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("# HELP rein_api_streams_refused_total"),
        "{metrics}"
    );
    assert!(
        metrics.contains("rein_api_streams_refused_total 1"),
        "{metrics}"
    );
    assert!(metrics.contains("rein_api_streams_open 1"), "{metrics}");
    // SIGTERM: the open stream ends instead of holding the drain open.
    let code = api.fleet.terminate("api", Duration::from_secs(20));
    assert_eq!(code, Some(0));
    let mut rest = Vec::new();
    while let Some(e) = held.next().await {
        rest.push(e);
    }
    assert!(
        rest.iter().all(|e| e.event == "committed"),
        "no end: the run goes on: {rest:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_stream_outlives_the_connections_idle_timeout() {
    let api = Api::start("stream_idle", &["--idle-timeout-ms", "300"]).await;
    let token = api.token("watcher", &["read"]);
    let run = idle_run(&api.store).await;
    let mut stream = Reader::open(&api, run, &token, None).await;
    assert_eq!(stream.next().await.unwrap().event, "committed");
    assert_eq!(stream.next().await.unwrap().event, "committed");
    // Nothing happens to the run for several idle timeouts: only keep-alives flow.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    common::cancel(&api.store, run).await;
    let rest = stream.until_end().await;
    assert_eq!(rest.last().unwrap().data["outcome"], "cancelled");
}

// ---- the CLI ---------------------------------------------------------------------------------

fn via_db(api: &Api, args: &[&str]) -> Output {
    rein_with(args, &[("DATABASE_URL", &api.url)])
}

fn via_api(api: &Api, token: &str, args: &[&str]) -> Output {
    rein_with(args, &[("REIN_URL", &api.base), ("REIN_TOKEN", token)])
}

/// The lines of a `--json` watch.
fn ndjson(out: &Output) -> Vec<Value> {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_watch_exits_by_how_the_run_ended_on_both_routes() {
    let (api, token) = fleet("stream_watch", &[]).await;
    let ok = enqueue(&api, &token, json!({"sim": {"work_ms": 30}}))
        .await
        .to_string();
    let bad = enqueue(&api, &token, json!({"sim": {"fatal_at_step": 1}}))
        .await
        .to_string();
    for (route, watch) in [
        ("database", via_db(&api, &["runs", "watch", &ok])),
        ("api", via_api(&api, &token, &["runs", "watch", &ok])),
    ] {
        assert_eq!(watch.status.code(), Some(0), "{route}: {}", stderr(&watch));
        let text = stdout(&watch);
        let mut lines = text.lines();
        assert!(
            lines.next().unwrap().trim_start().starts_with("seq"),
            "{route}: {text}"
        );
        assert!(
            text.lines()
                .last()
                .unwrap()
                .contains("ended succeeded in state done"),
            "{route}: {text}"
        );
    }
    for (route, watch) in [
        ("database", via_db(&api, &["runs", "watch", &bad, "--json"])),
        (
            "api",
            via_api(&api, &token, &["runs", "watch", &bad, "--json"]),
        ),
    ] {
        assert_eq!(watch.status.code(), Some(5), "{route}: {}", stderr(&watch));
        let lines = ndjson(&watch);
        let committed: Vec<i64> = lines
            .iter()
            .filter(|l| l["event"] == "committed")
            .map(|l| l["data"]["sequence"].as_i64().unwrap())
            .collect();
        assert_eq!(
            committed,
            (1..=committed.len() as i64).collect::<Vec<_>>(),
            "{route}"
        );
        let end = lines.last().unwrap();
        assert_eq!(end["event"], "end", "{route}");
        assert_eq!(end["data"]["outcome"], "failed", "{route}: {end}");
    }
    // Both routes print the same lines for the same finished run.
    let db = ndjson(&via_db(&api, &["runs", "watch", &bad, "--json"]));
    let through = ndjson(&via_api(&api, &token, &["runs", "watch", &bad, "--json"]));
    assert_eq!(db, through);
    // An unknown run is an input error, as for every command.
    let unknown = Uuid::now_v7().to_string();
    assert_eq!(
        via_db(&api, &["runs", "watch", &unknown]).status.code(),
        Some(1)
    );
    assert_eq!(
        via_api(&api, &token, &["runs", "watch", &unknown])
            .status
            .code(),
        Some(1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_wait_prints_how_the_run_ended_and_exits_by_it() {
    let (api, token) = fleet("stream_wait", &[]).await;
    let args = [
        "enqueue",
        "--definition",
        "lifecycle",
        "--input",
        r#"{"sim": {"work_ms": 20}}"#,
        "--wait",
    ];
    for (route, out) in [
        ("database", via_db(&api, &args)),
        ("api", via_api(&api, &token, &args)),
    ] {
        assert_eq!(out.status.code(), Some(0), "{route}: {}", stderr(&out));
        let text = stdout(&out);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{route}: the id, then the end: {text}");
        let run: Uuid = lines[0].parse().expect("the run id first");
        let row = api.store.run(run).await.unwrap();
        assert_eq!(
            lines[1],
            format!(
                "run {run} ended succeeded in state done at sequence {} ({})",
                row.last_sequence,
                row.terminal_reason.unwrap()
            ),
            "{route}"
        );
    }
    let failing = [
        "enqueue",
        "--definition",
        "lifecycle",
        "--input",
        r#"{"sim": {"fatal_at_step": 1}}"#,
        "--wait",
        "--json",
    ];
    let out = via_api(&api, &token, &failing);
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    let doc: Value = serde_json::from_str(stdout(&out).trim()).expect("one document");
    assert_eq!(doc["end"]["outcome"], "failed", "{doc}");
    assert_eq!(doc["end"]["run_id"], doc["run_id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_gives_up_on_a_run_that_is_still_going_with_its_own_exit_code() {
    let (url, store) = common::fresh_store("stream_timeout").await;
    let mut fleet = Fleet::new(&url, "stream_timeout");
    let base = fleet.spawn_server("api", &["api", "--listen", "127.0.0.1:0"]);
    let token = common::token(&url, "ops", &["admin"]);
    let run = idle_run(&store).await.to_string();
    for (route, out) in [
        (
            "database",
            rein_with(
                &["runs", "watch", &run, "--timeout", "1"],
                &[("DATABASE_URL", &url)],
            ),
        ),
        (
            "api",
            rein_with(
                &["runs", "watch", &run, "--timeout", "1"],
                &[("REIN_URL", &base), ("REIN_TOKEN", &token)],
            ),
        ),
    ] {
        assert_eq!(out.status.code(), Some(6), "{route}: {}", stderr(&out));
        let said = stderr(&out);
        assert!(said.contains("still going"), "{route}: {said}");
        assert!(said.contains("state ACTING"), "{route}: {said}");
        assert_eq!(
            stdout(&out).lines().count(),
            3,
            "{route}: header and two events"
        );
    }
    // enqueue --wait into a queue no worker takes gives up the same way.
    let out = rein_with(
        &[
            "enqueue",
            "--definition",
            "research-agent",
            "--queue",
            "nobody",
            "--wait",
            "--timeout",
            "1",
        ],
        &[("DATABASE_URL", &url)],
    );
    assert_eq!(out.status.code(), Some(6), "{}", stderr(&out));
    assert!(stderr(&out).contains("still going"), "{}", stderr(&out));
    let out = rein_with(
        &["enqueue", "--definition", "x", "--timeout", "1"],
        &[("DATABASE_URL", &url)],
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "--timeout needs --wait: {}",
        stderr(&out)
    );
}

/// `rein runs watch` through the API opens a broken stream again after the last event it
/// read: the API killed and started again on its address, the run ending meanwhile, the watch
/// still prints every event once, in order, and exits by how the run ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_watch_opens_a_broken_stream_again_and_prints_each_event_once() {
    use common::DieWithParent;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    let (url, store) = common::fresh_store("stream_reopen").await;
    let mut fleet = Fleet::new(&url, "stream_reopen");
    let listen = format!("127.0.0.1:{}", free_port());
    let base = fleet.spawn_server("api1", &["api", "--listen", &listen]);
    let token = common::token(&url, "watcher", &["read"]);
    let run = idle_run(&store).await;
    let out_path = fleet.log_dir.join("watch.out");
    let child = Command::new(common::REIN)
        .args([
            "runs",
            "watch",
            &run.to_string(),
            "--json",
            "--timeout",
            "60",
        ])
        .env_remove("DATABASE_URL")
        .env("REIN_URL", &base)
        .env("REIN_TOKEN", &token)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(fleet.log_dir.join("watch.err")).unwrap())
        .process_group(0)
        .die_with_parent()
        .spawn()
        .expect("spawn rein runs watch");
    fleet.procs.push(common::Proc {
        name: "watch".into(),
        child,
    });
    let read = || std::fs::read_to_string(&out_path).unwrap_or_default();
    common::wait_for(
        "the watch to print the run's events so far",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || async { read().lines().count() >= 2 },
    )
    .await;

    fleet.kill("api1");
    common::cancel(&store, run).await;
    fleet.spawn_server("api2", &["api", "--listen", &listen]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = fleet.proc("watch").child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the watch did not end after the API came back: {}",
            read()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let text = read();
    assert_eq!(status.code(), Some(5), "cancelled: {text}");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let committed: Vec<i64> = lines
        .iter()
        .filter(|l| l["event"] == "committed")
        .map(|l| l["data"]["sequence"].as_i64().unwrap())
        .collect();
    let last = store.run(run).await.unwrap().last_sequence;
    assert_eq!(committed, (1..=last).collect::<Vec<_>>(), "{text}");
    assert_eq!(lines.last().unwrap()["event"], "end", "{text}");
}
