//! `rein api` against real PostgreSQL: the real binary is started as a child process on a
//! free port, tokens are made with `rein tokens create`, and every request goes over HTTP.

use crate::common;

use common::{Api, PrivateRedis, code, free_port, json_of, rein, stderr, stdout};
use rein_store::{EnqueueRequest, Sender};
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_need_no_token_and_everything_else_does() {
    let api = Api::start("api_auth", &[]).await;
    let (s, v) = json_of(api.get("/healthz", None).send().await.unwrap()).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"status": "ok"})));
    let (s, _) = json_of(api.get("/readyz", None).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK);
    // The document describes the API and holds no tenant's data: generators read it by URL.
    let (s, doc) = json_of(api.get("/openapi.json", None).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK, "{doc}");
    assert!(doc["paths"]["/v1/runs"].is_object(), "{doc}");

    for path in ["/v1/runs", "/v1/approvals", "/nowhere"] {
        let (s, v) = json_of(api.get(path, None).send().await.unwrap()).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}: {v}");
        assert_eq!(code(&v), "unauthorized");
    }
    let r = api.get("/v1/runs", None).send().await.unwrap();
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    let (s, v) = json_of(api.get("/v1/runs", Some("rein_0000")).send().await.unwrap()).await;
    assert_eq!((s, code(&v)), (StatusCode::UNAUTHORIZED, "unauthorized"));

    let reader = api.token("reader", &["read"]);
    let (s, v) = json_of(api.get("/v1/runs", Some(&reader)).send().await.unwrap()).await;
    assert_eq!((s, v), (StatusCode::OK, json!([])));
    let (s, v) = json_of(
        api.post("/v1/runs", &reader)
            .json(&json!({"definition": "research-agent"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(v["error"]["details"]["required_scope"], "enqueue");
    // Nothing was created.
    assert!(
        api.store
            .list_runs(None, None, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[test]
fn tokens_create_refuses_bad_scopes_and_subjects() {
    let long = "x".repeat(129);
    for (args, says) in [
        (
            vec!["--scope", "superuser", "--subject", "a"],
            "unknown scope `superuser`",
        ),
        (vec!["--scope", "read", "--subject", ""], "subject"),
        (vec!["--scope", "read", "--subject", &long], "subject"),
    ] {
        let mut all = vec!["tokens", "create", "--database-url", "postgres://nowhere/x"];
        all.extend_from_slice(&args);
        let out = rein(&all);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_is_idempotent_by_key_and_the_run_reads_back() {
    let api = Api::start("api_enqueue", &[]).await;
    let token = api.token("ci", &["enqueue", "read"]);
    let body = json!({"definition": "research-agent", "input": {"topic": "x"}});
    let first = api
        .post("/v1/runs", &token)
        .header("Idempotency-Key", "order-1")
        .json(&body)
        .send()
        .await
        .unwrap();
    let (s, v) = json_of(first).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["created"], true);
    let run = v["run_id"].as_str().unwrap().to_owned();
    let (s, v) = json_of(
        api.post("/v1/runs", &token)
            .header("Idempotency-Key", "order-1")
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, v["run_id"].as_str()),
        (StatusCode::OK, Some(run.as_str()))
    );
    assert_eq!(v["created"], false);
    let (s, v) = json_of(
        api.post("/v1/runs", &token)
            .header("Idempotency-Key", "order-2")
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED);
    assert_ne!(v["run_id"].as_str(), Some(run.as_str()));

    let (s, v) = json_of(
        api.get(&format!("/v1/runs/{run}"), Some(&token))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["run_id"], run);
    assert_eq!(v["definition"], "research-agent");
    assert_eq!(v["state"], "INTAKE");
    assert_eq!(v["sequence"], 0);
    assert_eq!(v["data"]["topic"], "x");

    let (s, v) = json_of(
        api.get(&format!("/v1/runs/{run}/events"), Some(&token))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, v), (StatusCode::OK, json!([])));
    api.store
        .send(
            run.parse().unwrap(),
            "TASK_ACCEPTED",
            json!({}),
            &Sender::Engine("test".into()),
            60_000,
        )
        .await
        .unwrap();
    let (_, v) = json_of(
        api.get(&format!("/v1/runs/{run}/events"), Some(&token))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(v[0]["type"], "TASK_ACCEPTED");
    assert_eq!(v[0]["sequence"], 1);

    let (s, v) = json_of(
        api.get("/v1/runs?definition=research-agent&limit=1", Some(&token))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v.as_array().unwrap().len(), 1);

    // Bad input is a 4xx with a code, never a 500.
    for (path, status, want) in [
        (
            format!("/v1/runs/{}", Uuid::now_v7()),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "/v1/runs/not-a-uuid".to_owned(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
        ),
        (
            "/v1/runs?limit=0".to_owned(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
        ),
        (
            "/v1/runs?limit=1001".to_owned(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
        ),
    ] {
        let (s, v) = json_of(api.get(&path, Some(&token)).send().await.unwrap()).await;
        assert_eq!((s, code(&v)), (status, want), "{path}: {v}");
    }
    for bad in [
        "{not json".to_owned(),
        json!({"definition": "research-agent", "surprise": 1}).to_string(),
    ] {
        let (s, v) = json_of(
            api.post("/v1/runs", &token)
                .header("content-type", "application/json")
                .body(bad.clone())
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
            "{bad}: {v}"
        );
    }
    // A well-formed request naming a definition nobody registered: not found, like
    // `GET /v1/definitions/NAME`.
    let (s, v) = api
        .post_json(
            "/v1/runs",
            &token,
            &json!({"definition": "no-such-definition"}),
        )
        .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    assert_eq!(v["error"]["details"]["definition"], "no-such-definition");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_apply_queue_or_are_refused_with_the_state() {
    let api = Api::start("api_send", &[]).await;
    let token = api.token("operator", &["operate", "enqueue"]);
    let def = api
        .store
        .load_definition("research-agent", None)
        .await
        .unwrap();
    let run = api
        .store
        .enqueue(EnqueueRequest::new(def.clone(), json!({})))
        .await
        .unwrap()
        .run_id;

    // The user's reply is for a later state: it waits in the inbox.
    let (s, v) = json_of(
        api.post(&format!("/v1/runs/{run}/events"), &token)
            .json(&json!({"type": "USER_REPLY"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, v["outcome"].as_str()),
        (StatusCode::ACCEPTED, Some("queued")),
        "{v}"
    );

    // Once the run waits for the user, the user's cancel applies at once.
    api.store
        .send(
            run,
            "NEED_CLARIFICATION",
            json!({}),
            &Sender::Engine("test-worker".into()),
            60_000,
        )
        .await
        .unwrap();
    let (s, v) = json_of(
        api.post(&format!("/v1/runs/{run}/events"), &token)
            .json(&json!({"type": "USER_CANCELLED", "payload": {"reason": "empty"}}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, v["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{v}"
    );
    assert_eq!(v["sequence"], 2);
    let events = api.store.history(run).await.unwrap();
    assert_eq!(
        (events[1].worker.as_str(), events[1].sender.as_deref()),
        ("api:operator", Some("api:operator")),
        "the sender is the token's subject"
    );

    // The run is CANCELLED (terminal): nothing moves it.
    let (s, v) = json_of(
        api.post(&format!("/v1/runs/{run}/events"), &token)
            .json(&json!({"type": "USER_REPLY"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::CONFLICT, "invalid_transition"),
        "{v}"
    );
    assert_eq!(v["error"]["details"]["state"], "CANCELLED");
    assert_eq!(v["error"]["details"]["event"], "USER_REPLY");
    assert_eq!(v["error"]["details"]["reason"]["code"], "terminal");
    assert_eq!(api.store.run(run).await.unwrap().last_sequence, 2);

    let (s, v) = json_of(
        api.post(&format!("/v1/runs/{}/events", Uuid::now_v7()), &token)
            .json(&json!({"type": "TASK_ACCEPTED"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_records_the_tokens_subject_as_approver() {
    let api = Api::start("api_approve", &[]).await;
    let (run, approval) = common::waiting_approval(&api.store).await;
    let reader = api.token("watcher", &["read"]);
    let approver = api.token("alice@example.com", &["approve", "read"]);

    let (s, v) = json_of(
        api.get("/v1/approvals", Some(&reader))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v[0]["approval_id"], approval.to_string());

    let path = format!("/v1/approvals/{approval}/grant");
    let (s, v) = json_of(
        api.post(&path, &reader)
            .json(&json!({}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"));

    let (s, v) = json_of(
        api.post(&path, &approver)
            .json(&json!({"comment": "refund is fine"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "granted");
    assert_eq!(v["decided_by"], "alice@example.com");
    let stored = api.store.approval(approval).await.unwrap();
    assert_eq!(stored.decided_by.as_deref(), Some("alice@example.com"));
    assert_eq!(stored.comment.as_deref(), Some("refund is fine"));
    let last = api.store.history(run).await.unwrap().pop().unwrap();
    assert_eq!(last.kind, "APPROVED");
    assert_eq!(last.payload["approver"], "alice@example.com");

    // A second decision is a conflict; an unknown request is not found.
    let (s, v) = json_of(
        api.post(&format!("/v1/approvals/{approval}/deny"), &approver)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "conflict"), "{v}");
    let (s, v) = json_of(
        api.post(
            &format!("/v1/approvals/{}/grant", Uuid::now_v7()),
            &approver,
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_is_413_payload_too_large() {
    let api = Api::start("api_limit", &["--body-limit-bytes", "4096"]).await;
    let token = api.token("ci", &["admin"]);
    let big = json!({"definition": "research-agent", "input": {"blob": "x".repeat(8192)}});
    let (s, v) = json_of(
        api.post("/v1/runs", &token)
            .json(&big)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
        "{v}"
    );
    // A body without a length (chunked) is cut off the same way, while it is read.
    let body = big.to_string();
    let raw = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: rein\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
         {:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    let addr = api.base.trim_start_matches("http://").to_owned();
    let reply = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(addr).expect("connect");
        let _ = conn.write_all(raw.as_bytes());
        let mut reply = String::new();
        let _ = conn.read_to_string(&mut reply);
        reply
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert!(reply.contains("\"payload_too_large\""), "{reply}");
    assert!(
        api.store
            .list_runs(None, None, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_lists_every_route_served() {
    let api = Api::start("api_openapi", &[]).await;
    let token = api.token("ci", &["read"]);
    let (s, doc) = json_of(api.get("/openapi.json", Some(&token)).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.1"),
        "{}",
        doc["openapi"]
    );
    let served = [
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
        ("/v1/me", "get"),
        ("/v1/runs", "get"),
        ("/v1/runs", "post"),
        ("/v1/runs/{id}", "get"),
        ("/v1/runs/{id}/why", "get"),
        ("/v1/runs/{id}/usage", "get"),
        ("/v1/runs/{id}/events", "get"),
        ("/v1/runs/{id}/events", "post"),
        ("/v1/approvals", "get"),
        ("/v1/approvals/{id}/grant", "post"),
        ("/v1/approvals/{id}/deny", "post"),
        ("/v1/runs/{id}/rerun", "post"),
        ("/v1/runs/{id}/stream", "get"),
        ("/v1/workers", "get"),
        ("/v1/definitions", "get"),
        ("/v1/definitions", "post"),
        ("/v1/definitions/{name}", "get"),
        ("/v1/definitions/{name}/current", "post"),
        ("/v1/definitions/{name}/migrate", "post"),
        ("/v1/runs/{id}/fork", "post"),
        ("/v1/runs/{id}/redact", "post"),
        ("/v1/runs/{id}/brief", "get"),
        ("/v1/runs/{id}/verify", "get"),
        ("/v1/runs/{id}/whatif", "get"),
        ("/v1/runs/{id}/resolve", "post"),
        ("/v1/limits", "get"),
        ("/v1/webhooks", "get"),
        ("/v1/webhooks/deliveries", "get"),
        ("/v1/blobs/{sha256}", "get"),
    ];
    let paths = doc["paths"].as_object().expect("paths");
    for (path, method) in served {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} missing"
        );
    }
    let listed: usize = paths.values().map(|p| p.as_object().unwrap().len()).sum();
    assert_eq!(
        listed,
        served.len(),
        "the document lists only what is served: {paths:?}"
    );
    // Each documented route answers (no 404 from the router).
    for (path, method) in served {
        if path == "/metrics" {
            // Prometheus text, not JSON, and public like the probes.
            let r = api.get(path, None).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            let text = r.text().await.unwrap();
            assert!(text.contains("rein_build_info"), "{text}");
            continue;
        }
        let url = path.replace("{id}", &Uuid::now_v7().to_string());
        let r = match method {
            "get" => api.get(&url, Some(&token)).send().await.unwrap(),
            _ => api
                .post(&url, &token)
                .json(&json!({}))
                .send()
                .await
                .unwrap(),
        };
        let (s, v) = json_of(r).await;
        assert_ne!(
            (s, v["error"]["message"].as_str()),
            (StatusCode::NOT_FOUND, Some("no such route")),
            "{method} {path} is not served"
        );
    }
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
}

/// The schema `schema` names in `doc`, following one `$ref`.
fn component<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(r) => &doc["components"]["schemas"][r.trim_start_matches("#/components/schemas/")],
        None => schema,
    }
}

/// The property names of component `name`.
fn properties(doc: &Value, name: &str) -> std::collections::BTreeSet<String> {
    doc["components"]["schemas"][name]["properties"]
        .as_object()
        .unwrap_or_else(|| panic!("{name} has properties"))
        .keys()
        .cloned()
        .collect()
}

fn keys(v: &Value) -> std::collections::BTreeSet<String> {
    v.as_object()
        .unwrap_or_else(|| panic!("an object: {v}"))
        .keys()
        .cloned()
        .collect()
}

/// Every schema in `v` that a generator reads as an object without any key
/// (`Record<string, never>`): `type: object` with neither properties nor additionalProperties.
fn keyless_objects(v: &Value, at: &str, found: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            if o.get("type") == Some(&json!("object"))
                && !o.contains_key("properties")
                && !o.contains_key("additionalProperties")
                && !o.contains_key("allOf")
                && !o.contains_key("oneOf")
            {
                found.push(at.to_owned());
            }
            for (k, child) in o {
                keyless_objects(child, &format!("{at}/{k}"), found);
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                keyless_objects(child, &format!("{at}/{i}"), found);
            }
        }
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_types_what_generated_clients_read() {
    let api = Api::start("api_openapi_types", &[]).await;
    let token = api.token("ci", &["read", "enqueue", "approve"]);
    let (s, doc) = json_of(api.get("/openapi.json", None).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(doc["servers"][0]["url"], "/", "{}", doc["servers"]);

    // Every operation answers its errors with the error body, 5xx included, and 401 where
    // it needs a token.
    let mut operations = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            operations += 1;
            let public = op["security"] == json!([{}]);
            let mut statuses = vec!["400", "408", "413", "414", "429", "431", "500", "503"];
            if !public {
                statuses.push("401");
            }
            for status in statuses {
                let schema = &op["responses"][status]["content"]["application/json"]["schema"];
                assert_eq!(
                    schema["$ref"], "#/components/schemas/ErrorBody",
                    "{method} {path} documents {status} with the error body"
                );
            }
        }
    }
    assert!(operations >= 19);
    let code = &doc["components"]["schemas"]["ErrorDetail"]["properties"]["code"];
    let codes = component(&doc, code)["enum"]
        .as_array()
        .expect("codes as an enum");
    for c in [
        "validation_failed",
        "not_found",
        "unauthorized",
        "internal",
        "unavailable",
    ] {
        assert!(codes.contains(&json!(c)), "{c} in {codes:?}");
    }
    assert_eq!(codes.len(), 19);
    let status = &doc["components"]["schemas"]["RunView"]["properties"]["status"];
    assert_eq!(
        component(&doc, status)["enum"],
        json!(["runnable", "parked", "needs_operator", "terminal"])
    );
    let mut keyless = Vec::new();
    keyless_objects(&doc, "#", &mut keyless);
    assert!(keyless.is_empty(), "objects without keys: {keyless:?}");
    // A decision's body is optional, as the handlers take none.
    for path in ["/v1/approvals/{id}/grant", "/v1/approvals/{id}/deny"] {
        let body = &doc["paths"][path]["post"]["requestBody"];
        assert!(
            body.is_object() && body["required"] != true,
            "{path}: {body}"
        );
        // An object or nothing; not JSON `null`, which no handler takes.
        assert_eq!(
            body["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/DecideBody",
            "{path}: {body}"
        );
    }
    // A new run's response links to the operations on it.
    let links = &doc["paths"]["/v1/runs"]["post"]["responses"]["201"]["links"];
    for op in [
        "get_run",
        "why_run",
        "run_events",
        "send_event",
        "rerun_run",
    ] {
        assert_eq!(
            links[op]["operationId"], op,
            "POST /v1/runs links {op}: {links}"
        );
        assert_eq!(links[op]["parameters"]["id"], "$response.body#/run_id");
    }

    // The answers have the documented fields: why, workers, a run.
    let (s, v) = api
        .post_json("/v1/runs", &token, &json!({"definition": "research-agent"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let run = v["run_id"].as_str().unwrap().to_owned();
    let (s, why) = api.get_json(&format!("/v1/runs/{run}/why"), &token).await;
    assert_eq!(s, StatusCode::OK, "{why}");
    assert_eq!(keys(&why), properties(&doc, "WhyView"), "why: {why}");
    for (part, name) in [
        ("since", "WhySince"),
        ("effects", "WhyEffects"),
        ("fleet", "WhyFleet"),
    ] {
        assert_eq!(keys(&why[part]), properties(&doc, name), "why.{part}");
    }
    api.store
        .heartbeat("w-doc", "worker", json!({}))
        .await
        .unwrap();
    let (s, workers) = api.get_json("/v1/workers", &token).await;
    assert_eq!(s, StatusCode::OK, "{workers}");
    assert_eq!(keys(&workers[0]), properties(&doc, "WorkerView"));
    let (_, got) = api.get_json(&format!("/v1/runs/{run}"), &token).await;
    assert_eq!(keys(&got), properties(&doc, "RunView"));

    // A status outside the enum is refused, naming the valid ones.
    let (s, v) = api.get_json("/v1/runs?status=bogus", &token).await;
    assert_eq!(
        (s, common::code(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
        "{v}"
    );
    assert_eq!(
        v["error"]["details"]["allowed"],
        json!(["runnable", "parked", "needs_operator", "terminal"])
    );
    // A decision without a body is taken.
    let (_, approval) = common::waiting_approval(&api.store).await;
    let r = api
        .post(&format!("/v1/approvals/{approval}/deny"), &token)
        .send()
        .await
        .unwrap();
    let (s, v) = json_of(r).await;
    assert_eq!((s, &v["status"]), (StatusCode::OK, &json!("denied")), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_carries_its_cursor_in_the_body_when_asked() {
    let api = Api::start("api_envelope", &[]).await;
    let token = api.token("ci", &["read", "enqueue"]);
    let mut runs = Vec::new();
    for _ in 0..3 {
        let (s, v) = api
            .post_json("/v1/runs", &token, &json!({"definition": "research-agent"}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        runs.push(v["run_id"].as_str().unwrap().to_owned());
    }
    // The array, with the cursor in the header, as before.
    let r = api
        .get("/v1/runs?limit=2", Some(&token))
        .send()
        .await
        .unwrap();
    let header = r.headers()["rein-next-cursor"].to_str().unwrap().to_owned();
    let (_, plain) = json_of(r).await;
    assert_eq!(plain.as_array().map(Vec::len), Some(2), "{plain}");
    // The object: the same runs and the same cursor in the body.
    let r = api
        .get("/v1/runs?limit=2&envelope=true", Some(&token))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["rein-next-cursor"], header.as_str());
    let (s, page) = json_of(r).await;
    assert_eq!(s, StatusCode::OK, "{page}");
    assert_eq!(page["runs"], plain);
    assert_eq!(page["next_cursor"], header.as_str());
    assert_eq!(page["truncated"], false);
    let (_, last) = api
        .get_json(
            &format!("/v1/runs?limit=2&envelope=true&cursor={header}"),
            &token,
        )
        .await;
    assert_eq!(last["runs"].as_array().map(Vec::len), Some(1), "{last}");
    assert_eq!(last["runs"][0]["run_id"], runs[0].as_str());
    assert_eq!(last["next_cursor"], Value::Null);

    // A run's events likewise, with `after`.
    let run: Uuid = runs[0].parse().unwrap();
    common::as_the_engine(&api.store, run, &["TASK_ACCEPTED", "PLAN_READY"]).await;
    let path = format!("/v1/runs/{run}/events?limit=1");
    let r = api.get(&path, Some(&token)).send().await.unwrap();
    let after = r.headers()["rein-next-after"].to_str().unwrap().to_owned();
    let (_, plain) = json_of(r).await;
    let (s, page) = api.get_json(&format!("{path}&envelope=true"), &token).await;
    assert_eq!(s, StatusCode::OK, "{page}");
    assert_eq!(page["events"], plain);
    assert_eq!(page["next_after"].to_string(), after);
    let (_, rest) = api
        .get_json(
            &format!("/v1/runs/{run}/events?after={after}&limit=1000&envelope=true"),
            &token,
        )
        .await;
    assert_eq!(rest["next_after"], Value::Null, "{rest}");
    let total = api.store.history(run).await.unwrap().len();
    assert!(total >= 2);
    assert_eq!(
        rest["events"].as_array().map(Vec::len),
        Some(total - 1),
        "{rest}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_run_is_rerun_as_a_linked_run_and_workers_are_listed() {
    let api = Api::start("api_rerun", &[]).await;
    let token = api.token("operator", &["operate", "read"]);
    let def = api
        .store
        .load_definition("research-agent", None)
        .await
        .unwrap();
    let run = api
        .store
        .enqueue(EnqueueRequest::new(def, json!({"topic": "refunds"})))
        .await
        .unwrap()
        .run_id;
    // Not finished yet: 409.
    let (s, v) = json_of(
        api.post(&format!("/v1/runs/{run}/rerun"), &token)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "conflict");
    common::cancel(&api.store, run).await;
    let (s, v) = json_of(
        api.post(&format!("/v1/runs/{run}/rerun"), &token)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["parent_run_id"], json!(run));
    let again: Uuid = v["run_id"].as_str().unwrap().parse().unwrap();
    assert_ne!(again, run);

    api.store
        .heartbeat("w-api", "worker", json!({}))
        .await
        .unwrap();
    let (s, v) = json_of(api.get("/v1/workers", Some(&token)).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        v.as_array()
            .is_some_and(|a| a.iter().any(|w| w["worker_id"] == "w-api")),
        "{v}"
    );
}

/// `chain4` under another name, as TOML.
fn chain4_named(name: &str) -> String {
    let text =
        rein_core::builtin::CHAIN4.replace("name = \"chain4\"", &format!("name = \"{name}\""));
    assert!(text.contains(name));
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn definitions_are_listed_shown_and_registered() {
    let api = Api::start("api_defs", &[]).await;
    let reader = api.token("reader", &["read"]);
    let operator = api.token("release-bot", &["publish", "read"]);

    let (s, v) = json_of(
        api.get("/v1/definitions", Some(&reader))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let chain4 = v
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "chain4")
        .unwrap_or_else(|| panic!("the built-ins are listed: {v}"));
    let version = rein_core::builtin::load("chain4")
        .and_then(Result::ok)
        .expect("the built-in chain4")
        .version();
    assert_eq!(chain4["version"], version);
    assert!(chain4["hash"].as_str().is_some_and(|h| !h.is_empty()));
    assert!(chain4["description"].as_str().unwrap().contains("no-op"));

    let (s, v) = json_of(
        api.get(
            &format!("/v1/definitions/chain4?version={version}"),
            Some(&reader),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (&v["name"], &v["version"]),
        (&json!("chain4"), &json!(version))
    );
    assert_eq!(v["hash"], chain4["hash"]);
    assert_eq!(v["spec"]["states"][0]["name"], "step1");
    for path in [
        "/v1/definitions/no-such",
        "/v1/definitions/chain4?version=9",
    ] {
        let (s, v) = json_of(api.get(path, Some(&reader)).send().await.unwrap()).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::NOT_FOUND, "not_found"),
            "{path}: {v}"
        );
    }

    // A read-only token may not register.
    let toml = chain4_named("chain4-toml");
    let (s, v) = json_of(
        api.post("/v1/definitions", &reader)
            .header("content-type", "application/toml")
            .body(toml.clone())
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(v["error"]["details"]["required_scope"], "publish");

    // TOML by Content-Type, then the same body again.
    for (status, created) in [(StatusCode::CREATED, true), (StatusCode::OK, false)] {
        let (s, v) = json_of(
            api.post("/v1/definitions", &operator)
                .header("content-type", "application/toml; charset=utf-8")
                .body(toml.clone())
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(s, status, "{v}");
        assert_eq!(
            v,
            json!({"name": "chain4-toml", "version": version, "created": created,
                   "current_version": version})
        );
    }
    // TOML by `?format=toml` whatever the Content-Type says.
    let (s, v) = json_of(
        api.post("/v1/definitions?format=toml", &operator)
            .header("content-type", "text/plain")
            .body(chain4_named("chain4-query"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, &v["created"]),
        (StatusCode::CREATED, &json!(true)),
        "{v}"
    );

    // JSON: the spec of a parsed document, renamed.
    let parsed = rein_core::Definition::parse(
        &chain4_named("chain4-json"),
        rein_core::Format::Toml,
        &rein_core::GuardRegistry::new(),
    )
    .unwrap();
    let spec = serde_json::to_value(parsed.spec()).unwrap();
    let (s, v) = json_of(
        api.post("/v1/definitions", &operator)
            .json(&spec)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["name"], "chain4-json");
    // Registered ones are listed, loadable and enqueueable.
    let (_, v) = json_of(
        api.get("/v1/definitions", Some(&reader))
            .send()
            .await
            .unwrap(),
    )
    .await;
    for name in ["chain4-toml", "chain4-query", "chain4-json"] {
        assert!(
            v.as_array().unwrap().iter().any(|d| d["name"] == name),
            "{name}: {v}"
        );
    }
    let def = api
        .store
        .load_definition("chain4-json", None)
        .await
        .unwrap();
    assert_eq!(def.hash(), parsed.hash());

    // Another body under a registered version is a conflict.
    let changed = toml.replace("measures the engine", "measures something else");
    assert_ne!(changed, toml);
    let (s, v) = json_of(
        api.post("/v1/definitions?format=toml", &operator)
            .body(changed)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "conflict"), "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("new version"),
        "{v}"
    );

    // An invalid definition: every problem, located.
    let invalid = chain4_named("chain4-bad").replace("to = \"done\"", "to = \"nowhere\"");
    let (s, v) = json_of(
        api.post("/v1/definitions?format=toml", &operator)
            .body(invalid)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
        "{v}"
    );
    let problems = v["error"]["details"]["problems"]
        .as_array()
        .expect("problems");
    assert!(
        problems.iter().any(|p| p["item"]
            .as_str()
            .is_some_and(|i| i.starts_with("transitions[3]"))
            && p["reason"].as_str().is_some_and(|r| r.contains("nowhere"))),
        "{v}"
    );
    // Unparseable documents and formats are 422 too.
    for (path, body) in [
        ("/v1/definitions", "{not json"),
        ("/v1/definitions?format=yaml", "name: x"),
    ] {
        let (s, v) = json_of(api.post(path, &operator).body(body).send().await.unwrap()).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
            "{path}: {v}"
        );
    }
    let (_, v) = json_of(
        api.get("/v1/definitions/chain4-bad", Some(&reader))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(code(&v), "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_page_by_cursor_newest_first() {
    let api = Api::start("api_pages", &[]).await;
    let token = api.token("reader", &["read"]);
    let def = api.store.load_definition("chain4", None).await.unwrap();
    let mut enqueued = Vec::new();
    for i in 0..5 {
        let done = api
            .store
            .enqueue(EnqueueRequest::new(def.clone(), json!({ "i": i })))
            .await
            .unwrap();
        enqueued.push(done.run_id.to_string());
    }

    let mut seen: Vec<(String, String)> = Vec::new();
    let mut path = "/v1/runs?limit=2".to_owned();
    for page in 0..3 {
        let r = api.get(&path, Some(&token)).send().await.unwrap();
        let next = r
            .headers()
            .get("rein-next-cursor")
            .map(|v| v.to_str().unwrap().to_owned());
        let (s, v) = json_of(r).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let rows = v.as_array().expect("the body stays a bare array");
        assert_eq!(rows.len(), if page < 2 { 2 } else { 1 }, "page {page}: {v}");
        for row in rows {
            seen.push((
                row["created_at"].as_str().unwrap().to_owned(),
                row["run_id"].as_str().unwrap().to_owned(),
            ));
        }
        match next {
            Some(cursor) => {
                assert!(page < 2, "no cursor on the last page");
                path = format!("/v1/runs?limit=2&cursor={cursor}");
            }
            None => assert_eq!(page, 2, "a cursor on every page but the last"),
        }
    }
    // Each run exactly once, newest first by (created_at, run_id).
    let mut ids: Vec<String> = seen.iter().map(|(_, id)| id.clone()).collect();
    ids.sort();
    enqueued.sort();
    assert_eq!(ids, enqueued);
    let keys: Vec<(chrono::DateTime<chrono::Utc>, String)> = seen
        .iter()
        .map(|(at, id)| (at.parse().unwrap(), id.clone()))
        .collect();
    assert!(keys.windows(2).all(|w| w[0] > w[1]), "{keys:?}");

    // A page of exactly the rest has no cursor either.
    let r = api
        .get("/v1/runs?limit=5", Some(&token))
        .send()
        .await
        .unwrap();
    assert!(r.headers().get("rein-next-cursor").is_none());
    assert_eq!(json_of(r).await.1.as_array().unwrap().len(), 5);

    // Time bounds.
    for (query, want) in [
        ("created_after=2000-01-01T00:00:00Z", 5),
        ("created_before=2000-01-01T00:00:00Z", 0),
        ("created_after=2999-01-01T00:00:00Z", 0),
    ] {
        let (s, v) = json_of(
            api.get(&format!("/v1/runs?{query}"), Some(&token))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{query}: {v}");
        assert_eq!(v.as_array().unwrap().len(), want, "{query}: {v}");
    }

    // Malformed cursors and times are 422.
    let not_a_key = "6e6f7065"; // hex of "nope"
    for query in [
        "cursor=zz",
        "cursor=abc",
        "cursor=",
        &format!("cursor={not_a_key}"),
        "created_after=yesterday",
    ] {
        let (s, v) = json_of(
            api.get(&format!("/v1/runs?{query}"), Some(&token))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
            "{query}: {v}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_is_refused_from_then_on() {
    let api = Api::start("api_revoke", &[]).await;
    let token = api.token("temp", &["read"]);
    let (s, _) = json_of(api.get("/v1/runs", Some(&token)).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK);
    let token_id: Uuid =
        sqlx::query_scalar("SELECT token_id FROM rein_tokens WHERE subject = 'temp'")
            .fetch_one(api.store.pool())
            .await
            .unwrap();
    let id = token_id.to_string();
    let out = rein(&["tokens", "revoke", &id, "--database-url", &api.url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (s, v) = json_of(api.get("/v1/runs", Some(&token)).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    // Revoking it again names no live token: an input error, like any unknown id.
    let out = rein(&["tokens", "revoke", &id, "--database-url", &api.url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

// ---- the served document is the contract ---------------------------------------------------

/// A running API with a run to address, its served document, and requests of every
/// operation the server accepts, to vary one input at a time against what the document says.
struct Contract {
    api: Api,
    token: String,
    doc: Value,
    run: Uuid,
    /// A registered definition as a JSON document (registering it again is a no-op).
    definition: String,
    _redis: PrivateRedis,
}

impl Contract {
    async fn start(prefix: &str) -> Contract {
        // `GET /v1/limits` reads the API's Redis: without one its list is always empty.
        let redis = PrivateRedis::start(free_port(), &common::tmp_dir(&format!("{prefix}_redis")));
        // Redaction answers only with a key (without one it is 503, a server error here).
        let api = Api::start_env(
            prefix,
            &["--redis-url", &redis.url()],
            &[("REIN_REDACTION_KEY", &"7e".repeat(32))],
        )
        .await;
        let token = api.token("contract", &["admin"]);
        let (s, doc) = api.get_json("/openapi.json", &token).await;
        assert_eq!(s, StatusCode::OK);
        let (s, v) = api
            .post_json("/v1/runs", &token, &json!({"definition": "research-agent"}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let run = v["run_id"].as_str().unwrap().parse().unwrap();
        let (s, v) = api.get_json("/v1/definitions/research-agent", &token).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        Contract {
            api,
            token,
            doc,
            run,
            definition: v["spec"].to_string(),
            _redis: redis,
        }
    }

    /// Every operation of the document: path, method, operation.
    fn operations(&self) -> Vec<(String, String, Value)> {
        let mut all = Vec::new();
        for (path, item) in self.doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().unwrap() {
                all.push((path.clone(), method.clone(), op.clone()));
            }
        }
        all
    }

    /// The schema behind `schema`: references followed, the non-null branch of a nullable one.
    fn resolve<'a>(&'a self, schema: &'a Value) -> &'a Value {
        if let Some(r) = schema["$ref"].as_str() {
            let name = r
                .strip_prefix("#/components/schemas/")
                .expect("a local $ref");
            return self.resolve(&self.doc["components"]["schemas"][name]);
        }
        if let Some(branches) = schema["oneOf"].as_array() {
            let typed: Vec<&Value> = branches.iter().filter(|b| b["type"] != "null").collect();
            if let [only] = typed[..] {
                return self.resolve(only);
            }
        }
        schema
    }

    /// A schema's type, `null` aside.
    fn type_of(schema: &Value) -> &str {
        match &schema["type"] {
            Value::String(t) => t,
            Value::Array(ts) => ts
                .iter()
                .filter_map(Value::as_str)
                .find(|t| *t != "null")
                .unwrap_or(""),
            _ => "",
        }
    }

    /// The value of path parameter `name` in a request the server accepts.
    fn path_value(&self, path: &str, name: &str) -> String {
        match name {
            "id" if path.starts_with("/v1/runs/") => self.run.to_string(),
            "id" => Uuid::now_v7().to_string(),
            "name" => "research-agent".to_owned(),
            "sha256" => "0".repeat(64),
            other => panic!("{path}: give the contract test a value for path parameter `{other}`"),
        }
    }

    /// The body of a request of this operation the server accepts (its answer may still be
    /// 404 or 409: the request is well formed).
    fn base_body(&self, method: &str, path: &str) -> Option<(String, &'static str)> {
        let json = |v: Value| Some((v.to_string(), "application/json"));
        match (method, path) {
            ("get", _) | ("post", "/v1/runs/{id}/rerun") => None,
            ("post", "/v1/runs") => json(json!({"definition": "research-agent"})),
            ("post", "/v1/runs/{id}/events") => json(json!({"type": "NOT_DECLARED"})),
            ("post", "/v1/approvals/{id}/grant" | "/v1/approvals/{id}/deny") => json(json!({})),
            // The contract's run has no open call: a well-formed settlement is a conflict.
            ("post", "/v1/runs/{id}/resolve") => {
                json(json!({"resolution": "applied", "event": "TOOL_SUCCEEDED"}))
            }
            ("post", "/v1/definitions") => Some((self.definition.clone(), "application/json")),
            ("post", "/v1/definitions/{name}/current") => {
                json(json!({"version": rein_core::builtin::research_agent().version()}))
            }
            // No version 2 of the contract's definition: a well-formed migration is a 404.
            ("post", "/v1/definitions/{name}/migrate") => {
                json(json!({"from": 1, "to": 2, "dry_run": true}))
            }
            // The contract's run is at its first event at most: a fork there is a 404 or 409.
            ("post", "/v1/runs/{id}/fork") => json(json!({"at": 1})),
            // The contract's run holds no such key: a redaction replaces nothing, or waits
            // for a worker's lease (409).
            ("post", "/v1/runs/{id}/redact") => {
                json(json!({"fields": ["contract_key"], "reason": "contract"}))
            }
            _ => panic!("{method} {path}: give the contract test a request body"),
        }
    }

    /// Sends a request of the operation the server accepts, but for what `vary` changes.
    async fn send(&self, method: &str, path: &str, vary: Vary<'_>) -> (StatusCode, Value) {
        let mut url = path.to_owned();
        for segment in path.split('/').filter(|s| s.starts_with('{')) {
            let name = &segment[1..segment.len() - 1];
            let value = match vary.path {
                Some((n, v)) if n == name => v.to_owned(),
                _ => self.path_value(path, name),
            };
            url = url.replace(segment, &value);
        }
        let url = format!("{}{url}", self.api.base);
        let mut req = match method {
            "get" => self.api.http.get(url),
            "post" => self.api.http.post(url),
            other => panic!("method {other}"),
        }
        .bearer_auth(&self.token)
        .query(&vary.query);
        for (name, value) in &vary.headers {
            req = req.header(*name, value.as_str());
        }
        let body = match (&vary.body, self.base_body(method, path)) {
            (Some(body), _) => Some((body.to_string(), "application/json")),
            (None, base) => base,
        };
        if let Some((text, content_type)) = body {
            req = req.header("content-type", content_type).body(text);
        }
        let response = req.send().await.unwrap();
        // A run's stream lasts as long as the run: that it opened is the answer.
        let streams = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if streams {
            return (response.status(), Value::Null);
        }
        json_of(response).await
    }

    /// The operation's JSON body with `property` set to `value`.
    fn body_with(&self, method: &str, path: &str, property: &str, value: Value) -> Value {
        let (text, _) = self.base_body(method, path).expect("a body");
        let mut body: Value = serde_json::from_str(&text).unwrap();
        body[property] = value;
        body
    }
}

#[derive(Default)]
struct Vary<'a> {
    path: Option<(&'a str, &'a str)>,
    query: Vec<(&'a str, String)>,
    headers: Vec<(&'a str, String)>,
    body: Option<Value>,
}

/// Refused for its shape: 422 `validation_failed`.
fn refused((s, v): &(StatusCode, Value)) -> bool {
    *s == StatusCode::UNPROCESSABLE_ENTITY && code(v) == "validation_failed"
}

/// Accepted as well formed: neither refused for its shape nor a server error (a well-formed
/// request may still name nothing, 404, or conflict, 409).
fn accepted((s, _): &(StatusCode, Value)) -> bool {
    *s != StatusCode::UNPROCESSABLE_ENTITY && !s.is_server_error()
}

/// Checks one documented value against the server; `send` sends a request with the value
/// in place, `describe` names it in messages. An integer must be bounded: at each bound it
/// is accepted, one past it refused. A string is refused empty exactly when the document
/// rules the empty string out (`minLength` >= 1, an `enum`, or a format empty text cannot
/// meet); one of `maxLength` characters is accepted and one longer refused (where a run of
/// `a`s can match its pattern: none, or the name rule). Returns how many values were tried.
async fn check_bounds<F, Fut>(contract: &Contract, schema: &Value, describe: &str, send: F) -> usize
where
    F: Fn(Value) -> Fut,
    Fut: std::future::Future<Output = (StatusCode, Value)>,
{
    let schema = contract.resolve(schema);
    let mut tried = 0;
    match Contract::type_of(schema) {
        "integer" => {
            let (Some(min), Some(max)) = (schema["minimum"].as_i64(), schema["maximum"].as_i64())
            else {
                panic!(
                    "{describe}: an integer is documented with a minimum and a maximum: {schema}"
                );
            };
            for (value, want_accepted) in [
                (i128::from(min), true),
                (i128::from(max), true),
                (i128::from(min) - 1, false),
                (i128::from(max) + 1, false),
            ] {
                let number: Value = serde_json::from_str(&value.to_string()).unwrap();
                let answer = send(number).await;
                if want_accepted {
                    assert!(
                        accepted(&answer),
                        "{describe} = {value} (a bound) is refused: {answer:?}"
                    );
                } else {
                    assert!(
                        refused(&answer),
                        "{describe} = {value} (past a bound) is not refused with 422: {answer:?}"
                    );
                }
                tried += 1;
            }
        }
        "string" => {
            let min_length = schema["minLength"].as_u64().unwrap_or(0);
            let excludes_empty = min_length >= 1
                || schema["enum"]
                    .as_array()
                    .is_some_and(|values| !values.contains(&json!("")))
                || matches!(schema["format"].as_str(), Some("date-time" | "uuid"));
            let answer = send(json!("")).await;
            if excludes_empty {
                assert!(
                    refused(&answer),
                    "{describe} = \"\" is documented as invalid but not refused with 422: {answer:?}"
                );
            } else {
                assert!(
                    accepted(&answer),
                    "{describe} = \"\" is documented as valid (no minLength) but refused: {answer:?}"
                );
            }
            tried += 1;
            let filler_fits = schema["pattern"].is_null()
                || schema["pattern"].as_str() == Some(rein_core::NAME_PATTERN);
            if let (Some(max), true) = (schema["maxLength"].as_u64(), filler_fits) {
                let answer = send(json!("a".repeat(max as usize))).await;
                assert!(
                    accepted(&answer),
                    "{describe} of {max} characters (the bound) is refused: {answer:?}"
                );
                let answer = send(json!("a".repeat(max as usize + 1))).await;
                assert!(
                    refused(&answer),
                    "{describe} of {} characters is not refused with 422: {answer:?}",
                    max + 1
                );
                tried += 2;
            }
        }
        _ => {}
    }
    tried
}

fn as_param(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_path_parameter_is_a_documented_422_on_every_operation() {
    let contract = Contract::start("api_contract_path").await;
    let detail_fields: Vec<&String> =
        contract.doc["components"]["schemas"]["ErrorDetail"]["properties"]
            .as_object()
            .expect("ErrorDetail is documented")
            .keys()
            .collect();
    let mut checked = 0;
    for (path, method, op) in contract.operations() {
        let params: Vec<&Value> = op["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["in"] == "path")
            .collect();
        if params.is_empty() {
            continue;
        }
        let documented = &op["responses"]["422"];
        assert_eq!(
            documented["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/ErrorBody",
            "{method} {path} documents its 422 with the error body: {documented}"
        );
        let fine = contract.send(&method, &path, Vary::default()).await;
        assert!(
            accepted(&fine),
            "{method} {path} with well-formed parameters: {fine:?}"
        );
        for param in params {
            let name = param["name"].as_str().unwrap();
            let schema = contract.resolve(&param["schema"]);
            let malformed = if schema["format"] == "uuid" {
                "not-a-uuid"
            } else {
                assert!(
                    schema["pattern"].is_string(),
                    "{method} {path}: path parameter `{name}` documents its shape: {schema}"
                );
                "not%20a%20name"
            };
            let vary = Vary {
                path: Some((name, malformed)),
                ..Vary::default()
            };
            let (s, v) = contract.send(&method, &path, vary).await;
            assert!(
                refused(&(s, v.clone())),
                "{method} {path} with {name} = {malformed}: {s} {v}"
            );
            let fields: Vec<&String> = v["error"]
                .as_object()
                .expect("an error body")
                .keys()
                .collect();
            assert_eq!(
                fields, detail_fields,
                "{method} {path}: the documented error body: {v}"
            );
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "{v}"
            );
            checked += 1;
        }
    }
    // Run, why, usage, events (get and send), stream, rerun, fork, redact, grant, deny,
    // definition, its current version, its migration, brief, verify, what-if, resolve, blob.
    assert_eq!(
        checked, 19,
        "every operation with a path parameter was checked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_query_and_header_bounds_are_the_bounds_the_server_enforces() {
    let contract = Contract::start("api_contract_params").await;
    let mut tried = 0;
    let mut integers = 0;
    for (path, method, op) in contract.operations() {
        for param in op["parameters"].as_array().into_iter().flatten() {
            let name = param["name"].as_str().unwrap();
            let place = param["in"].as_str().unwrap();
            if place == "path" {
                continue;
            }
            let schema = &param["schema"];
            if Contract::type_of(contract.resolve(schema)) == "integer" {
                integers += 1;
            }
            let describe = format!("{method} {path} {place} parameter {name}");
            tried += check_bounds(&contract, schema, &describe, |value| {
                let (path, method) = (path.clone(), method.clone());
                let contract = &contract;
                async move {
                    let vary = match place {
                        "query" => Vary {
                            query: vec![(name, as_param(&value))],
                            ..Vary::default()
                        },
                        "header" => Vary {
                            headers: vec![(name, as_param(&value))],
                            ..Vary::default()
                        },
                        other => panic!("parameter in {other}"),
                    };
                    contract.send(&method, &path, vary).await
                }
            })
            .await;
        }
    }
    // limit of runs, approvals and events, after of events, version of a definition, after
    // and Last-Event-ID of a stream, limit of webhook deliveries.
    assert_eq!(integers, 8, "the integer parameters were found");
    // The six filters of runs, two of approvals, a definition's version, a document's
    // format, enqueue's Idempotency-Key, the two of events.
    assert!(tried >= 30, "only {tried} values tried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_body_bounds_are_the_bounds_the_server_enforces() {
    let contract = Contract::start("api_contract_bodies").await;
    let mut tried = 0;
    for (path, method, op) in contract.operations() {
        let schema = &op["requestBody"]["content"]["application/json"]["schema"];
        if schema.is_null() {
            continue;
        }
        let body = contract.resolve(schema);
        for (property, schema) in body["properties"].as_object().into_iter().flatten() {
            let describe = format!("{method} {path} body field {property}");
            tried += check_bounds(&contract, schema, &describe, |value| {
                let (path, method) = (path.clone(), method.clone());
                let contract = &contract;
                async move {
                    let body = contract.body_with(&method, &path, property, value);
                    let vary = Vary {
                        body: Some(body),
                        ..Vary::default()
                    };
                    contract.send(&method, &path, vary).await
                }
            })
            .await;
        }
    }
    // Enqueue's definition, version, queue, priority; a sent event's type; a decision's
    // comment (grant and deny); the current version of a definition.
    assert!(tried >= 27, "only {tried} values tried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_version_the_database_cannot_store_is_refused_not_a_server_error() {
    let api = Api::start("api_def_version", &[]).await;
    let token = api.token("ci", &["publish", "read"]);
    let (s, v) = api.get_json("/v1/definitions/chain4", &token).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let mut spec = v["spec"].clone();
    spec["name"] = json!("chain4-big");
    spec["version"] = json!(u64::from(rein_core::limits::VERSION_MAX) + 1);
    let (s, v) = api.post_json("/v1/definitions", &token, &spec).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
        "{v}"
    );
    assert_eq!(
        v["error"]["details"]["problems"][0]["item"], "version",
        "{v}"
    );
    // The highest version it can store registers.
    spec["version"] = json!(rein_core::limits::VERSION_MAX);
    let (s, v) = api.post_json("/v1/definitions", &token, &spec).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

/// A definition whose one waiting state takes `nudge` from outside and stays: every nudge is
/// one more event in the run's log.
const NUDGED: &str = r#"
name = "nudged"
version = 1
description = "Waits; every nudge is one more event in its log."
cancel_state = "cancelled"
events = ["nudge"]
call_results = []
external_events = ["nudge"]

[[states]]
name = "waiting"
kind = "waiting"
initial = true

[[states]]
name = "cancelled"
kind = "terminal"
outcome = "failed"

[[transitions]]
from = "waiting"
event = "nudge"
to = "waiting"
"#;

/// The response of `GET path`: status, the named headers, and the body.
async fn page_of(
    api: &Api,
    path: &str,
    token: &str,
    headers: [&str; 2],
) -> (StatusCode, [Option<String>; 2], Value, usize) {
    let r = api.get(path, Some(token)).send().await.unwrap();
    let found = headers.map(|h| r.headers().get(h).map(|v| v.to_str().unwrap().to_owned()));
    let status = r.status();
    let text = r.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, found, body, text.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_runs_leaves_their_data_out_and_stops_at_its_byte_bound() {
    let bound = 64 * 1024;
    let api = Api::start("api_list_bytes", &["--page-bytes-max", &bound.to_string()]).await;
    let token = api.token("reader", &["read"]);
    let def = api.store.load_definition("chain4", None).await.unwrap();
    let blob = "x".repeat(20 * 1024);
    let mut enqueued = Vec::new();
    for i in 0..12 {
        let input = json!({ "i": i, "blob": blob });
        let done = api
            .store
            .enqueue(EnqueueRequest::new(def.clone(), input))
            .await
            .unwrap();
        enqueued.push(done.run_id.to_string());
    }
    let headers = ["rein-next-cursor", "rein-page-truncated"];

    // Without `data`, every run fits: the list is its state, not its business data.
    let (s, [next, truncated], v, bytes) =
        page_of(&api, "/v1/runs?limit=12", &token, headers).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 12);
    assert!(rows.iter().all(|r| r.get("data").is_none()), "{v}");
    assert!(rows.iter().all(|r| r["state"] == "step1"), "{v}");
    assert_eq!((next, truncated), (None, None));
    assert!(bytes < bound, "{bytes} bytes");
    // One run keeps its data.
    let (_, run) = api
        .get_json(&format!("/v1/runs/{}", enqueued[0]), &token)
        .await;
    assert_eq!(run["data"]["blob"], blob.as_str());

    // With `data`, a page stops at the bound and says so; the cursor goes on from there.
    let mut path = "/v1/runs?limit=12&data=true".to_owned();
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let (s, [next, truncated], v, bytes) = page_of(&api, &path, &token, headers).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let rows = v.as_array().unwrap();
        pages += 1;
        assert!(!rows.is_empty());
        assert!(
            bytes <= bound + 25 * 1024,
            "page {pages}: {bytes} bytes for a bound of {bound}"
        );
        for row in rows {
            assert_eq!(row["data"]["blob"], blob.as_str());
            seen.push(row["run_id"].as_str().unwrap().to_owned());
        }
        let Some(next) = next else {
            assert_eq!(truncated, None, "the last page holds the rest");
            break;
        };
        if seen.len() < 12 {
            assert_eq!(truncated.as_deref(), Some("bytes"), "page {pages}");
        }
        path = format!("/v1/runs?limit=12&data=true&cursor={next}");
    }
    assert!(
        pages >= 4,
        "12 runs of 20 KiB in pages of 64 KiB: {pages} pages"
    );
    seen.sort();
    enqueued.sort();
    assert_eq!(seen, enqueued, "each run exactly once");

    // A run larger than the bound still comes, alone on its page.
    let huge = json!({ "blob": "y".repeat(100 * 1024) });
    api.store
        .enqueue(EnqueueRequest::new(def.clone(), huge))
        .await
        .unwrap();
    let (s, [next, truncated], v, _) =
        page_of(&api, "/v1/runs?limit=5&data=true", &token, headers).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v.as_array().unwrap().len(), 1, "the newest run alone");
    assert!(next.is_some());
    assert_eq!(truncated.as_deref(), Some("bytes"));
    let (s, v) = api.get_json("/v1/runs?data=maybe", &token).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_events_come_in_pages_and_the_cli_reads_them_all() {
    let bound = 64 * 1024;
    let api = Api::start("api_event_pages", &["--page-bytes-max", &bound.to_string()]).await;
    let token = api.token("ops", &["read", "operate"]);
    let (s, v) = json_of(
        api.post(
            "/v1/definitions?format=toml",
            &api.token("admin", &["admin"]),
        )
        .body(NUDGED)
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let def = api.store.load_definition("nudged", None).await.unwrap();
    let run = api
        .store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .unwrap()
        .run_id;
    let nudge = |payload: Value| {
        let (api, token) = (&api, &token);
        async move {
            let body = json!({"type": "nudge", "payload": payload});
            let (s, v) = api
                .post_json(&format!("/v1/runs/{run}/events"), token, &body)
                .await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
    };
    for i in 0..25 {
        nudge(json!({ "i": i })).await;
    }
    let headers = ["rein-next-after", "rein-page-truncated"];
    let events = format!("/v1/runs/{run}/events");

    // Pages of 10 in order; the header names where the next one starts.
    let mut after = None;
    let mut sequences: Vec<i64> = Vec::new();
    for want in [10, 10, 5] {
        let path = match after {
            Some(a) => format!("{events}?limit=10&after={a}"),
            None => format!("{events}?limit=10"),
        };
        let (s, [next, truncated], v, _) = page_of(&api, &path, &token, headers).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(truncated, None);
        let page: Vec<i64> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["sequence"].as_i64().unwrap())
            .collect();
        assert_eq!(page.len(), want, "{v}");
        sequences.extend(&page);
        after = next.map(|n| n.parse::<i64>().unwrap());
        if want == 5 {
            assert_eq!(after, None, "no next page after the last");
        } else {
            assert_eq!(after, page.last().copied());
        }
    }
    assert_eq!(sequences, (1..=25).collect::<Vec<i64>>());
    // The default page (100) holds them all.
    let (_, [next, _], v, _) = page_of(&api, &events, &token, headers).await;
    assert_eq!((v.as_array().unwrap().len(), next), (25, None));
    for bad in ["after=-1", "limit=0", "limit=1001", "after=x"] {
        let (s, v) = api.get_json(&format!("{events}?{bad}"), &token).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
            "{bad}: {v}"
        );
    }

    // Large payloads: pages stop at the byte bound, and `rein runs history` still shows the
    // whole log, through the API as through the database.
    let blob = "z".repeat(20 * 1024);
    for _ in 0..6 {
        nudge(json!({ "blob": blob })).await;
    }
    let (_, [next, truncated], v, bytes) =
        page_of(&api, &format!("{events}?after=25"), &token, headers).await;
    assert!(v.as_array().unwrap().len() < 6, "{v}");
    assert_eq!(truncated.as_deref(), Some("bytes"));
    assert!(next.is_some());
    assert!(bytes <= bound + 25 * 1024, "{bytes}");
    let history = |env: &[(&str, &str)]| {
        let out = common::rein_with(&["runs", "history", &run.to_string(), "--json"], env);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        serde_json::from_str::<Value>(&stdout(&out)).unwrap()
    };
    let through_api = history(&[("REIN_URL", &api.base), ("REIN_TOKEN", &token)]);
    let sequences: Vec<i64> = through_api
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["sequence"].as_i64().unwrap())
        .collect();
    assert_eq!(sequences, (1..=31).collect::<Vec<i64>>());
    assert_eq!(through_api, history(&[("DATABASE_URL", &api.url)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_json_object_is_a_request_body() {
    let api = Api::start("api_object_bodies", &[]).await;
    let token = api.token("ci", &["admin"]);
    let (run, approval) = common::waiting_approval(&api.store).await;
    let (_, definition) = api.get_json("/v1/definitions/chain4", &token).await;
    let fields: Vec<Value> = definition["spec"]
        .as_object()
        .unwrap()
        .values()
        .cloned()
        .collect();
    for (path, body) in [
        ("/v1/runs".to_owned(), json!(["lifecycle", null, {}])),
        ("/v1/runs".to_owned(), json!("lifecycle")),
        (format!("/v1/runs/{run}/events"), json!(["CANCEL", {}])),
        (format!("/v1/approvals/{approval}/deny"), json!([null])),
        (format!("/v1/approvals/{approval}/grant"), json!(null)),
        ("/v1/definitions".to_owned(), Value::Array(fields)),
    ] {
        let (s, v) = api.post_json(&path, &token, &body).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
            "POST {path} {body}: {v}"
        );
    }
    assert_eq!(
        api.store.run_totals().await.unwrap().0,
        1,
        "no run was made"
    );
    assert_eq!(
        api.store.approval(approval).await.unwrap().status,
        "pending"
    );
    assert_eq!(api.store.run(run).await.unwrap().state, "WAITING_APPROVAL");
    // An object is still a body, and so is nothing at all.
    let (s, v) = api
        .post_json(
            &format!("/v1/approvals/{approval}/grant"),
            &token,
            &json!({}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_on_an_api_without_redis_are_an_empty_list_saying_none_are_configured() {
    let api = Api::start("limits_no_redis", &[]).await;
    let token = api.token("viewer", &["read"]);
    let r = api.get("/v1/limits", Some(&token)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()
            .get("rein-fleet-limits")
            .and_then(|v| v.to_str().ok()),
        Some("none")
    );
    assert_eq!(r.json::<Value>().await.unwrap(), json!([]));
    // Keys are still checked.
    let r = api
        .get("/v1/limits?keys=not%20a%20key", Some(&token))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
}
