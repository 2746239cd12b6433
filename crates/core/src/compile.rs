//! Validation of a definition and its compilation into a [`Definition`]: every rule a
//! document must meet (names, states, transitions, guards and their cost, tools, fan-outs,
//! budgets, limits, who may send what), each problem reported, not only the first.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use crate::definition::{Definition, Inner, Transition};
use crate::event::EngineEvent;
use crate::guard::{GuardRegistry, GuardSpec};
use crate::limits;
use crate::spec::{
    BudgetSpec, DefinitionError, DefinitionProblem, DefinitionSpec, FanOutSpec, Format, JoinPolicy,
    StateKind, StateSpec, limit_key_problem, name_problem,
};

/// Which rules a spec is validated with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rules {
    /// Every rule: a definition being registered. Besides [`Rules::Stored`]'s: the cost
    /// bound of guard expressions, and a transient path for every state that calls out
    /// ([`transient_path_problem`]).
    Registration,
    /// The rules every stored definition met when it was registered.
    Stored,
}

impl Definition {
    /// Parses and validates a definition document, with the rules that apply when one is
    /// registered on top of [`Definition::from_spec`]'s: an http node's URLs name a host and
    /// hold no credentials ([`crate::http_url`]).
    pub fn parse(
        text: &str,
        format: Format,
        guards: &GuardRegistry,
    ) -> Result<Definition, DefinitionError> {
        if text.len() > limits::DEFINITION_BYTES_MAX {
            return Err(DefinitionError::TooLarge {
                size: text.len(),
                limit: limits::DEFINITION_BYTES_MAX,
            });
        }
        let spec: DefinitionSpec = match format {
            Format::Toml => toml::from_str(text).map_err(|e| DefinitionError::Parse(e.to_string())),
            Format::Json if !crate::text::json_text_is_object(text.as_bytes()) => Err(
                DefinitionError::Parse("a JSON definition is an object (`{...}`)".to_owned()),
            ),
            Format::Json => {
                serde_json::from_str(text).map_err(|e| DefinitionError::Parse(e.to_string()))
            }
            // YAML is read into JSON's data model first, then into the spec the way JSON is:
            // a plain `false` or `3` stays a boolean or a number, where read straight into the
            // spec it would quietly become the text "false" where text is expected, and the
            // same document would load as YAML and be refused as JSON.
            Format::Yaml => crate::yaml::to_json(text)
                .and_then(|v| {
                    serde_json::from_value(v).map_err(|e| {
                        // Read straight into the spec, the error names its line and column;
                        // where that reading succeeds, a scalar is of the wrong type.
                        match serde_norway::from_str::<DefinitionSpec>(text) {
                            Err(located) => located.to_string(),
                            Ok(_) => {
                                format!("{e}; quote a value to make it text (`\"false\"`, `\"3\"`)")
                            }
                        }
                    })
                })
                .map_err(|e| DefinitionError::Parse(format!("YAML: {e}"))),
        }?;
        // Rules for documents being registered; stored definitions keep loading without them.
        let url_problems = crate::http_url::problems(&spec);
        match Definition::from_spec(spec, guards) {
            Ok(_) if !url_problems.is_empty() => Err(DefinitionError::Invalid(url_problems)),
            Err(DefinitionError::Invalid(mut problems)) => {
                problems.extend(url_problems);
                Err(DefinitionError::Invalid(problems))
            }
            other => other,
        }
    }

    /// Validates a spec built in Rust or parsed from a file, with every rule a definition
    /// being registered must meet. Every problem is reported, not only the first.
    pub fn from_spec(
        spec: DefinitionSpec,
        guards: &GuardRegistry,
    ) -> Result<Definition, DefinitionError> {
        Definition::validate(spec, guards, Rules::Registration)
    }

    /// Validates a spec that was registered before: rules that only apply to new
    /// registrations (the cost bound of guard expressions) are not checked, so definitions
    /// already stored keep loading. Their guards stay safe to run: an expression over budget
    /// is refused when it is evaluated, the same way on every replay.
    pub fn from_stored_spec(
        spec: DefinitionSpec,
        guards: &GuardRegistry,
    ) -> Result<Definition, DefinitionError> {
        Definition::validate(spec, guards, Rules::Stored)
    }

