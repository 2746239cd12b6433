//! Trees of fan-outs against a real PostgreSQL, with in-process workers and a scheduler
//! (SPEC P1, Z4): a definition that fans out into copies of itself stays within the tree's
//! bounds and its root fails saying which bound, two writers fanning out under one root at
//! once never pass the bound together, and cancelling a run cancels every live run below it,
//! leased or not. Only the node action is faked.

use crate::common;
use crate::fleet;

use std::time::Duration;

use common::{assert_replays, enqueue, event_types, events_of, store, wait_until};
use fleet::Fleet;
use rein_core::join::TreeBounds;
use rein_core::{Definition, Format, GuardRegistry, RunState};
use rein_store::{
    CommitOutcome, CommitPlan, INBOX_TTL_MS_DEFAULT, NewEvent, Sender, Store, Writer, plan_commit,
};
use rein_worker::{ActionContext, BoxFuture, NodeHandler, Outcome, Registry};
use serde_json::json;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(60);

/// A definition that fans out into two copies of itself (its `START` runs the `fork` action).
const FORK: &str = include_str!("fixtures/fork.toml");

/// The `fork` action. Without `levels` in the run's data it always fans out (a fork bomb).
/// With `levels`, a run at `level` < `levels` fans out, passing `level + 1` down; a run at
/// the last level parks in HOLD, or, when its data says `hold`, keeps its action running
/// (and its lease) until it is stopped.
struct ForkAction;

impl NodeHandler for ForkAction {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        Box::pin(async move {
            let data = &ctx.run.data;
            let level = data["level"].as_u64().unwrap_or(0);
            let Some(levels) = data["levels"].as_u64() else {
                return Outcome::event("GO", json!({}));
            };
            if level >= levels {
                if data["hold"] == json!(true) {
                    std::future::pending::<()>().await;
                }
                return Outcome::event("STAY", json!({}));
            }
            let child = |hold: bool| json!({ "level": level + 1, "levels": levels, "hold": hold && level + 1 == levels });
            Outcome::event(
                "GO",
                json!({ "data": { "branch_inputs": { "left": child(true), "right": child(false) } } }),
            )
        })
    }
}

/// `workers` workers running the `fork` action and a scheduler, all on `store` (and its
/// bounds).
fn fleet(store: &Store, name: &str, workers: usize) -> Fleet {
    let mut fleet = Fleet::new();
    for w in 0..workers {
        let mut registry = Registry::new();
        registry.register("fork", ForkAction);
        fleet = fleet.worker_with(store, &format!("{name}-w{w}"), 8, registry);
    }
    fleet.scheduler(store, &format!("{name}-s"))
}

async fn fork(store: &Store) -> Definition {
    let def = Definition::parse(FORK, Format::Toml, &GuardRegistry::new()).expect("definition");
    store.register_definition(&def).await.expect("register");
    def
}

/// (runs in the tree, runs in it not ended, the deepest depth) of `root`'s tree, root included.
async fn tree(store: &Store, root: Uuid) -> (i64, i64, i32) {
    sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status <> 'terminal'), max(depth)
         FROM rein_runs WHERE run_id = $1 OR root_run_id = $1",
    )
    .bind(root)
    .fetch_one(store.pool())
    .await
    .expect("tree")
}

/// Starts a fork bomb on `workers` workers and a scheduler and waits until its whole tree
/// ended; its root.
async fn fork_bomb(store: &Store, name: &str, workers: usize) -> Uuid {
    let def = fork(store).await;
    let root = enqueue(store, &def, json!({})).await;
    let fleet = fleet(store, name, workers);
    wait_until("the root ends", LONG, || async {
        terminal_reason(store, root).await.is_some()
    })
    .await;
    wait_until("the whole tree ends", LONG, || async {
        tree(store, root).await.1 == 0
    })
    .await;
    fleet.stop().await;
    root
}

