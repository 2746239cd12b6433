//! Which endpoints each model key may be sent to. A definition is written by a tenant and
//! names both the key variable (`api_key_env`) and where the call goes (`base_url`); without
//! a binding, whoever may publish could point a definition at its own server and receive the
//! fleet's key. The API (at registration) and the worker (before every call) ask the same
//! [`KeyBindings`], built from the same `--model-key NAME=URL[,URL…]` flag.
//!
//! Defaults: `OPENAI_API_KEY` may reach `https://api.openai.com/v1`, and `REIN_MODEL_KEY` the
//! process's `REIN_MODEL_URL` when it has one. A binding given for a name replaces that
//! name's default.
//!
//! An endpoint admits a base URL with the same scheme, host (case-insensitive) and port
//! (default ports normalised) whose path is the bound path or continues it at a segment
//! boundary: `https://h/v1` admits `https://h/v1` and `https://h/v1/x`, not `https://h/v1x`.
//! No wildcards. Pure: the process's `REIN_MODEL_URL` is an argument.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Value, json};
use url::Url;

use crate::definition::DefinitionSpec;

/// The failure kind of a call whose key is not bound to its endpoint: nothing was sent.
pub const KEY_NOT_BOUND: &str = "key_not_bound";
/// Where `OPENAI_API_KEY` may go unless a binding says otherwise.
pub const OPENAI_URL: &str = "https://api.openai.com/v1";
/// Most key variables bound in one process.
pub const BINDINGS_MAX: usize = 64;
/// Most endpoints one key may be bound to.
pub const ENDPOINTS_PER_KEY_MAX: usize = 16;

/// One endpoint a key may be sent to: a scheme, host, port and path prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    url: Url,
}

impl Endpoint {
    /// Parses a bound URL: http or https, with a host, and no credentials, query or
    /// fragment (a binding names a place, nothing to send along).
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        let url = crate::http_url::parse(text.trim()).map_err(|p| p.reason)?;
        if url.query().is_some() || url.fragment().is_some() {
            return Err(format!(
                "`{}` has a query or fragment; bind a key to SCHEME://HOST[:PORT]/PATH only",
                crate::text::storable(text)
            ));
        }
        if url.host_str().is_some_and(|h| h.contains('*')) {
            return Err(format!(
                "`{}` holds a wildcard; a key is bound to exact hosts, so name each one",
                crate::text::storable(text)
            ));
        }
        Ok(Endpoint { url })
    }

    /// The bound path without its trailing slash (`""` for the root).
    fn path(&self) -> &str {
        self.url.path().trim_end_matches('/')
    }

    /// Whether a call to `base` stays within this endpoint.
    pub fn admits(&self, base: &Url) -> bool {
        let host = |u: &Url| u.host_str().map(str::to_ascii_lowercase);
        if self.url.scheme() != base.scheme()
            || host(&self.url) != host(base)
            || self.url.port_or_known_default() != base.port_or_known_default()
        {
            return false;
        }
        let bound = self.path();
        let path = base.path();
        path == bound || path.strip_prefix(bound).is_some_and(|r| r.starts_with('/'))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.url.as_str().trim_end_matches('/'))
    }
}

/// One `NAME=URL[,URL…]` of `--model-key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub name: String,
    pub endpoints: Vec<Endpoint>,
}

