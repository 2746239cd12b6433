//! The scheduler role (SPEC S1–S3): fires timers of parked runs and wall-time budgets,
//! recovers runs whose lease expired, and applies or expires inbox entries of unleased runs
//! (which is also how a branch's result reaches its waiting parent).
//!
//! Every firing is an ordinary guarded, sequenced commit that takes the fencing token only
//! when no live lease is held and only if the token is still the one it read; so any number
//! of schedulers may run at once, and firing twice is harmless (the loser is refused).

mod leader;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rein_core::retry::{Failure, LostAttempt, kind as retry_kind};
use rein_core::{ActionStatus, Definition, EngineEvent, Event, apply};
use rein_store::{
    CommitOutcome, CommitPlan, NewEvent, RunRow, Store, StoreError, Writer, counters, plan_commit,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use leader::{LEADER_LEASE, LEADER_TTL_MS_DEFAULT, Leadership};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub scheduler_id: String,
    pub tick_ms: u64,
    /// Most runs handled per kind of work per tick.
    pub batch: i64,
    /// Leader lease TTL (SPEC S3): only the leader scans; a follower takes over within
    /// this plus a tick of the leader's death.
    pub leader_ttl_ms: u64,
}

impl SchedulerConfig {
    pub fn new(id: impl Into<String>) -> SchedulerConfig {
        SchedulerConfig {
            scheduler_id: id.into(),
            tick_ms: 200,
            batch: 200,
            leader_ttl_ms: LEADER_TTL_MS_DEFAULT,
        }
    }

