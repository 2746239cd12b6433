//! `rein bench --model`: what Rein adds to each step of a model agent. Runs of the built-in
//! `support-agent` (look the order up, refund, finish: three model calls with a tool call
//! between each) talk to the stand-in model server in this process, which answers at once,
//! so every millisecond measured is Rein's: claiming, building the conversation, committing
//! the reply, dispatching and committing the tool call, and asking again.
//!
//! Two figures, p50 and p99 over every run and step:
//! - enqueue → request: from the enqueue's return to the run's first request at the model;
//! - reply → next request: from the model's answer to the same run's next request.
//!
//! The reference, measured in the same invocation on the same database: one durable
//! single-row insert transaction, one after another on one connection.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rein_store::Store;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::demo_model;

/// Workers driving the runs (in this process).
const WORKERS: usize = 2;
/// Reference transactions measured.
const REFERENCE_COMMITS: usize = 500;
/// Scratch table of the reference.
const SCRATCH: &str = "rein_bench_model_reference";

/// What one `--model` invocation measures.
pub struct ModelBench {
    pub runs: u32,
    pub rate: f64,
    pub timeout: Duration,
}

pub async fn run(store: &Store, bench: &ModelBench) -> Result<Value, String> {
    let reference = reference_commit_us(store).await?;
    let (standin, base_url) = demo_model::start_stand_in().await?;
    let definition = demo_model::keyless_copy(store).await?;
    let options = rein_worker::model::ModelOptions {
        default_base_url: Some(base_url),
        ..rein_worker::model::ModelOptions::default()
    };

    let stop = CancellationToken::new();
    let mut fleet = tokio::task::JoinSet::new();
    for i in 0..WORKERS {
        let mut config = rein_worker::WorkerConfig::new(format!("bench-model-worker-{i}"));
        config.concurrency = 64;
        config.poll_interval_ms = 20;
        let registry = rein_worker::builtin_registry_full(
            store.clone(),
            rein_worker::http::HttpOptions {
                egress: rein_worker::egress::Policy::new(),
                quote_error_bodies: false,
            },
            options.clone(),
        );
        let worker = rein_worker::Worker::new(store.clone(), config, registry);
        let stop = stop.clone();
        fleet.spawn(async move {
            let _ = worker.run(stop).await;
        });
    }

    // Open loop at `rate`: each run is enqueued on its own, and its order id names it in the
    // model's requests.
    let gap = Duration::from_secs_f64(1.0 / bench.rate);
    let mut enqueued: HashMap<String, Instant> = HashMap::new();
    let mut ids = Vec::new();
    let started = Instant::now();
    for i in 0..bench.runs {
        let order = format!("B-{i}");
        let request = rein_store::EnqueueRequest::new(
            definition.clone(),
            json!({ "order_id": order, "amount": 40 }),
        );
        let done = store
            .enqueue(request)
            .await
            .map_err(|e| format!("enqueue: {e}"))?;
        enqueued.insert(order, Instant::now());
        ids.push(done.run_id);
        let next = started + gap * (i + 1);
        tokio::time::sleep_until(next.into()).await;
    }
    let deadline = Instant::now() + bench.timeout;
    loop {
        let open: i64 = store
            .count_by_state()
            .await
            .map_err(|e| format!("count the unfinished runs: {e}"))?
            .iter()
            .filter(|c| c.0 == demo_model::DEFINITION && c.2 != "terminal")
            .map(|c| c.3)
            .sum();
        if open == 0 {
            break;
        }
        if Instant::now() > deadline {
            stop.cancel();
            return Err(format!(
                "{open} of {} runs did not finish within {} s",
                ids.len(),
                bench.timeout.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    while fleet.join_next().await.is_some() {}

    // Each request, by the order it is about, in arrival order.
    let mut by_run: HashMap<String, Vec<Instant>> = HashMap::new();
    for (request, at) in standin.requests().iter().zip(standin.arrivals()) {
        if let Some(order) = order_of(request) {
            by_run.entry(order).or_default().push(at);
        }
    }
    let mut first = Vec::new();
    let mut between = Vec::new();
    for (order, times) in &by_run {
        if let (Some(t0), Some(e)) = (times.first(), enqueued.get(order)) {
            first.push(t0.saturating_duration_since(*e).as_micros() as u64);
        }
        for pair in times.windows(2) {
            between.push(pair[1].saturating_duration_since(pair[0]).as_micros() as u64);
        }
    }
    first.sort_unstable();
    between.sort_unstable();
    let ms = |us: u64| us as f64 / 1000.0;
    let p = |v: &[u64], q: f64| {
        v.get(((v.len().max(1) - 1) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(0)
    };
    let reference_p50 = p(&reference, 0.5).max(1);
    let figures = json!({
        "runs": ids.len(),
        "model_requests": standin.requests().len(),
        "rate_runs_per_s": bench.rate,
        "workers": WORKERS,
        "enqueue_to_request_ms": { "p50": ms(p(&first, 0.5)), "p99": ms(p(&first, 0.99)), "samples": first.len() },
        "reply_to_next_request_ms": { "p50": ms(p(&between, 0.5)), "p99": ms(p(&between, 0.99)), "samples": between.len() },
        "reference_commit_ms": { "p50": ms(reference_p50), "p99": ms(p(&reference, 0.99)), "samples": reference.len() },
        "ratios_to_reference_commit_p50": {
            "enqueue_to_request_p50": p(&first, 0.5) as f64 / reference_p50 as f64,
            "reply_to_next_request_p50": p(&between, 0.5) as f64 / reference_p50 as f64,
        },
    });
    Ok(figures)
}

/// Prints [`run`]'s figures for a person.
pub fn print(f: &Value) {
    println!(
        "\n== model steps: {} support-agent runs at {} runs/s, {} workers, the stand-in model answering at once ==",
        f["runs"], f["rate_runs_per_s"], f["workers"]
    );
    println!(
        "{:<34} {:>9} {:>9} {:>8} {:>12}",
        "", "p50 ms", "p99 ms", "samples", "p50 / commit"
    );
    let ratios = &f["ratios_to_reference_commit_p50"];
    for (label, key, ratio) in [
        (
            "enqueue → first model request",
            "enqueue_to_request_ms",
            &ratios["enqueue_to_request_p50"],
        ),
        (
            "model reply → next request",
            "reply_to_next_request_ms",
            &ratios["reply_to_next_request_p50"],
        ),
        (
            "reference: one durable commit",
            "reference_commit_ms",
            &json!(1.0),
        ),
    ] {
        println!(
            "{label:<34} {:>9.2} {:>9.2} {:>8} {:>11.1}×",
            f[key]["p50"].as_f64().unwrap_or(0.0),
            f[key]["p99"].as_f64().unwrap_or(0.0),
            f[key]["samples"],
            ratio.as_f64().unwrap_or(0.0),
        );
    }
    println!(
        "(reply → next request includes committing the reply, dispatching the tool call, committing its result and building the next conversation)"
    );
}

/// The order id a support-agent request is about (its task message).
fn order_of(request: &Value) -> Option<String> {
    request["messages"]
        .as_array()?
        .iter()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .and_then(|t| serde_json::from_str::<Value>(t).ok())
        .and_then(|task| task["order_id"].as_str().map(str::to_owned))
}

/// Latency of one durable single-row insert transaction, one after another, in µs, sorted.
async fn reference_commit_us(store: &Store) -> Result<Vec<u64>, String> {
    let fail = |e: rein_store::StoreError| format!("reference measurement: {e}");
    store.scratch_create(SCRATCH).await.map_err(fail)?;
    let mut out = Vec::with_capacity(REFERENCE_COMMITS);
    for _ in 0..REFERENCE_COMMITS {
        let t = Instant::now();
        store.scratch_insert(SCRATCH, 1).await.map_err(fail)?;
        out.push(t.elapsed().as_micros() as u64);
    }
    store.scratch_drop(SCRATCH).await.map_err(fail)?;
    out.sort_unstable();
    Ok(out)
}
