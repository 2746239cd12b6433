//! Definitions shipped with Rein (SPEC M7), embedded from `definitions/` at build time.

use crate::definition::{Definition, DefinitionError, Format};
use crate::guard::GuardRegistry;

pub const LIFECYCLE: &str = include_str!("../../../definitions/lifecycle.toml");
pub const RESEARCH_AGENT: &str = include_str!("../../../definitions/research-agent.toml");
pub const CHAIN4: &str = include_str!("../../../definitions/chain4.toml");
pub const REFUND_AGENT: &str = include_str!("../../../definitions/refund-agent.toml");
pub const SUPPORT_AGENT: &str = include_str!("../../../definitions/support-agent.toml");

/// Name and source of every built-in definition.
pub const ALL: [(&str, &str); 5] = [
    ("lifecycle", LIFECYCLE),
    ("research-agent", RESEARCH_AGENT),
    ("chain4", CHAIN4),
    ("refund-agent", REFUND_AGENT),
    ("support-agent", SUPPORT_AGENT),
];

pub fn source(name: &str) -> Option<&'static str> {
    ALL.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// The source of built-in `name` declaring `version` instead of its own: the start of a
/// new version derived from it (a changed copy needs a version of its own, SPEC V1).
pub fn source_at_version(name: &str, version: u32) -> Option<String> {
    let text = source(name)?;
    let own = text
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .filter(|v| v.parse::<u32>().is_ok())?;
    Some(text.replacen(
        &format!("\nversion = {own}\n"),
        &format!("\nversion = {version}\n"),
        1,
    ))
}

/// Loads a built-in definition by name.
pub fn load(name: &str) -> Option<Result<Definition, DefinitionError>> {
    source(name).map(|text| Definition::parse(text, Format::Toml, &GuardRegistry::new()))
}

pub fn lifecycle() -> Definition {
    load("lifecycle")
        .and_then(Result::ok)
        .expect("the shipped lifecycle definition is validated by tests")
}

pub fn research_agent() -> Definition {
    load("research-agent")
        .and_then(Result::ok)
        .expect("the shipped research-agent definition is validated by tests")
}

pub fn refund_agent() -> Definition {
    load("refund-agent")
        .and_then(Result::ok)
        .expect("the shipped refund-agent definition is validated by tests")
}