    fn validate(
        spec: DefinitionSpec,
        guards: &GuardRegistry,
        rules: Rules,
    ) -> Result<Definition, DefinitionError> {
        let mut problems = Vec::new();
        let mut p =
            |item: String, reason: String| problems.push(DefinitionProblem { item, reason });
        // Guards read the constants as `def`: they are part of the data a bound must cover.
        let guard_data =
            crate::guard::DataSize::of(&serde_json::to_value(&spec.constants).unwrap_or_default())
                .max(crate::guard::DataSize::reference());
        let cost_of = |expr: &crate::guard::Expr| match rules {
            Rules::Registration => expr.check_cost(guard_data),
            Rules::Stored => Ok(0),
        };

        check_name(&mut p, "name", &spec.name);
        if !(1..=limits::VERSION_MAX).contains(&spec.version) {
            p(
                "version".into(),
                format!("must be 1..={}", limits::VERSION_MAX),
            );
        }
        if spec.states.len() > limits::STATES_MAX {
            p(
                "states".into(),
                format!(
                    "{} states; the limit is {}",
                    spec.states.len(),
                    limits::STATES_MAX
                ),
            );
        }
        if spec.events.len() > limits::EVENTS_MAX {
            p(
                "events".into(),
                format!(
                    "{} events; the limit is {}",
                    spec.events.len(),
                    limits::EVENTS_MAX
                ),
            );
        }
        if spec.transitions.len() > limits::TRANSITIONS_MAX {
            p(
                "transitions".into(),
                format!(
                    "{} transitions; the limit is {}",
                    spec.transitions.len(),
                    limits::TRANSITIONS_MAX
                ),
            );
        }

        // States.
        let mut states: HashMap<String, StateSpec> = HashMap::new();
        let mut initials = Vec::new();
        // Tool approval rules, compiled once here and kept for every call.
        let mut approval_rules: HashMap<(String, String), Arc<crate::guard::Expr>> = HashMap::new();
        for (i, state) in spec.states.iter().enumerate() {
            let item = format!("states[{i}] ({})", state.name);
            check_name(&mut p, &item, &state.name);
            if states.insert(state.name.clone(), state.clone()).is_some() {
                p(item.clone(), format!("duplicate state `{}`", state.name));
            }
            if state.initial {
                initials.push(state.name.clone());
                if state.kind == StateKind::Terminal {
                    p(item.clone(), "the initial state cannot be terminal".into());
                }
            }
            if state.outcome.is_some() && state.kind != StateKind::Terminal {
                p(
                    format!("{item}.outcome"),
                    "only a terminal state has an outcome (how a run that ends there counts)"
                        .into(),
                );
            }
            if let Some(action) = &state.action {
                check_name(&mut p, &format!("{item}.action"), action);
                if state.kind == StateKind::Terminal {
                    p(
                        format!("{item}.action"),
                        "a terminal state runs no action".into(),
                    );
                }
            }
            if let Some(retry) = &state.retry
                && let Err(reason) = retry.validate()
            {
                p(format!("{item}.retry"), reason);
            }
            let mut tool_names = BTreeSet::new();
            for (t, tool) in state.tools.iter().enumerate() {
                let tool_item = format!("{item}.tools[{t}] ({})", tool.name);
                check_name(&mut p, &tool_item, &tool.name);
                if !tool_names.insert(tool.name.clone()) {
                    p(tool_item.clone(), format!("duplicate tool `{}`", tool.name));
                }
                if let Some(when) = &tool.approval
                    && when != "always"
                    && when != "never"
                {
                    match crate::guard::compile_expr(when) {
                        Ok(rule) => {
                            if let Err(reason) = cost_of(&rule) {
                                p(format!("{tool_item}.approval"), reason);
                            }
                            approval_rules
                                .insert((state.name.clone(), tool.name.clone()), Arc::new(rule));
                        }
                        Err(reason) => p(format!("{tool_item}.approval"), reason),
                    }
                }
                if let Some(schema) = &tool.schema
                    && !schema.is_object()
                    && !schema.is_boolean()
                {
                    p(
                        format!("{tool_item}.schema"),
                        "a JSON Schema must be an object or a boolean".into(),
                    );
                }
                if tool.side_effect && tool.retryable && !tool.requires_idempotency_key {
                    p(
                        tool_item.clone(),
                        "a side-effect tool is retried only with an idempotency key: set `requires_idempotency_key = true` or `retryable = false` (SPEC X6)".into(),
                    );
                }
            }
        }
        if let Err(reason) = spec.retry.validate() {
            p("retry".into(), reason);
        }
        match initials.len() {
            0 => p(
                "states".into(),
                "missing initial state: mark exactly one state `initial = true`".into(),
            ),
            1 => {}
            _ => p(
                "states".into(),
                format!(
                    "duplicate initial state: {} are all marked initial",
                    initials.join(", ")
                ),
            ),
        }

        // Events.
        let mut events = BTreeSet::new();
        for (i, event) in spec.events.iter().enumerate() {
            let item = format!("events[{i}] ({event})");
            check_name(&mut p, &item, event);
            if EngineEvent::is_reserved(event) {
                p(
                    item.clone(),
                    format!("`{event}` is an engine event name and cannot be declared"),
                );
            }
            if !events.insert(event.clone()) {
                p(item, format!("duplicate event `{event}`"));
            }
        }
        let mut call_results = BTreeSet::new();
        for (i, event) in spec.call_results.iter().enumerate() {
            if !events.contains(event) {
                p(
                    format!("call_results[{i}] ({event})"),
                    format!("unknown event `{event}`"),
                );
            }
            call_results.insert(event.clone());
        }
        let mut priority = HashMap::new();
        for (i, event) in spec.priority.iter().enumerate() {
            if !events.contains(event) {
                p(
                    format!("priority[{i}] ({event})"),
                    format!("unknown event `{event}`"),
                );
            }
            if priority.insert(event.clone(), i).is_some() {
                p(
                    format!("priority[{i}] ({event})"),
                    format!("`{event}` is listed twice"),
                );
            }
        }
        for (name, value) in &spec.constants {
            if !(value.is_number() || value.is_boolean() || value.is_string()) {
                p(
                    format!("constants.{name}"),
                    "a constant must be a number, boolean or string".into(),
                );
            }
        }

        // Transitions.
        let mut table: HashMap<(String, String), Vec<Transition>> = HashMap::new();
        for (i, t) in spec.transitions.iter().enumerate() {
            let item = format!("transitions[{i}] ({} + {} -> {})", t.from, t.event, t.to);
            let from = states.get(&t.from);
            if from.is_none() {
                p(
                    item.clone(),
                    format!("unknown state `{}` in `from`", t.from),
                );
            }
            if !states.contains_key(&t.to) {
                p(item.clone(), format!("unknown state `{}` in `to`", t.to));
            }
            if !events.contains(&t.event) {
                p(item.clone(), format!("unknown event `{}`", t.event));
            }
            if from.is_some_and(|s| s.kind == StateKind::Terminal) {
                p(
                    item.clone(),
                    format!(
                        "terminal state `{}` cannot have outgoing transitions",
                        t.from
                    ),
                );
            }
            let mut specs: Vec<GuardSpec> = t.guards.clone();
            if let Some(expr) = &t.guard {
                specs.push(GuardSpec::business(expr));
            }
            if specs.len() > limits::GUARDS_PER_TRANSITION_MAX {
                p(
                    item.clone(),
                    format!(
                        "{} guards; the limit is {}",
                        specs.len(),
                        limits::GUARDS_PER_TRANSITION_MAX
                    ),
                );
            }
            let mut compiled = Vec::new();
            for (g, guard) in specs.iter().enumerate() {
                match guard.compile(guards) {
                    Ok(c) => {
                        if let Some(Err(reason)) = c.expr().map(cost_of) {
                            p(format!("{item}.guards[{g}]"), reason);
                        }
                        compiled.push(c);
                    }
                    Err(reason) => p(format!("{item}.guards[{g}]"), reason),
                }
            }
            compiled.sort_by_key(|g| g.kind);
            let mut effects = t.effects.clone();
            effects.dedup();
            table
                .entry((t.from.clone(), t.event.clone()))
                .or_default()
                .push(Transition {
                    index: i,
                    from: t.from.clone(),
                    event: t.event.clone(),
                    to: t.to.clone(),
                    priority: t.priority.unwrap_or(0),
                    guards: compiled,
                    effects,
                });
        }
        let mut keys: Vec<_> = table.keys().cloned().collect();
        keys.sort();
        for key in keys {
            let Some(candidates) = table.get_mut(&key) else {
                continue;
            };
            candidates.sort_by(|a, b| b.priority.cmp(&a.priority).then(a.index.cmp(&b.index)));
            // One event may run every guard of its candidates: together they share one budget.
            let steps: u64 = candidates
                .iter()
                .flat_map(|t| t.guards.iter())
                .filter_map(|g| g.expr().and_then(|e| cost_of(e).ok()))
                .fold(0u64, u64::saturating_add);
            if steps > limits::GUARD_STEPS_MAX {
                p(
                    format!("transitions from `{}` on `{}`", key.0, key.1),
                    format!(
                        "their guards may take up to {steps} evaluation steps together over data \
                         with lists of {} entries (each one event may run); the limit is {}: \
                         use fewer or cheaper guards for this event",
                        guard_data.longest,
                        limits::GUARD_STEPS_MAX
                    ),
                );
            }
            for pair in candidates.windows(2) {
                let (a, b) = (&pair[0], &pair[1]);
                let item = format!(
                    "transitions[{}] ({} + {} -> {})",
                    b.index, b.from, b.event, b.to
                );
                if a.to == b.to && a.guards.is_empty() && b.guards.is_empty() {
                    p(item, format!("duplicate of transitions[{}]", a.index));
                } else if a.priority == b.priority {
                    p(
                        item,
                        format!(
                            "ambiguous with transitions[{}]: both could fire for ({}, {}); give them different `priority` values",
                            a.index, a.from, a.event
                        ),
                    );
                } else if a.guards.is_empty() {
                    p(
                        item,
                        format!(
                            "unreachable: transitions[{}] has a higher priority and no guard, so it always wins for ({}, {})",
                            a.index, a.from, a.event
                        ),
                    );
                }
            }
        }

        // Cancel state.
        let cancel_state = match &spec.cancel_state {
            None => {
                p(
                    "cancel_state".into(),
                    "missing cancel state: name the state CANCEL moves a run to".into(),
                );
                String::new()
            }
            Some(name) => {
                match states.get(name) {
                    None => p("cancel_state".into(), format!("unknown state `{name}`")),
                    Some(s) if s.kind != StateKind::Terminal => p(
                        "cancel_state".into(),
                        format!("`{name}` must be a terminal state"),
                    ),
                    Some(_) => {}
                }
                name.clone()
            }
        };

        let mut schemas: HashMap<(String, String), Arc<jsonschema::Validator>> = HashMap::new();
        // Per-state timeouts and approval events must leave the state.
        let leaves = |state: &str, event: &str| {
            table
                .get(&(state.to_owned(), event.to_owned()))
                .is_some_and(|c| c.iter().any(|t| t.to != state))
        };
        let accepts =
            |state: &str, event: &str| table.contains_key(&(state.to_owned(), event.to_owned()));
        for (i, state) in spec.states.iter().enumerate() {
            let item = format!("states[{i}] ({})", state.name);
            if let Some(timeout) = &state.timeout {
                if timeout.after_ms == 0 {
                    p(
                        format!("{item}.timeout"),
                        "after_ms must be greater than 0".into(),
                    );
                }
                if !leaves(&state.name, &timeout.event) {
                    p(
                        format!("{item}.timeout"),
                        format!(
                            "timeout event `{}` does not leave state `{}`",
                            timeout.event, state.name
                        ),
                    );
                }
            }
            if let Some(approval) = &state.approval {
                if state.kind != StateKind::Waiting {
                    p(
                        format!("{item}.approval"),
                        "an approval is waited for in a `waiting` state".into(),
                    );
                }
                if approval.expires_after_ms == 0 {
                    p(
                        format!("{item}.approval"),
                        "expires_after_ms must be greater than 0".into(),
                    );
                }
                if !leaves(&state.name, &approval.expiry_event) {
                    p(
                        format!("{item}.approval"),
                        format!(
                            "expiry event `{}` does not leave state `{}`",
                            approval.expiry_event, state.name
                        ),
                    );
                }
                if let Some(reminder) = &approval.reminder_event
                    && !accepts(&state.name, reminder)
                {
                    p(
                        format!("{item}.approval"),
                        format!(
                            "reminder event `{reminder}` is not accepted in state `{}`",
                            state.name
                        ),
                    );
                }
                if approval
                    .remind_before_ms
                    .is_some_and(|r| r >= approval.expires_after_ms)
                {
                    p(
                        format!("{item}.approval"),
                        "remind_before_ms must be less than expires_after_ms".into(),
                    );
                }
            }
            if let Some(backoff) = &state.backoff {
                if state.kind != StateKind::Waiting {
                    p(
                        format!("{item}.backoff"),
                        "a backoff is waited for in a `waiting` state".into(),
                    );
                }
                for event in [&backoff.due, &backoff.exhausted] {
                    if !leaves(&state.name, event) {
                        p(
                            format!("{item}.backoff"),
                            format!(
                                "backoff event `{event}` does not leave state `{}`",
                                state.name
                            ),
                        );
                    }
                }
            }
            if let Some(event) = &state.on_lease_expired
                && !accepts(&state.name, event)
            {
                p(
                    format!("{item}.on_lease_expired"),
                    format!("event `{event}` is not accepted in state `{}`", state.name),
                );
            }
            if state.kind == StateKind::Terminal && state.timeout.is_some() {
                p(
                    format!("{item}.timeout"),
                    "a terminal state has no timeout".into(),
                );
            }
            if let Some(event) = &state.on_rejected_decision
                && !accepts(&state.name, event)
            {
                p(
                    format!("{item}.on_rejected_decision"),
                    format!("event `{event}` is not accepted in state `{}`", state.name),
                );
            }
            for (d, decision) in state.decisions.iter().enumerate() {
                if decision == crate::decision::CALL_TOOL {
                    if state.tools.is_empty() {
                        p(
                            format!("{item}.decisions[{d}] ({decision})"),
                            format!("state `{}` declares no tools to call", state.name),
                        );
                    }
                } else if !accepts(&state.name, decision) {
                    p(
                        format!("{item}.decisions[{d}] ({decision})"),
                        format!("state `{}` has no transition on `{decision}`", state.name),
                    );
                }
            }
            for (t, tool) in state.tools.iter().enumerate() {
                let tool_item = format!("{item}.tools[{t}] ({})", tool.name);
                if tool.may_need_approval() && !leaves(&state.name, tool.approval_event()) {
                    p(
                        format!("{tool_item}.approval_event"),
                        format!(
                            "event `{}` does not leave state `{}`; a call needing approval cannot wait for it",
                            tool.approval_event(),
                            state.name
                        ),
                    );
                }
                if let Some(schema) = &tool.schema {
                    match jsonschema::validator_for(schema) {
                        Ok(v) => {
                            schemas.insert((state.name.clone(), tool.name.clone()), Arc::new(v));
                        }
                        Err(e) => p(
                            format!("{tool_item}.schema"),
                            format!("not a valid JSON Schema: {e}"),
                        ),
                    }
                }
            }
            match (&state.http, state.action.as_deref()) {
                (Some(http), Some("http")) => {
                    let item = format!("{item}.http");
                    for (what, url) in
                        std::iter::once(("url", &http.url)).chain(http.reconcile_url.iter().map(|u| ("reconcile_url", u)))
                    {
                        if !(url.starts_with("http://") || url.starts_with("https://"))
                            || url.len() > limits::URL_LEN_MAX
                        {
                            p(
                                format!("{item}.{what}"),
                                format!(
                                    "`{url}` must be an http:// or https:// URL of at most {} bytes",
                                    limits::URL_LEN_MAX
                                ),
                            );
                        }
                    }
                    if http.timeout_ms == 0 || http.timeout_ms > 600_000 {
                        p(
                            format!("{item}.timeout_ms"),
                            "must be 1 ..= 600000".into(),
                        );
                    }
                    for (what, event) in [
                        ("transient_event", &http.transient_event),
                        ("fatal_event", &http.fatal_event),
                    ] {
                        if !leaves(&state.name, event) {
                            p(
                                format!("{item}.{what}"),
                                format!(
                                    "event `{event}` does not leave state `{}`",
                                    state.name
                                ),
                            );
                        }
                    }
                }
                (Some(_), _) => p(
                    format!("{item}.http"),
                    "only a state whose action is `http` takes an `http` table".into(),
                ),
                (None, Some("http")) => p(
                    format!("{item}.action"),
                    "an `http` action needs an `http` table with `url`, `transient_event` and `fatal_event`".into(),
                ),
                (None, _) => {}
            }
            for (item, reason) in crate::model::problems(&item, state, &leaves) {
                p(item, reason);
            }
            if rules == Rules::Registration
                && let Some((what, reason)) = transient_path_problem(state)
            {
                p(format!("{item}.{what}"), reason);
            }
        }

        let mut join_guards: HashMap<String, Arc<crate::guard::Expr>> = HashMap::new();
        for (i, state) in spec.states.iter().enumerate() {
            if let Some(fan_out) = &state.fan_out {
                let item = format!("states[{i}] ({}).fan_out", state.name);
                check_fan_out(&mut p, &item, state, fan_out, &leaves, &mut join_guards);
                if let Some(Err(reason)) = join_guards.get(&state.name).map(|e| cost_of(e)) {
                    p(format!("{item}.join.guard"), reason);
                }
            }
        }
        if let Some(budget) = &spec.budget {
            check_budget(&mut p, budget, &events, &table);
        }
        for (key, limit) in &spec.limits {
            if let Some(problem) = limit_key_problem(key) {
                p(format!("limits.{key}"), problem);
            }
            for problem in limit.problems() {
                p(format!("limits.{key}"), problem);
            }
        }
        for (i, state) in spec.states.iter().enumerate() {
            if state.limits.len() > limits::LIMITS_PER_STATE_MAX {
                p(
                    format!("states[{i}] ({}).limits", state.name),
                    format!("at most {} keys", limits::LIMITS_PER_STATE_MAX),
                );
            }
            for key in &state.limits {
                if let Some(problem) = limit_key_problem(key) {
                    p(format!("states[{i}] ({}).limits", state.name), problem);
                }
            }
            if !state.limits.is_empty() && state.action.is_none() {
                p(
                    format!("states[{i}] ({}).limits", state.name),
                    "only a state with an `action` takes limits".into(),
                );
            }
        }

        // Reachability from the initial state. CANCEL reaches the cancel state.
        if let [initial] = initials.as_slice() {
            let mut seen = BTreeSet::new();
            let mut queue = VecDeque::from([initial.clone()]);
            seen.insert(initial.clone());
            while let Some(state) = queue.pop_front() {
                for t in spec.transitions.iter().filter(|t| t.from == state) {
                    if seen.insert(t.to.clone()) {
                        queue.push_back(t.to.clone());
                    }
                }
            }
            if states.contains_key(&cancel_state) {
                seen.insert(cancel_state.clone());
            }
            for (i, state) in spec.states.iter().enumerate() {
                if !seen.contains(&state.name) {
                    p(
                        format!("states[{i}] ({})", state.name),
                        format!("unreachable state: no path leads to it from `{initial}`"),
                    );
                }
            }
        }
        if !spec.states.iter().any(|s| s.kind == StateKind::Terminal) {
            p(
                "states".into(),
                "no terminal state: a run could never end".into(),
            );
        }

        let senders = crate::external::resolve(&spec, &events, &call_results, &table, &mut p);
        if let Some(migration) = &spec.migration {
            let names: BTreeSet<&str> = spec.states.iter().map(|s| s.name.as_str()).collect();
            for (item, reason) in migration.problems(spec.version, &names) {
                p(item, reason);
            }
            for (old, new) in &migration.states {
                if states
                    .get(new)
                    .is_some_and(|s| s.kind == StateKind::Terminal)
                {
                    p(
                        format!("migration.states.{old}"),
                        format!("maps to `{new}`, a terminal state: a migration does not end runs"),
                    );
                }
            }
        }
        if let Some(problem) = spec.max_events.and_then(crate::runaway::max_events_problem) {
            p("max_events".into(), problem);
        }

        if !problems.is_empty() {
            return Err(DefinitionError::Invalid(problems));
        }
        let mut warnings = crate::runaway::timer_cycle_warnings(&spec);
        warnings.extend(crate::budget::warnings(&spec));
        let hash = crate::hash::sha256_hex(
            crate::hash::canonical_json(&serde_json::to_value(&spec).unwrap_or_default())
                .as_bytes(),
        );
        let def = Definition {
            inner: Arc::new(Inner {
                initial: initials.remove(0),
                cancel_state,
                states,
                events,
                call_results,
                table,
                priority,
                hash,
                spec,
                schemas,
                approval_rules,
                join_guards,
                senders,
                warnings,
            }),
        };
        let problems = crate::model::tool_choice_problems(&def);
        if !problems.is_empty() {
            return Err(DefinitionError::Invalid(problems));
        }
        Ok(def)
    }
}

