//! Traces over OTLP from real `rein` processes, as a collector decoding the official
//! protobufs sees them: the standard OTEL_* variables switch export on; a run is one trace
//! (its id the run id) whose root span `rein.run` is sent when the run is enqueued, with
//! every step, action attempt and scheduler firing under it, from however many processes;
//! the API's requests are server spans; a collector that cannot be reached is reported.

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, header};
use axum::routing::post;
use common::Fleet;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use prost::Message;
use rein_store::EnqueueRequest;
use serde_json::json;

/// A span as the collector received it; ids in lowercase hex, an empty parent for a root.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    kind: i32,
    attributes: BTreeMap<String, String>,
    status: (i32, String),
    events: Vec<(String, BTreeMap<String, String>)>,
    links: Vec<(String, String)>,
}

impl Got {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

type Received = Arc<Mutex<Vec<Got>>>;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                Some(any_value::Value::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}

/// The spans of one OTLP export request.
fn decode(request: ExportTraceServiceRequest) -> Vec<Got> {
    let mut out = Vec::new();
    for rs in request.resource_spans {
        let resource = rs.resource.map(|r| attributes(&r.attributes));
        let service = resource
            .and_then(|r| r.get("service.name").cloned())
            .unwrap_or_default();
        for span in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
            let status = span
                .status
                .as_ref()
                .map(|s| (s.code, s.message.clone()))
                .unwrap_or_default();
            out.push(Got {
                service: service.clone(),
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent: hex(&span.parent_span_id),
                name: span.name.clone(),
                kind: span.kind,
                attributes: attributes(&span.attributes),
                status,
                events: span
                    .events
                    .iter()
                    .map(|e| (e.name.clone(), attributes(&e.attributes)))
                    .collect(),
                links: span
                    .links
                    .iter()
                    .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                    .collect(),
            });
        }
    }
    out
}

