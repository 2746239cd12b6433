//! The scheduler role (SPEC S1–S3): fires timers of parked runs and wall-time budgets,
//! recovers runs whose lease expired, and applies or expires inbox entries of unleased runs
//! (which is also how a branch's result reaches its waiting parent).
//!
//! Every firing is an ordinary guarded, sequenced commit that takes the fencing token only
//! when no live lease is held and only if the token is still the one it read; so any number
//! of schedulers may run at once, and firing twice is harmless (the loser is refused).

mod leader;
pub mod webhooks;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rein_core::retry::{Failure, LostAttempt, kind as retry_kind};
use rein_core::{ActionStatus, Definition, EngineEvent, Event, apply};
use rein_store::{
    CommitOutcome, CommitPlan, CommitRequest, InboxEntry, NewEvent, NextLook, RunRow, Seen, Store,
    StoreError, Writer, counters, plan_commit,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};
use uuid::Uuid;

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
    /// Looks at a row that could not move it, after which its next look was set ahead.
    pub backed_off: AtomicU64,
    /// Rows reported at WARN as stuck: the first such look in a row (per run and state entry).
    pub stuck_reported: AtomicU64,
}

pub struct Scheduler {
    store: Store,
    config: SchedulerConfig,
    definitions: HashMap<(String, u32), Definition>,
    leadership: Leadership,
    /// When this scheduler, leading, last made sure the coming months' event partitions exist.
    months_checked: Option<std::time::Instant>,
    /// When to ask again whether `rein_runs` has statistics (see
    /// [`Store::first_statistics`]); None once it has.
    statistics_due: Option<std::time::Instant>,
    pub stats: SchedulerStats,
}

/// How often a leading scheduler makes sure this month's and the next two months' event
/// partitions exist (`rein_events_add_month`): a month is made weeks before its first event.
const MONTHS_CHECK_EVERY: Duration = Duration::from_secs(600);

/// Runs in `rein_runs` at which a leading scheduler takes the table's first statistics, if
/// nobody has: enough that a primary-key probe costs less than a scan in every plan made
/// after it.
pub const FIRST_STATISTICS_RUNS: u64 = 1_000;

/// How often a leading scheduler asks, until `rein_runs` has statistics.
const FIRST_STATISTICS_EVERY: Duration = Duration::from_secs(1);

impl Scheduler {
    pub fn new(store: Store, config: SchedulerConfig) -> Scheduler {
        register_metrics();
        let leadership = Leadership::new(&config.scheduler_id, config.leader_ttl_ms);
        Scheduler {
            store,
            config,
            definitions: HashMap::new(),
            leadership,
            months_checked: None,
            statistics_due: Some(std::time::Instant::now()),
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
                self.ensure_event_months().await;
                self.first_statistics().await;
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

    /// Makes the coming months' event partitions, at most every [`MONTHS_CHECK_EVERY`]. A
    /// failure only delays them: events of a month without a partition land in the default
    /// one, and making the month later moves them into it.
    async fn ensure_event_months(&mut self) {
        if self
            .months_checked
            .is_some_and(|at| at.elapsed() < MONTHS_CHECK_EVERY)
        {
            return;
        }
        self.months_checked = Some(std::time::Instant::now());
        match self.store.ensure_event_months().await {
            Ok(made) if !made.is_empty() => info!(partitions = ?made, "event partitions made"),
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, "making the coming months' event partitions failed; retrying in 10 minutes")
            }
        }
    }

    /// Takes `rein_runs`' first statistics once it holds [`FIRST_STATISTICS_RUNS`] runs,
    /// unless autovacuum or an operator did, asking at most every [`FIRST_STATISTICS_EVERY`];
    /// then never asks again. A failure is asked again at the next turn.
    async fn first_statistics(&mut self) {
        let now = std::time::Instant::now();
        if self.statistics_due.is_none_or(|due| now < due) {
            return;
        }
        self.statistics_due = Some(now + FIRST_STATISTICS_EVERY);
        match self.store.first_statistics(FIRST_STATISTICS_RUNS).await {
            Ok(true) => self.statistics_due = None,
            Ok(false) => {}
            Err(e) => {
                warn!(error = %e, "taking the first statistics of rein_runs failed; retrying")
            }
        }
    }

