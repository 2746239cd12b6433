//! Fuzzed inputs of the pure core (SPEC Z2): whatever a client, a model or a definition's
//! author sends — any text as a definition in TOML, JSON or YAML, a built-in definition with any
//! part replaced, any CEL guard over any data, any JSON Schema in a tool's spec, any model
//! reply or decision — is either accepted or refused with an error. None panics, and a guard
//! that would run long is refused by its cost bound instead of running.
//!
//! Each property runs a bounded number of cases in the suite; `PROPTEST_CASES=20000 cargo test
//! --workspace --test fuzz_inputs` runs them longer.

use proptest::prelude::*;
use rein_core::Format;
use rein_core::decision;
use rein_core::guard::{GuardInput, compile_expr};
use rein_core::model::parse_reply;
use rein_core::{Definition, GuardRegistry, RunState, builtin};
use serde_json::{Map, Value, json};

const CASES: u32 = 192;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(CASES),
        ..ProptestConfig::default()
    }
}

/// Any JSON value, nested a few levels: what clients and models send.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (-1e12f64..1e12).prop_map(|f| json!(f)),
        "[ -~]{0,24}".prop_map(Value::String),
        "\\PC{0,8}".prop_map(Value::String),
        prop_oneof![
            Just("call_tool"),
            Just("FINISH"),
            Just("refund"),
            Just("type"),
            Just("object"),
            Just("string"),
            Just("$ref"),
            Just("ACTING"),
        ]
        .prop_map(|s| Value::String(s.to_owned())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

/// Object keys: the ones Rein's documents use, and others.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop_oneof![
            Just("decision"), Just("tool"), Just("args"), Just("event"), Just("payload"),
            Just("type"), Just("properties"), Just("required"), Just("items"),
            Just("pattern"), Just("minimum"), Just("maxLength"), Just("anyOf"),
            Just("choices"), Just("message"), Just("content"), Just("tool_calls"),
            Just("function"), Just("arguments"), Just("name"), Just("usage"),
            Just("data"), Just("amount"), Just("order_id"),
        ].prop_map(str::to_owned),
        1 => "[a-z_]{1,10}",
    ]
}

/// A built-in definition as a JSON document.
fn builtin_json(name: &str) -> Value {
    let text = builtin::source(name).expect("a built-in definition");
    let toml: toml::Value = toml::from_str(text).expect("built-ins are TOML");
    serde_json::to_value(toml).expect("TOML converts to JSON")
}

/// `doc` with the value at the `pick`-th node (in a depth-first walk) replaced by `with`, or
/// removed from its object when `with` is `None`.
fn mutate(doc: &mut Value, pick: usize, with: Option<Value>) {
    fn walk(v: &mut Value, left: &mut usize, with: &mut Option<Option<Value>>) {
        match v {
            Value::Object(map) => {
                let keys: Vec<String> = map.keys().cloned().collect();
                for k in keys {
                    if with.is_none() {
                        return;
                    }
                    if *left == 0 {
                        match with.take().flatten() {
                            Some(new) => {
                                map.insert(k, new);
                            }
                            None => {
                                map.remove(&k);
                            }
                        }
                        return;
                    }
                    *left -= 1;
                    if let Some(child) = map.get_mut(&k) {
                        walk(child, left, with);
                    }
                }
            }
            Value::Array(items) => {
                for i in 0..items.len() {
                    if with.is_none() {
                        return;
                    }
                    if *left == 0 {
                        match with.take().flatten() {
                            Some(new) => items[i] = new,
                            None => {
                                items.remove(i);
                            }
                        }
                        return;
                    }
                    *left -= 1;
                    walk(&mut items[i], left, with);
                }
            }
            _ => {}
        }
    }
    let mut left = pick;
    walk(doc, &mut left, &mut Some(with));
}

fn parse(text: &str, format: Format) -> Result<Definition, String> {
    Definition::parse(text, format, &GuardRegistry::new()).map_err(|e| e.to_string())
}

