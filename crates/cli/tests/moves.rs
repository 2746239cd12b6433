//! Changing runs in flight (SPEC V1, E6) on the real database: `rein definitions migrate`
//! moves parked runs of v1 to v2 with the `[migration]` v2 declares, and they finish on v2
//! and verify; `rein fork` starts a new run from a run's state at a sequence, the source
//! untouched.

use crate::common;

use common::*;
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::{SendOutcome, Sender, Store};
use serde_json::{Value, json};
use uuid::Uuid;

/// v1: an order waits in NEW for SUBMIT, then in REVIEW for APPROVE; a call may run in
/// REVIEW (ACTION_DISPATCHED, then CALLED).
const ORDER_V1: &str = r#"
name = "order"
version = 1
cancel_state = "CANCELLED"
events = ["SUBMIT", "APPROVE", "REJECT", "CALLED"]
call_results = ["CALLED"]
external_events = ["SUBMIT", "APPROVE", "REJECT"]

[[states]]
name = "NEW"
kind = "waiting"
initial = true

[[states]]
name = "REVIEW"
kind = "waiting"

[[states]]
name = "DONE"
kind = "terminal"
outcome = "succeeded"

[[states]]
name = "REJECTED"
kind = "terminal"
outcome = "failed"

[[states]]
name = "CANCELLED"
kind = "terminal"
outcome = "failed"

[[transitions]]
from = "NEW"
event = "SUBMIT"
to = "REVIEW"

[[transitions]]
from = "REVIEW"
event = "APPROVE"
to = "DONE"
guard = "run.data.amount > 0"

[[transitions]]
from = "REVIEW"
event = "REJECT"
to = "REJECTED"

[[transitions]]
from = "REVIEW"
event = "CALLED"
to = "REVIEW"
effects = ["complete_step", "append_result"]
"#;

/// v2: REVIEW is now CHECKING, the amount is in cents and a currency is required; runs still
/// in NEW stay on v1.
fn order_v2() -> String {
    ORDER_V1
        .replace("version = 1", "version = 2")
        .replace("\"REVIEW\"", "\"CHECKING\"")
        .replace(
            "guard = \"run.data.amount > 0\"",
            "guard = \"run.data.currency == 'EUR' && run.data.amount_cents > 0 && !('legacy' in run.data)\"",
        )
        + r#"
[migration]
from = 1
not_migratable = ["NEW"]
states = { REVIEW = "CHECKING" }
rename = { amount = "amount_cents" }
drop = ["legacy"]
default = { currency = "EUR" }
"#
}

fn parse(text: &str) -> Definition {
    Definition::parse(text, Format::Toml, &GuardRegistry::new()).expect("a valid definition")
}

async fn send(store: &Store, run: Uuid, event: &str, payload: Value) -> SendOutcome {
    store
        .send(run, event, payload, &Sender::Engine("test".into()), 60_000)
        .await
        .unwrap_or_else(|e| panic!("{event} to {run}: {e}"))
}

async fn order_runs(store: &Store, n: usize, submit: bool) -> Vec<Uuid> {
    let runs = enqueue_many(
        store,
        "order",
        json!({"amount": 5, "legacy": true}),
        "default",
        n,
    )
    .await;
    if submit {
        for run in &runs {
            send(store, *run, "SUBMIT", json!({})).await;
        }
    }
    runs
}

fn migrate(url: &str, extra: &[&str]) -> (Option<i32>, Value) {
    let mut args = vec![
        "definitions",
        "migrate",
        "order",
        "--from",
        "1",
        "--to",
        "2",
        "--json",
        "--database-url",
        url,
    ];
    args.extend_from_slice(extra);
    let out = rein(&args);
    let doc = serde_json::from_str(&stdout(&out))
        .unwrap_or_else(|e| panic!("JSON ({e}): {} {}", stdout(&out), stderr(&out)));
    (out.status.code(), doc)
}

