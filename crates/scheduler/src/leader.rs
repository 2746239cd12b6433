//! Leader election among schedulers (SPEC S3), for efficiency only: the leader does the
//! scanning (expired leases, due timers, inboxes) and the others only ask, every tick,
//! whether the lease is free. Correctness never depends on it: every firing is a fenced
//! commit, so a leader that does not know yet that it was replaced (a stopped process, a
//! slow tick) only loses races.
//!
//! The lease is a row (`rein_leader_leases`) with holder, fencing token and expiry by the
//! database clock rather than a session advisory lock: it can be read by anyone (`rein
//! workers` shows the leader), it does not tie leadership to one pooled connection staying
//! open, and a stopped leader loses it after the TTL instead of when TCP gives up.

use rein_store::{LeaderLease, Store};
use tracing::{info, warn};

/// The name of the schedulers' lease.
pub const LEADER_LEASE: &str = "scheduler";
/// How long a leader's lease lasts without renewal: a killed leader is replaced after at
/// most this plus a tick.
pub const LEADER_TTL_MS_DEFAULT: u64 = 5_000;

/// One scheduler's view of the leader lease.
pub struct Leadership {
    holder: String,
    ttl_ms: u64,
    held: Option<LeaderLease>,
}

impl Leadership {
    pub fn new(holder: &str, ttl_ms: u64) -> Leadership {
        Leadership {
            holder: holder.to_owned(),
            ttl_ms,
            held: None,
        }
    }

    /// Whether this scheduler led at its last [`Leadership::check`].
    pub fn leads(&self) -> bool {
        self.held.is_some()
    }

    /// Takes the lease if it is free or expired, renews it if held; false when another
    /// scheduler holds a live lease or the database cannot be asked (then nobody is trusted
    /// to lead from here, which costs only time).
    pub async fn check(&mut self, store: &Store) -> bool {
        match store
            .acquire_leader(LEADER_LEASE, &self.holder, self.ttl_ms)
            .await
        {
            Ok(Some(lease)) => {
                let new_term = self
                    .held
                    .as_ref()
                    .is_none_or(|h| h.fencing_token != lease.fencing_token);
                if new_term {
                    info!(scheduler = %self.holder, token = lease.fencing_token, "leading the schedulers");
                }
                self.held = Some(lease);
                true
            }
            Ok(None) => {
                if self.held.take().is_some() {
                    warn!(scheduler = %self.holder, "stepped down: another scheduler took the leader lease");
                }
                false
            }
            Err(e) => {
                if self.held.take().is_some() {
                    warn!(scheduler = %self.holder, error = %e, "stepped down: cannot renew the leader lease");
                }
                false
            }
        }
    }

    /// Gives the lease up on the way out, so another scheduler leads at its next tick.
    pub async fn release(&mut self, store: &Store) {
        if self.held.take().is_some() {
            let _ = store.release_leader(LEADER_LEASE, &self.holder).await;
        }
    }
}
