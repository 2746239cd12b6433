//! Who may change what runs (SPEC Z4, H1) against a real `rein api`: publishing a definition
//! needs its own scope and records who did it; each name has a current version that runs
//! enqueued without a version start with; built-in names are not shadowed by accident; a run
//! records who enqueued it, and that person may be kept from granting its approvals; the API
//! compiles a definition once, not on every request that loads it.

use crate::common;

use std::time::{Duration, Instant};

use common::{Api, GREETER_TOML, GREETER_YAML, code, rein_with, stderr, stdout};
use rein_core::builtin;
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

/// refund-agent at the next version, its refunds needing no approval.
fn refund_without_approval() -> (u32, String) {
    let version = builtin::refund_agent().version() + 1;
    let text = builtin::source_at_version("refund-agent", version)
        .unwrap()
        .replace("approval = \"args.amount > 100\"", "approval = \"never\"");
    assert!(text.contains("approval = \"never\""));
    (version, text)
}

/// `chain4` renamed to `name` at `version`, as TOML.
fn own(name: &str, version: u32) -> String {
    builtin::source_at_version("chain4", version)
        .unwrap()
        .replacen("name = \"chain4\"", &format!("name = \"{name}\""), 1)
}

/// The version of a run enqueued through the API without naming one.
async fn enqueued_version(api: &Api, token: &str, definition: &str) -> u64 {
    let (s, v) = api
        .post_json("/v1/runs", token, &json!({ "definition": definition }))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, run) = api
        .get_json(
            &format!("/v1/runs/{}", v["run_id"].as_str().unwrap()),
            token,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{run}");
    run["version"].as_u64().unwrap()
}

fn listed<'a>(list: &'a Value, name: &str, version: u32) -> &'a Value {
    list.as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == name && d["version"] == version)
        .unwrap_or_else(|| panic!("{name} v{version} is listed: {list}"))
}

