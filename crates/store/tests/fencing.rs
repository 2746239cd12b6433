//! The fencing protocol against a real PostgreSQL (SPEC E1–E4, X1–X3a, S2).

use crate::common;

use common::{assert_replays, event_types, store, wait_lease_expired};
use rein_core::{Definition, EngineEvent, Event, RejectReason, RunState, apply};
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{
    ClaimedRun, CommitOutcome, CommitPlan, CommitRequest, EnqueueRequest, FenceReason,
    HeldConnection, INBOX_TTL_MS_DEFAULT, NewEvent, SendOutcome, Sender, Store, StoreError, Writer,
    plan_commit,
};
use serde_json::json;
use uuid::Uuid;

fn lifecycle() -> Definition {
    rein_core::builtin::lifecycle()
}

fn queues() -> Vec<String> {
    vec!["default".to_owned()]
}

fn leased(release: bool) -> CommitPlan {
    CommitPlan {
        writer: Writer::Leased,
        release,
        jitter_sample: 0.5,
    }
}

/// A writer without a lease delivering an event the engine decided (as a scheduler does).
fn engine() -> Sender {
    Sender::Engine("sched-1".into())
}

async fn enqueue(store: &Store) -> Uuid {
    store
        .enqueue(EnqueueRequest::new(lifecycle(), json!({ "k": 1 })))
        .await
        .expect("enqueue")
        .run_id
}

async fn claim_one(store: &Store, worker: &str, ttl_ms: u64) -> ClaimedRun {
    let mut claimed = store
        .claim(worker, 1, ttl_ms, &queues())
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1, "{worker} expected to claim one run");
    claimed.pop().unwrap()
}

/// The holder's commit of `kinds` on top of the state it read.
fn commit_of(claimed: &ClaimedRun, base: &RunState, kinds: &[&str]) -> CommitRequest {
    let events = kinds.iter().map(|k| NewEvent::new(*k, json!({}))).collect();
    plan_commit(
        &lifecycle(),
        claimed.run_id,
        claimed.token,
        base,
        events,
        Vec::new(),
        leased(false),
    )
    .expect("plan")
}

async fn commit_one(store: &Store, worker: &str, request: &CommitRequest) -> CommitOutcome {
    let mut out = store
        .commit_batch(worker, std::slice::from_ref(request))
        .await
        .expect("commit_batch");
    assert_eq!(out.len(), 1);
    out.pop().unwrap()
}

async fn expire_lease(store: &Store, run: Uuid) {
    sqlx::query("UPDATE rein_runs SET lease_until = now() - interval '1 s' WHERE run_id = $1")
        .bind(run)
        .execute(store.pool())
        .await
        .expect("expire lease");
}

