//! `rein demo`: everything in one process against a real PostgreSQL (a private one started
//! from the installed server binaries when DATABASE_URL is unset), driving a mixed workload
//! of both built-in definitions to the end and summarising what happened.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{EnqueueRequest, Sender, Store, counters};
use rein_worker::model::ModelOptions;
use rein_worker::{Worker, WorkerConfig};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use rein_process::report;
use rein_process::{DbArgs, exit};

/// Approvals of the demo's `expire` runs run out after this long, so the scheduler fires
/// their timeout while the demo watches.
const APPROVAL_EXPIRES_AFTER_MS: u64 = 2_000;
const APPROVAL_REMIND_BEFORE_MS: u64 = 1_000;
/// Version offset of those copies of the built-ins.
const EXPIRING_VERSION_OFFSET: u32 = 100;

#[derive(clap::Args)]
pub struct DemoArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Runs of the built-in sim and scripted definitions to enqueue; two runs of the
    /// model agent (`support-agent`) come on top.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    runs: u32,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
    /// Keep the database and the API serving after the summary until Ctrl-C.
    #[arg(long)]
    keep: bool,
    /// Give up waiting for the workload after this long.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

pub async fn demo(args: DemoArgs) -> u8 {
    rein_process::init_logging_at(false, "warn,sqlx=error");
    let mut private = None;
    let url = match args.db.database_url.clone() {
        Some(url) => url,
        None => match crate::privdb::start("demo", true).await {
            Ok(pg) => {
                let url = pg.url();
                private = Some(pg);
                url
            }
            Err(code) => return code,
        },
    };
    let (code, api, model_options) = run_demo(&args, &url).await;
    if args.keep
        && code == exit::OK
        && let Some(api) = api
    {
        // A scheduler and a worker keep serving, so a run enqueued now (through the API,
        // the CLI or the Python client) moves and ends like the demo's own.
        let stop = CancellationToken::new();
        let mut fleet = match Store::connect_within(&url, 8, args.db.db_connect_timeout_ms).await {
            Ok(store) => {
                awaiting_a_person(&store).await;
                start_fleet(&store, 1, 1, &stop, &model_options)
            }
            Err(e) => {
                eprintln!("warning: no worker kept serving: {e}");
                tokio::task::JoinSet::new()
            }
        };
        eprintln!(
            "\nkeeping the database, the API, a worker and a scheduler up.\nOpen the web console at {}/ and sign in with the token {}\nor explore through the API:\n  export REIN_URL={} REIN_TOKEN={}\n  rein runs list\n  rein runs show RUN\n  rein why RUN\n  rein approvals list --all\nor the database directly: export DATABASE_URL={url}\nCtrl-C to stop.",
            api.url, api.token, api.url, api.token
        );
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
        while fleet.join_next().await.is_some() {}
    } else if code == exit::OK && api.is_some() {
        eprintln!(
            "\nthe demo's API has stopped with it; run `rein demo --keep` to keep the API and the database up and explore them"
        );
    }
    if let Some(pg) = private {
        crate::privdb::finish(pg, code == exit::OK).await;
    }
    code
}

/// Starts `schedulers` schedulers and `workers` workers in this process; they stop with
/// `stop`.
fn start_fleet(
    store: &Store,
    schedulers: usize,
    workers: usize,
    stop: &CancellationToken,
    model: &ModelOptions,
) -> tokio::task::JoinSet<()> {
    let mut fleet = tokio::task::JoinSet::new();
    for i in 0..schedulers {
        let mut config = SchedulerConfig::new(format!("demo-scheduler-{i}"));
        config.tick_ms = 50;
        let mut scheduler = Scheduler::new(store.clone(), config);
        let stop = stop.clone();
        fleet.spawn(async move {
            let _ = scheduler.run(stop).await;
        });
    }
    for i in 0..workers {
        let mut config = WorkerConfig::new(format!("demo-worker-{i}"));
        config.concurrency = 16;
        config.lease_ttl_ms = 5_000;
        config.poll_interval_ms = 20;
        let worker = Worker::new(
            store.clone(),
            config,
            rein_worker::builtin_registry_full(
                store.clone(),
                rein_worker::http::HttpOptions {
                    egress: rein_worker::egress::Policy::new(),
                    quote_error_bodies: false,
                },
                model.clone(),
            ),
        );
        let stop = stop.clone();
        fleet.spawn(async move {
            let _ = worker.run(stop).await;
        });
    }
    fleet
}

