//! Exhaustive checks of the lease protocol model, and of models with one predicate removed:
//! the checker must find the counterexample each removed predicate prevents.

use std::collections::BTreeSet;
use std::time::Instant;

use rein_protocol_model::{Config, Flaws, LeaseModel};
use stateright::{Checker, HasDiscoveries, Model};

/// The safety properties, the `sometimes` examples and the liveness property all hold for the
/// protocol as implemented, over every interleaving within the bounds.
#[test]
fn the_protocol_keeps_every_property() {
    let cfg = Config::small();
    let started = Instant::now();
    let checker = LeaseModel::new(cfg.clone()).checker().spawn_bfs().join();
    println!(
        "protocol ({} workers, {} fault, {} free ticks, ttl {}): {} unique states ({} generated), depth {}, {:.1?}",
        cfg.workers,
        cfg.faults,
        cfg.free_ticks,
        cfg.ttl,
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
}

/// The same with three workers competing for the run, over one tick of pauses fewer.
#[test]
fn three_workers_keep_every_property() {
    let cfg = Config {
        workers: 3,
        free_ticks: 2,
        ..Config::small()
    };
    let started = Instant::now();
    let checker = LeaseModel::new(cfg).checker().spawn_bfs().join();
    println!(
        "three workers: {} unique states ({} generated), depth {}, {:.1?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
}

/// Runs the model with `flaws` until `property` is violated; returns the counterexample's
/// length in steps, printing it.
fn violation(flaws: Flaws, property: &'static str) -> usize {
    let model = LeaseModel::new(Config::small().with_flaws(flaws));
    assert!(
        model.properties().iter().any(|p| p.name == property),
        "no property named {property:?}"
    );
    let started = Instant::now();
    let checker = model
        .checker()
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let Some(path) = checker.discovery(property) else {
        panic!(
            "{flaws:?}: no counterexample to {property:?} in {} states",
            checker.unique_state_count()
        );
    };
    let actions = path.clone().into_actions();
    println!(
        "{flaws:?} violates {property:?} after {} steps ({} states, {:.1?}):",
        actions.len(),
        checker.unique_state_count(),
        started.elapsed()
    );
    for a in &actions {
        println!("  {a:?}");
    }
    println!("  last state: {:?}", path.last_state());
    actions.len()
}

#[test]
fn without_the_lease_expiry_check_a_late_write_lands() {
    let flaws = Flaws {
        no_lease_expiry: true,
        ..Flaws::default()
    };
    assert!(violation(flaws, "no leased write after the lease expired") > 0);
}

#[test]
fn without_the_token_check_a_stale_writer_lands() {
    let flaws = Flaws {
        no_token_check: true,
        ..Flaws::default()
    };
    assert!(violation(flaws, "no write with a token older than the newest grant") > 0);
}

#[test]
fn a_claim_that_takes_a_live_lease_makes_two_holders() {
    let flaws = Flaws {
        claim_takes_live_lease: true,
        ..Flaws::default()
    };
    assert!(violation(flaws, "at most one live lease") > 0);
}

#[test]
fn without_event_ids_a_keyed_event_is_applied_twice() {
    let flaws = Flaws {
        no_event_ids: true,
        ..Flaws::default()
    };
    assert!(violation(flaws, "a keyed event is applied at most once") > 0);
}

/// The liveness property is not vacuous: without lease recovery a crashed holder's run never
/// finishes.
#[test]
fn without_lease_recovery_a_crashed_holder_strands_its_run() {
    let flaws = Flaws {
        no_lease_recovery: true,
        ..Flaws::default()
    };
    assert!(violation(flaws, "the run finishes once faults stop") > 0);
}

/// The sequence predicate guards against a writer whose retried commit carries new event ids:
/// with it, such a writer is only fenced; without it, its commit lands at a sequence already
/// written.
#[test]
fn without_the_sequence_check_a_replanned_commit_writes_a_sequence_twice() {
    let flaws = Flaws {
        no_sequence_check: true,
        worker_replans: true,
        ..Flaws::default()
    };
    assert!(violation(flaws, "at most one accepted write per sequence") > 0);
}

#[test]
fn a_worker_that_replans_is_still_fenced_by_the_sequence_check() {
    // One tick fewer than `Config::small`, to keep the suite short.
    let cfg = Config {
        free_ticks: 2,
        ..Config::small()
    }
    .with_flaws(Flaws {
        worker_replans: true,
        ..Flaws::default()
    });
    let started = Instant::now();
    let checker = LeaseModel::new(cfg).checker().spawn_bfs().join();
    println!(
        "replanning workers: {} unique states, {:.1?}",
        checker.unique_state_count(),
        started.elapsed()
    );
    checker.assert_properties();
}

/// `eventually` is only sound on a model without cycles (stateright treats a path that
/// returns to a state it has seen as not ending). Walks the whole state graph depth-first and
/// fails on a back edge.
#[test]
fn the_state_graph_has_no_cycles() {
    use std::collections::HashMap;
    let model = LeaseModel::new(Config::small());
    // false: on the current path; true: finished.
    let mut seen: HashMap<rein_protocol_model::State, bool> = HashMap::new();
    let mut stack = Vec::new();
    for init in model.init_states() {
        seen.insert(init.clone(), false);
        stack.push((init, None::<Vec<_>>));
        while let Some((state, next)) = stack.last_mut() {
            let next = next.get_or_insert_with(|| {
                let mut actions = Vec::new();
                model.actions(state, &mut actions);
                actions
                    .into_iter()
                    .filter_map(|a| model.next_state(state, a))
                    .filter(|s| model.within_boundary(s))
                    .collect()
            });
            match next.pop() {
                Some(child) => match seen.get(&child) {
                    Some(false) => {
                        let from = stack
                            .iter()
                            .position(|(s, _)| *s == child)
                            .expect("on the path");
                        for (s, _) in &stack[from..] {
                            println!("{s:?}");
                        }
                        panic!("cycle through {child:?}")
                    }
                    Some(true) => {}
                    None => {
                        seen.insert(child.clone(), false);
                        stack.push((child, None));
                    }
                },
                None => {
                    let (done, _) = stack.pop().expect("a state on the path");
                    seen.insert(done, true);
                }
            }
        }
    }
    println!("no cycles among {} states", seen.len());
}
