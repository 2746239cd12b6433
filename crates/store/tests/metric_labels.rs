//! Tenant-written names as metric labels (SPEC O2, Z1): a definition with hundreds of states
//! and events, hundreds of definitions and a caller sending made-up event names leave at most
//! `METRIC_LABEL_VALUES_MAX` + 1 values (`other`) per label of each family on `/metrics`, and
//! nothing is lost: the counts that fall into `other` still add up.
//!
//! A test binary of its own: it installs the process-wide Prometheus recorder.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};

use rein_core::limits::{METRIC_LABEL_VALUES_MAX, STATES_MAX};
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::metrics as m;
use rein_store::{INBOX_TTL_MS_DEFAULT, Sender, Store, StoreError};
use serde_json::json;

/// The values of every label of family `name` in Prometheus text, and the sum of its samples
/// (of `_count` for a histogram or a summary).
fn family(text: &str, name: &str) -> (BTreeMap<String, BTreeSet<String>>, f64) {
    let mut labels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut total = 0.0;
    // A histogram or summary is counted by its `_count`.
    let distribution = [" histogram", " summary"]
        .iter()
        .any(|t| text.contains(&format!("# TYPE {name}{t}")));
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (series, counted) = if let Some(r) = rest.strip_prefix("_count") {
            (r, true)
        } else if rest.starts_with('{') || rest.starts_with(' ') {
            (rest, !distribution)
        } else {
            continue;
        };
        if let Some(inner) = series.strip_prefix('{').and_then(|r| r.split_once('}')) {
            for pair in inner.0.split("\",") {
                let (k, v) = pair.split_once("=\"").expect("label=\"value\"");
                if k != "le" && k != "quantile" {
                    labels
                        .entry(k.to_owned())
                        .or_default()
                        .insert(v.trim_end_matches('"').to_owned());
                }
            }
        }
        if counted {
            total += series
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
        }
    }
    (labels, total)
}

/// s0 -e0-> s1 -e1-> ... -> s{n}, the last state taking `extra` more events as self-loops.
fn chain(name: &str, states: usize, extra: usize) -> Definition {
    let mut events: Vec<String> = (0..states + extra).map(|i| format!("e{i}")).collect();
    events.sort();
    let mut spec_states = vec![json!({ "name": "cancelled", "kind": "terminal" })];
    let mut transitions = Vec::new();
    for i in 0..states {
        spec_states.push(json!({ "name": format!("s{i}"), "kind": "active", "initial": i == 0 }));
        if i + 1 < states {
            transitions.push(json!({ "from": format!("s{i}"), "event": format!("e{i}"),
                                     "to": format!("s{}", i + 1) }));
        }
    }
    let last = format!("s{}", states - 1);
    for i in states - 1..states + extra {
        transitions.push(json!({ "from": last, "event": format!("e{i}"), "to": last }));
    }
    let body = json!({
        "name": name,
        "version": 1,
        "cancel_state": "cancelled",
        "events": events,
        "external_events": events,
        "max_events": 100_000,
        "states": spec_states,
        "transitions": transitions,
    });
    Definition::parse(&body.to_string(), Format::Json, &GuardRegistry::new())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

async fn send(store: &Store, run: uuid::Uuid, kind: &str) -> Result<(), StoreError> {
    store
        .send(
            run,
            kind,
            json!({}),
            &Sender::outside("api:tenant"),
            INBOX_TTL_MS_DEFAULT,
        )
        .await
        .map(|_| ())
}

#[tokio::test]
async fn tenant_names_take_a_bounded_number_of_label_values_per_family() {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("the only recorder of this test binary");
    m::describe();
    let store = common::store("metric_labels").await;

    // One definition with the most states it may have, and more events than states.
    let states = STATES_MAX - 1;
    let def = chain("many-states", states, 2 * METRIC_LABEL_VALUES_MAX);
    store.register_definition(&def).await.unwrap();
    let run = common::enqueue(&store, &def, json!({})).await;
    let mut committed = 0.0;
    for i in 0..states - 1 + 2 * METRIC_LABEL_VALUES_MAX {
        send(&store, run, &format!("e{i}")).await.unwrap();
        committed += 1.0;
    }
    // Event names no definition declares: refused, and counted.
    for i in 0..2 * METRIC_LABEL_VALUES_MAX {
        let refused = send(&store, run, &format!("made-up-{i}")).await;
        assert!(
            matches!(refused, Err(StoreError::InvalidTransition(_))),
            "{refused:?}"
        );
    }
    // Many definitions, one event each.
    let definitions = METRIC_LABEL_VALUES_MAX + 20;
    for d in 0..definitions {
        let def = chain(&format!("tenant-{d}"), 2, 0);
        store.register_definition(&def).await.unwrap();
        let run = common::enqueue(&store, &def, json!({})).await;
        send(&store, run, "e0").await.unwrap();
        committed += 1.0;
    }

    let text = handle.render();
    let cap = METRIC_LABEL_VALUES_MAX + 1;
    for (name, label) in [
        (m::TRANSITIONS, "event"),
        (m::TRANSITIONS, "definition"),
        (m::TIME_IN_STATE, "state"),
        (m::TIME_IN_STATE, "definition"),
        (m::INVALID_TRANSITIONS, "event"),
    ] {
        let (labels, _) = family(&text, name);
        let values = labels.get(label).cloned().unwrap_or_default();
        assert!(
            values.len() <= cap,
            "{name} has {} values of `{label}`",
            values.len()
        );
        assert!(values.contains("other"), "{name} `{label}`: {values:?}");
    }
    // What counts as `other` is still counted.
    let (_, transitions) = family(&text, m::TRANSITIONS);
    assert_eq!(transitions, committed);
    let (_, refused) = family(&text, m::INVALID_TRANSITIONS);
    assert_eq!(refused, (2 * METRIC_LABEL_VALUES_MAX) as f64);
    let (_, left) = family(&text, m::TIME_IN_STATE);
    assert_eq!(left, (states - 1 + definitions) as f64);
    // The help text says so.
    let help = format!("# HELP {} ", m::TRANSITIONS);
    let line = text
        .lines()
        .find(|l| l.starts_with(&help))
        .expect("help text");
    assert!(
        line.contains(&format!("at most {METRIC_LABEL_VALUES_MAX}")),
        "{line}"
    );
    let series = text.lines().filter(|l| !l.starts_with('#')).count();
    println!("/metrics: {} bytes, {series} series lines", text.len());
}
