//! Webhooks against real PostgreSQL and real `rein scheduler` processes: the facts a run
//! commits (approval requests, decisions, reminders, expiry, its end) queue signed
//! deliveries in the same transaction, and schedulers POST them to a receiver in the test
//! that checks each signature, records what arrived, and can be told to fail or hang.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use common::{Fleet, rein_with, stderr, stdout, wait_for};
use rein_store::{EnqueueRequest, Store, WebhookDelivery};
use serde_json::{Value, json};
use uuid::Uuid;

const SECRET: &str = "a-webhook-secret-of-some-length";

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    delivery_id: Uuid,
    kind: String,
    body: Value,
    at: Instant,
    /// The signature matched the body and timestamp under [`SECRET`], the timestamp was
    /// within five minutes of now, and the headers agreed with the body.
    verified: bool,
}

#[derive(Default)]
struct ReceiverState {
    got: Mutex<Vec<Received>>,
    /// Answer this many requests with 500 first.
    fail_first: AtomicUsize,
    /// Hold this many requests open forever first (after recording them).
    hang_first: AtomicUsize,
}

/// A fake outside system: an HTTP server on a free port, serving until the test ends.
struct Receiver {
    state: Arc<ReceiverState>,
    url: String,
}

impl Receiver {
    async fn start() -> Receiver {
        let state = Arc::new(ReceiverState::default());
        let app = axum::Router::new()
            .route("/hook", axum::routing::post(receive))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver {
            state,
            url: format!("http://{addr}/hook"),
        }
    }

    fn got(&self) -> Vec<Received> {
        self.state.got.lock().unwrap().clone()
    }

    fn of_kind(&self, kind: &str) -> Vec<Received> {
        self.got().into_iter().filter(|r| r.kind == kind).collect()
    }

    async fn wait_for_kind(&self, kind: &str, n: usize, within: Duration) -> Vec<Received> {
        wait_for(
            &format!("{n} deliveries of {kind}"),
            within,
            Duration::from_millis(50),
            || async { self.of_kind(kind).len() >= n },
        )
        .await;
        self.of_kind(kind)
    }
}

