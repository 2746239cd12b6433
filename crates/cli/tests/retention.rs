//! Event history retention (SPEC L2): `rein retention archive` moves whole logs of runs that
//! finished before the cutoff out of the hot table while a fleet keeps running; archived runs
//! still replay to their stored state, unfinished and recently finished runs are untouched,
//! a second run is a no-op, and no event can be appended to an archived run.

use crate::common;

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

/// No gap in any log, no event under a stale token, no side effect twice, every log replays.
async fn assert_audit_clean(store: &Store) {
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

/// A worker and a scheduler with quick polls, until `stop`.
fn fleet(store: &Store, id: &str, stop: &CancellationToken) -> [tokio::task::JoinHandle<()>; 2] {
    let mut wconfig = rein_worker::WorkerConfig::new(format!("{id}-w"));
    wconfig.poll_interval_ms = 20;
    let worker = rein_worker::Worker::new(
        store.clone(),
        wconfig,
        rein_worker::builtin_registry(store.clone()),
    );
    let mut sconfig = rein_scheduler::SchedulerConfig::new(format!("{id}-s"));
    sconfig.tick_ms = 50;
    let mut scheduler = rein_scheduler::Scheduler::new(store.clone(), sconfig);
    [
        tokio::spawn({
            let stop = stop.clone();
            async move { worker.run(stop).await.expect("worker") }
        }),
        tokio::spawn({
            let stop = stop.clone();
            async move { scheduler.run(stop).await.expect("scheduler") }
        }),
    ]
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

/// A commit the reducer would take (an engine record) on the archived run `archived` is
/// refused by the store.
async fn late_commit_is_refused(store: &Store, archived: &rein_store::RunRow) {
    let def = store
        .load_definition(&archived.definition, Some(archived.version))
        .await
        .expect("def");
    let late = rein_store::plan_commit(
        &def,
        archived.run_id,
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
}

fn archive(url: &str, extra: &[&str]) -> Value {
    retention("archive", url, extra)
}

fn retention(what: &str, url: &str, extra: &[&str]) -> Value {
    let mut args = vec!["retention", what, "--database-url", url, "--json"];
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
    let tasks = fleet(&store, "ret", &stop);

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
    late_commit_is_refused(&store, &archived).await;
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
    assert_audit_clean(&store).await;
}

/// Runs `copies` copies of `template` created in the month (UTC) `months_back` months ago,
/// in that month's partition; returns their ids.
async fn copies_in_month(
    store: &Store,
    template: Uuid,
    salt: &str,
    months_back: i32,
    copies: i64,
) -> Vec<Uuid> {
    let start: DateTime<Utc> = sqlx::query_scalar(
        "SELECT date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC')::timestamp
                AT TIME ZONE 'UTC' - $1 * interval '1 month' + interval '1 day'",
    )
    .bind(months_back)
    .fetch_one(store.pool())
    .await
    .expect("month");
    store.add_event_month(start).await.expect("month partition");
    let copied = store
        .copy_runs(&rein_store::RunCopies {
            template,
            queue: "default",
            salt,
            first: 1,
            last: copies,
            created_from: start,
            created_every_ms: 60_000.0,
            due_every: 0,
        })
        .await
        .expect("copies");
    assert_eq!(copied, copies as u64);
    sqlx::query_scalar(
        "SELECT run_id FROM rein_runs WHERE run_id <> $1 AND created_at >= $2
           AND created_at < $2 + interval '20 days' AND definition = (SELECT definition FROM rein_runs WHERE run_id = $1)
           AND status = (SELECT status FROM rein_runs WHERE run_id = $1)
         ORDER BY run_id",
    )
    .bind(template)
    .bind(start)
    .fetch_all(store.pool())
    .await
    .expect("copies")
}

async fn partition_of_events(store: &Store, runs: &[Uuid]) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT p, count(*) FROM (
             SELECT tableoid::regclass::text AS p FROM rein_events WHERE run_id = ANY($1)
             UNION ALL
             SELECT tableoid::regclass::text FROM rein_events_archive WHERE run_id = ANY($1)) e
         GROUP BY 1 ORDER BY 1",
    )
    .bind(runs)
    .fetch_all(store.pool())
    .await
    .expect("partitions")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_moves_a_finished_month_whole_and_keeps_a_month_with_a_live_run() {
    let (url, store) = common::fresh_store("retention_months").await;
    let stop = CancellationToken::new();
    // Templates made by a real fleet: one run finished, one parked on an approval.
    let first = stop.child_token();
    let tasks = fleet(&store, "months-1", &first);
    let done = enqueue(&store, "lifecycle", json!({ "sim": {} }), "default", 1).await;
    let parked = enqueue(
        &store,
        "lifecycle",
        json!({ "sim": { "approval": "grant", "amount": 150 } }),
        "default",
        1,
    )
    .await;
    wait_for(
        "the templates settle",
        Duration::from_secs(60),
        POLL,
        || async {
            all_terminal(&store, &done).await
                && store
                    .run(parked[0])
                    .await
                    .is_ok_and(|r| r.status == "parked")
        },
    )
    .await;
    first.cancel();
    for t in tasks {
        t.await.expect("task");
    }

    // Three months ago: finished runs only. Two months ago: finished runs and one parked.
    let old = copies_in_month(&store, done[0], "m3", 3, 40).await;
    let mut mixed = copies_in_month(&store, done[0], "m2", 2, 30).await;
    let live = copies_in_month(&store, parked[0], "m2p", 2, 1).await;
    assert_eq!((old.len(), mixed.len(), live.len()), (40, 30, 1));
    let old_events = hot_events_of(&store, &old).await;
    assert!(old_events >= 2 * 40, "{old_events}");
    let ranges = store.event_ranges().await.expect("ranges");
    let month_of = |runs: &[Uuid]| -> String {
        ranges
            .iter()
            .find(|r| r.lo.is_some_and(|lo| runs[0] >= lo) && r.hi.is_some_and(|hi| runs[0] < hi))
            .map(|r| r.name.clone())
            .expect("a month holds the copies")
    };
    let (old_month, mixed_month) = (month_of(&old), month_of(&mixed));
    assert_ne!(old_month, mixed_month);
    assert_eq!(
        partition_of_events(&store, &old).await,
        vec![(old_month.clone(), old_events)]
    );

    let dry = retention("detach", &url, &["--older-than", "1d", "--dry-run"]);
    let months = dry["months"].as_array().expect("months");
    let judged = |name: &str| -> &Value {
        months
            .iter()
            .find(|m| m["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {dry}"))
    };
    assert_eq!(judged(&old_month)["unfinished"], 0, "{dry}");
    assert_eq!(judged(&old_month)["runs"], 40, "{dry}");
    assert_eq!(judged(&mixed_month)["unfinished"], 1, "{dry}");
    assert_eq!(judged(&mixed_month)["example"], json!(live[0]), "{dry}");
    assert_eq!(dry["moved"], json!([]), "{dry}");
    assert_eq!(
        hot_events_of(&store, &old).await,
        old_events,
        "a dry run moves nothing"
    );

    // A session that keeps reading rein_events holds the move up: it gives up after its
    // lock timeout, says what to do, and the month stays where it was.
    let mut reader = store.pool().acquire().await.expect("a connection");
    sqlx::query("BEGIN").execute(&mut *reader).await.unwrap();
    sqlx::query("SELECT count(*) FROM rein_events")
        .execute(&mut *reader)
        .await
        .unwrap();
    let cutoff = db_now(&store).await - chrono::Duration::days(1);
    let refused = store
        .archive_month(&old_month, cutoff)
        .await
        .expect_err("the reader holds the table");
    let said = refused.to_string();
    assert!(
        said.contains("did not let go within") && said.contains("rein retention detach"),
        "{said}"
    );
    sqlx::query("ROLLBACK").execute(&mut *reader).await.unwrap();
    drop(reader);
    assert_eq!(
        partition_of_events(&store, &old).await,
        vec![(old_month.clone(), old_events)],
        "the month stays attached"
    );

    let moved = retention("detach", &url, &["--older-than", "1d"]);
    println!("detach summary: {moved}");
    let moved_months: Vec<&str> = moved["moved"]
        .as_array()
        .expect("moved")
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!(moved_months, vec![old_month.as_str()], "{moved}");
    assert_eq!(moved["moved"][0]["runs"], 40, "{moved}");
    let archived_name = old_month.replace("rein_events_", "rein_events_archive_");
    assert_eq!(
        hot_events_of(&store, &old).await,
        0,
        "the month left rein_events"
    );
    assert_eq!(
        partition_of_events(&store, &old).await,
        vec![(archived_name.clone(), old_events)],
        "its events are the archive's now, not copied"
    );
    assert!(
        hot_events_of(&store, &mixed).await > 0,
        "the month with a live run stays"
    );

    // The moved runs read and replay as before; nothing more is appended to them.
    for run in &old[..5] {
        assert_eq!(store.verify_run(*run).await.expect("verify"), None, "{run}");
    }
    let sample = old[0].to_string();
    let history = rein(&["runs", "history", "--database-url", &url, &sample, "--json"]);
    assert_eq!(history.status.code(), Some(0), "{}", stderr(&history));
    let moved_run = store.run(old[0]).await.expect("run");
    let events: Value = serde_json::from_str(&stdout(&history)).expect("json");
    assert_eq!(
        events.as_array().map(Vec::len),
        Some(moved_run.last_sequence as usize)
    );
    late_commit_is_refused(&store, &moved_run).await;
    assert_eq!(hot_events_of(&store, &old[..1]).await, 0);

    // Runs archived one by one meanwhile join their month when it moves; the moved month's
    // runs are not archived again.
    let singles = archive(&url, &["--older-than", "1d"]);
    assert_eq!(singles["runs_archived"], mixed.len(), "{singles}");
    let second = stop.child_token();
    let tasks = fleet(&store, "months-2", &second);
    // Its approval's expiry is long due, so the scheduler may end it first; else the cancel.
    let cancelled = rein(&[
        "cancel",
        "--database-url",
        &url,
        &live[0].to_string(),
        "--reason",
        "test",
    ]);
    assert!(
        cancelled.status.code() == Some(0) || stderr(&cancelled).contains("terminal state"),
        "{}",
        stderr(&cancelled)
    );
    wait_for("the live run ends", Duration::from_secs(60), POLL, || {
        all_terminal(&store, &live)
    })
    .await;
    second.cancel();
    for t in tasks {
        t.await.expect("task");
    }
    let again = retention("detach", &url, &["--older-than", "1ms"]);
    assert_eq!(again["moved"][0]["name"], mixed_month, "{again}");
    assert_eq!(again["moved"].as_array().map(Vec::len), Some(1), "{again}");
    mixed.extend(&live);
    let archived_mixed = mixed_month.replace("rein_events_", "rein_events_archive_");
    let spread = partition_of_events(&store, &mixed).await;
    assert_eq!(spread.len(), 1, "{spread:?}");
    assert_eq!(spread[0].0, archived_mixed, "{spread:?}");
    for run in [mixed[0], live[0]] {
        assert_eq!(store.verify_run(run).await.expect("verify"), None, "{run}");
    }
    let nothing = retention("detach", &url, &["--older-than", "1ms"]);
    assert_eq!(nothing["moved"], json!([]), "{nothing}");

    assert_audit_clean(&store).await;
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
