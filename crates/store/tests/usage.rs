//! `rein_run_usage`: what each run's model calls used, kept by the insert of each
//! MODEL_REPLIED event, added up once for logs recorded before it existed, and checked by
//! `verify` against the log.

use crate::common;

use rein_core::builtin;
use rein_store::{MIGRATOR, Sender, Store};
use serde_json::{Value, json};
use uuid::Uuid;

async fn reply(store: &Store, run: Uuid, usage: Value) {
    let sent = store
        .send(
            run,
            "MODEL_REPLIED",
            json!({ "requested_model": "gpt-4o-mini", "usage": usage }),
            &Sender::Engine("test-worker".into()),
            60_000,
        )
        .await
        .expect("send MODEL_REPLIED");
    assert!(
        matches!(sent, rein_store::SendOutcome::Applied { .. }),
        "{sent:?}"
    );
}

/// A database migrated up to just before the table: its logs are added up by the migration,
/// then new replies by their inserts, and `verify` holds the two to the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_recorded_before_are_added_up_once_and_new_replies_by_their_insert() {
    let url = rein_devdb::test_database("usage_backfill", env!("CARGO_TARGET_TMPDIR"))
        .expect("a test database");
    let store = Store::connect_without_migrating(&url, 4).await.unwrap();
    let before = MIGRATOR
        .iter()
        .map(|m| m.version)
        .filter(|v| *v < 20261212000100)
        .max()
        .unwrap();
    MIGRATOR.run_to(before, store.pool()).await.unwrap();
    let def = builtin::load("support-agent").unwrap().unwrap();
    store.register_definition(&def).await.unwrap();
    let old = common::enqueue(&store, &def, json!({"order_id": "A1", "amount": 5})).await;
    reply(
        &store,
        old,
        json!({"input_tokens": 100, "output_tokens": 20, "cost": 0.5}),
    )
    .await;
    reply(&store, old, json!({"input_tokens": 7, "output_tokens": 3})).await;

    store.migrate().await.unwrap();
    let sums = store.run_usage(old).await.unwrap();
    assert_eq!(sums.len(), 1, "{sums:?}");
    assert_eq!(
        (sums[0].calls, sums[0].input_tokens, sums[0].output_tokens),
        (2, 107, 23)
    );
    assert_eq!(sums[0].cost, Some(0.5));
    assert_eq!(
        sums[0].reasoning_tokens, None,
        "never recorded: null, not 0"
    );
    assert_eq!(store.verify_run(old).await.unwrap(), None);

    // After the migration, each insert adds its reply, malformed numbers left out.
    reply(
        &store,
        old,
        json!({"input_tokens": 1, "output_tokens": "2", "reasoning_tokens": 9, "cost": -1}),
    )
    .await;
    let sums = store.run_usage(old).await.unwrap();
    assert_eq!(
        (sums[0].calls, sums[0].input_tokens, sums[0].output_tokens),
        (3, 108, 23)
    );
    assert_eq!(sums[0].reasoning_tokens, Some(9));
    assert_eq!(sums[0].cost, Some(0.5));
    assert_eq!(store.verify_run(old).await.unwrap(), None);
    // A huge count neither fails the commit nor overflows the sum.
    reply(
        &store,
        old,
        json!({"input_tokens": i64::MAX, "output_tokens": u64::MAX}),
    )
    .await;
    reply(&store, old, json!({"input_tokens": i64::MAX})).await;
    let sums = store.run_usage(old).await.unwrap();
    assert_eq!(sums[0].input_tokens, i64::MAX as u64);
    assert_eq!(sums[0].output_tokens, 23);
    assert_eq!(store.verify_run(old).await.unwrap(), None);

    // The checker catches a row that disagrees with the log, and a row with no calls.
    sqlx::query("UPDATE rein_run_usage SET calls = calls - 1 WHERE run_id = $1")
        .bind(old)
        .execute(store.pool())
        .await
        .unwrap();
    let problem = store.verify_run(old).await.unwrap().expect("caught");
    assert!(problem.contains("usage table"), "{problem}");
    let quiet = common::enqueue(&store, &def, json!({"order_id": "A2", "amount": 5})).await;
    assert_eq!(store.verify_run(quiet).await.unwrap(), None);
    sqlx::query(
        "INSERT INTO rein_run_usage (run_id, model, calls, input_tokens, output_tokens)
         VALUES ($1, 'ghost', 1, 1, 1)",
    )
    .bind(quiet)
    .execute(store.pool())
    .await
    .unwrap();
    let problem = store.verify_run(quiet).await.unwrap().expect("caught");
    assert!(problem.contains("ghost"), "{problem}");
}