fn check_fan_out(
    p: &mut impl FnMut(String, String),
    item: &str,
    state: &StateSpec,
    fan_out: &FanOutSpec,
    leaves: &impl Fn(&str, &str) -> bool,
    join_guards: &mut HashMap<String, Arc<crate::guard::Expr>>,
) {
    if state.kind != StateKind::Waiting {
        p(
            item.to_owned(),
            "a fan-out state waits for its branches: make it a `waiting` state".into(),
        );
    }
    if state.initial {
        p(
            item.to_owned(),
            "the initial state cannot fan out: branches start when a run enters the state".into(),
        );
    }
    let n = fan_out.branches.len();
    if n == 0 || n > limits::BRANCHES_MAX {
        p(
            format!("{item}.branches"),
            format!("{n} branches; a fan-out has 1 to {}", limits::BRANCHES_MAX),
        );
    }
    let mut names = BTreeSet::new();
    for (b, branch) in fan_out.branches.iter().enumerate() {
        let branch_item = format!("{item}.branches[{b}] ({})", branch.name);
        check_name(p, &branch_item, &branch.name);
        if !names.insert(branch.name.as_str()) {
            p(
                branch_item.clone(),
                format!("duplicate branch `{}`", branch.name),
            );
        }
        check_name(p, &format!("{branch_item}.definition"), &branch.definition);
        if branch.version == Some(0) {
            p(
                format!("{branch_item}.version"),
                "must be 1 or greater".into(),
            );
        }
        if branch.input.as_ref().is_some_and(|v| !v.is_object()) {
            p(
                format!("{branch_item}.input"),
                "a branch input is an object".into(),
            );
        }
        if branch.succeed_on.is_empty() {
            p(
                format!("{branch_item}.succeed_on"),
                "name the child's terminal states that count as success".into(),
            );
        }
        for (s, name) in branch.succeed_on.iter().enumerate() {
            check_name(p, &format!("{branch_item}.succeed_on[{s}]"), name);
        }
    }
    let join = &fan_out.join;
    match join.policy {
        JoinPolicy::All => {}
        JoinPolicy::AtLeast => match join.k {
            None => p(
                format!("{item}.join.k"),
                "policy `at_least` needs `k`".into(),
            ),
            Some(k) if k == 0 || k as usize > n => p(
                format!("{item}.join.k"),
                format!("k = {k} but the state has {n} branches: k must be 1 to {n}"),
            ),
            Some(_) => {}
        },
        JoinPolicy::Guard => match &join.guard {
            None => p(
                format!("{item}.join.guard"),
                "policy `guard` needs `guard`".into(),
            ),
            Some(expr) => match crate::guard::compile_expr(expr) {
                Ok(e) => {
                    join_guards.insert(state.name.clone(), Arc::new(e));
                }
                Err(reason) => p(format!("{item}.join.guard"), reason),
            },
        },
    }
    if join.k.is_some() && join.policy != JoinPolicy::AtLeast {
        p(
            format!("{item}.join.k"),
            "`k` goes with policy `at_least`".into(),
        );
    }
    if join.guard.is_some() && join.policy != JoinPolicy::Guard {
        p(
            format!("{item}.join.guard"),
            "`guard` goes with policy `guard`".into(),
        );
    }
    for (what, event) in [
        ("joined_event", &fan_out.joined_event),
        ("failed_event", &fan_out.failed_event),
    ] {
        if !leaves(&state.name, event) {
            p(
                format!("{item}.{what}"),
                format!("event `{event}` does not leave state `{}`", state.name),
            );
        }
    }
}

