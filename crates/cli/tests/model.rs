//! The built-in `model` action against a stand-in OpenAI-compatible server (a model API is an
//! external party, so a fake is allowed; it speaks the published wire format): real
//! PostgreSQL, real `rein worker` and `rein scheduler` processes.

use crate::common;

use std::os::unix::process::CommandExt;
use std::time::Duration;

use common::{Fleet, rein, stderr, stdout, wait_for};
use rein_lab::model_standin::StandIn;
use rein_store::{EnqueueRequest, Store};
use serde_json::{Value, json};
use uuid::Uuid;

const KEY: &str = "sk-test-very-secret-key-0123456789";

/// A stand-in serving on a free port of this test's runtime; its `base_url`.
async fn standin(script: Value) -> (StandIn, String) {
    let standin = StandIn::with_script(&script).expect("a valid script");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(standin.clone().serve(listener));
    (standin, format!("http://{addr}/v1"))
}

fn start(fleet: &mut Fleet, base_url: &str, worker: &str, extra: &[&str]) {
    let mut args = vec![
        "worker",
        "--lease-ttl-ms",
        "1000",
        "--poll-interval-ms",
        "20",
    ];
    args.extend_from_slice(extra);
    let binding = format!("OPENAI_API_KEY={base_url}");
    fleet.spawn_env(
        worker,
        &args,
        &[
            ("REIN_MODEL_URL", base_url),
            ("REIN_MODEL_KEYS", &binding),
            ("OPENAI_API_KEY", KEY),
        ],
    );
}

/// The support agent's document with `base_url` named in its model table.
fn with_base_url(text: String, base_url: &str) -> String {
    text.replacen(
        "model = \"gpt-4o-mini\"",
        &format!("model = \"gpt-4o-mini\"\nbase_url = \"{base_url}\""),
        1,
    )
}

/// Whether any request the stand-in received carried the key.
fn key_reached(standin: &StandIn) -> bool {
    standin
        .authorizations()
        .iter()
        .flatten()
        .any(|a| a.contains(KEY))
}

async fn enqueue(store: &Store, definition: &str, input: Value) -> Uuid {
    let def = store
        .load_definition(definition, None)
        .await
        .unwrap_or_else(|e| panic!("{definition}: {e}"));
    store
        .enqueue(EnqueueRequest::new(def, input))
        .await
        .expect("enqueue")
        .run_id
}

/// The run once it ended, and its log.
async fn finished(store: &Store, run: Uuid) -> (rein_store::RunRow, Vec<rein_store::StoredEvent>) {
    wait_for(
        "the run to end",
        Duration::from_secs(90),
        Duration::from_millis(20),
        || async { store.run(run).await.is_ok_and(|r| r.status == "terminal") },
    )
    .await;
    let row = store.run(run).await.expect("run");
    (row, store.history(run).await.expect("history"))
}

/// Registers a variant of the built-in support agent: `name`, with `edit` applied.
async fn register_variant(store: &Store, name: &str, edit: impl Fn(String) -> String) {
    let text = rein_core::builtin::SUPPORT_AGENT.replacen(
        "name = \"support-agent\"",
        &format!("name = \"{name}\""),
        1,
    );
    let def = rein_core::Definition::parse(
        &edit(text),
        rein_core::Format::Toml,
        &rein_core::GuardRegistry::new(),
    )
    .expect("a valid variant");
    store.register_definition(&def).await.expect("register");
}

fn kinds(history: &[rein_store::StoredEvent]) -> Vec<&str> {
    history.iter().map(|e| e.kind.as_str()).collect()
}

/// The first event of `kind` in the log; the test fails naming the log's kinds without one.
fn first<'a>(history: &'a [rein_store::StoredEvent], kind: &str) -> &'a rein_store::StoredEvent {
    history
        .iter()
        .find(|e| e.kind == kind)
        .unwrap_or_else(|| panic!("no {kind} in {:?}", kinds(history)))
}