fn scheduler(store: &Store, id: &str) -> Scheduler {
    Scheduler::new(store.clone(), SchedulerConfig::new(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_claims_never_take_the_same_run() {
    let store = store("two_claims").await;
    let mut runs = Vec::new();
    for round in 0..10 {
        let run = enqueue(&store).await;
        runs.push(run);
        let q = queues();
        let (a, b) = tokio::join!(
            store.claim("worker-a", 1, 10_000, &q),
            store.claim("worker-b", 1, 10_000, &q)
        );
        let (a, b) = (a.expect("claim a"), b.expect("claim b"));
        assert_eq!(
            a.len() + b.len(),
            1,
            "round {round}: exactly one claim takes the run"
        );
        let (holder, first) = match (a.first(), b.first()) {
            (Some(c), None) => ("worker-a", c.clone()),
            (None, Some(c)) => ("worker-b", c.clone()),
            _ => unreachable!(),
        };
        assert_eq!(first.run_id, run);
        assert_eq!(first.token, 1, "the first grant carries token 1");

        // Nobody else takes it while the lease is held.
        assert!(
            store
                .claim("worker-c", 1, 10_000, &queues())
                .await
                .unwrap()
                .is_empty()
        );

        // The holder gives the lease back; the next claim gets a higher token.
        let release = plan_commit(
            &lifecycle(),
            run,
            first.token,
            &first.state,
            Vec::new(),
            Vec::new(),
            leased(true),
        )
        .unwrap();
        assert!(matches!(
            commit_one(&store, holder, &release).await,
            CommitOutcome::Committed(_)
        ));
        let again = claim_one(&store, "worker-c", 10_000).await;
        assert_eq!(again.run_id, run);
        assert_eq!(again.token, 2);

        let grants: Vec<(i64, String)> = sqlx::query_as(
            "SELECT fencing_token, worker FROM rein_lease_grants WHERE run_id = $1
             ORDER BY fencing_token",
        )
        .bind(run)
        .fetch_all(store.pool())
        .await
        .unwrap();
        assert_eq!(
            grants,
            vec![(1, holder.to_owned()), (2, "worker-c".to_owned())],
            "every claim records its grant"
        );
    }
    for run in runs {
        assert_replays(&store, run).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_token_commit_is_fenced() {
    let store = store("stale_token").await;
    let run = enqueue(&store).await;
    let a = claim_one(&store, "worker-a", 300).await;
    wait_lease_expired(&store, run).await;

    let mut sched = scheduler(&store, "sched-1");
    assert!(
        sched.tick().await.unwrap() >= 1,
        "the expired lease is recovered"
    );
    let b = claim_one(&store, "worker-b", 10_000).await;
    assert!(b.token > a.token);

    // A wakes up and commits on what it read: refused, nothing written.
    let stale = commit_of(&a, &a.state, &["start"]);
    let stale_id = stale.events[0].event_id;
    match commit_one(&store, "worker-a", &stale).await {
        CommitOutcome::Fenced {
            current_token,
            reason,
            ..
        } => {
            assert_eq!(current_token, b.token);
            assert_eq!(
                reason,
                FenceReason::TokenSuperseded {
                    token: a.token,
                    current: b.token
                }
            );
            let text = reason.to_string();
            let said = format!("token {} was superseded by token {}", a.token, b.token);
            assert!(text.contains(&said), "{text}");
        }
        other => panic!("stale commit was not fenced: {other:?}"),
    }

    let fresh = commit_of(&b, &b.state, &["start"]);
    assert!(matches!(
        commit_one(&store, "worker-b", &fresh).await,
        CommitOutcome::Committed(_)
    ));
    // Still refused after B moved on.
    assert!(matches!(
        commit_one(&store, "worker-a", &stale).await,
        CommitOutcome::Fenced { .. }
    ));

    let history = store.history(run).await.unwrap();
    assert!(history.iter().all(|e| e.event_id != stale_id));
    assert_eq!(
        event_types(&store, run).await,
        vec![EngineEvent::LeaseExpired.as_str(), "start"]
    );
    let last = history.last().unwrap();
    assert_eq!((last.worker.as_str(), last.token), ("worker-b", b.token));
    assert!(history.iter().all(|e| e.worker != "worker-a"));
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_sequence_is_rejected() {
    let store = store("out_of_order").await;
    let run = enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 10_000).await;
    let first = commit_of(&c, &c.state, &["start"]);
    assert!(matches!(
        commit_one(&store, "worker-a", &first).await,
        CommitOutcome::Committed(_)
    ));

    // Same token, live lease, but planned on a base the log has moved past.
    let behind = commit_of(&c, &c.state, &["start"]);
    match commit_one(&store, "worker-a", &behind).await {
        CommitOutcome::Fenced {
            current_sequence,
            reason,
            ..
        } => {
            assert_eq!(current_sequence, 1);
            // It names the sequence, not the token (still the writer's own).
            assert_eq!(
                reason,
                FenceReason::SequenceMoved {
                    base: 0,
                    current: 1
                }
            );
            assert!(reason.to_string().contains("sequence moved"), "{reason}");
        }
        other => panic!("a commit behind the log was not refused: {other:?}"),
    }
    let history = store.history(run).await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].event_id, first.events[0].event_id);

    // The reducer refuses a sequence that is not last + 1.
    let now = store.run(run).await.unwrap().projection;
    for wrong in [now.sequence, now.sequence + 2] {
        let err = apply(
            &lifecycle(),
            &now,
            &Event::new(wrong, "complete", json!({})),
        )
        .expect_err("wrong sequence accepted");
        assert_eq!(
            err.reason,
            RejectReason::OutOfOrder {
                expected: now.sequence + 1
            }
        );
    }
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_event_id_is_idempotent() {
    let store = store("duplicate_event").await;
    let run = enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 10_000).await;
    let request = commit_of(&c, &c.state, &["start"]);
    let CommitOutcome::Committed(first) = commit_one(&store, "worker-a", &request).await else {
        panic!("first commit refused");
    };
    assert_eq!(first.sequence, 1);
    assert_eq!(
        commit_one(&store, "worker-a", &request).await,
        CommitOutcome::AlreadyCommitted { sequence: 1 }
    );
    let history = store.history(run).await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].event_id, request.events[0].event_id);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_commit_with_one_fenced_run_commits_the_others() {
    let store = store("batch_fenced").await;
    for _ in 0..3 {
        enqueue(&store).await;
    }
    let claimed = store.claim("worker-a", 3, 10_000, &queues()).await.unwrap();
    assert_eq!(claimed.len(), 3);
    let victim = claimed[1].run_id;
    expire_lease(&store, victim).await;
    let mut sched = scheduler(&store, "sched-1");
    assert_eq!(
        sched.tick().await.unwrap(),
        1,
        "only the expired run recovers"
    );
    assert!(store.run(victim).await.unwrap().fencing_token > claimed[1].token);

    let requests: Vec<CommitRequest> = claimed
        .iter()
        .map(|c| commit_of(c, &c.state, &["start"]))
        .collect();
    let outcomes = store.commit_batch("worker-a", &requests).await.unwrap();
    assert_eq!(outcomes.len(), 3);
    for (c, outcome) in claimed.iter().zip(&outcomes) {
        if c.run_id == victim {
            assert!(
                matches!(outcome, CommitOutcome::Fenced { .. }),
                "{outcome:?}"
            );
            assert_eq!(
                event_types(&store, c.run_id).await,
                vec![EngineEvent::LeaseExpired.as_str()]
            );
        } else {
            assert!(
                matches!(outcome, CommitOutcome::Committed(_)),
                "{outcome:?}"
            );
            assert_eq!(event_types(&store, c.run_id).await, vec!["start"]);
            assert_eq!(store.run(c.run_id).await.unwrap().state, "running");
        }
        assert_replays(&store, c.run_id).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_renewal_extends_only_live_leases() {
    let store = store("renewal").await;
    enqueue(&store).await;
    enqueue(&store).await;
    let claimed = store.claim("worker-a", 2, 10_000, &queues()).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let (live, dead) = (&claimed[0], &claimed[1]);
    expire_lease(&store, dead.run_id).await;
    let live_before = store.run(live.run_id).await.unwrap().lease_until.unwrap();
    let dead_before = store.run(dead.run_id).await.unwrap().lease_until.unwrap();

    let renewed = store
        .renew(
            "worker-a",
            &[(live.run_id, live.token), (dead.run_id, dead.token)],
            60_000,
        )
        .await
        .unwrap();
    let ids: Vec<Uuid> = renewed.iter().map(|r| r.run_id).collect();
    assert_eq!(ids, vec![live.run_id], "only the live lease is renewed");
    let live_row = store.run(live.run_id).await.unwrap();
    assert!(live_row.lease_live);
    assert!(live_row.lease_until.unwrap() > live_before);
    let dead_row = store.run(dead.run_id).await.unwrap();
    assert!(!dead_row.lease_live, "an expired lease is not revived");
    assert_eq!(dead_row.lease_until.unwrap(), dead_before);

    // Neither another worker nor a wrong token renews a live lease.
    assert!(
        store
            .renew("intruder", &[(live.run_id, live.token)], 60_000)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .renew("worker-a", &[(live.run_id, live.token + 1)], 60_000)
            .await
            .unwrap()
            .is_empty()
    );
    for c in &claimed {
        assert_replays(&store, c.run_id).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_with_client_key_returns_the_same_run() {
    let store = store("client_key").await;
    let mut request = EnqueueRequest::new(lifecycle(), json!({}));
    request.client_key = Some(rein_store::ClientKey::new("shop", "order-42"));
    let first = store.enqueue(request.clone()).await.unwrap();
    let second = store.enqueue(request).await.unwrap();
    assert!(first.created);
    assert!(!second.created);
    assert_eq!(first.run_id, second.run_id);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_runs")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_replays(&store, first.run_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_in_callers_transaction_rolls_back_with_it() {
    let store = store("enqueue_tx").await;
    let mut tx = store.pool().begin().await.unwrap();
    let rolled_back = Store::enqueue_in(&mut tx, EnqueueRequest::new(lifecycle(), json!({})))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(matches!(
        store.run(rolled_back.run_id).await,
        Err(StoreError::RunNotFound(_))
    ));

    let mut tx = store.pool().begin().await.unwrap();
    let kept = Store::enqueue_in(&mut tx, EnqueueRequest::new(lifecycle(), json!({})))
        .await
        .unwrap();
    // Not visible to others before the caller commits.
    assert!(matches!(
        store.run(kept.run_id).await,
        Err(StoreError::RunNotFound(_))
    ));
    tx.commit().await.unwrap();
    assert_eq!(store.run(kept.run_id).await.unwrap().state, "planned");
    assert_replays(&store, kept.run_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_without_lease_applies_at_once() {
    let store = store("send_applies").await;
    let run = enqueue(&store).await;
    let out = store
        .send(run, "start", json!({}), &engine(), INBOX_TTL_MS_DEFAULT)
        .await
        .unwrap();
    assert_eq!(out, SendOutcome::Applied { sequence: 1 });
    let row = store.run(run).await.unwrap();
    assert_eq!(row.state, "running");
    assert_eq!(row.fencing_token, 1, "the sender took the token");
    assert!(row.lease_owner.is_none());
    assert!(store.inbox(run).await.unwrap().is_empty());
    let history = store.history(run).await.unwrap();
    assert_eq!(
        (history[0].worker.as_str(), history[0].token),
        ("sched-1", 1)
    );
    let grants: Vec<(i64, String)> =
        sqlx::query_as("SELECT fencing_token, worker FROM rein_lease_grants WHERE run_id = $1")
            .bind(run)
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(grants, vec![(1, "sched-1".to_owned())]);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_with_live_lease_goes_to_inbox() {
    let store = store("send_inbox").await;
    let run = enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 10_000).await;
    let out = store
        .send(
            run,
            "start",
            json!({ "data": { "from": "api" } }),
            &engine(),
            60_000,
        )
        .await
        .unwrap();
    let SendOutcome::Queued { inbox_id } = out else {
        panic!("sent under a live lease but applied: {out:?}");
    };
    let row = store.run(run).await.unwrap();
    assert_eq!((row.state.as_str(), row.last_sequence), ("planned", 0));
    assert_eq!(
        row.fencing_token, c.token,
        "the sender did not take the token"
    );
    let inbox = store.inbox(run).await.unwrap();
    assert_eq!(inbox.len(), 1);
    assert_eq!((inbox[0].id, inbox[0].kind.as_str()), (inbox_id, "start"));
    assert!(!inbox[0].expired);
    assert!(store.history(run).await.unwrap().is_empty());

    // The holder applies it at its commit point and consumes the entry.
    let entry = &inbox[0];
    let request = plan_commit(
        &lifecycle(),
        run,
        c.token,
        &c.state,
        vec![NewEvent {
            event_id: entry.event_id,
            kind: entry.kind.clone(),
            payload: entry.payload.clone(),
            node: None,
            sender: None,
        }],
        vec![entry.id],
        leased(false),
    )
    .unwrap();
    assert!(matches!(
        commit_one(&store, "worker-a", &request).await,
        CommitOutcome::Committed(_)
    ));
    assert!(store.inbox(run).await.unwrap().is_empty());
    assert_eq!(
        store.history(run).await.unwrap()[0].event_id,
        entry.event_id
    );
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_of_event_no_state_could_accept_is_refused() {
    let store = store("send_refused").await;
    let run = enqueue(&store).await;
    let refused = |r: Result<SendOutcome, StoreError>| match r {
        Err(StoreError::InvalidTransition(e)) => e.reason,
        other => panic!("not refused: {other:?}"),
    };
    assert_eq!(
        refused(store.send(run, "bogus", json!({}), &engine(), 60_000).await),
        RejectReason::UnknownEvent
    );
    store
        .send(run, "start", json!({}), &engine(), 60_000)
        .await
        .unwrap();
    // No state reachable from `running` accepts `start`.
    assert_eq!(
        refused(store.send(run, "start", json!({}), &engine(), 60_000).await),
        RejectReason::NotInTable
    );
    store
        .send(run, "complete", json!({}), &engine(), 60_000)
        .await
        .unwrap();
    assert_eq!(store.run(run).await.unwrap().state, "done");
    assert_eq!(
        refused(store.send(run, "start", json!({}), &engine(), 60_000).await),
        RejectReason::Terminal
    );
    assert!(matches!(
        store
            .send(run, "CANCEL", json!({}), &engine(), 60_000)
            .await,
        Err(StoreError::InvalidTransition(_))
    ));
    assert!(
        store.inbox(run).await.unwrap().is_empty(),
        "refused events are not queued"
    );
    assert_eq!(event_types(&store, run).await, vec!["start", "complete"]);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_from_checkpoint_plus_tail_equals_full_replay() {
    let store = store("checkpoint_recovery").await;
    let run = enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 60_000).await;
    let mut state = c.state.clone();
    for n in [40usize, 30, 5] {
        let events = (0..n)
            .map(|i| {
                NewEvent::new(
                    EngineEvent::DecisionRejected.as_str(),
                    json!({ "i": i, "batch": n }),
                )
            })
            .collect();
        let request = plan_commit(
            &lifecycle(),
            run,
            c.token,
            &state,
            events,
            Vec::new(),
            leased(false),
        )
        .unwrap();
        assert!(matches!(
            commit_one(&store, "worker-a", &request).await,
            CommitOutcome::Committed(_)
        ));
        state = request.state;
    }
    assert_eq!(state.sequence, 75);
    let checkpoint = store
        .newest_checkpoint(run)
        .await
        .unwrap()
        .expect("a checkpoint after crossing 64 events");
    assert_eq!(
        checkpoint.sequence, 70,
        "written by the commit that crossed 64"
    );

    let recovered = store.recover_run(run).await.unwrap();
    assert_eq!(
        recovered.from_checkpoint,
        Some(70),
        "built from the checkpoint"
    );
    assert!(recovered.warnings.is_empty(), "{:?}", recovered.warnings);
    let recovered = recovered.state;
    let def = lifecycle();
    let events: Vec<Event> = store
        .history(run)
        .await
        .unwrap()
        .iter()
        .map(|e| e.as_event())
        .collect();
    let replayed = rein_core::replay(
        &def,
        RunState::initial(&def, json!({ "k": 1 })),
        events.iter(),
    )
    .unwrap();
    let stored = store.run(run).await.unwrap().projection;
    assert_eq!(recovered, replayed);
    assert_eq!(recovered, stored);
    assert_eq!(recovered.sequence, 75);
    assert_replays(&store, run).await;
}

/// The refusal's reason, or a panic naming what came back instead.
fn fence_reason(outcome: CommitOutcome) -> FenceReason {
    match outcome {
        CommitOutcome::Fenced { reason, .. } => reason,
        other => panic!("the commit was not fenced: {other:?}"),
    }
}

/// Where this test process's WARN lines go: a subscriber installed for the whole process
/// once (a thread-local one misses events that other tests' threads race it for).
fn captured_log() -> std::sync::Arc<std::sync::Mutex<Vec<u8>>> {
    static LOG: std::sync::OnceLock<std::sync::Arc<std::sync::Mutex<Vec<u8>>>> =
        std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buffer = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let writer = {
            let buffer = buffer.clone();
            move || Captured(buffer.clone())
        };
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(writer)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
        buffer
    })
    .clone()
}

struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_its_lease_expired_says_when_by_the_database_clock() {
    let log = captured_log();
    let store = store("fenced_lease_expired").await;
    let run = enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 10_000).await;
    expire_lease(&store, run).await;
    let lease_until = store.run(run).await.unwrap().lease_until.expect("a lease");

    let outcome = commit_one(&store, "worker-a", &commit_of(&c, &c.state, &["start"])).await;
    // The token is still the worker's own: only the lease refused the write.
    let CommitOutcome::Fenced { current_token, .. } = &outcome else {
        panic!("the commit was not fenced: {outcome:?}");
    };
    assert_eq!(*current_token, c.token);
    match fence_reason(outcome) {
        FenceReason::LeaseExpired {
            lease_until: said,
            db_now,
        } => {
            assert_eq!(said, lease_until);
            assert!(db_now >= said, "{db_now} is before {said}");
        }
        other => panic!("not refused for the lease: {other:?}"),
    }
    let text = String::from_utf8(log.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("fenced write refused") && l.contains(&run.to_string()))
        .unwrap_or_else(|| panic!("no WARN for the fenced write:\n{text}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("lease expired at"), "{line}");
    assert!(line.contains("by the database clock"), "{line}");
    assert!(!line.contains("token is no longer current"), "{line}");
    assert!(store.history(run).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_to_an_archived_run_says_it_is_archived() {
    let store = store("fenced_archived").await;
    let run = enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 10_000).await;
    sqlx::query("UPDATE rein_runs SET archived_at = now() WHERE run_id = $1")
        .bind(run)
        .execute(store.pool())
        .await
        .unwrap();
    let reason =
        fence_reason(commit_one(&store, "worker-a", &commit_of(&c, &c.state, &["start"])).await);
    assert_eq!(reason, FenceReason::Archived);
    assert!(reason.to_string().contains("archived"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_without_a_lease_beside_a_live_one_says_who_holds_it() {
    let store = store("fenced_lease_held").await;
    let run = enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 10_000).await;
    let plan = CommitPlan {
        writer: Writer::TakeToken,
        release: false,
        jitter_sample: 0.5,
    };
    let request = plan_commit(
        &lifecycle(),
        run,
        c.token,
        &c.state,
        vec![NewEvent::new("start", json!({}))],
        Vec::new(),
        plan,
    )
    .unwrap();
    match fence_reason(commit_one(&store, "sched-1", &request).await) {
        FenceReason::LeaseHeld { owner, lease_until } => {
            assert_eq!(owner.as_deref(), Some("worker-a"));
            assert_eq!(lease_until, Some(c.lease_until));
        }
        other => panic!("not refused for the live lease: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_the_lease_was_released_says_no_lease_is_held() {
    let store = store("fenced_released").await;
    enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 10_000).await;
    let release = plan_commit(
        &lifecycle(),
        c.run_id,
        c.token,
        &c.state,
        vec![NewEvent::new("start", json!({}))],
        Vec::new(),
        leased(true),
    )
    .unwrap();
    assert!(matches!(
        commit_one(&store, "worker-a", &release).await,
        CommitOutcome::Committed(_)
    ));
    // Same token, next sequence, but the lease was given back.
    let after = commit_of(&c, &release.state, &["complete"]);
    let reason = fence_reason(commit_one(&store, "worker-a", &after).await);
    assert_eq!(reason, FenceReason::LeaseNotHeld { owner: None });
    assert!(reason.to_string().contains("released"), "{reason}");
    // Another worker's commit on a lease worker-a holds says who holds it.
    let mut claimed = store.claim("worker-b", 1, 10_000, &queues()).await.unwrap();
    let b = claimed.pop().expect("worker-b claims the released run");
    let by_a = commit_of(&b, &b.state, &["complete"]);
    assert_eq!(
        fence_reason(commit_one(&store, "worker-a", &by_a).await),
        FenceReason::LeaseNotHeld {
            owner: Some("worker-b".to_owned())
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_approval_is_gone_says_so() {
    let store = store("fenced_approval").await;
    enqueue(&store).await;
    let c = claim_one(&store, "worker-a", 10_000).await;
    let mut request = commit_of(&c, &c.state, &["start"]);
    request.approval = Some(Uuid::now_v7());
    let reason = fence_reason(commit_one(&store, "worker-a", &request).await);
    assert_eq!(reason, FenceReason::ApprovalUnavailable);
}

/// The holder's `start`, with `note` in its payload.
fn start_noting(claimed: &ClaimedRun, note: &str) -> CommitRequest {
    plan_commit(
        &lifecycle(),
        claimed.run_id,
        claimed.token,
        &claimed.state,
        vec![NewEvent::new("start", json!({ "note": note }))],
        Vec::new(),
        leased(false),
    )
    .expect("plan")
}

/// Commits the holder's `start` on `held` and asserts it committed.
async fn start_committed_on(store: &Store, claimed: &ClaimedRun, held: &mut HeldConnection) {
    let committed = store
        .commit_runs_holding("worker-a", &[start_noting(claimed, "fine")], held)
        .await;
    assert!(
        matches!(committed.as_slice(), [Ok(CommitOutcome::Committed(_))]),
        "{committed:?}"
    );
}

/// PostgreSQL refuses a whole statement for one run's data (here a NUL character, which
/// jsonb cannot hold). `commit_runs` then commits the batch's runs one by one before anyone
/// is told: the other runs keep their results and only the bad one gets the refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_for_one_runs_data_is_committed_run_by_run() {
    let store = store("batch_run_by_run").await;
    for _ in 0..3 {
        enqueue(&store).await;
    }
    let claimed = store
        .claim("worker-a", 3, 10_000, &queues())
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 3);
    let requests: Vec<CommitRequest> = claimed
        .iter()
        .enumerate()
        .map(|(i, c)| start_noting(c, if i == 1 { "a\u{0}b" } else { "fine" }))
        .collect();
    // As one statement the batch is refused, and nothing of it is written.
    let whole = store.commit_batch("worker-a", &requests).await;
    assert!(
        matches!(&whole, Err(e) if !e.is_transient()),
        "one run's NUL refuses the statement: {whole:?}"
    );
    for c in &claimed {
        assert!(event_types(&store, c.run_id).await.is_empty());
    }

    let outcomes = store.commit_runs("worker-a", &requests).await;
    assert_eq!(outcomes.len(), 3);
    for (i, (c, outcome)) in claimed.iter().zip(&outcomes).enumerate() {
        let row = store.run(c.run_id).await.expect("run");
        if i == 1 {
            assert!(
                matches!(outcome, Err(e) if !e.is_transient()),
                "{outcome:?}"
            );
            assert_eq!(row.state, "planned", "the bad run wrote nothing");
            assert!(event_types(&store, c.run_id).await.is_empty());
        } else {
            assert!(
                matches!(outcome, Ok(CommitOutcome::Committed(_))),
                "{outcome:?}"
            );
            assert_eq!(row.state, "running");
            assert_eq!(event_types(&store, c.run_id).await, ["start"]);
            assert_replays(&store, c.run_id).await;
        }
    }
}

/// Index entries of the event log read so far, once the statistics show `inserted` rows
/// inserted into it.
async fn event_log_reads_after(store: &Store, inserted: i64) -> i64 {
    common::statistics_once(
        store,
        "SELECT (SELECT COALESCE(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes
                  WHERE relname LIKE 'rein_events%'),
                (SELECT COALESCE(sum(n_tup_ins), 0)::bigint FROM pg_stat_user_tables
                  WHERE relname LIKE 'rein_events%')",
        inserted,
    )
    .await
}

/// A commit asks whether its events are stored already (a retry whose first attempt landed)
/// by the batch's own (run_id, event_id) keys. It once read every event of the run to learn
/// it, so each step of a long run cost more than the last: here a step on top of a
/// 3,000-event log read 3,000 index entries of the log; now it reads none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_on_a_long_log_reads_only_its_own_events() {
    let store = store("commit_reads_own_events").await;
    let run = enqueue(&store).await;
    let claimed = claim_one(&store, "worker-a", 60_000).await;
    assert_eq!(claimed.run_id, run);
    // A long log, written as the owner would have: the run row says where it ends.
    const LOG: i64 = 3_000;
    sqlx::query(
        "INSERT INTO rein_events (run_id, sequence, event_id, type, payload, fencing_token, worker)
         SELECT $1, s, gen_random_uuid(), 'NOTE', '{}', $2, 'worker-a'
         FROM generate_series(1, $3::bigint) AS s",
    )
    .bind(run)
    .bind(claimed.token)
    .bind(LOG)
    .execute(store.pool())
    .await
    .expect("a long log");
    sqlx::query("UPDATE rein_runs SET last_sequence = $2 WHERE run_id = $1")
        .bind(run)
        .bind(LOG)
        .execute(store.pool())
        .await
        .expect("the run row follows its log");
    let before = event_log_reads_after(&store, LOG).await;

    let mut base = claimed.state.clone();
    base.sequence = LOG as u64;
    let request = commit_of(&claimed, &base, &["start"]);
    assert!(
        matches!(
            commit_one(&store, "worker-a", &request).await,
            CommitOutcome::Committed(_)
        ),
        "the step on top of the long log commits"
    );
    let after = event_log_reads_after(&store, LOG + 1).await;
    assert!(
        after - before < 100,
        "one step read {} index entries of the event log; its run has {LOG} events, so it \
         read the run's log instead of probing its own event",
        after - before
    );

    // A retry of that same commit is still recognised as landed.
    assert!(
        matches!(
            commit_one(&store, "worker-a", &request).await,
            CommitOutcome::AlreadyCommitted { .. }
        ),
        "a retried commit is answered from the stored event"
    );
}

/// A writer keeps a connection between its statements only while nobody else needs one,
/// and gives back one that saw an error or sat unused: a connection the database dropped
/// meanwhile then costs no commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_connection_is_kept_only_while_the_pool_can_spare_it() {
    let store = store("held_connection").await;
    for _ in 0..3 {
        enqueue(&store).await;
    }
    let mut held = HeldConnection::default();
    let claimed = store
        .claim_holding("worker-a", 3, 60_000, &queues(), &mut held)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 3);
    assert!(held.is_held(), "a pool of 4 spares the claim's connection");

    // PostgreSQL refuses the NUL: the connection goes back to the pool.
    let refused = store
        .commit_runs_holding(
            "worker-a",
            &[start_noting(&claimed[0], "a\u{0}b")],
            &mut held,
        )
        .await;
    assert!(matches!(refused.as_slice(), [Err(_)]), "{refused:?}");
    assert!(
        !held.is_held(),
        "a connection that saw an error is given back"
    );
    start_committed_on(&store, &claimed[1], &mut held).await;
    assert!(held.is_held());

    // The database drops every other connection while this one sits unused: past
    // IDLE_MAX it is given back unused, and the commit runs on a sound one.
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(store.pool())
    .await
    .expect("terminate");
    tokio::time::sleep(HeldConnection::IDLE_MAX + std::time::Duration::from_millis(200)).await;
    start_committed_on(&store, &claimed[2], &mut held).await;

    // A pool of one connection has none to spare: it goes back after every statement.
    let url = rein_devdb::test_database("held_connection_one", env!("CARGO_TARGET_TMPDIR"))
        .expect("a test database");
    let single = Store::connect(&url, 1).await.expect("connect");
    let mut held = HeldConnection::default();
    single
        .claim_holding("worker-a", 1, 60_000, &queues(), &mut held)
        .await
        .expect("claim");
    assert!(!held.is_held(), "the pool's only connection is given back");
    tokio::time::timeout(std::time::Duration::from_secs(2), single.pool().acquire())
        .await
        .expect("the pool hands out its connection at once")
        .expect("acquire");
}

/// A run refers to a blob only when its own commit stored it, or found it stored while
/// holding its content (SPEC E5): a `$blob` reference written into a payload refers to
/// nothing, even in the statement that stores that blob for another run. An older release's
/// commit, which records nothing itself, gets a reference only for a blob row its own
/// transaction wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blob_references_are_recorded_by_the_commit_that_stored_or_found_the_blob() {
    use rein_core::blob::{Blob, BlobRef, reference};
    let store = store("blob_refs").await;
    for _ in 0..3 {
        enqueue(&store).await;
    }
    let claimed = store.claim("worker-a", 3, 10_000, &queues()).await.unwrap();
    assert_eq!(claimed.len(), 3);
    let content = rein_core::hash::canonical_json(&json!({ "secret": "x".repeat(100) }));
    let blob = Blob {
        sha256: rein_core::hash::sha256_hex(content.as_bytes()),
        content: content.into_bytes(),
    };
    let named = BlobRef {
        sha256: blob.sha256.clone(),
        bytes: blob.content.len(),
    };
    let with = |c: &ClaimedRun, blobs: Vec<Blob>| {
        let mut r = commit_of(c, &c.state, &["start"]);
        r.events[0].payload = json!({ "result": reference(&named) });
        r.blobs = blobs;
        r
    };
    // The first run stores it; the second only names it, in the same statement.
    let (storer, namer, finder) = (&claimed[0], &claimed[1], &claimed[2]);
    let outcomes = store
        .commit_batch(
            "worker-a",
            &[with(storer, vec![blob.clone()]), with(namer, Vec::new())],
        )
        .await
        .unwrap();
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, CommitOutcome::Committed(_)))
    );
    // The third computes the same content later: found stored, and so its own.
    commit_one(&store, "worker-a", &with(finder, vec![blob.clone()])).await;

    let readable = |run: Uuid| {
        let (store, named) = (store.clone(), named.clone());
        async move { store.read_blob_of(run, &named).await.unwrap().is_some() }
    };
    assert!(readable(storer.run_id).await);
    assert!(
        !readable(namer.run_id).await,
        "a named hash is not a reference"
    );
    assert!(readable(finder.run_id).await);
    let referring: Vec<Uuid> =
        sqlx::query_scalar("SELECT run_id FROM rein_blob_refs WHERE sha256 = $1 ORDER BY run_id")
            .bind(&blob.sha256)
            .fetch_all(store.pool())
            .await
            .unwrap();
    let mut expected = vec![storer.run_id, finder.run_id];
    expected.sort();
    assert_eq!(referring, expected);

    // An older release's commit, as its SQL writes: blob and event in one statement.
    let old = |run: Uuid, sequence: i64, sha: &str, store_it: bool| {
        let store = store.clone();
        let sha = sha.to_owned();
        async move {
            sqlx::query(
                "WITH b AS (
                     INSERT INTO rein_blobs (sha256, size_bytes, content)
                     SELECT $3, 1, '\\x30'::bytea WHERE $4
                     ON CONFLICT (sha256) DO NOTHING)
                 INSERT INTO rein_events (run_id, sequence, event_id, type, payload, fencing_token, worker)
                 VALUES ($1, $2, gen_random_uuid(), 'start',
                         jsonb_build_object('result', jsonb_build_object('$blob',
                             jsonb_build_object('sha256', $3::text, 'bytes', 1))), 1, 'old-worker')",
            )
            .bind(run)
            .bind(sequence)
            .bind(sha)
            .bind(store_it)
            .execute(store.pool())
            .await
            .unwrap();
        }
    };
    let fresh = "f".repeat(64);
    old(storer.run_id, 100, &fresh, true).await;
    old(namer.run_id, 100, &blob.sha256, false).await;
    let legacy: Vec<(String, Uuid)> = sqlx::query_as(
        "SELECT sha256, run_id FROM rein_blob_refs WHERE run_id = ANY($1) ORDER BY 1",
    )
    .bind(vec![storer.run_id, namer.run_id])
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(
        legacy,
        vec![(blob.sha256.clone(), storer.run_id), (fresh, storer.run_id)],
        "the stored blob is the old writer's; a hash stored earlier is not"
    );
}
