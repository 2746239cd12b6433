//! Optional Redis acceleration (SPEC K1): wake-ups that cut an idle worker's poll short.
//! Redis is never a source of truth: a lost, late or duplicated wake-up costs at most one
//! poll interval or one extra claim query, and every (re)connect is treated as "wake-ups may
//! have been lost: rescan now".

pub mod limits;
pub mod stream;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Publishes of one process are coalesced over this window: a burst of enqueues on a queue
/// becomes at most one PUBLISH per window.
pub const COALESCE: Duration = Duration::from_millis(5);
/// How long a connection attempt may take before Redis counts as unreachable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest pause between reconnection attempts.
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// Metric: wake-ups published (after coalescing).
pub const WAKEUPS_PUBLISHED: &str = "rein_wakeups_published_total";
/// Metric: wake-ups received by a worker (before coalescing into claim rounds).
pub const WAKEUPS_RECEIVED: &str = "rein_wakeups_received_total";

/// The help text of the metrics this crate records.
pub fn describe_metrics() {
    metrics::describe_counter!(WAKEUPS_PUBLISHED, "Wake-ups published, after coalescing");
    metrics::describe_counter!(WAKEUPS_RECEIVED, "Wake-ups received by this worker");
    limits::describe();
    stream::describe();
}

/// Registers at 0 the wake-ups a process publishes (every role whose store publishes them).
pub fn register_metrics() {
    metrics::counter!(WAKEUPS_PUBLISHED).increment(0);
}

/// Where Redis is and how Rein's channels and keys are named.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub url: String,
    /// Prefix of every channel and key (lets deployments or tests share one Redis).
    pub prefix: String,
}

impl RedisConfig {
    pub fn new(url: impl Into<String>) -> RedisConfig {
        RedisConfig {
            url: url.into(),
            prefix: "rein".to_owned(),
        }
    }

    pub fn with_prefix(mut self, prefix: impl Into<String>) -> RedisConfig {
        self.prefix = prefix.into();
        self
    }

    /// The channel for wake-ups of one queue.
    pub fn queue_channel(&self, queue: &str) -> String {
        format!("{}:wake:q:{queue}", self.prefix)
    }

    /// The channel for work whose queue the writer does not know (a sent event, a fired
    /// timer, a released lease): every worker listens to it.
    pub fn any_channel(&self) -> String {
        format!("{}:wake:any", self.prefix)
    }

    /// An entry of fleet-wide limit `key`: `tat` (a rate's next arrival), `ticket` (its last
    /// deferral) or `slots` (its concurrency slots). The braces keep a key's entries in one
    /// slot of a Redis cluster.
    pub fn limit_key(&self, key: &str, part: &str) -> String {
        format!("{}:limit:{{{key}}}:{part}", self.prefix)
    }

    fn client(&self) -> Result<redis::Client, redis::RedisError> {
        redis::Client::open(self.url.as_str())
    }
}

/// Whether Redis answered last time, so that each change is logged once (WARN when it
/// becomes unreachable, INFO when it is back), not once per failed call.
#[derive(Debug, Default)]
pub struct Health {
    /// 0 unknown, 1 up, 2 down.
    state: AtomicU8,
}

impl Health {
    pub fn up(&self, what: &str) {
        if self.state.swap(1, Ordering::AcqRel) == 2 {
            info!(what, "Redis reachable again");
        }
    }

    pub fn down(&self, what: &str, error: &dyn std::fmt::Display) {
        if self.state.swap(2, Ordering::AcqRel) != 2 {
            warn!(what, error = %error, "Redis unreachable; carrying on without it (polling, local limits)");
        }
    }

    pub fn is_up(&self) -> bool {
        self.state.load(Ordering::Acquire) == 1
    }
}

/// Publishes wake-ups after commits, coalesced per channel.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<PublisherInner>,
}

struct PublisherInner {
    config: RedisConfig,
    pending: Mutex<HashSet<String>>,
    flag: Notify,
    health: Health,
}

impl Publisher {
    /// Starts the background task that drains the pending channels; it stops with `stop`.
    pub fn start(config: RedisConfig, stop: CancellationToken) -> Publisher {
        let inner = Arc::new(PublisherInner {
            config,
            pending: Mutex::new(HashSet::new()),
            flag: Notify::new(),
            health: Health::default(),
        });
        tokio::spawn(publish_loop(inner.clone(), stop));
        Publisher { inner }
    }

    /// Work became runnable on `queue` (or on some queue, when `None`). Cheap and never
    /// blocks: the wake-up is published by the background task within [`COALESCE`].
    pub fn wake(&self, queue: Option<&str>) {
        let channel = match queue {
            Some(q) => self.inner.config.queue_channel(q),
            None => self.inner.config.any_channel(),
        };
        let fresh = match self.inner.pending.lock() {
            Ok(mut p) => p.insert(channel),
            Err(_) => return,
        };
        if fresh {
            self.inner.flag.notify_one();
        }
    }

    pub fn health(&self) -> &Health {
        &self.inner.health
    }
}

async fn connect_manager(
    config: &RedisConfig,
) -> Result<redis::aio::ConnectionManager, redis::RedisError> {
    let client = config.client()?;
    within(
        CONNECT_TIMEOUT,
        "connection timed out",
        redis::aio::ConnectionManager::new(client),
    )
    .await
}

