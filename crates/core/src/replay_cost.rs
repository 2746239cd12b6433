//! What replaying a stored log may cost, known before the replay starts, and how a replay is
//! stopped when nobody waits for its answer any more.
//!
//! A replay's work is its events times what one event may take: the reducer's own work
//! ([`EVENT_STEPS`]) plus the guards of the costliest decision of the definition
//! ([`guard_steps_bound`]), in the same evaluation steps as the guards' cost model
//! ([`crate::guard::GuardCost`]). Like that model, it never looks at a clock: the same log and
//! definitions give the same cost everywhere, so a refusal is the same on every server.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::Definition;
use crate::guard::DataSize;
use crate::limits;

/// Most steps one replay served to a remote caller may take (what-if, verify): some 4 s at
/// the guards' typical 13 ns a step, 12 s at their slowest 40. A what-if of 300,000 events
/// on definitions without guards fits; one of 10,000 events on a definition whose guards may
/// take a million steps an event does not (`rein replay`, which has no such limit, does it).
pub const REPLAY_COST_MAX: u64 = 300_000_000;
/// Steps charged for the reducer's own work on one event (applying it to a copy of the
/// projection, choosing among the candidates), guards aside.
pub const EVENT_STEPS: u64 = 500;
/// Steps charged for one guard that is a registered function rather than an expression
/// (functions have no cost model; they are the engine's own and cheap).
pub const FUNCTION_GUARD_STEPS: u64 = 100;
/// A replay looks at its [`Cancel`] flag once every this many events.
pub const CANCEL_CHECK_EVERY: u64 = 64;

/// Upper bound of the steps the guards of one decision of `def` may take (the candidates of
/// one event in one state, one tool's approval rule, one join guard), at the data size its
/// registration was checked at: the constants or [`limits::GUARD_DATA_REF`], whichever is
/// larger. Never more than [`limits::GUARD_STEPS_MAX`], past which a guard is not evaluated.
pub fn guard_steps_bound(def: &Definition) -> u64 {
    let inner = &def.inner;
    let data = DataSize::of(&serde_json::to_value(&inner.spec.constants).unwrap_or_default())
        .max(DataSize::reference());
    let expr_steps = |e: &crate::guard::Expr| e.cost().steps(data);
    let events = inner.table.values().map(|candidates| {
        candidates
            .iter()
            .flat_map(|t| t.guards.iter())
            .map(|g| g.expr().map_or(FUNCTION_GUARD_STEPS, expr_steps))
            .fold(0u64, u64::saturating_add)
    });
    let rules = inner
        .approval_rules
        .values()
        .chain(inner.join_guards.values())
        .map(|e| expr_steps(e));
    events
        .chain(rules)
        .max()
        .unwrap_or(0)
        .min(limits::GUARD_STEPS_MAX)
}

/// Upper bound of the steps replaying `events` events takes, once on each of `defs`, when each
/// event may run its decision's guards `guard_runs` times on each (a what-if both explains
/// the candidates and applies the event: twice).
pub fn replay_cost(events: u64, defs: &[&Definition], guard_runs: u64) -> u64 {
    let per_event = defs
        .iter()
        .map(|d| EVENT_STEPS.saturating_add(guard_steps_bound(d).saturating_mul(guard_runs)))
        .fold(0u64, u64::saturating_add);
    events.saturating_mul(per_event)
}

/// Asks a replay to stop: set by whoever waits for it when it stops waiting, looked at by
/// the replay every [`CANCEL_CHECK_EVERY`] events. Also counts the events the replay went
/// through. Clones share the flag and the count.
#[derive(Clone, Default, Debug)]
pub struct Cancel(Arc<Shared>);

#[derive(Default, Debug)]
struct Shared {
    cancelled: AtomicBool,
    events: AtomicU64,
}

impl Cancel {
    pub fn new() -> Cancel {
        Cancel::default()
    }

    /// Asks the replay to stop at its next look.
    pub fn cancel(&self) {
        self.0.cancelled.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.cancelled.load(Ordering::Relaxed)
    }

    /// Events the replays watched by this flag went through.
    pub fn events(&self) -> u64 {
        self.0.events.load(Ordering::Relaxed)
    }

    /// `events` until the flag is set (looked at on the first and every
    /// [`CANCEL_CHECK_EVERY`]th one), each one counted. A replay cut short this way ends
    /// early with a meaningless answer: its caller checks [`Cancel::is_cancelled`].
    pub fn until_cancelled<I: Iterator>(&self, events: I) -> impl Iterator<Item = I::Item> {
        let shared = self.0.clone();
        events.take_while(move |_| {
            let n = shared.events.fetch_add(1, Ordering::Relaxed);
            !(n.is_multiple_of(CANCEL_CHECK_EVERY) && shared.cancelled.load(Ordering::Relaxed))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Format, GuardRegistry};

    fn def(guard: &str) -> Definition {
        let text = format!(
            r#"
name = "loop"
version = 1
events = ["PING"]
cancel_state = "DONE"
[[states]]
name = "DONE"
kind = "terminal"
[[states]]
name = "A"
kind = "waiting"
initial = true
[[transitions]]
from = "A"
event = "PING"
to = "A"
{guard}
"#
        );
        Definition::parse(&text, Format::Toml, &GuardRegistry::new()).unwrap()
    }

    #[test]
    fn the_cost_is_the_events_times_the_costliest_decision_and_the_reducer() {
        let plain = def("");
        assert_eq!(guard_steps_bound(&plain), 0);
        assert_eq!(replay_cost(10, &[&plain], 2), 10 * EVENT_STEPS);
        let guarded = def(r#"guard = "run.data.items.exists(i, i == 'x')""#);
        let bound = guard_steps_bound(&guarded);
        assert!(bound > 4_096 && bound <= limits::GUARD_STEPS_MAX, "{bound}");
        assert_eq!(
            replay_cost(10, &[&plain, &guarded], 2),
            10 * (2 * EVENT_STEPS + 2 * bound)
        );
        // 300,000 events on definitions without guards fit; 10,000 on guards of a million
        // steps an event do not.
        assert!(replay_cost(300_000, &[&plain, &plain], 2) <= REPLAY_COST_MAX);
        const { assert!(10_000 * limits::GUARD_STEPS_MAX > REPLAY_COST_MAX) };
    }

    #[test]
    fn a_cancelled_replay_stops_at_its_next_look() {
        let cancel = Cancel::new();
        let seen = cancel.until_cancelled(0..1_000).take(10).count();
        assert_eq!((seen, cancel.events()), (10, 10));
        cancel.cancel();
        let later = Cancel::new();
        later.cancel();
        assert_eq!(later.until_cancelled(0..1_000).count(), 0);
        let seen = cancel.until_cancelled(0..1_000).count() as u64;
        assert!(seen < CANCEL_CHECK_EVERY, "{seen}");
    }
}
