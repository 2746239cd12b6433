//! The scheduler's scans reach every due row (SPEC S1–S3, X3a): runs it cannot move (a timer
//! into a false guard, inbox entries the state cannot take yet, a lease or a wall-time budget
//! whose definition cannot be loaded) are looked at once and then left alone for a while,
//! so a thousand of them never keep a due timer, a join or a recovery waiting.

use crate::common;

use common::{store, wait_until};
use rein_core::{Definition, Format, GuardRegistry};
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{
    ClaimedRun, CommitOutcome, CommitPlan, EnqueueRequest, INBOX_TTL_MS_DEFAULT, NewEvent,
    SendOutcome, Sender, Store, Writer, plan_commit,
};
use serde_json::{Value, json};
use std::time::Duration;
use uuid::Uuid;

/// Rows of each kind that no scan can move.
const STUCK: usize = 1_000;

/// A definition document: `states` are (name, kind, more TOML), the first one initial, and a
/// terminal CANCELLED is added as the cancel state; `transitions` are (from, event, to, more
/// TOML).
fn definition(
    name: &str,
    events: &[&str],
    states: &[(&str, &str, &str)],
    transitions: &[(&str, &str, &str, &str)],
) -> String {
    let mut doc = format!(
        "name = \"{name}\"\nversion = 1\ncancel_state = \"CANCELLED\"\nevents = {events:?}\n"
    );
    for (i, (state, kind, more)) in states
        .iter()
        .chain(&[("CANCELLED", "terminal", "")])
        .enumerate()
    {
        let initial = if i == 0 { "initial = true\n" } else { "" };
        doc += &format!("\n[[states]]\nname = \"{state}\"\nkind = \"{kind}\"\n{initial}{more}\n");
    }
    for (from, event, to, more) in transitions {
        doc += &format!(
            "\n[[transitions]]\nfrom = \"{from}\"\nevent = \"{event}\"\nto = \"{to}\"\n{more}\n"
        );
    }
    doc
}

/// A waiting state whose timer is due at once and leads only into `run.data.open`; POKE
/// changes the run without leaving the state.
fn gated() -> String {
    definition(
        "gated",
        &["OPEN", "POKE"],
        &[
            (
                "WAIT",
                "waiting",
                r#"timeout = { after_ms = 1, event = "OPEN" }"#,
            ),
            ("OPENED", "terminal", ""),
        ],
        &[
            (
                "WAIT",
                "OPEN",
                "OPENED",
                r#"guard = "run.data.open == true""#,
            ),
            ("WAIT", "POKE", "WAIT", ""),
        ],
    )
}

/// Parked in FIRST, which cannot take LATER; SECOND can.
fn later() -> String {
    definition(
        "later",
        &["STEP", "LATER"],
        &[
            ("FIRST", "waiting", ""),
            ("SECOND", "waiting", ""),
            ("DONE", "terminal", ""),
        ],
        &[
            ("FIRST", "STEP", "SECOND", ""),
            ("SECOND", "LATER", "DONE", ""),
        ],
    )
}

/// Works in WORK, then parks in PARKED, which takes LATER.
fn held() -> String {
    definition(
        "held",
        &["FINISHED", "LATER"],
        &[
            ("WORK", "active", ""),
            ("PARKED", "waiting", ""),
            ("DONE", "terminal", ""),
        ],
        &[
            ("WORK", "FINISHED", "PARKED", ""),
            ("PARKED", "LATER", "DONE", ""),
        ],
    )
}

/// A parent that fans out into one branch of `branch` and waits for it.
fn gather() -> String {
    let fan_out = r#"
[states.fan_out]
joined_event = "JOINED"
failed_event = "JOIN_FAILED"
join = { policy = "all" }
branches = [{ name = "only", definition = "branch", version = 1, succeed_on = ["DONE"] }]"#;
    definition(
        "gather",
        &["GO", "JOINED", "JOIN_FAILED"],
        &[
            ("PLAN", "active", ""),
            ("GATHER", "waiting", fan_out),
            ("DONE", "terminal", ""),
            ("FAILED", "terminal", ""),
        ],
        &[
            ("PLAN", "GO", "GATHER", ""),
            ("GATHER", "JOINED", "DONE", ""),
            ("GATHER", "JOIN_FAILED", "FAILED", ""),
        ],
    )
}