/// A stand-in OTLP/HTTP collector on `listener`: it decodes every export request, protobuf
/// or JSON, with the official OTLP message types, and keeps its spans.
fn collector_on(listener: tokio::net::TcpListener) -> Received {
    let received: Received = Arc::default();
    let kept = received.clone();
    let app = Router::new().route(
        "/v1/traces",
        post(move |headers: HeaderMap, body: Bytes| {
            let kept = kept.clone();
            async move {
                let json = headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.starts_with("application/json"));
                let request = if json {
                    serde_json::from_slice::<ExportTraceServiceRequest>(&body)
                        .expect("an OTLP/JSON export request")
                } else {
                    ExportTraceServiceRequest::decode(body)
                        .expect("an OTLP protobuf export request")
                };
                kept.lock().unwrap().extend(decode(request));
                if json {
                    (
                        [(header::CONTENT_TYPE, "application/json")],
                        Bytes::from_static(b"{}"),
                    )
                } else {
                    // An empty ExportTraceServiceResponse.
                    (
                        [(header::CONTENT_TYPE, "application/x-protobuf")],
                        Bytes::new(),
                    )
                }
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    received
}

async fn collector() -> (String, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (format!("http://{addr}"), collector_on(listener))
}

fn spans(received: &Received) -> Vec<Got> {
    received.lock().unwrap().clone()
}

/// The OTEL_* variables that send `service`'s traces to `endpoint` (OTLP/HTTP protobuf, the
/// default, unless `protocol` says otherwise), in batches every 200 ms.
fn otel(endpoint: &str, service: &str, protocol: Option<&str>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.to_owned()),
        ("OTEL_SERVICE_NAME", service.to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "200".to_owned()),
    ];
    if let Some(protocol) = protocol {
        env.push(("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.to_owned()));
    }
    env
}

fn env_refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_taken_over_by_a_second_worker_is_one_trace_with_a_span_per_step_and_action() {
    let (endpoint, received) = collector().await;
    let (url, store) = common::fresh_store("traces").await;
    let mut fleet = Fleet::new(&url, "traces");
    let def = store.load_definition("research-agent", None).await.unwrap();
    let run = store
        .enqueue(EnqueueRequest::new(
            def,
            json!({ "sim": { "work_ms": 300, "steps": 4 } }),
        ))
        .await
        .unwrap()
        .run_id;
    let env_a = otel(&endpoint, "worker-a", Some("http/json"));
    fleet.spawn_env("trace-a", &["worker"], &env_refs(&env_a));
    common::wait_for(
        "worker a to finish a step",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || async {
            store
                .run(run)
                .await
                .is_ok_and(|r| r.projection.steps_completed >= 1)
        },
    )
    .await;
    // Stopped part-way: it hands the run back and sends its spans before exiting.
    assert_eq!(fleet.terminate("trace-a", Duration::from_secs(20)), Some(0));
    let done_by_a = store.run(run).await.unwrap();
    assert_ne!(done_by_a.status, "terminal", "a must stop part-way");

    let env_b = otel(&endpoint, "worker-b", None);
    fleet.spawn_env("trace-b", &["worker"], &env_refs(&env_b));
    common::wait_for(
        "worker b to finish the run",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async { store.run(run).await.is_ok_and(|r| r.status == "terminal") },
    )
    .await;
    assert_eq!(fleet.terminate("trace-b", Duration::from_secs(20)), Some(0));

    let all = spans(&received);
    let trace = run.simple().to_string();
    let of_run: Vec<&Got> = all.iter().filter(|s| s.trace_id == trace).collect();
    let steps = |service: &str| {
        of_run
            .iter()
            .filter(|s| s.service == service && s.name == "rein.step")
            .count()
    };
    assert!(
        steps("worker-a") >= 1,
        "worker a's steps are in the run's trace: {all:?}"
    );
    assert!(
        steps("worker-b") >= 1,
        "worker b's steps are in the run's trace: {all:?}"
    );
    // Each action attempt is a span under the step that ran it.
    let step_ids: Vec<&str> = of_run
        .iter()
        .filter(|s| s.name == "rein.step")
        .map(|s| s.span_id.as_str())
        .collect();
    let actions: Vec<&&Got> = of_run.iter().filter(|s| s.name == "rein.action").collect();
    assert!(actions.len() >= 4, "an action span per step: {actions:?}");
    for a in &actions {
        assert!(
            step_ids.contains(&a.parent.as_str()),
            "action {a:?} is not under a step"
        );
    }
    // Every step is a child of the run's root span, whose id the run id gives.
    let root = &trace[16..];
    for s in of_run.iter().filter(|s| s.name == "rein.step") {
        assert_eq!(s.parent, root, "{s:?}");
    }
    // Nothing of another trace: every span the workers sent belongs to the run.
    assert_eq!(of_run.len(), all.len(), "{all:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_enqueued_through_the_api_renders_as_one_tree_under_its_root_span() {
    let (endpoint, received) = collector().await;
    let (url, store) = common::fresh_store("traces_tree").await;
    let mut fleet = Fleet::new(&url, "traces_tree");
    let env_api = otel(&endpoint, "api", None);
    let base = fleet.spawn_server_env(
        "api",
        &["api", "--insecure-dev", "--listen", "127.0.0.1:0"],
        &env_refs(&env_api),
    );
    // The agent's own trace, whose span calls the API.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let answer = reqwest::Client::new()
        .post(format!("{base}/v1/runs"))
        .header("traceparent", format!("00-{caller_trace}-{caller_span}-01"))
        .json(&json!({
            "definition": "research-agent",
            "input": { "sim": { "steps": 1, "transient_failures": 1 } },
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::CREATED);
    let body: serde_json::Value = answer.json().await.unwrap();
    let run: uuid::Uuid = body["run_id"].as_str().unwrap().parse().unwrap();

    let env_worker = otel(&endpoint, "worker", None);
    fleet.spawn_env(
        "worker",
        &["worker", "--poll-interval-ms", "20"],
        &env_refs(&env_worker),
    );
    let env_scheduler = otel(&endpoint, "scheduler", None);
    fleet.spawn_env(
        "scheduler",
        &["scheduler", "--tick-ms", "50"],
        &env_refs(&env_scheduler),
    );
    common::wait_for(
        "the run to end",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || async { store.run(run).await.is_ok_and(|r| r.status == "terminal") },
    )
    .await;
    for id in ["worker", "scheduler", "api"] {
        assert_eq!(
            fleet.terminate(id, Duration::from_secs(20)),
            Some(0),
            "{id}"
        );
    }

    let all = spans(&received);
    let trace = run.simple().to_string();
    let of_run: Vec<&Got> = all.iter().filter(|s| s.trace_id == trace).collect();

    // One root, sent by the process that enqueued the run, with the run's facts.
    let roots: Vec<&&Got> = of_run.iter().filter(|s| s.parent.is_empty()).collect();
    assert_eq!(roots.len(), 1, "one root span: {of_run:#?}");
    let root = roots[0];
    assert_eq!(root.name, "rein.run");
    assert_eq!(root.service, "api");
    assert_eq!(
        root.span_id,
        trace[16..],
        "the root's id comes from the run id"
    );
    assert_eq!(root.attr("rein.run.id"), Some(run.to_string().as_str()));
    assert_eq!(root.attr("rein.definition"), Some("research-agent"));
    assert_eq!(root.attr("rein.queue"), Some("default"));
    // The caller's trace is a link, not the parent.
    assert!(
        root.links
            .contains(&(caller_trace.to_owned(), caller_span.to_owned())),
        "the root links to the caller's span: {root:?}"
    );

    // A tree: every other span's parent is a span of the trace.
    let ids: HashSet<&str> = of_run.iter().map(|s| s.span_id.as_str()).collect();
    for s in &of_run {
        assert!(
            s.parent.is_empty() || ids.contains(s.parent.as_str()),
            "{} of {} has a parent that was never sent: {s:?}",
            s.name,
            s.service
        );
    }
    for name in ["rein.step", "rein.action", "rein.fire"] {
        assert!(
            of_run.iter().any(|s| s.name == name),
            "no {name} span: {of_run:#?}"
        );
    }

    // The failed attempt says so, with its class and message, and an exception event.
    let failed: Vec<&&Got> = of_run
        .iter()
        .filter(|s| s.name == "rein.action" && s.status.0 == StatusCode::Error as i32)
        .collect();
    let failed = failed
        .first()
        .unwrap_or_else(|| panic!("a failed attempt: {of_run:#?}"));
    assert_eq!(failed.status.1, "sim: transient failure");
    assert_eq!(failed.attr("error.type"), Some("transient"));
    let (_, exception) = failed
        .events
        .iter()
        .find(|(name, _)| name == "exception")
        .unwrap_or_else(|| panic!("an exception event: {failed:?}"));
    assert_eq!(
        exception.get("exception.type").map(String::as_str),
        Some("transient")
    );
    assert_eq!(
        exception.get("exception.message").map(String::as_str),
        Some("sim: transient failure")
    );
    assert!(
        of_run
            .iter()
            .filter(|s| s.name == "rein.action" && s.status.0 != StatusCode::Error as i32)
            .count()
            >= 2,
        "the attempts that succeeded have no error status: {of_run:#?}"
    );

    // The scheduler's firing of the retry, under the root, with the token it took.
    let fired = of_run
        .iter()
        .find(|s| s.name == "rein.fire" && s.attr("rein.event") == Some("RETRY_DUE"))
        .unwrap_or_else(|| panic!("a RETRY_DUE firing: {of_run:#?}"));
    assert_eq!(fired.service, "scheduler");
    assert_eq!(fired.parent, root.span_id);
    assert_eq!(fired.attr("rein.run.id"), Some(run.to_string().as_str()));
    assert_eq!(fired.attr("rein.scan"), Some("timer"));
    assert_eq!(fired.attr("rein.outcome"), Some("moved"));
    assert!(
        fired
            .attr("rein.fencing_token")
            .is_some_and(|t| t.parse::<i64>().is_ok_and(|t| t > 0)),
        "{fired:?}"
    );

    // The API request is a server span in the caller's trace, named by its route's
    // template, and links to the run it created.
    let request = all
        .iter()
        .find(|s| s.service == "api" && s.attr("http.route") == Some("/v1/runs"))
        .unwrap_or_else(|| panic!("the enqueue request's span: {all:#?}"));
    assert_eq!(request.name, "POST /v1/runs");
    assert_eq!(request.kind, SpanKind::Server as i32);
    assert_eq!(request.trace_id, caller_trace);
    assert_eq!(request.parent, caller_span);
    assert_eq!(request.attr("http.request.method"), Some("POST"));
    assert_eq!(request.attr("url.path"), Some("/v1/runs"));
    assert_eq!(request.attr("http.response.status_code"), Some("201"));
    assert!(
        request
            .links
            .contains(&(trace.clone(), root.span_id.clone())),
        "the request links to the run's root: {request:?}"
    );
}

/// Lines of `log` that contain `what`.
fn lines_with(log: &str, what: &str) -> usize {
    log.lines().filter(|l| l.contains(what)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_is_logged_once_and_so_is_its_return() {
    const DOWN: &str = "cannot send traces to the OTLP collector";
    const BACK: &str = "traces reach the OTLP collector again";
    let port = common::free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let (url, store) = common::fresh_store("traces_down").await;
    let mut fleet = Fleet::new(&url, "traces_down");
    let def = store.load_definition("research-agent", None).await.unwrap();
    let input = json!({ "sim": { "work_ms": 100, "steps": 4 } });
    let first = store
        .enqueue(EnqueueRequest::new(def.clone(), input.clone()))
        .await
        .unwrap()
        .run_id;
    let env = otel(&endpoint, "worker", None);
    fleet.spawn_env(
        "worker",
        &["worker", "--poll-interval-ms", "20"],
        &env_refs(&env),
    );
    let log_path = fleet.log_dir.join("worker.err");
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    common::wait_for(
        "the first run to end",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async { store.run(first).await.is_ok_and(|r| r.status == "terminal") },
    )
    .await;
    // Its spans went out in several batches, all refused.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(lines_with(&log(), DOWN), 1, "{}", log());
    let warned = log();
    let line = warned.lines().find(|l| l.contains(DOWN)).unwrap();
    assert!(line.contains("WARN"), "{line}");

    // The collector comes up on that address; the next run's spans reach it.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let received = collector_on(listener);
    let second = store
        .enqueue(EnqueueRequest::new(def, input))
        .await
        .unwrap()
        .run_id;
    let trace = second.simple().to_string();
    common::wait_for(
        "the second run's spans at the collector",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async {
            store
                .run(second)
                .await
                .is_ok_and(|r| r.status == "terminal")
                && spans(&received).iter().any(|s| s.trace_id == trace)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(fleet.terminate("worker", Duration::from_secs(20)), Some(0));
    let log = log();
    assert_eq!(lines_with(&log, BACK), 1, "{log}");
    assert_eq!(lines_with(&log, DOWN), 1, "{log}");
}