fn check_budget(
    p: &mut impl FnMut(String, String),
    budget: &BudgetSpec,
    events: &BTreeSet<String>,
    table: &HashMap<(String, String), Vec<Transition>>,
) {
    if budget.tokens.is_none()
        && budget.cost.is_none()
        && budget.wall_time_ms.is_none()
        && budget.steps.is_none()
    {
        p(
            "budget".into(),
            "declare at least one of tokens, cost, wall_time_ms, steps".into(),
        );
    }
    for (what, value) in [
        ("tokens", budget.tokens),
        ("wall_time_ms", budget.wall_time_ms),
        ("steps", budget.steps),
    ] {
        if value == Some(0) {
            p(format!("budget.{what}"), "must be greater than 0".into());
        }
    }
    if budget.cost.is_some_and(|c| !c.is_finite() || c <= 0.0) {
        p(
            "budget.cost".into(),
            "must be a finite number greater than 0".into(),
        );
    }
    if !events.contains(&budget.event) {
        p(
            format!("budget.event ({})", budget.event),
            format!("unknown event `{}`: declare it in `events`", budget.event),
        );
    } else if !table.keys().any(|(_, e)| e == &budget.event) {
        p(
            format!("budget.event ({})", budget.event),
            format!(
                "no transition takes `{}`: a run could never stop on its budget",
                budget.event
            ),
        );
    }
}