/// One active state that finishes: `branch`, and the runs whose leases expire.
fn worker_task(name: &str) -> String {
    definition(
        name,
        &["FINISHED"],
        &[("WORK", "active", ""), ("DONE", "terminal", "")],
        &[("WORK", "FINISHED", "DONE", "")],
    )
}

/// Parked with a wall-time budget that runs out at once.
fn budgeted(name: &str) -> String {
    let doc = definition(
        name,
        &["OUT_OF_TIME"],
        &[("WAIT", "waiting", ""), ("STOPPED", "terminal", "")],
        &[("WAIT", "OUT_OF_TIME", "STOPPED", "")],
    );
    doc + "\n[budget]\nwall_time_ms = 1\nevent = \"OUT_OF_TIME\"\n"
}

async fn register(store: &Store, text: &str) -> Definition {
    let def = Definition::parse(text, Format::Toml, &GuardRegistry::new()).expect("definition");
    store.register_definition(&def).await.expect("register");
    def
}

async fn enqueue_many(
    store: &Store,
    def: &Definition,
    queue: &str,
    input: Value,
    n: usize,
) -> Vec<Uuid> {
    let requests: Vec<EnqueueRequest> = (0..n)
        .map(|_| {
            let mut request = EnqueueRequest::new(def.clone(), input.clone());
            request.queue = queue.to_owned();
            request
        })
        .collect();
    common::enqueue_all(store, &requests).await
}

async fn enqueue_one(store: &Store, def: &Definition, queue: &str, input: Value) -> Uuid {
    enqueue_many(store, def, queue, input, 1).await[0]
}

fn scheduler(store: &Store) -> Scheduler {
    Scheduler::new(store.clone(), SchedulerConfig::new("scans-scheduler"))
}

/// How many ticks one pass over `rows` due rows takes at the scheduler's batch size: the
/// bound within which every due row is reached.
fn one_pass(rows: usize) -> usize {
    rows.div_ceil(SchedulerConfig::new("-").batch as usize)
}

/// Ticks until `reached` holds; the number of ticks it took, or `None` after `max`.
async fn ticks_until<F, Fut>(scheduler: &mut Scheduler, max: usize, mut reached: F) -> Option<usize>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for n in 1..=max {
        scheduler.tick().await.expect("tick");
        if reached().await {
            return Some(n);
        }
    }
    None
}

/// Ticks until `reached` holds, which must take at most one pass over the `STUCK` rows of
/// each kind and the one that must move; prints how many ticks it took.
async fn within_one_pass<F, Fut>(scheduler: &mut Scheduler, what: &str, reached: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let bound = one_pass(STUCK + 1);
    let ticks = ticks_until(scheduler, bound, reached).await;
    println!("{what}: after {ticks:?} ticks (bound {bound})");
    assert!(ticks.is_some(), "{what}: not within {bound} ticks");
}

async fn state_of(store: &Store, run: Uuid) -> String {
    store.run(run).await.expect("run").state
}

/// Waits until the run's timer (and wall-time budget, if any) is due by the database clock.
async fn wait_due(store: &Store, last: Uuid) {
    wait_until("the timer is due", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT coalesce(wake_at <= clock_timestamp(), true)
                    AND coalesce(deadline_at <= clock_timestamp(), true)
             FROM rein_runs WHERE run_id = $1",
        )
        .bind(last)
        .fetch_one(store.pool())
        .await
        .expect("due")
    })
    .await;
}

/// Runs whose state never takes their due timer.
async fn blocked_timers(store: &Store, n: usize) -> (Definition, Vec<Uuid>) {
    let gated = register(store, &gated()).await;
    let runs = enqueue_many(store, &gated, "gated", json!({ "open": false }), n).await;
    (gated, runs)
}

/// Runs parked in a state that cannot take the entry waiting in their inbox.
async fn blocked_inboxes(store: &Store, n: usize) -> Vec<Uuid> {
    let later = register(store, &later()).await;
    let runs = enqueue_many(store, &later, "later", json!({}), n).await;
    for &run in &runs {
        let sent = store
            .send(
                run,
                "LATER",
                json!({}),
                &Sender::Engine("sender".into()),
                INBOX_TTL_MS_DEFAULT,
            )
            .await
            .expect("send");
        assert!(matches!(sent, SendOutcome::Queued { .. }), "{sent:?}");
    }
    runs
}