    /// The lease must outlive a few ticks, or leadership would flap between renewals.
    pub fn validate(&self) -> Result<(), String> {
        let min = (3 * self.tick_ms).max(rein_store::LEADER_TTL_MS_MIN);
        if !(min..=rein_store::LEADER_TTL_MS_MAX).contains(&self.leader_ttl_ms) {
            return Err(format!(
                "--leader-ttl-ms {} must be in {min}..={} (at least 3 ticks of {} ms)",
                self.leader_ttl_ms,
                rein_store::LEADER_TTL_MS_MAX,
                self.tick_ms
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
pub struct SchedulerStats {
    pub timers_fired: AtomicU64,
    pub leases_recovered: AtomicU64,
    pub inbox_applied: AtomicU64,
    /// Another scheduler (or a sender) got there first: harmless.
    pub lost_races: AtomicU64,
}

pub struct Scheduler {
    store: Store,
    config: SchedulerConfig,
    definitions: HashMap<(String, u32), Definition>,
    leadership: Leadership,
    pub stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(store: Store, config: SchedulerConfig) -> Scheduler {
        let leadership = Leadership::new(&config.scheduler_id, config.leader_ttl_ms);
        Scheduler {
            store,
            config,
            definitions: HashMap::new(),
            leadership,
            stats: SchedulerStats::default(),
        }
    }

    pub async fn run(&mut self, shutdown: CancellationToken) -> Result<(), StoreError> {
        info!(scheduler = %self.config.scheduler_id, "scheduler started");
        let mut ticks = 0u64;
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            if ticks.is_multiple_of(10) {
                let _ = self
                    .store
                    .heartbeat(
                        &self.config.scheduler_id,
                        "scheduler",
                        // Silent for three heartbeat periods (10 ticks each): gone.
                        json!({ "ttl_ms": self.config.tick_ms * 30 }),
                    )
                    .await;
            }
            ticks += 1;
            if self.leadership.check(&self.store).await {
                match self.tick().await {
                    Ok(n) if n > 0 => continue,
                    Ok(_) => {}
                    Err(e) => warn!(error = %e, "scheduler tick failed; retrying"),
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_millis(self.config.tick_ms)) => {}
            }
        }
        self.leadership.release(&self.store).await;
        let _ = self.store.deregister(&self.config.scheduler_id).await;
        info!(scheduler = %self.config.scheduler_id, "scheduler stopped");
        Ok(())
    }

    /// Whether this scheduler led at its last check.
    pub fn leads(&self) -> bool {
        self.leadership.leads()
    }

    /// One pass over expired leases, due timers and inboxes; returns how much it did.
    pub async fn tick(&mut self) -> Result<usize, StoreError> {
        let mut done = 0;
        for row in self.store.expired_leases(self.config.batch).await? {
            done += usize::from(self.recover(row).await?);
        }
        for row in self.store.due_timers(self.config.batch).await? {
            done += usize::from(self.fire(row).await?);
        }
        for run_id in self.store.due_deadlines(self.config.batch).await? {
            if self
                .store
                .fire_deadline(run_id, &self.config.scheduler_id)
                .await?
            {
                debug!(%run_id, "wall-time budget fired");
                self.stats.timers_fired.fetch_add(1, Ordering::Relaxed);
                done += 1;
            }
        }
        for run_id in self.store.runs_with_inbox(self.config.batch).await? {
            let row = self.store.run(run_id).await?;
            done += usize::from(self.drain_inbox(row).await?);
        }
        Ok(done)
    }

    async fn definition(&mut self, name: &str, version: u32) -> Result<Definition, StoreError> {
        let key = (name.to_owned(), version);
        if let Some(def) = self.definitions.get(&key) {
            return Ok(def.clone());
        }
        let def = self.store.load_definition(name, Some(version)).await?;
        self.definitions.insert(key, def.clone());
        Ok(def)
    }

    /// S2: a lease expired. Record it; a dispatched call becomes in doubt (a worker will
    /// reconcile it); otherwise an active state takes its declared recovery event (e.g. the
    /// retry path, attempt counted); failing that, the run is simply claimable again.
    async fn recover(&mut self, row: RunRow) -> Result<bool, StoreError> {
        let def = self.definition(&row.definition, row.version).await?;
        let state = &row.projection;
        let expired = NewEvent::new(
            EngineEvent::LeaseExpired.as_str(),
            json!({ "worker": row.lease_owner, "token": row.fencing_token }),
        );
        let mut events = vec![expired];
        let pending_dispatched = state
            .action
            .as_ref()
            .is_some_and(|a| a.status == ActionStatus::Dispatched && a.call_id.is_some());
        if pending_dispatched {
            let call_id = state.action.as_ref().and_then(|a| a.call_id.clone());
            events.push(NewEvent::new(
                EngineEvent::ActionResultInDoubt.as_str(),
                json!({ "call_id": call_id, "reason": "lease expired while the call was dispatched" }),
            ));
        } else if let Some((kind, payload)) = rein_core::retry::lost_attempt_event(
            &def,
            state,
            (&events[0].kind, &events[0].payload),
            LostAttempt::LeaseExpired,
            &Failure::transient(retry_kind::LEASE_EXPIRED, "worker lease expired"),
        ) {
            events.push(NewEvent::new(kind, payload));
        }
        let recovered = self.commit(&def, &row, events, Vec::new()).await?;
        if recovered {
            info!(run_id = %row.run_id, worker = ?row.lease_owner, state = %state.state, "recovered expired lease");
            self.stats.leases_recovered.fetch_add(1, Ordering::Relaxed);
            let _ = self.store.add_counter(counters::LEASES_RECOVERED, 1).await;
            metrics::counter!(rein_store::metrics::LEASE_EXPIRIES).increment(1);
            if let Some(seconds) = row.expired_for_s() {
                metrics::histogram!(rein_store::metrics::RECOVERY).record(seconds);
            }
        }
        Ok(recovered)
    }

    /// S1: a parked run's timer is due; commit the first candidate the definition accepts.
    async fn fire(&mut self, row: RunRow) -> Result<bool, StoreError> {
        let def = self.definition(&row.definition, row.version).await?;
        let elapsed_ms = row.in_state_ms.max(0.0).ceil() as u64;
        let try_elapsed_ms = row.try_elapsed_ms.max(0.0).ceil() as u64;
        let candidates =
            rein_core::timer::fired_events(&def, &row.projection, elapsed_ms, try_elapsed_ms);
        for (kind, payload) in candidates {
            let event = Event::new(row.projection.sequence + 1, kind.clone(), payload.clone());
            if apply(&def, &row.projection, &event).is_ok() {
                let fired = self
                    .commit(
                        &def,
                        &row,
                        vec![NewEvent::new(kind.clone(), payload)],
                        Vec::new(),
                    )
                    .await?;
                if fired {
                    debug!(run_id = %row.run_id, event = %kind, "timer fired");
                    self.stats.timers_fired.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!(rein_store::metrics::TIMERS_FIRED, "kind" => kind.clone())
                        .increment(1);
                }
                return Ok(fired);
            }
        }
        warn!(run_id = %row.run_id, state = %row.state, "timer due but no candidate event is accepted");
        Ok(false)
    }

    async fn drain_inbox(&mut self, row: RunRow) -> Result<bool, StoreError> {
        if row.lease_live {
            return Ok(false);
        }
        let def = self.definition(&row.definition, row.version).await?;
        let entries = self.store.inbox(row.run_id).await?;
        let (events, consumed) = rein_store::plan_inbox(&def, &row.projection, entries);
        if events.is_empty() {
            return Ok(false);
        }
        let n = events.len() as u64;
        let applied = self.commit(&def, &row, events, consumed).await?;
        if applied {
            self.stats.inbox_applied.fetch_add(n, Ordering::Relaxed);
        }
        Ok(applied)
    }

    async fn commit(
        &mut self,
        def: &Definition,
        row: &RunRow,
        events: Vec<NewEvent>,
        consumed: Vec<i64>,
    ) -> Result<bool, StoreError> {
        let plan = CommitPlan {
            writer: Writer::TakeToken,
            release: false,
            jitter_sample: rand::random::<f64>(),
        };
        let request = match plan_commit(
            def,
            row.run_id,
            row.fencing_token,
            &row.projection,
            events,
            consumed,
            plan,
        ) {
            Ok(r) => r,
            Err(e) => {
                warn!(run_id = %row.run_id, state = %e.state, event = %e.event, reason = %e.reason, "rejected transition");
                return Ok(false);
            }
        };
        match self
            .store
            .commit_batch(&self.config.scheduler_id, std::slice::from_ref(&request))
            .await?
            .pop()
        {
            Some(CommitOutcome::Committed(_)) => Ok(true),
            _ => {
                self.stats.lost_races.fetch_add(1, Ordering::Relaxed);
                Ok(false)
            }
        }
    }
}
