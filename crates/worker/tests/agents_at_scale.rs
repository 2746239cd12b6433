//! Agents at scale against a real PostgreSQL, with in-process workers and schedulers:
//! parallel branches as child runs joined by policy (SPEC P1), budgets (tokens, wall time),
//! LLM-sized payloads stored once by hash (SPEC E5), the resume brief after a restart
//! (SPEC D3) and the ceiling that ends runaway runs. Only the external model and tools are
//! faked (the handlers below).

use crate::common;
use crate::fleet;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{assert_replays, enqueue, event_types, events_of, store, wait_state, wait_until};
use fleet::Fleet;
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::{Sender, Store, StoreError};
use rein_worker::{
    ActionContext, BoxFuture, NodeHandler, Outcome, Reconciled, Registry, builtin_registry,
};
use serde_json::{Value, json};
use tokio::sync::{Barrier, Notify};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(30);

/// The fake model and tools of every run here, by node action.
#[derive(Clone, Default)]
struct Fakes {
    /// Calls per action name.
    calls: Arc<Mutex<Vec<(String, String)>>>,
    /// Branches that must run at the same moment meet here.
    rendezvous: Arc<Mutex<Option<Arc<Barrier>>>>,
    rendezvous_timeout_ms: u64,
    /// Branches marked `hold` wait for this.
    release: Arc<Notify>,
    /// The worker whose `step` action hangs at step 3 (a crash mid-run).
    hang_on: Arc<Mutex<Option<String>>>,
    /// Resume briefs seen by the `step` action.
    briefs: Arc<Mutex<Vec<rein_core::brief::ResumeBrief>>>,
}

impl Fakes {
    fn calls_of(&self, action: &str) -> usize {
        self.calls
            .lock()
            .expect("calls")
            .iter()
            .filter(|(a, _)| a == action)
            .count()
    }
}

struct Fake {
    action: &'static str,
    fakes: Fakes,
}

/// A large tool result: 5 MiB of text that does not compress to nothing.
fn big_result() -> Value {
    let mut text = String::with_capacity(5 * 1024 * 1024);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    while text.len() < 5 * 1024 * 1024 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(&format!("{x:016x}"));
    }
    json!({ "page": text })
}

impl NodeHandler for Fake {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        self.action == "step"
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let (action, fakes) = (self.action, self.fakes.clone());
        Box::pin(async move {
            fakes
                .calls
                .lock()
                .expect("calls")
                .push((action.to_owned(), ctx.worker_id.clone()));
            let data = ctx.run.data.clone();
            match action {
                "plan" => Outcome::event("GO", json!({})),
                "task" => {
                    if data["rendezvous"] == json!(true) {
                        let barrier = fakes.rendezvous.lock().expect("barrier").clone();
                        let Some(barrier) = barrier else {
                            return Outcome::event(
                                "BROKE",
                                json!({ "error": { "message": "no rendezvous" } }),
                            );
                        };
                        let wait = Duration::from_millis(fakes.rendezvous_timeout_ms);
                        if tokio::time::timeout(wait, barrier.wait()).await.is_err() {
                            return Outcome::event(
                                "BROKE",
                                json!({ "error": { "message": "no other branch ran at the same time" } }),
                            );
                        }
                    }
                    if data["hold"] == json!(true) {
                        fakes.release.notified().await;
                    }
                    if data["outcome"] == json!("fail") {
                        return Outcome::event(
                            "BROKE",
                            json!({ "error": { "class": "fatal", "message": "source unavailable" } }),
                        );
                    }
                    Outcome::event(
                        "FINISHED",
                        json!({ "data": { "result": { "value": data["value"], "worker": ctx.worker_id } } }),
                    )
                }
                "think" => Outcome::event(
                    "THOUGHT",
                    json!({ "usage": { "tokens": 300, "cost": 0.01 } }),
                ),
                "park" => Outcome::event("PARK", json!({})),
                "spin" => Outcome::event("AGAIN", json!({})),
                "start" => Outcome::event("GO", json!({})),
                "fetch" => Outcome::event("FETCHED", json!({ "result": big_result() })),
                "step" => {
                    fakes
                        .briefs
                        .lock()
                        .expect("briefs")
                        .push(ctx.resume_brief());
                    let hang = fakes.hang_on.lock().expect("hang").clone();
                    if ctx.step == 3 && hang.as_deref() == Some(ctx.worker_id.as_str()) {
                        // The worker dies mid-call: nothing ever comes back.
                        std::future::pending::<()>().await;
                    }
                    if ctx.step >= 4 {
                        return Outcome::event("ALL_DONE", json!({}));
                    }
                    Outcome::event("STEP_DONE", json!({ "result": { "n": ctx.step } }))
                }
                other => Outcome::InDoubt(format!("no fake for {other}")),
            }
        })
    }

    fn reconcile(&self, _ctx: ActionContext) -> Option<BoxFuture<Result<Reconciled, String>>> {
        // The fake tool of `step` applies nothing before it answers: a lost call did not
        // happen.
        Some(Box::pin(async { Ok(Reconciled::NotApplied) }))
    }
}

fn registry(fakes: &Fakes) -> Registry {
    let mut registry = Registry::new();
    for action in [
        "plan", "task", "think", "park", "fetch", "step", "spin", "start",
    ] {
        registry.register(
            action,
            Fake {
                action,
                fakes: fakes.clone(),
            },
        );
    }
    registry
}

