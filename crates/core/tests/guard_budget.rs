//! The evaluation budget of guard expressions (SPEC M5, Z1): every CEL expression a definition
//! holds has a static bound of its work; registration refuses one over
//! [`limits::GUARD_STEPS_MAX`], naming it, and evaluation refuses to run one whose bound over
//! the data given is over it. Never a clock: the same input gives the same answer.

use std::time::Instant;

use rein_core::definition::{DefinitionSpec, JoinPolicy};
use rein_core::guard::{DataSize, GuardInput, GuardScope, compile_expr};
use rein_core::limits::{self, GUARD_STEPS_MAX};
use rein_core::{
    Definition, DefinitionError, Event, Format, GuardRegistry, RejectReason, RunState, apply,
};
use serde_json::{Value, json};

/// A literal list `[1, 2, ..., n]`.
fn list(n: usize) -> String {
    let items: Vec<String> = (1..=n).map(|i| i.to_string()).collect();
    format!("[{}]", items.join(","))
}

/// `depth` comprehensions nested over literal lists of `n` elements, around `body`.
fn nested(depth: usize, n: usize, body: &str) -> String {
    let l = list(n);
    let mut expr = body.to_owned();
    for v in (0..depth).rev() {
        expr = format!("{l}.all(v{v}, {expr})");
    }
    expr
}

/// The expression of the report: 100^4 = 10^8 iterations in 1.2 KB.
fn ten_to_the_eight() -> String {
    let l = format!(
        "[{}]",
        (0..=99)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    format!("{l}.all(a,{l}.all(b,{l}.all(c,{l}.all(d,true))))")
}

/// start -go-> done, the transition guarded by `guard`.
fn guarded(guard: &str) -> String {
    format!(
        r#"
name = "budget"
version = 1
cancel_state = "cancelled"
events = ["go"]
external_events = ["go"]

[[states]]
name = "start"
kind = "active"
initial = true

[[states]]
name = "done"
kind = "terminal"

[[states]]
name = "cancelled"
kind = "terminal"

[[transitions]]
from = "start"
event = "go"
to = "done"
guard = {guard:?}
"#
    )
}

fn parse(text: &str) -> Result<Definition, DefinitionError> {
    Definition::parse(text, Format::Toml, &GuardRegistry::new())
}

fn spec(text: &str) -> DefinitionSpec {
    toml::from_str(text).expect("the fixture is a well-formed document")
}

/// The reason of the problem at `item`; panics when there is none.
fn problem(err: &DefinitionError, item: &str) -> String {
    err.problems()
        .into_iter()
        .find(|p| p.item == item)
        .map(|p| p.reason)
        .unwrap_or_else(|| panic!("no problem at {item}: {err}"))
}

fn input(payload: &Value) -> GuardInput<'_> {
    GuardInput {
        run: json!({ "state": "start", "attempt": 0, "data": {} }),
        event: json!({ "type": "go", "payload": payload }),
        payload,
        retry: json!({}),
        constants: json!({}),
        budget: json!({}),
    }
}