/// `call`, failing as an I/O error saying `what` when it takes longer than `limit`: a Redis
/// that stopped answering counts as unreachable.
pub(crate) async fn within<T>(
    limit: Duration,
    what: &'static str,
    call: impl std::future::Future<Output = Result<T, redis::RedisError>>,
) -> Result<T, redis::RedisError> {
    match tokio::time::timeout(limit, call).await {
        Ok(r) => r,
        Err(_) => Err(redis::RedisError::from((redis::ErrorKind::Io, what))),
    }
}

async fn publish_loop(inner: Arc<PublisherInner>, stop: CancellationToken) {
    let mut conn: Option<redis::aio::ConnectionManager> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = inner.flag.notified() => {}
        }
        // Let the burst gather, then publish each channel once.
        tokio::time::sleep(COALESCE).await;
        let channels: Vec<String> = match inner.pending.lock() {
            Ok(mut p) => p.drain().collect(),
            Err(_) => return,
        };
        // A wake-up that arrived during the last window was published with it but left a
        // permit behind: nothing to send, and an empty pipeline would read as Redis failing.
        if channels.is_empty() {
            continue;
        }
        // A connection that failed is replaced once at once: the first publish after Redis
        // returns must not be the one that discovers the old connection is dead.
        for _attempt in 0..2 {
            if conn.is_none() {
                match connect_manager(&inner.config).await {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        // Dropped: workers still poll, and their resubscription rescans.
                        inner.health.down("publish", &e);
                        break;
                    }
                }
            }
            let Some(c) = conn.as_mut() else { break };
            let mut pipe = redis::pipe();
            for ch in &channels {
                pipe.cmd("PUBLISH").arg(ch).arg(1).ignore();
            }
            match within(CONNECT_TIMEOUT, "timed out", pipe.query_async::<()>(c)).await {
                Ok(()) => {
                    inner.health.up("publish");
                    metrics::counter!(WAKEUPS_PUBLISHED).increment(channels.len() as u64);
                    break;
                }
                Err(e) => inner.health.down("publish", &e),
            }
            conn = None;
        }
    }
}

/// Listens for wake-ups of `queues` (and of unknown queues) on a dedicated pub/sub
/// connection and signals `wake` for each: [`Notify`] keeps a single permit, so any number of
/// wake-ups that arrive while the worker is busy become one extra claim round. Every
/// (re)subscription signals too, since wake-ups published while disconnected are lost.
pub fn subscribe(
    config: RedisConfig,
    queues: &[String],
    wake: Arc<Notify>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let mut channels: Vec<String> = queues.iter().map(|q| config.queue_channel(q)).collect();
    channels.push(config.any_channel());
    tokio::spawn(async move {
        let health = Health::default();
        let mut pause = Duration::from_millis(100);
        while !stop.is_cancelled() {
            match listen(&config, &channels, &wake, &health, &stop).await {
                Ok(()) => pause = Duration::from_millis(100),
                Err(e) => health.down("subscribe", &e),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(RECONNECT_MAX);
        }
    })
}

async fn listen(
    config: &RedisConfig,
    channels: &[String],
    wake: &Notify,
    health: &Health,
    stop: &CancellationToken,
) -> Result<(), redis::RedisError> {
    let mut pubsub = connect_pubsub(config).await?;
    for ch in channels {
        pubsub.subscribe(ch).await?;
    }
    health.up("subscribe");
    // Anything published while we were not subscribed is lost: rescan now.
    wake.notify_one();
    let mut messages = pubsub.on_message();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            msg = messages.next() => match msg {
                Some(_) => {
                    metrics::counter!(WAKEUPS_RECEIVED).increment(1);
                    wake.notify_one();
                }
                None => {
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "subscription connection closed",
                    )));
                }
            }
        }
    }
}

async fn connect_pubsub(config: &RedisConfig) -> Result<redis::aio::PubSub, redis::RedisError> {
    let client = config.client()?;
    within(
        CONNECT_TIMEOUT,
        "connection timed out",
        client.get_async_pubsub(),
    )
    .await
}

/// How many connections are subscribed to `channel` right now (`PUBSUB NUMSUB`): whether a
/// fleet is listening for wake-ups, as Redis itself sees it.
pub async fn subscribers(config: &RedisConfig, channel: &str) -> Result<u64, redis::RedisError> {
    let mut conn = connect_manager(config).await?;
    let mut cmd = redis::cmd("PUBSUB");
    cmd.arg("NUMSUB").arg(channel);
    let (_, n) = within(
        CONNECT_TIMEOUT,
        "PUBSUB NUMSUB timed out",
        cmd.query_async::<(String, u64)>(&mut conn),
    )
    .await?;
    Ok(n)
}

/// Counts the messages published on one channel while it lives (subscribed before
/// [`Tap::start`] returns): what a fleet really published, as a listener sees it.
pub struct Tap {
    count: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl Tap {
    pub async fn start(config: &RedisConfig, channel: &str) -> Result<Tap, redis::RedisError> {
        let mut pubsub = connect_pubsub(config).await?;
        pubsub.subscribe(channel).await?;
        let count = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let (counted, stopped) = (count.clone(), stop.clone());
        tokio::spawn(async move {
            let mut messages = pubsub.into_on_message();
            loop {
                tokio::select! {
                    _ = stopped.cancelled() => return,
                    msg = messages.next() => match msg {
                        Some(_) => {
                            counted.fetch_add(1, Ordering::Relaxed);
                        }
                        None => return,
                    }
                }
            }
        });
        Ok(Tap { count, stop })
    }

    /// Messages seen so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
