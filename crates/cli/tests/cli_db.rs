//! Operator commands against a real database, run as a user runs them.

use crate::common;

use std::time::Duration;

use common::{rein, stderr, stdout};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A worker with the built-in actions in this process; cancel the token to stop it.
fn start_worker(
    store: &rein_store::Store,
    id: &str,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), rein_store::StoreError>>,
) {
    let mut config = rein_worker::WorkerConfig::new(id);
    config.poll_interval_ms = 20;
    let worker = rein_worker::Worker::new(
        store.clone(),
        config,
        rein_worker::builtin_registry(store.clone()),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    (shutdown, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_show_send_and_history_through_the_cli() {
    let url = common::fresh_database("cli_db");
    let out = rein(&["migrate", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let input = r#"{"sim": {"work_ms": 1, "approval": "grant", "amount": 150}}"#;
    let out = rein(&[
        "enqueue",
        "--database-url",
        &url,
        "--definition",
        "lifecycle",
        "--input",
        input,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let printed = stdout(&out);
    assert_eq!(printed.lines().count(), 1, "{printed}");
    let run: Uuid = printed
        .trim()
        .parse()
        .expect("enqueue prints a run id alone");

    let out = rein(&[
        "runs",
        "show",
        &run.to_string(),
        "--database-url",
        &url,
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let shown: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    for key in [
        "run_id",
        "definition",
        "version",
        "status",
        "state",
        "sequence",
        "attempt",
    ] {
        assert!(shown.get(key).is_some(), "no {key} in {shown}");
    }
    for key in ["worker", "token", "until"] {
        assert!(
            shown["lease"].get(key).is_some(),
            "no lease.{key} in {shown}"
        );
    }
    assert_eq!(shown["state"], "planned");

    // A worker takes the run to `paused`, where it waits for the approval.
    let store = rein_store::Store::connect(&url, 4).await.expect("connect");
    let (shutdown, task) = start_worker(&store, "cli-db-worker");
    common::wait_for(
        "the run to wait for approval",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || {
            let store = store.clone();
            async move { store.run(run).await.is_ok_and(|r| r.state == "paused") }
        },
    )
    .await;
    shutdown.cancel();
    task.await.expect("worker task").expect("worker");

    let out = rein(&[
        "send",
        &run.to_string(),
        "approval_granted",
        "--payload",
        r#"{"approver": "cli"}"#,
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("applied"), "{}", stdout(&out));

    let out = rein(&[
        "runs",
        "history",
        &run.to_string(),
        "--database-url",
        &url,
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let events: Vec<Value> = serde_json::from_str(&stdout(&out)).expect("JSON array");
    assert!(events.len() >= 3, "{events:?}");
    for e in &events {
        for key in [
            "sequence",
            "type",
            "event_id",
            "token",
            "worker",
            "occurred_at",
            "payload",
        ] {
            assert!(e.get(key).is_some(), "no {key} in {e}");
        }
    }
    assert_eq!(events.last().expect("an event")["type"], "approval_granted");
}

#[test]
fn unreachable_database_exits_3() {
    let out = rein(&[
        "runs",
        "show",
        &Uuid::nil().to_string(),
        "--database-url",
        "postgres://postgres@127.0.0.1:1/x",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
}

#[test]
fn no_database_url_exits_1() {
    let out = rein(&["enqueue", "--definition", "lifecycle"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

/// README: 1 for usage or input errors (an unknown thing named, a malformed URL), 2 for
/// refusals, 3 for a database that cannot be reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_follow_the_readme_table() {
    let (url, _store) = common::fresh_store("cli_exit_codes").await;
    for bad in ["not a url", "postgres://[::1"] {
        let out = rein(&["runs", "list", "--database-url", bad]);
        assert_eq!(out.status.code(), Some(1), "{bad}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("not a valid PostgreSQL URL"),
            "{}",
            stderr(&out)
        );
    }
    let unknown = Uuid::now_v7().to_string();
    let out = rein(&["tokens", "revoke", &unknown, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("no live token"), "{}", stderr(&out));
    // An engine event from outside is refused: 2.
    let out = rein(&["enqueue", "--definition", "chain4", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let run = stdout(&out).trim().to_owned();
    let out = rein(&["send", &run, "next", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    // An unknown run: 1.
    let out = rein(&["runs", "show", &unknown, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

#[test]
fn insecure_dev_refuses_an_address_other_hosts_can_reach() {
    for listen in ["0.0.0.0:0", "[::]:0", "192.0.2.1:7878"] {
        let out = rein(&[
            "api",
            "--insecure-dev",
            "--listen",
            listen,
            "--database-url",
            "postgres://rein@127.0.0.1:1/rein",
        ]);
        assert_eq!(out.status.code(), Some(1), "{listen}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("loopback"),
            "{listen}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "{listen}: nothing served");
    }
}

#[test]
fn definitions_register_stores_a_file_and_refuses_a_changed_body_under_the_same_version() {
    let url = common::fresh_database("cli_register");
    let out = rein(&["migrate", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let dir = common::tmp_dir("cli_register");
    let file = dir.join("my-chain.toml");
    let text = rein_core::builtin::CHAIN4.replace("name = \"chain4\"", "name = \"my-chain\"");
    std::fs::write(&file, &text).expect("write");
    let path = file.to_string_lossy().into_owned();

    let out = rein(&["definitions", "register", &path, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let version = rein_core::builtin::load("chain4")
        .and_then(Result::ok)
        .expect("the built-in chain4")
        .version();
    assert!(
        stdout(&out).contains(&format!("registered my-chain v{version}")),
        "{}",
        stdout(&out)
    );
    // The same body again changes nothing.
    let out = rein(&["definitions", "register", &path, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("already registered"),
        "{}",
        stdout(&out)
    );
    // Runs can be enqueued with it now.
    let out = rein(&[
        "enqueue",
        "--definition",
        "my-chain",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // A different body under the same version is refused: change means a new version.
    std::fs::write(&file, text.replace("Four no-op", "4 no-op")).expect("write");
    let out = rein(&["definitions", "register", &path, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("new version"), "{}", stderr(&out));
    // An invalid file is refused before touching the database.
    std::fs::write(&file, "name = \"broken\"").expect("write");
    let out = rein(&["definitions", "register", &path, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_rerun_and_workers_from_the_cli() {
    let (url, store) = common::fresh_store("cli_operate").await;
    let def = store.load_definition("lifecycle", None).await.unwrap();
    let run = store
        .enqueue(rein_store::EnqueueRequest::new(
            def,
            serde_json::json!({ "sim": { "work_ms": 1 } }),
        ))
        .await
        .unwrap()
        .run_id
        .to_string();

    // A run that has not finished is not run again.
    let out = rein(&["rerun", &run, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("has not finished"),
        "{}",
        stderr(&out)
    );

    let out = rein(&["cancel", &run, "--reason", "", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "a reason is required");
    let out = rein(&[
        "cancel",
        &run,
        "--reason",
        "customer withdrew",
        "--as",
        "ops",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let row = store.run(run.parse().unwrap()).await.unwrap();
    assert_eq!(row.status, "terminal");
    assert_eq!(
        row.terminal_reason.as_deref(),
        Some("cancelled: customer withdrew")
    );

    // Now finished, it can be run again: a new run, linked to it, with the same input.
    let out = rein(&["rerun", &run, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let again: Uuid = stdout(&out).trim().parse().expect("the new run's id alone");
    let (parent, input): (Option<Uuid>, Value) =
        sqlx::query_as("SELECT parent_run_id, input FROM rein_runs WHERE run_id = $1")
            .bind(again)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(parent, Some(run.parse().unwrap()));
    assert_eq!(input["sim"]["work_ms"], 1);

    store
        .heartbeat("w-alive", "worker", serde_json::json!({}))
        .await
        .unwrap();
    let out = rein(&["workers", "--json", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let members: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let w = members
        .as_array()
        .and_then(|m| m.iter().find(|m| m["worker_id"] == "w-alive"))
        .unwrap_or_else(|| panic!("{members}"));
    assert_eq!(w["role"], "worker");
    assert!(w["silent_ms"].as_f64().is_some_and(|ms| ms < 60_000.0));
    assert_eq!(w["leases_held"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brief_prints_the_steps_done_and_the_pending_step_the_same_each_time() {
    let (url, store) = common::fresh_store("cli_brief").await;
    let def = rein_core::builtin::refund_agent();
    let script = serde_json::json!({ "agent": { "script": [
        { "decision": "call_tool", "tool": "lookup_order", "args": { "order_id": "B7" } },
        { "decision": "call_tool", "tool": "refund", "args": { "order_id": "B7", "amount": 420 } },
        { "decision": "FINISH" }] }, "task": "refund order B7" });
    let run = store
        .enqueue(rein_store::EnqueueRequest::new(def, script))
        .await
        .expect("enqueue")
        .run_id;
    let (shutdown, task) = start_worker(&store, "cli-brief-worker");
    common::wait_for(
        "the refund to wait for approval",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || {
            let store = store.clone();
            async move {
                store
                    .run(run)
                    .await
                    .is_ok_and(|r| r.state == "WAITING_APPROVAL")
            }
        },
    )
    .await;
    shutdown.cancel();
    task.await.expect("worker task").expect("worker");

    let args = ["brief", &run.to_string(), "--database-url", &url, "--json"];
    let first = rein(&args);
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    let second = rein(&args);
    assert_eq!(
        stdout(&first),
        stdout(&second),
        "the brief is deterministic"
    );
    let brief: Value = serde_json::from_str(&stdout(&first)).expect("JSON");
    assert_eq!(brief["task"], "refund order B7");
    assert_eq!(brief["steps_completed"], 1);
    let done = brief["steps_done"].as_array().expect("steps_done");
    assert_eq!(done.len(), 1, "{brief}");
    assert_eq!(done[0]["result"]["order"]["order_id"], "B7");
    assert_eq!(brief["pending"]["status"], "waiting");
    assert_eq!(brief["pending"]["node"], "WAITING_APPROVAL");
    assert_eq!(brief["pending"]["step"], 2);

    let human = rein(&["brief", &run.to_string(), "--database-url", &url]);
    assert_eq!(human.status.code(), Some(0), "{}", stderr(&human));
    let text = stdout(&human);
    assert!(text.contains("done      1 step(s)"), "{text}");
    assert!(
        text.contains("pending   step 2 at WAITING_APPROVAL (waiting"),
        "{text}"
    );

    let unknown = rein(&["brief", &Uuid::nil().to_string(), "--database-url", &url]);
    assert_eq!(unknown.status.code(), Some(1), "{}", stderr(&unknown));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_list_into_a_closed_pipe_ends_quietly_like_any_unix_tool() {
    let (url, store) = common::fresh_store("closed_pipe").await;
    common::enqueue_many(&store, "lifecycle", serde_json::json!({}), "default", 5).await;
    // `rein runs list | head -1` once head has gone.
    let out = common::rein_into_closed_pipe(&["runs", "list", "--database-url", &url]);
    assert!(
        common::ended_by_sigpipe(&out),
        "{:?}: {}",
        out.status,
        stderr(&out)
    );
    let err = stderr(&out);
    assert!(
        !err.contains("panicked") && !err.contains("Broken pipe"),
        "{err}"
    );
}

/// Runs `rein runs list` against `url` with `extra` arguments and environment; the output
/// and how long it took.
fn timed_runs_list(
    url: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Output, Duration) {
    let started = std::time::Instant::now();
    let out = std::process::Command::new(common::REIN)
        .args(["runs", "list", "--database-url", url])
        .args(extra)
        .env_remove("DATABASE_URL")
        .env_remove("REIN_DB_CONNECT_TIMEOUT_MS")
        .envs(env.iter().copied())
        .output()
        .expect("run the rein binary");
    (out, started.elapsed())
}

#[test]
fn a_database_that_refuses_or_ignores_connections_fails_the_command_within_the_connect_timeout() {
    let refused = format!("postgres://rein@127.0.0.1:{}/rein", common::free_port());
    // Default: a few seconds.
    let (out, took) = timed_runs_list(&refused, &[], &[]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("cannot reach PostgreSQL"), "{err}");
    assert!(err.contains("within 5000 ms"), "{err}");
    assert!(took < Duration::from_secs(8), "took {took:?}");
    // The flag shortens it.
    let (out, took) = timed_runs_list(&refused, &["--db-connect-timeout-ms", "600"], &[]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("within 600 ms"), "{}", stderr(&out));
    assert!(took < Duration::from_secs(3), "took {took:?}");
    // So does the environment; a server refusing connections is asked again until then.
    let (out, took) = timed_runs_list(&refused, &[], &[("REIN_DB_CONNECT_TIMEOUT_MS", "2500")]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("within 2500 ms"), "{}", stderr(&out));
    assert!(
        took >= Duration::from_millis(2_300) && took < Duration::from_secs(6),
        "took {took:?}"
    );
    // A server that takes the connection and never answers is given up on just the same.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let port = silent.local_addr().expect("its address").port();
    let ignored = format!("postgres://rein@127.0.0.1:{port}/rein");
    let (out, took) = timed_runs_list(&ignored, &["--db-connect-timeout-ms", "800"], &[]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("did not answer"), "{}", stderr(&out));
    assert!(
        took >= Duration::from_millis(750) && took < Duration::from_secs(4),
        "took {took:?}"
    );
    drop(silent);
    // Out of range is a usage error.
    let (out, _) = timed_runs_list(&refused, &["--db-connect-timeout-ms", "0"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_changed_by_hand_is_an_integrity_error_and_the_brief_follows_the_log() {
    let (url, store) = common::fresh_store("cli_checkpoint").await;
    let def = rein_core::builtin::research_agent();
    // 25 tool steps of three events each: a log long enough for checkpoints.
    let input = serde_json::json!({ "task": "find papers on fencing", "sim": { "steps": 25 } });
    let run = store
        .enqueue(rein_store::EnqueueRequest::new(def, input))
        .await
        .expect("enqueue")
        .run_id;
    let (shutdown, task) = start_worker(&store, "cli-checkpoint-worker");
    common::wait_for(
        "the run to succeed",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            let store = store.clone();
            async move { store.run(run).await.is_ok_and(|r| r.state == "SUCCEEDED") }
        },
    )
    .await;
    shutdown.cancel();
    task.await.expect("worker task").expect("worker");
    let checkpoints: Vec<i64> = sqlx::query_scalar(
        "SELECT sequence FROM rein_checkpoints WHERE run_id = $1 ORDER BY sequence",
    )
    .bind(run)
    .fetch_all(store.pool())
    .await
    .expect("checkpoints");
    assert!(checkpoints.len() >= 2, "{checkpoints:?}");
    let (oldest, newest) = (checkpoints[0], checkpoints[checkpoints.len() - 1]);
    let run_arg = run.to_string();
    let verify = ["runs", "verify", &run_arg, "--database-url", &url];
    let out = rein(&verify);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let forge = |sequence: i64| {
        let store = store.clone();
        async move {
            let changed = sqlx::query(
                "UPDATE rein_checkpoints SET state = jsonb_set(state, '{data,task}', '\"forged\"')
                 WHERE run_id = $1 AND sequence = $2",
            )
            .bind(run)
            .bind(sequence)
            .execute(store.pool())
            .await
            .expect("forge a checkpoint")
            .rows_affected();
            assert_eq!(changed, 1);
        }
    };

    // An older checkpoint changed by hand: verify and the audit check every one.
    forge(oldest).await;
    let out = rein(&verify);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains(&format!(
            "integrity error: checkpoint at sequence {oldest} differs from the state the log gives there (in data)"
        )),
        "{}",
        stderr(&out)
    );
    let audit = store.audit().await.expect("audit");
    assert_eq!(audit.replay_mismatches, 1, "{audit:?}");
    // The brief starts from the newest checkpoint, which is still true.
    let brief = ["brief", &run_arg, "--database-url", &url, "--json"];
    let out = rein(&brief);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
    let trusted = stdout(&out);

    // The newest changed by hand: the brief falls back to the log and says so.
    forge(newest).await;
    let out = rein(&brief);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), trusted, "the brief the log gives");
    let shown: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(shown["task"], "find papers on fencing");
    assert!(
        stderr(&out).contains(&format!(
            "warning: checkpoint at sequence {newest} differs from the state the log gives there (in data); this brief was rebuilt from the log"
        )),
        "{}",
        stderr(&out)
    );
    let out = rein(&["brief", &run_arg, "--database-url", &url]);
    assert!(
        stdout(&out).contains("find papers on fencing"),
        "{}",
        stdout(&out)
    );
    assert!(!stdout(&out).contains("forged"), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("rebuilt from the log"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_cycle_only_timers_drive_is_a_warning_when_checked_and_registered() {
    let url = common::fresh_database("cli_timer_cycle");
    let out = rein(&["migrate", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../core/tests/fixtures/timer-ping-pong.toml"
    );
    let warning = "warning: states (PING, PONG): a cycle made only of timer events";

    let out = rein(&["definitions", "check", path]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("ok: ping-pong v1"),
        "{}",
        stdout(&out)
    );
    assert!(stderr(&out).contains(warning), "{}", stderr(&out));

    let out = rein(&[
        "definitions",
        "register",
        path,
        "--json",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stderr(&out).contains(warning), "{}", stderr(&out));
    let done: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(done["created"], true, "registered regardless");
    assert_eq!(done["warnings"][0]["item"], "states (PING, PONG)", "{done}");
}

#[test]
fn enqueueing_a_sim_run_that_asks_for_too_many_steps_is_refused_with_the_bound() {
    let url = common::fresh_database("cli_sim_steps");
    let out = rein(&["migrate", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let enqueue = |input: &str| {
        rein(&[
            "enqueue",
            "--database-url",
            &url,
            "--definition",
            "research-agent",
            "--input",
            input,
        ])
    };
    let out = enqueue(r#"{"sim": {"steps": 100000000}}"#);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("input.sim.steps is 100000000; a sim run takes at most 1000 steps"),
        "{}",
        stderr(&out)
    );
    let out = enqueue(r#"{"sim": {"steps": "many"}}"#);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("input.sim does not parse"),
        "{}",
        stderr(&out)
    );
    let out = rein(&["runs", "list", "--json", "--database-url", &url]);
    let runs: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(runs, serde_json::json!([]), "no run was created");
    let out = enqueue(r#"{"sim": {"steps": 1000}}"#);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// A run that, a millisecond after it starts, fans out into two copies of itself: only the
/// scheduler's timers drive it, and the scheduler's commits start the children.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_given_a_fan_out_depth_bound_holds_a_self_forking_tree_to_it() {
    let (url, store) = common::fresh_store("cli_fan_out_depth").await;
    let root = common::enqueue_timed_fork(&store).await;
    let mut fleet = common::Fleet::new(&url, "cli_fan_out_depth");
    fleet.spawn(
        "sched",
        &["scheduler", "--tick-ms", "50", "--fan-out-depth-max", "1"],
    );
    common::wait_for(
        "the tree ends",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || async {
            let live: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM rein_runs
                 WHERE (run_id = $1 OR root_run_id = $1) AND status <> 'terminal'",
            )
            .bind(root)
            .fetch_one(store.pool())
            .await
            .expect("live");
            live == 0
        },
    )
    .await;
    fleet.terminate("sched", Duration::from_secs(10));

    let runs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rein_runs WHERE run_id = $1 OR root_run_id = $1")
            .bind(root)
            .fetch_one(store.pool())
            .await
            .expect("runs");
    assert_eq!(
        runs, 3,
        "the root and its two children, which may not fan out"
    );
    let row = store.run(root).await.expect("root");
    assert_eq!(row.state, "FAILED");
    assert_eq!(
        row.terminal_reason.as_deref(),
        Some("fan_out_depth_exceeded")
    );
}