impl Fleet {
    fn worker(self, store: &Store, id: &str, concurrency: usize, fakes: &Fakes) -> Fleet {
        self.worker_with(store, id, concurrency, registry(fakes))
    }
}

async fn register(store: &Store, text: &str) -> Definition {
    let def = Definition::parse(text, Format::Toml, &GuardRegistry::new()).expect("definition");
    store.register_definition(&def).await.expect("register");
    def
}

// ---------------------------------------------------------------------------------------
// Parallel branches

/// A definition document. The first state is the initial one; `CANCELLED` (terminal) is
/// added as the cancel state. States are (name, kind, action, more TOML for the state);
/// transitions (from, event, to, effects).
fn machine(
    name: &str,
    events: &[&str],
    header: &str,
    states: &[(&str, &str, &str, &str)],
    transitions: &[(&str, &str, &str, &str)],
) -> String {
    let mut doc = format!(
        "name = \"{name}\"\nversion = 1\ncancel_state = \"CANCELLED\"\nevents = {events:?}\n{header}\n"
    );
    let cancelled = ("CANCELLED", "terminal", "", "");
    for (i, (state, kind, action, more)) in states.iter().chain([&cancelled]).enumerate() {
        doc += &format!("\n[[states]]\nname = \"{state}\"\nkind = \"{kind}\"\n");
        if i == 0 {
            doc += "initial = true\n";
        }
        if !action.is_empty() {
            doc += &format!("action = \"{action}\"\n");
        }
        doc += more;
    }
    for (from, event, to, effects) in transitions {
        doc +=
            &format!("\n[[transitions]]\nfrom = \"{from}\"\nevent = \"{event}\"\nto = \"{to}\"\n");
        if !effects.is_empty() {
            doc += &format!("effects = {effects}\n");
        }
    }
    doc
}

fn task() -> String {
    machine(
        "fan-task",
        &["FINISHED", "BROKE"],
        "",
        &[
            ("WORK", "active", "task", ""),
            ("DONE", "terminal", "", ""),
            ("FAILED", "terminal", "", ""),
        ],
        &[
            ("WORK", "FINISHED", "DONE", ""),
            ("WORK", "BROKE", "FAILED", ""),
        ],
    )
}

/// A parent that plans, then fans out into `branches` joined by `join`.
fn fan_parent(name: &str, join: &str, branches: &[&str]) -> String {
    fan_parent_with(name, join, branches, "")
}

/// [`fan_parent`] with `more` TOML in its fan-out table.
fn fan_parent_with(name: &str, join: &str, branches: &[&str], more: &str) -> String {
    let branches: Vec<String> = branches
        .iter()
        .map(|b| {
            format!(
                r#"{{ name = "{b}", definition = "fan-task", version = 1, succeed_on = ["DONE"] }}"#
            )
        })
        .collect();
    let fan_out = format!(
        "\n[states.fan_out]\njoined_event = \"JOINED\"\nfailed_event = \"JOIN_FAILED\"\njoin = {join}\nbranches = [{}]\n{more}",
        branches.join(", ")
    );
    machine(
        name,
        &["GO", "JOINED", "JOIN_FAILED"],
        "",
        &[
            ("PLAN", "active", "plan", ""),
            ("GATHER", "waiting", "", &fan_out),
            ("DONE", "terminal", "", ""),
            ("FAILED", "terminal", "", ""),
        ],
        &[
            ("PLAN", "GO", "GATHER", ""),
            ("GATHER", "JOINED", "DONE", ""),
            ("GATHER", "JOIN_FAILED", "FAILED", ""),
        ],
    )
}

/// (branch, state) of each child, as [`children_of`] lists them.
fn states_by_branch(children: &[(Uuid, String, String)]) -> Vec<(&str, &str)> {
    children
        .iter()
        .map(|(_, b, s)| (b.as_str(), s.as_str()))
        .collect()
}

