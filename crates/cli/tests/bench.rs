//! `rein bench` as a user runs it: small workloads against a real database, checking that the
//! report is complete and consistent with what the database holds — never how fast it was.

use crate::common;

use common::{PrivateRedis, REIN, free_port, rein, stderr, stdout};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn bench(url: &str, extra: &[&str]) -> (Option<i32>, Value, String) {
    let mut args = vec![
        "bench",
        "--database-url",
        url,
        "--runs",
        "200",
        "--reference-s",
        "1",
        "--duration-s",
        "60",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = rein(&args);
    let err = stderr(&out);
    let report = serde_json::from_str(&stdout(&out)).unwrap_or(Value::Null);
    (out.status.code(), report, err)
}

fn migrated(prefix: &str) -> String {
    let url = common::fresh_database(prefix);
    let out = rein(&["migrate", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    url
}

/// `got` is `expected` within `tolerance` of it, or both are None.
fn assert_near(got: Option<f64>, expected: Option<f64>, tolerance: f64, context: &Value) {
    match (got, expected) {
        (Some(g), Some(e)) => assert!((g - e).abs() <= tolerance * e, "{g} vs {e}: {context}"),
        (g, e) => assert_eq!(g, e, "{context}"),
    }
}

fn assert_complete(report: &Value, runs: i64, events_per_run: i64) {
    for key in [
        "runs_per_s",
        "steps_per_s",
        "events_per_s",
        "db_transactions_per_step",
    ] {
        assert!(
            report[key].as_f64().is_some_and(|v| v > 0.0),
            "{key} in {report}"
        );
    }
    for key in [
        "enqueue_to_start_p50",
        "enqueue_to_start_p99",
        "step_p50",
        "step_p99",
    ] {
        assert!(
            report["latency_ms"][key].as_f64().is_some(),
            "latency_ms.{key} in {report}"
        );
    }
    for key in ["single_inserts_per_s", "batched_inserts_per_s"] {
        assert!(
            report["reference"][key].as_f64().is_some_and(|v| v > 0.0),
            "reference.{key} in {report}"
        );
    }
    assert_eq!(report["reference"]["batch_size"], 10);
    for key in [
        "runs",
        "workers",
        "processes",
        "claim_batch",
        "commit_batching",
        "definition",
        "redis",
    ] {
        assert!(
            report["params"].get(key).is_some(),
            "params.{key} in {report}"
        );
    }
    let point = &report["points"][0];
    assert_eq!(point["runs"], runs, "{point}");
    assert_eq!(point["runs_finished"], runs, "{point}");
    assert_eq!(point["events"], runs * events_per_run, "{point}");
    assert_eq!(point["steps"], runs * events_per_run, "{point}");
    assert_eq!(point["enqueue_to_start_ms"]["samples"], runs, "{point}");
    assert!(point["connections"].as_u64().is_some_and(|c| c >= 1));
    // WAL is read on any server; per event it is at least the event row itself.
    assert!(
        point["cost"]["wal_bytes_per_event"].as_f64() > Some(50.0),
        "{point}"
    );
    assert!(
        report["db_cost"]["reference_batched"]["wal_bytes_per_row"].as_f64() > Some(0.0),
        "{report}"
    );
    // The machine's CPU (/proc/stat) per event and per reference row, and their ratio.
    let cpu = point["cost"]["machine_cpu_us_per_event"].as_f64();
    assert!(cpu > Some(0.0), "{point}");
    assert_eq!(report["db_cost"]["machine_cpu_us_per_event"].as_f64(), cpu);
    // The in-process workers' share of it: this process's own CPU, part of the machine's
    // (whose /proc/stat ticks are coarser, hence the slack).
    let workers = point["cost"]["workers_cpu_us_per_event"].as_f64();
    if point["processes"] == false {
        assert!(workers > Some(0.0), "{point}");
        assert!(workers < cpu.map(|c| c * 1.1), "{point}");
    } else {
        assert_eq!(workers, None, "worker processes' CPU is theirs: {point}");
    }
    assert_eq!(
        report["db_cost"]["workers_cpu_us_per_event"].as_f64(),
        workers
    );
    // How busy the machine's CPUs were while the runs ran (what bounds the point), with
    // the CPUs counted; /proc/stat's ticks are coarse, hence the slack above 1.
    let share = point["cost"]["machine_busy_share"].as_f64();
    assert!(share.is_some_and(|s| s > 0.0 && s <= 1.05), "{point}");
    assert!(point["cost"]["machine_cpus"].as_u64() >= Some(1), "{point}");
    assert_eq!(report["db_cost"]["machine_busy_share"].as_f64(), share);
    assert_eq!(
        report["db_cost"]["machine_cpus"],
        point["cost"]["machine_cpus"]
    );
    let row = report["db_cost"]["reference_batched"]["machine_cpu_us_per_row"].as_f64();
    assert!(row > Some(0.0), "{report}");
    let expected = row.unwrap() / cpu.unwrap();
    let said = report["ratios"]["batched_row_cpu_to_event_cpu"]
        .as_f64()
        .expect("the CPU ratio");
    assert!((said - expected).abs() <= 1e-9 * expected, "{report}");
    // The same with each side's client left out: the machine's CPU less the in-process
    // workers' per event, less the inserting process's per reference row. A worker
    // process's CPU is not this process's to read, so that point has neither.
    let server = point["cost"]["server_cpu_us_per_event"].as_f64();
    assert_eq!(
        report["db_cost"]["server_cpu_us_per_event"].as_f64(),
        server
    );
    let per_event = cpu.zip(workers).map(|(c, w)| c - w).filter(|&s| s > 0.0);
    assert_near(server, per_event, 1e-6, point);
    let reference = &report["db_cost"]["reference_batched"];
    let row_server = reference["server_cpu_us_per_row"].as_f64();
    let row_expected = row
        .zip(reference["client_cpu_us_per_row"].as_f64())
        .map(|(m, c)| m - c)
        .filter(|&s| s > 0.0);
    assert_near(row_server, row_expected, 1e-6, report);
    let said = report["ratios"]["batched_row_server_cpu_to_event_server_cpu"].as_f64();
    let expected = server.zip(row_server).map(|(event, row)| row / event);
    assert_near(said, expected, 1e-9, report);
    if point["processes"] == false {
        assert!(server.is_some(), "the workers are this process's: {point}");
    }
    assert!(
        point["peak_rss_mb"]
            .as_array()
            .is_some_and(|a| !a.is_empty() && a.iter().all(|m| m.as_f64() > Some(0.0))),
        "{point}"
    );
}

#[test]
fn bench_reports_every_figure_for_in_process_workers_and_groups_commits() {
    let url = migrated("bench_inproc");
    let (code, report, err) = bench(&url, &["--workers", "2"]);
    assert_eq!(code, Some(0), "{err}");
    // chain4: four steps, one event each.
    assert_complete(&report, 200, 4);
    let point = &report["points"][0];
    assert!(
        point["commit_statements"].as_u64() < Some(800),
        "800 commits in fewer statements with batching: {point}"
    );
    assert!(point["claim_queries"].as_u64() > Some(0), "{point}");
    // Without `--floor` there is no floor to be a share of.
    assert!(
        report["ratios"]["events_per_s_to_floor"].is_null(),
        "{report}"
    );
    // A database given to the benchmark is left as it is: without pg_stat_statements in it,
    // statement times are unavailable and say why.
    let why = report["db_cost"]["statements_unavailable"]
        .as_str()
        .unwrap_or_else(|| panic!("no reason for missing statement times: {report}"));
    assert!(why.contains("pg_stat_statements"), "{why}");
    assert!(
        report["db_cost"]["commit_us_per_event"].is_null(),
        "{report}"
    );

    // Without batching, every commit is its own statement.
    let (code, report, err) = bench(&url, &["--workers", "1", "--no-commit-batching"]);
    assert_eq!(code, Some(0), "{err}");
    assert_complete(&report, 200, 4);
    assert!(
        report["points"][0]["commit_statements"].as_u64() >= Some(800),
        "{report}"
    );
    assert_eq!(report["params"]["commit_batching"], false);
}

/// `--floor`: each bare shape of a step's writes is measured from as many connections as
/// the reference, next to it, on scratch tables that are gone afterwards; the event log and
/// the runs are left as the point left them.
#[tokio::test]
async fn bench_measures_the_floor_under_a_step_on_scratch_tables() {
    let url = migrated("bench_floor");
    let (code, report, err) = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            bench(
                &url,
                &["--workers", "1", "--floor", "--reference-connections", "5"],
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert_complete(&report, 200, 4);
    let floor = &report["floor"];
    let reference = &report["reference"];
    assert_eq!(floor["connections"], reference["connections"], "{report}");
    // Pinned: the reference and the floor write from 5 connections, whatever the point's.
    assert_eq!(reference["connections"], 5, "{report}");
    assert_eq!(floor["runs_per_statement"], 28, "{floor}");
    // The projection of a finished chain4 run, not an empty object.
    assert!(floor["projection_bytes"].as_u64() > Some(100), "{floor}");
    let shapes = floor["shapes"].as_array().expect("shapes");
    let names: Vec<&str> = shapes.iter().filter_map(|s| s["shape"].as_str()).collect();
    assert_eq!(
        names,
        [
            "events_only",
            "run_row",
            "projection",
            "fenced_event",
            "fenced_run"
        ],
        "{floor}"
    );
    // Rein's events/s as a share of the bare writes with the projection, what its commit
    // writes today.
    let with_projection = shapes[2]["events_per_s"].as_f64().unwrap();
    let events_per_s = report["events_per_s"].as_f64().unwrap();
    let said = report["ratios"]["events_per_s_to_floor"]
        .as_f64()
        .expect("the share of the floor");
    let expected = events_per_s / with_projection;
    assert!((said - expected).abs() <= 0.01 * expected, "{report}");
    let rows_per_s = reference["batched_inserts_per_s"].as_f64().unwrap();
    for s in shapes {
        let per_s = s["events_per_s"].as_f64().unwrap_or(0.0);
        assert!(per_s > 0.0, "{s}");
        let r = s["events_per_s_to_batched_rows_per_s"].as_f64().unwrap();
        assert!((r - per_s / rows_per_s).abs() <= 0.01 * r, "{s}");
        let cost = &s["cost"];
        assert!(cost["wal_bytes_per_row"].as_f64() > Some(0.0), "{s}");
        let machine = cost["machine_cpu_us_per_row"].as_f64().unwrap_or(0.0);
        let client = cost["client_cpu_us_per_row"].as_f64().unwrap_or(0.0);
        // /proc/stat counts in ticks: 10% slack for the client's share of the machine.
        assert!(client > 0.0 && client <= machine * 1.1, "{s}");
        // The server's CPU: the machine's less the client's, per event and per reference
        // row, and their ratio.
        let server = cost["server_cpu_us_per_row"].as_f64();
        let expected = Some(machine - client).filter(|&x| x > 0.0);
        assert_near(server, expected, 1e-6, s);
        let said = s["batched_row_server_cpu_to_event_server_cpu"].as_f64();
        let row = report["db_cost"]["reference_batched"]["server_cpu_us_per_row"].as_f64();
        let expected = server.zip(row).map(|(event, row)| row / event);
        assert_near(said, expected, 1e-9, s);
    }
    // The reference's rows carry the client's share too.
    assert!(
        report["db_cost"]["reference_batched"]["client_cpu_us_per_row"].as_f64() > Some(0.0),
        "{report}"
    );
    // The layout in which a step writes only its event: a reference row's machine CPU over
    // the run's-life shape's server CPU plus Rein's workers' CPU an event.
    let life = &shapes[4]["cost"];
    let life_server = life["server_cpu_us_per_row"].as_f64();
    let workers = report["db_cost"]["workers_cpu_us_per_event"].as_f64();
    let row = report["db_cost"]["reference_batched"]["machine_cpu_us_per_row"].as_f64();
    let expected = life_server
        .zip(workers)
        .zip(row)
        .map(|((life, workers), row)| row / (life + workers));
    assert!(expected.is_some(), "{report}");
    assert_near(
        report["ratios"]["event_only_layout_cpu_ratio"].as_f64(),
        expected,
        1e-9,
        &report,
    );

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'rein_bench_floor_%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(left, 0, "the floor's scratch tables are dropped");
    let floor_events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rein_events_all WHERE worker = 'floor'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(floor_events, 0, "the floor never writes the event log");
    pool.close().await;
}

/// `--repeat`: the point and the reference measured in turn. Each pair's ratio is its own
/// point's over its own reference's, the headline figures are the pair with the median
/// ratio, and every pair's point ran all its runs to the end.
#[tokio::test]
async fn bench_repeats_the_point_and_the_reference_in_turn_and_leads_with_the_median_pair() {
    let url = migrated("bench_repeat");
    let (code, report, err) = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            bench(
                &url,
                &[
                    "--workers",
                    "1",
                    "--repeat",
                    "3",
                    "--reference-connections",
                    "5",
                ],
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert_complete(&report, 200, 4);
    let repeats = &report["repeats"];
    let pairs = repeats["pairs"].as_array().expect("pairs");
    assert_eq!(pairs.len(), 3, "{repeats}");
    let ratios: Vec<f64> = pairs
        .iter()
        .map(|p| {
            let said = p["events_per_s_to_batched_rows_per_s"].as_f64().unwrap();
            let events = p["events_per_s"].as_f64().unwrap();
            let rows = p["batched_rows_per_s"].as_f64().unwrap();
            assert!(events > 0.0 && rows > 0.0, "{p}");
            assert!((said - events / rows).abs() <= 1e-9 * said, "{p}");
            assert!(p["machine_cpu_us_per_event"].as_f64() > Some(0.0), "{p}");
            // Every pair's reference wrote from the pinned connections, not the point's.
            assert_eq!(p["reference_connections"], 5, "{p}");
            assert!(p["connections"].as_u64() < Some(5), "{p}");
            said
        })
        .collect();
    let mut sorted = ratios.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(repeats["ratio_min"].as_f64(), Some(sorted[0]), "{repeats}");
    assert_eq!(
        repeats["ratio_median"].as_f64(),
        Some(sorted[1]),
        "{repeats}"
    );
    assert_eq!(repeats["ratio_max"].as_f64(), Some(sorted[2]), "{repeats}");
    let headline = repeats["headline"].as_u64().expect("headline") as usize;
    assert_eq!(ratios[headline], sorted[1], "{repeats}");
    // The headline figures, the points table and the reference are that pair's.
    let pair = &pairs[headline];
    assert_eq!(report["events_per_s"], pair["events_per_s"], "{report}");
    assert_eq!(report["points"][0]["events_per_s"], pair["events_per_s"]);
    assert_eq!(
        report["reference"]["batched_inserts_per_s"],
        pair["batched_rows_per_s"]
    );
    assert_eq!(
        report["ratios"]["events_per_s_to_batched_rows_per_s"].as_f64(),
        Some(sorted[1])
    );
    // The headline's server-side CPU ratio is its pair's too.
    assert_eq!(
        report["ratios"]["batched_row_server_cpu_to_event_server_cpu"], pair["server_cpu_ratio"],
        "{report}"
    );

    // Three points' runs, every one of them finished.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (runs, finished): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status = 'terminal') FROM rein_runs",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((runs, finished), (600, 600));
    pool.close().await;

    // Without --repeat the report has the one pair.
    let (code, report, err) = tokio::task::spawn_blocking(move || bench(&url, &["--workers", "1"]))
        .await
        .unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(report["repeats"]["pairs"].as_array().map(Vec::len), Some(1));
    assert_eq!(report["repeats"]["headline"], 0);
    // Unpinned, the reference writes from as many connections as the point's workers opened.
    let pair = &report["repeats"]["pairs"][0];
    assert_eq!(pair["reference_connections"], pair["connections"], "{pair}");
    assert_eq!(report["reference"]["connections"], pair["connections"]);
}

#[test]
fn bench_drives_real_worker_processes_and_reads_their_figures() {
    let url = migrated("bench_procs");
    let (code, report, err) = bench(&url, &["--processes", "2"]);
    assert_eq!(code, Some(0), "{err}");
    assert_complete(&report, 200, 4);
    let point = &report["points"][0];
    assert_eq!(point["processes"], true);
    assert_eq!(
        point["peak_rss_mb"].as_array().map(Vec::len),
        Some(2),
        "one peak RSS per worker process: {point}"
    );
    // The figures come from the processes' own logs as they stopped.
    assert!(point["claim_queries"].as_u64() > Some(0), "{point}");
    assert_eq!(report["params"]["processes"], serde_json::json!([2]));
}

#[test]
fn bench_runs_any_definition_file_with_sim_actions() {
    let url = migrated("bench_file");
    let dir = common::tmp_dir("bench_file");
    let file = dir.join("three-steps.toml");
    std::fs::write(
        &file,
        r#"
name = "three-steps"
version = 1
cancel_state = "cancelled"
events = ["TASK_ACCEPTED", "next", "OUTPUT_COMMITTED"]
call_results = []

[[states]]
name = "INTAKE"
kind = "active"
initial = true
action = "sim"

[[states]]
name = "work"
kind = "active"
action = "noop"

[[states]]
name = "FINALIZING"
kind = "active"
action = "sim"

[[states]]
name = "done"
kind = "terminal"

[[states]]
name = "cancelled"
kind = "terminal"

[[transitions]]
from = "INTAKE"
event = "TASK_ACCEPTED"
to = "work"

[[transitions]]
from = "work"
event = "next"
to = "FINALIZING"

[[transitions]]
from = "FINALIZING"
event = "OUTPUT_COMMITTED"
to = "done"
"#,
    )
    .expect("write the definition");
    let path = file.to_string_lossy().into_owned();
    let (code, report, err) = bench(
        &url,
        &["--definition", &path, "--input", r#"{"sim":{"work_ms":2}}"#],
    );
    assert_eq!(code, Some(0), "{err}");
    assert_complete(&report, 200, 3);
    assert_eq!(report["params"]["definition"], "three-steps v1", "{report}");
}

#[test]
fn bench_says_what_is_wrong_before_it_starts() {
    // An unreachable database: exit 3, and the reason.
    let out = rein(&[
        "bench",
        "--database-url",
        "postgres://nobody@127.0.0.1:1/none",
        "--runs",
        "10",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("error"), "{}", stderr(&out));

    // A database without Rein's schema: exit 3, and what to run.
    let url = common::fresh_database("bench_noschema");
    let out = rein(&["bench", "--database-url", &url, "--runs", "10"]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("rein migrate"), "{}", stderr(&out));

    // Bad input: exit 1 with the reason, before touching any database.
    for (args, says) in [
        (vec!["--input", "[1]"], "JSON object"),
        (vec!["--input", "{"], "not valid JSON"),
        (vec!["--definition", "/nonexistent.toml"], "cannot open"),
        (vec!["--rate", "0"], "--rate"),
        (vec!["--runs", "0"], "--runs"),
        (
            vec!["--workers", "16", "--worker-pool", "32"],
            "connections",
        ),
        (vec!["--compare-redis", "--rate", "10"], "--redis-url"),
        (vec!["--repeat", "2", "--scale"], "--repeat"),
        (vec!["--repeat", "11"], "--repeat"),
        (
            vec!["--reference-connections", "0"],
            "--reference-connections",
        ),
        (
            vec!["--reference-connections", "65"],
            "--reference-connections",
        ),
        (
            vec!["--model", "--reference-connections", "4"],
            "--reference-connections",
        ),
        (
            vec!["--compare-redis", "--redis-url", "redis://127.0.0.1:1"],
            "--rate",
        ),
    ] {
        let out = Command::new(REIN)
            .arg("bench")
            .args(&args)
            .env_remove("DATABASE_URL")
            .env_remove("REDIS_URL")
            .output()
            .expect("run rein");
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
}

/// One half of a `--compare-redis` report: every run it enqueued finished, and its latency
/// and claim figures are there.
fn assert_half(half: &Value, redis: bool) {
    assert_eq!(half["redis"], redis, "{half}");
    let runs = half["runs"].as_i64().unwrap_or(0);
    assert!(runs > 0, "{half}");
    assert_eq!(half["runs_finished"], runs, "{half}");
    let start = &half["enqueue_to_start_ms"];
    assert_eq!(start["samples"], runs, "{half}");
    assert!(start["p50"].as_f64().is_some_and(|v| v > 0.0), "{half}");
    assert!(start["p99"].as_f64() >= start["p50"].as_f64(), "{half}");
    assert!(half["claim_queries"].as_u64() > Some(0), "{half}");
    assert!(
        half["claim_queries_per_run"]
            .as_f64()
            .is_some_and(|v| v > 0.0),
        "{half}"
    );
}

#[test]
fn bench_compares_polling_only_with_redis_wakeups_at_the_same_load() {
    let url = migrated("bench_redis");
    let redis = PrivateRedis::start(free_port(), &common::tmp_dir("bench_redis"));
    let prefix = format!("bench-test-{}", std::process::id());
    for fleet in [["--workers", "2"], ["--processes", "2"]] {
        // Redis comes from REDIS_URL, as a deployment would give it: the polling half must
        // not let its workers (processes included) pick it up.
        let out = Command::new(REIN)
            .args(["bench", "--database-url", &url, "--compare-redis"])
            .args([
                "--rate",
                "40",
                "--duration-s",
                "3",
                "--redis-prefix",
                &prefix,
            ])
            .args(fleet)
            .arg("--json")
            .env_remove("DATABASE_URL")
            .env("REDIS_URL", redis.url())
            .output()
            .expect("run rein");
        assert_eq!(out.status.code(), Some(0), "{fleet:?}: {}", stderr(&out));
        let report: Value = serde_json::from_str(&stdout(&out)).unwrap_or(Value::Null);
        let compare = &report["compare_redis"];
        let (without, with) = (&compare["without"], &compare["with"]);
        assert_half(without, false);
        assert_half(with, true);
        assert_eq!(without["processes"], fleet[0] == "--processes", "{report}");
        // What Redis itself saw on each half's queue channel: nothing without, both
        // publishing and every worker subscribed with.
        assert_eq!(without["wakeups_published"], 0, "{report}");
        assert_eq!(without["wake_subscribers"], 0, "{report}");
        assert!(with["wakeups_published"].as_u64() > Some(0), "{report}");
        assert_eq!(with["wake_subscribers"], 2, "{report}");
        for key in [
            "enqueue_to_start_p50",
            "enqueue_to_start_p90",
            "enqueue_to_start_p99",
            "claim_queries_per_run",
        ] {
            assert!(
                compare["ratio_without_to_with"][key]
                    .as_f64()
                    .is_some_and(|v| v.is_finite() && v > 0.0),
                "{key}: {report}"
            );
        }
        assert_eq!(report["params"]["redis"], "compare", "{report}");
        assert_eq!(report["params"]["poll_interval_ms"], 100, "{report}");
    }
}

#[test]
fn bench_runs_from_a_checkout_the_postgres_user_cannot_reach() {
    use std::os::unix::fs::PermissionsExt;
    // A clone in root's home: the home is 0700, so `postgres` cannot reach its `target/`.
    let locked = common::tmp_dir("bench_locked_home");
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o700)).unwrap();
    let checkout = locked.join("rein");
    std::fs::create_dir_all(checkout.join("target")).unwrap();
    let out = Command::new(REIN)
        .args([
            "bench",
            "--runs",
            "20",
            "--reference-s",
            "1",
            "--duration-s",
            "60",
            "--json",
        ])
        .current_dir(&checkout)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run the rein binary");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report: Value = serde_json::from_str(&stdout(&out)).expect("one JSON report");
    assert_eq!(report["points"][0]["runs_finished"], 20, "{report}");
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if root {
        // Said where it went instead, and why.
        let note = err
            .lines()
            .find(|l| l.starts_with("note: the postgres user cannot reach"))
            .unwrap_or_else(|| panic!("no note on where the server went:\n{err}"));
        assert!(
            note.contains(&checkout.join("target/rein-pg").display().to_string()),
            "{note}"
        );
        assert!(note.contains("mode 700"), "{note}");
        let dir = note
            .rsplit_once(" are in ")
            .and_then(|(_, rest)| rest.strip_suffix(" instead"))
            .unwrap_or_else(|| panic!("no directory in: {note}"));
        assert!(
            dir.starts_with(&std::env::temp_dir().display().to_string()),
            "{note}"
        );
        assert!(err.contains(&format!("data in {dir}/data")), "{err}");
        // Removed with the server once the benchmark succeeded.
        assert!(!Path::new(dir).exists(), "{dir} left behind");
    }
    let _ = std::fs::remove_dir_all(&locked);
}

/// On its private server the benchmark loads pg_stat_statements and reports what each
/// committed event and each claimed run cost in statement time and WAL, next to the
/// reference row's.
#[test]
fn bench_reports_the_database_cost_of_each_event_on_its_private_server() {
    let dir = common::tmp_dir("bench_costs");
    let out = Command::new(REIN)
        .args([
            "bench",
            "--runs",
            "40",
            "--workers",
            "1",
            "--reference-s",
            "1",
            "--duration-s",
            "60",
            "--json",
        ])
        .current_dir(&dir)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run the rein binary");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report: Value = serde_json::from_str(&stdout(&out)).expect("one JSON report");
    let cost = &report["points"][0]["cost"];
    assert!(cost["statements_unavailable"].is_null(), "{report}");
    for key in [
        "db_us_per_event",
        "commit_us_per_event",
        "commit_wal_bytes_per_event",
        "claim_us_per_claimed_run",
        "claim_wal_bytes_per_claimed_run",
    ] {
        assert!(cost[key].as_f64() > Some(0.0), "{key} in {cost}");
    }
    for key in [
        "db_us_per_event",
        "commit_us_per_event",
        "claim_us_per_claimed_run",
    ] {
        assert_eq!(report["db_cost"][key], cost[key], "{key} in {report}");
    }
    // Every run was claimed (each finishes within its first claim), by claim statements.
    assert!(cost["runs_claimed"].as_i64() >= Some(40), "{cost}");
    assert!(cost["commit_calls"].as_i64() >= Some(1), "{cost}");
    // The group claim's and the group commit's batches, from the same counters.
    let per = |a: &str, b: &str| cost[a].as_f64().unwrap() / cost[b].as_f64().unwrap();
    assert_eq!(
        cost["runs_per_claim"].as_f64(),
        Some(per("runs_claimed", "claim_calls")),
        "{cost}"
    );
    assert!(cost["runs_per_claim"].as_f64() >= Some(1.0), "{cost}");
    assert_eq!(
        cost["events_per_commit"].as_f64(),
        Some(
            report["points"][0]["events"].as_f64().unwrap()
                / cost["commit_calls"].as_f64().unwrap()
        ),
        "{cost}"
    );
    // The commit statement's time is part of all statements' time.
    assert!(
        cost["commit_us_per_event"].as_f64() <= cost["db_us_per_event"].as_f64(),
        "{cost}"
    );
    let kinds: Vec<&str> = cost["top_statements"]
        .as_array()
        .expect("top statements")
        .iter()
        .filter_map(|s| s["kind"].as_str())
        .collect();
    assert!(
        kinds.contains(&"commit") && kinds.contains(&"claim"),
        "{cost}"
    );
    for phase in ["reference_batched", "reference_single"] {
        let r = &report["db_cost"][phase];
        assert!(r["db_us_per_row"].as_f64() > Some(0.0), "{phase}: {report}");
        assert!(
            r["wal_bytes_per_row"].as_f64() > Some(0.0),
            "{phase}: {report}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--model`: every run's three model requests are measured (the first from its enqueue,
/// the two after it from the reply before), next to the reference commit, and the ratios
/// are the figures divided by that reference.
#[test]
fn bench_model_measures_every_step_of_every_run_against_a_commit() {
    let url = migrated("bench_model");
    let out = rein(&[
        "bench",
        "--model",
        "--model-runs",
        "8",
        "--model-rate",
        "50",
        "--database-url",
        &url,
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let f: Value = serde_json::from_str(&stdout(&out)).expect("one JSON document");
    assert_eq!(f["runs"], 8, "{f}");
    // The stand-in plays look up, refund, finish: three requests a run.
    assert_eq!(f["model_requests"], 24, "{f}");
    assert_eq!(f["enqueue_to_request_ms"]["samples"], 8, "{f}");
    assert_eq!(f["reply_to_next_request_ms"]["samples"], 16, "{f}");
    let reference = f["reference_commit_ms"]["p50"]
        .as_f64()
        .expect("a reference");
    assert!(reference > 0.0, "{f}");
    for (figure, ratio) in [
        ("enqueue_to_request_ms", "enqueue_to_request_p50"),
        ("reply_to_next_request_ms", "reply_to_next_request_p50"),
    ] {
        let p50 = f[figure]["p50"].as_f64().expect("p50");
        let p99 = f[figure]["p99"].as_f64().expect("p99");
        assert!(p50 > 0.0 && p99 >= p50, "{figure}: {f}");
        let r = f["ratios_to_reference_commit_p50"][ratio]
            .as_f64()
            .expect("ratio");
        assert!(
            (r - p50 / reference).abs() <= 0.01 * r.max(1.0),
            "{ratio}: {f}"
        );
    }
}

#[tokio::test]
async fn bench_fills_a_backlog_by_sql_and_measures_the_same_point_on_it() {
    let url = migrated("bench_backlog");
    let (code, report, err) = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            bench(
                &url,
                &[
                    "--workers",
                    "2",
                    "--backlog-runs",
                    "3000",
                    "--parked-runs",
                    "500",
                ],
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{err}");
    let backlog = &report["backlog"];
    assert_eq!(backlog["filled"]["backlog_runs"], 3000, "{backlog}");
    assert_eq!(backlog["filled"]["parked_runs"], 500, "{backlog}");
    // The point is measured twice, on the empty database and on the full one.
    assert_eq!(backlog["empty"]["runs_finished"], 200, "{backlog}");
    assert_eq!(backlog["full"]["runs_finished"], 200, "{backlog}");
    for key in ["steps_per_s_ratio", "claim_p99_ratio", "history_p50_ratio"] {
        assert!(backlog[key].as_f64() > Some(0.0), "{key} in {backlog}");
    }
    assert_eq!(backlog["history_full"]["events_per_read"], 4.0, "{backlog}");

    // What the report says was written is in the database: copies with their whole logs,
    // time-ordered ids, and the parked share that was due moved by the scheduler's ticks.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (copies, events, ordered): (i64, i64, bool) = sqlx::query_as(
        "SELECT count(*), sum(last_sequence)::bigint,
                bool_and(ordered)
         FROM (SELECT last_sequence,
                      (lag(created_at) OVER (ORDER BY run_id)) IS NULL
                      OR lag(created_at) OVER (ORDER BY run_id) <= created_at AS ordered
               FROM rein_runs WHERE queue LIKE '%-backlog') r",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(copies, 3000);
    assert!(ordered, "backlog run ids order by creation time");
    let logged: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rein_events_all e JOIN rein_runs r USING (run_id) WHERE r.queue LIKE '%-backlog'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(logged, events, "every copy has its whole log");
    assert_eq!(events, 3000 * 4);
    // The filled tables were vacuumed before the point measured on them, not left to
    // autovacuum's first pass over a bulk load in the middle of it.
    assert!(
        backlog["filled"]["vacuum_seconds"].as_f64() > Some(0.0),
        "{backlog}"
    );
    let unvacuumed: Vec<String> = sqlx::query_scalar(
        "SELECT relname::text FROM pg_stat_user_tables
         WHERE relname IN ('rein_runs', 'rein_lease_grants', 'rein_events_other')
           AND last_vacuum IS NULL",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(unvacuumed.is_empty(), "not vacuumed: {unvacuumed:?}");
    // And checkpointed, so the checkpoints a bulk load's WAL sets off do not fall inside
    // the point measured next; a role that may not checkpoint is told why.
    let may_checkpoint: bool = sqlx::query_scalar(
        "SELECT rolsuper OR pg_has_role(current_user, 'pg_checkpoint', 'MEMBER')
         FROM pg_roles WHERE rolname = current_user",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let filled = &backlog["filled"];
    if may_checkpoint {
        assert!(
            filled["checkpoint_seconds"].as_f64() > Some(0.0),
            "{filled}"
        );
        assert!(filled["checkpoint_unavailable"].is_null(), "{filled}");
    } else {
        assert!(filled["checkpoint_seconds"].is_null(), "{filled}");
        let why = filled["checkpoint_unavailable"]
            .as_str()
            .unwrap_or_default();
        assert!(why.contains("pg_checkpoint"), "{filled}");
    }
    // The sizes the report gives are of every table, a partitioned one counted once.
    let tables = backlog["filled"]["tables"].as_array().expect("tables");
    let rows_of = |name: &str| {
        tables
            .iter()
            .find(|t| t["table"] == name)
            .and_then(|t| t["rows"].as_i64())
            .unwrap_or_else(|| panic!("{name} in {tables:?}"))
    };
    let all_events: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_events_all")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(rows_of("rein_runs") >= 3000, "{tables:?}");
    let estimated = rows_of("rein_events");
    assert!(
        estimated >= events && estimated <= all_events * 11 / 10,
        "{estimated} rows estimated, {all_events} when filled: {tables:?}"
    );

    // Then history left both ways: the copies' month by its partition, whole; finished runs
    // of this month one by one.
    let retention = &backlog["retention"];
    assert_eq!(retention["month"]["runs"], 3000, "{retention}");
    assert_eq!(retention["month_events"], events, "{retention}");
    assert!(
        retention["rows"]["runs"].as_i64() >= Some(400),
        "{retention}"
    );
    assert!(
        retention["rows"]["wal_bytes"].as_i64() > Some(0),
        "{retention}"
    );
    let hot: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM rein_events e JOIN rein_runs r USING (run_id) WHERE r.queue LIKE '%-backlog'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(hot, 0, "the month left the hot log");
    let ticks = &backlog["scheduler"];
    assert_eq!(ticks["due_at_once"], 5, "{ticks}");
    assert!(ticks["runs_moved"].as_u64() >= Some(5), "{ticks}");
    let parked: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, count(*) FROM rein_runs WHERE queue LIKE '%-parked' GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let total: i64 = parked.iter().map(|p| p.1).sum();
    // The copies and the template they were made from.
    assert_eq!(total, 501, "{parked:?}");
    // A due copy's approval expired: `timeout` ends it in `failed`. The others still wait.
    assert_eq!(
        parked,
        vec![("parked".to_owned(), 496), ("terminal".to_owned(), 5)],
        "only the due share moved"
    );
    pool.close().await;
}