fn check_name(p: &mut impl FnMut(String, String), item: &str, name: &str) {
    if let Some(reason) = name_problem(name) {
        p(item.to_owned(), reason);
    }
}

/// A registration rule: a state whose action calls out must give a transient failure of
/// that call (connect error, timeout, 429, 5xx, ...) a path on the definition's retry path
/// rather than to an operator. "Has a path" per kind of state:
///
/// - `model`: the worker commits a transient failure of the model call as
///   `[states.model] transient_event` (`rein_worker::model`); without it the run waits for an
///   operator (OPERATOR_REQUIRED) at the first 429. So `transient_event` must be declared.
///   That it has a transition leaving the state (to a retry wait with a `backoff`, say) is
///   checked for every definition, stored ones too, wherever it is declared.
/// - `http`: `transient_event` is a required field of the `http` table and must leave the
///   state (both checked for every definition): such a state always has its path.
/// - a state with `tools`: a tool handler commits its own result events (the definition's
///   `call_results`), which the definition cannot tell transient from fatal; the engine's
///   own event for a tool call lost in doubt and found not applied is `on_lease_expired`,
///   and without it the step runs again under the same idempotency key (SPEC X7), never
///   waiting for an operator. Both
///   are accepted, so there is nothing more to refuse here.
///
/// Stored definitions keep loading without it ([`Rules::Stored`]): their runs keep going
/// to an operator on a transient failure, as they did when they were registered.
fn transient_path_problem(state: &StateSpec) -> Option<(&'static str, String)> {
    let model = state.model.as_ref()?;
    if state.action.as_deref() != Some("model") || model.transient_event.is_some() {
        return None;
    }
    Some((
        "model.transient_event",
        format!(
            "state `{name}`: a transient failure of its model call (connect error, timeout, 429, \
             5xx, a stream cut short) is committed as `transient_event`, but the definition has \
             none, so the run would wait for an operator; add `transient_event = \"MODEL_RETRYABLE_FAILED\"` \
             (an event of `events`) to [states.model] and a transition from `{name}` on it to a \
             state that retries (a waiting state with a `backoff` whose `due` leads back to \
             `{name}`) so retries have a path",
            name = state.name
        ),
    ))
}