    /// Whether this scheduler led at its last check.
    pub fn leads(&self) -> bool {
        self.leadership.leads()
    }

    /// One pass over expired leases, due wall-time budgets, due timers and inboxes; returns
    /// how many runs it moved. A row it cannot move (or whose look fails) gets a next look
    /// ahead and is passed over until then, so it never holds the head of a scan; only losing
    /// the database ends the pass early.
    pub async fn tick(&mut self) -> Result<usize, StoreError> {
        let mut done = 0;
        for row in self.store.expired_leases(self.config.batch).await? {
            let seen = row.seen();
            let span = Scan::Lease.span(seen.run_id);
            let look = self.recover(row).instrument(span.clone()).await;
            record_look(&span, &look);
            done += self.settle(Scan::Lease, seen, look).await?;
        }
        // Before timers: a timer's next look never passes a budget still ahead, but one
        // already due is delivered here first.
        for seen in self.store.due_deadlines(self.config.batch).await? {
            let span = Scan::Deadline.span(seen.run_id);
            let look = self
                .deliver_deadline(seen.run_id)
                .instrument(span.clone())
                .await;
            record_look(&span, &look);
            done += self.settle(Scan::Deadline, seen, look).await?;
        }
        done += self.fire_due_timers().await?;
        for run_id in self.store.runs_with_inbox(self.config.batch).await? {
            done += self.drain_inbox(run_id).await?;
        }
        Ok(done)
    }

    /// Counts a look that moved its run; gives one that did not a next look ahead. Reported
    /// at WARN on the first such look in a row (once per run and state entry: any commit
    /// starts a new row of looks), at DEBUG after that.
    async fn settle(
        &mut self,
        scan: Scan,
        seen: Seen,
        look: Result<Look, StoreError>,
    ) -> Result<usize, StoreError> {
        let (why, next_change_ms) = match look {
            Ok(Look::Moved) => return Ok(1),
            Ok(Look::Gone) => return Ok(0),
            Ok(Look::Stuck {
                why,
                next_change_ms,
            }) => (why, next_change_ms),
            Err(e @ StoreError::Unreachable(_)) => return Err(e),
            Err(e) => (e.to_string(), None),
        };
        let Some(next) = self.store.look_later(seen, next_change_ms).await? else {
            // The run changed meanwhile: that made it due again.
            return Ok(0);
        };
        self.backed_off(scan, seen.run_id, &why, next);
        Ok(0)
    }