/// A CEL expression from a small grammar over what guards read: run data, the payload,
/// literals, operators, functions and macros, nested.
fn guard_expr() -> impl Strategy<Value = String> {
    let atom = prop_oneof![
        Just("run.data.x".to_owned()),
        Just("run.data.items".to_owned()),
        Just("payload.amount".to_owned()),
        Just("payload".to_owned()),
        Just("run.attempt".to_owned()),
        Just("retry.attempt".to_owned()),
        Just("run.tokens_used".to_owned()),
        Just("no_such_name".to_owned()),
        any::<i32>().prop_map(|n| n.to_string()),
        (-1e6f64..1e6).prop_map(|f| format!("{f:?}")),
        "[a-z ]{0,6}".prop_map(|s| format!("{s:?}")),
        Just("true".to_owned()),
        Just("null".to_owned()),
        Just("[1, 2, 3]".to_owned()),
        Just("{'a': 1}".to_owned()),
    ];
    atom.prop_recursive(4, 32, 3, |inner| {
        prop_oneof![
            (
                inner.clone(),
                prop_oneof![
                    Just("=="),
                    Just("!="),
                    Just("<"),
                    Just(">="),
                    Just("+"),
                    Just("-"),
                    Just("*"),
                    Just("/"),
                    Just("%"),
                    Just("&&"),
                    Just("||"),
                    Just("in"),
                ],
                inner.clone()
            )
                .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
            inner.clone().prop_map(|a| format!("!{a}")),
            inner.clone().prop_map(|a| format!("size({a})")),
            inner.clone().prop_map(|a| format!("has({a}.field)")),
            inner.clone().prop_map(|a| format!("{a}.all(v, v > 0)")),
            inner.clone().prop_map(|a| format!("{a}.map(v, v * 2)")),
            inner
                .clone()
                .prop_map(|a| format!("{a}.exists(v, run.data.items.all(w, w != v))")),
            (inner.clone(), inner.clone(), inner.clone())
                .prop_map(|(c, a, b)| format!("({c} ? {a} : {b})")),
            inner
                .clone()
                .prop_map(|a| format!("string({a}).matches('^a+$')")),
            inner.prop_map(|a| format!("{a}[0]")),
        ]
    })
}

fn guard_input(payload: &Value, data: Value) -> GuardInput<'_> {
    GuardInput {
        run: json!({ "data": data, "attempt": 1, "tokens_used": 10, "state": "ACTING" }),
        event: json!({ "type": "E" }),
        payload,
        retry: json!({ "attempt": 1, "elapsed_ms": 5 }),
        constants: json!({}),
        budget: json!({}),
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_text_as_a_definition_is_loaded_or_refused(text in "\\PC{0,400}") {
        for format in [Format::Toml, Format::Json, Format::Yaml] {
            let _ = parse(&text, format);
        }
    }

    #[test]
    fn a_built_in_definition_with_any_part_replaced_is_loaded_or_refused(
        which in 0usize..builtin::ALL.len(),
        picks in prop::collection::vec((0usize..400, prop::option::of(json_value())), 1..4),
    ) {
        let mut doc = builtin_json(builtin::ALL[which].0);
        for (pick, with) in picks {
            mutate(&mut doc, pick, with);
        }
        let text = serde_json::to_string(&doc).unwrap();
        if let Ok(def) = parse(&text, Format::Json) {
            // What loads is whole: it names its initial state among its states.
            let initial = def.initial_state().to_owned();
            prop_assert!(def.states().any(|s| s.name == initial));
        }
        // The same document as TOML, where it can be written as TOML, and as YAML.
        if let Ok(toml) = toml::to_string(&doc) {
            let _ = parse(&toml, Format::Toml);
        }
        let yaml = serde_norway::to_string(&doc).unwrap();
        let yaml_loaded = parse(&yaml, Format::Yaml);
        // A document is one definition whichever language it is written in.
        prop_assert_eq!(
            yaml_loaded.ok().map(|d| d.hash().to_owned()),
            parse(&text, Format::Json).ok().map(|d| d.hash().to_owned())
        );
    }

    #[test]
    fn any_guard_compiles_or_is_refused_and_runs_within_its_bound(
        expr in guard_expr(),
        payload in json_value(),
        data in json_value(),
        items in prop::collection::vec(any::<i16>(), 0..64),
    ) {
        if let Ok(compiled) = compile_expr(&expr) {
            let data = json!({ "x": data, "items": items });
            let input = guard_input(&payload, data);
            // Ok(bool) or a refusal (a type error, a missing field, the cost bound): never a
            // panic, never a hang, and never more steps than the limit.
            let mut scope = rein_core::guard::GuardScope::new(&input);
            let _ = compiled.eval_in(&mut scope);
            prop_assert!(scope.steps_used() <= rein_core::limits::GUARD_STEPS_MAX);
        }
    }

    #[test]
    fn any_decision_in_an_agent_state_is_accepted_or_rejected(decision in json_value()) {
        let def = builtin::refund_agent();
        let run = RunState::initial(&def, json!({}));
        let _ = decision::validate(&def, &run, &decision);
    }

    #[test]
    fn a_decision_shaped_like_a_tool_call_is_accepted_or_rejected(
        tool in prop_oneof![Just("refund"), Just("lookup_order"), Just("nope")],
        args in json_value(),
    ) {
        let def = builtin::refund_agent();
        let run = RunState::initial(&def, json!({}));
        let call = json!({ "decision": "call_tool", "tool": tool, "args": args });
        let _ = decision::validate(&def, &run, &call);
    }

    #[test]
    fn any_json_schema_in_a_tools_spec_is_loaded_or_refused_and_any_arguments_are_judged(
        schema in json_value(),
        args in json_value(),
    ) {
        let mut doc = builtin_json("refund-agent");
        let tools = doc["states"][0]["tools"].as_array_mut().expect("the refund agent's tools");
        tools[0]["schema"] = schema;
        let text = serde_json::to_string(&doc).unwrap();
        if let Ok(def) = parse(&text, Format::Json) {
            let run = RunState::initial(&def, json!({}));
            let tool = def.state(def.initial_state()).unwrap().tools[0].name.clone();
            let call = json!({ "decision": "call_tool", "tool": tool, "args": args });
            let _ = decision::validate(&def, &run, &call);
        }
    }

    #[test]
    fn any_model_reply_parses_to_a_decision_or_a_refusal(
        body in json_value(),
        content in json_value(),
        arguments in "\\PC{0,64}",
    ) {
        let def = builtin::load("support-agent").unwrap().unwrap();
        let state = def
            .states()
            .find(|s| s.model.is_some())
            .expect("support-agent asks a model")
            .clone();
        let spec = state.model.clone().unwrap();
        let _ = parse_reply(&def, &state, &spec, &body);
        // Shaped like a Chat Completions reply, with any content and any tool arguments.
        let shaped = json!({
            "model": "m",
            "choices": [{ "message": {
                "role": "assistant",
                "content": content,
                "tool_calls": [{ "id": "c", "type": "function",
                                 "function": { "name": "FINISH", "arguments": arguments } }],
            }, "finish_reason": "tool_calls" }],
            "usage": { "prompt_tokens": 3, "completion_tokens": 4 },
        });
        let _ = parse_reply(&def, &state, &spec, &shaped);
    }
}

