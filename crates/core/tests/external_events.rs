//! Which events a definition takes from callers outside the engine (SPEC Z3): declared in
//! `external_events`, checked when the definition is validated, and derived for definitions
//! stored before the field existed.

use rein_core::{Definition, DefinitionError, Format, GuardRegistry, builtin};

/// A run that waits for a reply (`reply`), may be told to give up (`abandon`), has a
/// backoff and an approval: start -work-> ... with a call result `done`.
const WAITS: &str = r#"
name = "waits"
version = 1
cancel_state = "cancelled"
events = ["work", "done", "ask", "reply", "abandon", "due", "exhausted", "approve", "deny", "expired", "remind"]
call_results = ["done"]

[[states]]
name = "start"
kind = "active"
initial = true
action = "sim"

[[states]]
name = "asking"
kind = "waiting"

[[states]]
name = "backing_off"
kind = "waiting"
backoff = { due = "due", exhausted = "exhausted" }

[[states]]
name = "approving"
kind = "waiting"
approval = { expires_after_ms = 1000, expiry_event = "expired", reminder_event = "remind", remind_before_ms = 100, granted_event = "approve", denied_event = "deny" }

[[states]]
name = "finished"
kind = "terminal"

[[states]]
name = "cancelled"
kind = "terminal"

[[transitions]]
from = "start"
event = "done"
to = "finished"
effects = ["complete_step"]

[[transitions]]
from = "start"
event = "ask"
to = "asking"

[[transitions]]
from = "start"
event = "work"
to = "backing_off"

[[transitions]]
from = "asking"
event = "reply"
to = "approving"

[[transitions]]
from = "asking"
event = "abandon"
to = "cancelled"

[[transitions]]
from = "asking"
event = "done"
to = "finished"

[[transitions]]
from = "backing_off"
event = "due"
to = "start"

[[transitions]]
from = "backing_off"
event = "exhausted"
to = "cancelled"

[[transitions]]
from = "approving"
event = "approve"
to = "start"

[[transitions]]
from = "approving"
event = "deny"
to = "cancelled"

[[transitions]]
from = "approving"
event = "expired"
to = "cancelled"

[[transitions]]
from = "approving"
event = "remind"
to = "approving"
"#;

fn parse(text: &str) -> Result<Definition, DefinitionError> {
    Definition::parse(text, Format::Toml, &GuardRegistry::new())
}

/// WAITS declaring `external_events = LIST` (TOML).
fn declaring(list: &str) -> String {
    WAITS.replacen(
        "call_results = [\"done\"]",
        &format!("call_results = [\"done\"]\nexternal_events = {list}"),
        1,
    )
}

fn external(def: &Definition) -> Vec<&str> {
    def.external_events().map(String::as_str).collect()
}

#[test]
fn a_declared_list_is_exactly_what_outside_callers_may_send() {
    let def = parse(&declaring(r#"["reply", "approve"]"#)).expect("valid");
    assert_eq!(external(&def), ["approve", "reply"]);
    assert!(def.accepts_from_outside("reply"));
    assert!(def.accepts_from_outside("CANCEL"), "CANCEL is always taken");
    for engine_only in ["abandon", "deny", "done", "work", "ACTION_DISPATCHED"] {
        assert!(!def.accepts_from_outside(engine_only), "{engine_only}");
    }
    assert!(def.is_approval_event("approve") && def.is_approval_event("deny"));
    assert!(!def.is_approval_event("reply"));
    let none = parse(&declaring("[]")).expect("valid");
    assert_eq!(external(&none), Vec::<&str>::new());
    assert!(none.accepts_from_outside("CANCEL"));
}

#[test]
fn a_list_naming_anything_but_the_definitions_own_events_is_refused() {
    for (list, item, reason) in [
        (
            r#"["nope"]"#,
            "external_events[0] (nope)",
            "unknown event `nope`",
        ),
        (
            r#"["done"]"#,
            "external_events[0] (done)",
            "is a call result",
        ),
        (
            r#"["ACTION_DISPATCHED"]"#,
            "external_events[0] (ACTION_DISPATCHED)",
            "is an engine event",
        ),
        (
            r#"["CANCEL"]"#,
            "external_events[0] (CANCEL)",
            "always accepted",
        ),
        (
            r#"["reply", "reply"]"#,
            "external_events[1] (reply)",
            "listed twice",
        ),
    ] {
        let err = parse(&declaring(list)).expect_err(list);
        assert!(
            err.problems()
                .iter()
                .any(|p| p.item == item && p.reason.contains(reason)),
            "{list}: no problem `{item}: …{reason}…` in\n{err}"
        );
    }
}

/// A definition stored before `external_events` existed still loads, and takes from outside
/// what its runs wait for: events of waiting states that the engine does not commit itself
/// (not backoff, approval expiry or reminder events, not call results), and its approval
/// events — never what an active state's action decides.
#[test]
fn a_definition_without_a_list_takes_what_its_waiting_states_wait_for() {
    let def = parse(WAITS).expect("valid");
    assert_eq!(external(&def), ["abandon", "approve", "deny", "reply"]);
}

#[test]
fn the_built_in_definitions_declare_their_external_events() {
    for (name, text) in builtin::ALL {
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with("external_events =")),
            "{name} declares no external_events"
        );
    }
    let expect = [
        (
            "lifecycle",
            vec!["approval_denied", "approval_granted", "dependency_resolved"],
        ),
        (
            "research-agent",
            vec!["APPROVED", "REJECTED", "USER_CANCELLED", "USER_REPLY"],
        ),
        ("refund-agent", vec![]),
        ("chain4", vec![]),
    ];
    for (name, events) in expect {
        let def = builtin::load(name).expect("built in").expect("valid");
        assert_eq!(external(&def), events, "{name}");
    }
    let lifecycle = builtin::lifecycle();
    assert!(lifecycle.is_approval_event("approval_granted"));
    assert!(lifecycle.is_approval_event("approval_denied"));
    assert!(!lifecycle.is_approval_event("dependency_resolved"));
}

/// The built-ins' bodies as stored before they declared `external_events` load with the
/// derived list, which takes the same replies and approvals as the declared one.
#[test]
fn built_ins_stored_without_a_list_keep_taking_their_replies() {
    for name in ["lifecycle", "research-agent"] {
        let text = builtin::source(name).expect("built in");
        let old: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("external_events ="))
            .map(|l| format!("{l}\n"))
            .collect();
        let old = parse(&old).expect("the body without the list still validates");
        let new = builtin::load(name).expect("built in").expect("valid");
        assert_eq!(external(&old), external(&new), "{name}");
    }
}