/// Runs whose lease expired and whose definition can no longer be loaded (its row was
/// removed by hand), so no scheduler can recover them.
async fn unrecoverable_leases(store: &Store, n: usize) -> Vec<Uuid> {
    let doomed = register(store, &worker_task("doomed")).await;
    let runs = enqueue_many(store, &doomed, "doomed", json!({}), n).await;
    let claimed = store
        .claim("dead-worker", n as u32, 60_000, &["doomed".to_owned()])
        .await
        .expect("claim");
    assert_eq!(claimed.len(), n);
    sqlx::query(
        "UPDATE rein_runs SET lease_until = clock_timestamp() - interval '1 minute'
         WHERE queue = 'doomed'",
    )
    .execute(store.pool())
    .await
    .expect("expire");
    forget_definition(store, "doomed").await;
    runs
}

/// Runs whose wall-time budget ran out and whose definition can no longer be loaded.
async fn undeliverable_deadlines(store: &Store, n: usize) -> Vec<Uuid> {
    let doomed = register(store, &budgeted("doomed-budget")).await;
    let runs = enqueue_many(store, &doomed, "doomed-budget", json!({}), n).await;
    forget_definition(store, "doomed-budget").await;
    runs
}

async fn forget_definition(store: &Store, name: &str) {
    sqlx::query("DELETE FROM rein_definitions WHERE name = $1")
        .bind(name)
        .execute(store.pool())
        .await
        .expect("delete definition");
}

/// A parent waiting in its fan-out whose only branch just ended: its result is in the
/// parent's inbox, for the scheduler to apply.
async fn waiting_join(store: &Store) -> Uuid {
    let task = register(store, &worker_task("branch")).await;
    let gather = register(store, &gather()).await;
    let parent = enqueue_one(store, &gather, "join", json!({})).await;
    commit_as_holder(store, &gather, "GO").await;
    assert_eq!(state_of(store, parent).await, "GATHER");
    let child = commit_as_holder(store, &task, "FINISHED").await;
    assert_eq!(state_of(store, child).await, "DONE");
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_inbox WHERE run_id = $1")
        .bind(parent)
        .fetch_one(store.pool())
        .await
        .expect("inbox");
    assert_eq!(waiting, 1, "the branch result waits in the parent's inbox");
    parent
}

/// Claims the one runnable run of queue `join` and commits `event`, releasing it.
async fn commit_as_holder(store: &Store, def: &Definition, event: &str) -> Uuid {
    let claimed = claim_join(store).await;
    release_with(store, def, &claimed, event).await;
    claimed.run_id
}

async fn claim_join(store: &Store) -> ClaimedRun {
    store
        .claim("holder", 1, 60_000, &["join".to_owned()])
        .await
        .expect("claim")
        .pop()
        .expect("a runnable run")
}

/// The holder commits `event` and releases the run.
async fn release_with(store: &Store, def: &Definition, claimed: &ClaimedRun, event: &str) {
    let request = plan_commit(
        def,
        claimed.run_id,
        claimed.token,
        &claimed.state,
        vec![NewEvent::new(event, json!({}))],
        Vec::new(),
        CommitPlan {
            writer: Writer::Leased,
            release: true,
            jitter_sample: 0.5,
        },
    )
    .expect("plan");
    let outcome = store
        .commit_batch("holder", std::slice::from_ref(&request))
        .await
        .expect("commit")
        .pop();
    assert!(
        matches!(outcome, Some(CommitOutcome::Committed(_))),
        "{outcome:?}"
    );
}

/// A run whose lease expired after the unrecoverable ones' and that can be recovered.
async fn recoverable_lease(store: &Store) -> Uuid {
    let fine = register(store, &worker_task("fine")).await;
    let run = enqueue_one(store, &fine, "fine", json!({})).await;
    store
        .claim("dead-worker", 1, 60_000, &["fine".to_owned()])
        .await
        .expect("claim");
    sqlx::query(
        "UPDATE rein_runs SET lease_until = clock_timestamp() - interval '1 s' WHERE run_id = $1",
    )
    .bind(run)
    .execute(store.pool())
    .await
    .expect("expire");
    run
}

