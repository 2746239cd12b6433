//! Event history retention (SPEC L2): `rein retention archive` moves whole logs of runs that
//! finished before the cutoff out of the hot table while a fleet keeps running; archived runs
//! still replay to their stored state, unfinished and recently finished runs are untouched,
//! a second run is a no-op, and no event can be appended to an archived run.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{rein, stderr, stdout, wait_for};
use rein_store::{CommitOutcome, CommitPlan, NewEvent, Store, Writer};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const POLL: Duration = Duration::from_millis(20);
/// Between the old runs finishing and the recent one: the cutoff falls in the middle.
const GAP: chrono::TimeDelta = chrono::TimeDelta::seconds(4);

async fn enqueue(store: &Store, def: &str, input: Value, queue: &str, n: usize) -> Vec<Uuid> {
    common::enqueue_many(store, def, input, queue, n).await
}

async fn all_terminal(store: &Store, runs: &[Uuid]) -> bool {
    for run in runs {
        if !store.run(*run).await.is_ok_and(|r| r.status == "terminal") {
            return false;
        }
    }
    true
}

async fn hot_events_of(store: &Store, runs: &[Uuid]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM rein_events WHERE run_id = ANY($1)")
        .bind(runs)
        .fetch_one(store.pool())
        .await
        .expect("count")
}

async fn db_now(store: &Store) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(store.pool())
        .await
        .expect("clock")
}

