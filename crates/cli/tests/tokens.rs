//! What a token may reach (SPEC Z4), through the real `rein api` on real PostgreSQL: tokens
//! bound to queues and a priority ceiling, quotas on runs in flight and on the enqueue rate,
//! subjects and senders that cannot drive a terminal, and a token the command line never
//! shows.

use crate::common;

use common::{Api, code, json_of, rein, rein_with, stderr, stdout};
use rein_store::{EnqueueRequest, Store};
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

/// POSTs an enqueue of research-agent with `fields` added to the body.
async fn enqueue(api: &Api, token: &str, fields: Value) -> (StatusCode, Value) {
    let mut body = json!({"definition": "research-agent", "input": {"topic": "t"}});
    if let (Some(body), Some(fields)) = (body.as_object_mut(), fields.as_object()) {
        body.extend(fields.clone());
    }
    api.post_json("/v1/runs", token, &body).await
}

/// POSTs a plain enqueue of research-agent, with `key` as its Idempotency-Key.
async fn enqueue_raw(api: &Api, token: &str, key: Option<&str>) -> reqwest::Response {
    let mut request = api
        .post("/v1/runs", token)
        .json(&json!({"definition": "research-agent"}));
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.unwrap()
}

fn run_id(v: &Value) -> Uuid {
    v["run_id"]
        .as_str()
        .unwrap_or_default()
        .parse()
        .expect("a run id")
}

/// A research-agent run in `queue`, made on the database.
async fn run_in(store: &Store, queue: &str) -> Uuid {
    let def = store.load_definition("research-agent", None).await.unwrap();
    let mut request = EnqueueRequest::new(def, json!({}));
    request.queue = queue.to_owned();
    store.enqueue(request).await.unwrap().run_id
}

