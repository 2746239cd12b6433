//! A definition stored before guard expressions had an evaluation budget (SPEC M5, Z1):
//! it keeps loading, and its guard over the budget is refused when evaluated instead of
//! holding the database transaction and the caller's thread for as long as it runs.

use crate::common;

use common::{assert_replays, store};
use rein_core::definition::DefinitionSpec;
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::{EnqueueRequest, INBOX_TTL_MS_DEFAULT, SendOutcome, Sender};
use serde_json::json;

/// 100^3 = 10^6 iterations over literal lists, guarding start -go-> done.
fn definition() -> serde_json::Value {
    let l = format!(
        "[{}]",
        (0..100)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    json!({
        "name": "costly-guard",
        "version": 1,
        "cancel_state": "cancelled",
        "events": ["go"],
        "external_events": ["go"],
        "states": [
            { "name": "start", "kind": "active", "initial": true },
            { "name": "done", "kind": "terminal" },
            { "name": "cancelled", "kind": "terminal" },
        ],
        "transitions": [{
            "from": "start",
            "event": "go",
            "to": "done",
            "guard": format!("{l}.all(a, {l}.all(b, {l}.all(c, true)))"),
        }],
    })
}

#[tokio::test]
async fn a_stored_definition_over_the_guard_budget_loads_and_its_guard_is_refused() {
    let store = store("guard_budget").await;
    let body = definition();
    let err = Definition::parse(&body.to_string(), Format::Json, &GuardRegistry::new())
        .expect_err("registering it now is refused");
    assert!(err.to_string().contains("evaluation steps"), "{err}");

    // As an earlier version stored it.
    let spec: DefinitionSpec = serde_json::from_value(body).unwrap();
    let stored = Definition::from_stored_spec(spec, &GuardRegistry::new()).unwrap();
    store.register_definition(&stored).await.unwrap();
    let def = store
        .load_definition("costly-guard", Some(1))
        .await
        .expect("a stored definition keeps loading");

    let run = store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .unwrap()
        .run_id;
    let outcome = store
        .send(
            run,
            "go",
            json!({}),
            &Sender::outside("api:alice"),
            INBOX_TTL_MS_DEFAULT,
        )
        .await
        .unwrap();
    // The guard is not evaluated: the event cannot be taken now and waits in the inbox.
    assert!(
        matches!(outcome, SendOutcome::Queued { .. }),
        "the guard must not run: {outcome:?}"
    );
    assert_eq!(store.run(run).await.unwrap().state, "start");
    assert_replays(&store, run).await;
}
