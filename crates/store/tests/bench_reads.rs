//! What `rein bench` asks of the database while it measures: the runs of its own point,
//! read by a range of run ids, never every run the database holds. On a database with a
//! million finished runs, a progress poll that counted the point's queue by scanning
//! `rein_runs` took ~0.9 s of the database's CPU every 3 s, inside the measured window.

use crate::common;

use std::time::{Duration, SystemTime};

use rein_store::{EnqueueRequest, first_run_id_at};

const QUEUE: &str = "bench-reads";
const HISTORY: usize = 2_000;

fn requests(n: usize) -> Vec<EnqueueRequest> {
    let def = rein_core::builtin::load("chain4")
        .expect("a built-in chain4")
        .expect("it compiles");
    (0..n)
        .map(|_| {
            let mut r = EnqueueRequest::new(def.clone(), serde_json::json!({}));
            r.queue = QUEUE.to_owned();
            r
        })
        .collect()
}

/// Rows of `rein_runs` read so far, by sequential scans and fetched through indexes; then
/// what [`common::statistics_once`] waits for: rows inserted, or scans made.
const READ_ONCE_INSERTED: &str = "SELECT seq_tup_read + COALESCE(idx_tup_fetch, 0), n_tup_ins
     FROM pg_stat_user_tables WHERE relname = 'rein_runs'";
const READ_ONCE_SCANNED: &str =
    "SELECT seq_tup_read + COALESCE(idx_tup_fetch, 0), seq_scan + COALESCE(idx_scan, 0)
     FROM pg_stat_user_tables WHERE relname = 'rein_runs'";
/// Scans of `rein_runs` so far, once its inserted rows show.
const SCANS_ONCE_INSERTED: &str = "SELECT seq_scan + COALESCE(idx_scan, 0), n_tup_ins
     FROM pg_stat_user_tables WHERE relname = 'rein_runs'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_point_s_progress_and_figures_read_its_own_runs_not_the_history() {
    let store = common::store("bench_reads").await;
    // History on the same queue, made before the point began.
    for chunk in requests(HISTORY).chunks(500) {
        common::enqueue_all(&store, chunk).await;
    }
    sqlx::query("ANALYZE rein_runs")
        .execute(store.pool())
        .await
        .expect("analyze");
    tokio::time::sleep(Duration::from_millis(5)).await;
    let since = first_run_id_at(SystemTime::now());
    tokio::time::sleep(Duration::from_millis(5)).await;
    let point = common::enqueue_all(&store, &requests(2)).await;
    assert!(
        point.iter().all(|id| *id >= since),
        "the point's runs are in its range"
    );

    let inserted = (HISTORY + 2) as i64;
    let before = common::statistics_once(&store, READ_ONCE_INSERTED, inserted).await;
    let scans = common::statistics_once(&store, SCANS_ONCE_INSERTED, inserted).await;
    let progress = store.queue_progress(QUEUE, since).await.expect("progress");
    assert_eq!(progress, (2, 0), "the point's 2 runs, none finished");
    let after = common::statistics_once(&store, READ_ONCE_SCANNED, scans + 1).await;
    assert!(
        after - before < 100,
        "the progress poll read {} rows of rein_runs for a point of 2 runs over {HISTORY} \
         runs of history",
        after - before
    );

    let stats = store.queue_stats(QUEUE, since).await.expect("figures");
    assert_eq!((stats.runs, stats.runs_terminal), (2, 0));
    // The bound is what keeps history out: from the first id, the queue holds every run.
    let all = store
        .queue_progress(QUEUE, uuid::Uuid::nil())
        .await
        .expect("progress over the whole queue");
    assert_eq!(all, ((HISTORY + 2) as i64, 0));
}