/// Runs the workload; returns the exit code and the API it served.
async fn run_demo(args: &DemoArgs, url: &str) -> (u8, Option<DemoApi>, ModelOptions) {
    let store = match Store::connect_within(url, 24, args.db.db_connect_timeout_ms).await {
        Ok(s) => s,
        Err(e) => return (report(&e), None, ModelOptions::default()),
    };
    if let Err(e) = store.migrate().await {
        return (report(&e), None, ModelOptions::default());
    }
    // The API serves this database for the demo's lifetime (and with --keep, after it), with
    // a token made for the demo.
    let api = match start_api(&store).await {
        Ok(api) => api,
        Err(code) => return (code, None, ModelOptions::default()),
    };
    let model = match crate::demo_model::setup(&store).await {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return (exit::INPUT, Some(api), ModelOptions::default());
        }
    };
    let code = drive(args, url, &store, &api, &model).await;
    (code, Some(api), model.options)
}

async fn drive(
    args: &DemoArgs,
    url: &str,
    store: &Store,
    api: &DemoApi,
    model: &crate::demo_model::ModelSetup,
) -> u8 {
    let store = store.clone();
    eprintln!("API on {} (token for this demo: {})", api.url, api.token);
    let stop = CancellationToken::new();
    let mut fleet = start_fleet(&store, 2, 4, &stop, &model.options);

    let (lifecycle, research, refund) = match (
        store.load_definition("lifecycle", None).await,
        store.load_definition("research-agent", None).await,
        store.load_definition("refund-agent", None).await,
    ) {
        (Ok(a), Ok(b), Ok(c)) => (a, b, c),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return report(&e),
    };
    // Copies whose approvals run out in seconds, for the runs whose approver never answers.
    let mut expiring = Vec::new();
    for def in [&lifecycle, &research] {
        let copy = match rein_worker::sim::with_fast_approval_expiry(
            def,
            APPROVAL_EXPIRES_AFTER_MS,
            APPROVAL_REMIND_BEFORE_MS,
            EXPIRING_VERSION_OFFSET,
        ) {
            Ok(copy) => copy,
            Err(e) => {
                eprintln!("error: {e}");
                return exit::INPUT;
            }
        };
        if let Err(e) = store.register_definition(&copy).await {
            return report(&e);
        }
        expiring.push(copy);
    }
    let [lifecycle_expiring, research_expiring] = [&expiring[0], &expiring[1]];
    let mut requests = Vec::new();
    for i in 0..args.runs {
        // Every tenth run is a refund agent: a scripted model picks tools, refunds over 100
        // wait for the approver.
        if i % 10 == 9 {
            requests.push(EnqueueRequest::new(refund.clone(), refund_input(i)));
            continue;
        }
        let (def, sim) = workload(i, &lifecycle, &research);
        let def = match sim["approval"].as_str() {
            Some("expire") if def.name() == "lifecycle" => lifecycle_expiring.clone(),
            Some("expire") => research_expiring.clone(),
            _ => def,
        };
        requests.push(EnqueueRequest::new(def, json!({ "sim": sim })));
    }
    // Two runs of a real agent: a model picks the tools; the refund over 100 waits for the
    // demo's approver.
    let support_first = requests.len();
    for input in crate::demo_model::inputs() {
        requests.push(EnqueueRequest::new(model.definition.clone(), input));
    }
    let started = Instant::now();
    let mut run_ids = Vec::new();
    for chunk in requests.chunks(1000) {
        match store.enqueue_batch(chunk).await {
            Ok(done) => run_ids.extend(done.into_iter().map(|e| e.run_id)),
            Err(e) => return report(&e),
        }
    }
    eprintln!(
        "enqueued {} runs (lifecycle and research-agent with sim actions; refund-agent with a scripted model; {} with a model at {}{})",
        run_ids.len(),
        crate::demo_model::DEFINITION,
        model.endpoint,
        if model.stand_in {
            ", a local stand-in because REIN_MODEL_URL is not set"
        } else {
            ""
        }
    );
    let support_runs: Vec<uuid::Uuid> = run_ids.get(support_first..).unwrap_or(&[]).to_vec();
    let cancel_target = run_ids.get(7).copied();
    let mut cancelled = false;
    let mut approvals = BTreeMap::<&str, u64>::new();
    let deadline = Instant::now() + Duration::from_secs(args.timeout_s);
    let mut last_print = Instant::now() - Duration::from_secs(1);
    // Live bars per definition and state on a terminal; a line a second otherwise.
    let mut bars = (std::io::IsTerminal::is_terminal(&std::io::stderr()) && !args.json)
        .then(StateBars::default);
    loop {
        // The simulated approver decides parked approvals as each run's input says.
        // Agent runs ask through the approval store, bound to the exact call: the approver
        // decides each open request as the run's input says.
        if let Ok(open) = store.approvals(false, None, 200).await {
            for request in open {
                let Ok(row) = store.run(request.run_id).await else {
                    continue;
                };
                let grant = row.projection.data["agent"]["approver"] != "deny";
                let comment = if grant {
                    "the order checks out"
                } else {
                    "not eligible for a refund"
                };
                if store
                    .decide_approval(request.approval_id, grant, "demo-approver", Some(comment))
                    .await
                    .is_ok()
                {
                    *approvals
                        .entry(if grant { "granted" } else { "denied" })
                        .or_default() += 1;
                }
            }
        }
        if let Ok(waiting) = store
            .runs_in_states(&rein_worker::sim::APPROVAL_WAIT_STATES, 200)
            .await
        {
            for row in waiting {
                if row.definition == "refund-agent"
                    || row.definition == crate::demo_model::DEFINITION
                {
                    continue; // decided above, through its request
                }
                let Some((event, deny)) =
                    rein_worker::sim::approver_answer(&row.definition, &row.projection.data)
                else {
                    continue;
                };
                let payload = json!({ "approver": "demo-approver", "reason": if deny { "denied by the demo approver" } else { "granted" } });
                if store
                    .send(
                        row.run_id,
                        event,
                        payload,
                        &Sender::Approver("demo-approver".into()),
                        60_000,
                    )
                    .await
                    .is_ok()
                {
                    *approvals
                        .entry(if deny { "denied" } else { "granted" })
                        .or_default() += 1;
                }
            }
        }
        if !cancelled
            && let Some(run) = cancel_target
            && store
                .send(
                    run,
                    "CANCEL",
                    json!({ "reason": "cancelled by the demo" }),
                    &Sender::outside("demo-operator"),
                    60_000,
                )
                .await
                .is_ok()
        {
            cancelled = true;
        }
        let counts = match store.count_by_state().await {
            Ok(c) => c,
            Err(e) => return report(&e),
        };
        let terminal: i64 = counts
            .iter()
            .filter(|c| c.2 == "terminal")
            .map(|c| c.3)
            .sum();
        let total: i64 = counts.iter().map(|c| c.3).sum();
        if let Some(bars) = bars.as_mut() {
            bars.show(&counts);
        } else if last_print.elapsed() >= Duration::from_secs(1) || terminal == total {
            last_print = Instant::now();
            let line: Vec<String> = counts
                .iter()
                .map(|(d, s, _, n)| format!("{d}/{s}={n}"))
                .collect();
            eprintln!(
                "[{:>5.1}s] {terminal}/{total} finished  {}",
                started.elapsed().as_secs_f64(),
                line.join(" ")
            );
        }
        if terminal == total {
            break;
        }
        if Instant::now() > deadline {
            eprintln!(
                "error: the workload did not finish within {} s",
                args.timeout_s
            );
            stop.cancel();
            return exit::REFUSED;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    stop.cancel();
    while fleet.join_next().await.is_some() {}

    let counts = store.count_by_state().await.unwrap_or_default();
    let events = store.count_events_by_type().await.unwrap_or_default();
    let fenced = store.counter(counters::FENCED_WRITES).await.unwrap_or(0);
    let expired = store
        .count_events_with_reason("approval_expired")
        .await
        .unwrap_or(0);
    let events_total: i64 = events.iter().map(|e| e.1).sum();
    let count = |names: &[&str]| crate::events_of(&events, names);
    let mut by_final: BTreeMap<String, i64> = BTreeMap::new();
    for (d, s, _, n) in &counts {
        *by_final.entry(format!("{d}/{s}")).or_default() += n;
    }
    let mut integrity_errors = 0;
    for run in &run_ids {
        if !matches!(store.verify_run(*run).await, Ok(None)) {
            integrity_errors += 1;
        }
    }
    let summary = json!({
        "runs": run_ids.len(),
        "runs_by_final_state": by_final,
        "events": events_total,
        "retries": count(&["retry", "RETRY_DUE"]),
        "approvals": {
            "granted": approvals.get("granted").copied().unwrap_or(0),
            "denied": approvals.get("denied").copied().unwrap_or(0),
            "expired": expired,
        },
        "cancelled": count(&["CANCEL"]),
        "fenced_writes_rejected": fenced,
        "replay_mismatches": integrity_errors,
        "elapsed_s": elapsed,
        "runs_per_s": run_ids.len() as f64 / elapsed,
        "events_per_s": events_total as f64 / elapsed,
        "database_url": url,
        "api": { "url": api.url, "token": api.token },
        "model_agent": {
            "endpoint": model.endpoint,
            "stand_in": model.stand_in,
            "runs": crate::demo_model::report(&store, &support_runs).await,
        },
    });
    if args.json {
        println!("{summary}");
    } else {
        print_summary(&summary);
        crate::demo_model::print_report(&summary["model_agent"], &summary["model_agent"]["runs"]);
    }
    if integrity_errors > 0 {
        exit::REFUSED
    } else {
        exit::OK
    }
}

/// With `--keep`: one more refund, over 100, that nobody decides, so a person can approve
/// it from the console or the CLI and watch the run move on.
async fn awaiting_a_person(store: &Store) {
    let mut input = refund_input(0);
    input["agent"]["script"][1]["args"] = json!({ "order_id": "order-for-you", "amount": 250 });
    input["agent"]["approver"] = json!("person");
    let enqueued = match store.load_definition("refund-agent", None).await {
        Ok(def) => store.enqueue(EnqueueRequest::new(def, input)).await,
        Err(e) => Err(e),
    };
    match enqueued {
        Ok(run) => eprintln!(
            "a refund of 250 (run {}) waits for a person's approval: approve it in the console's Approvals page or with `rein approvals list` and `rein approve`",
            run.run_id
        ),
        Err(e) => eprintln!("warning: the refund that waits for a person was not enqueued: {e}"),
    }
}

/// A refund-agent run: look the order up, refund an amount (over 100 every other time, so a
/// person must approve that exact call; some are denied), finish.
fn refund_input(i: u32) -> Value {
    let amount = if (i / 10).is_multiple_of(2) { 150 } else { 40 };
    json!({ "agent": {
        "script": [
            { "decision": "call_tool", "tool": "lookup_order",
              "args": { "order_id": format!("order-{i}") } },
            { "decision": "call_tool", "tool": "refund",
              "args": { "order_id": format!("order-{i}"), "amount": amount } },
            { "decision": "FINISH" }],
        "approver": if (i / 20).is_multiple_of(2) { "grant" } else { "deny" } } })
}

/// Run `i` of the demo workload: a mix that exercises retries, exhaustion, approvals (granted
/// and denied), failures and multi-step agents.
fn workload(
    i: u32,
    lifecycle: &rein_core::Definition,
    research: &rein_core::Definition,
) -> (rein_core::Definition, Value) {
    let def = if i.is_multiple_of(2) {
        lifecycle.clone()
    } else {
        research.clone()
    };
    // Both definitions get every variant: the variant follows the pair index.
    let sim = match (i / 2) % 20 {
        0..=3 => json!({ "work_ms": 20, "transient_failures": 1 + (i / 2) % 2 }),
        4 | 5 => json!({ "work_ms": 10, "transient_failures": 5 }),
        6 | 7 => json!({ "work_ms": 10, "approval": "grant", "amount": 150 }),
        8 | 9 => json!({ "work_ms": 10, "approval": "deny", "amount": 500 }),
        10 | 11 => json!({ "work_ms": 10, "fatal_at_step": 1 }),
        12 | 13 => json!({ "work_ms": 30, "steps": 3 }),
        // Nobody answers: the approval times out through the scheduler.
        17 => json!({ "work_ms": 10, "approval": "expire", "amount": 300 }),
        _ => json!({ "work_ms": 10 }),
    };
    (def, sim)
}

/// One bar per definition (finished runs of its total) with its live states as the message.
#[derive(Default)]
struct StateBars {
    multi: indicatif::MultiProgress,
    bars: BTreeMap<String, indicatif::ProgressBar>,
}

impl StateBars {
    fn show(&mut self, counts: &[(String, String, String, i64)]) {
        let mut per_def: BTreeMap<&str, (u64, u64, Vec<String>)> = BTreeMap::new();
        for (def, state, status, n) in counts {
            let entry = per_def.entry(def.as_str()).or_default();
            entry.0 += *n as u64;
            if status == "terminal" {
                entry.1 += *n as u64;
            }
            entry.2.push(format!("{state} {n}"));
        }
        for (def, (total, done, states)) in per_def {
            let bar = self.bars.entry(def.to_owned()).or_insert_with(|| {
                let bar = self.multi.add(indicatif::ProgressBar::new(total));
                if let Ok(style) = indicatif::ProgressStyle::with_template(
                    "{prefix:>15} {bar:30} {pos:>5}/{len:<5} {msg}",
                ) {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar.set_prefix(def.to_owned());
                bar
            });
            bar.set_length(total);
            bar.set_position(done);
            bar.set_message(states.join("  "));
        }
    }
}

struct DemoApi {
    url: String,
    token: String,
}

/// Starts `rein api` in this process on a free port, with an admin token for the demo.
async fn start_api(store: &Store) -> Result<DemoApi, u8> {
    let (_, token) = match store.create_token("rein-demo", &["admin".to_owned()]).await {
        Ok(t) => t,
        Err(e) => return Err(report(&e)),
    };
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot open a port for the API: {e}");
            return Err(exit::INPUT);
        }
    };
    let url = match listener.local_addr() {
        Ok(a) => format!("http://{a}"),
        Err(e) => {
            eprintln!("error: cannot read the API's address: {e}");
            return Err(exit::INPUT);
        }
    };
    // Redaction works in the demo: with REIN_REDACTION_KEY's key when it is set, else with
    // one made for this demo alone.
    let key = rein_process::redaction_key().ok().flatten().or_else(|| {
        let secret: String = rand::random::<[u8; 32]>()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        rein_core::redact::RedactionKey::new(&secret).ok()
    });
    let app = rein_api::router(
        store.clone().with_redaction_key(key),
        false,
        rein_api::Limits::default(),
        None,
    );
    // Serves until the demo's process exits.
    tokio::spawn(rein_api::serve_in_process(
        listener,
        app,
        tokio_util::sync::CancellationToken::new(),
    ));
    Ok(DemoApi { url, token })
}

fn print_summary(s: &Value) {
    println!("\n== Rein demo summary ==");
    println!(
        "API {url} (serves until the demo exits; `rein demo --keep` keeps it) — try: REIN_URL={url} REIN_TOKEN={token} rein runs list --status terminal",
        url = s["api"]["url"].as_str().unwrap_or(""),
        token = s["api"]["token"].as_str().unwrap_or(""),
    );
    println!("{:<40} {:>8}", "runs by final state", "count");
    if let Some(map) = s["runs_by_final_state"].as_object() {
        for (k, v) in map {
            println!("  {k:<38} {v:>8}");
        }
    }
    println!("{:<40} {:>8}", "runs", s["runs"]);
    println!("{:<40} {:>8}", "events committed", s["events"]);
    println!("{:<40} {:>8}", "retries", s["retries"]);
    println!(
        "{:<40} {:>8}",
        "approvals granted", s["approvals"]["granted"]
    );
    println!("{:<40} {:>8}", "approvals denied", s["approvals"]["denied"]);
    println!(
        "{:<40} {:>8}",
        "approvals expired (timed out)", s["approvals"]["expired"]
    );
    println!("{:<40} {:>8}", "cancelled", s["cancelled"]);
    println!(
        "{:<40} {:>8}",
        "fenced writes rejected", s["fenced_writes_rejected"]
    );
    println!(
        "{:<40} {:>8}",
        "runs whose log does not replay", s["replay_mismatches"]
    );
    println!(
        "{:<40} {:>8.1} runs/s, {:.1} events/s",
        "throughput",
        s["runs_per_s"].as_f64().unwrap_or(0.0),
        s["events_per_s"].as_f64().unwrap_or(0.0)
    );
}
