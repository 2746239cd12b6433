//! A model of Rein's lease protocol, checked exhaustively with [stateright]: how workers claim,
//! renew and commit under leases with fencing tokens, how the scheduler fires timers, drains
//! inboxes and recovers expired leases, and how an event from outside is committed directly or
//! queued in the run's inbox (SPEC X1–X4, X3a, S1–S2, E2).
//!
//! One run row stands for `rein_runs`; every time comparison is against the database clock
//! `now`. Workers, the scheduler and an API client talk to the database through a network that
//! delays (any interleaving), drops and duplicates requests and drops replies; workers crash
//! (forget everything) and pause (do nothing while the clock runs). The predicates that decide
//! whether a claim, renewal or commit lands are those of `crates/store/queries/claim.sql`,
//! `renew.sql` and `commit.sql`, and the send path is `Store::send_on` in
//! `crates/store/src/send.rs`; each action below names the statement it stands for.
//!
//! The run's definition is abstract: `A(0..steps)` is active (runnable) and each WORK commit
//! moves it one step; the last one parks it in `P`, which releases the lease and sets a timer;
//! the scheduler's TIMER takes it to `B` (runnable), whose FINISH ends it (`Done`, terminal).
//! SIGNAL, the API client's keyed event, is accepted in every state but `Done`; the
//! scheduler's LEASE_EXPIRED keeps the control state. Everything else a real definition does
//! (guards, retries, actions) only decides which of these events a writer appends.
//!
//! [`Flaws`] switches single predicates off, so tests can show that the checker finds what
//! each one prevents.

use stateright::{Model, Property};

/// Predicates of the real protocol that a test may switch off, and one worker behaviour the
/// shipped worker does not have. All `false` is the protocol as implemented.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flaws {
    /// commit.sql without `r.lease_until > clock_timestamp()` for a leased writer.
    pub no_lease_expiry: bool,
    /// commit.sql without `r.fencing_token = q.token`.
    pub no_token_check: bool,
    /// commit.sql without `r.last_sequence = q.base_seq`.
    pub no_sequence_check: bool,
    /// claim.sql without `r.lease_owner IS NULL`: a claim takes a live lease.
    pub claim_takes_live_lease: bool,
    /// No idempotency by event id: `sent_before` is skipped, commit.sql has no
    /// `NOT EXISTS (... event_id ...)` and `rein_inbox` no `UNIQUE (run_id, event_id)`.
    pub no_event_ids: bool,
    /// The scheduler never recovers an expired lease (its `expired_leases` scan is off): a
    /// holder that crashes leaves its run stuck, which the liveness property must find.
    pub no_lease_recovery: bool,
    /// A worker that lost a commit's reply plans the commit again with new event ids instead
    /// of sending the same request (the shipped worker resends the same request).
    pub worker_replans: bool,
}

/// Bounds of the check.
#[derive(Clone, Debug)]
pub struct Config {
    pub workers: u8,
    /// Lease length in ticks of the database clock.
    pub ttl: u8,
    /// How long the run stays parked in `P` before its timer is due.
    pub timer: u8,
    /// WORK commits in `A`; the last one parks the run.
    pub steps: u8,
    /// Faults before they stop: lost or duplicated messages, crashes, a scheduler giving up
    /// on a statement still in flight.
    pub faults: u8,
    /// Clock ticks anyone may sleep through (pauses, delays) before faults stop.
    pub free_ticks: u8,
    /// How often the API client sends its keyed event (a retry sends it again).
    pub sends: u8,
    /// A fencing token beyond this is outside the check (a safety net for flawed models).
    pub max_token: u8,
    pub flaws: Flaws,
}

impl Config {
    /// Two workers, one fault, three free ticks: checked in the test suite.
    pub fn small() -> Config {
        Config {
            workers: 2,
            ttl: 2,
            timer: 1,
            steps: 2,
            faults: 1,
            free_ticks: 3,
            sends: 2,
            max_token: 12,
            flaws: Flaws::default(),
        }
    }

    pub fn with_flaws(mut self, flaws: Flaws) -> Config {
        self.flaws = flaws;
        self
    }

    /// The clock never needs to pass this: after the free ticks, time only moves when nobody
    /// can act, and then a lease or a timer is all anyone waits for.
    pub fn horizon(&self) -> u8 {
        self.free_ticks + 3 * self.ttl + self.timer + 2
    }
}

/// The run's control state (the projection's `state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Control {
    A(u8),
    P,
    B,
    Done,
}