impl Binding {
    /// Parses `NAME=URL[,URL…]`; the name must be one a definition may name.
    pub fn parse(text: &str) -> Result<Binding, String> {
        let Some((name, urls)) = text.split_once('=') else {
            return Err(format!(
                "`{}` is not NAME=URL[,URL…]; e.g. OPENAI_API_KEY=https://api.openai.com/v1",
                crate::text::storable(&text.chars().take(64).collect::<String>())
            ));
        };
        let name = name.trim();
        if let Some(problem) = crate::model::key_env_problem(name) {
            return Err(problem);
        }
        let endpoints = urls
            .split(',')
            .filter(|u| !u.trim().is_empty())
            .map(Endpoint::parse)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{name}: {e}"))?;
        if endpoints.is_empty() {
            return Err(format!(
                "{name}: give at least one URL, e.g. {name}=https://api.openai.com/v1"
            ));
        }
        if endpoints.len() > ENDPOINTS_PER_KEY_MAX {
            return Err(format!(
                "{name}: at most {ENDPOINTS_PER_KEY_MAX} URLs per key"
            ));
        }
        Ok(Binding {
            name: name.to_owned(),
            endpoints,
        })
    }
}

/// Why a key may not be sent to a base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotBound {
    pub name: String,
    /// The base URL asked for, as it may be quoted.
    pub base_url: String,
    /// Where the key may go (empty: nowhere).
    pub endpoints: Vec<String>,
}

impl fmt::Display for NotBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = &self.name;
        if self.endpoints.is_empty() {
            write!(
                f,
                "{name} is bound to no endpoint, so it is not sent to {}; bind it on the workers and the API with --model-key {name}=URL (REIN_MODEL_KEYS)",
                self.base_url
            )
        } else {
            write!(
                f,
                "{name} may be sent only to {}, not to {}; point base_url at one of those, or bind the key to this endpoint on the workers and the API with --model-key {name}=URL (REIN_MODEL_KEYS)",
                self.endpoints.join(", "),
                self.base_url
            )
        }
    }
}

/// Every key variable's endpoints, and the base URL of model states that give none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyBindings {
    keys: BTreeMap<String, Vec<Endpoint>>,
    default_base_url: Option<String>,
}

impl Default for KeyBindings {
    /// The defaults of a process without `REIN_MODEL_URL`.
    fn default() -> KeyBindings {
        KeyBindings::new(Vec::new(), None).unwrap_or(KeyBindings {
            keys: BTreeMap::new(),
            default_base_url: None,
        })
    }
}

impl KeyBindings {
    /// The defaults, with `given` replacing the default of each name it binds (a name given
    /// twice gets the endpoints of both). `model_url` is the process's `REIN_MODEL_URL`; one
    /// that cannot be bound leaves `REIN_MODEL_KEY` bound to nothing.
    pub fn new(given: Vec<Binding>, model_url: Option<&str>) -> Result<KeyBindings, String> {
        let model_url = model_url.map(str::trim).filter(|u| !u.is_empty());
        let mut keys: BTreeMap<String, Vec<Endpoint>> = BTreeMap::new();
        if let Ok(openai) = Endpoint::parse(OPENAI_URL) {
            keys.insert("OPENAI_API_KEY".into(), vec![openai]);
        }
        keys.insert(
            "REIN_MODEL_KEY".into(),
            model_url
                .and_then(|u| Endpoint::parse(u).ok())
                .into_iter()
                .collect(),
        );
        let mut replaced: Vec<String> = Vec::new();
        for binding in given {
            if !replaced.contains(&binding.name) {
                keys.insert(binding.name.clone(), Vec::new());
                replaced.push(binding.name.clone());
            }
            let endpoints = keys.entry(binding.name.clone()).or_default();
            for e in binding.endpoints {
                if !endpoints.contains(&e) {
                    endpoints.push(e);
                }
            }
            if endpoints.len() > ENDPOINTS_PER_KEY_MAX {
                return Err(format!(
                    "{}: at most {ENDPOINTS_PER_KEY_MAX} URLs per key",
                    binding.name
                ));
            }
        }
        if keys.len() > BINDINGS_MAX {
            return Err(format!("bind at most {BINDINGS_MAX} key variables"));
        }
        Ok(KeyBindings {
            keys,
            default_base_url: model_url.map(str::to_owned),
        })
    }