async fn runs_count(store: &Store) -> usize {
    store.list_runs(None, None, 1000).await.unwrap().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_bound_token_enqueues_only_into_its_queues() {
    let api = Api::start("tok_queues", &[]).await;
    let tenant = common::token_with(
        &api.url,
        "tenant-a",
        &["enqueue"],
        &["--queue", "tenant-a", "--queue", "tenant-a-bulk"],
    );

    // No queue named: the token's first queue.
    let (s, v) = enqueue(&api, &tenant, json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(api.store.run(run_id(&v)).await.unwrap().queue, "tenant-a");
    let (s, v) = enqueue(&api, &tenant, json!({"queue": "tenant-a-bulk"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(
        api.store.run(run_id(&v)).await.unwrap().queue,
        "tenant-a-bulk"
    );

    for queue in ["payments", "default"] {
        let (s, v) = enqueue(&api, &tenant, json!({"queue": queue})).await;
        assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
        assert_eq!(v["error"]["details"]["queue"], queue);
        assert_eq!(
            v["error"]["details"]["allowed_queues"],
            json!(["tenant-a", "tenant-a-bulk"])
        );
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("`tenant-a`, `tenant-a-bulk`") && message.contains(queue),
            "{message}"
        );
    }
    assert_eq!(runs_count(&api.store).await, 2, "nothing else was created");

    // A token without bounds keeps reaching every queue.
    let free = api.token("platform", &["enqueue"]);
    let (s, v) = enqueue(&api, &free, json!({"queue": "payments"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = enqueue(&api, &free, json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(api.store.run(run_id(&v)).await.unwrap().queue, "default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priority_above_the_tokens_ceiling_is_refused() {
    let api = Api::start("tok_priority", &[]).await;
    let tenant = common::token_with(&api.url, "tenant", &["enqueue"], &["--max-priority", "10"]);

    let (s, v) = enqueue(&api, &tenant, json!({"priority": 10})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = enqueue(&api, &tenant, json!({"priority": -5})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    for priority in [11, 2_147_483_647] {
        let (s, v) = enqueue(&api, &tenant, json!({"priority": priority})).await;
        assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
        assert_eq!(v["error"]["details"]["priority_max"], 10);
        assert_eq!(v["error"]["details"]["priority"], priority);
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("at most 10"),
            "{v}"
        );
    }
    assert_eq!(runs_count(&api.store).await, 2);

    let free = api.token("platform", &["enqueue"]);
    let (s, v) = enqueue(&api, &free, json!({"priority": 2_147_483_647})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_bound_token_acts_on_no_run_outside_its_queues() {
    let api = Api::start("tok_reach", &[]).await;
    let tenant = common::token_with(
        &api.url,
        "tenant",
        &["enqueue", "operate", "approve"],
        &["--queue", "tenant", "--max-priority", "5"],
    );
    let theirs = run_in(&api.store, "payments").await;
    let ours = run_in(&api.store, "tenant").await;

    // Events: refused outside, applied inside.
    let (s, v) = api
        .post_json(
            &format!("/v1/runs/{theirs}/events"),
            &tenant,
            &json!({"type": "CANCEL", "payload": {"reason": "mine now"}}),
        )
        .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(v["error"]["details"]["queue"], "payments");
    assert_eq!(api.store.run(theirs).await.unwrap().status, "runnable");
    let (s, v) = api
        .post_json(
            &format!("/v1/runs/{ours}/events"),
            &tenant,
            &json!({"type": "CANCEL", "payload": {"reason": "done"}}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");

    // Reruns: another queue's finished run is refused, its own is run again.
    common::cancel(&api.store, theirs).await;
    let (s, v) = api
        .post_json(&format!("/v1/runs/{theirs}/rerun"), &tenant, &json!({}))
        .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    let (s, v) = api
        .post_json(&format!("/v1/runs/{ours}/rerun"), &tenant, &json!({}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(api.store.run(run_id(&v)).await.unwrap().queue, "tenant");

    // A run of its queue above its priority ceiling cannot be rerun through it either.
    let def = api
        .store
        .load_definition("research-agent", None)
        .await
        .unwrap();
    let mut urgent = EnqueueRequest::new(def, json!({}));
    urgent.queue = "tenant".into();
    urgent.priority = 100;
    let urgent = api.store.enqueue(urgent).await.unwrap().run_id;
    common::cancel(&api.store, urgent).await;
    let (s, v) = api
        .post_json(&format!("/v1/runs/{urgent}/rerun"), &tenant, &json!({}))
        .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(v["error"]["details"]["priority_max"], 5);

    // Approvals: another queue's request is not its to decide.
    let (run, approval) = common::waiting_approval(&api.store).await;
    assert_eq!(api.store.run(run).await.unwrap().queue, "default");
    let (s, v) = api
        .post_json(
            &format!("/v1/approvals/{approval}/grant"),
            &tenant,
            &json!({}),
        )
        .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(
        api.store.approval(approval).await.unwrap().status,
        "pending"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_in_flight_are_capped_per_token_until_one_finishes() {
    let api = Api::start("tok_in_flight", &[]).await;
    let tenant = common::token_with(
        &api.url,
        "tenant",
        &["enqueue", "operate"],
        &["--max-in-flight", "2"],
    );
    let first = enqueue_raw(&api, &tenant, Some("order-1")).await;
    let (s, v) = json_of(first).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let first = run_id(&v);
    let (s, v) = enqueue(&api, &tenant, json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    let refused = enqueue_raw(&api, &tenant, None).await;
    assert_eq!(refused.headers()["retry-after"], "5");
    let (s, v) = json_of(refused).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"),
        "{v}"
    );
    assert_eq!(
        v["error"]["details"],
        json!({"quota": "in_flight", "limit": 2, "retry_after_s": 5})
    );
    assert_eq!(
        runs_count(&api.store).await,
        2,
        "the refused run is not kept"
    );

    // The same key again returns its run: a retry creates nothing, so no quota stops it.
    let again = enqueue_raw(&api, &tenant, Some("order-1")).await;
    let (s, v) = json_of(again).await;
    assert_eq!((s, run_id(&v)), (StatusCode::OK, first), "{v}");

    // Another token, and the database route, are not held to this token's quota.
    let other = api.token("other", &["enqueue"]);
    let (s, v) = enqueue(&api, &other, json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    // Once one of its runs finishes, the token may enqueue again; a rerun counts too.
    common::cancel(&api.store, first).await;
    let (s, v) = api
        .post_json(&format!("/v1/runs/{first}/rerun"), &tenant, &json!({}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = enqueue(&api, &tenant, json!({})).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"),
        "{v}"
    );

    // Through the CLI the refusal is a refusal (exit 2) that says what to do.
    let out = rein_with(
        &["enqueue", "--definition", "research-agent"],
        &[("REIN_URL", &api.base), ("REIN_TOKEN", &tenant)],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("unfinished runs, its quota of runs in flight"),
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_enqueue_rate_is_capped_per_token_by_the_minute() {
    let api = Api::start("tok_rate", &[]).await;
    let tenant = common::token_with(
        &api.url,
        "tenant",
        &["enqueue"],
        &["--max-enqueue-per-minute", "3"],
    );
    let mut made = Vec::new();
    for _ in 0..3 {
        let (s, v) = enqueue(&api, &tenant, json!({})).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        made.push(run_id(&v));
    }
    // Finished runs still count: the quota is on creating them.
    for run in made {
        common::cancel(&api.store, run).await;
    }
    let refused = enqueue_raw(&api, &tenant, None).await;
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let (s, v) = json_of(refused).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"),
        "{v}"
    );
    assert_eq!(v["error"]["details"]["quota"], "enqueue_per_minute");
    assert_eq!(v["error"]["details"]["limit"], 3);
    assert_eq!(v["error"]["details"]["retry_after_s"], retry_after);
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    assert_eq!(runs_count(&api.store).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_holds_across_api_processes_sharing_the_database() {
    let mut api = Api::start("tok_shared", &[]).await;
    let second = api
        .fleet
        .spawn_server("api2", &["api", "--listen", "127.0.0.1:0"]);
    let tenant = common::token_with(&api.url, "tenant", &["enqueue"], &["--max-in-flight", "4"]);
    let bases = [api.base.clone(), second];
    let asks = (0..16).map(|i| {
        let request = api
            .http
            .post(format!("{}/v1/runs", bases[i % 2]))
            .bearer_auth(&tenant)
            .json(&json!({"definition": "research-agent"}));
        async move { request.send().await.unwrap().status() }
    });
    let statuses = futures_join(asks.collect()).await;
    let created = statuses
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count();
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((created, refused), (4, 12), "{statuses:?}");
    assert_eq!(runs_count(&api.store).await, 4);
}

/// Awaits every future at once, in order of the list.
async fn futures_join<F: std::future::Future<Output = StatusCode> + Send + 'static>(
    futures: Vec<F>,
) -> Vec<StatusCode> {
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[test]
fn tokens_create_refuses_bad_bounds() {
    for (args, says) in [
        (vec!["--queue", "pay ments"], "a token's queue"),
        (vec!["--queue", ""], "a token's queue"),
        (vec!["--max-in-flight", "0"], "--max-in-flight"),
        (
            vec!["--max-enqueue-per-minute", "0"],
            "--max-enqueue-per-minute",
        ),
        (vec!["--max-priority", "high"], "--max-priority"),
    ] {
        let mut all = vec![
            "tokens",
            "create",
            "--database-url",
            "postgres://nowhere/x",
            "--scope",
            "enqueue",
            "--subject",
            "a",
        ];
        all.extend_from_slice(&args);
        let out = rein(&all);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_with_control_characters_is_refused_at_creation() {
    let (url, store) = common::fresh_store("tok_subject").await;
    for subject in [
        "alice\nINFO forged log line",
        "bob\u{1b}[2J",
        "eve\u{202e}gpj.exe",
    ] {
        let out = rein(&[
            "tokens",
            "create",
            "--database-url",
            &url,
            "--scope",
            "read",
            "--subject",
            subject,
        ]);
        assert_eq!(out.status.code(), Some(1), "{subject:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("control character"),
            "{subject:?}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "no secret is printed");
        assert!(
            store
                .create_token(subject, &["read".to_owned()])
                .await
                .is_err(),
            "{subject:?}"
        );
    }
    // The table refuses one too, whoever writes it (C0 and C1 controls alike).
    for subject in ["mallory\u{7}", "csi\u{9b}31m"] {
        let raw = sqlx::query(
            "INSERT INTO rein_tokens (token_id, subject, scopes, token_hash)
             VALUES ($1, $2, ARRAY['read'], $3)",
        )
        .bind(Uuid::now_v7())
        .bind(subject)
        .bind(subject)
        .execute(store.pool())
        .await;
        let refused = format!("{raw:?}");
        assert!(
            refused.contains("rein_tokens_subject_printable"),
            "{subject:?}: {refused}"
        );
    }
    // Printable subjects, accents and all, are fine.
    common::token(&url, "Zoë Ünal (payments)", &["read"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_would_drive_the_terminal_is_refused_and_old_ones_print_escaped() {
    let (url, store) = common::fresh_store("tok_sender").await;
    let run = run_in(&store, "default").await;
    let out = rein(&[
        "send",
        "--database-url",
        &url,
        &run.to_string(),
        "CANCEL",
        "--as",
        "ops\u{1b}]0;pwned\u{7}",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("control character"),
        "{}",
        stderr(&out)
    );
    assert_eq!(store.run(run).await.unwrap().last_sequence, 0);

    // An event stored before senders were checked still shows, escaped, on one line.
    sqlx::query(
        "INSERT INTO rein_events (run_id, sequence, event_id, type, payload, schema_version,
                                  fencing_token, worker, sender)
         VALUES ($1, 1, $2, 'CANCEL', '{}', 1, 0, 'api', $3)",
    )
    .bind(run)
    .bind(Uuid::now_v7())
    .bind("api:bob\u{1b}[2J\n    2  FORGED")
    .execute(store.pool())
    .await
    .unwrap();
    let out = rein(&["runs", "history", "--database-url", &url, &run.to_string()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(!text.contains('\u{1b}'), "{text:?}");
    assert_eq!(text.lines().count(), 2, "a header and one event: {text:?}");
    assert!(text.contains("api:bob\\u{1b}[2J\\u{a}"), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_token_can_come_from_a_file_and_the_flag_warns() {
    let api = Api::start("tok_file", &[]).await;
    let token = api.token("reader", &["read"]);
    let dir = common::tmp_dir("tok_file_secrets");
    let file = dir.join("token");
    std::fs::write(&file, format!("{token}\n")).unwrap();
    let file = file.to_str().unwrap().to_owned();
    let list = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["runs", "list", "--api-url", &api.base];
        args.extend_from_slice(extra);
        rein_with(&args, env)
    };

    let out = list(&["--api-token-file", &file], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
    // The file wins over REIN_TOKEN.
    let out = list(
        &["--api-token-file", &file],
        &[("REIN_TOKEN", "rein_wrong")],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let out = list(&["--api-token", &token], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let warned = stderr(&out);
    assert!(
        warned.contains("warning: --api-token") && warned.contains("--api-token-file"),
        "{warned}"
    );
    assert!(
        !warned.contains(&token),
        "the warning does not repeat the secret"
    );
    let out = list(&[], &[("REIN_TOKEN", &token)]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));

    let empty = dir.join("empty");
    std::fs::write(&empty, "\n").unwrap();
    let large = dir.join("large");
    std::fs::write(&large, "x".repeat(5000)).unwrap();
    let missing = dir.join("missing");
    for (path, says) in [
        (&empty, "is empty"),
        (&large, "larger than 4096 bytes"),
        (&missing, "cannot read --api-token-file"),
        (&dir, "cannot read --api-token-file"),
    ] {
        let out = list(&["--api-token-file", path.to_str().unwrap()], &[]);
        assert_eq!(out.status.code(), Some(1), "{path:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{path:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty());
    }
    let out = list(&["--api-token-file", &file, "--api-token", &token], &[]);
    assert_eq!(out.status.code(), Some(1), "both at once: {}", stderr(&out));
}