/// The `run_id` a `rein ... --json` command printed.
fn run_id_of(out: &std::process::Output) -> Uuid {
    serde_json::from_str::<Value>(&stdout(out)).unwrap()["run_id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn outcome_of(doc: &Value, run: Uuid) -> &Value {
    doc["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == run.to_string())
        .unwrap_or_else(|| panic!("run {run} in {doc}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_parked_runs_move_to_v2_finish_there_and_verify() {
    let (url, store) = fresh_store("moves_migrate").await;
    store.register_definition(&parse(ORDER_V1)).await.unwrap();
    let parked = order_runs(&store, 100, true).await;
    let fresh = order_runs(&store, 3, false).await;
    store
        .register_definition(&parse(&order_v2()))
        .await
        .unwrap();

    // The dry run shows the plan and changes nothing.
    let (code, plan) = migrate(&url, &["--dry-run"]);
    assert_eq!(code, Some(0), "{plan}");
    assert_eq!(plan["would_move"], 100, "{plan}");
    assert_eq!(plan["not_migratable"], 3, "{plan}");
    assert_eq!(plan["moved"], 0);
    let one = outcome_of(&plan, parked[0]);
    assert_eq!(one["from_state"], "REVIEW");
    assert_eq!(one["to_state"], "CHECKING");
    let stays = outcome_of(&plan, fresh[0]);
    assert_eq!(stays["outcome"], "not_migratable");
    assert!(
        stays["why"]
            .as_str()
            .unwrap()
            .contains("`NEW` is declared not migratable"),
        "{stays}"
    );
    let row = store.run(parked[0]).await.unwrap();
    assert_eq!(
        (row.version, row.last_sequence),
        (1, 1),
        "a dry run writes nothing"
    );

    // A run a worker holds is not moved under it.
    let held = parked[99];
    sqlx::query(
        "UPDATE rein_runs SET lease_owner = 'w-test', lease_until = clock_timestamp() + interval '1 hour',
                              fencing_token = fencing_token + 1
         WHERE run_id = $1",
    )
    .bind(held)
    .execute(store.pool())
    .await
    .unwrap();

    let (code, done) = migrate(&url, &["--reason", "CHECKING replaces REVIEW"]);
    assert_eq!(done["moved"], 99, "{done}");
    assert_eq!(done["busy"], 1, "{done}");
    assert_eq!(done["not_migratable"], 3, "{done}");
    assert_eq!(code, Some(2), "runs left behind exit non-zero");
    assert_eq!(outcome_of(&done, held)["outcome"], "busy");

    // Once the worker let go, the same command moves it.
    sqlx::query("UPDATE rein_runs SET lease_owner = NULL, lease_until = NULL WHERE run_id = $1")
        .bind(held)
        .execute(store.pool())
        .await
        .unwrap();
    let (code, again) = migrate(&url, &[]);
    assert_eq!(code, Some(0), "{again}");
    assert_eq!(
        (again["moved"].as_u64(), again["not_migratable"].as_u64()),
        (Some(1), Some(3))
    );

    for run in &parked {
        let row = store.run(*run).await.unwrap();
        assert_eq!((row.version, row.state.as_str()), (2, "CHECKING"), "{run}");
        assert_eq!(row.projection.data["amount_cents"], 5);
        assert_eq!(row.projection.data["currency"], "EUR");
        assert!(row.projection.data.get("legacy").is_none());
    }
    let history = store.history(parked[0]).await.unwrap();
    let moved = history.last().unwrap();
    assert_eq!(moved.kind, "DEFINITION_MIGRATED");
    assert_eq!(moved.payload["from_version"], 1);
    assert_eq!(moved.payload["to_version"], 2);
    assert_eq!(moved.payload["reason"], "CHECKING replaces REVIEW");

    // They finish on v2: its guard holds only for the migrated data.
    for run in &parked {
        send(&store, *run, "APPROVE", json!({})).await;
        let row = store.run(*run).await.unwrap();
        assert_eq!(row.state, "DONE", "{run}");
    }
    // Every log replays: the events before the move on v1, the rest on v2.
    for run in parked.iter().chain(&fresh) {
        assert_eq!(store.verify_run(*run).await.unwrap(), None, "{run}");
    }
    let out = rein(&[
        "runs",
        "verify",
        &parked[0].to_string(),
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{} {}", stdout(&out), stderr(&out));
    for run in &fresh {
        assert_eq!(store.run(*run).await.unwrap().version, 1);
    }
    // Nothing is left to move, and an unmoved v1 run still takes v1's events.
    send(&store, fresh[0], "SUBMIT", json!({})).await;
    assert_eq!(store.run(fresh[0]).await.unwrap().state, "REVIEW");

    // A what-if of a migrated run replays its events up to the move on v1 and compares
    // from there: on v2 itself the same, and a v3 that wants more than 10 cents refuses the
    // approval.
    let replay = |definition: &str| {
        let out = rein(&[
            "replay",
            &parked[0].to_string(),
            "--definition",
            definition,
            "--json",
            "--database-url",
            &url,
        ]);
        serde_json::from_str::<Value>(&stdout(&out))
            .unwrap_or_else(|e| panic!("JSON ({e}): {} {}", stdout(&out), stderr(&out)))
    };
    let same = replay("order@2");
    assert_eq!(same["verdict"], "same", "{same}");
    assert_eq!(same["compared_after"]["sequence"], moved.sequence, "{same}");
    let v3 = order_v2()
        .split("[migration]")
        .next()
        .unwrap()
        .replace("version = 2", "version = 3")
        .replace("amount_cents > 0", "amount_cents > 10");
    store.register_definition(&parse(&v3)).await.unwrap();
    let diverged = replay("order@3");
    assert_eq!(diverged["verdict"], "refused", "{diverged}");
    assert_eq!(diverged["divergence"]["event"], "APPROVE", "{diverged}");
    assert_eq!(diverged["recorded_definition"]["version"], 2, "{diverged}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_refuses_what_it_cannot_do_and_says_why() {
    let (url, store) = fresh_store("moves_refuse").await;
    store.register_definition(&parse(ORDER_V1)).await.unwrap();
    let runs = order_runs(&store, 2, true).await;
    // No v2 yet.
    let out = rein(&[
        "definitions",
        "migrate",
        "order",
        "--from",
        "1",
        "--to",
        "2",
        "--database-url",
        &url,
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("version 2"), "{}", stderr(&out));
    // v2 without a migration: nothing may be assumed compatible.
    let bare = ORDER_V1.replace("version = 1", "version = 2");
    store.register_definition(&parse(&bare)).await.unwrap();
    let (code, doc) = migrate(&url, &[]);
    assert_eq!(code, Some(0), "{doc}");
    assert_eq!(doc["not_migratable"], 2, "{doc}");
    assert!(
        outcome_of(&doc, runs[0])["why"]
            .as_str()
            .unwrap()
            .contains("no migration from order@v1 to v2"),
        "{doc}"
    );
    // A run between a call and its result waits for the result.
    send(
        &store,
        runs[1],
        "ACTION_DISPATCHED",
        json!({"action_id": "a1", "call_id": "c1", "node": "n", "step": 1, "idempotency_key": "k1"}),
    )
    .await;
    let mut migrations = rein_core::checkpoint::Migrations::new();
    migrations.register("order", 1, Ok);
    let body = rein_ops::moves::MigrateBody {
        from: Some(1),
        to: Some(2),
        ..Default::default()
    };
    let done = rein_ops::moves::migrate(
        &store,
        "order",
        &body,
        "operator:test",
        &migrations,
        &|_| {},
    )
    .await
    .unwrap();
    // A closure registered by the embedding program goes through the same command.
    assert_eq!(done.moved, 1, "{done:?}");
    let busy = done.runs.iter().find(|r| r.run_id == runs[1]).unwrap();
    assert_eq!(busy.outcome, "busy");
    assert!(
        busy.why
            .as_deref()
            .unwrap()
            .contains("call c1 is in flight"),
        "{busy:?}"
    );
    assert_eq!(store.verify_run(runs[0]).await.unwrap(), None);
    // Bad input is refused before anything is read.
    for (args, says) in [
        (vec!["--from", "2", "--to", "1"], "newer version"),
        (vec!["--from", "1", "--to", "1"], "same version"),
        (
            vec!["--from", "1", "--to", "2", "--wait-s", "99999"],
            "wait_s",
        ),
    ] {
        let mut all = vec!["definitions", "migrate", "order", "--database-url", &url];
        all.extend(args);
        let out = rein(&all);
        assert!(!out.status.success());
        assert!(stderr(&out).contains(says), "{}", stderr(&out));
    }
    // A v2 whose migration maps to a state it lacks does not register.
    let broken = order_v2().replace("REVIEW = \"CHECKING\"", "REVIEW = \"NOWHERE\"");
    let err = Definition::parse(&broken, Format::Toml, &GuardRegistry::new()).unwrap_err();
    assert!(err.to_string().contains("migration.states.REVIEW"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_starts_from_the_sources_state_and_leaves_the_source_alone() {
    let (url, store) = fresh_store("moves_fork").await;
    store.register_definition(&parse(ORDER_V1)).await.unwrap();
    store
        .register_definition(&parse(&order_v2()))
        .await
        .unwrap();
    let source = order_runs(&store, 1, true).await[0];
    // 2: a call dispatched, 3: its result (step 1 done), 4: rejected.
    send(
        &store,
        source,
        "ACTION_DISPATCHED",
        json!({"action_id": "a1", "call_id": "c1", "node": "score", "step": 1, "idempotency_key": "key-1"}),
    )
    .await;
    sqlx::query(
        "INSERT INTO rein_actions (run_id, action_id, node, step, idempotency_key, call_id, status)
         VALUES ($1, 'a1', 'score', 1, 'key-1', 'c1', 'SUCCEEDED')
         ON CONFLICT (run_id, action_id) DO NOTHING",
    )
    .bind(source)
    .execute(store.pool())
    .await
    .unwrap();
    send(
        &store,
        source,
        "CALLED",
        json!({"call_id": "c1", "result": {"score": 3}}),
    )
    .await;
    send(&store, source, "REJECT", json!({"reason": "too small"})).await;
    let before = store.run(source).await.unwrap();
    assert_eq!(
        (before.state.as_str(), before.last_sequence),
        ("REJECTED", 4)
    );

    // At an open call the fork is refused: its side effect's fate is unknown there.
    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        "2",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("call c1 is in flight"),
        "{}",
        stderr(&out)
    );
    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        "9",
        "--database-url",
        &url,
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("1..=4"), "{}", stderr(&out));

    // After step 1, with a larger amount: the fork is approved where the source was not.
    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        "3",
        "--input-patch",
        r#"{"amount": 70, "note": "second look"}"#,
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let forked: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let fork: Uuid = forked["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(forked["state"], "REVIEW");
    assert_eq!(forked["at_sequence"], 3);
    let row = store.run(fork).await.unwrap();
    assert_eq!(row.parent_run_id, Some(source));
    assert_eq!(
        row.last_sequence, 1,
        "a snapshot event, not a copy of history"
    );
    assert_eq!(row.projection.steps_completed, 1);
    assert_eq!(row.projection.results.len(), 1);
    assert_eq!(row.projection.data["amount"], 70);
    let input = store.run_input(fork).await.unwrap();
    assert_eq!(
        (&input["amount"], &input["note"]),
        (&json!(70), &json!("second look")),
        "the fork's input is stored as patched: {input}"
    );
    let first = &store.history(fork).await.unwrap()[0];
    assert_eq!(first.kind, "RUN_FORKED");
    assert_eq!(first.payload["source_run_id"], source.to_string());
    assert_eq!(first.payload["at_sequence"], 3);
    // The ledger of the steps made comes along, with their idempotency keys.
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM rein_actions WHERE run_id = $1")
            .bind(fork)
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(keys, vec!["key-1".to_owned()]);
    send(&store, fork, "APPROVE", json!({})).await;
    assert_eq!(store.run(fork).await.unwrap().state, "DONE");
    assert_eq!(store.verify_run(fork).await.unwrap(), None);
    let after = store.run(source).await.unwrap();
    assert_eq!(
        (
            after.state.as_str(),
            after.last_sequence,
            after.projection.clone()
        ),
        (
            before.state.as_str(),
            before.last_sequence,
            before.projection.clone()
        ),
        "the source is untouched"
    );

    // A fork may continue on v2, moved by v2's migration: REVIEW becomes CHECKING.
    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        "1",
        "--definition",
        "order@2",
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let on_v2: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        (on_v2["version"].as_u64(), on_v2["state"].as_str()),
        (Some(2), Some("CHECKING"))
    );
    let v2_run: Uuid = on_v2["run_id"].as_str().unwrap().parse().unwrap();
    send(&store, v2_run, "APPROVE", json!({})).await;
    assert_eq!(store.run(v2_run).await.unwrap().state, "DONE");
    assert_eq!(store.verify_run(v2_run).await.unwrap(), None);
    // Nobody may send the operations' own events.
    let refused = store
        .send(
            source,
            "RUN_FORKED",
            json!({}),
            &Sender::Outside {
                name: "api:someone".into(),
                approver: None,
            },
            60_000,
        )
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("rein fork"), "{refused}");
}

/// A fork at a failed call (its step not done, due to be tried again) writes that call's
/// ledger row in its own first commit; the rows inherited from the source skip it instead of
/// failing the whole fork on the duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_at_a_failed_call_keeps_the_forks_own_ledger_row() {
    let (url, store) = fresh_store("moves_fork_failed").await;
    let def = ORDER_V1
        .replace("name = \"order\"", "name = \"order-retry\"")
        .replace(
            "events = [\"SUBMIT\", \"APPROVE\", \"REJECT\", \"CALLED\"]",
            "events = [\"SUBMIT\", \"APPROVE\", \"REJECT\", \"CALLED\", \"CALL_FAILED\"]",
        )
        .replace(
            "call_results = [\"CALLED\"]",
            "call_results = [\"CALLED\", \"CALL_FAILED\"]",
        )
        + r#"
[[transitions]]
from = "REVIEW"
event = "CALL_FAILED"
to = "REVIEW"
"#;
    store.register_definition(&parse(&def)).await.unwrap();
    let source = enqueue_many(&store, "order-retry", json!({"amount": 5}), "default", 1).await[0];
    send(&store, source, "SUBMIT", json!({})).await;
    send(
        &store,
        source,
        "ACTION_DISPATCHED",
        json!({"action_id": "a1", "call_id": "c1", "node": "score", "step": 1, "idempotency_key": "key-1"}),
    )
    .await;
    send(
        &store,
        source,
        "CALL_FAILED",
        json!({"call_id": "c1", "error": {"class": "transient", "kind": "network", "message": "reset"}}),
    )
    .await;
    let before = store.run(source).await.unwrap();
    assert_eq!(before.last_sequence, 3);
    let status: String = sqlx::query_scalar(
        "SELECT status FROM rein_actions WHERE run_id = $1 AND action_id = 'a1'",
    )
    .bind(source)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(
        status, "FAILED",
        "the source's ledger holds the failed call"
    );

    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        "3",
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let forked: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let fork: Uuid = forked["run_id"].as_str().unwrap().parse().unwrap();
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT idempotency_key, status FROM rein_actions WHERE run_id = $1 ORDER BY action_id",
    )
    .bind(fork)
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(rows, vec![("key-1".to_owned(), "FAILED".to_owned())]);
    assert_eq!(store.verify_run(fork).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_migrates_with_the_admin_scope_and_forks_with_operate() {
    let api = Api::start("moves_api", &[]).await;
    api.store
        .register_definition(&parse(ORDER_V1))
        .await
        .unwrap();
    let runs = order_runs(&api.store, 3, true).await;
    api.store
        .register_definition(&parse(&order_v2()))
        .await
        .unwrap();
    let operate = api.token("op", &["read", "operate"]);
    let admin = api.token("boss", &["admin"]);
    let body = json!({"from": 1, "to": 2, "dry_run": true});
    let (status, doc) = api
        .post_json("/v1/definitions/order/migrate", &operate, &body)
        .await;
    assert_eq!(status, 403, "{doc}");
    let (status, doc) = api
        .post_json(
            "/v1/definitions/order/migrate",
            &admin,
            &json!({"from": 1, "to": 2, "bogus": 1}),
        )
        .await;
    assert_eq!(status, 422, "{doc}");
    let (status, doc) = api
        .post_json("/v1/definitions/order/migrate", &admin, &body)
        .await;
    assert_eq!(
        (status.as_u16(), doc["would_move"].as_u64()),
        (200, Some(3)),
        "{doc}"
    );
    let (status, doc) = api
        .post_json(
            "/v1/definitions/order/migrate",
            &admin,
            &json!({"from": 1, "to": 2, "runs": [runs[0]]}),
        )
        .await;
    assert_eq!(
        (status.as_u16(), doc["moved"].as_u64()),
        (200, Some(1)),
        "{doc}"
    );
    let history = api.store.history(runs[0]).await.unwrap();
    assert_eq!(history.last().unwrap().payload["by"], "operator:boss");
    // A migration to the version it starts from is a conflict, and the document says so.
    let (status, doc) = api
        .post_json(
            "/v1/definitions/order/migrate",
            &admin,
            &json!({"from": 2, "to": 2}),
        )
        .await;
    assert_eq!(status, 409, "{doc}");
    let (_, openapi) = api.get_json("/openapi.json", &admin).await;
    assert!(
        openapi["paths"]["/v1/definitions/{name}/migrate"]["post"]["responses"]["409"].is_object(),
        "migrate's 409 is documented"
    );

    let (status, doc) = api
        .post_json(
            &format!("/v1/runs/{}/fork", runs[1]),
            &operate,
            &json!({"at": 1, "reason": "retry with the new rule"}),
        )
        .await;
    assert_eq!(status, 201, "{doc}");
    assert_eq!(doc["forked_from"], runs[1].to_string());
    let fork: Uuid = doc["run_id"].as_str().unwrap().parse().unwrap();
    let first = &api.store.history(fork).await.unwrap()[0];
    assert_eq!(first.kind, "RUN_FORKED");
    assert_eq!(
        (&first.payload["reason"], &first.payload["by"]),
        (&json!("retry with the new rule"), &json!("operator:op")),
        "the fork's reason is recorded"
    );
    let (status, doc) = api
        .post_json(
            &format!("/v1/runs/{}/fork", runs[1]),
            &operate,
            &json!({"at": 1, "reason": "a\u{0}b"}),
        )
        .await;
    assert_eq!(status, 422, "{doc}");
    assert_eq!(doc["error"]["details"]["field"], "reason", "{doc}");
    // A sequence past the log: the run is there, its log is shorter (not a 404).
    let (status, doc) = api
        .post_json(
            &format!("/v1/runs/{}/fork", runs[1]),
            &operate,
            &json!({"at": 999}),
        )
        .await;
    assert_eq!(status, 409, "{doc}");
    assert_eq!(doc["error"]["details"]["field"], "at", "{doc}");
    let (status, doc) = api
        .post_json(
            &format!("/v1/runs/{}/fork", runs[1]),
            &operate,
            &json!({"at": 0}),
        )
        .await;
    assert_eq!(status, 422, "{doc}");
    let reader = api.token("reader", &["read"]);
    let (status, _) = api
        .post_json(
            &format!("/v1/runs/{}/fork", runs[1]),
            &reader,
            &json!({"at": 1}),
        )
        .await;
    assert_eq!(status, 403);
}

/// The "retry this step with a better prompt" workflow: a support agent gave up after looking
/// the order up; its fork after the lookup, on a version with another prompt, asks the model
/// again with the source's conversation so far and ends differently. The model is a stand-in
/// (an external party); worker and scheduler are real processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_with_a_changed_prompt_asks_the_model_again_and_ends_differently() {
    let (url, store) = fresh_store("moves_prompt").await;
    let v1 = rein_core::builtin::SUPPORT_AGENT.replacen(
        "name = \"support-agent\"",
        "name = \"support-fork\"",
        1,
    );
    store.register_definition(&parse(&v1)).await.unwrap();
    let prompt_v2 =
        "You are a patient support agent. Never give up on a customer before refunding.";
    let v2 = v1.replacen("version = 1", "version = 2", 1).replacen(
        "system = \"You are a support agent.",
        &format!("system = \"{prompt_v2}"),
        1,
    ) + "\n[migration]\nfrom = 1\n";
    // The first version's model looks the order up, then gives up; later calls follow the
    // stand-in's own policy (refund, then finish).
    let standin = rein_lab::model_standin::StandIn::with_script(&json!([
        {"tool_call": {"name": "lookup_order", "arguments": {"order_id": "B2"}}},
        {"tool_call": {"name": "GIVE_UP", "arguments": {"payload": {"reason": "not sure"}}}}
    ]))
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(standin.clone().serve(listener));
    let mut fleet = Fleet::new(&url, "moves_prompt");
    let binding = format!("OPENAI_API_KEY={base_url}");
    let env = [
        ("REIN_MODEL_URL", base_url.as_str()),
        ("REIN_MODEL_KEYS", binding.as_str()),
        ("OPENAI_API_KEY", "sk-test-very-secret-key-0123456789"),
    ];
    fleet.spawn_env(
        "w1",
        &[
            "worker",
            "--lease-ttl-ms",
            "1000",
            "--poll-interval-ms",
            "20",
        ],
        &env,
    );
    fleet.spawn("s1", &["scheduler", "--tick-ms", "50"]);
    let source = enqueue_many(
        &store,
        "support-fork",
        json!({"order_id": "B2", "amount": 40}),
        "default",
        1,
    )
    .await[0];
    let ended = |run: Uuid| {
        let store = store.clone();
        async move { store.run(run).await.is_ok_and(|r| r.status == "terminal") }
    };
    wait_for(
        "the source to end",
        std::time::Duration::from_secs(90),
        std::time::Duration::from_millis(20),
        || ended(source),
    )
    .await;
    let before = store.run(source).await.unwrap();
    assert_eq!(before.state, "FAILED", "{:?}", before.terminal_reason);
    let history = store.history(source).await.unwrap();
    let looked_up = history
        .iter()
        .find(|e| e.kind == "TOOL_SUCCEEDED")
        .expect("the lookup's result")
        .sequence;
    store.register_definition(&parse(&v2)).await.unwrap();
    let asked_before = standin.requests().len();

    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        &looked_up.to_string(),
        "--definition",
        "support-fork@2",
        "--reason",
        "retry with the patient prompt",
        "--input-patch",
        r#"{"amount": 7}"#,
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let fork: Uuid = run_id_of(&out);
    wait_for(
        "the fork to end",
        std::time::Duration::from_secs(90),
        std::time::Duration::from_millis(20),
        || ended(fork),
    )
    .await;
    let row = store.run(fork).await.unwrap();
    assert_eq!(row.state, "DONE", "{:?}", row.terminal_reason);
    // The model was asked again, with the new prompt and the source's lookup in the
    // conversation: the fork did not look the order up a second time.
    let requests = standin.requests();
    let first = &requests[asked_before];
    let system = first["messages"][0]["content"].as_str().unwrap();
    assert!(system.starts_with(prompt_v2), "{system}");
    let said = first["messages"].to_string();
    assert!(said.contains("lookup_order"), "{said}");
    // Its task message is the input as patched, not the source's.
    let task = first["messages"][1]["content"].as_str().unwrap();
    assert_eq!(first["messages"][1]["role"], "user", "{said}");
    assert!(
        task.contains(r#""amount":7"#) && !task.contains(r#""amount":40"#),
        "{task}"
    );
    let fork_log = store.history(fork).await.unwrap();
    assert_eq!(fork_log[0].kind, "RUN_FORKED");
    assert!(
        !fork_log
            .iter()
            .any(|e| e.kind == "ACTION_DISPATCHED" && e.payload["tool"] == "lookup_order"),
        "the lookup is inherited, not repeated"
    );
    assert!(
        fork_log
            .iter()
            .any(|e| e.kind == "ACTION_DISPATCHED" && e.payload["tool"] == "refund")
    );
    assert_eq!(store.verify_run(fork).await.unwrap(), None);
    let after = store.run(source).await.unwrap();
    assert_eq!(
        (after.state, after.last_sequence),
        (before.state, before.last_sequence),
        "the source is untouched"
    );
}

/// Rolling upgrades: a run whose log holds engine events newer than a binary knows is not
/// claimed by it; moved and forked runs are marked as needing the protocol that reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_worker_claims_a_run_whose_log_needs_a_newer_protocol() {
    let (url, store) = fresh_store("moves_protocol").await;
    let runs = enqueue_many(&store, "lifecycle", json!({}), "default", 2).await;
    let protocol_of = |run: Uuid| {
        let store = store.clone();
        async move {
            sqlx::query_scalar::<_, i16>("SELECT protocol FROM rein_runs WHERE run_id = $1")
                .bind(run)
                .fetch_one(store.pool())
                .await
                .unwrap()
        }
    };
    assert_eq!(protocol_of(runs[0]).await, 1, "a new run needs nothing new");
    sqlx::query("UPDATE rein_runs SET protocol = $2 WHERE run_id = $1")
        .bind(runs[0])
        .bind(rein_store::PROTOCOL_VERSION + 1)
        .execute(store.pool())
        .await
        .unwrap();
    let claimed = store
        .claim("w-old", 10, 60_000, &["default".to_owned()])
        .await
        .unwrap();
    let ids: Vec<Uuid> = claimed.iter().map(|c| c.run_id).collect();
    assert_eq!(ids, vec![runs[1]], "only the run this binary can read");
    sqlx::query("UPDATE rein_runs SET protocol = 1 WHERE run_id = $1")
        .bind(runs[0])
        .execute(store.pool())
        .await
        .unwrap();
    let claimed = store
        .claim("w-old", 10, 60_000, &["default".to_owned()])
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);

    // A fork and a moved run need the protocol of their first or newest event.
    store.register_definition(&parse(ORDER_V1)).await.unwrap();
    store
        .register_definition(&parse(&order_v2()))
        .await
        .unwrap();
    let source = order_runs(&store, 1, true).await[0];
    // A worker of a release before protocols (its heartbeat says none) is at work: nothing
    // that writes protocol 2 may go ahead, and a dry run names it.
    sqlx::query(
        "INSERT INTO rein_workers (worker_id, role, info)
         VALUES ('w-old-release', 'worker', '{\"ttl_ms\": 60000}')",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        "1",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("w-old-release"), "{}", stderr(&out));
    let out = rein(&[
        "definitions",
        "migrate",
        "order",
        "--from",
        "1",
        "--to",
        "2",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("upgrade them first"),
        "{}",
        stderr(&out)
    );
    let (_, plan) = migrate(&url, &["--dry-run"]);
    assert_eq!(plan["old_workers"], json!(["w-old-release"]), "{plan}");
    let workers = rein(&["workers", "--database-url", &url]);
    assert!(
        stdout(&workers).contains("protocol"),
        "{}",
        stdout(&workers)
    );
    sqlx::query("DELETE FROM rein_workers WHERE worker_id = 'w-old-release'")
        .execute(store.pool())
        .await
        .unwrap();
    // A member of this release reports the protocol it reads.
    store
        .heartbeat("w-new", "worker", json!({"ttl_ms": 60000}))
        .await
        .unwrap();
    let members = store.members().await.unwrap();
    assert_eq!(members[0].info["protocol"], rein_store::PROTOCOL_VERSION);
    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        "1",
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let fork: Uuid = run_id_of(&out);
    assert_eq!(protocol_of(fork).await, rein_store::PROTOCOL_MOVES);
    assert_eq!(protocol_of(source).await, 1);
    let (code, _) = migrate(&url, &["--runs", &source.to_string()]);
    assert_eq!(code, Some(0));
    assert_eq!(protocol_of(source).await, rein_store::PROTOCOL_MOVES);
}