    /// The key variables a binding names (defaults included).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Where key `name` may go.
    pub fn endpoints(&self, name: &str) -> &[Endpoint] {
        self.keys.get(name).map_or(&[], Vec::as_slice)
    }

    /// The base URL of model states that give none (the process's `REIN_MODEL_URL`).
    pub fn default_base_url(&self) -> Option<&str> {
        self.default_base_url.as_deref()
    }

    /// Whether key `name` may be sent to `base_url`.
    pub fn check(&self, name: &str, base_url: &str) -> Result<(), NotBound> {
        let endpoints = self.endpoints(name);
        let admitted = crate::http_url::parse(base_url)
            .is_ok_and(|base| endpoints.iter().any(|e| e.admits(&base)));
        if admitted {
            return Ok(());
        }
        Err(NotBound {
            name: name.to_owned(),
            base_url: crate::text::storable(&base_url.chars().take(200).collect::<String>()),
            endpoints: endpoints.iter().map(ToString::to_string).collect(),
        })
    }

    /// The model states of `spec` whose key would go to an endpoint it is not bound to, by
    /// item. A state without `base_url` is checked against this process's `REIN_MODEL_URL`,
    /// and not at all when there is none (the worker's decides, and the worker checks it).
    pub fn problems(&self, spec: &DefinitionSpec) -> Vec<(String, NotBound)> {
        let mut out = Vec::new();
        for (i, state) in spec.states.iter().enumerate() {
            let Some(model) = &state.model else { continue };
            let Some(name) = &model.api_key_env else {
                continue;
            };
            let Some(base) = model.base_url.as_deref().or(self.default_base_url()) else {
                continue;
            };
            if let Err(not_bound) = self.check(name, base) {
                out.push((
                    format!("states[{i}] ({}).model.api_key_env", state.name),
                    not_bound,
                ));
            }
        }
        out
    }