/// The projection a writer reads and the reducer advances.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct View {
    pub control: Control,
    /// SIGNAL events applied.
    pub signals: u8,
    /// `last_sequence`.
    pub seq: u8,
}

impl View {
    fn runnable(&self) -> bool {
        matches!(self.control, Control::A(_) | Control::B)
    }
}

/// Who writes. Workers hold leases; the scheduler and the API take the token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Party {
    Worker(u8),
    Scheduler,
    Api,
}

/// The identity of a commit's own events (their event ids): the same for a resent request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommitId {
    pub by: Party,
    pub token: u8,
    pub base: u8,
    pub nonce: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum What {
    Work,
    Inbox,
    Recover,
    Timer,
    Send,
}

/// One run's commit request (a row of commit.sql's `req`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Commit {
    pub id: CommitId,
    /// `Writer::TakeToken`.
    pub bump: bool,
    pub token: u8,
    pub base: u8,
    /// The projection after the events.
    pub view: View,
    pub events: u8,
    /// SIGNAL events carried (their event id comes from the sender's key); they come first.
    pub signals: u8,
    /// Inbox entries consumed (bit i: the entry of the API's i-th send).
    pub consumed: u8,
    pub release: bool,
    pub what: What,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    Committed,
    AlreadyCommitted,
    Fenced,
}

/// Requests in flight (`orphan`: its sender crashed, so nobody reads the reply). A reply is
/// received when its request is processed, or lost: a reply that is late is the same as one
/// received at once by a process that then pauses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    Claim { w: u8, orphan: bool },
    Renew { w: u8, token: u8, orphan: bool },
    Commit { c: Commit, orphan: bool },
    Send { attempt: u8 },
}

/// What a request's reply says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reply {
    Claimed {
        w: u8,
        token: u8,
        view: View,
        until: u8,
    },
    NothingClaimed,
    Renewed {
        w: u8,
        token: u8,
        until: u8,
    },
    RenewRefused {
        w: u8,
        token: u8,
    },
    Commit {
        id: CommitId,
        outcome: Outcome,
    },
    Send,
}

impl Msg {
    /// The worker whose connection carries this request.
    fn worker(&self) -> Option<u8> {
        match *self {
            Msg::Claim { w, .. } | Msg::Renew { w, .. } => Some(w),
            Msg::Commit { c, .. } => match c.id.by {
                Party::Worker(w) => Some(w),
                _ => None,
            },
            Msg::Send { .. } => None,
        }
    }

    fn orphan(&self) -> bool {
        match *self {
            Msg::Claim { orphan, .. } | Msg::Renew { orphan, .. } | Msg::Commit { orphan, .. } => {
                orphan
            }
            Msg::Send { .. } => false,
        }
    }

    fn orphaned(self) -> Msg {
        match self {
            Msg::Claim { w, .. } => Msg::Claim { w, orphan: true },
            Msg::Renew { w, token, .. } => Msg::Renew {
                w,
                token,
                orphan: true,
            },
            Msg::Commit { c, .. } => Msg::Commit { c, orphan: true },
            other => other,
        }
    }
}

/// The run row (`rein_runs`) and its inbox (`rein_inbox`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Row {
    pub view: View,
    pub token: u8,
    pub owner: Option<u8>,
    /// `lease_until`; 0 while no one owns the lease.
    pub until: u8,
    pub wake_at: Option<u8>,
    /// Inbox entries (bit i: the entry of the API's i-th send).
    pub inbox: u8,
}

impl Row {
    /// `lease_until > clock_timestamp()` (NULL, with no owner, is not live).
    fn lease_live(&self, now: u8) -> bool {
        self.owner.is_some() && self.until > now
    }
}

