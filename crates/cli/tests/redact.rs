//! `rein runs redact`: personal data forgotten from a run's log, input, projection and
//! checkpoints on the real database, with the log still append-only for everything else and
//! the run still verifying.

mod common;

use common::*;
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::{Sender, Store};
use serde_json::{Value, json};
use uuid::Uuid;

const PROFILE: &str = r#"
name = "profile"
version = 1
cancel_state = "CANCELLED"
events = ["SUBMIT", "APPROVE"]
external_events = ["SUBMIT", "APPROVE"]

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
"#;

async fn send(store: &Store, run: Uuid, event: &str, payload: Value) {
    store
        .send(run, event, payload, &Sender::Engine("test".into()), 60_000)
        .await
        .unwrap_or_else(|e| panic!("{event}: {e}"));
}

/// Everything stored about `run` as text: its row, events and checkpoints.
async fn stored_text(store: &Store, run: Uuid) -> String {
    let (row, events, checkpoints): (String, String, String) = sqlx::query_as(
        "SELECT (SELECT row_to_json(r)::text FROM rein_runs r WHERE run_id = $1),
                (SELECT coalesce(json_agg(e)::text, '') FROM rein_events_all e WHERE run_id = $1),
                (SELECT coalesce(json_agg(c)::text, '') FROM rein_checkpoints c WHERE run_id = $1)",
    )
    .bind(run)
    .fetch_one(store.pool())
    .await
    .unwrap();
    format!("{row}{events}{checkpoints}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_keys_are_forgotten_everywhere_and_the_run_still_verifies() {
    let (url, store) = fresh_store("redact").await;
    let def = Definition::parse(PROFILE, Format::Toml, &GuardRegistry::new()).unwrap();
    store.register_definition(&def).await.unwrap();
    let run = enqueue_many(
        &store,
        "profile",
        json!({"email": "ada@example.org", "amount": 5}),
        "default",
        1,
    )
    .await[0];
    send(
        &store,
        run,
        "SUBMIT",
        json!({"data": {"email": "ada.l@example.org", "phone": "+44 20 7946 0000"}}),
    )
    .await;
    send(&store, run, "APPROVE", json!({})).await;
    let before = stored_text(&store, run).await;
    assert!(before.contains("ada@example.org") && before.contains("+44 20 7946 0000"));

    // A key the definition's guard reads cannot go: the replay would decide differently.
    let out = rein(&[
        "runs",
        "redact",
        &run.to_string(),
        "--fields",
        "amount",
        "--reason",
        "asked",
        "--database-url",
        &url,
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("reads `amount`"), "{}", stderr(&out));
    assert_eq!(
        stored_text(&store, run).await,
        before,
        "a refusal writes nothing"
    );

    let out = rein(&[
        "runs",
        "redact",
        &run.to_string(),
        "--fields",
        "email,phone",
        "--reason",
        "erasure request 4711",
        "--as",
        "dpo",
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let done: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(done["events"], 1, "{done}");
    let after = stored_text(&store, run).await;
    for value in ["ada@example.org", "ada.l@example.org", "+44 20 7946 0000"] {
        assert!(!after.contains(value), "{value} is still stored");
    }
    assert!(after.contains("$redacted"));
    let marker = rein_core::redact::marker(&json!("ada.l@example.org"));
    let row = store.run(run).await.unwrap();
    assert_eq!(
        row.projection.data["email"], marker,
        "the projection holds the hash"
    );
    assert_eq!(
        store.verify_run(run).await.unwrap(),
        None,
        "the redacted run verifies"
    );
    let (by, reason): (String, String) =
        sqlx::query_as("SELECT redacted_by, reason FROM rein_redactions WHERE run_id = $1")
            .bind(run)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(
        (by.as_str(), reason.as_str()),
        ("dpo", "erasure request 4711")
    );
    // Again: nothing left to replace.
    let out = rein(&[
        "runs",
        "redact",
        &run.to_string(),
        "--fields",
        "email",
        "--reason",
        "again",
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        serde_json::from_str::<Value>(&stdout(&out)).unwrap()["events"],
        0
    );

    // The log is append-only for everything else, even for its owner.
    let refused = sqlx::query("UPDATE rein_events SET payload = '{}' WHERE run_id = $1")
        .bind(run)
        .execute(store.pool())
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("append-only"), "{refused}");
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL rein.redacting = 'on'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let refused = sqlx::query("UPDATE rein_events SET type = 'X' WHERE run_id = $1")
        .bind(run)
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("append-only"), "{refused}");
}
