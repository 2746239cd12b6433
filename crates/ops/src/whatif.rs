//! What-if replay of stored runs (`rein replay RUN --definition …`, `rein replay --all`):
//! the logs are read from the store and compared by the pure [`rein_core::whatif::compare`];
//! nothing is written and no action runs.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use rein_core::Definition;
use rein_core::replay_cost::Cancel;
use rein_core::whatif::{self, Verdict, WhatIf};
use rein_store::{Store, WhatIfRuns};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::error::Error;

/// Runs `--all` compares unless told otherwise.
pub const RUNS_DEFAULT: usize = 1_000;
/// Most runs one `--all` compares.
pub const RUNS_MAX: usize = 100_000;
/// Divergences a summary shows as examples.
pub const EXAMPLES_MAX: usize = 20;
/// Runs read (with their logs) at once.
const PAGE_RUNS: usize = 100;

/// The definition a what-if replays on, as named: `NAME@VERSION` (registered), a definition
/// file, or `NAME` (the name's current registered version).
pub async fn resolve_definition(store: &Store, named: &str) -> Result<Definition, Error> {
    if std::path::Path::new(named).is_file() {
        return crate::load_definition(named).map_err(|e| {
            Error::validation(format!("--definition {named}: {e}"))
                .with_details(json!({ "field": "definition" }))
        });
    }
    registered_definition(store, named).await
}

/// [`resolve_definition`] for a remote caller: only a registered version, never a file on
/// the server's disk.
pub async fn registered_definition(store: &Store, named: &str) -> Result<Definition, Error> {
    let (name, version) = split_version(named)?;
    if let Some(problem) = rein_core::name_problem(name) {
        return Err(Error::validation(format!("definition `{name}`: {problem}"))
            .with_details(json!({ "field": "definition" })));
    }
    Ok(store.load_definition(name, version).await?)
}

/// `NAME@VERSION` as its parts; a bare name has no version.
pub fn split_version(named: &str) -> Result<(&str, Option<u32>), Error> {
    let Some((name, version)) = named.rsplit_once('@') else {
        return Ok((named, None));
    };
    match version.parse::<u32>() {
        Ok(v) if (1..=rein_core::limits::VERSION_MAX).contains(&v) && !name.is_empty() => {
            Ok((name, Some(v)))
        }
        _ => Err(Error::validation(format!(
            "`{named}` is neither a file nor NAME@VERSION (a version is 1..={}); `rein \
             definitions list --registered` shows the registered ones",
            rein_core::limits::VERSION_MAX
        ))
        .with_details(json!({ "field": "definition" }))),
    }
}

fn named(def: &Definition) -> Value {
    json!({ "name": def.name(), "version": def.version(), "hash": def.hash() })
}

fn report(run_id: Uuid, old: &Definition, new: &Definition, w: &WhatIf, from: u64) -> Value {
    let mut out = json!({
        "run_id": run_id,
        "recorded_definition": named(old),
        "definition": named(new),
    });
    if from > 0 {
        // A migrated run: what came before stays the versions' it ran on.
        out["compared_after"] = json!({
            "sequence": from,
            "why": format!(
                "the run was migrated to version {} at sequence {from}; the events up to there \
                 are replayed on the versions they ran on",
                old.version()
            ),
        });
    }
    if let (Some(map), Ok(Value::Object(fields))) = (out.as_object_mut(), serde_json::to_value(w)) {
        map.extend(fields);
    }
    out
}

/// Replays stored run `run_id` on its own definition version and on `new`: the first event
/// `new` decides differently, or that it decides them all the same.
pub async fn run(store: &Store, run_id: Uuid, new: &Definition) -> Result<Value, Error> {
    let replay = Replay::load(store, run_id, new.clone()).await?;
    Ok(replay.compare(&Cancel::new()).unwrap_or_default())
}

/// One run's what-if, read from the store and ready to replay: the replay itself touches
/// nothing but memory, so it can run wherever its caller likes.
pub struct Replay {
    run_id: Uuid,
    /// The version the run is on now.
    pub old: Definition,
    pub new: Definition,
    /// Every version its log names, by number.
    pub versions: BTreeMap<u32, Definition>,
    input: Value,
    pub events: Vec<rein_core::Event>,
}

impl Replay {
    /// Reads `run_id`'s log, its input and the versions it ran on.
    pub async fn load(store: &Store, run_id: Uuid, new: Definition) -> Result<Replay, Error> {
        let row = store.run(run_id).await?;
        let old = store
            .load_definition(&row.definition, Some(row.version))
            .await?;
        let input = store.run_input(run_id).await?;
        let events: Vec<rein_core::Event> = store
            .history(run_id)
            .await?
            .iter()
            .map(|e| e.as_event())
            .collect();
        let versions = store
            .log_definitions(&row.definition, row.version, &events)
            .await?;
        Ok(Replay {
            run_id,
            old,
            new,
            versions,
            input,
            events,
        })
    }

    /// [`crate::recovery::replay_budget`] of this what-if, now that the versions its log ran
    /// on are known: its events on the costliest of them and on the other definition.
    pub fn budget(&self) -> Result<u64, Error> {
        let costliest = self
            .versions
            .values()
            .chain([&self.old])
            .max_by_key(|d| rein_core::replay_cost::guard_steps_bound(d))
            .unwrap_or(&self.old);
        crate::recovery::replay_budget(
            crate::recovery::Replayed::WhatIf,
            self.run_id,
            self.events.len() as u64,
            &[costliest, &self.new],
        )
    }