async fn applied_effects(store: &Store, run: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM rein_sim_effects WHERE run_id = $1")
        .bind(run)
        .fetch_one(store.pool())
        .await
        .expect("effects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_over_100_waits_for_approval_then_is_applied_once_across_a_worker_kill() {
    let (url, store) = common::fresh_store("model_refund").await;
    let (standin, base_url) = standin(json!([])).await;
    let run = enqueue(
        &store,
        "support-agent",
        json!({"order_id": "A7", "amount": 150}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_refund");
    start(&mut fleet, &base_url, "model-w1", &[]);
    fleet.spawn("model-s1", &["scheduler", "--tick-ms", "50"]);
    wait_for(
        "the run to wait for approval",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || async {
            store
                .run(run)
                .await
                .is_ok_and(|r| r.state == "WAITING_APPROVAL")
        },
    )
    .await;
    fleet.kill("model-w1");
    start(&mut fleet, &base_url, "model-w2", &[]);

    let request = common::open_request(&url, run);
    assert_eq!(request["tool"], "refund");
    assert_eq!(request["args"], json!({"order_id": "A7", "amount": 150}));
    let id = request["approval_id"].as_str().expect("id").to_owned();
    let out = rein(&["approve", &id, "--as", "carol", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let (row, history) = finished(&store, run).await;
    assert_eq!(row.state, "DONE", "{:?}", row.terminal_reason);
    assert_eq!(
        applied_effects(&store, run).await,
        1,
        "the refund is applied once"
    );
    let replies: Vec<&rein_store::StoredEvent> = history
        .iter()
        .filter(|e| e.kind == "MODEL_REPLIED")
        .collect();
    // lookup, refund (asks for approval; the engine runs it once granted), finish: the
    // model is never asked to repeat the approved call.
    assert_eq!(replies.len(), 3, "{:?}", kinds(&history));
    let dispatched = first(&history, "ACTION_DISPATCHED");
    assert_eq!(
        dispatched.payload["approval_id"].as_str(),
        Some(id.as_str())
    );
    assert_eq!(dispatched.payload["tool"], "refund");
    for r in &replies {
        assert_eq!(r.payload["requested_model"], "gpt-4o-mini");
        assert_eq!(r.payload["model"], "gpt-4o-mini-standin-2026-01");
        assert!(
            r.payload["usage"]["tokens"].as_u64().unwrap_or(0) > 0,
            "{}",
            r.payload
        );
        assert!(r.payload["usage"]["cost"].as_f64().unwrap_or(0.0) > 0.0);
        // Every message of the prompt is stored once, by its hash.
        for hash in r.payload["prompt"]["new"].as_array().expect("hashes") {
            let stored: i64 =
                sqlx::query_scalar("SELECT count(*) FROM rein_blobs WHERE sha256 = $1")
                    .bind(hash.as_str().expect("hash"))
                    .fetch_one(store.pool())
                    .await
                    .expect("blobs");
            assert_eq!(stored, 1, "{hash}");
        }
    }
    assert_eq!(
        replies[2].payload["prompt"]["parent"],
        replies[1].payload["prompt"]["sha256"]
    );
    assert_eq!(
        replies[2].payload["reply"]["tool_calls"][0]["function"]["name"],
        "FINISH"
    );
    // The request the stand-in got: tools, decisions, one call, the approved call answered
    // by its own result under its own id, saying who approved it.
    let requests = standin.requests();
    let last = requests.last().expect("requests");
    let names: Vec<&str> = last["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, ["lookup_order", "refund", "FINISH", "GIVE_UP"]);
    assert_eq!(last["tool_choice"], "required");
    assert_eq!(last["parallel_tool_calls"], false);
    let messages = last["messages"].as_array().expect("messages");
    let asked = messages
        .iter()
        .position(|m| m["tool_calls"][0]["function"]["name"] == "refund")
        .expect("the refund call in the conversation");
    let call_id = &messages[asked]["tool_calls"][0]["id"];
    let answer = &messages[asked + 1];
    assert_eq!(answer["role"], "tool");
    assert_eq!(&answer["tool_call_id"], call_id);
    let said = answer["content"].as_str().unwrap_or("");
    assert!(said.contains("carol") && said.contains("result"), "{said}");
    assert!(
        !last["messages"].to_string().contains("again"),
        "{}",
        last["messages"]
    );
    // The key never reaches the log or the worker's output.
    for e in &history {
        assert!(
            !e.payload.to_string().contains(KEY),
            "{}: {}",
            e.kind,
            e.payload
        );
    }
    for name in ["model-w1", "model-w2"] {
        for ext in ["out", "err"] {
            let log = std::fs::read_to_string(fleet.log_dir.join(format!("{name}.{ext}")))
                .unwrap_or_default();
            assert!(!log.contains(KEY), "{name}.{ext} holds the key");
        }
    }
    let report = store.audit().await.expect("audit");
    assert_eq!(report.violations(), 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_answers_garbage_ends_on_the_rejected_decision_path() {
    let (url, store) = common::fresh_store("model_garbage").await;
    let dir = common::tmp_dir("model_garbage");
    let script = dir.join("script.json");
    std::fs::write(
        &script,
        json!([{"raw": "{this is not json"}, {"text": "I would rather chat"}]).to_string(),
    )
    .expect("script");
    let mut fleet = Fleet::new(&url, "model_garbage");
    // The stand-in as its own process, the way the demo runs it.
    let log = std::fs::File::create(dir.join("standin.err")).expect("log");
    let mut child = std::process::Command::new(common::REIN)
        .args(["stand-in-model", "--listen", "127.0.0.1:0", "--script"])
        .arg(&script)
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .process_group(0)
        .spawn()
        .expect("spawn the stand-in");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
        &mut line,
    )
    .expect("its address");
    fleet.procs.push(common::Proc {
        name: "standin".into(),
        child,
    });
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .expect(&line)
        .to_owned();
    let base_url = format!("http://{addr}/v1");
    let first = enqueue(
        &store,
        "support-agent",
        json!({"order_id": "A1", "amount": 5}),
    )
    .await;
    start(&mut fleet, &base_url, "garbage-w1", &[]);
    let (row, history) = finished(&store, first).await;
    assert_eq!(row.state, "FAILED");
    let rejected = history
        .iter()
        .find(|e| e.kind == "DECISION_REJECTED")
        .unwrap_or_else(|| panic!("{:?}", kinds(&history)));
    assert_eq!(rejected.payload["step"], "parse");
    assert!(
        rejected.payload["reason"]
            .as_str()
            .unwrap_or("")
            .contains("not JSON")
    );
    assert!(history.iter().any(|e| e.kind == "DECISION_FAILED"));

    let second = enqueue(
        &store,
        "support-agent",
        json!({"order_id": "A2", "amount": 5}),
    )
    .await;
    let (row, history) = finished(&store, second).await;
    assert_eq!(row.state, "FAILED");
    let rejected = history
        .iter()
        .find(|e| e.kind == "DECISION_REJECTED")
        .expect("rejected");
    assert_eq!(rejected.payload["step"], "parse");
    assert!(
        rejected.payload["reason"]
            .as_str()
            .unwrap_or("")
            .contains("no tool call"),
        "{}",
        rejected.payload
    );
    // The raw reply is kept for a later judge.
    let replied = history
        .iter()
        .find(|e| e.kind == "MODEL_REPLIED")
        .expect("reply");
    assert_eq!(replied.payload["reply"]["content"], "I would rather chat");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_is_waited_out_with_retry_after() {
    let (url, store) = common::fresh_store("model_429").await;
    let (standin, base_url) = standin(json!([
        {"status": 429, "retry_after_s": 1, "repeat": 3},
        {"status": 500},
    ]))
    .await;
    let run = enqueue(
        &store,
        "support-agent",
        json!({"order_id": "A3", "amount": 20}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_429");
    start(&mut fleet, &base_url, "storm-w1", &[]);
    fleet.spawn("storm-s1", &["scheduler", "--tick-ms", "50"]);
    let (row, history) = finished(&store, run).await;
    assert_eq!(row.state, "DONE", "{:?}", row.terminal_reason);
    let failures: Vec<&rein_store::StoredEvent> = history
        .iter()
        .filter(|e| e.kind == "MODEL_RETRYABLE_FAILED")
        .collect();
    assert_eq!(failures.len(), 4, "{:?}", kinds(&history));
    for f in &failures[..3] {
        assert_eq!(f.payload["error"]["kind"], "http_429");
        assert_eq!(f.payload["retry_after_ms"], 1000);
    }
    assert_eq!(failures[3].payload["error"]["kind"], "http_5xx");
    // Each retry came no sooner than the endpoint asked.
    for f in &failures[..3] {
        let due = history
            .iter()
            .find(|e| e.kind == "RETRY_DUE" && e.sequence > f.sequence)
            .expect("a retry");
        let waited = (due.occurred_at - f.occurred_at).num_milliseconds();
        assert!(
            waited >= 1000,
            "retried after {waited} ms, Retry-After said 1000"
        );
    }
    assert_eq!(applied_effects(&store, run).await, 1);
    assert_eq!(standin.requests().len(), 4 + 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_stops_a_chatty_model() {
    let (url, store) = common::fresh_store("model_budget").await;
    register_variant(&store, "chatty-agent", |t| {
        t.replacen(
            "[retry]",
            "[budget]\ntokens = 500\nevent = \"GIVE_UP\"\n\n[retry]",
            1,
        )
    })
    .await;
    let chatty = json!({"tool_call": {"name": "lookup_order", "arguments": {"order_id": "A4"}},
                        "usage": {"prompt_tokens": 200, "completion_tokens": 10}, "repeat": 50});
    let (standin, base_url) = standin(json!([chatty])).await;
    let run = enqueue(
        &store,
        "chatty-agent",
        json!({"order_id": "A4", "amount": 5}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_budget");
    start(&mut fleet, &base_url, "budget-w1", &[]);
    let (row, history) = finished(&store, run).await;
    assert_eq!(row.state, "FAILED");
    let replies = history.iter().filter(|e| e.kind == "MODEL_REPLIED").count();
    assert_eq!(
        replies,
        3,
        "210 tokens a reply against 500: {:?}",
        kinds(&history)
    );
    let last = history.last().expect("events");
    assert_eq!(last.kind, "GIVE_UP");
    assert_eq!(last.payload["budget"], "tokens");
    assert_eq!(standin.requests().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_naming_database_url_as_its_key_is_refused() {
    let dir = common::tmp_dir("model_key_env");
    let file = dir.join("steal.toml");
    std::fs::write(
        &file,
        rein_core::builtin::SUPPORT_AGENT.replace(
            "api_key_env = \"OPENAI_API_KEY\"",
            "api_key_env = \"DATABASE_URL\"",
        ),
    )
    .expect("write");
    let out = rein(&["definitions", "check", file.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let said = format!("{}{}", stdout(&out), stderr(&out));
    assert!(
        said.contains("api_key_env") && said.contains("DATABASE_URL"),
        "{said}"
    );
    // Nor may a worker allow it.
    let (url, _store) = common::fresh_store("model_key_env").await;
    let out = rein(&[
        "worker",
        "--model-key-env",
        "DATABASE_URL",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("DATABASE_URL"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_variable_off_the_allow_list_is_fatal_with_a_reason() {
    let (url, store) = common::fresh_store("model_allow").await;
    register_variant(&store, "own-key-agent", |t| {
        t.replace(
            "api_key_env = \"OPENAI_API_KEY\"",
            "api_key_env = \"TEAM_LLM_KEY\"",
        )
    })
    .await;
    let (standin, base_url) = standin(json!([])).await;
    let run = enqueue(
        &store,
        "own-key-agent",
        json!({"order_id": "A5", "amount": 5}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_allow");
    fleet.spawn_env(
        "allow-w1",
        &["worker", "--poll-interval-ms", "20"],
        &[("REIN_MODEL_URL", &base_url), ("TEAM_LLM_KEY", KEY)],
    );
    let (row, history) = finished(&store, run).await;
    assert_eq!(row.state, "FAILED");
    let failed = history
        .iter()
        .find(|e| e.kind == "MODEL_FATAL_FAILED")
        .expect("fatal");
    let message = failed.payload["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("--model-key-env TEAM_LLM_KEY"),
        "{message}"
    );
    assert!(
        standin.requests().is_empty(),
        "nothing is sent without an allowed key"
    );
}

/// A definition that would send the fleet's key to a server its publisher names is refused
/// at registration: through the API with 422 naming where the key may go, and on the
/// database unless the key is bound there. The server never hears from Rein.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_a_key_for_an_unbound_base_url_is_refused_naming_the_bound_endpoints() {
    let (standin, base_url) = standin(json!([])).await;
    let api = common::Api::start("model_bind_api", &[]).await;
    let publisher = api.token("tenant", &["publish", "read"]);
    let text = with_base_url(
        rein_core::builtin::SUPPORT_AGENT.replacen(
            "name = \"support-agent\"",
            "name = \"steal-agent\"",
            1,
        ),
        &base_url,
    );
    let (status, body) = api.post_toml("/v1/definitions", &publisher, &text).await;
    assert_eq!(status, 422, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("OPENAI_API_KEY may be sent only to https://api.openai.com/v1")
            && message.contains(&base_url),
        "{message}"
    );
    let (status, _) = api
        .get_json("/v1/definitions/steal-agent", &publisher)
        .await;
    assert_eq!(status, 404, "nothing was stored");

    let file = common::tmp_dir("model_bind_api").join("steal.toml");
    std::fs::write(&file, &text).expect("write");
    let file = file.to_str().expect("path");
    let out = rein(&["definitions", "register", file, "--database-url", &api.url]);
    assert_ne!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("https://api.openai.com/v1"),
        "{}",
        stderr(&out)
    );
    let bound = format!("OPENAI_API_KEY={base_url}");
    let out = rein(&[
        "definitions",
        "register",
        file,
        "--model-key",
        &bound,
        "--database-url",
        &api.url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(standin.requests().is_empty());
    assert!(!key_reached(&standin));
}

/// A version stored before keys were bound (as an older release stored it) meets a worker
/// whose key is not bound to its base_url: the call is fatal, `key_not_bound`, and the
/// stand-in never receives the key. `rein definitions check --registered` lists that version
/// beforehand, and the worker reports where its keys may go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_version_whose_key_is_not_bound_fails_fatal_without_sending_the_key() {
    let (url, store) = common::fresh_store("model_unbound").await;
    let (standin, base_url) = standin(json!([])).await;
    register_variant(&store, "steal-agent", |t| with_base_url(t, &base_url)).await;
    let out = rein(&[
        "definitions",
        "check",
        "--registered",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let listed = stdout(&out);
    assert!(
        listed.contains("steal-agent v1") && listed.contains("https://api.openai.com/v1"),
        "{listed}"
    );
    assert!(!listed.contains("support-agent"), "{listed}");
    let bound = format!("OPENAI_API_KEY={base_url}");
    let out = rein(&[
        "definitions",
        "check",
        "--registered",
        "--model-key",
        &bound,
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));

    let run = enqueue(
        &store,
        "steal-agent",
        json!({"order_id": "A11", "amount": 5}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_unbound");
    fleet.spawn_env(
        "unbound-w1",
        &["worker", "--poll-interval-ms", "20"],
        &[("OPENAI_API_KEY", KEY)],
    );
    let (row, history) = finished(&store, run).await;
    assert_eq!(row.state, "FAILED", "{:?}", kinds(&history));
    let failed = first(&history, "MODEL_FATAL_FAILED");
    assert_eq!(failed.payload["error"]["kind"], "key_not_bound");
    let message = failed.payload["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("https://api.openai.com/v1"), "{message}");
    assert!(
        !key_reached(&standin),
        "the key reached an unbound endpoint"
    );
    assert!(standin.requests().is_empty(), "nothing was sent");

    let out = rein(&["workers", "--json", "--database-url", &url]);
    let members: Value = serde_json::from_str(&stdout(&out)).expect("workers as JSON");
    let worker = members
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["worker_id"] == "unbound-w1")
        .unwrap_or_else(|| panic!("{members}"));
    assert_eq!(
        worker["info"]["model_keys"]["OPENAI_API_KEY"],
        json!(["https://api.openai.com/v1"])
    );
    assert!(!stdout(&out).contains(KEY));
    let out = rein(&["workers", "--database-url", &url]);
    assert!(
        stdout(&out).contains("model keys: OPENAI_API_KEY -> https://api.openai.com/v1"),
        "{}",
        stdout(&out)
    );
}

/// A NUL in a reply cannot be stored: the reply is rejected at step `parse` and the run takes
/// its rejected-decision path instead of waiting for an operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_a_model_reply_is_rejected_at_parse() {
    let (url, store) = common::fresh_store("model_nul").await;
    let (_standin, base_url) = standin(json!([
        {"tool_call": {"name": "FINISH", "arguments": {"payload": {"summary": "done\u{0}"}}}},
    ]))
    .await;
    let run = enqueue(
        &store,
        "support-agent",
        json!({"order_id": "A12", "amount": 5}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_nul");
    start(&mut fleet, &base_url, "nul-w1", &[]);
    let (row, history) = finished(&store, run).await;
    assert_eq!(row.state, "FAILED", "{:?}", kinds(&history));
    let rejected = first(&history, "DECISION_REJECTED");
    assert_eq!(rejected.payload["step"], "parse");
    assert!(
        rejected.payload["reason"]
            .as_str()
            .unwrap_or("")
            .contains("NUL"),
        "{}",
        rejected.payload
    );
}

/// A model endpoint whose host name resolves to an address the egress policy refuses (here
/// the worker's own database) is refused for good: fatal, kind `egress_refused`, not retried
/// as a DNS failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_endpoint_refused_by_its_host_name_is_fatal_not_retried() {
    let (url, store) = common::fresh_store("model_egress").await;
    let (db_host, db_port) = store
        .database_address()
        .expect("the test database is on TCP");
    assert_eq!(
        db_host, "127.0.0.1",
        "refused only once `localhost` is resolved"
    );
    let base_url = format!("http://localhost:{db_port}/v1");
    register_variant(&store, "egress-agent", |t| {
        with_base_url(t, &base_url).replace("api_key_env = \"OPENAI_API_KEY\"\n", "")
    })
    .await;
    let run = enqueue(
        &store,
        "egress-agent",
        json!({"order_id": "A13", "amount": 5}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_egress");
    fleet.spawn("egress-w1", &["worker", "--poll-interval-ms", "20"]);
    fleet.spawn("egress-s1", &["scheduler", "--tick-ms", "50"]);
    let (row, history) = finished(&store, run).await;
    assert_eq!(row.state, "FAILED", "{:?}", kinds(&history));
    assert!(
        !history.iter().any(|e| e.kind == "MODEL_RETRYABLE_FAILED"),
        "{:?}",
        kinds(&history)
    );
    let failed = first(&history, "MODEL_FATAL_FAILED");
    assert_eq!(failed.payload["error"]["kind"], "egress_refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_grows_by_about_the_same_bytes_each_model_step() {
    let (url, store) = common::fresh_store("model_linear").await;
    let lookup = json!({"tool_call": {"name": "lookup_order", "arguments": {"order_id": "A6"}},
                        "usage": {"prompt_tokens": 100, "completion_tokens": 10}, "repeat": 9});
    let (_standin, base_url) = standin(json!([
        lookup,
        {"tool_call": {"name": "FINISH", "arguments": {}}, "usage": {"prompt_tokens": 100, "completion_tokens": 10}},
    ]))
    .await;
    let run = enqueue(
        &store,
        "support-agent",
        json!({"order_id": "A6", "amount": 5}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_linear");
    start(&mut fleet, &base_url, "linear-w1", &[]);
    let (row, _) = finished(&store, run).await;
    assert_eq!(row.state, "DONE");
    let sizes: Vec<i32> = sqlx::query_scalar(
        "SELECT octet_length(payload::text) FROM rein_events WHERE run_id = $1 AND type = 'MODEL_REPLIED' ORDER BY sequence",
    )
    .bind(run)
    .fetch_all(store.pool())
    .await
    .expect("sizes");
    assert_eq!(sizes.len(), 10);
    let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
    assert!(
        hi - lo < 120,
        "bytes per step should stay about constant: {sizes:?}"
    );
    let blobs: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_blobs")
        .fetch_one(store.pool())
        .await
        .expect("blobs");
    // system + task, then each later step's reply and result once: 2 + 2 * 9.
    assert!(blobs <= 20, "{blobs} blobs for 10 steps");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_reply_commits_the_final_message_and_publishes_its_deltas() {
    use futures_util::StreamExt;
    let (url, store) = common::fresh_store("model_stream").await;
    register_variant(&store, "streaming-agent", |t| {
        t.replacen("timeout_ms = 30000", "timeout_ms = 30000\nstream = true", 1)
    })
    .await;
    let (_standin, base_url) = standin(json!([
        {"cut_stream": true, "tool_call": {"name": "lookup_order", "arguments": {"order_id": "A8"}}},
        {"text": "Looking it up", "tool_call": {"name": "lookup_order", "arguments": {"order_id": "A8"}}},
    ]))
    .await;
    let dir = common::tmp_dir("model_stream");
    let redis = common::PrivateRedis::start(common::free_port(), &dir);
    let run = enqueue(
        &store,
        "streaming-agent",
        json!({"order_id": "A8", "amount": 5}),
    )
    .await;
    let config = rein_accel::RedisConfig::new(redis.url());
    let deltas = rein_accel::stream::subscribe_run(&config, &run.to_string())
        .await
        .expect("subscribe");
    let mut fleet = Fleet::new(&url, "model_stream");
    start(
        &mut fleet,
        &base_url,
        "stream-w1",
        &["--redis-url", &redis.url()],
    );
    fleet.spawn("stream-s1", &["scheduler", "--tick-ms", "50"]);
    let (row, history) = finished(&store, run).await;
    assert_eq!(row.state, "DONE", "{:?}", row.terminal_reason);
    let cut = history
        .iter()
        .find(|e| e.kind == "MODEL_RETRYABLE_FAILED")
        .unwrap_or_else(|| panic!("{:?}", kinds(&history)));
    assert_eq!(cut.payload["error"]["kind"], "stream_cut");
    let replied = history
        .iter()
        .find(|e| e.kind == "MODEL_REPLIED")
        .expect("reply");
    assert_eq!(replied.payload["reply"]["content"], "Looking it up");
    assert_eq!(
        replied.payload["reply"]["tool_calls"][0]["function"]["arguments"],
        r#"{"order_id":"A8"}"#
    );
    let got: Vec<Value> = tokio::time::timeout(
        Duration::from_secs(30),
        deltas
            .map(|d| serde_json::from_str::<Value>(&d).unwrap_or(Value::Null))
            .take_while(|d| {
                let done = d["type"] == "reply_done";
                async move { !done }
            })
            .collect::<Vec<_>>(),
    )
    .await
    .expect("deltas up to reply_done");
    let text: String = got
        .iter()
        .filter(|d| d["type"] == "delta")
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert!(text.contains("Looking it up"), "{got:?}");
    let arguments: String = got
        .iter()
        .filter(|d| d["type"] == "tool_call_delta")
        .filter_map(|d| d["arguments"].as_str())
        .collect();
    assert!(arguments.contains(r#"{"order_id":"A8"}"#), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fatal_replies_end_the_run_with_what_to_fix() {
    let (url, store) = common::fresh_store("model_fatal").await;
    let (standin, base_url) = standin(json!([
        {"status": 401},
        {"status": 400, "code": "context_length_exceeded"},
    ]))
    .await;
    let mut fleet = Fleet::new(&url, "model_fatal");
    start(&mut fleet, &base_url, "fatal-w1", &[]);
    for (order, kind, says) in [
        ("A9", "unauthorized", "unauthorized: check OPENAI_API_KEY"),
        (
            "A10",
            "context_length_exceeded",
            "context_length_exceeded: the conversation is longer",
        ),
    ] {
        let run = enqueue(
            &store,
            "support-agent",
            json!({"order_id": order, "amount": 5}),
        )
        .await;
        let (row, history) = finished(&store, run).await;
        assert_eq!(row.state, "FAILED");
        let failed = history
            .iter()
            .find(|e| e.kind == "MODEL_FATAL_FAILED")
            .unwrap_or_else(|| panic!("{:?}", kinds(&history)));
        assert_eq!(failed.payload["error"]["kind"], kind);
        let message = failed.payload["error"]["message"].as_str().unwrap_or("");
        assert!(message.starts_with(says), "{message}");
        // The endpoint's error is described (its type or code, its size), never quoted.
        assert!(!message.contains("scripted failure"), "{message}");
        assert!(message.contains("a body of"), "{message}");
        assert!(
            !history.iter().any(|e| e.kind == "RETRY_DUE"),
            "a fatal failure is not retried"
        );
    }
    // The key went to the endpoint as a bearer token, never into a request body.
    assert_eq!(standin.requests().len(), 2);
    assert!(!standin.requests()[0].to_string().contains(KEY));
    assert_eq!(standin.authorizations()[0], Some(format!("Bearer {KEY}")));
}

/// Tokens the replies in `replies` (time µs, tokens) used beyond what a `tpm` limit allows
/// by any moment: a quiet key holds a minute's tokens, and refills at `tpm` a minute. `slack`
/// is one booking: a reply's usage is settled only after it arrived. The largest excess,
/// in tokens (0: the limit held).
fn tpm_excess(replies: &[(i64, u64)], tpm: u64, slack: u64) -> i64 {
    let mut sorted = replies.to_vec();
    sorted.sort_unstable();
    let Some(&(t0, _)) = sorted.first() else {
        return 0;
    };
    let mut used = 0u64;
    let mut worst = 0i64;
    for (t, tokens) in sorted {
        used += tokens;
        let allowed = tpm as f64 + tpm as f64 * (t - t0) as f64 / 60e6 + slack as f64;
        worst = worst.max(used as i64 - allowed as i64);
    }
    worst
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tpm_limit_holds_across_two_worker_processes() {
    let dir = common::tmp_dir("model-tpm");
    let redis = common::PrivateRedis::start(common::free_port(), &dir);
    let redis_url = redis.url();
    let (url, store) = common::fresh_store("model_tpm").await;
    let (_standin, base_url) = standin(json!([])).await;
    // 6000 tokens a minute (100 a second) for the model the support agent calls; each call
    // books its max_tokens (512) and is corrected by the reply's usage.
    let tpm = 6000u64;
    let limit = format!("model:gpt-4o-mini=tpm={tpm}");
    let mut fleet = Fleet::new(&url, "model-tpm");
    // Each worker holds at most half of the 16 runs, so both call the model: with the
    // default 32, whichever worker claimed first took all 16 runs enqueued while the two
    // were starting, and the limit was never shared.
    for worker in ["w1", "w2"] {
        start(
            &mut fleet,
            &base_url,
            worker,
            &[
                "--concurrency",
                "8",
                "--limit",
                &limit,
                "--limit-wait-max-ms",
                "300",
                "--redis-url",
                &redis_url,
                "--redis-prefix",
                "tpm",
            ],
        );
    }
    fleet.spawn(
        "s1",
        &["scheduler", "--tick-ms", "50", "--db-pool-max", "2"],
    );

    let mut runs = Vec::new();
    for i in 0..16 {
        let input = json!({ "order_id": format!("T-{i}"), "amount": 20 });
        runs.push(enqueue(&store, "support-agent", input).await);
    }
    let mut replies = Vec::new();
    let mut by_worker = std::collections::BTreeMap::<String, usize>::new();
    for run in &runs {
        let (row, history) = finished(&store, *run).await;
        assert_eq!(row.state, "DONE", "{:?}", kinds(&history));
        for e in history.iter().filter(|e| e.kind == "MODEL_REPLIED") {
            let tokens = e.payload["usage"]["tokens"].as_u64().expect("usage");
            replies.push((e.occurred_at.timestamp_micros(), tokens));
            *by_worker.entry(e.worker.clone()).or_default() += 1;
        }
    }
    let deferred: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM rein_events WHERE type = 'ACTION_DEFERRED' AND payload->>'limit' = 'tpm'",
    )
    .fetch_one(store.pool())
    .await
    .expect("deferrals");
    let total: u64 = replies.iter().map(|r| r.1).sum();
    let (first, last) = (
        replies.iter().map(|r| r.0).min().unwrap_or(0),
        replies.iter().map(|r| r.0).max().unwrap_or(0),
    );
    let span_s = (last - first) as f64 / 1e6;
    println!(
        "tpm {tpm}: {} replies, {total} tokens in {span_s:.1} s, {deferred} tpm deferrals, by worker {by_worker:?}",
        replies.len()
    );
    assert_eq!(replies.len(), 16 * 3, "three model calls a run");
    assert!(
        total > tpm,
        "the workload must outgrow a minute's bucket: {total}"
    );
    assert_eq!(
        tpm_excess(&replies, tpm, 512),
        0,
        "the fleet used more than tpm allows"
    );
    assert!(deferred > 0, "calls beyond the bucket wait for it");
    assert!(
        by_worker.len() == 2,
        "both workers called the model: {by_worker:?}"
    );
    // Throttled, not stalled: what exceeds the bucket comes at about tpm a minute.
    let at_least = (total - tpm) as f64 / (tpm as f64 / 60.0);
    assert!(
        span_s >= at_least * 0.8,
        "too fast for the limit: {span_s} s < {at_least} s"
    );

    // The checker catches a fleet whose workers each keep their own bucket: twice the
    // tokens in the same time.
    let doubled: Vec<(i64, u64)> = replies.iter().chain(replies.iter()).copied().collect();
    assert!(tpm_excess(&doubled, tpm, 512) > 0);
    drop(fleet);
    drop(redis);
}

/// The support agent's document with its model table's `tool_choice` set to `value`.
fn with_tool_choice(text: String, value: &str) -> String {
    text.replacen(
        "model = \"gpt-4o-mini\"",
        &format!("model = \"gpt-4o-mini\"\ntool_choice = \"{value}\""),
        1,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_auto_completes_against_a_server_that_refuses_required() {
    let (url, store) = common::fresh_store("model_tool_choice").await;
    // Like llama-cpp-python's server: 500 to `"tool_choice": "required"`.
    let (standin, base_url) = standin(json!([])).await;
    standin.refuse_tool_choice_required();
    register_variant(&store, "support-agent-auto", |t| {
        with_tool_choice(t, "auto")
    })
    .await;
    let auto = enqueue(
        &store,
        "support-agent-auto",
        json!({"order_id": "A21", "amount": 5}),
    )
    .await;
    let required = enqueue(
        &store,
        "support-agent",
        json!({"order_id": "A22", "amount": 5}),
    )
    .await;
    let mut fleet = Fleet::new(&url, "model_tool_choice");
    start(&mut fleet, &base_url, "choice-w1", &[]);

    let (row, history) = finished(&store, auto).await;
    assert_eq!(
        row.state,
        "DONE",
        "{:?} {:?}",
        row.terminal_reason,
        kinds(&history)
    );
    assert_eq!(applied_effects(&store, auto).await, 1);
    assert!(
        !history.iter().any(|e| e.kind == "MODEL_RETRYABLE_FAILED"),
        "{:?}",
        kinds(&history)
    );

    // The default `required` fails as the server answers: a 5xx, retried.
    wait_for(
        "the default run's model call to fail",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || async {
            store.history(required).await.is_ok_and(|h| {
                h.iter().any(|e| {
                    e.kind == "MODEL_RETRYABLE_FAILED" && e.payload["error"]["kind"] == "http_5xx"
                })
            })
        },
    )
    .await;
    let choices: Vec<Value> = standin
        .requests()
        .iter()
        .map(|r| r["tool_choice"].clone())
        .collect();
    assert!(choices.contains(&json!("auto")), "{choices:?}");
    assert!(choices.contains(&json!("required")), "{choices:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_setting_tool_choice_gets_runs_of_the_newer_protocol() {
    let (_url, store) = common::fresh_store("model_tool_choice_protocol").await;
    register_variant(&store, "support-agent-auto", |t| {
        with_tool_choice(t, "auto")
    })
    .await;
    // Spelled out, the default needs nothing new.
    register_variant(&store, "support-agent-required", |t| {
        with_tool_choice(t, "required")
    })
    .await;
    let mut runs = Vec::new();
    for name in [
        "support-agent",
        "support-agent-required",
        "support-agent-auto",
    ] {
        runs.push(enqueue(&store, name, json!({"order_id": "A23", "amount": 5})).await);
    }
    let mut protocols = Vec::new();
    for run in &runs {
        protocols.push(
            sqlx::query_scalar::<_, i16>("SELECT protocol FROM rein_runs WHERE run_id = $1")
                .bind(run)
                .fetch_one(store.pool())
                .await
                .expect("protocol"),
        );
    }
    assert_eq!(protocols, [1, 1, rein_store::PROTOCOL_TOOL_CHOICE]);
    const { assert!(rein_store::PROTOCOL_TOOL_CHOICE > rein_store::PROTOCOL_MOVES) };

    // A worker of the release before (it reads up to PROTOCOL_MOVES) claims the others only.
    let old_claim = sqlx::query(include_str!("../../store/queries/claim.sql"))
        .bind("w-old-release")
        .bind(10_i64)
        .bind(vec!["default".to_owned()])
        .bind(60_000_i64)
        .bind(0_i64)
        .bind(rein_store::PROTOCOL_MOVES)
        .fetch_all(store.pool())
        .await
        .expect("the older claim");
    let mut expected = vec![runs[0], runs[1]];
    let mut got: Vec<Uuid> = old_claim
        .iter()
        .map(|row| sqlx::Row::get(row, "run_id"))
        .collect();
    expected.sort();
    got.sort();
    assert_eq!(
        got, expected,
        "an older worker never claims the tool_choice run"
    );
    let claimed = store
        .claim("w-new", 10, 60_000, &["default".to_owned()])
        .await
        .expect("claim");
    let ids: Vec<Uuid> = claimed.iter().map(|c| c.run_id).collect();
    assert_eq!(ids, vec![runs[2]], "this release does");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_without_a_budget_shows_its_tokens_and_cost_in_the_cli_and_the_api() {
    let api = common::Api::start("model_usage", &[]).await;
    let store = &api.store;
    let (_standin, base_url) = standin(json!([])).await;
    let run = enqueue(
        store,
        "support-agent",
        json!({"order_id": "A31", "amount": 5}),
    )
    .await;
    let mut fleet = Fleet::new(&api.url, "model_usage");
    start(&mut fleet, &base_url, "usage-w1", &[]);
    let (row, history) = finished(store, run).await;
    assert_eq!(row.state, "DONE", "{:?}", kinds(&history));
    let def = store.load_definition("support-agent", None).await.unwrap();
    assert!(
        def.budget().is_none(),
        "the shipped agent declares no budget"
    );

    // What the log says the calls used: the figures every view must show.
    let replies: Vec<&Value> = history
        .iter()
        .filter(|e| e.kind == "MODEL_REPLIED")
        .map(|e| &e.payload["usage"])
        .collect();
    assert!(replies.len() >= 2, "{:?}", kinds(&history));
    let sum = |k: &str| replies.iter().map(|u| u[k].as_u64().unwrap()).sum::<u64>();
    let (input, output) = (sum("input_tokens"), sum("output_tokens"));
    let cost: f64 = replies.iter().map(|u| u["cost"].as_f64().unwrap()).sum();
    assert!(input > 0 && output > 0 && cost > 0.0);

    let stored = store.run_usage(run).await.unwrap();
    assert_eq!(stored.len(), 1, "{stored:?}");
    let m = &stored[0];
    assert_eq!(m.model, "gpt-4o-mini");
    assert_eq!(
        (m.calls, m.input_tokens, m.output_tokens),
        (replies.len() as u64, input, output)
    );
    assert_eq!(
        m.reasoning_tokens, None,
        "the stand-in reports none: null, not 0"
    );
    assert!((m.cost.unwrap() - cost).abs() < 1e-12);

    // The CLI, straight from the database.
    let show = rein(&["runs", "show", &run.to_string(), "--database-url", &api.url]);
    let text = stdout(&show);
    assert!(show.status.success(), "{}", stderr(&show));
    let line = format!(
        "usage       {} calls, {input} input + {output} output tokens",
        replies.len()
    );
    assert!(text.contains(&line), "{text}");
    assert!(text.contains(", cost 0.0"), "{text}");
    let by_model = rein(&[
        "runs",
        "usage",
        &run.to_string(),
        "--json",
        "--database-url",
        &api.url,
    ]);
    assert!(by_model.status.success(), "{}", stderr(&by_model));
    let by_model: Value = serde_json::from_str(&stdout(&by_model)).unwrap();
    assert_eq!(by_model["models"][0]["model"], "gpt-4o-mini");
    assert_eq!(by_model["models"][0]["input_tokens"], input);
    assert_eq!(by_model["total"]["output_tokens"], output);
    assert_eq!(by_model["total"]["reasoning_tokens"], Value::Null);

    // The API: the run view, the list and the route by model say the same.
    let token = api.token("reader", &["read"]);
    let (status, view) = api.get_json(&format!("/v1/runs/{run}"), &token).await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["usage"]["calls"], replies.len());
    assert_eq!(view["usage"]["input_tokens"], input);
    assert!((view["usage"]["cost"].as_f64().unwrap() - cost).abs() < 1e-12);
    let (status, list) = api.get_json("/v1/runs", &token).await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list[0]["usage"], view["usage"], "{list}");
    let (status, usage) = api.get_json(&format!("/v1/runs/{run}/usage"), &token).await;
    assert_eq!(status, 200, "{usage}");
    assert_eq!(usage, by_model);
    let (status, missing) = api
        .get_json(&format!("/v1/runs/{}/usage", Uuid::now_v7()), &token)
        .await;
    assert_eq!(status, 404, "{missing}");

    let list = rein(&["runs", "list", "--database-url", &api.url]);
    let row = stdout(&list)
        .lines()
        .find(|l| l.starts_with(&run.to_string()))
        .map(str::to_owned)
        .unwrap_or_default();
    assert!(
        row.trim_end().ends_with(&(input + output).to_string()),
        "{row}"
    );

    // The CLI through the API prints what it prints from the database.
    let remote = common::rein_with(
        &["runs", "show", &run.to_string()],
        &[("REIN_URL", &api.base), ("REIN_TOKEN", &token)],
    );
    assert!(
        stdout(&remote).contains(&line),
        "{}{}",
        stdout(&remote),
        stderr(&remote)
    );

    // A run with no model call says so, in every view.
    fleet.kill("usage-w1");
    let quiet = enqueue(
        store,
        "support-agent",
        json!({"order_id": "A32", "amount": 5}),
    )
    .await;
    let (_, view) = api.get_json(&format!("/v1/runs/{quiet}"), &token).await;
    assert_eq!(view["usage"], Value::Null, "{view}");
    let show = rein(&[
        "runs",
        "show",
        &quiet.to_string(),
        "--database-url",
        &api.url,
    ]);
    assert!(
        stdout(&show).contains("usage       no model calls"),
        "{}",
        stdout(&show)
    );

    // `verify` recomputes the sums from the log: a changed row is caught.
    let ok = rein(&[
        "runs",
        "verify",
        &run.to_string(),
        "--database-url",
        &api.url,
    ]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    sqlx::query("UPDATE rein_run_usage SET output_tokens = output_tokens + 1 WHERE run_id = $1")
        .bind(run)
        .execute(store.pool())
        .await
        .unwrap();
    let caught = rein(&[
        "runs",
        "verify",
        &run.to_string(),
        "--database-url",
        &api.url,
    ]);
    assert!(!caught.status.success());
    assert!(
        stderr(&caught).contains("usage table"),
        "{}",
        stderr(&caught)
    );
}