/// The reproduction: an operate token registered refund-agent v3 with `approval = "never"`
/// and the next ordinary enqueue ran it. Now registering needs `publish`, a built-in name
/// takes another version only from an admin who says so, and even then the runs enqueued
/// without a version keep the current one until it is moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operate_token_cannot_replace_a_definition_for_everyone() {
    let api = Api::start("publish_repro", &[]).await;
    let operator = api.token("ops", &["operate", "enqueue", "read"]);
    let publisher = api.token("release-bot", &["publish", "read"]);
    let admin = api.token("platform-admin", &["admin"]);
    let shipped = builtin::refund_agent().version();
    let (version, text) = refund_without_approval();

    let (s, v) = api.post_toml("/v1/definitions", &operator, &text).await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(v["error"]["details"]["required_scope"], "publish");

    let (s, v) = api.post_toml("/v1/definitions", &publisher, &text).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "conflict"), "{v}");
    assert_eq!(v["error"]["details"]["builtin_version"], shipped);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("allow_builtin"),
        "{v}"
    );
    let (s, v) = api
        .post_toml("/v1/definitions?allow_builtin=true", &publisher, &text)
        .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(v["error"]["details"]["required_scope"], "admin");
    // Nothing was stored.
    assert!(
        api.store
            .load_definition("refund-agent", Some(version))
            .await
            .is_err()
    );

    let (s, v) = api
        .post_toml("/v1/definitions?allow_builtin=true", &admin, &text)
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["current_version"], shipped, "{v}");
    assert_eq!(
        enqueued_version(&api, &operator, "refund-agent").await,
        u64::from(shipped)
    );
    let (_, list) = api.get_json("/v1/definitions", &operator).await;
    let stored = listed(&list, "refund-agent", version);
    assert_eq!(
        (&stored["registered_by"], &stored["current"]),
        (&json!("platform-admin"), &json!(false))
    );
    let current = listed(&list, "refund-agent", shipped);
    assert_eq!(
        (&current["registered_by"], &current["current"]),
        (&json!("rein"), &json!(true))
    );

    // Moving the pointer: publish, and for a built-in name's other version, admin saying so.
    let path = "/v1/definitions/refund-agent/current";
    let to_new = json!({ "version": version });
    let (s, v) = api.post_json(path, &operator, &to_new).await;
    assert_eq!(
        (s, &v["error"]["details"]["required_scope"]),
        (StatusCode::FORBIDDEN, &json!("publish"))
    );
    for token in [&publisher, &admin] {
        let (s, v) = api.post_json(path, token, &to_new).await;
        assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "conflict"), "{v}");
    }
    let with_flag = json!({ "version": version, "allow_builtin": true });
    let (s, v) = api.post_json(path, &publisher, &with_flag).await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    let (s, v) = api.post_json(path, &admin, &with_flag).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v,
        json!({ "name": "refund-agent", "version": version, "previous": shipped })
    );
    assert_eq!(
        enqueued_version(&api, &operator, "refund-agent").await,
        u64::from(version)
    );
    // Back to the shipped version: publish is enough.
    let (s, v) = api
        .post_json(path, &publisher, &json!({ "version": shipped }))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        enqueued_version(&api, &operator, "refund-agent").await,
        u64::from(shipped)
    );
    let (s, v) = api
        .post_json(path, &publisher, &json!({ "version": 99 }))
        .await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "conflict"), "{v}");
    let (s, v) = api
        .post_json(
            "/v1/definitions/no-such/current",
            &publisher,
            &json!({ "version": 1 }),
        )
        .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    let (s, v) = api.post_json(path, &publisher, &json!({})).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_publishes_as_its_caller_and_moves_the_current_version_when_asked() {
    let api = Api::start("publish_cli", &[]).await;
    let publisher = api.token("release-bot", &["publish", "read"]);
    let operator = api.token("ops", &["operate", "read"]);
    let dir = common::tmp_dir("publish_cli");
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let (v1, v2, v3) = (
        file("triage-1.toml", &own("triage", 1)),
        file("triage-2.toml", &own("triage", 2)),
        file("triage-3.toml", &own("triage", 3)),
    );
    let through_api = |token: &str, args: &[&str]| {
        rein_with(args, &[("REIN_URL", &api.base), ("REIN_TOKEN", token)])
    };
    let on_db = |args: &[&str]| rein_with(args, &[("DATABASE_URL", &api.url)]);
    let ok = |out: &std::process::Output| {
        assert_eq!(out.status.code(), Some(0), "{}", stderr(out));
        stdout(out)
    };

    let text = ok(&through_api(&publisher, &["definitions", "register", &v1]));
    assert!(text.contains("registered triage v1"), "{text}");
    assert!(text.contains("triage v1 is current"), "{text}");
    let done: Value = serde_json::from_str(&ok(&through_api(
        &publisher,
        &["definitions", "register", &v2, "--json"],
    )))
    .unwrap();
    assert_eq!(
        done,
        json!({"name": "triage", "version": 2, "created": true, "current_version": 1})
    );
    let text = ok(&through_api(&publisher, &["definitions", "register", &v2]));
    assert!(text.contains("v1 stays current"), "{text}");
    assert!(text.contains("rein definitions current triage 2"), "{text}");

    let text = ok(&through_api(
        &publisher,
        &["definitions", "list", "--registered"],
    ));
    assert!(
        text.contains("triage\tv1\tcurrent\trelease-bot\t"),
        "{text}"
    );
    assert!(text.contains("triage\tv2\t-\trelease-bot\t"), "{text}");

    let text = ok(&through_api(
        &publisher,
        &["definitions", "current", "triage", "2"],
    ));
    assert!(text.contains("triage v2 is current (was v1)"), "{text}");
    let (s, view) = api.get_json("/v1/definitions/triage", &publisher).await;
    assert_eq!(s, StatusCode::OK, "{view}");
    assert_eq!(
        (&view["version"], &view["current"], &view["registered_by"]),
        (&json!(2), &json!(true), &json!("release-bot"))
    );
    let out = through_api(
        &publisher,
        &["definitions", "show", "triage", "--format", "json"],
    );
    assert!(
        stderr(&out).contains("triage v2 (current), registered by release-bot"),
        "{}",
        stderr(&out)
    );

    // On the database the CLI is the operator, named by --as.
    let done: Value = serde_json::from_str(&ok(&on_db(&[
        "definitions",
        "register",
        &v3,
        "--make-current",
        "--as",
        "carol",
        "--json",
    ])))
    .unwrap();
    assert_eq!(done["current_version"], 3, "{done}");
    let (_, view) = api.get_json("/v1/definitions/triage", &publisher).await;
    assert_eq!(
        (&view["version"], &view["registered_by"]),
        (&json!(3), &json!("carol"))
    );

    // An operate token may not publish; a built-in name needs --allow-builtin on the
    // database too.
    let out = through_api(&operator, &["definitions", "register", &v3]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(stderr(&out).contains("publish"), "{}", stderr(&out));
    let (_, refund) = refund_without_approval();
    let refund = file("refund-agent.toml", &refund);
    let out = on_db(&["definitions", "register", &refund]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--allow-builtin"), "{}", stderr(&out));
    let text = ok(&on_db(&[
        "definitions",
        "register",
        &refund,
        "--allow-builtin",
    ]));
    assert!(text.contains("stays current"), "{text}");
}

/// A research-agent run enqueued through the API by `token`, parked in WAITING_APPROVAL
/// with an open request.
async fn waiting_approval(api: &Api, token: &str) -> (Uuid, Uuid) {
    let (s, v) = api
        .post_json("/v1/runs", token, &json!({"definition": "research-agent"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let run: Uuid = v["run_id"].as_str().unwrap().parse().unwrap();
    common::as_the_engine(
        &api.store,
        run,
        &["TASK_ACCEPTED", "PLAN_READY", "APPROVAL_REQUIRED"],
    )
    .await;
    let approval = common::ask_refund_approval(
        &api.store,
        run,
        json!({"order_id": "A7", "amount": 900}),
        "h-sod",
    )
    .await;
    (run, approval)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_enqueuer_is_recorded_and_may_not_grant_where_duties_are_separated() {
    let api = Api::start("publish_sod", &["--approver-may-not-be-enqueuer"]).await;
    let alice = api.token("alice", &["enqueue", "approve", "operate", "read"]);
    let bob = api.token("bob", &["approve", "read"]);
    let (run, approval) = waiting_approval(&api, &alice).await;

    let (s, view) = api.get_json(&format!("/v1/runs/{run}"), &bob).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(view["enqueued_by"], "alice", "{view}");
    let out = rein_with(
        &["runs", "show", &run.to_string()],
        &[("DATABASE_URL", &api.url)],
    );
    assert!(
        stdout(&out).contains("enqueued by alice"),
        "{}",
        stdout(&out)
    );

    let grant = format!("/v1/approvals/{approval}/grant");
    let (s, v) = api.post_json(&grant, &alice, &json!({})).await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(
        v["error"]["details"]["policy"], "approver_may_not_be_enqueuer",
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("another person"),
        "{v}"
    );
    // Nor by sending the approval event.
    let (s, v) = api
        .post_json(
            &format!("/v1/runs/{run}/events"),
            &alice,
            &json!({"type": "APPROVED"}),
        )
        .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(api.store.run(run).await.unwrap().state, "WAITING_APPROVAL");
    assert_eq!(
        api.store.approval(approval).await.unwrap().status,
        "pending"
    );

    let (s, v) = api.post_json(&grant, &bob, &json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["decided_by"], "bob");
}

/// A definition of about 1 MB with 4,080 guarded transitions, as JSON.
fn wide(name: &str) -> Value {
    let events: Vec<String> = (0..510)
        .map(|i| format!("e{i}"))
        .chain(["finish".to_owned()])
        .collect();
    let pad = "x".repeat(100);
    let mut transitions: Vec<Value> = (0..510)
        .flat_map(|i| {
            let pad = pad.clone();
            (0..8).map(move |p| {
                json!({
                    "from": "start", "event": format!("e{i}"), "to": "work", "priority": p,
                    "guard": format!("run.data.amount > {p} && run.data.region == \"r{i}-{pad}\""),
                })
            })
        })
        .collect();
    transitions.push(json!({"from": "work", "event": "finish", "to": "done"}));
    json!({
        "name": name, "version": 1, "cancel_state": "cancelled", "events": events,
        "states": [
            {"name": "start", "kind": "active", "initial": true},
            {"name": "work", "kind": "active"},
            {"name": "done", "kind": "terminal"},
            {"name": "cancelled", "kind": "terminal"},
        ],
        "transitions": transitions,
    })
}

/// The value of an unlabelled counter in Prometheus text; 0 when it is absent.
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Every request that loads a definition used to compile it again (0.6-0.8 s of CPU for a
/// 1 MB definition). The API now compiles it once and answers the rest from its copy; the
/// figures are printed, not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_compiles_a_definition_once_not_on_every_request_that_loads_it() {
    let api = Api::start("publish_cache", &[]).await;
    let token = api.token("reader", &["read", "enqueue"]);
    let doc = wide("wide");
    let bytes = doc.to_string().len();
    assert!(bytes <= rein_core::limits::DEFINITION_BYTES_MAX, "{bytes}");
    let def = rein_core::Definition::parse(
        &doc.to_string(),
        rein_core::Format::Json,
        &rein_core::GuardRegistry::new(),
    )
    .expect("valid");
    // Registered by another process: the API has compiled nothing of it.
    api.store.register_definition(&def).await.unwrap();

    let mut took = Vec::new();
    for i in 0..8 {
        let started = Instant::now();
        let (s, v) = if i % 2 == 0 {
            api.get_json("/v1/definitions/wide", &token).await
        } else {
            api.post_json("/v1/runs", &token, &json!({"definition": "wide"}))
                .await
        };
        took.push(started.elapsed());
        assert!(s.is_success(), "{s}: {v}");
    }
    let metrics = reqwest::get(format!("{}/metrics", api.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        counter(&metrics, "rein_definitions_compiled_total"),
        1.0,
        "{metrics}"
    );
    let rest: Duration = took[1..].iter().sum::<Duration>() / (took.len() as u32 - 1);
    println!(
        "definition of {bytes} bytes with {} transitions: first request {:?} (compiles), \
         the next {} on average {:?}",
        def.transitions().len(),
        took[0],
        took.len() - 1,
        rest
    );
}

/// 20 KB of YAML whose aliases would unfold into 10^8 strings (which aborted the API on
/// allocation) is refused with 422 naming where the anchor is, and the API keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_yaml_alias_bomb_is_refused_and_the_api_keeps_answering() {
    let api = Api::start("publish_yaml_bomb", &[]).await;
    let publisher = api.token("release-bot", &["publish", "read"]);
    let mut bomb = format!("name: bomb\nl0: &l0 [{}]\n", vec!["x"; 10_000].join(","));
    for level in 1..=4 {
        let aliases = vec![format!("*l{}", level - 1); 10].join(",");
        bomb.push_str(&format!("l{level}: &l{level} [{aliases}]\n"));
    }
    assert!(bomb.len() < 21_000, "{} bytes", bomb.len());
    let reply = api
        .post("/v1/definitions", &publisher)
        .header("content-type", "application/yaml")
        .body(bomb)
        .send()
        .await
        .unwrap();
    let (s, v) = common::json_of(reply).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert!(v.to_string().contains("line 2 column 5"), "{v}");
    let (s, v) = api.get_json("/v1/definitions", &publisher).await;
    assert_eq!(s, StatusCode::OK, "the API is still up: {v}");
    let healthz = reqwest::get(format!("{}/healthz", api.base)).await.unwrap();
    assert_eq!(healthz.status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_in_yaml_registers_as_the_same_definition_as_in_toml() {
    let api = Api::start("publish_yaml", &[]).await;
    let publisher = api.token("release-bot", &["publish", "read"]);
    let post = |query: &str, content_type: &str, body: &str| {
        api.post(&format!("/v1/definitions{query}"), &publisher)
            .header("content-type", content_type)
            .body(body.to_owned())
            .send()
    };
    let (s, v) = common::json_of(post("", "application/yaml", GREETER_YAML).await.unwrap()).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["version"], 1);
    // The same definition in TOML is the body already registered, not another one.
    let (s, v) = api
        .post_toml("/v1/definitions", &publisher, GREETER_TOML)
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["created"], false, "{v}");
    // `?format=yaml` overrides the content type.
    let (s, v) = common::json_of(
        post("?format=yaml", "text/plain", GREETER_YAML)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, view) = api.get_json("/v1/definitions/greeter", &publisher).await;
    assert_eq!(s, StatusCode::OK, "{view}");
    let local = rein_core::Definition::parse(
        GREETER_TOML,
        rein_core::Format::Toml,
        &rein_core::GuardRegistry::new(),
    )
    .unwrap();
    assert_eq!(view["hash"], local.hash());

    // Malformed YAML is a located problem, not a server error.
    let broken = GREETER_YAML.replace("{name: WAIT, kind: waiting}", "{name: WAIT, kind: waiting");
    let (s, v) = common::json_of(post("", "application/yaml", &broken).await.unwrap()).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert!(v.to_string().contains("line "), "{v}");

    // The CLI sends a .yaml file as YAML, through the API and on the database.
    let dir = common::tmp_dir("publish_yaml");
    let file = dir.join("greeter.yaml");
    std::fs::write(&file, GREETER_YAML.replace("version: 1", "version: 2")).unwrap();
    let file = file.to_str().unwrap();
    let out = rein_with(
        &["definitions", "register", file, "--json"],
        &[("REIN_URL", &api.base), ("REIN_TOKEN", &publisher)],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let done: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(done["version"], 2, "{done}");
    assert_eq!(done["created"], true, "{done}");
    let out = rein_with(
        &["definitions", "register", file, "--json"],
        &[("DATABASE_URL", &api.url)],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let again: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(again["created"], false, "{again}");
}