/// What a worker believes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Worker {
    Idle,
    Holding {
        token: u8,
        view: View,
        /// The lease's end as the claim or the last renewal reported it.
        until: u8,
        pending: Option<Commit>,
        replans: u8,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scheduler {
    pub pending: Option<Commit>,
    pub nonce: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Api {
    pub sent: u8,
    pub answered: bool,
}

/// Properties an accepted write broke, recorded when the write is judged (bits of
/// [`State::broken`]).
pub mod broke {
    /// It wrote a sequence already written.
    pub const OVERLAP: u8 = 1;
    /// It did not start right after the highest sequence written.
    pub const GAP: u8 = 2;
    /// Its token was not the newest grant.
    pub const STALE_TOKEN: u8 = 4;
    /// A leased write whose writer did not hold a live lease by the database clock.
    pub const EXPIRED_LEASE: u8 = 8;
    /// It was written to a terminal run.
    pub const AFTER_TERMINAL: u8 = 16;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub now: u8,
    /// Faults so far (they happen only before the clock reaches `free_ticks`).
    pub faults: u8,
    pub row: Row,
    pub workers: Vec<Worker>,
    pub scheduler: Scheduler,
    pub api: Api,
    /// A multiset, kept sorted.
    pub net: Vec<Msg>,
    /// Ids of stored events that a request still in flight or pending could carry again
    /// (others can never be looked up again, so they are forgotten).
    pub stored: Vec<CommitId>,
    /// SIGNAL events (the API's keyed event) accepted so far.
    pub signals_applied: u8,
    /// The highest sequence written so far.
    pub written: u8,
    /// [`broke`] bits of the writes accepted so far.
    pub broken: u8,
    /// A lease that expired while held was taken by a lease-less writer (bump); its owner.
    pub expired_owner: Option<u8>,
    /// Someone else claimed the run after its holder's lease expired.
    pub taken_over: bool,
    /// A worker's commit was refused.
    pub fenced: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The database clock moves on.
    Tick,
    /// A worker polls for work (claim.sql); sent only while the run is claimable, since a
    /// poll that finds nothing changes nothing.
    Claim(u8),
    /// The worker's renewer extends its lease (renew.sql).
    Renew(u8),
    /// The worker commits its next event under its lease (commit.sql, `bump = false`).
    Work(u8),
    /// The worker applies what its run's inbox holds (`apply_inbox`: read the inbox,
    /// `plan_inbox`, commit.sql consuming the entries).
    ApplyInbox(u8),
    /// The reply of the worker's commit was lost: send it again (or plan it again).
    Retry(u8),
    /// The reply was lost and the lease is over by the worker's reckoning: stop.
    GiveUp(u8),
    /// The scheduler's `expired_leases` scan and `recover`: LEASE_EXPIRED, taking the token.
    Recover,
    /// The scheduler's `due_timers` scan and `fire`: TIMER, taking the token.
    FireTimer,
    /// The scheduler's `runs_with_inbox` scan and `judge_inbox`, for a run without a live
    /// lease: the inbox's events, taking the token.
    DrainInbox,
    /// The scheduler's statement or its reply was lost: look again.
    Rescan,
    /// The API client sends its keyed event (`Store::send_once`), again if it got no answer.
    Send,
    /// The database processes a request and its reply arrives.
    Deliver(Msg),
    // Faults.
    /// The request is processed but its reply is lost.
    LoseReply(Msg),
    Lose(Msg),
    Duplicate(Msg),
    Crash(u8),
    /// The scheduler gives up on a statement that is still in flight.
    Abandon,
}

/// The model: bounds and flaws.
#[derive(Clone, Debug)]
pub struct LeaseModel {
    pub cfg: Config,
}

fn popcount(bits: u8) -> u8 {
    bits.count_ones() as u8
}

impl LeaseModel {
    /// Panics on bounds the model cannot represent (they are a test's constants).
    pub fn new(cfg: Config) -> LeaseModel {
        assert!(
            (1..=4).contains(&cfg.workers),
            "workers must be 1..=4 (the state space grows about fivefold with each)"
        );
        assert!(
            (1..=8).contains(&cfg.sends),
            "sends must be 1..=8 (one inbox bit each)"
        );
        assert!(
            cfg.ttl >= 1 && cfg.steps >= 1,
            "ttl and steps must be at least 1"
        );
        assert!(
            u16::from(cfg.free_ticks) + 3 * u16::from(cfg.ttl) + u16::from(cfg.timer) + 2 < 200,
            "free_ticks, ttl and timer must keep the clock's horizon below 200"
        );
        LeaseModel { cfg }
    }

    // --- The reducer ---

    fn work(&self, v: View) -> Option<(View, bool)> {
        let (control, release) = match v.control {
            Control::A(k) if k + 1 < self.cfg.steps => (Control::A(k + 1), false),
            Control::A(_) => (Control::P, true),
            Control::B => (Control::Done, true),
            Control::P | Control::Done => return None,
        };
        Some((
            View {
                control,
                seq: v.seq + 1,
                ..v
            },
            release,
        ))
    }

    fn signal(v: View, n: u8) -> Option<View> {
        (v.control != Control::Done && n > 0).then_some(View {
            signals: v.signals + n,
            seq: v.seq + n,
            ..v
        })
    }

    // --- Predicates of the SQL ---

    /// claim.sql: `r.status = 'runnable' AND r.lease_owner IS NULL`.
    fn claimable(&self, row: &Row) -> bool {
        row.view.runnable() && (row.owner.is_none() || self.cfg.flaws.claim_takes_live_lease)
    }

    /// Whether any event of `c` is stored already (commit.sql's `NOT EXISTS`), and whether its
    /// first one is (what the store reports as `AlreadyCommitted`).
    fn stored(&self, s: &State, c: &Commit) -> (bool, bool) {
        let own = s.stored.contains(&c.id);
        let signal = c.signals > 0 && s.signals_applied > 0;
        let first = if c.signals > 0 { signal } else { own };
        if self.cfg.flaws.no_event_ids {
            (false, first)
        } else {
            (own || signal, first)
        }
    }

    /// commit.sql's `upd` predicate for one run.
    fn accepts(&self, s: &State, c: &Commit) -> bool {
        let (row, f) = (&s.row, &self.cfg.flaws);
        let token = f.no_token_check || row.token == c.token;
        let sequence = f.no_sequence_check || row.view.seq == c.base;
        let lease = if c.bump {
            row.owner.is_none() || row.until <= s.now
        } else {
            let Party::Worker(w) = c.id.by else {
                return false;
            };
            row.owner == Some(w) && (f.no_lease_expiry || row.until > s.now)
        };
        token && sequence && lease && !self.stored(s, c).0
    }

    /// commit.sql's updates for an accepted commit.
    fn apply(&self, s: &mut State, c: &Commit) {
        let before = s.row.clone();
        let leased_by = match c.id.by {
            Party::Worker(w) if !c.bump => Some(w),
            _ => None,
        };
        let mut broken = 0;
        if c.base < s.written {
            broken |= broke::OVERLAP;
        }
        if c.base > s.written {
            broken |= broke::GAP;
        }
        if c.token != before.token {
            broken |= broke::STALE_TOKEN;
        }
        let held_live = leased_by.is_some() && before.owner == leased_by && before.until > s.now;
        if !(c.bump || held_live) {
            broken |= broke::EXPIRED_LEASE;
        }
        if before.view.control == Control::Done {
            broken |= broke::AFTER_TERMINAL;
        }
        s.broken |= broken;
        s.written = s.written.max(c.base + c.events);
        s.signals_applied += c.signals;
        s.stored.push(c.id);
        let row = &mut s.row;
        row.view = c.view;
        if c.bump {
            row.token += 1;
            if before.owner.is_some() {
                s.expired_owner = before.owner;
            }
        }
        if c.bump || c.release {
            row.owner = None;
            row.until = 0;
        }
        row.wake_at = match (before.view.control, c.view.control) {
            (Control::P, Control::P) => before.wake_at,
            (_, Control::P) => Some(s.now + self.cfg.timer),
            _ => None,
        };
        row.inbox &= !c.consumed;
    }

    fn judge_commit(&self, s: &mut State, c: &Commit) -> Outcome {
        if self.accepts(s, c) {
            self.apply(s, c);
            Outcome::Committed
        } else if self.stored(s, c).1 {
            Outcome::AlreadyCommitted
        } else {
            if matches!(c.id.by, Party::Worker(_)) {
                s.fenced = true;
            }
            Outcome::Fenced
        }
    }

    /// `Store::send_on`: under the run's row lock, in one transaction.
    fn deliver_send(&self, s: &mut State, attempt: u8) {
        let stored = s.signals_applied > 0 || s.row.inbox != 0;
        if stored && !self.cfg.flaws.no_event_ids {
            return; // sent_before: what became of the first send
        }
        let Some(view) = Self::signal(s.row.view, 1) else {
            return; // could_ever_accept: a terminal run takes nothing
        };
        if !s.row.lease_live(s.now) {
            let c = Commit {
                id: CommitId {
                    by: Party::Api,
                    token: s.row.token,
                    base: s.row.view.seq,
                    nonce: attempt,
                },
                bump: true,
                token: s.row.token,
                base: s.row.view.seq,
                view,
                events: 1,
                signals: 1,
                consumed: 0,
                release: false,
                what: What::Send,
            };
            // Under the row lock this lands unless its event is stored (then the store
            // reports a corrupt state and the transaction rolls back).
            self.judge_commit(s, &c);
        } else {
            s.row.inbox |= 1 << attempt;
        }
    }

    fn has(s: &State, pred: impl Fn(&Msg) -> bool) -> bool {
        s.net.iter().any(pred)
    }

    fn in_flight(s: &State, c: &Commit) -> bool {
        Self::has(
            s,
            |m| matches!(m, Msg::Commit { c: x, orphan: false } if x == c),
        )
    }

    fn send(s: &mut State, m: Msg) {
        let at = s.net.partition_point(|x| *x <= m);
        s.net.insert(at, m);
    }

    fn take(s: &mut State, m: &Msg) -> bool {
        match s.net.iter().position(|x| x == m) {
            Some(i) => {
                s.net.remove(i);
                true
            }
            None => false,
        }
    }

    fn worker_plan(&self, s: &State, w: u8, inbox: bool) -> Option<Commit> {
        let Worker::Holding {
            token,
            view,
            pending: None,
            ..
        } = s.workers[w as usize]
        else {
            return None;
        };
        let id = CommitId {
            by: Party::Worker(w),
            token,
            base: view.seq,
            nonce: 0,
        };
        if inbox {
            // apply_inbox: reads the inbox, plan_inbox takes what the state accepts.
            let entries = s.row.inbox;
            let after = Self::signal(view, popcount(entries))?;
            Some(Commit {
                id,
                bump: false,
                token,
                base: view.seq,
                view: after,
                events: popcount(entries),
                signals: popcount(entries),
                consumed: entries,
                release: false,
                what: What::Inbox,
            })
        } else {
            let (after, release) = self.work(view)?;
            Some(Commit {
                id,
                bump: false,
                token,
                base: view.seq,
                view: after,
                events: 1,
                signals: 0,
                consumed: 0,
                release,
                what: What::Work,
            })
        }
    }

    fn scheduler_plan(&self, s: &State, what: What) -> Option<Commit> {
        if s.scheduler.pending.is_some() {
            return None;
        }
        let row = &s.row;
        let (view, events, signals, consumed) = match what {
            // expired_leases: lease_owner IS NOT NULL AND lease_until <= now.
            What::Recover
                if row.owner.is_some()
                    && row.until <= s.now
                    && row.view.runnable()
                    && !self.cfg.flaws.no_lease_recovery =>
            {
                (
                    View {
                        seq: row.view.seq + 1,
                        ..row.view
                    },
                    1,
                    0,
                    0,
                )
            }
            // due_timers: wake_at <= now AND lease_owner IS NULL.
            What::Timer
                if row.owner.is_none()
                    && row.wake_at.is_some_and(|t| t <= s.now)
                    && row.view.control == Control::P =>
            {
                (
                    View {
                        control: Control::B,
                        seq: row.view.seq + 1,
                        ..row.view
                    },
                    1,
                    0,
                    0,
                )
            }
            // runs_with_inbox + judge_inbox: only without a live lease.
            What::Inbox if row.inbox != 0 && !row.lease_live(s.now) => {
                let n = popcount(row.inbox);
                (Self::signal(row.view, n)?, n, n, row.inbox)
            }
            _ => return None,
        };
        Some(Commit {
            id: CommitId {
                by: Party::Scheduler,
                token: row.token,
                base: row.view.seq,
                nonce: s.scheduler.nonce,
            },
            bump: true,
            token: row.token,
            base: row.view.seq,
            view,
            events,
            signals,
            consumed,
            release: !view.runnable(),
            what,
        })
    }

    /// Keeps the stored ids a request in flight or pending could still carry, sorted.
    fn forget_unreachable_ids(s: &mut State) {
        let mut referenced: Vec<CommitId> = s
            .net
            .iter()
            .filter_map(|m| match m {
                Msg::Commit { c, .. } => Some(c.id),
                _ => None,
            })
            .chain(s.workers.iter().filter_map(|w| match w {
                Worker::Holding {
                    pending: Some(c), ..
                } => Some(c.id),
                _ => None,
            }))
            .chain(s.scheduler.pending.map(|c| c.id))
            .collect();
        referenced.sort_unstable();
        s.stored.retain(|id| referenced.binary_search(id).is_ok());
        s.stored.sort_unstable();
        s.stored.dedup();
    }

    /// Workers that believe they hold a live lease (not being released).
    pub fn live_holders(s: &State) -> usize {
        s.workers
            .iter()
            .filter(|w| match w {
                Worker::Holding { until, pending, .. } => {
                    *until > s.now && !pending.is_some_and(|c| c.release)
                }
                Worker::Idle => false,
            })
            .count()
    }

    fn progress_actions(&self, s: &State, out: &mut Vec<Action>) {
        for w in 0..self.cfg.workers {
            let conn = |m: &Msg| m.worker() == Some(w) && !m.orphan();
            // A worker polls for work while it drives runs (it has free slots), so it may
            // claim again a run it still believes it holds once that lease was taken from it.
            // A poll of a run it cannot claim changes nothing: not modelled.
            let polling = Self::has(s, |m| conn(m) && matches!(m, Msg::Claim { .. }));
            if !polling && self.claimable(&s.row) {
                out.push(Action::Claim(w));
            }
            match &s.workers[w as usize] {
                Worker::Idle => {}
                Worker::Holding { until, pending, .. } => {
                    let renewing = Self::has(s, |m| conn(m) && matches!(m, Msg::Renew { .. }));
                    // A lease being released is not renewed here (the shipped renewer still
                    // asks, and ignores the answer: that only keeps the lease a little longer).
                    let releasing = pending.is_some_and(|c| c.release);
                    if !renewing && !releasing && s.now + self.cfg.ttl > *until {
                        out.push(Action::Renew(w));
                    }
                    match pending {
                        None => {
                            if self.worker_plan(s, w, false).is_some() {
                                out.push(Action::Work(w));
                            }
                            if s.row.inbox != 0 && self.worker_plan(s, w, true).is_some() {
                                out.push(Action::ApplyInbox(w));
                            }
                        }
                        Some(c) if !Self::in_flight(s, c) => {
                            // commit_with retries until the lease would have expired.
                            out.push(if *until > s.now {
                                Action::Retry(w)
                            } else {
                                Action::GiveUp(w)
                            });
                        }
                        Some(_) => {}
                    }
                }
            }
        }
        match &s.scheduler.pending {
            None => {
                for (what, action) in [
                    (What::Recover, Action::Recover),
                    (What::Timer, Action::FireTimer),
                    (What::Inbox, Action::DrainInbox),
                ] {
                    if self.scheduler_plan(s, what).is_some() {
                        out.push(action);
                    }
                }
            }
            Some(c) if !Self::in_flight(s, c) => out.push(Action::Rescan),
            Some(_) => {}
        }
        // The API client sends again only when it got no answer and nothing is on its way.
        let sending = Self::has(s, |m| matches!(m, Msg::Send { .. }));
        if s.api.sent < self.cfg.sends && !s.api.answered && !sending {
            out.push(Action::Send);
        }
        Self::each_msg(s, |m| out.push(Action::Deliver(m)));
    }

    /// Each distinct message in flight.
    fn each_msg(s: &State, mut f: impl FnMut(Msg)) {
        let mut last = None;
        for m in &s.net {
            if last != Some(m) {
                f(*m);
                last = Some(m);
            }
        }
    }

    fn fault_actions(&self, s: &State, out: &mut Vec<Action>) {
        Self::each_msg(s, |m| {
            out.push(Action::Lose(m));
            out.push(Action::Duplicate(m));
            if !m.orphan() {
                out.push(Action::LoseReply(m));
            }
        });
        for w in 0..self.cfg.workers {
            let busy = s.workers[w as usize] != Worker::Idle
                || Self::has(s, |m| m.worker() == Some(w) && !m.orphan());
            if busy {
                out.push(Action::Crash(w));
            }
        }
        if s.scheduler.pending.is_some_and(|c| Self::in_flight(s, &c)) {
            out.push(Action::Abandon);
        }
    }

    /// The database processes a request; returns its reply.
    fn process(&self, s: &mut State, m: Msg) -> Reply {
        match m {
            Msg::Claim { w, .. } => {
                if !self.claimable(&s.row) {
                    return Reply::NothingClaimed;
                }
                s.row.token += 1;
                s.row.owner = Some(w);
                s.row.until = s.now + self.cfg.ttl;
                if s.expired_owner.is_some_and(|o| o != w) {
                    s.taken_over = true;
                }
                s.expired_owner = None;
                Reply::Claimed {
                    w,
                    token: s.row.token,
                    view: s.row.view,
                    until: s.row.until,
                }
            }
            Msg::Renew { w, token, .. } => {
                let row = &mut s.row;
                // renew.sql: token, owner and a live lease.
                if row.token == token && row.owner == Some(w) && row.until > s.now {
                    row.until = s.now + self.cfg.ttl;
                    Reply::Renewed {
                        w,
                        token,
                        until: row.until,
                    }
                } else {
                    Reply::RenewRefused { w, token }
                }
            }
            Msg::Commit { c, .. } => Reply::Commit {
                id: c.id,
                outcome: self.judge_commit(s, &c),
            },
            Msg::Send { attempt } => {
                self.deliver_send(s, attempt);
                Reply::Send
            }
        }
    }

    /// A reply reaches the process that asked.
    fn receive(s: &mut State, reply: Reply) {
        match reply {
            Reply::Claimed {
                w,
                token,
                view,
                until,
            } => {
                // `drive`: a run claimed again supersedes the task still driving it (that
                // task stops; a commit it sent may still be on its way).
                s.workers[w as usize] = Worker::Holding {
                    token,
                    view,
                    until,
                    pending: None,
                    replans: 0,
                };
            }
            Reply::NothingClaimed => {}
            Reply::Renewed { w, token, until } => {
                if let Worker::Holding {
                    token: t, until: u, ..
                } = &mut s.workers[w as usize]
                    && *t == token
                {
                    *u = (*u).max(until);
                }
            }
            Reply::RenewRefused { w, token } => {
                // The renewer drops a lease it lost, unless it is being released.
                if let Worker::Holding {
                    token: t, pending, ..
                } = &s.workers[w as usize]
                    && *t == token
                    && !pending.is_some_and(|c| c.release)
                {
                    s.workers[w as usize] = Worker::Idle;
                }
            }
            Reply::Commit { id, outcome } => match id.by {
                Party::Worker(w) => {
                    let slot = &mut s.workers[w as usize];
                    if let Worker::Holding {
                        view,
                        pending: Some(c),
                        ..
                    } = slot
                        && c.id == id
                    {
                        let c = *c;
                        match outcome {
                            Outcome::Committed | Outcome::AlreadyCommitted if !c.release => {
                                *view = c.view;
                                if let Worker::Holding { pending, .. } = slot {
                                    *pending = None;
                                }
                            }
                            _ => *slot = Worker::Idle,
                        }
                    }
                }
                Party::Scheduler => {
                    if s.scheduler.pending.is_some_and(|c| c.id == id) {
                        s.scheduler.pending = None;
                    }
                }
                Party::Api => {}
            },
            Reply::Send => s.api.answered = true,
        }
    }
}

impl Model for LeaseModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            faults: 0,
            row: Row {
                view: View {
                    control: Control::A(0),
                    signals: 0,
                    seq: 0,
                },
                token: 0,
                owner: None,
                until: 0,
                wake_at: None,
                inbox: 0,
            },
            workers: vec![Worker::Idle; self.cfg.workers as usize],
            scheduler: Scheduler {
                pending: None,
                nonce: 0,
            },
            api: Api {
                sent: 0,
                answered: false,
            },
            net: Vec::new(),
            stored: Vec::new(),
            signals_applied: 0,
            written: 0,
            broken: 0,
            expired_owner: None,
            taken_over: false,
            fenced: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        self.progress_actions(s, out);
        // Once the run ended, time changes nothing that matters.
        let ended = s.row.view.control == Control::Done;
        if s.now >= self.cfg.free_ticks {
            // Faults have stopped: everyone acts before time passes, so the clock moves only
            // when all wait for it (a lease to run out, a timer to come due).
            if out.is_empty() && !ended && s.now < self.cfg.horizon() {
                out.push(Action::Tick);
            }
            return;
        }
        // Before that, anyone may sleep through a tick (a pause, a slow network).
        if !ended {
            out.push(Action::Tick);
        }
        if s.faults < self.cfg.faults {
            self.fault_actions(s, out);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.now += 1,
            Action::Claim(w) => Self::send(&mut s, Msg::Claim { w, orphan: false }),
            Action::Renew(w) => {
                let Worker::Holding { token, .. } = s.workers[w as usize] else {
                    return None;
                };
                Self::send(
                    &mut s,
                    Msg::Renew {
                        w,
                        token,
                        orphan: false,
                    },
                );
            }
            Action::Work(w) | Action::ApplyInbox(w) => {
                let c = self.worker_plan(&s, w, matches!(action, Action::ApplyInbox(_)))?;
                if let Worker::Holding { pending, .. } = &mut s.workers[w as usize] {
                    *pending = Some(c);
                }
                Self::send(&mut s, Msg::Commit { c, orphan: false });
            }
            Action::Retry(w) => {
                let replan = self.cfg.flaws.worker_replans;
                let Worker::Holding {
                    pending: Some(c),
                    replans,
                    ..
                } = &mut s.workers[w as usize]
                else {
                    return None;
                };
                if replan {
                    *replans += 1;
                    c.id.nonce = *replans;
                }
                let c = *c;
                Self::send(&mut s, Msg::Commit { c, orphan: false });
            }
            Action::GiveUp(w) => s.workers[w as usize] = Worker::Idle,
            Action::Recover | Action::FireTimer | Action::DrainInbox => {
                let what = match action {
                    Action::Recover => What::Recover,
                    Action::FireTimer => What::Timer,
                    _ => What::Inbox,
                };
                let c = self.scheduler_plan(&s, what)?;
                s.scheduler.pending = Some(c);
                Self::send(&mut s, Msg::Commit { c, orphan: false });
            }
            Action::Rescan => s.scheduler.pending = None,
            Action::Send => {
                let attempt = s.api.sent;
                s.api.sent += 1;
                Self::send(&mut s, Msg::Send { attempt });
            }
            Action::Deliver(m) => {
                if !Self::take(&mut s, &m) {
                    return None;
                }
                let reply = self.process(&mut s, m);
                if !m.orphan() {
                    Self::receive(&mut s, reply);
                }
            }
            Action::LoseReply(m) => {
                if !Self::take(&mut s, &m) {
                    return None;
                }
                self.process(&mut s, m);
                s.faults += 1;
            }
            Action::Lose(m) => {
                if !Self::take(&mut s, &m) {
                    return None;
                }
                s.faults += 1;
            }
            Action::Duplicate(m) => {
                Self::send(&mut s, m);
                s.faults += 1;
            }
            Action::Crash(w) => {
                s.workers[w as usize] = Worker::Idle;
                let net = std::mem::take(&mut s.net);
                for m in net {
                    Self::send(
                        &mut s,
                        if m.worker() == Some(w) {
                            m.orphaned()
                        } else {
                            m
                        },
                    );
                }
                s.faults += 1;
            }
            Action::Abandon => {
                s.scheduler.pending = None;
                s.scheduler.nonce += 1;
                s.faults += 1;
            }
        }
        Self::forget_unreachable_ids(&mut s);
        Some(s)
    }

    fn within_boundary(&self, s: &State) -> bool {
        s.row.token <= self.cfg.max_token && s.now <= self.cfg.horizon()
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("at most one accepted write per sequence", |_, s: &State| {
                s.broken & broke::OVERLAP == 0
            }),
            Property::always(
                "no write with a token older than the newest grant",
                |_, s: &State| s.broken & broke::STALE_TOKEN == 0,
            ),
            Property::always("no leased write after the lease expired", |_, s: &State| {
                s.broken & broke::EXPIRED_LEASE == 0
            }),
            Property::always("at most one live lease", |_, s: &State| {
                LeaseModel::live_holders(s) <= 1
            }),
            Property::always("sequences are contiguous", |_, s: &State| {
                s.broken & (broke::GAP | broke::OVERLAP) == 0
            }),
            Property::always("a terminal run accepts nothing", |_, s: &State| {
                s.broken & broke::AFTER_TERMINAL == 0
            }),
            Property::always("a keyed event is applied at most once", |_, s: &State| {
                s.signals_applied <= 1
            }),
            Property::always(
                "within the bounds of the check",
                |m: &LeaseModel, s: &State| {
                    s.row.token < m.cfg.max_token && s.now < m.cfg.horizon()
                },
            ),
            Property::sometimes("a take-over happens", |_, s: &State| s.taken_over),
            Property::sometimes("a fenced write is refused", |_, s: &State| s.fenced),
            Property::sometimes("the run finishes", |_, s: &State| {
                s.row.view.control == Control::Done
            }),
            Property::sometimes("a keyed event waits in the inbox", |_, s: &State| {
                s.row.inbox != 0
            }),
            // Liveness: "every run finishes when faults stop". Faults (lost, duplicated or
            // abandoned requests, lost replies, crashes) and pauses (any process sleeping
            // through a clock tick) happen only while the clock is below `free_ticks`; from
            // then on no fault happens and the clock moves only when nobody can act (all wait
            // for a lease to run out or a timer to come due), which stands for "every process
            // eventually takes its next step". stateright judges `eventually` at the ends of
            // paths (states with no successor); every path of this model is finite and acyclic
            // (the test `the_state_graph_has_no_cycles` walks the whole graph to confirm it),
            // and `Done` is never left once reached, so what is checked is: every reachable
            // state in which nothing more can happen has the run finished, whatever faults and
            // pauses came before.
            Property::eventually("the run finishes once faults stop", |_, s: &State| {
                s.row.view.control == Control::Done
            }),
        ]
    }
}
