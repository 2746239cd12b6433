//! Replays of a run's log that a request asks for (a what-if, a verify, a fork's): they run
//! on a few threads of their own, never on the threads that serve requests, at most
//! `--max-replays` at once and `--max-replays-per-token` for one token; one more is answered
//! 503 (the server's cap) or 429 (the token's), with `Retry-After`. A replay whose request
//! goes away (the client closed its connection) is told to stop and stops within
//! [`rein_core::replay_cost::CANCEL_CHECK_EVERY`] events.
//!
//! The threads run at a lower priority (nice [`NICE`]) than the rest of the process: the
//! threads serving requests, `/healthz` among them, take a core from a replay whenever they
//! have work, however many replays run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};

use rein_core::replay_cost::Cancel;
use rein_ops::{Code, Error};
use uuid::Uuid;

/// Replays at once unless `--max-replays` says otherwise: one a core on a 2-core machine.
/// A replay is pure CPU work on a log held in memory, so more replays than cores would not
/// finish more of them a second, only slice the same cores thinner while each holds its log.
pub const REPLAYS_MAX_DEFAULT: usize = 2;
/// Replays one token may have running at once unless `--max-replays-per-token` says
/// otherwise: one, so that no single token holds every thread.
pub const REPLAYS_PER_TOKEN_MAX_DEFAULT: usize = 1;
/// What `Retry-After` says when a replay is refused for a cap: a replay within
/// [`rein_core::replay_cost::REPLAY_COST_MAX`] takes a few seconds.
pub const RETRY_AFTER_S: u64 = 2;
/// How much lower the replay threads' priority is than the rest of the process (Linux).
pub const NICE: i32 = 10;

/// Metric: replays running now.
pub const REPLAYS_RUNNING: &str = "rein_api_replays_running";
/// Metric: replays refused, by `reason` (`token_cap`, `server_cap`, `over_budget`).
pub const REPLAYS_REFUSED: &str = "rein_api_replays_refused_total";
/// Metric: replays stopped because their request went away.
pub const REPLAYS_CANCELLED: &str = "rein_api_replays_cancelled_total";

/// The help text of the replay metrics, and their series at 0.
pub fn register_metrics() {
    metrics::describe_gauge!(
        REPLAYS_RUNNING,
        "Log replays (what-if, verify, fork) running now on the replay threads"
    );
    metrics::describe_counter!(
        REPLAYS_REFUSED,
        "Log replays refused: token_cap (429), server_cap (503), over_budget (422)"
    );
    metrics::describe_counter!(
        REPLAYS_CANCELLED,
        "Log replays stopped early because their request went away"
    );
    metrics::gauge!(REPLAYS_RUNNING).set(0.0);
    for reason in ["token_cap", "server_cap", "over_budget"] {
        metrics::counter!(REPLAYS_REFUSED, "reason" => reason).increment(0);
    }
    metrics::counter!(REPLAYS_CANCELLED).increment(0);
}

/// Counts `refused` when it is a replay refused over its budget (the budget checks also
/// answer a missing run or version, which were never replays).
pub fn refused_over_budget(refused: &rein_ops::Error) {
    let limit = refused.details.as_ref().and_then(|d| d.get("limit"));
    if limit.and_then(serde_json::Value::as_u64) == Some(rein_core::replay_cost::REPLAY_COST_MAX) {
        metrics::counter!(REPLAYS_REFUSED, "reason" => "over_budget").increment(1);
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// What the replays have done since the server started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Holding a slot now: waiting for a thread, replaying, or winding down after a cancel.
    pub running: usize,
    /// Handed to the replay threads: waiting there for a thread or a hold, or begun.
    pub queued: u64,
    /// Begun on a replay thread.
    pub started: u64,
    /// Told to stop because their request went away before the answer.
    pub abandoned: u64,
    /// Ended early because they were told to stop.
    pub cancelled: u64,
    /// Events the replays went through, all together.
    pub events: u64,
}

/// The replay threads, their caps and what they did.
pub struct Replays {
    max: usize,
    per_token_max: usize,
    /// Slots held, by token.
    held: Mutex<HashMap<Uuid, usize>>,
    jobs: Mutex<mpsc::Sender<Job>>,
    queued: AtomicU64,
    started: AtomicU64,
    abandoned: AtomicU64,
    cancelled: AtomicU64,
    events: AtomicU64,
    /// While above zero, replays wait before they begin ([`Replays::hold`]).
    holds: Arc<(Mutex<usize>, Condvar)>,
}

/// A replay's place under the caps, given back when the replay has ended on its thread (not
/// when its request goes away: a replay winding down still counts).
pub struct Slot {
    replays: Arc<Replays>,
    token: Uuid,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.replays.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.token) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.token);
            }
        }
        metrics::gauge!(REPLAYS_RUNNING).decrement(1.0);
    }
}