    /// The report of the comparison, or `None` when `cancel` was set before it ended.
    pub fn compare(&self, cancel: &Cancel) -> Option<Value> {
        let def_of = |v| self.versions.get(&v);
        let (w, from) = whatif::compare_across_until(
            &def_of,
            &self.old,
            &self.new,
            self.input.clone(),
            &self.events,
            cancel,
        )?;
        Some(report(self.run_id, &self.old, &self.new, &w, from))
    }
}

/// Which runs `--all` compares.
pub struct AllRuns<'a> {
    pub definition: &'a str,
    pub version: Option<u32>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// At most this many (1 to [`RUNS_MAX`]), the oldest first.
    pub limit: usize,
    /// Whether the answer lists every run's report (`runs`), not only the summary.
    pub every_run: bool,
}

/// Replays every run `of` names (oldest first, at most its limit) on `new`, telling
/// `progress` how many are done after each page: how many would end the same, diverge, be
/// refused or do not replay, up to [`EXAMPLES_MAX`] examples, and (when asked) every run's
/// report.
pub async fn all(
    store: &Store,
    of: AllRuns<'_>,
    new: &Definition,
    progress: &mut dyn FnMut(usize),
) -> Result<Value, Error> {
    if !(1..=RUNS_MAX).contains(&of.limit) {
        return Err(Error::validation(format!(
            "--limit is 1 to {RUNS_MAX} runs, not {}; compare more in windows (--since, --until)",
            of.limit
        ))
        .with_details(json!({ "field": "limit" })));
    }
    if let (Some(since), Some(until)) = (of.since, of.until)
        && since >= until
    {
        return Err(Error::validation(format!(
            "--since ({since}) must be before --until ({until})"
        ))
        .with_details(json!({ "field": "since" })));
    }
    let window = WhatIfRuns {
        definition: of.definition,
        version: of.version,
        since: of.since,
        until: of.until,
    };
    let mut versions: HashMap<u32, Definition> = HashMap::new();
    let mut counts: BTreeMap<&'static str, usize> = [
        Verdict::Same,
        Verdict::Diverged,
        Verdict::Refused,
        Verdict::Unreplayable,
    ]
    .into_iter()
    .map(|v| (v.as_str(), 0))
    .collect();
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    let mut runs: Vec<Value> = Vec::new();
    let mut examples: Vec<Value> = Vec::new();
    let mut after = None;
    let mut more = false;
    let mut compared = 0;
    while compared < of.limit {
        // One more than wanted tells whether runs were left out for the limit.
        let wanted = (of.limit - compared).min(PAGE_RUNS);
        let mut page = store.whatif_runs(&window, after, wanted as i64 + 1).await?;
        more = page.len() > wanted;
        page.truncate(wanted);
        let Some(last) = page.last() else { break };
        after = Some((last.created_at, last.run_id));
        let ids: Vec<Uuid> = page.iter().map(|r| r.run_id).collect();
        let mut logs = store.histories(&ids).await?;
        for run in page {
            let old = match versions.get(&run.version) {
                Some(d) => d.clone(),
                None => {
                    let d = store
                        .load_definition(of.definition, Some(run.version))
                        .await?;
                    versions.insert(run.version, d.clone());
                    d
                }
            };
            let events = logs.remove(&run.run_id).unwrap_or_default();
            // A migrated run's earlier versions, each loaded once.
            for v in rein_core::migration::versions_in_log(run.version, events.iter()) {
                if let std::collections::hash_map::Entry::Vacant(slot) = versions.entry(v) {
                    slot.insert(store.load_definition(of.definition, Some(v)).await?);
                }
            }
            let (w, from) =
                whatif::compare_across(&|v| versions.get(&v), &old, new, run.input, &events);
            *counts.entry(w.verdict.as_str()).or_default() += 1;
            if let Some(d) = &w.divergence {
                let kind = serde_json::to_value(d.kind)
                    .ok()
                    .and_then(|k| k.as_str().map(str::to_owned))
                    .unwrap_or_default();
                *by_kind.entry(kind).or_default() += 1;
            }
            let one = report(run.run_id, &old, new, &w, from);
            if w.verdict != Verdict::Same && examples.len() < EXAMPLES_MAX {
                examples.push(one.clone());
            }
            compared += 1;
            if of.every_run {
                runs.push(one);
            }
        }
        progress(compared);
        if !more {
            break;
        }
    }
    Ok(json!({
        "definition": named(new),
        "source": { "name": of.definition, "version": of.version },
        "since": of.since,
        "until": of.until,
        "compared": compared,
        "limit": of.limit,
        "truncated": more,
        "counts": counts,
        "by_kind": by_kind,
        "examples": examples,
        "runs": of.every_run.then_some(runs),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_definition_is_named_with_or_without_its_version() {
        assert_eq!(
            split_version("refund-agent@2").ok(),
            Some(("refund-agent", Some(2)))
        );
        assert_eq!(
            split_version("refund-agent").ok(),
            Some(("refund-agent", None))
        );
        for bad in ["refund-agent@", "refund-agent@0", "refund-agent@x", "@3"] {
            assert!(split_version(bad).is_err(), "{bad}");
        }
    }
}