/// A guard whose work grows with the square of its data is refused before it runs; with
/// little data the same expression runs.
#[test]
fn a_guard_that_would_run_long_is_cut_off_by_its_bound_with_a_clear_error() {
    let expr = compile_expr("run.data.items.all(a, run.data.items.all(b, a != b || a == b))")
        .expect("it compiles");
    let payload = json!({});
    let small = guard_input(&payload, json!({ "items": [1, 2, 3] }));
    assert_eq!(expr.eval(&small), Ok(true));
    let items: Vec<i64> = (0..200_000).collect();
    let big = guard_input(&payload, json!({ "items": items }));
    let refused = expr
        .eval(&big)
        .expect_err("a quadratic walk over 200,000 items");
    assert!(
        refused.contains("step") || refused.contains("cost") || refused.contains("bound"),
        "{refused}"
    );
}

/// The generators reach past the first check: many guards compile and evaluate, and mutated
/// definitions both load and are refused, so the properties above exercise more than the
/// parsers' first refusal.
#[test]
fn the_generators_reach_past_the_first_check() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut compiled, mut evaluated) = (0, 0);
    for _ in 0..300 {
        let expr = guard_expr().new_tree(&mut runner).unwrap().current();
        if let Ok(e) = compile_expr(&expr) {
            compiled += 1;
            let payload = json!({ "amount": 3 });
            if e.eval(&guard_input(&payload, json!({ "x": 1, "items": [1, 2] })))
                .is_ok()
            {
                evaluated += 1;
            }
        }
    }
    println!("{compiled} of 300 guards compiled, {evaluated} evaluated to a bool");
    // Most random guards are refused at evaluation (a type error, a missing field): the
    // ones that evaluate show the generator reaches the interpreter at all.
    assert!(compiled >= 100, "only {compiled} of 300 guards compiled");
    assert!(evaluated >= 3, "only {evaluated} of 300 guards evaluated");
    let (mut loaded, mut refused) = (0, 0);
    for _ in 0..300 {
        let mut doc = builtin_json("refund-agent");
        let pick = (0usize..400).new_tree(&mut runner).unwrap().current();
        let with = prop::option::of(json_value())
            .new_tree(&mut runner)
            .unwrap()
            .current();
        mutate(&mut doc, pick, with);
        match parse(&serde_json::to_string(&doc).unwrap(), Format::Json) {
            Ok(_) => loaded += 1,
            Err(_) => refused += 1,
        }
    }
    println!("mutated refund agents: {loaded} loaded, {refused} refused");
    assert!(
        loaded >= 10 && refused >= 10,
        "{loaded} loaded, {refused} refused"
    );
}