/// Sets a replay's flag when the request waiting for it goes away before its answer.
struct CancelOnDrop(Option<Cancel>, Arc<Replays>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = self.0.take() {
            cancel.cancel();
            self.1.abandoned.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Keeps replays from beginning while it lives ([`Replays::hold`]).
pub struct Hold(Arc<(Mutex<usize>, Condvar)>);

impl Drop for Hold {
    fn drop(&mut self) {
        let (count, changed) = &*self.0;
        *count.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        changed.notify_all();
    }
}

impl Replays {
    /// `max` threads (at least one), taking at most `per_token_max` replays of one token at
    /// once. The threads end when the last handle on this is dropped.
    pub fn new(max: usize, per_token_max: usize) -> Arc<Replays> {
        let max = max.max(1);
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..max {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("rein-replay-{i}"))
                .spawn(move || {
                    lower_priority();
                    loop {
                        let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start a replay thread");
            }
        }
        Arc::new(Replays {
            max,
            per_token_max: per_token_max.max(1),
            held: Mutex::new(HashMap::new()),
            jobs: Mutex::new(tx),
            queued: AtomicU64::new(0),
            started: AtomicU64::new(0),
            abandoned: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            events: AtomicU64::new(0),
            holds: Arc::new((Mutex::new(0), Condvar::new())),
        })
    }

    /// A slot for a replay of `token`'s: 429 when the token has its `--max-replays-per-token`
    /// running, 503 when the server has its `--max-replays`, both with `Retry-After`.
    pub fn slot(self: &Arc<Self>, token: Uuid) -> Result<Slot, Error> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let mine = held.get(&token).copied().unwrap_or(0);
        let all: usize = held.values().sum();
        let refused = if mine >= self.per_token_max {
            Some((
                "token_cap",
                Code::TooManyRequests,
                format!(
                    "this token has {mine} replay(s) of a run's log running (what-if, verify, \
                     fork), its most at once (--max-replays-per-token {}); retry when one has \
                     ended",
                    self.per_token_max
                ),
            ))
        } else if all >= self.max {
            Some((
                "server_cap",
                Code::Unavailable,
                format!(
                    "this server is running its {} replays of runs' logs (what-if, verify, \
                     fork) at once (--max-replays); retry shortly",
                    self.max
                ),
            ))
        } else {
            None
        };
        if let Some((reason, code, message)) = refused {
            metrics::counter!(REPLAYS_REFUSED, "reason" => reason).increment(1);
            let mut e = Error::new(code, message);
            e.retry_after_s = Some(RETRY_AFTER_S);
            return Err(e);
        }
        *held.entry(token).or_default() += 1;
        metrics::gauge!(REPLAYS_RUNNING).increment(1.0);
        Ok(Slot {
            replays: self.clone(),
            token,
        })
    }

    /// Runs `work` on a replay thread under `slot` and waits for its answer. When this future
    /// is dropped first (its request went away), `work`'s [`Cancel`] is set; the slot is given
    /// back when `work` has returned.
    pub async fn run<T: Send + 'static>(
        &self,
        slot: Slot,
        work: impl FnOnce(&Cancel) -> T + Send + 'static,
    ) -> Result<T, Error> {
        let cancel = Cancel::new();
        let replays = slot.replays.clone();
        let mut on_drop = CancelOnDrop(Some(cancel.clone()), replays.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let holds = self.holds.clone();
        let job: Job = Box::new(move || {
            {
                let (count, changed) = &*holds;
                let mut count = count.lock().unwrap_or_else(|e| e.into_inner());
                while *count > 0 {
                    count = changed.wait(count).unwrap_or_else(|e| e.into_inner());
                }
            }
            replays.started.fetch_add(1, Ordering::Relaxed);
            let out = work(&cancel);
            replays.events.fetch_add(cancel.events(), Ordering::Relaxed);
            if cancel.is_cancelled() {
                replays.cancelled.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(REPLAYS_CANCELLED).increment(1);
            }
            // Given back before the answer, so the caller may ask again at once.
            drop(slot);
            let _ = tx.send(out);
        });
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job);
        if sent.is_err() {
            return Err(Error::new(
                Code::Internal,
                "the replay threads have stopped; see the server log".to_owned(),
            ));
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        let out = rx.await.map_err(|_| {
            Error::new(
                Code::Internal,
                "a replay ended without an answer; see the server log".to_owned(),
            )
        })?;
        on_drop.0 = None;
        Ok(out)
    }

    /// Keeps replays from beginning until the answer is dropped: they take their slot and
    /// wait. For tests and measurements that need a replay held at its start.
    pub fn hold(&self) -> Hold {
        *self.holds.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Hold(self.holds.clone())
    }

    pub fn stats(&self) -> ReplayStats {
        ReplayStats {
            running: self
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .sum(),
            queued: self.queued.load(Ordering::Relaxed),
            started: self.started.load(Ordering::Relaxed),
            abandoned: self.abandoned.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            events: self.events.load(Ordering::Relaxed),
        }
    }
}

/// Lowers the calling thread's priority by [`NICE`] (Linux: a thread's own nice value).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: setpriority reads only its arguments; `who` 0 is the calling thread on Linux.
        let done = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, NICE) };
        if done != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(),
                "cannot lower the replay thread's priority; replays compete with requests");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn caps_answer_429_for_the_token_and_503_for_the_server_with_retry_after() {
        let replays = Replays::new(2, 1);
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let held = replays.slot(a).expect("a first slot");
        let e = replays.slot(a).err().expect("the token's cap");
        assert_eq!(
            (e.code, e.retry_after_s),
            (Code::TooManyRequests, Some(RETRY_AFTER_S))
        );
        let _other = replays.slot(b).expect("another token's slot");
        let e = replays.slot(c).err().expect("the server's cap");
        assert_eq!(
            (e.code, e.retry_after_s),
            (Code::Unavailable, Some(RETRY_AFTER_S))
        );
        assert!(e.message.contains("--max-replays"), "{}", e.message);
        drop(held);
        assert!(replays.slot(c).is_ok(), "a slot given back is taken again");
    }

    #[tokio::test]
    async fn a_replay_whose_request_goes_away_is_told_to_stop_and_gives_its_slot_back() {
        let replays = Replays::new(1, 1);
        let hold = replays.hold();
        let slot = replays.slot(Uuid::nil()).unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        // A replay of a log without end: only its flag stops it.
        let mut request = Box::pin(replays.run(slot, move |cancel| {
            let seen = cancel.until_cancelled(0u64..).count();
            let _ = done_tx.send(seen);
        }));
        assert!(futures_util::FutureExt::now_or_never(&mut request).is_none());
        // The request goes away while the replay waits to begin.
        drop(request);
        drop(hold);
        let seen = done_rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the replay stopped");
        assert!(
            seen < rein_core::replay_cost::CANCEL_CHECK_EVERY as usize,
            "{seen}"
        );
        for _ in 0..6_000 {
            if replays.stats().running == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let stats = replays.stats();
        assert_eq!(
            (
                stats.running,
                stats.started,
                stats.abandoned,
                stats.cancelled
            ),
            (0, 1, 1, 1),
            "{stats:?}"
        );
    }
}