    fn backed_off(&self, scan: Scan, run_id: Uuid, why: &str, next: NextLook) {
        self.stats.backed_off.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(rein_store::metrics::SCAN_BACKOFFS, "scan" => scan.as_str()).increment(1);
        if next.misses == 1 {
            self.stats.stuck_reported.fetch_add(1, Ordering::Relaxed);
            warn!(%run_id, scan = scan.as_str(), reason = %why, next_look = %next.at,
                "cannot move the run; looking again later, less and less often, until it changes");
        } else {
            debug!(%run_id, scan = scan.as_str(), reason = %why, misses = next.misses,
                next_look = %next.at, "still cannot move the run");
        }
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
    async fn recover(&mut self, row: RunRow) -> Result<Look, StoreError> {
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
        let fired: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
        tracing::Span::current().record("rein.event", fired.join(",").as_str());
        let recovered = self.commit(&def, &row, events, Vec::new()).await?;
        if recovered == Look::Moved {
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

    /// A run's wall-time budget ran out: deliver its budget event.
    async fn deliver_deadline(&mut self, run_id: Uuid) -> Result<Look, StoreError> {
        if !self
            .store
            .fire_deadline(run_id, &self.config.scheduler_id)
            .await?
        {
            // Delivered by another scheduler, or no longer due.
            return Ok(Look::Gone);
        }
        debug!(%run_id, "wall-time budget fired");
        self.stats.timers_fired.fetch_add(1, Ordering::Relaxed);
        Ok(Look::Moved)
    }

    /// S1: the due timers of a page. Each run's firing is judged on its own and all of them
    /// are committed in one statement (one transaction, one flush), each fenced on its own:
    /// a burst of timers due at once costs a tick one round trip, not one per run.
    async fn fire_due_timers(&mut self) -> Result<usize, StoreError> {
        let rows = self.store.due_timers(self.config.batch).await?;
        let mut looks: Vec<(Seen, tracing::Span, Option<LookResult>)> =
            Vec::with_capacity(rows.len());
        let mut requests = Vec::new();
        let mut waiting = Vec::new();
        for row in rows {
            let seen = row.seen();
            let span = Scan::Timer.span(seen.run_id);
            match self.plan_fire(&row).instrument(span.clone()).await {
                Ok(Fire::Commit(request, kind)) => {
                    span.record("rein.event", kind.as_str());
                    waiting.push((looks.len(), kind));
                    requests.push(*request);
                    looks.push((seen, span, None));
                }
                Ok(Fire::Done(look)) => looks.push((seen, span, Some(Ok(look)))),
                Err(e) => looks.push((seen, span, Some(Err(e)))),
            }
        }
        let outcomes = self.commit_all(&requests).await?;
        for ((at, kind), Landed { look, token }) in waiting.into_iter().zip(outcomes) {
            if let Some(token) = token {
                looks[at].1.record("rein.fencing_token", token);
            }
            if matches!(look, Ok(Look::Moved)) {
                debug!(run_id = %looks[at].0.run_id, event = %kind, "timer fired");
                self.stats.timers_fired.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(rein_store::metrics::TIMERS_FIRED,
                    "kind" => rein_store::metrics::label(rein_store::metrics::TIMERS_FIRED, "kind", &kind))
                    .increment(1);
            }
            looks[at].2 = Some(look);
        }
        let mut done = 0;
        for (seen, span, look) in looks {
            let look = look.unwrap_or(Ok(Look::Gone));
            record_look(&span, &look);
            done += self.settle(Scan::Timer, seen, look).await?;
        }
        Ok(done)
    }

    /// A parked run's timer is due: the first candidate the definition accepts, as a commit.
    /// When it accepts none, the next look need not come before the timers offer other events.
    async fn plan_fire(&mut self, row: &RunRow) -> Result<Fire, StoreError> {
        let def = self.definition(&row.definition, row.version).await?;
        let elapsed_ms = row.in_state_ms.max(0.0).ceil() as u64;
        let try_elapsed_ms = row.try_elapsed_ms.max(0.0).ceil() as u64;
        let candidates =
            rein_core::timer::fired_events(&def, &row.projection, elapsed_ms, try_elapsed_ms);
        for (kind, payload) in candidates {
            let event = Event::new(row.projection.sequence + 1, kind.clone(), payload.clone());
            if apply(&def, &row.projection, &event).is_ok() {
                return Ok(
                    match plan_request(
                        &def,
                        row,
                        vec![NewEvent::new(kind.clone(), payload)],
                        Vec::new(),
                    ) {
                        Ok(request) => Fire::Commit(Box::new(request), kind),
                        Err(look) => Fire::Done(look),
                    },
                );
            }
        }
        Ok(Fire::Done(Look::Stuck {
            why: format!(
                "timer due in state {} but no candidate event is accepted",
                row.state
            ),
            next_change_ms: rein_core::timer::next_change_after(&def, &row.projection, elapsed_ms),
        }))
    }

    /// X3a: applies or expires the inbox entries of a run without a live lease, a page of due
    /// entries at a time; entries the run cannot take yet get a next look ahead. A run with a
    /// live lease has its due entries put off until the lease ends (its holder applies them).
    async fn drain_inbox(&mut self, run_id: Uuid) -> Result<usize, StoreError> {
        let mut after = 0;
        for _ in 0..INBOX_PAGES_PER_LOOK {
            let entries = self.store.due_inbox(run_id, after).await?;
            let Some(last) = entries.last() else {
                return Ok(0);
            };
            after = last.id;
            let ids: Vec<i64> = entries.iter().map(|e| e.id).collect();
            let (seen, why) = match self.judge_inbox(run_id, entries).await {
                Ok(InboxLook::Applied) => return Ok(1),
                Ok(InboxLook::Leased) => return Ok(0),
                Ok(InboxLook::Stuck(seen, why)) => (Some(seen), why),
                Err(e @ StoreError::Unreachable(_)) => return Err(e),
                Err(e) => (None, e.to_string()),
            };
            match self.store.look_at_inbox_later(run_id, seen, &ids).await? {
                Some(next) => self.backed_off(Scan::Inbox, run_id, &why, next),
                // The run changed meanwhile: its entries are due again.
                None => return Ok(0),
            }
        }
        Ok(0)
    }

    async fn judge_inbox(
        &mut self,
        run_id: Uuid,
        entries: Vec<InboxEntry>,
    ) -> Result<InboxLook, StoreError> {
        let row = self.store.run(run_id).await?;
        if row.lease_live {
            self.store.look_at_inbox_after_lease(run_id).await?;
            return Ok(InboxLook::Leased);
        }
        let seen = row.seen();
        let def = self.definition(&row.definition, row.version).await?;
        let (events, consumed) = rein_store::plan_inbox(&def, &row.projection, entries);
        if events.is_empty() {
            // Normal: an event sent ahead of the state that takes it.
            return Ok(InboxLook::Stuck(
                seen,
                format!("state {} takes none of its inbox entries yet", row.state),
            ));
        }
        let n = events.len() as u64;
        match self.commit(&def, &row, events, consumed).await? {
            Look::Moved => {
                self.stats.inbox_applied.fetch_add(n, Ordering::Relaxed);
                Ok(InboxLook::Applied)
            }
            _ => Ok(InboxLook::Stuck(
                seen,
                "the commit applying its inbox did not land".into(),
            )),
        }
    }

    /// Commits `events` by taking the token. `Moved` when it landed; otherwise `Stuck`
    /// (after a lost race the run changed, so no next look is set for it).
    async fn commit(
        &mut self,
        def: &Definition,
        row: &RunRow,
        events: Vec<NewEvent>,
        consumed: Vec<i64>,
    ) -> Result<Look, StoreError> {
        let request = match plan_request(def, row, events, consumed) {
            Ok(r) => r,
            Err(look) => return Ok(look),
        };
        let Landed { look, token } = self
            .commit_all(std::slice::from_ref(&request))
            .await?
            .pop()
            .unwrap_or(Landed {
                look: Ok(Look::Gone),
                token: None,
            });
        if let Some(token) = token {
            tracing::Span::current().record("rein.fencing_token", token);
        }
        look
    }

    /// Commits `requests` in one statement: per request, its look and the token it took. Only
    /// losing the database fails the whole; a run PostgreSQL refuses is that run's error.
    async fn commit_all(&mut self, requests: &[CommitRequest]) -> Result<Vec<Landed>, StoreError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let mut out = Vec::with_capacity(requests.len());
        for outcome in self
            .store
            .commit_runs(&self.config.scheduler_id, requests)
            .await
        {
            out.push(match outcome {
                Ok(CommitOutcome::Committed(c)) => Landed {
                    look: Ok(Look::Moved),
                    token: Some(c.token),
                },
                Ok(other) => {
                    self.stats.lost_races.fetch_add(1, Ordering::Relaxed);
                    Landed {
                        look: Ok(Look::Stuck {
                            why: format!("the commit did not land: {other:?}"),
                            next_change_ms: None,
                        }),
                        token: None,
                    }
                }
                Err(e @ StoreError::Unreachable(_)) => return Err(e),
                Err(e) => Landed {
                    look: Err(e),
                    token: None,
                },
            });
        }
        Ok(out)
    }
}

/// A writer without a lease commits `events` on the state it read (SPEC X3a); a transition
/// the definition refuses is a look that could not move the run.
fn plan_request(
    def: &Definition,
    row: &RunRow,
    events: Vec<NewEvent>,
    consumed: Vec<i64>,
) -> Result<CommitRequest, Look> {
    let plan = CommitPlan {
        writer: Writer::TakeToken,
        release: false,
        jitter_sample: rand::random::<f64>(),
    };
    plan_commit(
        def,
        row.run_id,
        row.fencing_token,
        &row.projection,
        events,
        consumed,
        plan,
    )
    .map_err(|e| Look::Stuck {
        why: format!(
            "rejected transition: {} in {}: {}",
            e.event, e.state, e.reason
        ),
        next_change_ms: None,
    })
}

type LookResult = Result<Look, StoreError>;

/// What one commit of [`Scheduler::commit_all`] did, and the token it took if it landed.
struct Landed {
    look: LookResult,
    token: Option<i64>,
}

/// What a due timer leads to: a commit of its event, or a look that moves nothing.
enum Fire {
    Commit(Box<CommitRequest>, String),
    Done(Look),
}

/// Records on a firing's span whether it moved the run.
fn record_look(span: &tracing::Span, look: &Result<Look, StoreError>) {
    let outcome = match look {
        Ok(Look::Moved) => "moved",
        Ok(Look::Gone) => "gone",
        Ok(Look::Stuck { .. }) => "stuck",
        Err(_) => "error",
    };
    span.record("rein.outcome", outcome);
}

/// Most pages of due inbox entries one look at a run judges; a run with more is returned by
/// the next scan again.
const INBOX_PAGES_PER_LOOK: usize = 10;

/// The scans of a tick.
#[derive(Debug, Clone, Copy)]
enum Scan {
    Lease,
    Deadline,
    Timer,
    Inbox,
}

impl Scan {
    const ALL: [Scan; 4] = [Scan::Lease, Scan::Deadline, Scan::Timer, Scan::Inbox];

    /// The span of one firing on `run_id` (SPEC O3), a child of the run's root span:
    /// `rein.event` is the event it commits, `rein.fencing_token` the token it took.
    fn span(self, run_id: Uuid) -> tracing::Span {
        let span = tracing::info_span!("rein.fire", rein.scan = self.as_str(),
            rein.run.id = %run_id, rein.event = tracing::field::Empty,
            rein.fencing_token = tracing::field::Empty, rein.outcome = tracing::field::Empty);
        rein_store::trace::parent_to_run(&span, run_id);
        span
    }

    fn as_str(self) -> &'static str {
        match self {
            Scan::Lease => "lease",
            Scan::Deadline => "deadline",
            Scan::Timer => "timer",
            Scan::Inbox => "inbox",
        }
    }
}

/// Registers at 0 the families a scheduler records, with the label values known at start:
/// its scans and the events the built-in definitions' timers fire.
fn register_metrics() {
    use rein_store::metrics as m;
    metrics::counter!(m::LEASE_EXPIRIES).increment(0);
    let _ = metrics::histogram!(m::RECOVERY);
    for scan in Scan::ALL {
        metrics::counter!(m::SCAN_BACKOFFS, "scan" => scan.as_str()).increment(0);
    }
    for def in m::builtin_definitions() {
        for kind in rein_core::timer::timer_events(&def) {
            metrics::counter!(m::TIMERS_FIRED, "kind" => m::label(m::TIMERS_FIRED, "kind", kind))
                .increment(0);
        }
    }
}

/// What a look at a row came to.
#[derive(Debug, PartialEq)]
enum Look {
    /// A commit landed: the run moved.
    Moved,
    /// The row left the scan without this look (another scheduler was first).
    Gone,
    /// Nothing could be committed; `next_change_ms` (from state entry) is when time alone
    /// could change that.
    Stuck {
        why: String,
        next_change_ms: Option<u64>,
    },
}

enum InboxLook {
    Applied,
    Leased,
    Stuck(Seen, String),
}
