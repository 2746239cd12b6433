//! Bounded sets of metric label values (SPEC O2, Z1). Definition, state, event, queue and
//! limit names are written by tenants; as Prometheus label values each distinct one is a new
//! series, so a definition with thousands of states could blow up `/metrics`. Each label of
//! each metric family admits its first [`limits::METRIC_LABEL_VALUES_MAX`] distinct values;
//! every later one is recorded as [`OTHER`]. Deterministic for a given order of recordings,
//! and a lookup in a small sorted set under a lock: cheap enough for every commit.
//!
//! No global here: the crates that record metrics own a `static` of their own.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use crate::limits;

/// The value recorded once a label has admitted its share of distinct values.
pub const OTHER: &str = "other";

/// The values admitted so far, per (metric family, label).
#[derive(Debug, Default)]
pub struct LabelValues {
    admitted: Mutex<BTreeMap<(&'static str, &'static str), BTreeSet<String>>>,
}

impl LabelValues {
    pub const fn new() -> Self {
        LabelValues {
            admitted: Mutex::new(BTreeMap::new()),
        }
    }

    /// `value` as label `label` of `family` records it: itself while the label has room or
    /// once admitted, else [`OTHER`].
    pub fn value(&self, family: &'static str, label: &'static str, value: &str) -> String {
        let Ok(mut admitted) = self.admitted.lock() else {
            return OTHER.to_owned();
        };
        let values = admitted.entry((family, label)).or_default();
        if values.contains(value) {
            return value.to_owned();
        }
        if values.len() < limits::METRIC_LABEL_VALUES_MAX {
            values.insert(value.to_owned());
            return value.to_owned();
        }
        OTHER.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_label_admits_its_first_values_and_counts_the_rest_as_other() {
        let labels = LabelValues::new();
        let max = limits::METRIC_LABEL_VALUES_MAX;
        for i in 0..max {
            assert_eq!(
                labels.value("f", "state", &format!("s{i}")),
                format!("s{i}")
            );
        }
        assert_eq!(labels.value("f", "state", "late"), OTHER);
        assert_eq!(
            labels.value("f", "state", "s0"),
            "s0",
            "an admitted value stays"
        );
        // Each label of each family has its own room.
        assert_eq!(labels.value("f", "event", "late"), "late");
        assert_eq!(labels.value("g", "state", "late"), "late");
    }
}