async fn lease_recovered(store: &Store, run: Uuid) -> bool {
    store.run(run).await.expect("run").lease_owner.is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_timer_fires_within_one_pass_behind_a_thousand_timers_into_a_false_guard() {
    let store = store("scan_timers").await;
    let (gated, _stuck) = blocked_timers(&store, STUCK).await;
    let open = enqueue_one(&store, &gated, "gated", json!({ "open": true })).await;
    wait_due(&store, open).await;
    let mut scheduler = scheduler(&store);
    within_one_pass(
        &mut scheduler,
        "a timer behind blocked timers fired",
        || async { state_of(&store, open).await == "OPENED" },
    )
    .await;

    // Once they have been looked at, the blocked timers no longer stand in the way.
    let next = enqueue_one(&store, &gated, "gated", json!({ "open": true })).await;
    wait_due(&store, next).await;
    within_one_pass(&mut scheduler, "the next due timer fired", || async {
        state_of(&store, next).await == "OPENED"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_completes_within_one_pass_behind_a_thousand_inboxes_the_runs_cannot_take() {
    let store = store("scan_inbox").await;
    blocked_inboxes(&store, STUCK).await;
    let parent = waiting_join(&store).await;
    let mut scheduler = scheduler(&store);
    within_one_pass(
        &mut scheduler,
        "a join behind blocked inboxes completed",
        || async { state_of(&store, parent).await == "DONE" },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_recovered_within_one_pass_behind_a_thousand_that_cannot_be() {
    let store = store("scan_leases").await;
    unrecoverable_leases(&store, STUCK).await;
    let run = recoverable_lease(&store).await;
    let mut scheduler = scheduler(&store);
    within_one_pass(
        &mut scheduler,
        "a lease behind unrecoverable ones was recovered",
        || lease_recovered(&store, run),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_time_budget_fires_within_one_pass_behind_a_thousand_that_cannot() {
    let store = store("scan_deadlines").await;
    undeliverable_deadlines(&store, STUCK).await;
    let fine = register(&store, &budgeted("fine-budget")).await;
    let run = enqueue_one(&store, &fine, "fine", json!({})).await;
    wait_due(&store, run).await;
    let mut scheduler = scheduler(&store);
    within_one_pass(
        &mut scheduler,
        "a budget behind undeliverable ones fired",
        || async { state_of(&store, run).await == "STOPPED" },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_thousand_stuck_rows_of_every_kind_a_join_a_timer_and_a_recovery_still_happen() {
    let store = store("scan_all").await;
    let (gated, _) = blocked_timers(&store, STUCK).await;
    blocked_inboxes(&store, STUCK).await;
    unrecoverable_leases(&store, STUCK).await;
    undeliverable_deadlines(&store, STUCK).await;
    let parent = waiting_join(&store).await;
    let lease = recoverable_lease(&store).await;
    let open = enqueue_one(&store, &gated, "gated", json!({ "open": true })).await;
    wait_due(&store, open).await;
    let mut scheduler = scheduler(&store);
    within_one_pass(
        &mut scheduler,
        "a join, a timer and a recovery behind stuck rows of every kind",
        || async {
            state_of(&store, parent).await == "DONE"
                && state_of(&store, open).await == "OPENED"
                && lease_recovered(&store, lease).await
        },
    )
    .await;
}

/// (misses, milliseconds from now to the next look) of the run.
async fn next_look(store: &Store, run: Uuid) -> (i32, Option<f64>) {
    sqlx::query_as(
        "SELECT scan_misses, (extract(epoch FROM scan_after - clock_timestamp()) * 1000)::float8
         FROM rein_runs WHERE run_id = $1",
    )
    .bind(run)
    .fetch_one(store.pool())
    .await
    .expect("next look")
}

/// (misses, milliseconds from now to the next look, to the expiry) of the run's entries.
async fn inbox_looks(store: &Store, run: Uuid) -> Vec<(i32, f64, f64)> {
    sqlx::query_as(
        "SELECT scan_misses,
                (extract(epoch FROM scan_after - clock_timestamp()) * 1000)::float8,
                (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8
         FROM rein_inbox WHERE run_id = $1 ORDER BY id",
    )
    .bind(run)
    .fetch_all(store.pool())
    .await
    .expect("inbox looks")
}

/// Lets the run's next look arrive now, as the clock would.
async fn next_look_arrives(store: &Store, run: Uuid) {
    sqlx::query("UPDATE rein_runs SET scan_after = clock_timestamp() WHERE run_id = $1")
        .bind(run)
        .execute(store.pool())
        .await
        .expect("next look arrives");
}

fn count(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(std::sync::atomic::Ordering::Relaxed)
}

async fn send(store: &Store, run: Uuid, kind: &str, payload: Value, ttl_ms: u64) -> SendOutcome {
    store
        .send(run, kind, payload, &Sender::Engine("sender".into()), ttl_ms)
        .await
        .expect("send")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timer_into_a_false_guard_is_reported_once_and_looked_at_less_and_less_often() {
    let store = store("scan_backoff").await;
    let gated = register(&store, &gated()).await;
    let run = enqueue_one(&store, &gated, "gated", json!({ "open": false })).await;
    wait_due(&store, run).await;
    let mut scheduler = scheduler(&store);

    for _ in 0..5 {
        scheduler.tick().await.expect("tick");
    }
    assert_eq!(count(&scheduler.stats.backed_off), 1, "looked at once");
    assert_eq!(count(&scheduler.stats.stuck_reported), 1, "reported once");
    let (misses, ahead) = next_look(&store, run).await;
    assert_eq!(misses, 1);
    let ahead = ahead.expect("a next look");
    assert!(ahead > 0.0 && ahead <= 1_000.0, "next look in {ahead} ms");

    // Another scheduler honours the next look the first one set (SPEC S3).
    let mut other = Scheduler::new(store.clone(), SchedulerConfig::new("other-scheduler"));
    other.tick().await.expect("tick");
    assert_eq!(count(&other.stats.backed_off), 0, "not looked at again");

    // Each look in a row that cannot move it puts the next one twice as far, up to a minute.
    for misses in 2..=9 {
        next_look_arrives(&store, run).await;
        scheduler.tick().await.expect("tick");
        let (seen, ahead) = next_look(&store, run).await;
        assert_eq!(seen, misses);
        let expected = (1_000.0 * 2f64.powi(misses - 1)).min(60_000.0);
        let ahead = ahead.expect("a next look");
        assert!(
            ahead <= expected && ahead > expected - 1_000.0,
            "after {misses} looks the next is in {ahead} ms, not ~{expected}"
        );
    }
    assert_eq!(count(&scheduler.stats.backed_off), 9);
    assert_eq!(
        count(&scheduler.stats.stuck_reported),
        1,
        "still reported once"
    );
    assert_eq!(state_of(&store, run).await, "WAIT");

    // A commit changes the run: it is looked at again at once (and reported afresh).
    let poked = send(
        &store,
        run,
        "POKE",
        json!({ "data": { "open": false } }),
        1_000,
    )
    .await;
    assert!(matches!(poked, SendOutcome::Applied { .. }), "{poked:?}");
    assert_eq!(next_look(&store, run).await, (0, None));
    scheduler.tick().await.expect("tick");
    assert_eq!(count(&scheduler.stats.stuck_reported), 2);
    assert_eq!(next_look(&store, run).await.0, 1);

    // When a commit opens the guard, the timer fires at the next tick, not a minute later.
    for _ in 2..=9 {
        next_look_arrives(&store, run).await;
        scheduler.tick().await.expect("tick");
    }
    assert!(next_look(&store, run).await.1.expect("a next look") > 59_000.0);
    send(
        &store,
        run,
        "POKE",
        json!({ "data": { "open": true } }),
        1_000,
    )
    .await;
    scheduler.tick().await.expect("tick");
    assert_eq!(state_of(&store, run).await, "OPENED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_entries_a_run_cannot_take_wait_until_it_changes_and_are_applied_at_once_then() {
    let store = store("scan_inbox_change").await;
    let later = register(&store, &later()).await;
    let run = enqueue_one(&store, &later, "later", json!({})).await;
    let queued = send(&store, run, "LATER", json!({}), INBOX_TTL_MS_DEFAULT).await;
    assert!(matches!(queued, SendOutcome::Queued { .. }), "{queued:?}");
    let mut scheduler = scheduler(&store);

    for _ in 0..5 {
        scheduler.tick().await.expect("tick");
    }
    assert_eq!(count(&scheduler.stats.backed_off), 1, "looked at once");
    let looks = inbox_looks(&store, run).await;
    assert_eq!(looks.len(), 1);
    assert_eq!(looks[0].0, 1);
    assert!(looks[0].1 > 0.0 && looks[0].1 <= 1_000.0, "{looks:?}");

    // STEP moves the run to SECOND, which takes LATER: the next tick applies it.
    let stepped = send(&store, run, "STEP", json!({}), INBOX_TTL_MS_DEFAULT).await;
    assert!(
        matches!(stepped, SendOutcome::Applied { .. }),
        "{stepped:?}"
    );
    scheduler.tick().await.expect("tick");
    assert_eq!(state_of(&store, run).await, "DONE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_entry_is_looked_at_again_when_it_expires_and_recorded_as_expired() {
    let store = store("scan_inbox_expiry").await;
    let later = register(&store, &later()).await;
    let run = enqueue_one(&store, &later, "later", json!({})).await;
    send(&store, run, "LATER", json!({}), 3_000).await;
    let mut scheduler = scheduler(&store);
    scheduler.tick().await.expect("tick");

    // After many looks in a row its next look would be a minute away, but it expires sooner.
    sqlx::query(
        "UPDATE rein_inbox SET scan_after = clock_timestamp(), scan_misses = 10 WHERE run_id = $1",
    )
    .bind(run)
    .execute(store.pool())
    .await
    .expect("many looks");
    scheduler.tick().await.expect("tick");
    let looks = inbox_looks(&store, run).await;
    assert_eq!(looks[0].0, 11);
    assert!(
        (looks[0].1 - looks[0].2).abs() < 1.0,
        "next look at the expiry: {looks:?}"
    );

    wait_until("the entry expired", Duration::from_secs(10), || async {
        inbox_looks(&store, run).await[0].2 <= 0.0
    })
    .await;
    scheduler.tick().await.expect("tick");
    assert!(inbox_looks(&store, run).await.is_empty());
    let kinds: Vec<String> = store
        .history(run)
        .await
        .expect("history")
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, vec!["INBOX_EXPIRED"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_entries_of_a_leased_run_wait_for_the_lease_to_end_and_are_applied_once_it_does() {
    let store = store("scan_inbox_leased").await;
    let held = register(&store, &held()).await;
    let run = enqueue_one(&store, &held, "join", json!({})).await;
    let claimed = claim_join(&store).await;
    let queued = send(&store, run, "LATER", json!({}), INBOX_TTL_MS_DEFAULT).await;
    assert!(matches!(queued, SendOutcome::Queued { .. }), "{queued:?}");
    let mut scheduler = scheduler(&store);
    scheduler.tick().await.expect("tick");

    let put_off: bool = sqlx::query_scalar(
        "SELECT i.scan_after = r.lease_until FROM rein_inbox i JOIN rein_runs r USING (run_id)
         WHERE i.run_id = $1",
    )
    .bind(run)
    .fetch_one(store.pool())
    .await
    .expect("put off");
    assert!(put_off, "the entry waits for the lease to end");
    assert_eq!(
        count(&scheduler.stats.backed_off),
        0,
        "a live lease is no miss"
    );

    // The holder parks the run in PARKED, releasing it: the next tick applies LATER.
    release_with(&store, &held, &claimed, "FINISHED").await;
    assert_eq!(state_of(&store, run).await, "PARKED");
    scheduler.tick().await.expect("tick");
    assert_eq!(state_of(&store, run).await, "DONE");
}

/// A page of timers due at once lands in one transaction (SPEC S1): a burst of due timers
/// costs a tick one round trip, not one per run. Each run is still judged on its own: one
/// that cannot move among them is looked at later, and the others fire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_due_timers_fires_in_one_transaction_and_a_run_that_cannot_move_waits() {
    let store = store("scan_timer_page").await;
    let gated = register(&store, &gated()).await;
    let open = enqueue_many(&store, &gated, "gated", json!({ "open": true }), 50).await;
    let shut = enqueue_one(&store, &gated, "gated", json!({ "open": false })).await;
    for run in open.iter().chain([&shut]) {
        wait_due(&store, *run).await;
    }
    let mut scheduler = scheduler(&store);
    let moved = scheduler.tick().await.expect("tick");
    assert_eq!(moved, 50, "every run whose guard holds moved in one tick");
    let (fired, transactions): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT xmin::text) FROM rein_events
         WHERE run_id = ANY($1) AND type = 'OPEN'",
    )
    .bind(&open)
    .fetch_one(store.pool())
    .await
    .expect("fired events");
    assert_eq!(fired, 50);
    assert_eq!(
        transactions, 1,
        "the page's timers fired in one transaction"
    );
    assert_eq!(state_of(&store, shut).await, "WAIT");
    let looked_later: bool = sqlx::query_scalar(
        "SELECT scan_after > clock_timestamp() FROM rein_runs WHERE run_id = $1",
    )
    .bind(shut)
    .fetch_one(store.pool())
    .await
    .expect("next look");
    assert!(
        looked_later,
        "the run that could not move is looked at later"
    );
}