/// Whether the signature headers sign `body`, the way a receiver checks them.
fn signed(headers: &HeaderMap, body: &[u8]) -> bool {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let (Some(timestamp), Some(signature)) = (
        header("rein-timestamp").and_then(|t| t.parse::<i64>().ok()),
        header("rein-signature"),
    ) else {
        return false;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    (now - timestamp).abs() <= 300
        && header("content-type") == Some("application/json")
        && signature_of(timestamp, body) == signature
        && rein_scheduler::webhooks::verify(SECRET.as_bytes(), timestamp, body, signature)
}

/// The signature a receiver computes on its own: `v1=` and the hex HMAC-SHA256 under
/// [`SECRET`] of the timestamp, a dot and the body.
fn signature_of(timestamp: i64, body: &[u8]) -> String {
    use hmac::{KeyInit, Mac};
    let mut mac = hmac::Hmac::<hmac_sha2::Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(format!("{timestamp}.").as_bytes());
    mac.update(body);
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

#[test]
fn the_receivers_check_refuses_a_planted_signature() {
    let body = br#"{"id":"0","kind":"run.failed"}"#;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let headers = |timestamp: i64, signature: &str| {
        let mut h = HeaderMap::new();
        h.insert("content-type", "application/json".parse().unwrap());
        h.insert("rein-timestamp", timestamp.to_string().parse().unwrap());
        h.insert("rein-signature", signature.parse().unwrap());
        h
    };
    let good = rein_scheduler::webhooks::sign(SECRET.as_bytes(), now, body);
    assert_eq!(good, signature_of(now, body));
    assert!(signed(&headers(now, &good), body));
    let planted = format!("v1={}", "ab".repeat(32));
    assert!(
        !signed(&headers(now, &planted), body),
        "a planted signature"
    );
    let other_key = rein_scheduler::webhooks::sign(b"another secret, 16+ bytes", now, body);
    assert!(
        !signed(&headers(now, &other_key), body),
        "signed with another secret"
    );
    assert!(
        !signed(&headers(now, &good), br#"{"id":"1"}"#),
        "another body"
    );
    let old = rein_scheduler::webhooks::sign(SECRET.as_bytes(), now - 3600, body);
    assert!(
        !signed(&headers(now - 3600, &old), body),
        "an hour-old timestamp"
    );
}

async fn receive(
    State(state): State<Arc<ReceiverState>>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let id_header = headers
        .get("rein-delivery-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<Uuid>().ok());
    let kind = headers
        .get("rein-event")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let agrees = id_header.is_some()
        && parsed["id"].as_str().and_then(|s| s.parse().ok()) == id_header
        && parsed["kind"] == json!(kind);
    state.got.lock().unwrap().push(Received {
        delivery_id: id_header.unwrap_or_default(),
        kind,
        verified: agrees && signed(&headers, &body),
        body: parsed,
        at: Instant::now(),
    });
    let take = |n: &AtomicUsize| {
        n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
            .is_ok()
    };
    if take(&state.hang_first) {
        std::future::pending::<()>().await;
    }
    if take(&state.fail_first) {
        return StatusCode::INTERNAL_SERVER_ERROR;
    }
    StatusCode::NO_CONTENT
}

/// A fresh database, a receiver, and the processes a test starts.
struct Setup {
    url: String,
    store: Store,
    fleet: Fleet,
    receiver: Receiver,
}

impl Setup {
    async fn start(prefix: &str) -> Setup {
        let (url, store) = common::fresh_store(prefix).await;
        Setup {
            fleet: Fleet::new(&url, prefix),
            url,
            store,
            receiver: Receiver::start().await,
        }
    }

    /// `rein webhooks add` to the receiver (or `to`) with `extra` flags; the webhook's id.
    fn add_webhook(&self, to: Option<&str>, extra: &[&str]) -> Uuid {
        let mut args = vec![
            "webhooks",
            "add",
            "--database-url",
            &self.url,
            "--url",
            to.unwrap_or(&self.receiver.url),
            "--secret-env",
            "TEST_WEBHOOK_SECRET",
        ];
        args.extend_from_slice(extra);
        let out = rein_with(&args, &[("TEST_WEBHOOK_SECRET", SECRET)]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        stdout(&out).trim().parse().expect("the webhook's id")
    }

    /// `rein scheduler` polling for deliveries every 50 ms, with `extra` flags.
    fn scheduler(&mut self, id: &str, extra: &[&str]) {
        let mut args = vec![
            "scheduler",
            "--tick-ms",
            "50",
            "--webhook-poll-interval-ms",
            "50",
        ];
        args.extend_from_slice(extra);
        self.fleet.spawn(id, &args);
    }

    async fn deliveries(&self) -> Vec<WebhookDelivery> {
        self.store.webhook_deliveries(None, 1000).await.unwrap()
    }

    async fn delivery(&self, id: Uuid) -> WebhookDelivery {
        self.deliveries()
            .await
            .into_iter()
            .find(|d| d.delivery_id == id)
            .unwrap_or_else(|| panic!("no delivery {id}"))
    }
}

/// A research-agent run in ACTING, driven there without a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_request_is_delivered_signed_naming_the_exact_action() {
    let mut s = Setup::start("webhooks_requested").await;
    s.add_webhook(None, &[]);
    s.scheduler("sched-1", &[]);
    let run = common::acting_run(&s.store).await;
    let approval = common::ask_for_approval(&s.store, run, 150).await;
    let got = s
        .receiver
        .wait_for_kind("approval.requested", 1, Duration::from_secs(20))
        .await;
    assert_eq!(got.len(), 1, "{got:?}");
    let r = &got[0];
    assert!(r.verified, "signature and headers check out: {r:?}");
    let body = &r.body;
    assert_eq!(body["run_id"], json!(run));
    assert_eq!(body["definition"], "research-agent");
    assert_eq!(body["version"], 2);
    assert_eq!(body["queue"], "default");
    assert!(body["occurred_at"].is_string(), "{body}");
    let a = &body["approval"];
    assert_eq!(a["approval_id"], json!(approval));
    assert_eq!(a["tool"], "refund");
    assert_eq!(a["args"], json!({"order_id": "A1", "amount": 150}));
    assert_eq!(a["action_hash"], "refund-150");
    assert_eq!(a["risk"], "high");
    assert_eq!(a["status"], "pending");
    assert!(
        a["requested_at"].is_string() && a["expires_at"].is_string(),
        "{a}"
    );
    wait_for(
        "the delivery recorded as delivered",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { s.delivery(r.delivery_id).await.status == "delivered" },
    )
    .await;
    let row = s.delivery(r.delivery_id).await;
    assert_eq!((row.attempts, row.last_status_code), (1, Some(204)));
    assert_eq!(row.kind, "approval.requested");
    assert!(row.delivered_at.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_and_a_denial_are_delivered_as_decided_with_the_decider_and_comment() {
    let mut s = Setup::start("webhooks_decided").await;
    s.add_webhook(None, &["--kind", "approval.decided"]);
    s.scheduler("sched-1", &[]);
    let granted_run = common::acting_run(&s.store).await;
    let granted = common::ask_for_approval(&s.store, granted_run, 150).await;
    let denied_run = common::acting_run(&s.store).await;
    let denied = common::ask_for_approval(&s.store, denied_run, 300).await;
    for (id, verb, who, comment) in [
        (granted, "approve", "alice", "refund is fine"),
        (denied, "deny", "bob", "too much"),
    ] {
        let out = rein_with(
            &[
                verb,
                &id.to_string(),
                "--database-url",
                &s.url,
                "--comment",
                comment,
            ],
            &[("REIN_APPROVER", who)],
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    }
    let got = s
        .receiver
        .wait_for_kind("approval.decided", 2, Duration::from_secs(20))
        .await;
    let of = |run: Uuid| {
        got.iter()
            .find(|r| r.body["run_id"] == json!(run))
            .unwrap_or_else(|| panic!("a decision of {run}: {got:?}"))
    };
    let g = of(granted_run);
    assert!(g.verified, "{g:?}");
    assert_eq!(g.body["approval"]["approval_id"], json!(granted));
    assert_eq!(g.body["approval"]["status"], "granted");
    assert_eq!(g.body["approval"]["decided_by"], "alice");
    assert_eq!(g.body["approval"]["comment"], "refund is fine");
    assert_eq!(
        g.body["approval"]["args"],
        json!({"order_id": "A1", "amount": 150})
    );
    let d = of(denied_run);
    assert!(d.verified, "{d:?}");
    assert_eq!(d.body["approval"]["approval_id"], json!(denied));
    assert_eq!(d.body["approval"]["status"], "denied");
    assert_eq!(d.body["approval"]["decided_by"], "bob");
    assert_eq!(d.body["approval"]["comment"], "too much");
    // Only the kind asked for: the requests and the denied run's end were not queued.
    let kinds: Vec<String> = s.deliveries().await.into_iter().map(|d| d.kind).collect();
    assert_eq!(kinds, ["approval.decided", "approval.decided"], "{kinds:?}");
}

/// A run that waits for an approval whose reminder fires after 1 s and whose expiry after
/// 3 s, reached through a 1 ms timer so the scheduler alone drives it.
const TIMED_APPROVAL: &str = r#"
name = "webhook-timers"
version = 1
events = ["GO", "NUDGE", "EXPIRED", "APPROVED", "REJECTED"]
cancel_state = "NO"

[[states]]
name = "START"
kind = "waiting"
initial = true
timeout = { after_ms = 1, event = "GO" }

[[states]]
name = "WAIT"
kind = "waiting"
approval = { expires_after_ms = 3000, remind_before_ms = 2000, reminder_event = "NUDGE", expiry_event = "EXPIRED" }

[[states]]
name = "OK"
kind = "terminal"
outcome = "succeeded"

[[states]]
name = "NO"
kind = "terminal"
outcome = "failed"

[[transitions]]
from = "START"
event = "GO"
to = "WAIT"

[[transitions]]
from = "WAIT"
event = "NUDGE"
to = "WAIT"

[[transitions]]
from = "WAIT"
event = "EXPIRED"
to = "NO"

[[transitions]]
from = "WAIT"
event = "APPROVED"
to = "OK"

[[transitions]]
from = "WAIT"
event = "REJECTED"
to = "NO"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reminder_the_expiry_and_the_failed_end_are_delivered_in_order() {
    let mut s = Setup::start("webhooks_timers").await;
    s.add_webhook(None, &[]);
    let def = rein_core::Definition::parse(
        TIMED_APPROVAL,
        rein_core::Format::Toml,
        &rein_core::GuardRegistry::new(),
    )
    .expect("definition");
    s.store.register_definition(&def).await.unwrap();
    let run = s
        .store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .unwrap()
        .run_id;
    let approval = s
        .store
        .request_approval(rein_store::ApprovalAsk {
            run_id: run,
            node: "START",
            tool: "payout",
            args: &json!({"to": "acct-9"}),
            action_hash: "payout-9",
            risk: "high",
            expires_after_ms: 3_000,
        })
        .await
        .unwrap()
        .approval_id;
    s.scheduler("sched-1", &[]);
    let ended = s
        .receiver
        .wait_for_kind("run.failed", 1, Duration::from_secs(30))
        .await;
    s.receiver
        .wait_for_kind("approval.expired", 1, Duration::from_secs(10))
        .await;
    let mut got = s.receiver.got();
    // The expiry and the end it causes commit together and may arrive in either order.
    got[1..].sort_by(|a, b| a.kind.cmp(&b.kind));
    let kinds: Vec<&str> = got.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["approval.reminder", "approval.expired", "run.failed"],
        "{got:?}"
    );
    assert!(got.iter().all(|r| r.verified), "{got:?}");
    for r in &got[..2] {
        assert_eq!(r.body["approval"]["approval_id"], json!(approval), "{r:?}");
        assert_eq!(r.body["approval"]["tool"], "payout");
        assert_eq!(r.body["approval"]["args"], json!({"to": "acct-9"}));
        assert_eq!(r.body["definition"], "webhook-timers");
    }
    assert_eq!(got[0].body["event"], "NUDGE");
    assert_eq!(got[1].body["event"], "EXPIRED");
    assert_eq!(got[1].body["approval"]["status"], "expired");
    let end = &ended[0].body;
    assert_eq!(end["run_id"], json!(run));
    assert_eq!(end["status"], "failed");
    assert_eq!(end["state"], "NO");
    assert_eq!(
        end["terminal_reason"],
        json!(s.store.run(run).await.unwrap().terminal_reason)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_succeeds_is_finished_and_one_cancelled_or_failed_is_failed_saying_which() {
    let mut s = Setup::start("webhooks_run_end").await;
    s.add_webhook(None, &["--kind", "run.finished", "--kind", "run.failed"]);
    s.scheduler("sched-1", &[]);
    let succeeded = common::acting_run(&s.store).await;
    common::as_the_engine(
        &s.store,
        succeeded,
        &["TOOL_SUCCEEDED", "TASK_READY", "OUTPUT_COMMITTED"],
    )
    .await;
    let cancelled = common::acting_run(&s.store).await;
    common::cancel(&s.store, cancelled).await;
    let def = s
        .store
        .load_definition("research-agent", None)
        .await
        .unwrap();
    let failed = s
        .store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .unwrap()
        .run_id;
    common::as_the_engine(&s.store, failed, &["TASK_ACCEPTED", "PLAN_FAILED"]).await;

    let finished = s
        .receiver
        .wait_for_kind("run.finished", 1, Duration::from_secs(20))
        .await;
    let ended = s
        .receiver
        .wait_for_kind("run.failed", 2, Duration::from_secs(20))
        .await;
    assert_eq!(finished.len(), 1, "{finished:?}");
    assert_eq!(finished[0].body["run_id"], json!(succeeded));
    assert_eq!(finished[0].body["status"], "succeeded");
    assert_eq!(finished[0].body["state"], "SUCCEEDED");
    assert!(finished[0].verified);
    let of = |run: Uuid| {
        ended
            .iter()
            .find(|r| r.body["run_id"] == json!(run))
            .unwrap_or_else(|| panic!("the end of {run}: {ended:?}"))
    };
    assert_eq!(of(cancelled).body["status"], "cancelled");
    assert_eq!(of(cancelled).body["state"], "CANCELLED");
    assert_eq!(of(failed).body["status"], "failed");
    assert_eq!(of(failed).body["state"], "FAILED");
    for run in [succeeded, cancelled, failed] {
        let row = s.store.run(run).await.unwrap();
        let body = &s
            .receiver
            .got()
            .into_iter()
            .find(|r| r.body["run_id"] == json!(run))
            .unwrap()
            .body;
        assert_eq!(
            body["terminal_reason"],
            json!(row.terminal_reason),
            "{body}"
        );
    }
    assert_eq!(s.receiver.got().len(), 3, "one delivery per run's end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_failing_three_times_gets_the_same_delivery_four_times_further_apart() {
    let mut s = Setup::start("webhooks_retry").await;
    s.add_webhook(None, &["--kind", "run.failed"]);
    s.receiver.state.fail_first.store(3, Ordering::SeqCst);
    let metrics = format!("127.0.0.1:{}", common::free_port());
    s.scheduler("sched-1", &["--metrics-listen", &metrics]);
    let run = common::acting_run(&s.store).await;
    common::cancel(&s.store, run).await;
    let got = s
        .receiver
        .wait_for_kind("run.failed", 4, Duration::from_secs(40))
        .await;
    assert_eq!(got.len(), 4, "{got:?}");
    let id = got[0].delivery_id;
    assert!(
        got.iter().all(|r| r.delivery_id == id && r.verified),
        "{got:?}"
    );
    let gaps: Vec<Duration> = got.windows(2).map(|w| w[1].at - w[0].at).collect();
    assert!(
        gaps[0] >= Duration::from_millis(700) && gaps[1] > gaps[0] && gaps[2] > gaps[1],
        "backoff from about a second, doubling: {gaps:?}"
    );
    wait_for(
        "the delivery recorded as delivered",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { s.delivery(id).await.status == "delivered" },
    )
    .await;
    let row = s.delivery(id).await;
    assert_eq!(row.attempts, 4);
    assert_eq!(row.last_status_code, Some(204));
    assert_eq!(row.last_error, None);
    let text = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (outcome, n) in [("delivered", 1), ("retried", 3), ("failed", 0)] {
        let sample = format!("rein_webhook_deliveries_total{{outcome=\"{outcome}\"}} {n}\n");
        assert!(text.contains(&sample), "{sample}in\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_is_down_fails_the_delivery_after_the_attempts_max() {
    let mut s = Setup::start("webhooks_down").await;
    let closed = format!("http://127.0.0.1:{}/hook", common::free_port());
    let hook = s.add_webhook(Some(&closed), &[]);
    s.scheduler("sched-1", &["--webhook-attempts-max", "3"]);
    let run = common::acting_run(&s.store).await;
    common::cancel(&s.store, run).await;
    let queued = s.deliveries().await;
    assert_eq!(queued.len(), 1, "{queued:?}");
    let id = queued[0].delivery_id;
    wait_for(
        "the delivery failed",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async { s.delivery(id).await.status == "failed" },
    )
    .await;
    let row = s.delivery(id).await;
    assert_eq!(row.attempts, 3);
    assert_eq!(row.last_status_code, None);
    assert!(
        row.last_error
            .as_deref()
            .is_some_and(|e| e.contains("cannot post")),
        "{row:?}"
    );
    assert_eq!(row.webhook_id, hook);
    let out = common::rein(&[
        "webhooks",
        "deliveries",
        "--failed",
        "--json",
        "--database-url",
        &s.url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let listed: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["delivery_id"], json!(id));
    assert_eq!(listed[0]["url"], closed);
    assert_eq!(listed[0]["attempts"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_scheduler_is_killed_mid_post_is_delivered_by_another() {
    let mut s = Setup::start("webhooks_killed").await;
    s.add_webhook(None, &["--kind", "run.failed"]);
    s.receiver.state.hang_first.store(1, Ordering::SeqCst);
    s.scheduler("sched-1", &[]);
    let run = common::acting_run(&s.store).await;
    common::cancel(&s.store, run).await;
    let first = s
        .receiver
        .wait_for_kind("run.failed", 1, Duration::from_secs(20))
        .await;
    s.fleet.kill("sched-1");
    let id = first[0].delivery_id;
    assert_eq!(s.delivery(id).await.status, "pending");
    s.scheduler("sched-2", &[]);
    // The dead scheduler's claim (30 s by the database clock) must run out first.
    let got = s
        .receiver
        .wait_for_kind("run.failed", 2, Duration::from_secs(60))
        .await;
    assert!(
        got.iter().all(|r| r.delivery_id == id && r.verified),
        "the same delivery, again: {got:?}"
    );
    assert!(got[1].at - got[0].at >= Duration::from_secs(25), "{got:?}");
    wait_for(
        "the delivery recorded as delivered",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { s.delivery(id).await.status == "delivered" },
    )
    .await;
    assert_eq!(
        s.delivery(id).await.attempts,
        1,
        "the killed post recorded nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_for_another_definition_or_queue_gets_nothing_and_no_webhook_queues_nothing() {
    let mut s = Setup::start("webhooks_scope").await;
    // No webhook: the facts commit and nothing is queued.
    let run = common::acting_run(&s.store).await;
    common::ask_for_approval(&s.store, run, 150).await;
    common::cancel(&s.store, run).await;
    assert!(s.deliveries().await.is_empty());

    s.add_webhook(None, &["--definition", "lifecycle"]);
    s.add_webhook(None, &["--queue", "elsewhere"]);
    let run = common::acting_run(&s.store).await;
    common::ask_for_approval(&s.store, run, 150).await;
    common::cancel(&s.store, run).await;
    assert!(
        s.deliveries().await.is_empty(),
        "webhooks of another definition and another queue"
    );

    // A webhook for this definition: the same facts are queued, once each.
    s.add_webhook(
        None,
        &["--definition", "research-agent", "--queue", "default"],
    );
    let run = common::acting_run(&s.store).await;
    common::ask_for_approval(&s.store, run, 150).await;
    common::cancel(&s.store, run).await;
    let mut kinds: Vec<String> = s.deliveries().await.into_iter().map(|d| d.kind).collect();
    kinds.sort();
    assert_eq!(kinds, ["approval.requested", "run.failed"]);
    s.scheduler("sched-1", &[]);
    s.receiver
        .wait_for_kind("run.failed", 1, Duration::from_secs(20))
        .await;
    s.receiver
        .wait_for_kind("approval.requested", 1, Duration::from_secs(20))
        .await;
    assert!(
        s.receiver
            .got()
            .iter()
            .all(|r| r.body["run_id"] == json!(run)),
        "only the last run's facts"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_add_refuses_a_bad_url_a_short_secret_an_unknown_kind_and_a_missing_variable() {
    let (url, _store) = common::fresh_store("webhooks_cli_checks").await;
    let add = |target: &str, secret: Option<&str>, extra: &[&str]| {
        let mut args = vec![
            "webhooks",
            "add",
            "--database-url",
            &url,
            "--url",
            target,
            "--secret-env",
            "TEST_WEBHOOK_SECRET",
        ];
        args.extend_from_slice(extra);
        let env: Vec<(&str, &str)> = secret
            .map(|s| ("TEST_WEBHOOK_SECRET", s))
            .into_iter()
            .collect();
        rein_with(&args, &env)
    };
    let long_url = format!("http://example.com/{}", "a".repeat(2048));
    for (target, secret, extra, says) in [
        (
            "ftp://example.com/hook",
            Some(SECRET),
            &[][..],
            "http or https",
        ),
        ("http://", Some(SECRET), &[][..], "host"),
        ("not a url", Some(SECRET), &[][..], "URL"),
        (long_url.as_str(), Some(SECRET), &[][..], "2048"),
        (
            "http://u:p@example.com/",
            Some(SECRET),
            &[][..],
            "credentials",
        ),
        ("http://example.com/hook", Some("short"), &[][..], "16"),
        ("http://example.com/hook", None, &[][..], "not set"),
        (
            "http://example.com/hook",
            Some(SECRET),
            &["--kind", "run.started"][..],
            "approval.requested, approval.reminder, approval.expired, approval.decided, run.finished, run.failed",
        ),
    ] {
        let out = add(target, secret, extra);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{target} {extra:?}: {}",
            stderr(&out)
        );
        assert!(
            stderr(&out).contains(says),
            "{target} {extra:?}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty());
    }
    let out = add("https://hooks.example.com/rein", Some(SECRET), &["--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let added: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let out = common::rein(&["webhooks", "list", "--json", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stdout(&out).contains(SECRET), "never the secret");
    let listed: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(listed, json!([added]), "only the good one was stored");
    let id = added["webhook_id"].as_str().unwrap();
    let out = common::rein(&["webhooks", "remove", id, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = common::rein(&["webhooks", "remove", id, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "already removed");
    let out = common::rein(&["webhooks", "list", "--json", "--database-url", &url]);
    assert_eq!(stdout(&out).trim(), "[]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_lists_webhooks_without_secrets_and_deliveries_to_operators() {
    let api = common::Api::start("webhooks_api", &[]).await;
    let out = rein_with(
        &[
            "webhooks",
            "add",
            "--database-url",
            &api.url,
            "--url",
            "http://127.0.0.1:9/hook",
            "--secret-env",
            "TEST_WEBHOOK_SECRET",
            "--kind",
            "run.failed",
        ],
        &[("TEST_WEBHOOK_SECRET", SECRET)],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let run = common::acting_run(&api.store).await;
    common::cancel(&api.store, run).await;
    let operator = api.token("ops", &["operate"]);
    let reader = api.token("viewer", &["read"]);
    let (status, hooks) = api.get_json("/v1/webhooks", &operator).await;
    assert_eq!(status.as_u16(), 200, "{hooks}");
    assert_eq!(hooks[0]["url"], "http://127.0.0.1:9/hook");
    assert_eq!(hooks[0]["kinds"], json!(["run.failed"]));
    assert!(!hooks.to_string().contains(SECRET), "{hooks}");
    let (status, rows) = api
        .get_json("/v1/webhooks/deliveries?status=pending&limit=10", &operator)
        .await;
    assert_eq!(status.as_u16(), 200, "{rows}");
    assert_eq!(rows[0]["run_id"], json!(run));
    assert_eq!(rows[0]["kind"], "run.failed");
    assert_eq!(rows[0]["status"], "pending");
    assert_eq!(rows[0]["attempts"], 0);
    let (_, none) = api
        .get_json("/v1/webhooks/deliveries?status=delivered", &operator)
        .await;
    assert_eq!(none, json!([]));
    let (status, _) = api
        .get_json("/v1/webhooks/deliveries?status=lost", &operator)
        .await;
    assert_eq!(status.as_u16(), 422);
    for path in ["/v1/webhooks", "/v1/webhooks/deliveries"] {
        let (status, v) = api.get_json(path, &reader).await;
        assert_eq!(status.as_u16(), 403, "{path}: {v}");
    }
}

/// What a raw receiver saw of one post.
#[derive(Default)]
struct RawReceiver {
    /// A request arrived (headers and body read).
    asked: std::sync::atomic::AtomicBool,
    /// Requests that arrived, over every connection.
    asks: AtomicUsize,
    /// The scheduler closed the connection.
    closed: std::sync::atomic::AtomicBool,
    /// Bytes of the answer the scheduler's side accepted before it closed.
    accepted: AtomicUsize,
}

/// Reads one HTTP request (headers, then a Content-Length body) from `conn`.
async fn read_request(conn: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = conn.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            return false;
        }
        seen.extend_from_slice(&buf[..n]);
        let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if seen.len() >= end + 4 + length {
            return true;
        }
    }
}

/// A receiver on a free port that, for each post, answers `head` and then up to
/// `body_bytes` bytes of `FILLER`, counting what the scheduler accepts; with no `head` it
/// never answers and notes when the scheduler closes the connection.
async fn raw_receiver(head: Option<String>, body_bytes: usize) -> (Arc<RawReceiver>, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let seen = Arc::new(RawReceiver::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let state = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let (state, head) = (state.clone(), head.clone());
            tokio::spawn(async move {
                if !read_request(&mut conn).await {
                    return;
                }
                state.asked.store(true, Ordering::SeqCst);
                state.asks.fetch_add(1, Ordering::SeqCst);
                let Some(head) = head else {
                    let mut buf = [0u8; 64];
                    while matches!(conn.read(&mut buf).await, Ok(n) if n > 0) {}
                    state.closed.store(true, Ordering::SeqCst);
                    return;
                };
                if conn.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = FILLER.repeat(64 * 1024 / FILLER.len());
                while state.accepted.load(Ordering::SeqCst) < body_bytes {
                    match conn.write(chunk.as_bytes()).await {
                        Ok(n) if n > 0 => {
                            state.accepted.fetch_add(n, Ordering::SeqCst);
                        }
                        _ => break,
                    }
                }
                state.closed.store(true, Ordering::SeqCst);
            });
        }
    });
    (seen, url)
}

/// What the huge answer is made of: text no error may quote.
const FILLER: &str = "internal-service-answer ";

/// A receiver answering 500 with a gigabyte of text: the scheduler reads a few kilobytes,
/// closes the connection, and records the answer described (status and size), not quoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_answering_a_huge_body_is_read_no_further_than_a_few_kilobytes() {
    let mut s = Setup::start("webhooks_huge_answer").await;
    let gigabyte = 1 << 30;
    let head = format!(
        "HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: {gigabyte}\r\n\r\n"
    );
    let (seen, url) = raw_receiver(Some(head), gigabyte).await;
    s.add_webhook(Some(&url), &["--kind", "run.failed"]);
    s.scheduler("sched-1", &["--webhook-attempts-max", "1"]);
    let run = common::acting_run(&s.store).await;
    common::cancel(&s.store, run).await;
    let id = s.deliveries().await[0].delivery_id;
    wait_for(
        "the delivery failed and the receiver's connection closed",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async { s.delivery(id).await.status == "failed" && seen.closed.load(Ordering::SeqCst) },
    )
    .await;
    let accepted = seen.accepted.load(Ordering::SeqCst);
    println!("the scheduler accepted {accepted} bytes of a {gigabyte} byte answer");
    assert!(accepted < 64 << 20, "{accepted} bytes accepted");
    let row = s.delivery(id).await;
    assert_eq!(row.last_status_code, Some(500));
    let error = row.last_error.unwrap_or_default();
    assert!(
        error.contains("500 Internal Server Error") && error.contains("more than 4096 bytes"),
        "{error}"
    );
    assert!(
        !error.contains(FILLER.trim()),
        "described, not quoted: {error}"
    );
}

/// A receiver that never answers holds its own post, not another receiver's delivery: the
/// other's arrives while the hanging post is still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_receiver_does_not_hold_back_another_receivers_delivery() {
    let mut s = Setup::start("webhooks_hanging").await;
    let (hanging, url) = raw_receiver(None, 0).await;
    s.add_webhook(Some(&url), &["--kind", "run.failed"]);
    s.add_webhook(None, &["--kind", "approval.requested"]);
    s.scheduler("sched-1", &[]);
    let run = common::acting_run(&s.store).await;
    common::cancel(&s.store, run).await;
    wait_for(
        "the hanging receiver's post",
        Duration::from_secs(20),
        Duration::from_millis(20),
        || async { hanging.asked.load(Ordering::SeqCst) },
    )
    .await;
    let other = common::acting_run(&s.store).await;
    common::ask_for_approval(&s.store, other, 150).await;
    s.receiver
        .wait_for_kind("approval.requested", 1, Duration::from_secs(30))
        .await;
    assert!(
        !hanging.closed.load(Ordering::SeqCst),
        "the other delivery arrived only after the hanging post was given up"
    );
}

/// A receiver that never answers, with 20 deliveries due (more than a scheduler's 16
/// slots), gets at most 4 posts at a time; its other deliveries are left due, so another
/// receiver's delivery, queued after all of them, arrives while the hanging posts are
/// still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_receiver_with_many_due_deliveries_leaves_slots_to_another_receiver() {
    let mut s = Setup::start("webhooks_hanging_many").await;
    let (hanging, url) = raw_receiver(None, 0).await;
    let hanging_id = s.add_webhook(Some(&url), &["--kind", "run.failed"]);
    s.add_webhook(None, &["--kind", "approval.requested"]);
    for _ in 0..20 {
        let run = common::acting_run(&s.store).await;
        common::cancel(&s.store, run).await;
    }
    s.scheduler("sched-1", &[]);
    wait_for(
        "20 deliveries to the hanging receiver queued, and its first post",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || async {
            let queued = s.deliveries().await;
            queued.iter().filter(|d| d.webhook_id == hanging_id).count() == 20
                && hanging.asked.load(Ordering::SeqCst)
        },
    )
    .await;
    let other = common::acting_run(&s.store).await;
    common::ask_for_approval(&s.store, other, 150).await;
    s.receiver
        .wait_for_kind("approval.requested", 1, Duration::from_secs(30))
        .await;
    assert!(
        !hanging.closed.load(Ordering::SeqCst),
        "the other delivery arrived only after the hanging posts were given up"
    );
    let asks = hanging.asks.load(Ordering::SeqCst);
    assert!(
        (1..=4).contains(&asks),
        "{asks} posts to the hanging receiver at once"
    );
}

/// The database's port of `url` (`postgres://...:PORT/db`).
fn database_port(url: &str) -> u16 {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.port())
        .unwrap_or(5432)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_add_refuses_a_metadata_address_and_the_databases_port_naming_rule_and_flag() {
    let s = Setup::start("webhooks_add_egress").await;
    let db = format!("http://127.0.0.1:{}/hook", database_port(&s.url));
    for (target, rule) in [
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[::ffff:169.254.169.254]/", "metadata"),
        (db.as_str(), "database"),
    ] {
        let out = rein_with(
            &[
                "webhooks",
                "add",
                "--database-url",
                &s.url,
                "--url",
                target,
                "--secret-env",
                "TEST_WEBHOOK_SECRET",
            ],
            &[("TEST_WEBHOOK_SECRET", SECRET)],
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{target}: {err}");
        assert!(
            err.contains(&format!("egress rule `{rule}`")) && err.contains("--webhook-allow"),
            "{target}: {err}"
        );
    }
    assert!(s.store.webhooks().await.unwrap().is_empty());
    // An entry naming the database's port exactly opens it.
    let port = database_port(&s.url).to_string();
    s.add_webhook(
        Some(&db),
        &["--webhook-allow", &format!("127.0.0.1:{port}")],
    );
}

/// Webhooks stored before (or registered past) the scheduler's rules are disabled when a
/// delivery of theirs is due, with the refusal as their reason, and nothing is posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_webhook_the_rules_refuse_is_disabled_with_its_reason_and_gets_nothing() {
    let mut s = Setup::start("webhooks_disabled").await;
    let db = format!("http://127.0.0.1:{}/hook", database_port(&s.url));
    let port = database_port(&s.url).to_string();
    let to_db = s.add_webhook(
        Some(&db),
        &[
            "--kind",
            "run.failed",
            "--webhook-allow",
            &format!("127.0.0.1:{port}"),
        ],
    );
    let to_receiver = s.add_webhook(None, &["--kind", "run.failed"]);
    s.scheduler("sched-1", &["--webhook-allow", "hooks.example.com"]);
    let run = common::acting_run(&s.store).await;
    common::cancel(&s.store, run).await;
    wait_for(
        "both deliveries failed",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async { s.deliveries().await.iter().all(|d| d.status == "failed") },
    )
    .await;
    for (hook, rule) in [(to_db, "database"), (to_receiver, "not_allowed")] {
        let reason = s.store.webhook_disabled_reason(hook).await.unwrap();
        let reason = reason.unwrap_or_else(|| panic!("{hook} has no reason"));
        assert!(
            reason.contains(&format!("rule {rule}")) && reason.contains("--webhook-allow"),
            "{reason}"
        );
        let delivery = s
            .deliveries()
            .await
            .into_iter()
            .find(|d| d.webhook_id == hook);
        let error = delivery.and_then(|d| d.last_error).unwrap_or_default();
        assert!(error.contains(&reason), "{error}");
    }
    assert!(
        s.store.webhooks().await.unwrap().is_empty(),
        "no live webhook"
    );
    assert!(s.receiver.got().is_empty(), "{:?}", s.receiver.got());
}
