//! Live deltas of a run (a model's tokens as they stream in), carried from the worker that
//! produces them to whoever watches the run, over Redis pub/sub: one channel per run.
//!
//! Best effort by design: a delta is never the record. What a run did is its committed
//! events; a watcher that misses deltas (no Redis, a slow subscriber, a reconnect) still
//! sees every committed event, from the database. So a publish never waits on Redis: a full
//! buffer or an unreachable server drops the delta and counts it.

use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{CONNECT_TIMEOUT, Health, RedisConfig, connect_manager, connect_pubsub, within};

/// Metric: deltas published to a run's channel.
pub const DELTAS_PUBLISHED: &str = "rein_stream_deltas_published_total";
/// Metric: deltas dropped (buffer full, or Redis unreachable).
pub const DELTAS_DROPPED: &str = "rein_stream_deltas_dropped_total";

/// Deltas waiting to be published, per process; beyond it a delta is dropped, not queued.
const BUFFER: usize = 1024;

/// The help text of the stream metrics.
pub fn describe() {
    metrics::describe_counter!(DELTAS_PUBLISHED, "Live deltas published to a run's channel");
    metrics::describe_counter!(
        DELTAS_DROPPED,
        "Live deltas dropped because the buffer was full or Redis was unreachable"
    );
}

impl RedisConfig {
    /// The channel that carries the live deltas of run `run_id`.
    pub fn run_stream_channel(&self, run_id: &str) -> String {
        format!("{}:stream:run:{run_id}", self.prefix)
    }
}

/// Where an action sends its live deltas. [`Deltas::none`] (no Redis) drops them; that is
/// not an error: watchers then see the committed events only.
#[derive(Clone, Debug, Default)]
pub struct Deltas {
    tx: Option<mpsc::Sender<(String, String)>>,
}

impl Deltas {
    /// Deltas that go nowhere.
    pub fn none() -> Deltas {
        Deltas { tx: None }
    }

    /// Starts the task that publishes deltas; it stops with `stop`.
    pub fn start(config: RedisConfig, stop: CancellationToken) -> Deltas {
        metrics::counter!(DELTAS_PUBLISHED).increment(0);
        metrics::counter!(DELTAS_DROPPED).increment(0);
        let (tx, rx) = mpsc::channel(BUFFER);
        tokio::spawn(publish_loop(config, rx, stop));
        Deltas { tx: Some(tx) }
    }

    /// Whether deltas go anywhere (Redis is configured).
    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// Queues `json` (one JSON document, e.g. `{"type":"delta","content":"Hel"}`) for run
    /// `run_id`'s channel. Never waits: a full buffer drops it.
    pub fn send(&self, run_id: &str, json: String) {
        let Some(tx) = &self.tx else { return };
        if tx.try_send((run_id.to_owned(), json)).is_err() {
            metrics::counter!(DELTAS_DROPPED).increment(1);
        }
    }
}

async fn publish_loop(
    config: RedisConfig,
    mut rx: mpsc::Receiver<(String, String)>,
    stop: CancellationToken,
) {
    let health = Health::default();
    let mut conn: Option<redis::aio::ConnectionManager> = None;
    loop {
        let (run_id, json) = tokio::select! {
            _ = stop.cancelled() => return,
            next = rx.recv() => match next {
                Some(m) => m,
                None => return,
            },
        };
        if conn.is_none() {
            match connect_manager(&config).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    health.down("stream publish", &e);
                    metrics::counter!(DELTAS_DROPPED).increment(1);
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let mut cmd = redis::cmd("PUBLISH");
        cmd.arg(config.run_stream_channel(&run_id)).arg(json);
        match within(CONNECT_TIMEOUT, "timed out", cmd.query_async::<i64>(c)).await {
            Ok(_) => {
                health.up("stream publish");
                metrics::counter!(DELTAS_PUBLISHED).increment(1);
            }
            Err(e) => {
                health.down("stream publish", &e);
                metrics::counter!(DELTAS_DROPPED).increment(1);
                conn = None;
            }
        }
    }
}

/// Subscribes to run `run_id`'s deltas. The stream yields each published JSON document and
/// ends when the connection drops; the subscription is live when this returns, so a caller
/// that subscribes first and then reads the committed events misses nothing of either.
pub async fn subscribe_run(
    config: &RedisConfig,
    run_id: &str,
) -> Result<impl Stream<Item = String> + Send + 'static + use<>, redis::RedisError> {
    let mut pubsub = connect_pubsub(config).await?;
    within(
        CONNECT_TIMEOUT,
        "SUBSCRIBE timed out",
        pubsub.subscribe(config.run_stream_channel(run_id)),
    )
    .await?;
    Ok(pubsub
        .into_on_message()
        .filter_map(|msg| async move { msg.get_payload::<String>().ok() }))
}
