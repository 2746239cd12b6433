//! The web console's side of `rein api`: its files are served without a token under a strict
//! Content-Security-Policy, from the binary or from `--console-dir`, never from outside that
//! directory; and the API answers what the console asks (`GET /v1/me`, the run filters, each
//! run's newest event).

use crate::common;

use common::{Api, code, json_of, rein, stderr};
use rein_store::EnqueueRequest;
use reqwest::StatusCode;
use serde_json::json;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_console_is_served_without_a_token_under_a_strict_policy() {
    let api = Api::start("console_embedded", &[]).await;
    for path in ["/", "/console/index.html"] {
        let r = api.get(path, None).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{path}");
        let headers = r.headers().clone();
        assert_eq!(
            headers["content-type"], "text/html; charset=utf-8",
            "{path}"
        );
        let policy = headers["content-security-policy"].to_str().unwrap();
        for part in [
            "default-src 'self'",
            "script-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(policy.contains(part), "{path}: {policy}");
        }
        assert!(!policy.contains("unsafe-inline"), "{policy}");
        assert_eq!(headers["x-content-type-options"], "nosniff");
        let body = r.text().await.unwrap();
        assert!(body.contains("<html"), "{path}: {body}");
    }
    let (s, v) = json_of(api.get("/console/no-such.js", None).send().await.unwrap()).await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    // The console's paths open nothing else: the API still wants a token.
    let (s, _) = json_of(api.get("/v1/runs", None).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_dir_is_read_on_every_request_and_never_left() {
    let root = temp_dir("console_dir");
    let dir = root.join("console");
    std::fs::create_dir_all(dir.join("views")).unwrap();
    std::fs::write(root.join("secret.txt"), "outside").unwrap();
    std::fs::write(dir.join("index.html"), "<html>one</html>").unwrap();
    std::fs::write(dir.join("views/a.js"), "export const a = 1;").unwrap();
    let api = Api::start("console_dir", &["--console-dir", dir.to_str().unwrap()]).await;

    let page = |api: &Api| {
        let r = api.get("/", None);
        async move { r.send().await.unwrap().text().await.unwrap() }
    };
    assert_eq!(page(&api).await, "<html>one</html>");
    std::fs::write(dir.join("index.html"), "<html>two</html>").unwrap();
    assert_eq!(
        page(&api).await,
        "<html>two</html>",
        "read again, not cached"
    );

    let r = api.get("/console/views/a.js", None).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["content-type"],
        "text/javascript; charset=utf-8"
    );

    // `..` arrives encoded, so no URL normalisation removes it before the server sees it.
    for path in [
        "/console/..%2fsecret.txt",
        "/console/views%2f..%2f..%2fsecret.txt",
        "/console/%2e%2e%2fsecret.txt",
        "/console/%2fetc%2fpasswd",
    ] {
        let r = api.get(path, None).send().await.unwrap();
        let status = r.status();
        let body = r.text().await.unwrap();
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
        assert!(!body.contains("outside"), "{path}: {body}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_console_serves_none_and_a_console_dir_needs_its_page() {
    let api = Api::start("console_off", &["--no-console"]).await;
    let (s, v) = json_of(api.get("/", None).send().await.unwrap()).await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    let (s, _) = json_of(api.get("/healthz", None).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK);

    let empty = temp_dir("console_empty");
    let out = rein(&[
        "api",
        "--database-url",
        &api.url,
        "--listen",
        "127.0.0.1:0",
        "--console-dir",
        empty.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no index.html there"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_dir_all(&empty);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn me_names_the_tokens_subject_scopes_and_bounds() {
    let api = Api::start("console_me", &[]).await;
    let reader = api.token("ana", &["read"]);
    let (s, v) = json_of(api.get("/v1/me", Some(&reader)).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["subject"], "ana");
    assert_eq!(v["scopes"], json!(["read"]));
    assert!(v["queues"].is_null(), "{v}");
    let bound = common::token_with(
        &api.url,
        "bo",
        &["approve", "read"],
        &["--queue", "refunds", "--max-priority", "5"],
    );
    let (s, v) = json_of(api.get("/v1/me", Some(&bound)).send().await.unwrap()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["subject"], "bo");
    assert_eq!(v["queues"], json!(["refunds"]));
    assert_eq!(v["priority_max"], 5);
    let (s, v) = json_of(api.get("/v1/me", None).send().await.unwrap()).await;
    assert_eq!((s, code(&v)), (StatusCode::UNAUTHORIZED, "unauthorized"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_filter_by_state_queue_parent_and_id_prefix_and_carry_their_newest_event() {
    let api = Api::start("console_filters", &[]).await;
    let token = api.token("reader", &["read"]);
    let def = api.store.load_definition("chain4", None).await.unwrap();
    let initial = def.initial_state().to_owned();
    let mut ids = Vec::new();
    for queue in ["alpha", "alpha", "beta"] {
        let mut request = EnqueueRequest::new(def.clone(), json!({}));
        request.queue = queue.to_owned();
        ids.push(api.store.enqueue(request).await.unwrap().run_id);
    }
    let mut child = EnqueueRequest::new(def.clone(), json!({}));
    child.queue = "beta".to_owned();
    child.parent_run_id = Some(ids[0]);
    let child = api.store.enqueue(child).await.unwrap().run_id;

    let listed = |query: String| {
        let r = api.get(&format!("/v1/runs?{query}"), Some(&token));
        async move {
            let (s, v) = json_of(r.send().await.unwrap()).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            let mut found: Vec<uuid::Uuid> = v
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["run_id"].as_str().unwrap().parse().unwrap())
                .collect();
            found.sort();
            found
        }
    };
    let sorted = |mut v: Vec<uuid::Uuid>| {
        v.sort();
        v
    };
    assert_eq!(
        listed("queue=alpha".into()).await,
        sorted(ids[..2].to_vec())
    );
    assert_eq!(
        listed("queue=beta".into()).await,
        sorted(vec![ids[2], child])
    );
    assert_eq!(listed(format!("state={initial}")).await.len(), 4);
    assert!(listed("state=NOWHERE".into()).await.is_empty());
    assert_eq!(listed(format!("parent={}", ids[0])).await, vec![child]);
    let whole = ids[1].to_string();
    assert_eq!(listed(format!("id_prefix={whole}")).await, vec![ids[1]]);
    // Eight hex digits of a UUIDv7 are its creation time: all four share them or follow.
    let prefix = &whole[..8];
    assert!(
        listed(format!("id_prefix={prefix}"))
            .await
            .contains(&ids[1])
    );
    let mut other = whole.clone();
    let last = other.pop().unwrap();
    other.push(if last == '0' { '1' } else { '0' });
    assert!(listed(format!("id_prefix={other}")).await.is_empty());

    for bad in [
        "id_prefix=xyz",
        "id_prefix=",
        "state=",
        "queue=a%20b",
        "parent=nope",
    ] {
        let (s, v) = json_of(
            api.get(&format!("/v1/runs?{bad}"), Some(&token))
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

    // Each run says its queue, priority, parent and newest event, listed and alone: none
    // before its first event, then the newest.
    let (_, v) = json_of(api.get("/v1/runs", Some(&token)).send().await.unwrap()).await;
    for run in v.as_array().unwrap() {
        assert_eq!(run["sequence"], 0, "{run}");
        assert!(run["last_event"].is_null(), "{run}");
        assert!(run["queue"].is_string(), "{run}");
    }
    let operator = api.token("op", &["operate"]);
    let (s, v) = json_of(
        api.post(&format!("/v1/runs/{child}/events"), &operator)
            .json(&json!({"type": "CANCEL", "payload": {"reason": "filters test"}}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, v) = json_of(
        api.get(&format!("/v1/runs/{child}"), Some(&token))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(v["queue"], "beta", "{v}");
    assert_eq!(v["parent_run_id"], json!(ids[0]), "{v}");
    assert_eq!(v["priority"], 0, "{v}");
    let sequence = v["sequence"].as_i64().unwrap();
    assert_eq!(v["last_event"]["sequence"], sequence, "{v}");
    assert!(v["last_event"]["type"].is_string(), "{v}");
    assert!(sequence >= 1, "{v}");
    let history = api.store.history(child).await.unwrap();
    assert_eq!(
        v["last_event"]["type"],
        history.last().unwrap().kind.as_str(),
        "{v}"
    );
    let (_, v) = json_of(
        api.get(&format!("/v1/runs?parent={}", ids[0]), Some(&token))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(v[0]["last_event"]["sequence"], sequence, "{v}");
}