async fn children_of(store: &Store, parent: Uuid) -> Vec<(Uuid, String, String)> {
    sqlx::query_as(
        "SELECT run_id, branch->>'name', state FROM rein_runs
         WHERE parent_run_id = $1 ORDER BY branch->>'name'",
    )
    .bind(parent)
    .fetch_all(store.pool())
    .await
    .expect("children")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_branches_at_least_two_one_fails_and_the_join_proceeds_with_the_two_results() {
    let store = store("fan_at_least").await;
    register(&store, &task()).await;
    // b may still be running when a and c decide the join: it is kept running, so its own
    // failure is what reaches the parent.
    let parent = register(
        &store,
        &fan_parent_with(
            "fan-2of3",
            r#"{ policy = "at_least", k = 2 }"#,
            &["a", "b", "c"],
            "cancel_losers = false\n",
        ),
    )
    .await;
    let fakes = Fakes::default();
    let run = enqueue(
        &store,
        &parent,
        json!({ "branch_inputs": {
            "a": { "outcome": "succeed", "value": "A" },
            "b": { "outcome": "fail" },
            "c": { "outcome": "succeed", "value": "C" } } }),
    )
    .await;
    let fleet = Fleet::new()
        .worker(&store, "fan-w1", 4, &fakes)
        .scheduler(&store, "fan-s1");
    wait_state(&store, run, "DONE").await;
    // Every child ends (b fails), whether before or after the join.
    wait_until("every branch ended", LONG, || async {
        children_of(&store, run)
            .await
            .iter()
            .all(|(_, _, state)| state != "WORK")
    })
    .await;
    // Each child's end reached the parent exactly once: applied, or recorded as rejected.
    let results = ["BRANCH_SUCCEEDED", "BRANCH_FAILED", "BRANCH_REJECTED"];
    wait_until("every branch's result reached the parent", LONG, || async {
        event_types(&store, run)
            .await
            .iter()
            .filter(|t| results.contains(&t.as_str()))
            .count()
            == 3
    })
    .await;
    fleet.stop().await;

    let joined = events_of(&store, run, "JOINED").await;
    assert_eq!(joined.len(), 1, "the join fires once");
    assert_eq!(joined[0].payload["succeeded"], json!(["a", "c"]));
    let data = store.run(run).await.expect("run").projection.data;
    assert_eq!(data["branches"]["a"]["result"]["value"], "A");
    assert_eq!(data["branches"]["c"]["result"]["value"], "C");
    let children = children_of(&store, run).await;
    assert_eq!(
        states_by_branch(&children),
        vec![("a", "DONE"), ("b", "FAILED"), ("c", "DONE")]
    );
    assert_replays(&store, run).await;
    for (child, _, _) in children {
        assert_replays(&store, child).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_all_takes_the_failure_path_when_one_branch_fails() {
    let store = store("fan_all").await;
    register(&store, &task()).await;
    let parent = register(
        &store,
        &fan_parent("fan-all", r#"{ policy = "all" }"#, &["a", "b", "c"]),
    )
    .await;
    let fakes = Fakes::default();
    let run = enqueue(
        &store,
        &parent,
        json!({ "branch_inputs": {
            "a": { "outcome": "succeed" }, "b": { "outcome": "fail" }, "c": { "outcome": "succeed" } } }),
    )
    .await;
    let fleet = Fleet::new()
        .worker(&store, "all-w1", 4, &fakes)
        .scheduler(&store, "all-s1");
    wait_state(&store, run, "FAILED").await;
    fleet.stop().await;
    let failed = events_of(&store, run, "JOIN_FAILED").await;
    assert_eq!(failed.len(), 1);
    assert!(
        failed[0].payload["failed"]
            .as_array()
            .is_some_and(|f| f.contains(&json!("b")))
    );
    assert!(events_of(&store, run, "JOINED").await.is_empty());
    let row = store.run(run).await.expect("run");
    assert_eq!(
        row.terminal_reason.as_deref(),
        Some("join_policy_cannot_be_met")
    );
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_result_arriving_after_the_join_fired_is_recorded_as_rejected() {
    let store = store("fan_late").await;
    register(&store, &task()).await;
    // c is kept running past the join, so its result arrives late.
    let parent = register(
        &store,
        &fan_parent_with(
            "fan-late",
            r#"{ policy = "at_least", k = 2 }"#,
            &["a", "b", "c"],
            "cancel_losers = false\n",
        ),
    )
    .await;
    let fakes = Fakes::default();
    let run = enqueue(
        &store,
        &parent,
        json!({ "branch_inputs": {
            "a": { "outcome": "succeed" }, "b": { "outcome": "succeed" },
            "c": { "outcome": "succeed", "hold": true, "value": "late" } } }),
    )
    .await;
    let fleet = Fleet::new()
        .worker(&store, "late-w1", 4, &fakes)
        .scheduler(&store, "late-s1");
    wait_state(&store, run, "DONE").await;
    let sequence_at_join = store.run(run).await.expect("run").last_sequence;
    // A forged result from outside is refused outright.
    let forged = store
        .send(
            run,
            "BRANCH_SUCCEEDED",
            json!({ "branch": "c", "fan_out": 2 }),
            &Sender::outside("mallory"),
            60_000,
        )
        .await;
    assert!(matches!(forged, Err(StoreError::Invalid(_))), "{forged:?}");

    // c finishes after the join.
    wait_until("c is running", LONG, || async {
        fakes.calls_of("task") == 3
    })
    .await;
    fakes.release.notify_one();
    wait_until("c's late result is recorded", LONG, || async {
        !events_of(&store, run, "BRANCH_REJECTED").await.is_empty()
    })
    .await;
    fleet.stop().await;

    let rejected = events_of(&store, run, "BRANCH_REJECTED").await;
    assert_eq!(rejected.len(), 1);
    assert_eq!(rejected[0].payload["branch"], "c");
    assert_eq!(rejected[0].payload["event"], "BRANCH_SUCCEEDED");
    assert!(rejected[0].sequence > sequence_at_join);
    let row = store.run(run).await.expect("run");
    assert_eq!(row.state, "DONE", "the late result moved nothing");
    assert_eq!(
        row.projection.data["branches"]["c"]["status"], "running",
        "and was not applied"
    );
    assert!(
        events_of(&store, run, "BRANCH_SUCCEEDED")
            .await
            .iter()
            .all(|e| e.payload["branch"] != "c")
    );
    assert_replays(&store, run).await;
}

/// One quick branch `a` and two that hold until released, joined when one succeeds, run by
/// a worker and a scheduler until the join is decided.
async fn one_of_three(store: &Store, name: &str, more: &str) -> (Uuid, Fakes, Fleet) {
    register(store, &task()).await;
    let parent = register(
        store,
        &fan_parent_with(
            name,
            r#"{ policy = "at_least", k = 1 }"#,
            &["a", "b", "c"],
            more,
        ),
    )
    .await;
    let run = enqueue(
        store,
        &parent,
        json!({ "branch_inputs": {
            "a": { "outcome": "succeed", "value": "A" },
            "b": { "outcome": "succeed", "hold": true, "value": "B" },
            "c": { "outcome": "succeed", "hold": true, "value": "C" } } }),
    )
    .await;
    let fakes = Fakes::default();
    let fleet = Fleet::new()
        .worker(store, &format!("{name}-w1"), 4, &fakes)
        .scheduler(store, &format!("{name}-s1"));
    wait_state(store, run, "DONE").await;
    (run, fakes, fleet)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_branches_still_running_when_the_join_is_decided_are_cancelled() {
    let store = store("fan_cancel_losers").await;
    let (run, fakes, fleet) = one_of_three(&store, "fan-1of3", "").await;
    wait_until("b and c are cancelled", LONG, || async {
        let children = children_of(&store, run).await;
        children
            .iter()
            .filter(|(_, b, s)| b != "a" && s == "CANCELLED")
            .count()
            == 2
    })
    .await;
    // Their ends still reach the parent, which records them as too late.
    wait_until("both late ends are recorded", LONG, || async {
        events_of(&store, run, "BRANCH_REJECTED").await.len() == 2
    })
    .await;
    fleet.stop().await;

    let joined = events_of(&store, run, "JOINED").await;
    assert_eq!(joined.len(), 1);
    assert_eq!(joined[0].payload["succeeded"], json!(["a"]));
    assert_eq!(joined[0].payload["running"], json!(["b", "c"]));
    let children = children_of(&store, run).await;
    assert_eq!(
        states_by_branch(&children),
        vec![("a", "DONE"), ("b", "CANCELLED"), ("c", "CANCELLED")]
    );
    for (child, branch, _) in &children {
        assert_eq!(
            child.as_bytes()[..6],
            run.as_bytes()[..6],
            "branch {branch}'s id {child} carries its parent's time prefix"
        );
    }
    for (child, branch, _) in children.iter().filter(|(_, b, _)| b != "a") {
        let cancels = events_of(&store, *child, "CANCEL").await;
        assert_eq!(cancels.len(), 1, "branch {branch}");
        assert_eq!(cancels[0].payload["reason"], "join_decided");
        assert_eq!(cancels[0].payload["parent_run_id"], json!(run));
        let row = store.run(*child).await.expect("child");
        assert_eq!(
            row.terminal_reason.as_deref(),
            Some("cancelled: join_decided")
        );
        assert!(
            events_of(&store, *child, "FINISHED").await.is_empty(),
            "branch {branch} never finished its work"
        );
        assert_replays(&store, *child).await;
    }
    assert!(fakes.calls_of("task") <= 3, "no branch ran again");
    assert_replays(&store, run).await;
}

/// Moves every row of run `old`, in every table that has a `run_id`, to the id `new`: as if
/// its fan-out had started it under another rule for child ids (an older release's).
async fn move_run(store: &Store, old: Uuid, new: Uuid) {
    let sql = r#"
DO $$
DECLARE t record; cols text; vals text;
BEGIN
    FOR t IN SELECT c.table_name FROM information_schema.columns c
             JOIN information_schema.tables b USING (table_schema, table_name)
             WHERE c.column_name = 'run_id' AND b.table_type = 'BASE TABLE'
               AND c.table_schema = current_schema()
    LOOP
        SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position),
               string_agg(CASE WHEN column_name = 'run_id' THEN quote_literal('NEW_ID') || '::uuid'
                               ELSE quote_ident(column_name) END, ', ' ORDER BY ordinal_position)
        INTO cols, vals
        FROM information_schema.columns
        WHERE table_schema = current_schema() AND table_name = t.table_name;
        EXECUTE format('INSERT INTO %I (%s) OVERRIDING SYSTEM VALUE SELECT %s FROM %I WHERE run_id = %L',
                       t.table_name, cols, vals, t.table_name, 'OLD_ID');
        EXECUTE format('DELETE FROM %I WHERE run_id = %L', t.table_name, 'OLD_ID');
    END LOOP;
END $$"#
        .replace("NEW_ID", &new.to_string())
        .replace("OLD_ID", &old.to_string());
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(store.pool())
        .await
        .expect("move the run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_decided_after_an_upgrade_cancels_branches_started_under_another_id_rule() {
    let store = store("fan_cancel_old_ids").await;
    register(&store, &task()).await;
    let parent = register(
        &store,
        &fan_parent(
            "fan-old-ids",
            r#"{ policy = "at_least", k = 1 }"#,
            &["a", "b", "c"],
        ),
    )
    .await;
    let hold = json!({ "outcome": "succeed", "hold": true, "value": "x" });
    let run = enqueue(
        &store,
        &parent,
        json!({ "branch_inputs": { "a": hold, "b": hold, "c": hold } }),
    )
    .await;
    let before = Fakes::default();
    let fleet = Fleet::new()
        .worker(&store, "old-ids-w1", 4, &before)
        .scheduler(&store, "old-ids-s1");
    wait_until("every branch is at work", LONG, || async {
        before.calls_of("task") == 3
    })
    .await;
    fleet.stop().await;
    // No child keeps the id the current rule gives it.
    let mut moved = Vec::new();
    for (child, branch, _) in children_of(&store, run).await {
        let other = Uuid::now_v7();
        move_run(&store, child, other).await;
        moved.push((other, branch));
    }
    assert_eq!(moved.len(), 3);

    // One branch may finish; the join is then decided with the other two still at work.
    let after = Fakes::default();
    after.release.notify_one();
    let fleet = Fleet::new()
        .worker(&store, "old-ids-w2", 4, &after)
        .scheduler(&store, "old-ids-s2");
    wait_state(&store, run, "DONE").await;
    wait_until("the two losers are cancelled", LONG, || async {
        children_of(&store, run)
            .await
            .iter()
            .filter(|(_, _, s)| s == "CANCELLED")
            .count()
            == 2
    })
    .await;
    fleet.stop().await;
    for (child, branch, state) in children_of(&store, run).await {
        assert!(moved.contains(&(child, branch.clone())), "{child} {branch}");
        if state == "CANCELLED" {
            let cancels = events_of(&store, child, "CANCEL").await;
            assert_eq!(cancels.len(), 1, "branch {branch}");
            assert_eq!(cancels[0].payload["reason"], "join_decided");
        }
        assert_replays(&store, child).await;
    }
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cancel_losers_false_the_branches_still_running_run_to_their_end() {
    let store = store("fan_keep_losers").await;
    let (run, fakes, fleet) =
        one_of_three(&store, "fan-1of3-keep", "cancel_losers = false\n").await;
    wait_until("b and c are running", LONG, || async {
        fakes.calls_of("task") == 3
    })
    .await;
    // Released after the join, both finish their work.
    wait_until("b and c finished", LONG, || async {
        fakes.release.notify_waiters();
        children_of(&store, run)
            .await
            .iter()
            .all(|(_, _, s)| s == "DONE")
    })
    .await;
    fleet.stop().await;
    for (child, branch, _) in children_of(&store, run).await {
        assert!(
            events_of(&store, child, "CANCEL").await.is_empty(),
            "branch {branch} was not cancelled"
        );
        let inbox: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_inbox WHERE run_id = $1")
            .bind(child)
            .fetch_one(store.pool())
            .await
            .expect("inbox");
        assert_eq!(inbox, 0, "nothing waits for branch {branch}");
    }
    assert_replays(&store, run).await;
}

/// Runs two branches that only finish if both run at the same moment, on `workers` workers
/// of concurrency 1; returns the parent.
async fn rendezvous_run(store: &Store, fakes: &Fakes, workers: &[&str]) -> Uuid {
    register(store, &task()).await;
    let parent = register(
        store,
        &fan_parent("fan-meet", r#"{ policy = "all" }"#, &["a", "b"]),
    )
    .await;
    *fakes.rendezvous.lock().expect("barrier") = Some(Arc::new(Barrier::new(2)));
    let run = enqueue(
        store,
        &parent,
        json!({ "branch_inputs": {
            "a": { "outcome": "succeed", "rendezvous": true, "value": "from a" },
            "b": { "outcome": "succeed", "rendezvous": true, "value": "from b" } } }),
    )
    .await;
    let mut fleet = Fleet::new().scheduler(store, "meet-s1");
    for w in workers {
        fleet = fleet.worker(store, w, 1, fakes);
    }
    wait_until("the parent ended", LONG, || async {
        store.run(run).await.expect("run").status == "terminal"
    })
    .await;
    fleet.stop().await;
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branches_run_on_different_workers_at_once_and_keep_their_own_facts() {
    let store = store("fan_workers").await;
    let fakes = Fakes {
        rendezvous_timeout_ms: 20_000,
        ..Fakes::default()
    };
    let run = rendezvous_run(&store, &fakes, &["meet-w1", "meet-w2"]).await;
    assert_eq!(store.run(run).await.expect("run").state, "DONE");

    // Each branch's end was written by the worker that held its lease; two workers.
    let mut writers = BTreeSet::new();
    let children = children_of(&store, run).await;
    for (child, _, _) in &children {
        let finished = events_of(&store, *child, "FINISHED").await;
        assert_eq!(finished.len(), 1);
        writers.insert(finished[0].worker.clone());
    }
    assert_eq!(
        writers,
        BTreeSet::from(["meet-w1".to_owned(), "meet-w2".to_owned()])
    );
    // Their leases overlapped: each was granted before the other branch's end was written.
    let overlap: bool = sqlx::query_scalar(
        "SELECT bool_and(g.granted_at < e.occurred_at)
         FROM rein_lease_grants g
         JOIN rein_runs c ON c.run_id = g.run_id AND c.parent_run_id = $1
         JOIN rein_events e ON e.type = 'FINISHED' AND e.run_id <> g.run_id
         JOIN rein_runs o ON o.run_id = e.run_id AND o.parent_run_id = $1",
    )
    .bind(run)
    .fetch_one(store.pool())
    .await
    .expect("overlap");
    assert!(overlap, "each branch was leased before the other one ended");
    // Each branch wrote only its own key; neither overwrote the other.
    let data = store.run(run).await.expect("run").projection.data;
    assert_eq!(data["branches"]["a"]["result"]["value"], "from a");
    assert_eq!(data["branches"]["b"]["result"]["value"], "from b");
    assert_ne!(
        data["branches"]["a"]["result"]["worker"],
        data["branches"]["b"]["result"]["worker"]
    );
    assert_replays(&store, run).await;
}

/// The check above is not vacuous: with one worker of concurrency 1 the two branches can
/// never run at once, the rendezvous fails and so does the join.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_single_worker_the_branches_cannot_run_at_once() {
    let store = store("fan_one_worker").await;
    let fakes = Fakes {
        rendezvous_timeout_ms: 1_500,
        ..Fakes::default()
    };
    let run = rendezvous_run(&store, &fakes, &["alone-w1"]).await;
    assert_eq!(store.run(run).await.expect("run").state, "FAILED");
}

// ---------------------------------------------------------------------------------------
// Budgets

/// Registers `build` with `budget` (as `budgeted`) and without (as `free`), and starts a run
/// of each: the one without shows what the budget prevents.
async fn with_and_without_budget(
    store: &Store,
    build: fn(&str, &str) -> String,
    budget: &str,
) -> (Uuid, Uuid) {
    let budgeted = register(store, &build("budgeted", &format!("[budget]\n{budget}\n"))).await;
    let free = register(store, &build("free", "")).await;
    (
        enqueue(store, &budgeted, json!({})).await,
        enqueue(store, &free, json!({})).await,
    )
}

/// An agent that thinks forever (300 tokens a thought), with an optional budget.
fn looper(name: &str, budget: &str) -> String {
    machine(
        name,
        &["THOUGHT", "BUDGET_EXHAUSTED"],
        budget,
        &[
            ("THINK", "active", "think", ""),
            ("STOPPED", "terminal", "", ""),
        ],
        &[
            ("THINK", "THOUGHT", "THINK", ""),
            ("THINK", "BUDGET_EXHAUSTED", "STOPPED", ""),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_stops_a_looping_agent_at_the_declared_event() {
    let store = store("budget_tokens").await;
    let (run, free) = with_and_without_budget(
        &store,
        looper,
        "tokens = 1000\ncost = 100.0\nevent = \"BUDGET_EXHAUSTED\"",
    )
    .await;
    let fakes = Fakes::default();
    let fleet = Fleet::new().worker(&store, "think-w1", 2, &fakes);
    wait_state(&store, run, "STOPPED").await;
    // Without a budget the same agent keeps spending.
    wait_until("the unbudgeted agent thought 10 times", LONG, || async {
        store.run(free).await.expect("run").projection.sequence >= 10
    })
    .await;
    fleet.stop().await;

    let row = store.run(run).await.expect("run");
    assert_eq!(row.projection.usage.tokens, 1200, "4 thoughts of 300");
    assert_eq!(
        row.projection.usage.steps, 5,
        "4 thoughts and the budget event"
    );
    assert_eq!(row.terminal_reason.as_deref(), Some("budget_exhausted"));
    assert_eq!(
        event_types(&store, run).await,
        vec![
            "THOUGHT",
            "THOUGHT",
            "THOUGHT",
            "THOUGHT",
            "BUDGET_EXHAUSTED"
        ]
    );
    let fired = events_of(&store, run, "BUDGET_EXHAUSTED").await;
    assert_eq!(fired[0].payload["budget"], "tokens");
    assert_eq!(fired[0].payload["limit"].as_f64(), Some(1000.0));
    assert_replays(&store, run).await;

    let free_row = store.run(free).await.expect("run");
    assert_ne!(free_row.status, "terminal");
    assert!(
        free_row.projection.usage.is_zero(),
        "no budget, no accounting"
    );
}

/// Parks waiting for a user who never answers, with an optional budget.
fn sleeper(name: &str, budget: &str) -> String {
    machine(
        name,
        &["PARK", "REPLY", "BUDGET_EXHAUSTED"],
        budget,
        &[
            ("START", "active", "park", ""),
            ("WAITING_USER", "waiting", "", ""),
            ("DONE", "terminal", "", ""),
            ("TIMED_OUT", "terminal", "", ""),
        ],
        &[
            ("START", "PARK", "WAITING_USER", ""),
            ("WAITING_USER", "REPLY", "DONE", ""),
            ("WAITING_USER", "BUDGET_EXHAUSTED", "TIMED_OUT", ""),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_time_budget_fires_through_the_scheduler_by_the_database_clock() {
    let store = store("budget_wall").await;
    let (run, free) = with_and_without_budget(
        &store,
        sleeper,
        "wall_time_ms = 800\nevent = \"BUDGET_EXHAUSTED\"",
    )
    .await;
    let fakes = Fakes::default();
    let fleet = Fleet::new()
        .worker(&store, "sleep-w1", 2, &fakes)
        .scheduler(&store, "sleep-s1");
    wait_state(&store, run, "TIMED_OUT").await;
    fleet.stop().await;

    let fired = events_of(&store, run, "BUDGET_EXHAUSTED").await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].worker, "sleep-s1", "the scheduler fired it");
    assert_eq!(fired[0].payload["budget"], "wall_time_ms");
    let after_ms: f64 = sqlx::query_scalar(
        "SELECT (extract(epoch FROM e.occurred_at - r.created_at) * 1000)::float8
         FROM rein_events e JOIN rein_runs r USING (run_id)
         WHERE e.run_id = $1 AND e.type = 'BUDGET_EXHAUSTED'",
    )
    .bind(run)
    .fetch_one(store.pool())
    .await
    .expect("elapsed");
    assert!(after_ms >= 800.0, "fired {after_ms} ms after creation");
    let row = store.run(run).await.expect("run");
    assert_eq!(
        row.projection.usage.exhausted.as_deref(),
        Some("wall_time_ms")
    );
    assert_eq!(
        store.run(free).await.expect("run").state,
        "WAITING_USER",
        "without a budget the run still waits"
    );
    assert_replays(&store, run).await;
}

// ---------------------------------------------------------------------------------------
// LLM-sized payloads

fn fetcher() -> String {
    machine(
        "fetcher",
        &["FETCHED"],
        "",
        &[
            ("FETCH", "active", "fetch", ""),
            ("DONE", "terminal", "", ""),
        ],
        &[("FETCH", "FETCHED", "DONE", r#"["append_result"]"#)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5mb_tool_result_is_stored_once_and_replay_reads_it_without_calling_the_tool() {
    let store = store("blobs").await;
    let def = register(&store, &fetcher()).await;
    let fakes = Fakes::default();
    let first = enqueue(&store, &def, json!({})).await;
    let second = enqueue(&store, &def, json!({})).await;
    let fleet = Fleet::new().worker(&store, "fetch-w1", 2, &fakes);
    wait_state(&store, first, "DONE").await;
    wait_state(&store, second, "DONE").await;
    fleet.stop().await;
    assert_eq!(fakes.calls_of("fetch"), 2, "one call per run");

    let expected = big_result();
    let bytes = rein_core::hash::canonical_json(&expected).len();
    let sha256 = rein_core::hash::sha256_hex(rein_core::hash::canonical_json(&expected).as_bytes());
    for run in [first, second] {
        let fetched = events_of(&store, run, "FETCHED").await;
        let reference = rein_core::blob::reference_of(&fetched[0].payload["result"])
            .expect("the event holds a reference");
        assert_eq!(reference.sha256, sha256);
        assert_eq!(reference.bytes, bytes);
        let event_bytes: i32 = sqlx::query_scalar(
            "SELECT octet_length(payload::text) FROM rein_events WHERE run_id = $1 AND type = 'FETCHED'",
        )
        .bind(run)
        .fetch_one(store.pool())
        .await
        .expect("size");
        assert!(event_bytes < 1024, "the event is {event_bytes} bytes");
        assert_eq!(
            store.read_blob(&reference).await.expect("blob"),
            expected,
            "the recorded result reads back whole"
        );
    }
    let stats = store.blob_stats().await.expect("stats");
    assert_eq!(stats.blobs, 1, "two runs, one stored copy");
    assert_eq!(stats.stored_bytes, bytes as i64);
    eprintln!(
        "blob bytes: {} stored once for 2 runs (inline it would be {})",
        stats.stored_bytes,
        2 * bytes
    );

    // Replay (the stored-projection verification) reads the recorded result by hash and
    // never calls the tool.
    assert_replays(&store, first).await;
    assert_replays(&store, second).await;
    assert_eq!(fakes.calls_of("fetch"), 2, "replay called no tool");

    // A planted corruption of the stored content is caught.
    sqlx::query(
        "UPDATE rein_blobs SET content = overlay(content placing 'x'::bytea from 20 for 1)",
    )
    .execute(store.pool())
    .await
    .expect("corrupt");
    let verdict = store.verify_run(first).await.expect("verify");
    assert!(
        verdict.as_deref().is_some_and(|v| v.contains("bad blob")),
        "{verdict:?}"
    );
}

#[test]
fn a_field_too_large_even_for_a_blob_and_a_payload_still_too_large_are_named() {
    use rein_core::blob::{PayloadError, externalize};
    let huge = json!({ "result": "x".repeat(rein_core::limits::BLOB_BYTES_MAX + 1) });
    assert!(matches!(
        externalize(&huge, 1024),
        Err(PayloadError::FieldTooLarge { ref field, .. }) if field == "result"
    ));
    let wide =
        json!({ "data": { "notes": "y".repeat(rein_core::limits::EVENT_PAYLOAD_BYTES_MAX) } });
    let err = externalize(&wide, 1024).expect_err("data stays inline and is too large");
    assert!(err.to_string().contains("the limit is"), "{err}");
}

// ---------------------------------------------------------------------------------------
// The resume brief

fn stepper() -> String {
    machine(
        "stepper",
        &["STEP_DONE", "ALL_DONE"],
        r#"call_results = ["STEP_DONE", "ALL_DONE"]"#,
        &[("WORK", "active", "step", ""), ("DONE", "terminal", "", "")],
        &[
            (
                "WORK",
                "STEP_DONE",
                "WORK",
                r#"["append_result", "complete_step"]"#,
            ),
            ("WORK", "ALL_DONE", "DONE", r#"["complete_step"]"#),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resume_brief_after_a_restart_lists_exactly_the_done_steps_and_the_pending_one() {
    let store = store("brief").await;
    let def = register(&store, &stepper()).await;
    let fakes = Fakes::default();
    *fakes.hang_on.lock().expect("hang") = Some("brief-w1".into());
    let run = enqueue(&store, &def, json!({ "task": "three lookups" })).await;

    // The first worker does steps 1 and 2 and dies during step 3.
    let fleet = Fleet::new().worker(&store, "brief-w1", 1, &fakes);
    wait_until("step 3 is dispatched", LONG, || async {
        events_of(&store, run, "ACTION_DISPATCHED").await.len() == 3
    })
    .await;
    fleet.stop().await;

    let brief = store.resume_brief(run).await.expect("brief");
    let again = store.resume_brief(run).await.expect("brief");
    assert_eq!(
        brief.to_canonical_json(),
        again.to_canonical_json(),
        "deterministic"
    );
    assert_eq!(
        brief.task,
        rein_core::brief::BriefValue::Inline(json!("three lookups"))
    );
    assert_eq!(brief.steps_completed, 2);
    let done: Vec<(Option<u32>, Value)> = brief
        .steps_done
        .iter()
        .map(|s| match &s.result {
            rein_core::brief::BriefValue::Inline(v) => (s.step, v.clone()),
            other => panic!("small results are inline: {other:?}"),
        })
        .collect();
    assert_eq!(
        done,
        vec![(Some(1), json!({ "n": 1 })), (Some(2), json!({ "n": 2 }))]
    );
    let pending = brief.pending.clone().expect("a pending step");
    assert_eq!((pending.step, pending.node.as_str()), (3, "WORK"));
    assert_eq!(pending.status, "dispatched", "step 3 may have been sent");

    // Restarted on another worker: the call is reconciled, then step 3 runs again and the
    // action sees the same done steps, with step 3 pending as a retry.
    fakes.briefs.lock().expect("briefs").clear();
    let fleet = Fleet::new()
        .worker(&store, "brief-w2", 1, &fakes)
        .scheduler(&store, "brief-s1");
    wait_state(&store, run, "DONE").await;
    fleet.stop().await;
    let seen = fakes.briefs.lock().expect("briefs").clone();
    let retry = seen
        .iter()
        .find(|b| b.pending.as_ref().is_some_and(|p| p.step == 3))
        .expect("step 3 ran again with a brief");
    assert_eq!(retry.steps_done, brief.steps_done);
    assert_eq!(
        retry.pending.as_ref().map(|p| p.status.as_str()),
        Some("retrying")
    );
    let last = store.resume_brief(run).await.expect("brief");
    assert_eq!(last.steps_completed, 4);
    assert_eq!(last.steps_done.len(), 3);
    assert_eq!(last.pending, None, "a finished run has nothing pending");
    assert_ne!(last.to_canonical_json(), brief.to_canonical_json());
    assert_replays(&store, run).await;
}

// ---------------------------------------------------------------------------------------
// Runaway runs

/// A fixture of the core's tests with `max_events = 50`.
fn with_ceiling_of_50(text: &str) -> String {
    assert!(text.contains("version = 1\n"));
    text.replacen("version = 1\n", "version = 1\nmax_events = 50\n", 1)
}

async fn wait_terminal(store: &Store, run: Uuid) {
    wait_until("the run ended", LONG, || async {
        store.run(run).await.expect("run").status == "terminal"
    })
    .await;
}

/// Asserts that `run` ended failed on its ceiling of 50 events, the last one written by
/// `writer`.
async fn assert_ended_on_the_ceiling(store: &Store, run: Uuid, writer: &str) {
    let row = store.run(run).await.expect("run");
    assert_eq!(row.state, "CANCELLED", "the definition's cancel state");
    assert_eq!(row.terminal_reason.as_deref(), Some("step_limit"));
    assert_eq!(row.last_sequence, 50, "at the ceiling, not past it");
    assert!(row.finished_at.is_some());
    let history = store.history(run).await.expect("history");
    assert_eq!(history.len(), 50);
    let last = history.last().expect("events");
    assert_eq!(last.kind, "STEP_LIMIT_REACHED");
    assert_eq!(last.payload["reason"], "step_limit");
    assert_eq!(last.payload["max_events"], 50);
    assert_eq!(
        last.worker, writer,
        "appended to the commit that reached the ceiling"
    );
    assert_replays(store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_active_state_that_returns_to_itself_ends_failed_at_max_events() {
    let store = store("runaway_self_loop").await;
    let text = with_ceiling_of_50(include_str!("../../core/tests/fixtures/self-loop.toml"));
    let def = register(&store, &text).await;
    let run = enqueue(&store, &def, json!({})).await;
    let fakes = Fakes::default();
    let fleet = Fleet::new().worker(&store, "spin-w1", 1, &fakes);
    wait_terminal(&store, run).await;
    fleet.stop().await;
    assert_ended_on_the_ceiling(&store, run, "spin-w1").await;
    assert_eq!(
        events_of(&store, run, "AGAIN").await.len(),
        49,
        "the worker's steps until the ceiling"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_waiting_states_whose_1ms_timers_point_at_each_other_end_failed_at_max_events() {
    let store = store("runaway_ping_pong").await;
    let text = with_ceiling_of_50(include_str!(
        "../../core/tests/fixtures/timer-ping-pong.toml"
    ));
    let def = register(&store, &text).await;
    assert_eq!(def.warnings().len(), 1, "{:?}", def.warnings());
    let run = enqueue(&store, &def, json!({})).await;
    let fakes = Fakes::default();
    let fleet = Fleet::new()
        .worker(&store, "pong-w1", 1, &fakes)
        .scheduler(&store, "pong-s1");
    wait_terminal(&store, run).await;
    fleet.stop().await;
    assert_ended_on_the_ceiling(&store, run, "pong-s1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_research_run_asking_for_more_sim_steps_than_the_sim_takes_fails_at_intake() {
    let store = store("runaway_sim_steps").await;
    let def = store
        .load_definition("research-agent", None)
        .await
        .expect("built in");
    let run = enqueue(&store, &def, json!({ "sim": { "steps": 100_000_000 } })).await;
    let fleet = Fleet::new().worker_with(&store, "steps-w1", 1, builtin_registry(store.clone()));
    wait_terminal(&store, run).await;
    fleet.stop().await;
    let row = store.run(run).await.expect("run");
    assert_eq!(row.state, "FAILED");
    assert_eq!(row.terminal_reason.as_deref(), Some("invalid_input"));
    let history = store.history(run).await.expect("history");
    assert_eq!(history.len(), 1, "nothing ran");
    assert_eq!(history[0].kind, "INVALID_INPUT");
    assert_eq!(
        history[0].payload["error"]["message"],
        "input.sim.steps is 100000000; a sim run takes at most 1000 steps"
    );
}
