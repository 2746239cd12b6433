//! The floor `rein bench --floor` measures: each shape writes one event per run per
//! statement, in sequence, on scratch tables, and says so when a statement wrote less.

mod common;

use rein_store::{FloorShape, StoreError};

#[tokio::test]
async fn each_floor_shape_writes_every_run_s_next_event_and_refuses_a_step_out_of_sequence() {
    let store = common::store("floor_shapes").await;
    let prefix = "rein_bench_floor_test";
    for shape in FloorShape::ALL {
        let (runs, projection) = store.floor_create(prefix, 6).await.unwrap();
        let statement = shape.statement(prefix).unwrap();
        assert_eq!(runs.len(), 6);
        let mut sorted = runs.clone();
        sorted.sort();
        assert_eq!(runs, sorted, "in id order");
        for sequence in 1..=3 {
            store
                .floor_step(&statement, &runs[..3], sequence, &projection)
                .await
                .unwrap_or_else(|e| panic!("{shape:?} at {sequence}: {e}"));
        }
        let events: Vec<(i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*), max(sequence) FROM {prefix}_events"
        )))
        .fetch_all(store.pool())
        .await
        .unwrap();
        assert_eq!(events, [(9, 3)], "{shape:?}");
        // A step that repeats a sequence: the log's key refuses it, or the run row's
        // sequence (the fenced event: the log's key, without an error) does and nothing is
        // written, which the floor reports.
        let again = store
            .floor_step(&statement, &runs[..3], 3, &projection)
            .await;
        match (shape, again) {
            (FloorShape::EventsOnly, Err(StoreError::Db(e))) => {
                assert!(e.to_string().contains("duplicate key"), "{e}")
            }
            (
                FloorShape::RunRow | FloorShape::Projection | FloorShape::FencedEvent,
                Err(StoreError::Corrupt(why)),
            ) => {
                assert!(why.contains("wrote 0 of 3 events at sequence 3"), "{why}")
            }
            (shape, other) => panic!("{shape:?} repeated a sequence: {other:?}"),
        }
        if shape == FloorShape::Projection {
            let written: Vec<serde_json::Value> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT projection FROM {prefix}_runs WHERE last_sequence = 3"
            )))
            .fetch_all(store.pool())
            .await
            .unwrap();
            assert_eq!(written, vec![projection.clone(); 3]);
        }
        // A run whose token moved on (a claim granted a new one): every shape that checks
        // the token writes nothing for it, and the others' events still land.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {prefix}_runs SET fencing_token = 2 WHERE run_id = $1"
        )))
        .bind(runs[0])
        .execute(store.pool())
        .await
        .unwrap();
        let stale = store
            .floor_step(&statement, &runs[..3], 4, &projection)
            .await;
        match (shape, stale) {
            (FloorShape::EventsOnly, Ok(())) => {}
            (
                FloorShape::RunRow | FloorShape::Projection | FloorShape::FencedEvent,
                Err(StoreError::Corrupt(why)),
            ) => {
                assert!(why.contains("wrote 2 of 3 events at sequence 4"), "{why}")
            }
            (shape, other) => panic!("{shape:?} stepped under a stale token: {other:?}"),
        }
        let stale_events: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {prefix}_events WHERE run_id = $1 AND sequence = 4"
        )))
        .bind(runs[0])
        .fetch_one(store.pool())
        .await
        .unwrap();
        let checks_token = shape != FloorShape::EventsOnly;
        assert_eq!(stale_events, i64::from(!checks_token), "{shape:?}");
    }
    store.floor_drop(prefix).await.unwrap();
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'rein_bench_floor_test%'",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(left, 0);
}
