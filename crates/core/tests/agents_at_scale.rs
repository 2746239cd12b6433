//! Agents at scale in the pure core: join policies decided from branch results and late
//! results refused (SPEC P1), usage accounted and the budget event fired once, large values
//! moved to blobs by hash (SPEC E5) and the resume brief (SPEC D3). No storage: events are
//! applied with the reducer, as storage does.

use proptest::prelude::*;
use rein_core::join::{
    JoinOutcome, Loser, Refusal, TreeBounds, child_run_id, children, losers, outcome,
    refused_events,
};
use rein_core::{
    Definition, Event, Format, GuardRegistry, RejectReason, RunState, apply, follow_up,
};
use serde_json::{Value, json};
use uuid::Uuid;

/// A parent that fans out into `branches` with `join`, and a budget of 1000 tokens.
fn parent(join: &str, branches: &[&str]) -> String {
    let branches: Vec<String> = branches
        .iter()
        .map(|b| format!(r#"{{ name = "{b}", definition = "task", succeed_on = ["DONE"] }}"#))
        .collect();
    format!(
        r#"
name = "fan"
version = 1
cancel_state = "CANCELLED"
events = ["GO", "JOINED", "JOIN_FAILED", "THOUGHT", "BUDGET_EXHAUSTED", "AGAIN"]

[budget]
tokens = 1000
event = "BUDGET_EXHAUSTED"

[[states]]
name = "PLAN"
kind = "active"
initial = true

[[states]]
name = "GATHER"
kind = "waiting"

[states.fan_out]
joined_event = "JOINED"
failed_event = "JOIN_FAILED"
join = {join}
branches = [{branches}]

[[states]]
name = "SUMMARIZE"
kind = "active"

[[states]]
name = "DONE"
kind = "terminal"

[[states]]
name = "FAILED"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "PLAN"
event = "GO"
to = "GATHER"

[[transitions]]
from = "PLAN"
event = "THOUGHT"
to = "PLAN"
guard = "run.tokens_used < budget.tokens"

[[transitions]]
from = "PLAN"
event = "BUDGET_EXHAUSTED"
to = "FAILED"

[[transitions]]
from = "GATHER"
event = "JOINED"
to = "SUMMARIZE"

[[transitions]]
from = "GATHER"
event = "JOIN_FAILED"
to = "FAILED"

[[transitions]]
from = "SUMMARIZE"
event = "AGAIN"
to = "GATHER"

[[transitions]]
from = "SUMMARIZE"
event = "GO"
to = "DONE"
"#,
        branches = branches.join(", ")
    )
}

fn load(text: &str) -> Definition {
    Definition::parse(text, Format::Toml, &GuardRegistry::new()).expect("valid definition")
}

fn at_least(k: u32, branches: &[&str]) -> Definition {
    load(&parent(
        &format!(r#"{{ policy = "at_least", k = {k} }}"#),
        branches,
    ))
}

fn step(def: &Definition, run: &RunState, kind: &str, payload: Value) -> RunState {
    apply(def, run, &Event::new(run.sequence + 1, kind, payload))
        .unwrap_or_else(|e| panic!("{kind} refused: {e}"))
}

/// Applies what the engine would commit on its own after the last event, as storage does.
fn settle(def: &Definition, run: RunState) -> RunState {
    match follow_up(def, &run) {
        Some((kind, payload)) => step(def, &run, &kind, payload),
        None => run,
    }
}

fn result(run: &RunState, branch: &str, ok: bool) -> (String, Value) {
    let kind = if ok {
        "BRANCH_SUCCEEDED"
    } else {
        "BRANCH_FAILED"
    };
    let fan_out = run.join.as_ref().map(|j| j.fan_out);
    (
        kind.to_owned(),
        json!({ "branch": branch, "fan_out": fan_out, "child_run_id": format!("child-{branch}"),
                "state": if ok { "DONE" } else { "FAILED" }, "result": { "from": branch } }),
    )
}

fn deliver(def: &Definition, run: RunState, branch: &str, ok: bool) -> RunState {
    let (kind, payload) = result(&run, branch, ok);
    settle(def, step(def, &run, &kind, payload))
}

fn fanned_out(def: &Definition) -> RunState {
    let run = RunState::initial(def, json!({ "task": "compare three sources" }));
    step(def, &run, "GO", json!({}))
}

#[test]
fn entering_a_fan_out_state_opens_the_join_and_marks_every_branch_running() {
    let def = at_least(2, &["a", "b", "c"]);
    let run = fanned_out(&def);
    assert_eq!(run.state, "GATHER");
    assert_eq!(run.join.as_ref().map(|j| j.fan_out), Some(1));
    for b in ["a", "b", "c"] {
        assert_eq!(run.data["branches"][b]["status"], "running", "branch {b}");
    }
    assert_eq!(follow_up(&def, &run), None, "nothing is decided yet");
}

#[test]
fn at_least_two_of_three_joins_with_two_results_despite_one_failure() {
    let def = at_least(2, &["a", "b", "c"]);
    let run = deliver(&def, fanned_out(&def), "a", true);
    let run = deliver(&def, run, "b", false);
    assert_eq!(run.state, "GATHER", "one success is not enough");
    let run = deliver(&def, run, "c", true);
    assert_eq!(run.state, "SUMMARIZE", "the join fired");
    assert_eq!(run.data["branches"]["a"]["result"], json!({ "from": "a" }));
    assert_eq!(run.data["branches"]["b"]["status"], "failed");
    assert_eq!(run.data["branches"]["c"]["result"], json!({ "from": "c" }));
    assert_eq!(run.join, None, "the join is closed once it fired");
}

#[test]
fn at_least_two_fails_as_soon_as_two_of_three_failed() {
    let def = at_least(2, &["a", "b", "c"]);
    let run = deliver(&def, fanned_out(&def), "a", false);
    assert_eq!(run.state, "GATHER");
    let run = deliver(&def, run, "b", false);
    assert_eq!(run.state, "FAILED", "c alone cannot make two");
}

#[test]
fn policy_all_takes_the_failure_path_on_the_first_failure() {
    let def = load(&parent(r#"{ policy = "all" }"#, &["a", "b", "c"]));
    let run = deliver(&def, fanned_out(&def), "a", true);
    let run = deliver(&def, run, "b", false);
    assert_eq!(run.state, "FAILED");
    assert_eq!(
        run.terminal_reason.as_deref(),
        Some("join_policy_cannot_be_met")
    );
}

#[test]
fn policy_all_joins_when_every_branch_succeeded() {
    let def = load(&parent(r#"{ policy = "all" }"#, &["a", "b"]));
    let run = deliver(&def, fanned_out(&def), "b", true);
    assert_eq!(run.state, "GATHER");
    let run = deliver(&def, run, "a", true);
    assert_eq!(run.state, "SUMMARIZE");
}

#[test]
fn a_guard_policy_joins_when_its_expression_holds() {
    let def = load(&parent(
        r#"{ policy = "guard", guard = "run.data.branches.b.status == 'succeeded'" }"#,
        &["a", "b"],
    ));
    let run = deliver(&def, fanned_out(&def), "a", true);
    assert_eq!(run.state, "GATHER", "the guard wants b");
    let run = deliver(&def, run, "b", true);
    assert_eq!(run.state, "SUMMARIZE");

    let run = deliver(&def, fanned_out(&def), "b", false);
    let run = deliver(&def, run, "a", true);
    assert_eq!(
        run.state, "FAILED",
        "every branch ended and the guard never held"
    );
}

#[test]
fn a_result_after_the_join_fired_is_rejected_and_changes_nothing() {
    let def = at_least(2, &["a", "b", "c"]);
    let gathered = fanned_out(&def);
    let late = result(&gathered, "c", true);
    let run = deliver(&def, gathered, "a", true);
    let run = deliver(&def, run, "b", true);
    assert_eq!(run.state, "SUMMARIZE");
    let err = apply(&def, &run, &Event::new(run.sequence + 1, &late.0, late.1))
        .expect_err("a late result is refused");
    assert!(
        matches!(err.reason, RejectReason::BranchResultRejected { ref branch, .. } if branch == "c"),
        "{err}"
    );
    assert_eq!(run.data["branches"]["c"]["status"], "running");
}

#[test]
fn a_second_result_for_a_branch_and_one_from_an_earlier_fan_out_are_rejected() {
    let def = at_least(2, &["a", "b", "c"]);
    let first = fanned_out(&def);
    let stale = result(&first, "a", true);
    let run = deliver(&def, first, "a", true);
    let (kind, payload) = result(&run, "a", false);
    let twice = apply(&def, &run, &Event::new(run.sequence + 1, &kind, payload));
    assert!(matches!(
        twice.map_err(|e| e.reason),
        Err(RejectReason::BranchResultRejected { .. })
    ));
    // Join, go round again: the new fan-out does not take the old one's results.
    let run = deliver(&def, run, "b", true);
    let again = step(&def, &run, "AGAIN", json!({}));
    assert_eq!(again.data["branches"]["a"]["status"], "running");
    let old = apply(
        &def,
        &again,
        &Event::new(again.sequence + 1, &stale.0, stale.1),
    );
    assert!(matches!(
        old.map_err(|e| e.reason),
        Err(RejectReason::BranchResultRejected { .. })
    ));
}

#[test]
fn children_are_started_once_per_fan_out_with_stable_ids_and_their_inputs() {
    let def = at_least(2, &["a", "b", "c"]);
    let parent_id = Uuid::from_u128(7);
    let run = RunState::initial(
        &def,
        json!({ "branch_inputs": { "b": { "query": "fencing" } } }),
    );
    let run = step(&def, &run, "GO", json!({}));
    let kids = children(&def, parent_id, 0, &run);
    assert_eq!(kids.len(), 3);
    assert_eq!(kids[1].branch, "b");
    assert_eq!(kids[1].input, json!({ "query": "fencing" }));
    assert_eq!(kids[0].run_id, child_run_id(parent_id, 1, "a"));
    assert_ne!(kids[0].run_id, kids[1].run_id);
    assert_ne!(
        child_run_id(parent_id, 1, "a"),
        child_run_id(parent_id, 9, "a")
    );
    assert!(
        children(&def, parent_id, run.sequence, &run).is_empty(),
        "a commit that does not open the fan-out starts nothing"
    );
}

#[test]
fn a_whole_tree_of_branch_ids_is_time_ordered_with_its_root() {
    // Two roots made a millisecond apart, as UUIDv7 does.
    let earlier = Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0001);
    let later = Uuid::from_u128(0x0190_0000_0001_7000_8000_0000_0000_0000);
    let child = child_run_id(earlier, 1, "a");
    let grandchild = child_run_id(child, 3, "b");
    for id in [child, grandchild] {
        assert_eq!(id.get_version_num(), 7, "{id}");
        assert_eq!(id.get_variant(), uuid::Variant::RFC4122, "{id}");
        assert_eq!(id.as_bytes()[..6], earlier.as_bytes()[..6], "{id}");
        // In the earlier root's range of run ids, before any run made after it.
        assert!(id < later, "{id} sorts before {later}");
    }
    assert_ne!(child, grandchild);
    assert_eq!(
        child,
        child_run_id(earlier, 1, "a"),
        "still a function of its inputs"
    );
}

#[test]
fn the_losers_of_a_decided_join_are_named_by_fan_out_and_branch() {
    let def = at_least(1, &["a", "b", "c"]);
    let run = fanned_out(&def);
    let fan_out = run.join.as_ref().expect("open").fan_out;
    assert!(losers(&def, &run).is_empty(), "nothing is decided yet");
    // The state the commit judges: a's result applied, the join's own event not yet.
    let (kind, payload) = result(&run, "a", true);
    let run = step(&def, &run, &kind, payload);
    assert_eq!(
        losers(&def, &run),
        ["b", "c"].map(|b| Loser {
            fan_out,
            branch: b.to_owned()
        })
    );
}

#[test]
fn usage_accumulates_and_the_budget_event_fires_once_when_tokens_run_out() {
    let def = at_least(1, &["a"]);
    let mut run = RunState::initial(&def, json!({}));
    let mut fired = Vec::new();
    for _ in 0..4 {
        run = step(
            &def,
            &run,
            "THOUGHT",
            json!({ "usage": { "tokens": 300, "cost": 0.25 } }),
        );
        if let Some((kind, payload)) = follow_up(&def, &run) {
            fired.push((kind.clone(), payload.clone()));
            run = step(&def, &run, &kind, payload);
            break;
        }
    }
    assert_eq!(run.usage.tokens, 1200);
    assert_eq!(run.usage.cost, 1.0);
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].0, "BUDGET_EXHAUSTED");
    assert_eq!(fired[0].1["budget"], "tokens");
    assert_eq!(run.state, "FAILED");
    assert_eq!(run.usage.exhausted.as_deref(), Some("tokens"));
    assert_eq!(follow_up(&def, &run), None, "it fires once");
}

#[test]
fn a_guard_over_usage_refuses_to_loop_past_the_budget() {
    let def = at_least(1, &["a"]);
    let run = RunState::initial(&def, json!({}));
    let run = step(
        &def,
        &run,
        "THOUGHT",
        json!({ "usage": { "tokens": 1000 } }),
    );
    assert_eq!(
        follow_up(&def, &run).map(|(kind, _)| kind).as_deref(),
        Some("BUDGET_EXHAUSTED"),
        "reaching the limit exactly uses the budget up"
    );
    let again = apply(
        &def,
        &run,
        &Event::new(run.sequence + 1, "THOUGHT", json!({})),
    );
    assert!(
        matches!(
            again.map_err(|e| e.reason),
            Err(RejectReason::GuardFailed { .. })
        ),
        "run.tokens_used < budget.tokens no longer holds"
    );
}

#[test]
fn usage_of_a_bad_shape_is_refused_with_a_clear_reason() {
    let def = at_least(1, &["a"]);
    let run = RunState::initial(&def, json!({}));
    let err = apply(
        &def,
        &run,
        &Event::new(1, "THOUGHT", json!({ "usage": { "tokens": -5 } })),
    )
    .expect_err("negative tokens");
    assert!(err.to_string().contains("usage.tokens"), "{err}");
}

#[test]
fn the_commit_that_crosses_a_budget_counts_in_full_and_the_budget_event_follows_it_at_once() {
    let def = at_least(1, &["a"]);
    let mut run = RunState::initial(&def, json!({}));
    let thought = json!({ "usage": { "tokens": 300 } });
    for used in [300, 600, 900] {
        run = step(&def, &run, "THOUGHT", thought.clone());
        assert_eq!(run.usage.tokens, used);
        assert_eq!(follow_up(&def, &run), None, "under the limit at {used}");
    }
    // The step that crosses 1000 completes: its usage is counted in full, over the limit.
    run = step(&def, &run, "THOUGHT", thought.clone());
    assert_eq!(run.usage.tokens, 1200);
    let (kind, payload) = follow_up(&def, &run).expect("the budget event, in the same commit");
    assert_eq!(kind, "BUDGET_EXHAUSTED");
    assert_eq!(payload["used"].as_f64(), Some(1200.0));
    assert_eq!(payload["limit"].as_f64(), Some(1000.0));
    run = step(&def, &run, &kind, payload);
    assert_eq!(run.state, "FAILED");
    // No step starts after it.
    let next = apply(
        &def,
        &run,
        &Event::new(run.sequence + 1, "THOUGHT", thought),
    );
    assert_eq!(next.map_err(|e| e.reason), Err(RejectReason::Terminal));
}

#[test]
fn a_steps_budget_of_n_lets_n_events_run_and_counts_its_own_event_as_one_more() {
    let text = parent(r#"{ policy = "all" }"#, &["a"]).replace("tokens = 1000", "steps = 3");
    let def = load(&text.replace(r#"guard = "run.tokens_used < budget.tokens""#, ""));
    let mut run = RunState::initial(&def, json!({}));
    let mut thoughts = 0;
    while follow_up(&def, &run).is_none() {
        run = step(&def, &run, "THOUGHT", json!({}));
        thoughts += 1;
        assert!(thoughts <= 3, "a fourth step ran");
    }
    assert_eq!(thoughts, 3);
    let run = settle(&def, run);
    assert_eq!(run.state, "FAILED");
    assert_eq!(run.usage.steps, 4, "3 steps and the budget event");
}

#[test]
fn a_state_with_an_action_that_does_not_take_the_budget_event_is_warned_about() {
    let text = parent(r#"{ policy = "all" }"#, &["a"]).replace(
        "name = \"SUMMARIZE\"\nkind = \"active\"",
        "name = \"SUMMARIZE\"\nkind = \"active\"\naction = \"summarize\"",
    );
    let def = load(&text);
    let warnings = def.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].item.contains("(SUMMARIZE)"), "{warnings:?}");
    assert!(
        warnings[0].reason.contains("BUDGET_EXHAUSTED") && warnings[0].reason.contains("spending"),
        "{warnings:?}"
    );
}

#[test]
fn a_definition_without_a_budget_keeps_its_projection_exactly_as_before() {
    let def = rein_core::builtin::lifecycle();
    let run = RunState::initial(&def, json!({}));
    let run = step(&def, &run, "start", json!({ "usage": { "tokens": 10 } }));
    assert!(run.usage.is_zero());
    let projection = serde_json::to_value(&run).expect("json");
    assert!(projection.get("usage").is_none());
    assert!(projection.get("join").is_none());
}

#[test]
fn validation_names_each_fan_out_and_budget_problem_where_it_is() {
    let bad = parent(r#"{ policy = "at_least", k = 4 }"#, &["a", "b", "c"])
        .replace(
            r#"event = "BUDGET_EXHAUSTED""#,
            r#"event = "NO_SUCH_EVENT""#,
        )
        .replace(r#"joined_event = "JOINED""#, r#"joined_event = "GO""#)
        .replace(
            r#"definition = "task", succeed_on = ["DONE"] }, { name = "b""#,
            r#"definition = "task", succeed_on = [] }, { name = "a""#,
        );
    let problems = Definition::parse(&bad, Format::Toml, &GuardRegistry::new())
        .expect_err("invalid")
        .problems();
    let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
    let has = |needle: &str| {
        assert!(
            text.iter().any(|t| t.contains(needle)),
            "no problem mentions {needle:?}: {text:#?}"
        )
    };
    has("states[1] (GATHER).fan_out.join.k: k = 4 but the state has 3 branches");
    has("budget.event (NO_SUCH_EVENT): unknown event `NO_SUCH_EVENT`");
    has("states[1] (GATHER).fan_out.joined_event: event `GO` does not leave state `GATHER`");
    has("states[1] (GATHER).fan_out.branches[1] (a): duplicate branch `a`");
    has("states[1] (GATHER).fan_out.branches[0] (a).succeed_on");

    let active = parent(r#"{ policy = "all" }"#, &["a"]).replacen(
        "name = \"GATHER\"\nkind = \"waiting\"",
        "name = \"GATHER\"\nkind = \"active\"",
        1,
    );
    let problems = Definition::parse(&active, Format::Toml, &GuardRegistry::new())
        .expect_err("an active fan-out state")
        .problems();
    assert!(
        problems
            .iter()
            .any(|p| p.item == "states[1] (GATHER).fan_out" && p.reason.contains("waiting")),
        "{problems:?}"
    );

    let untaken = parent(r#"{ policy = "all" }"#, &["a"]).replace(
        "[[transitions]]\nfrom = \"PLAN\"\nevent = \"BUDGET_EXHAUSTED\"\nto = \"FAILED\"\n",
        "",
    );
    let problems = Definition::parse(&untaken, Format::Toml, &GuardRegistry::new())
        .expect_err("a budget event no transition takes")
        .problems();
    assert!(
        problems
            .iter()
            .any(|p| p.item.starts_with("budget.event") && p.reason.contains("no transition")),
        "{problems:?}"
    );
}

#[test]
fn large_fields_move_to_blobs_once_and_tampered_content_is_caught() {
    use rein_core::blob::{decode, externalize, reference_of, references};
    let page = json!({ "text": "z".repeat(100_000) });
    let payload = json!({ "result": page, "prompt": page, "call_id": "c1", "note": "small" });
    let (out, blobs) = externalize(&payload, 64 * 1024).expect("fits");
    assert_eq!(blobs.len(), 1, "two equal values, one blob");
    assert_eq!(out["call_id"], "c1");
    assert_eq!(out["note"], "small");
    let r = reference_of(&out["result"]).expect("a reference");
    assert_eq!(reference_of(&out["prompt"]), Some(r.clone()));
    assert_eq!(references(&out).len(), 2);
    assert_eq!(decode(&r, &blobs[0].content).expect("intact"), page);
    let mut tampered = blobs[0].content.clone();
    tampered[10] ^= 1;
    assert!(decode(&r, &tampered).is_err());
    let (again, _) = externalize(&out, 64 * 1024).expect("idempotent");
    assert_eq!(again, out, "a reference is never wrapped again");
}

#[test]
fn the_resume_brief_is_the_same_when_built_twice_and_follows_the_run() {
    use rein_core::brief::{BriefValue, resume_brief};
    let def = rein_core::builtin::refund_agent();
    let run = RunState::initial(&def, json!({ "task": "refund A1" }));
    let look = step(
        &def,
        &run,
        "TOOL_SUCCEEDED",
        json!({ "result": { "found": true } }),
    );
    let big = step(
        &def,
        &look,
        "TOOL_SUCCEEDED",
        json!({ "result": { "page": "p".repeat(5000) } }),
    );
    let brief = resume_brief(&def, &big);
    assert_eq!(
        brief.to_canonical_json(),
        resume_brief(&def, &big.clone()).to_canonical_json()
    );
    assert_eq!(brief.task, BriefValue::Inline(json!("refund A1")));
    assert_eq!(brief.steps_completed, 2);
    assert_eq!(
        brief.steps_done[0].result,
        BriefValue::Inline(json!({ "found": true }))
    );
    assert!(
        matches!(brief.steps_done[1].result, BriefValue::Reference { bytes, .. } if bytes > 5000),
        "a large result is referenced, not copied"
    );
    let pending = brief
        .pending
        .clone()
        .expect("the agent decides its next step");
    assert_eq!((pending.step, pending.status.as_str()), (3, "not_started"));
    assert_ne!(
        resume_brief(&def, &look).to_canonical_json(),
        brief.to_canonical_json()
    );
}

// ---------------------------------------------------------------------------------------
// Bounds on trees of fan-outs (SPEC Z4)

#[test]
fn a_tree_may_grow_to_its_depth_bound_and_start_up_to_its_descendants_bound() {
    let bounds = TreeBounds::default();
    assert_eq!((bounds.depth_max, bounds.descendants_max), (4, 1000));
    assert_eq!(bounds.check(0, 0, 2), Ok(()));
    assert_eq!(
        bounds.check(3, 0, 2),
        Ok(()),
        "children at depth 4 are allowed"
    );
    assert_eq!(
        bounds.check(4, 0, 2),
        Err(Refusal::Depth {
            depth: 4,
            depth_max: 4
        })
    );
    assert_eq!(bounds.check(1, 998, 2), Ok(()), "exactly at the bound");
    let past = bounds.check(1, 999, 2).expect_err("past the bound");
    assert_eq!(past.reason(), "fan_out_descendants_exceeded");
    assert_eq!(
        past.to_string(),
        "its root's tree started 999 runs; 2 more would pass the bound of 1000"
    );
    let none = TreeBounds {
        depth_max: 0,
        descendants_max: 1000,
    };
    assert!(
        none.check(0, 0, 1).is_err(),
        "a depth bound of 0 forbids fan-outs"
    );
}

#[test]
fn a_refused_fan_out_takes_its_failure_path_with_every_branch_failed_for_the_reason() {
    let def = load(&parent(r#"{ policy = "all" }"#, &["a", "b"]));
    let run = fanned_out(&def);
    let refusal = Refusal::Depth {
        depth: 4,
        depth_max: 4,
    };
    let candidates = refused_events(&def, &run, &refusal);
    assert_eq!(
        candidates
            .iter()
            .map(|(k, _)| k.as_str())
            .collect::<Vec<_>>(),
        ["JOIN_FAILED", "CANCEL"],
        "the failed event first, CANCEL when the definition refuses it"
    );
    let (kind, payload) = &candidates[0];
    assert_eq!(payload["refused"], json!({ "depth": 4, "depth_max": 4 }));
    assert_eq!(payload["failed"], json!(["a", "b"]));
    let failed = step(&def, &run, kind, payload.clone());
    assert_eq!(failed.state, "FAILED");
    assert_eq!(
        failed.terminal_reason.as_deref(),
        Some("fan_out_depth_exceeded")
    );
    for b in ["a", "b"] {
        assert_eq!(failed.data["branches"][b]["status"], "failed", "branch {b}");
        assert_eq!(
            failed.data["branches"][b]["reason"],
            "fan_out_depth_exceeded"
        );
    }
    let (kind, payload) = &candidates[1];
    let cancelled = step(&def, &run, kind, payload.clone());
    assert_eq!(cancelled.state, "CANCELLED");
    assert_eq!(
        cancelled.terminal_reason.as_deref(),
        Some("cancelled: fan_out_depth_exceeded")
    );
    assert!(
        refused_events(&def, &failed, &refusal).is_empty(),
        "no fan-out is open any more"
    );
}

#[test]
fn a_join_failed_by_a_refused_branch_carries_the_refusal_up_to_its_own_parent() {
    let def = load(&parent(r#"{ policy = "all" }"#, &["a", "b"]));
    let run = fanned_out(&def);
    let (kind, mut payload) = result(&run, "a", false);
    payload["reason"] = json!("fan_out_descendants_exceeded");
    let run = settle(&def, step(&def, &run, &kind, payload));
    assert_eq!(run.state, "FAILED");
    assert_eq!(
        run.terminal_reason.as_deref(),
        Some("fan_out_descendants_exceeded")
    );
    // Any other failure keeps the join's own reason.
    let run = fanned_out(&def);
    let (kind, mut payload) = result(&run, "a", false);
    payload["reason"] = json!("source unavailable");
    let run = settle(&def, step(&def, &run, &kind, payload));
    assert_eq!(
        run.terminal_reason.as_deref(),
        Some("join_policy_cannot_be_met")
    );
}

proptest! {
    /// Whatever order the results arrive in, `at_least k` joins exactly when at least k
    /// branches succeed, and `all` exactly when every one does; each join fires once.
    #[test]
    fn the_join_decision_depends_only_on_how_many_branches_succeeded(
        outcomes in proptest::collection::vec(any::<bool>(), 1..6),
        k_seed in 0usize..6,
        order_seed in any::<u64>(),
    ) {
        let n = outcomes.len();
        let names: Vec<String> = (0..n).map(|i| format!("b{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let k = (k_seed % n) + 1;
        let mut order: Vec<usize> = (0..n).collect();
        let mut seed = order_seed;
        for i in (1..n).rev() {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (seed >> 33) as usize % (i + 1));
        }
        let succeeded = outcomes.iter().filter(|o| **o).count();
        for (def, expect_join) in [
            (at_least(k as u32, &refs), succeeded >= k),
            (load(&parent(r#"{ policy = "all" }"#, &refs)), succeeded == n),
        ] {
            let mut run = fanned_out(&def);
            for &i in &order {
                if run.state != "GATHER" {
                    break;
                }
                prop_assert_eq!(outcome(&def, &run), None);
                run = deliver(&def, run, &names[i], outcomes[i]);
            }
            let expected = if expect_join { "SUMMARIZE" } else { "FAILED" };
            prop_assert_eq!(run.state.as_str(), expected);
            prop_assert_ne!(outcome(&def, &run), Some(JoinOutcome::Joined));
        }
    }
}
