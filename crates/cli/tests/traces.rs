//! Traces over OTLP from real `rein worker` processes: the standard OTEL_* variables switch
//! export on, every step and action attempt is a span, and the spans of one run from two
//! workers (one stopped part-way) share one trace: the run's.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use common::Fleet;
use rein_store::EnqueueRequest;
use serde_json::{Value, json};

/// A stand-in OTLP/HTTP collector (JSON encoding): it keeps every export request's body.
async fn collector() -> (String, Arc<Mutex<Vec<Value>>>) {
    let received: Arc<Mutex<Vec<Value>>> = Arc::default();
    let kept = received.clone();
    let app = Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let kept = kept.clone();
            async move {
                if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                    kept.lock().unwrap().push(v);
                }
                ([("content-type", "application/json")], "{}")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), received)
}

/// (service name, span) of every span exported so far.
fn spans(received: &Mutex<Vec<Value>>) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for export in received.lock().unwrap().iter() {
        for rs in export["resourceSpans"].as_array().into_iter().flatten() {
            let service = rs["resource"]["attributes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|a| a["key"] == "service.name")
                .and_then(|a| a["value"]["stringValue"].as_str())
                .unwrap_or("")
                .to_owned();
            for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                for span in ss["spans"].as_array().into_iter().flatten() {
                    out.push((service.clone(), span.clone()));
                }
            }
        }
    }
    out
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
    let otel = |service: &'static str| {
        [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json".to_owned()),
            ("OTEL_SERVICE_NAME", service.to_owned()),
        ]
    };
    let env_a = otel("worker-a");
    let env_a: Vec<(&str, &str)> = env_a.iter().map(|(k, v)| (*k, v.as_str())).collect();
    fleet.spawn_env("trace-a", &["worker"], &env_a);
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

    let env_b = otel("worker-b");
    let env_b: Vec<(&str, &str)> = env_b.iter().map(|(k, v)| (*k, v.as_str())).collect();
    fleet.spawn_env("trace-b", &["worker"], &env_b);
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
    let of_run: Vec<&(String, Value)> = all
        .iter()
        .filter(|(_, s)| s["traceId"].as_str() == Some(trace.as_str()))
        .collect();
    let steps = |service: &str| {
        of_run
            .iter()
            .filter(|(svc, s)| svc == service && s["name"] == "rein.step")
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
        .filter(|(_, s)| s["name"] == "rein.step")
        .filter_map(|(_, s)| s["spanId"].as_str())
        .collect();
    let actions: Vec<&Value> = of_run
        .iter()
        .map(|(_, s)| s)
        .filter(|s| s["name"] == "rein.action")
        .collect();
    assert!(actions.len() >= 4, "an action span per step: {actions:?}");
    for a in &actions {
        let parent = a["parentSpanId"].as_str().unwrap_or("");
        assert!(step_ids.contains(&parent), "action {a} is not under a step");
    }
    // Nothing of another trace: every span the workers sent belongs to the run.
    assert_eq!(of_run.len(), all.len(), "{all:?}");
}