fn archive(url: &str, extra: &[&str]) -> Value {
    let mut args = vec!["retention", "archive", "--database-url", url, "--json"];
    args.extend_from_slice(extra);
    let out = rein(&args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    serde_json::from_str(&stdout(&out)).expect("the summary is JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_moves_whole_old_logs_and_archived_runs_still_replay() {
    let (url, store) = common::fresh_store("retention").await;
    // A fleet runs the whole time: archiving happens beside live work.
    let stop = CancellationToken::new();
    let mut wconfig = rein_worker::WorkerConfig::new("ret-w");
    wconfig.poll_interval_ms = 20;
    let worker = rein_worker::Worker::new(
        store.clone(),
        wconfig,
        rein_worker::builtin_registry(store.clone()),
    );
    let mut sconfig = rein_scheduler::SchedulerConfig::new("ret-s");
    sconfig.tick_ms = 50;
    let mut scheduler = rein_scheduler::Scheduler::new(store.clone(), sconfig);
    let tasks = [
        tokio::spawn({
            let stop = stop.clone();
            async move { worker.run(stop).await.expect("worker") }
        }),
        tokio::spawn({
            let stop = stop.clone();
            async move { scheduler.run(stop).await.expect("scheduler") }
        }),
    ];

    let mut old = enqueue(&store, "lifecycle", json!({ "sim": {} }), "default", 150).await;
    old.extend(
        enqueue(
            &store,
            "research-agent",
            json!({ "sim": { "steps": 2, "transient_failures": 1 } }),
            "default",
            20,
        )
        .await,
    );
    wait_for(
        "the old runs terminal",
        Duration::from_secs(120),
        POLL,
        || all_terminal(&store, &old),
    )
    .await;
    // Unfinished: runnable on a queue nobody serves, and parked for an approval nobody gives.
    let mut unfinished = enqueue(&store, "lifecycle", json!({ "sim": {} }), "nobody", 3).await;
    unfinished.extend(
        enqueue(
            &store,
            "lifecycle",
            json!({ "sim": { "approval": "grant", "amount": 150 } }),
            "default",
            1,
        )
        .await,
    );
    let old_finished: DateTime<Utc> =
        sqlx::query_scalar("SELECT max(finished_at) FROM rein_runs WHERE run_id = ANY($1)")
            .bind(&old)
            .fetch_one(store.pool())
            .await
            .expect("finished_at");
    wait_for("the gap to pass", Duration::from_secs(10), POLL, || async {
        db_now(&store).await > old_finished + GAP
    })
    .await;
    let recent = enqueue(&store, "lifecycle", json!({ "sim": {} }), "default", 1).await;
    wait_for(
        "the recent run terminal",
        Duration::from_secs(30),
        POLL,
        || all_terminal(&store, &recent),
    )
    .await;
    wait_for(
        "the parked run parked",
        Duration::from_secs(30),
        POLL,
        || async {
            store
                .run(unfinished[3])
                .await
                .is_ok_and(|r| r.status == "parked")
        },
    )
    .await;
    let unfinished_events = hot_events_of(&store, &unfinished).await;
    let recent_events = hot_events_of(&store, &recent).await;
    let old_events = hot_events_of(&store, &old).await;
    assert!(old_events >= 4 * old.len() as i64, "{old_events}");

    // Cut off halfway through the gap, by the database clock.
    let older_than_ms = (db_now(&store).await - old_finished - GAP / 2).num_milliseconds();
    let older_than = format!("{older_than_ms}ms");

    store.vacuum_events(false).await.expect("vacuum");
    let before = store.events_table_size().await.expect("size");
    let dry = archive(&url, &["--older-than", &older_than, "--dry-run"]);
    assert_eq!(dry["candidates"]["runs"], old.len(), "{dry}");
    assert_eq!(dry["candidates"]["events"], old_events, "{dry}");
    assert_eq!(dry["runs_archived"], 0, "{dry}");
    assert_eq!(
        hot_events_of(&store, &old).await,
        old_events,
        "a dry run moves nothing"
    );

    let done = archive(&url, &["--older-than", &older_than, "--batch", "16"]);
    println!("archive summary: {done}");
    assert_eq!(done["runs_archived"], old.len(), "{done}");
    assert_eq!(done["events_moved"], old_events, "{done}");
    assert!(
        done["batches"].as_u64() >= Some(old.len().div_ceil(16) as u64),
        "{done}"
    );
    assert_eq!(hot_events_of(&store, &old).await, 0, "whole logs moved");
    assert_eq!(hot_events_of(&store, &unfinished).await, unfinished_events);
    assert_eq!(hot_events_of(&store, &recent).await, recent_events);
    let after = store.events_table_size().await.expect("size");
    assert_eq!(after.rows, before.rows - old_events, "{before:?} {after:?}");
    store.vacuum_events(false).await.expect("vacuum");
    let vacuumed = store.events_table_size().await.expect("size");
    store.vacuum_events(true).await.expect("vacuum full");
    let compacted = store.events_table_size().await.expect("size");
    println!(
        "rein_events: {} rows / {} bytes before; {} rows after; {} bytes after VACUUM; {} bytes after VACUUM FULL",
        before.rows, before.bytes, after.rows, vacuumed.bytes, compacted.bytes
    );
    assert!(compacted.bytes < before.bytes, "{before:?} {compacted:?}");

    // Archived runs replay to their stored state, through the store and the CLI.
    for run in &old {
        assert_eq!(store.verify_run(*run).await.expect("verify"), None, "{run}");
    }
    let sample = old[0].to_string();
    let verified = rein(&["runs", "verify", "--database-url", &url, &sample]);
    assert_eq!(verified.status.code(), Some(0), "{}", stderr(&verified));
    let history = rein(&["runs", "history", "--database-url", &url, &sample, "--json"]);
    assert_eq!(history.status.code(), Some(0), "{}", stderr(&history));
    let events: Value = serde_json::from_str(&stdout(&history)).expect("json");
    let last_sequence = store.run(old[0]).await.expect("run").last_sequence;
    assert_eq!(
        events.as_array().map(Vec::len),
        Some(last_sequence as usize)
    );
    let why = rein(&["why", "--database-url", &url, &sample]);
    assert_eq!(why.status.code(), Some(0), "{}", stderr(&why));

    // No late event lands for an archived run: a send is refused (terminal), and even a
    // commit the reducer would take (an engine record) is refused by the store.
    let archived = store.run(old[0]).await.expect("run");
    let sent = store
        .send(
            old[0],
            "CANCEL",
            json!({ "reason": "late" }),
            &rein_store::Sender::outside("test"),
            1_000,
        )
        .await;
    assert!(sent.is_err(), "{sent:?}");
    let def = store
        .load_definition(&archived.definition, Some(archived.version))
        .await
        .expect("def");
    let late = rein_store::plan_commit(
        &def,
        old[0],
        archived.fencing_token,
        &archived.projection,
        vec![NewEvent::new("LEASE_EXPIRED", json!({ "late": true }))],
        Vec::new(),
        CommitPlan {
            writer: Writer::TakeToken,
            release: false,
            jitter_sample: 0.5,
        },
    );
    if let Ok(request) = late {
        let outcome = store
            .commit_batch("late-writer", std::slice::from_ref(&request))
            .await
            .expect("commit");
        assert!(
            !matches!(outcome.first(), Some(CommitOutcome::Committed(_))),
            "{outcome:?}"
        );
    }
    assert_eq!(hot_events_of(&store, &old[..1]).await, 0);
    assert_eq!(store.verify_run(old[0]).await.expect("verify"), None);

    // Again: nothing left to do.
    let again = archive(&url, &["--older-than", &older_than]);
    assert_eq!(again["runs_archived"], 0, "{again}");
    assert_eq!(again["events_moved"], 0, "{again}");

    stop.cancel();
    for t in tasks {
        t.await.expect("task");
    }
    let audit = store.audit().await.expect("audit");
    assert_eq!(
        (
            audit.sequence_gaps,
            audit.stale_token_events,
            audit.duplicate_effects,
            audit.replay_mismatches
        ),
        (0, 0, 0, 0),
        "{audit:?}"
    );
}

#[test]
fn archive_refuses_bad_durations_and_batches_with_exit_1() {
    for (args, says) in [
        (vec!["--older-than", "30"], "no unit"),
        (vec!["--older-than", "3y"], "unknown unit"),
        (vec!["--older-than", "0d"], "longer than 0"),
        (vec!["--older-than", "30d", "--batch", "0"], "--batch"),
        (vec!["--older-than", "30d", "--batch", "100001"], "--batch"),
    ] {
        let mut full = vec![
            "retention",
            "archive",
            "--database-url",
            "postgres://nobody@127.0.0.1:1/none",
        ];
        full.extend_from_slice(&args);
        let out = rein(&full);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
}
