//! Token quotas (SPEC Z4) under concurrency: every API process counts in PostgreSQL, and one
//! token's enqueues are serialised there, so racing callers cannot together exceed a quota.

use crate::common;

use std::time::Duration;

use common::wait_until;
use rein_core::Definition;
use rein_store::{EnqueueRequest, Quota, Store, StoreError, TokenBounds, TokenInfo};
use serde_json::json;

/// Enqueues racing for one token's slots, in each round.
const ASKS: usize = 8;
/// Rounds of the race, each with a token of its own.
const ROUNDS: usize = 6;
const IN_FLIGHT_MAX: u32 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_enqueues_of_one_token_never_exceed_its_in_flight_quota() {
    let url = rein_devdb::test_database("tokens_race", env!("CARGO_TARGET_TMPDIR"))
        .expect("a test database");
    // A connection for every ask, the blocker and the watcher.
    let store = Store::connect(&url, ASKS as u32 + 4).await.unwrap();
    let def = store.load_definition("research-agent", None).await.unwrap();
    for round in 0..ROUNDS {
        let bounds = TokenBounds {
            in_flight_max: Some(IN_FLIGHT_MAX),
            ..TokenBounds::default()
        };
        let (_, secret) = store
            .create_bounded_token(&format!("tenant-{round}"), &["enqueue".to_owned()], &bounds)
            .await
            .unwrap();
        let token = store.verify_token(&secret).await.unwrap().expect("live");
        assert_eq!(token.bounds, bounds);
        let created = race(&store, &token, &def).await;
        let stored: i64 =
            sqlx::query_scalar("SELECT count(*) FROM rein_runs WHERE enqueued_token = $1")
                .bind(token.token_id)
                .fetch_one(store.pool())
                .await
                .unwrap();
        assert_eq!(
            (created, stored),
            (IN_FLIGHT_MAX as usize, i64::from(IN_FLIGHT_MAX)),
            "round {round}: as many runs as the quota, the refused ones rolled back"
        );
    }
}

/// Starts [`ASKS`] enqueues for `token` held back together, releases them at once, and
/// returns how many created a run; every other one must be refused by the quota.
async fn race(store: &Store, token: &TokenInfo, def: &Definition) -> usize {
    // Hold every insert into rein_runs back until all the asks are in flight, as a slow
    // moment of the database would, so they reach the count together.
    let mut blocker = store.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE rein_runs IN SHARE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let asks: Vec<_> = (0..ASKS)
        .map(|_| {
            let (store, token, def) = (store.clone(), token.clone(), def.clone());
            tokio::spawn(async move {
                store
                    .enqueue_as(Some(&token), EnqueueRequest::new(def, json!({})))
                    .await
            })
        })
        .collect();
    wait_until(
        "every enqueue waits on a lock",
        Duration::from_secs(20),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(store.pool())
            .await
            .unwrap();
            waiting >= ASKS as i64
        },
    )
    .await;
    blocker.commit().await.unwrap();
    let mut created = 0;
    for ask in asks {
        match ask.await.unwrap() {
            Ok(done) => {
                assert!(done.created);
                created += 1;
            }
            Err(StoreError::QuotaExceeded(q)) => {
                assert_eq!((q.quota, q.limit), (Quota::InFlight, IN_FLIGHT_MAX));
            }
            Err(e) => panic!("{e}"),
        }
    }
    created
}