/// Runs `f` three times; its result and the fastest and slowest times in milliseconds (the
/// machine is shared: the figures are printed, never asserted).
fn timed<T>(f: impl Fn() -> T) -> (T, f64, f64) {
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..3 {
        let started = Instant::now();
        last = Some(f());
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    let min = times.iter().copied().fold(f64::MAX, f64::min);
    let max = times.iter().copied().fold(0.0, f64::max);
    (last.expect("ran"), min, max)
}

/// The bound of `expr` over data of the reference size.
fn bound_at_reference(expr: &str) -> u64 {
    compile_expr(expr)
        .expect("parses")
        .cost()
        .steps(DataSize::reference())
}

/// The largest `n` for which `depth` comprehensions over lists of `n` around `body` are
/// within the budget.
fn largest_within_budget(depth: usize, body: &str) -> usize {
    let mut n = 1;
    while bound_at_reference(&nested(depth, n + 1, body)) <= GUARD_STEPS_MAX {
        n += 1;
    }
    n
}

#[test]
fn the_ten_to_the_eight_iterations_guard_is_refused_when_registered() {
    let expr = ten_to_the_eight();
    // Within the old limits: it is the cost rule that refuses it.
    assert!(
        expr.len() <= limits::GUARD_EXPR_LEN_MAX,
        "{} bytes",
        expr.len()
    );
    let err = parse(&guarded(&expr)).expect_err("10^8 iterations are over budget");
    let reason = problem(&err, "transitions[0] (start + go -> done).guards[0]");
    assert!(reason.contains("evaluation steps"), "{reason}");
    assert!(
        reason.contains(&format!("the limit is {GUARD_STEPS_MAX}")),
        "{reason}"
    );
    assert!(reason.contains("iterates too long"), "{reason}");
    let bound = bound_at_reference(&expr);
    assert!(
        bound >= 100_000_000,
        "the bound {bound} is below the iterations"
    );
    assert!(
        reason.contains(&bound.to_string()),
        "the reason names the bound {bound}: {reason}"
    );
}

#[test]
fn a_guard_at_the_bound_is_accepted_and_evaluates_in_milliseconds() {
    // Shapes that stress different parts of the interpreter, each made as large as the
    // budget allows.
    let shapes = [
        (3, "true"),
        (3, "v0 + v1 + v2 >= 3"),
        (2, "size([v0, v1, v0 * v1]) == 3"),
        (2, "{'k': v0, 'j': v1}.k == v0"),
        (2, "string(v0) + string(v1) != ''"),
        (3, "v2 in [v0, v1, v2]"),
    ];
    for (depth, body) in shapes {
        let n = largest_within_budget(depth, body);
        let expr = nested(depth, n, body);
        let bound = bound_at_reference(&expr);
        assert!(bound <= GUARD_STEPS_MAX);
        assert!(
            bound > GUARD_STEPS_MAX / 2,
            "{bound} is not near the budget"
        );
        let def = parse(&guarded(&expr)).expect("a guard within budget is accepted");
        let run = RunState::initial(&def, json!({}));
        let (next, min, max) = timed(|| apply(&def, &run, &Event::new(1, "go", json!({}))));
        assert_eq!(next.map(|r| r.state).ok(), Some("done".to_owned()));
        println!(
            "{depth} x {n} elements around `{body}`: bound {bound} steps, evaluated in \
             {min:.1}..{max:.1} ms ({:.1} ns per step at best)",
            min * 1e6 / bound as f64
        );
    }
}

#[test]
fn a_guard_over_payload_data_at_the_bound_evaluates_in_milliseconds() {
    let expr = "payload.items.all(i, i.price >= 0 && i.price < 1000000 && i.name != '' \
                && size(i.name) < 100)";
    let def = parse(&guarded(expr)).expect("linear in the payload");
    let cost = compile_expr(expr).unwrap();
    let payload_of = |n: usize| json!({ "items": vec![json!({ "price": 1, "name": "x" }); n] });
    let steps = |n: usize| {
        let payload = payload_of(n);
        cost.cost().steps(DataSize::of(&input(&payload).event))
    };
    let mut n = 1;
    while steps(n * 2) <= GUARD_STEPS_MAX {
        n *= 2;
    }
    while steps(n + 64) <= GUARD_STEPS_MAX {
        n += 64;
    }
    let payload = payload_of(n);
    assert!(payload.to_string().len() <= limits::EVENT_PAYLOAD_BYTES_MAX);
    let run = RunState::initial(&def, json!({}));
    let event = Event::new(1, "go", payload);
    let (next, min, max) = timed(|| apply(&def, &run, &event));
    assert_eq!(next.map(|r| r.state).ok(), Some("done".to_owned()));
    let plain = parse(&guarded("size(payload) > 0")).unwrap();
    let (_, plain_min, plain_max) = timed(|| apply(&plain, &run, &event));
    println!(
        "`{expr}` over {n} items ({} bytes): bound {} steps, the event applied in \
         {min:.1}..{max:.1} ms; with a guard that only reads the payload, \
         {plain_min:.1}..{plain_max:.1} ms",
        event.payload.to_string().len(),
        steps(n),
    );
    let err = apply(&def, &run, &Event::new(1, "go", payload_of(n + 64))).unwrap_err();
    assert!(
        matches!(err.reason, RejectReason::GuardError { .. }),
        "just over the bound: {err}"
    );
}

#[test]
fn a_guard_just_over_the_bound_is_refused() {
    let n = largest_within_budget(3, "true");
    let err = parse(&guarded(&nested(3, n + 1, "true"))).expect_err("one more is over");
    let reason = problem(&err, "transitions[0] (start + go -> done).guards[0]");
    assert!(reason.contains("evaluation steps"), "{reason}");
}

#[test]
fn a_comprehension_over_run_data_nested_in_another_is_refused_as_quadratic() {
    for expr in [
        "payload.items.all(a, payload.items.all(b, a != b))",
        "run.results.exists(r, payload.ids.exists(i, r.value == i))",
        "payload.items.map(a, payload.items.map(b, b)).size() > 0",
    ] {
        let err = parse(&guarded(expr)).expect_err(expr);
        let reason = problem(&err, "transitions[0] (start + go -> done).guards[0]");
        assert!(
            reason.contains("grows faster than the data"),
            "{expr}: {reason}"
        );
    }
}

#[test]
fn guards_that_walk_their_data_once_are_accepted() {
    for expr in [
        "payload.items.exists(i, i.text.contains('urgent'))",
        "payload.items.all(i, i.tags.all(t, t != 'blocked'))",
        "payload.items.map(i, i.price).filter(p, p > 100).size() < 3",
        "run.results.exists(r, r.node == 'search') && size(run.results) < 10",
        "payload.kind in ['a', 'b', 'c'] && payload.note.startsWith('ok')",
        "run.attempt < retry.max_retries",
    ] {
        parse(&guarded(expr)).unwrap_or_else(|e| panic!("{expr}: {e}"));
    }
}

#[test]
fn a_linear_guard_evaluates_as_before() {
    let def = parse(&guarded(
        "payload.items.exists(i, i.text.contains('urgent'))",
    ))
    .unwrap();
    let run = RunState::initial(&def, json!({}));
    let urgent = json!({ "items": [{ "text": "later" }, { "text": "urgent: now" }] });
    let calm = json!({ "items": [{ "text": "later" }] });
    assert_eq!(
        apply(&def, &run, &Event::new(1, "go", urgent))
            .unwrap()
            .state,
        "done"
    );
    let err = apply(&def, &run, &Event::new(1, "go", calm)).unwrap_err();
    assert!(
        matches!(err.reason, RejectReason::GuardFailed { .. }),
        "{err}"
    );
}

#[test]
fn tool_approval_rules_and_join_guards_have_the_same_bound() {
    let mut refund = rein_core::builtin::refund_agent().spec().clone();
    let (s, t) = refund
        .states
        .iter()
        .enumerate()
        .find_map(|(s, state)| {
            state
                .tools
                .iter()
                .position(|t| t.approval.as_deref().is_some_and(|a| a.contains("args")))
                .map(|t| (s, t))
        })
        .expect("refund-agent has a tool with an approval rule");
    refund.states[s].tools[t].approval = Some(ten_to_the_eight());
    let item = format!(
        "states[{s}] ({}).tools[{t}] ({}).approval",
        refund.states[s].name, refund.states[s].tools[t].name
    );
    let err = Definition::from_spec(refund, &GuardRegistry::new()).expect_err("over budget");
    assert!(problem(&err, &item).contains("evaluation steps"));

    let mut research = spec(include_str!("../../../definitions/fan-out-research.toml"));
    let s = research
        .states
        .iter()
        .position(|state| state.fan_out.is_some())
        .expect("a fan-out state");
    let fan_out = research.states[s].fan_out.as_mut().unwrap();
    fan_out.join.policy = JoinPolicy::Guard;
    fan_out.join.k = None;
    fan_out.join.guard = Some(ten_to_the_eight());
    let item = format!(
        "states[{s}] ({}).fan_out.join.guard",
        research.states[s].name
    );
    let err = Definition::from_spec(research, &GuardRegistry::new()).expect_err("over budget");
    assert!(problem(&err, &item).contains("evaluation steps"));
}

/// start -go-> done through `count` transitions of decreasing priority, each guarded by
/// `guard` and a last term that tells them apart.
fn many_candidates(count: usize, guard: &str) -> String {
    let base = guarded("true");
    let mut text = base[..base.find("[[transitions]]").unwrap()].to_owned();
    for i in 1..=count {
        text.push_str(&format!(
            "\n[[transitions]]\nfrom = \"start\"\nevent = \"go\"\nto = \"done\"\npriority = {i}\n\
             guard = {:?}\n",
            format!("{guard} && payload.pick == {i}")
        ));
    }
    text
}

#[test]
fn the_guards_one_event_may_run_share_one_budget() {
    let n = largest_within_budget(2, "true");
    let heavy = nested(2, n, "true");
    let each = bound_at_reference(&format!("{heavy} && payload.pick == 1"));
    let count = (GUARD_STEPS_MAX / each + 1) as usize;
    assert!(count >= 2, "each guard alone ({each}) fits");
    let text = many_candidates(count, &heavy);
    let err = parse(&text).expect_err("together they are over budget");
    let reason = problem(&err, "transitions from `start` on `go`");
    assert!(reason.contains("together"), "{reason}");
    assert!(
        reason.contains(&format!("the limit is {GUARD_STEPS_MAX}")),
        "{reason}"
    );
    parse(&many_candidates(count - 1, &heavy)).expect("one fewer fits");

    // Stored before the rule, it loads; at run time the candidates are tried highest
    // priority first, and the one reached after the budget is spent is not evaluated.
    let def = Definition::from_stored_spec(spec(&text), &GuardRegistry::new()).unwrap();
    let payload = json!({ "pick": 1 });
    let guard_input = input(&payload);
    let mut scope = GuardScope::new(&guard_input);
    let results: Vec<Result<bool, String>> = def
        .candidates("start", "go")
        .iter()
        .flat_map(|t| t.guards.iter())
        .map(|g| g.eval(&mut scope))
        .collect();
    assert!(scope.steps_used() <= GUARD_STEPS_MAX);
    assert_eq!(results[0], Ok(false), "the first candidate is evaluated");
    let last = results.last().unwrap();
    let Err(error) = last else {
        panic!("the last candidate is past the budget: {results:?}");
    };
    assert!(
        error.contains("taken by the guards evaluated before it"),
        "{error}"
    );
    // The reducer reports the first candidate's failure, as for any guards that all fail.
    let run = RunState::initial(&def, json!({}));
    let err = apply(&def, &run, &Event::new(1, "go", payload.clone())).unwrap_err();
    assert!(
        matches!(err.reason, RejectReason::GuardFailed { .. }),
        "{err}"
    );
}

#[test]
fn a_stored_definition_over_the_bound_loads_and_its_guard_fails_without_running() {
    let text = guarded(&ten_to_the_eight());
    assert!(parse(&text).is_err(), "registration refuses it");
    let def = Definition::from_stored_spec(spec(&text), &GuardRegistry::new())
        .expect("a definition stored before the rule still loads");
    let run = RunState::initial(&def, json!({}));
    let event = Event::new(1, "go", json!({}));
    let (first, min, _) = timed(|| apply(&def, &run, &event).unwrap_err());
    let RejectReason::GuardError { error, .. } = &first.reason else {
        panic!("the guard is refused with an error: {first}");
    };
    assert!(error.starts_with("not evaluated"), "{error}");
    assert!(
        error.contains(&format!("the limit is {GUARD_STEPS_MAX}")),
        "{error}"
    );
    // Deterministic: the same input gives the same answer, on every replay.
    let again = apply(&def, &run, &event).unwrap_err();
    assert_eq!(again.reason, first.reason);
    println!("10^8-iteration guard refused in {min:.3} ms");
}

#[test]
fn a_guard_over_more_data_than_its_budget_allows_fails_with_a_reason() {
    let expr = "payload.items.all(i, i > 0)";
    let def = parse(&guarded(expr)).expect("linear in the payload");
    let run = RunState::initial(&def, json!({}));
    let small = json!({ "items": vec![1; 100] });
    assert_eq!(
        apply(&def, &run, &Event::new(1, "go", small))
            .unwrap()
            .state,
        "done"
    );
    // Find a list long enough to be over budget, still within the payload limit.
    let cost = compile_expr(expr).unwrap();
    let mut n = 1000;
    while cost
        .cost()
        .steps(DataSize::of(&json!({ "items": vec![1; n] })))
        <= GUARD_STEPS_MAX
    {
        n *= 2;
    }
    let large = json!({ "items": vec![1; n] });
    assert!(large.to_string().len() <= limits::EVENT_PAYLOAD_BYTES_MAX);
    let err = apply(&def, &run, &Event::new(1, "go", large)).unwrap_err();
    let RejectReason::GuardError { error, .. } = &err.reason else {
        panic!("over budget for this data: {err}");
    };
    assert!(
        error.contains(&format!("lists of up to {n} entries")),
        "{error}"
    );
}

#[test]
fn the_bound_covers_what_the_interpreter_does_for_each_shape() {
    // Each expression is evaluated and its bound must be at least its iterations: a sanity
    // floor on the model, per shape.
    let cases: [(&str, Value, u64); 5] = [
        (&nested(2, 50, "true"), json!({}), 2_500),
        (
            "payload.items.all(i, i > 0)",
            json!({ "items": vec![1; 500] }),
            500,
        ),
        (
            "payload.items.map(i, i * 2).filter(x, x > 1).size() == 500",
            json!({ "items": vec![1; 500] }),
            1_000,
        ),
        (
            "payload.items.all(i, i.tags.all(t, t != 'x'))",
            json!({ "items": vec![json!({ "tags": vec!["a"; 20] }); 50] }),
            1_000,
        ),
        (
            "payload.s + payload.s != ''",
            json!({ "s": "y".repeat(8_000) }),
            2 * 8_000 / rein_core::guard::STRING_BYTES_PER_UNIT as u64,
        ),
    ];
    for (expr, payload, floor) in cases {
        let e = compile_expr(expr).unwrap();
        let i = input(&payload);
        let size = DataSize::of(&i.event).max(DataSize::of(&payload));
        let bound = e.cost().steps(size);
        assert!(bound >= floor, "{expr}: bound {bound} below {floor}");
        assert_eq!(e.eval(&i), Ok(true), "{expr}");
    }
}
