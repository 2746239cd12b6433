//! The floor `rein bench --floor` measures: each shape writes one event per run per
//! statement, in sequence, on scratch tables, and says so when a statement wrote less.

use crate::common;

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

/// The run's-life shape: each life claims the connection's runs from the claim index under a
/// new token, writes their events under it and releases them at the end, so the next life
/// can claim them again; a run another holder took, or a step's shape, is refused.
#[tokio::test]
async fn a_floor_run_s_life_claims_steps_and_ends_under_a_new_token_each_time() {
    let store = common::store("floor_life").await;
    let prefix = "rein_bench_floor_life";
    let (runs, projection) = store.floor_create(prefix, 6).await.unwrap();
    let statement = FloorShape::FencedRun.statement(prefix).unwrap();
    let mine = &runs[..3];
    type Row = (i64, Option<String>, i64, serde_json::Value);
    let rows = |ids: &[uuid::Uuid]| {
        let (pool, ids) = (store.pool().clone(), ids.to_vec());
        async move {
            sqlx::query_as::<_, Row>(sqlx::AssertSqlSafe(format!(
                "SELECT fencing_token, lease_owner, last_sequence, projection FROM {prefix}_runs
                 WHERE run_id = ANY($1) ORDER BY run_id"
            )))
            .bind(ids)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    let events = || {
        let pool = store.pool().clone();
        async move {
            sqlx::query_as::<_, (i64, i64, i64)>(sqlx::AssertSqlSafe(format!(
                "SELECT count(*), max(sequence), count(DISTINCT fencing_token) FROM {prefix}_events"
            )))
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let untouched = rows(&runs[3..]).await;
    for life in 1..=2 {
        store
            .floor_life(&statement, mine, life, &projection)
            .await
            .unwrap_or_else(|e| panic!("life {life}: {e}"));
        let per_life = rein_store::FLOOR_EVENTS_PER_LIFE;
        let ended = vec![(life + 1, None, life * per_life, projection.clone()); 3];
        assert_eq!(rows(mine).await, ended, "life {life}");
        assert_eq!(
            events().await,
            (3 * life * per_life, life * per_life, life),
            "life {life}"
        );
    }
    // The other connection's runs were neither claimed nor written.
    assert_eq!(rows(&runs[3..]).await, untouched);

    // A run another holder leased meanwhile is not claimed, and the life says so.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {prefix}_runs SET lease_owner = 'other', lease_until = clock_timestamp() + interval '1 hour'
         WHERE run_id = $1"
    )))
    .bind(mine[0])
    .execute(store.pool())
    .await
    .unwrap();
    match store.floor_life(&statement, mine, 3, &projection).await {
        Err(StoreError::Corrupt(why)) => {
            assert!(why.contains("life 3 claimed 2 of 3 runs"), "{why}")
        }
        other => panic!("a life with a run held elsewhere: {other:?}"),
    }

    // Each measure takes only its own shape's statements.
    match store.floor_step(&statement, mine, 99, &projection).await {
        Err(StoreError::Invalid(why)) => assert!(why.contains("floor_life"), "{why}"),
        other => panic!("a step of the life's shape: {other:?}"),
    }
    let step = FloorShape::FencedEvent.statement(prefix).unwrap();
    match store.floor_life(&step, mine, 4, &projection).await {
        Err(StoreError::Invalid(why)) => assert!(why.contains("not a run's life"), "{why}"),
        other => panic!("a life of a step's shape: {other:?}"),
    }
    store.floor_drop(prefix).await.unwrap();
}

/// Waits until a statement of the fenced-event shape waits on a lock in another backend.
async fn until_the_step_waits(store: &rein_store::Store, what: &str) {
    common::wait_until(what, std::time::Duration::from_secs(20), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock'
               AND query LIKE '-- rein bench floor: events under a share-locked token%'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        waiting == 1
    })
    .await;
}

/// The fenced-event shape against a claim at the same time, in both orders, as PostgreSQL
/// interleaves them: a claim that took the run's row first leaves the old holder's step
/// writing nothing once it commits its new token; a step that holds the share lock first is
/// skipped by the claim's `FOR UPDATE SKIP LOCKED` until the step has landed.
#[tokio::test]
async fn a_fenced_event_and_a_claim_at_once_never_land_a_stale_holder_s_event() {
    let store = common::store("floor_interleaved").await;
    let prefix = "rein_bench_floor_race";
    let (runs, projection) = store.floor_create(prefix, 2).await.unwrap();
    let statement = FloorShape::FencedEvent.statement(prefix).unwrap();
    // The run's first event, in a task of its own, so it may wait on a lock.
    let step_at_once = |run: uuid::Uuid| {
        let (store, statement, projection) = (store.clone(), statement.clone(), projection.clone());
        tokio::spawn(async move { store.floor_step(&statement, &[run], 1, &projection).await })
    };
    let events_of = |run: uuid::Uuid| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {prefix}_events WHERE run_id = $1"
            )))
            .bind(run)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    // The claim first: it has locked the run's row and granted token 2, not yet committed.
    let mut claim = store.pool().begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {prefix}_runs SET fencing_token = 2 WHERE run_id = $1"
    )))
    .bind(runs[0])
    .execute(&mut *claim)
    .await
    .unwrap();
    let step = step_at_once(runs[0]);
    until_the_step_waits(
        &store,
        "the old holder's step waits on the claim's row lock",
    )
    .await;
    claim.commit().await.unwrap();
    match step.await.unwrap() {
        Err(StoreError::Corrupt(why)) => {
            assert!(why.contains("wrote 0 of 1 events at sequence 1"), "{why}")
        }
        other => panic!("a step under token 1 after token 2 was granted: {other:?}"),
    }
    assert_eq!(events_of(runs[0]).await, 0, "a stale holder's event landed");

    // The step first: it holds the run's share lock while its insert waits on another
    // transaction's uncommitted entry at the same sequence, which then rolls back.
    let mut blocker = store.pool().begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {prefix}_events (run_id, sequence, event_id, type, payload, node, fencing_token, worker)
         VALUES ($1, 1, $2, 'next', '{{}}', 'step', 1, 'blocker')"
    )))
    .bind(runs[1])
    .bind(uuid::Uuid::now_v7())
    .execute(&mut *blocker)
    .await
    .unwrap();
    let step = step_at_once(runs[1]);
    until_the_step_waits(&store, "the step waits with the run's share lock held").await;
    let mut claim = store.pool().begin().await.unwrap();
    let claimed: Vec<uuid::Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT run_id FROM {prefix}_runs WHERE run_id = $1 FOR UPDATE SKIP LOCKED"
    )))
    .bind(runs[1])
    .fetch_all(&mut *claim)
    .await
    .unwrap();
    assert!(claimed.is_empty(), "a claim passed a step's share lock");
    claim.rollback().await.unwrap();
    blocker.rollback().await.unwrap();
    step.await
        .unwrap()
        .expect("the step lands once the other entry is gone");
    assert_eq!(events_of(runs[1]).await, 1);
    // Now the claim takes the row.
    let claimed: Vec<uuid::Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT run_id FROM {prefix}_runs WHERE run_id = $1 FOR UPDATE SKIP LOCKED"
    )))
    .bind(runs[1])
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(claimed, [runs[1]]);
    store.floor_drop(prefix).await.unwrap();
}