    /// What a worker reports with its heartbeat: each key variable and where it may go
    /// (names and URLs, never a key).
    pub fn to_json(&self) -> Value {
        let keys: serde_json::Map<String, Value> = self
            .keys
            .iter()
            .map(|(name, endpoints)| {
                let urls: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
                (name.clone(), json!(urls))
            })
            .collect();
        Value::Object(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(binding: &str) -> KeyBindings {
        KeyBindings::new(vec![Binding::parse(binding).expect(binding)], None).expect("bindings")
    }

    #[test]
    fn the_defaults_bind_openai_to_its_api_and_rein_model_key_to_rein_model_url() {
        let keys = KeyBindings::new(Vec::new(), Some("http://127.0.0.1:8089/v1")).expect("keys");
        assert!(
            keys.check("OPENAI_API_KEY", "https://api.openai.com/v1")
                .is_ok()
        );
        assert!(
            keys.check("OPENAI_API_KEY", "http://127.0.0.1:8089/v1")
                .is_err()
        );
        assert!(
            keys.check("REIN_MODEL_KEY", "http://127.0.0.1:8089/v1")
                .is_ok()
        );
        assert!(
            keys.check("REIN_MODEL_KEY", "https://api.openai.com/v1")
                .is_err()
        );
        let unset = KeyBindings::default();
        let refused = unset
            .check("REIN_MODEL_KEY", "http://127.0.0.1:8089/v1")
            .expect_err("bound to nothing");
        assert!(refused.endpoints.is_empty());
        assert!(
            refused
                .to_string()
                .contains("--model-key REIN_MODEL_KEY=URL")
        );
    }

    #[test]
    fn a_given_binding_replaces_the_names_default_and_adds_new_names() {
        let keys = KeyBindings::new(
            vec![
                Binding::parse("OPENAI_API_KEY=https://proxy.example/v1").expect("one"),
                Binding::parse("TEAM_KEY=http://a.example/v1,http://b.example:8080/llm")
                    .expect("two"),
                Binding::parse("TEAM_KEY=http://c.example/v1").expect("again"),
            ],
            None,
        )
        .expect("keys");
        assert!(
            keys.check("OPENAI_API_KEY", "https://api.openai.com/v1")
                .is_err()
        );
        assert!(
            keys.check("OPENAI_API_KEY", "https://proxy.example/v1")
                .is_ok()
        );
        for base in [
            "http://a.example/v1",
            "http://b.example:8080/llm/",
            "http://c.example/v1",
        ] {
            assert!(keys.check("TEAM_KEY", base).is_ok(), "{base}");
        }
        assert!(keys.check("OTHER_KEY", "http://a.example/v1").is_err());
        assert_eq!(
            keys.to_json()["TEAM_KEY"],
            json!([
                "http://a.example/v1",
                "http://b.example:8080/llm",
                "http://c.example/v1"
            ])
        );
    }

    #[test]
    fn the_port_must_match_with_default_ports_normalised() {
        let keys = bound("K=https://api.example.com/v1");
        assert!(keys.check("K", "https://api.example.com:443/v1").is_ok());
        assert!(keys.check("K", "https://api.example.com:8443/v1").is_err());
        let keys = bound("K=http://127.0.0.1:8089/v1");
        assert!(keys.check("K", "http://127.0.0.1:8089/v1").is_ok());
        assert!(keys.check("K", "http://127.0.0.1/v1").is_err());
        assert!(keys.check("K", "http://127.0.0.1:8090/v1").is_err());
    }

    #[test]
    fn the_path_must_continue_the_bound_path_at_a_segment_boundary() {
        let keys = bound("K=https://api.example.com/v1");
        for base in [
            "https://api.example.com/v1",
            "https://api.example.com/v1/",
            "https://api.example.com/v1/x",
        ] {
            assert!(keys.check("K", base).is_ok(), "{base}");
        }
        for base in [
            "https://api.example.com/v1x",
            "https://api.example.com/",
            "https://api.example.com/v2/v1",
            "https://api.example.com/v1/../evil",
            "https://api.example.com/v1/%2e%2e/evil",
        ] {
            assert!(keys.check("K", base).is_err(), "{base}");
        }
        let root = bound("K=https://api.example.com/");
        assert!(root.check("K", "https://api.example.com/anything").is_ok());
    }

    #[test]
    fn the_scheme_must_match_and_the_host_ignores_case_only() {
        let keys = bound("K=https://API.Example.com/v1");
        assert!(keys.check("K", "https://api.example.COM/v1").is_ok());
        assert!(keys.check("K", "http://api.example.com/v1").is_err());
        for base in [
            "https://api.example.com.evil.net/v1",
            "https://evil.net/v1?https://api.example.com/v1",
            "https://api.example.com@evil.net/v1",
            "https://sub.api.example.com/v1",
            "not a url",
        ] {
            assert!(keys.check("K", base).is_err(), "{base}");
        }
    }

    #[test]
    fn bound_urls_with_credentials_a_query_or_a_fragment_and_bad_names_are_refused() {
        for text in [
            "K=https://u:p@api.example.com/v1",
            "K=https://api.example.com/v1?x=1",
            "K=https://api.example.com/v1#f",
            "K=ftp://api.example.com/",
            "K=",
            "K",
            "DATABASE_URL=https://api.example.com/v1",
            "lower=https://api.example.com/v1",
            "K=https://*.example.com/v1",
        ] {
            assert!(Binding::parse(text).is_err(), "{text}");
        }
        let error = Binding::parse("K=https://u:hunter2@api.example.com/v1").expect_err("creds");
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn a_refusal_names_where_the_key_may_go() {
        let refused = KeyBindings::default()
            .check("OPENAI_API_KEY", "http://attacker.example/v1")
            .expect_err("unbound");
        let said = refused.to_string();
        assert!(said.contains("https://api.openai.com/v1"), "{said}");
        assert!(said.contains("http://attacker.example/v1"), "{said}");
    }
}