async fn terminal_reason(store: &Store, run: Uuid) -> Option<String> {
    let row = store.run(run).await.expect("run");
    (row.status == "terminal").then(|| row.terminal_reason.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_forking_into_itself_stops_at_the_depth_bound_and_its_root_fails_saying_so() {
    let store = store("fork_depth").await;
    assert_eq!(store.tree_bounds(), TreeBounds::default());
    let root = fork_bomb(&store, "fork-depth", 1).await;

    // Depth 0 to 4: 1 + 2 + 4 + 8 + 16 runs, and not one more.
    let (runs, _, deepest) = tree(&store, root).await;
    assert_eq!((runs, deepest), (31, 4));
    assert_eq!(
        terminal_reason(&store, root).await.as_deref(),
        Some("fan_out_depth_exceeded")
    );
    let descendants: i64 =
        sqlx::query_scalar("SELECT descendants FROM rein_runs WHERE run_id = $1")
            .bind(root)
            .fetch_one(store.pool())
            .await
            .expect("descendants");
    assert_eq!(
        descendants, 30,
        "the root counted every run its tree started"
    );

    // A run at depth 4 took its fan-out's failure path, recorded with the bound.
    let leaf: Uuid = sqlx::query_scalar(
        "SELECT run_id FROM rein_runs WHERE root_run_id = $1 AND depth = 4 AND state = 'FAILED'
         LIMIT 1",
    )
    .bind(root)
    .fetch_one(store.pool())
    .await
    .expect("a leaf");
    let failed = events_of(&store, leaf, "JOIN_FAILED").await;
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].payload["reason"], "fan_out_depth_exceeded");
    assert_eq!(
        failed[0].payload["refused"],
        json!({ "depth": 4, "depth_max": 4 })
    );
    let leaf_row = store.run(leaf).await.expect("leaf");
    assert_eq!(leaf_row.state, "FAILED");
    assert_eq!(
        leaf_row.projection.data["branches"]["left"]["status"],
        "failed"
    );
    assert_replays(&store, leaf).await;
    assert_replays(&store, root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_forking_into_itself_stops_at_the_descendants_bound() {
    let store = store("fork_descendants")
        .await
        .with_tree_bounds(TreeBounds {
            depth_max: 32,
            descendants_max: 10,
        });
    let root = fork_bomb(&store, "fork-descendants", 2).await;

    let (runs, _, _) = tree(&store, root).await;
    // Fan-outs of two: 2 + 2 + 2 + 2 + 2 children, then every further one is refused.
    assert_eq!(runs, 11, "the root and the 10 runs its tree may start");
    assert_eq!(
        terminal_reason(&store, root).await.as_deref(),
        Some("fan_out_descendants_exceeded")
    );
    assert_replays(&store, root).await;
}

/// The next runnable run `worker` claims: its id, the state it read and its token.
async fn claim(store: &Store, worker: &str) -> (Uuid, RunState, i64) {
    let mut claimed = store
        .claim(worker, 1, 60_000, &["default".to_owned()])
        .await
        .expect("claim");
    let run = claimed
        .pop()
        .unwrap_or_else(|| panic!("{worker} claims a run"));
    (run.run_id, run.state, run.token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_fanning_out_under_one_root_at_once_never_pass_its_bound() {
    // Room for the root's two children and one more fan-out of two.
    let bounds = TreeBounds {
        depth_max: 8,
        descendants_max: 4,
    };
    let store = store("fork_race").await.with_tree_bounds(bounds);
    let def = fork(&store).await;
    let plan = CommitPlan {
        writer: Writer::Leased,
        release: false,
        jitter_sample: 0.5,
    };
    let go = || vec![NewEvent::new("GO", json!({}))];

    let root = enqueue(&store, &def, json!({})).await;
    let (claimed, base, token) = claim(&store, "w-root").await;
    assert_eq!(claimed, root);
    let request = plan_commit(&def, root, token, &base, go(), Vec::new(), plan).expect("plan");
    assert_eq!(request.children.len(), 2);
    let out = store
        .commit_batch("w-root", &[request])
        .await
        .expect("commit");
    assert!(matches!(out[0], CommitOutcome::Committed(_)), "{out:?}");

    // Both children fan out at the same moment, from two workers each holding one.
    let children: Vec<Uuid> = sqlx::query_scalar(
        "SELECT run_id FROM rein_runs WHERE parent_run_id = $1 ORDER BY branch->>'name'",
    )
    .bind(root)
    .fetch_all(store.pool())
    .await
    .expect("children");
    assert_eq!(children.len(), 2);
    let mut requests = Vec::new();
    for i in 0..2 {
        let worker = format!("w-{i}");
        let (child, base, token) = claim(&store, &worker).await;
        assert!(children.contains(&child));
        let request = plan_commit(&def, child, token, &base, go(), Vec::new(), plan).expect("plan");
        assert_eq!(request.children.len(), 2, "each plans its own fan-out");
        requests.push((worker, request));
    }
    let (a, b) = (requests.remove(0), requests.remove(0));
    let (store_a, store_b) = (store.clone(), store.clone());
    let (out_a, out_b) = tokio::join!(
        async move { store_a.commit_batch(&a.0, &[a.1]).await },
        async move { store_b.commit_batch(&b.0, &[b.1]).await },
    );
    for out in [out_a.expect("commit a"), out_b.expect("commit b")] {
        assert!(matches!(out[0], CommitOutcome::Committed(_)), "{out:?}");
    }

    let (runs, _, _) = tree(&store, root).await;
    assert_eq!(runs, 5, "the root, its two children and one fan-out of two");
    let states: Vec<String> =
        sqlx::query_scalar("SELECT state FROM rein_runs WHERE run_id = ANY($1) ORDER BY state")
            .bind(&children)
            .fetch_all(store.pool())
            .await
            .expect("states");
    assert_eq!(
        states,
        ["FAILED", "FORK"],
        "one fanned out, the other was refused"
    );
    for child in &children {
        assert_replays(&store, *child).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_root_cancels_every_live_run_below_it_leased_or_not() {
    let store = store("fork_cancel").await;
    let def = fork(&store).await;
    // Depth 0 to 2: the four leaves either park (unleased) or keep their action running
    // (leased by a worker) until they are stopped.
    let root = enqueue(&store, &def, json!({ "levels": 2 })).await;
    let fleet = fleet(&store, "fork-cancel", 2);
    let leased_leaves = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM rein_runs WHERE root_run_id = $1 AND depth = 2
               AND lease_owner IS NOT NULL AND state = 'START'",
        )
        .bind(root)
        .fetch_one(store.pool())
        .await
        .expect("leased leaves")
    };
    wait_until("the tree stands: 7 runs, two leaves held", LONG, || async {
        let parked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM rein_runs WHERE (run_id = $1 OR root_run_id = $1)
               AND state IN ('FORK', 'HOLD') AND lease_owner IS NULL",
        )
        .bind(root)
        .fetch_one(store.pool())
        .await
        .expect("parked");
        parked == 5 && leased_leaves().await == 2
    })
    .await;

    store
        .send(
            root,
            "CANCEL",
            json!({ "reason": "not needed" }),
            &Sender::outside("ops"),
            INBOX_TTL_MS_DEFAULT,
        )
        .await
        .expect("cancel");
    wait_until("every run in the tree ended", LONG, || async {
        tree(&store, root).await.1 == 0
    })
    .await;
    fleet.stop().await;

    assert_eq!(
        terminal_reason(&store, root).await.as_deref(),
        Some("cancelled: not needed")
    );
    let below: Vec<(Uuid, Uuid, String, Option<String>)> = sqlx::query_as(
        "SELECT run_id, parent_run_id, state, terminal_reason FROM rein_runs
         WHERE root_run_id = $1 ORDER BY depth, run_id",
    )
    .bind(root)
    .fetch_all(store.pool())
    .await
    .expect("below");
    assert_eq!(below.len(), 6);
    for (run, parent, state, reason) in &below {
        assert_eq!(state, "CANCELLED", "run {run}");
        assert_eq!(reason.as_deref(), Some("cancelled: parent_cancelled"));
        let cancels = events_of(&store, *run, "CANCEL").await;
        assert_eq!(cancels.len(), 1, "run {run} is cancelled once");
        assert_eq!(cancels[0].payload["reason"], "parent_cancelled");
        assert_eq!(cancels[0].payload["parent_run_id"], json!(parent));
        assert_replays(&store, *run).await;
    }
    let inbox: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM rein_inbox i JOIN rein_runs r USING (run_id)
         WHERE r.root_run_id = $1 AND i.type = 'CANCEL'",
    )
    .bind(root)
    .fetch_one(store.pool())
    .await
    .expect("inbox");
    assert_eq!(inbox, 0, "every CANCEL was applied");
    assert_replays(&store, root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_sent_from_outside_that_opens_a_fan_out_is_held_to_the_bound_too() {
    // The same tree, moved by an event sent from outside instead of by an action: the send
    // commits the fan-out itself, in its own transaction.
    let text = FORK
        .replace(
            "events = [\"GO\", \"STAY\", \"JOINED\", \"JOIN_FAILED\"]",
            "events = [\"GO\", \"STAY\", \"JOINED\", \"JOIN_FAILED\"]\nexternal_events = [\"GO\"]",
        )
        .replace(
            "kind = \"active\"\ninitial = true\naction = \"fork\"",
            "kind = \"waiting\"\ninitial = true",
        );
    let def = Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("definition");
    let store = store("fork_sent").await;
    store.register_definition(&def).await.expect("register");
    let send_go = |store: Store, run: Uuid| async move {
        store
            .send(
                run,
                "GO",
                json!({}),
                &Sender::outside("ops"),
                INBOX_TTL_MS_DEFAULT,
            )
            .await
            .expect("send")
    };

    let allowed = enqueue(&store, &def, json!({})).await;
    send_go(store.clone(), allowed).await;
    assert_eq!(
        tree(&store, allowed).await.0,
        3,
        "a fan-out within the bound starts"
    );
    assert_eq!(store.run(allowed).await.expect("run").state, "FORK");

    let flat = store.clone().with_tree_bounds(TreeBounds {
        depth_max: 0,
        descendants_max: 1000,
    });
    let refused = enqueue(&flat, &def, json!({})).await;
    send_go(flat.clone(), refused).await;
    assert_eq!(tree(&flat, refused).await.0, 1, "no child started");
    let row = flat.run(refused).await.expect("run");
    assert_eq!(row.state, "FAILED");
    assert_eq!(
        row.terminal_reason.as_deref(),
        Some("fan_out_depth_exceeded")
    );
    assert_eq!(
        event_types(&flat, refused).await,
        ["GO", "JOIN_FAILED"],
        "the refusal is committed with the event that opened the fan-out"
    );
    assert_replays(&flat, refused).await;
}
