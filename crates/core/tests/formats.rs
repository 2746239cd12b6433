//! One definition, three languages (SPEC M1): a definition written in TOML, JSON or YAML
//! parses into the same spec and has the same hash, and a malformed YAML document is refused
//! with the line it breaks on.

use rein_core::{Definition, DefinitionError, Format, GuardRegistry, builtin};

fn parse(text: &str, format: Format) -> Definition {
    Definition::parse(text, format, &GuardRegistry::new())
        .unwrap_or_else(|e| panic!("{format:?} parses: {e}\n{text}"))
}

/// A small definition as a person would write it in each language.
const TOML: &str = r#"
name = "greeter"
version = 3
description = "Says hello, waits for a reply, then ends."
cancel_state = "CANCELLED"
events = ["GREETED", "REPLIED"]
external_events = ["REPLIED"]

[[states]]
name = "GREET"
kind = "active"
initial = true
action = "noop"
timeout = { after_ms = 5000, event = "GREETED" }

[[states]]
name = "WAIT"
kind = "waiting"

[[states]]
name = "DONE"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "GREET"
event = "GREETED"
to = "WAIT"

[[transitions]]
from = "WAIT"
event = "REPLIED"
to = "DONE"
guards = [{ kind = "business", name = "any_reply", expr = "size(payload) >= 0" }]
"#;

const YAML: &str = r#"
# The same definition in YAML: comments, block lists, a flow map.
name: greeter
version: 3
description: Says hello, waits for a reply, then ends.
cancel_state: CANCELLED
events: [GREETED, REPLIED]
external_events:
  - REPLIED
states:
  - name: GREET
    kind: active
    initial: true
    action: noop
    timeout: {after_ms: 5000, event: GREETED}
  - {name: WAIT, kind: waiting}
  - name: DONE
    kind: terminal
  - name: CANCELLED
    kind: terminal
transitions:
  - from: GREET
    event: GREETED
    to: WAIT
  - from: WAIT
    event: REPLIED
    to: DONE
    guards:
      - kind: business
        name: any_reply
        expr: size(payload) >= 0
"#;

const JSON: &str = r#"{
  "name": "greeter", "version": 3,
  "description": "Says hello, waits for a reply, then ends.",
  "cancel_state": "CANCELLED",
  "events": ["GREETED", "REPLIED"], "external_events": ["REPLIED"],
  "states": [
    {"name": "GREET", "kind": "active", "initial": true, "action": "noop",
     "timeout": {"after_ms": 5000, "event": "GREETED"}},
    {"name": "WAIT", "kind": "waiting"},
    {"name": "DONE", "kind": "terminal"},
    {"name": "CANCELLED", "kind": "terminal"}
  ],
  "transitions": [
    {"from": "GREET", "event": "GREETED", "to": "WAIT"},
    {"from": "WAIT", "event": "REPLIED", "to": "DONE",
     "guards": [{"kind": "business", "name": "any_reply", "expr": "size(payload) >= 0"}]}
  ]
}"#;

#[test]
fn one_definition_written_in_toml_json_and_yaml_has_one_hash() {
    let toml = parse(TOML, Format::Toml);
    let json = parse(JSON, Format::Json);
    let yaml = parse(YAML, Format::Yaml);
    assert_eq!(toml.hash(), json.hash());
    assert_eq!(toml.hash(), yaml.hash());
    assert_eq!(toml.spec(), yaml.spec());
    // A change shows in the hash, whatever the language.
    let changed = parse(&YAML.replace("version: 3", "version: 4"), Format::Yaml);
    assert_ne!(changed.hash(), yaml.hash());
}

#[test]
fn every_built_in_definition_has_the_same_hash_in_yaml_and_json() {
    for (name, text) in builtin::ALL {
        let toml = parse(text, Format::Toml);
        let doc: toml::Value = toml::from_str(text).expect("built-ins are TOML");
        let yaml_text = serde_norway::to_string(&doc).expect("TOML converts to YAML");
        let json_text = serde_json::to_string(&doc).expect("TOML converts to JSON");
        let yaml = parse(&yaml_text, Format::Yaml);
        let json = parse(&json_text, Format::Json);
        assert_eq!(yaml.hash(), toml.hash(), "{name}: YAML and TOML");
        assert_eq!(json.hash(), toml.hash(), "{name}: JSON and TOML");
    }
}

#[test]
fn the_format_follows_the_file_name() {
    assert_eq!(Format::from_path("agent.yaml"), Format::Yaml);
    assert_eq!(Format::from_path("dir/AGENT.YML"), Format::Yaml);
    assert_eq!(Format::from_path("agent.json"), Format::Json);
    assert_eq!(Format::from_path("agent.toml"), Format::Toml);
    assert_eq!(Format::from_path("agent"), Format::Toml);
}

fn parse_error(text: &str) -> String {
    match Definition::parse(text, Format::Yaml, &GuardRegistry::new()) {
        Err(DefinitionError::Parse(message)) => message,
        other => panic!("a parse error, not {other:?}"),
    }
}

#[test]
fn malformed_yaml_is_refused_with_its_line() {
    // A mapping key indented one space too far on line 5.
    let broken = YAML.replacen("    kind: active", "     kind: active", 1);
    let message = parse_error(&broken);
    assert!(message.starts_with("YAML: "), "{message}");
    assert!(message.contains("line "), "{message}");

    // An unknown field is named, with where it is.
    let unknown = YAML.replacen("    initial: true", "    initial: true\n    colour: red", 1);
    let message = parse_error(&unknown);
    assert!(message.contains("colour"), "{message}");
    assert!(message.contains("line 14 column 5"), "{message}");

    // Two documents in one file are not one definition.
    let message = parse_error(&format!("{YAML}\n---\n{YAML}"));
    assert!(message.contains("more than one document"), "{message}");
}

#[test]
fn a_yaml_scalar_keeps_its_type_so_yaml_and_json_agree() {
    // `action: false` is a boolean where text is expected: JSON refuses it, and so must YAML,
    // rather than loading an action named "false".
    let yaml = YAML.replacen("    action: noop", "    action: false", 1);
    let message = parse_error(&yaml);
    assert!(message.contains("boolean"), "{message}");
    assert!(message.contains("quote a value"), "{message}");
    let json: serde_json::Value = serde_norway::from_str(&yaml).unwrap();
    assert!(
        Definition::parse(&json.to_string(), Format::Json, &GuardRegistry::new()).is_err(),
        "the JSON form is refused too"
    );
    // Quoted, it is text, in both.
    let quoted = YAML.replacen("    action: noop", "    action: \"noop\"", 1);
    let a = Definition::parse(&quoted, Format::Yaml, &GuardRegistry::new()).unwrap();
    let b = Definition::parse(YAML, Format::Yaml, &GuardRegistry::new()).unwrap();
    assert_eq!(a.hash(), b.hash());
}

#[test]
fn yaml_aliases_cannot_unfold_a_small_document_into_a_huge_one() {
    // Constants take any value, so this is expanded unless the parser bounds it: 10^12
    // strings from under 2 KiB.
    let mut bomb = String::from(
        "name: bomb\nversion: 1\nconstants:\n  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n",
    );
    for i in 1..12 {
        let prev = i - 1;
        let refs = vec![format!("*a{prev}"); 10].join(", ");
        bomb.push_str(&format!("  a{i}: &a{i} [{refs}]\n"));
    }
    assert!(bomb.len() < 4096);
    // Refused at the first anchor, before anything is expanded.
    let started = std::time::Instant::now();
    let message = parse_error(&bomb);
    assert!(
        message.contains("line 4 column 7") && message.contains("write the value out"),
        "{message}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}
