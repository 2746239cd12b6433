//! The shape of an http node's URL (SPEC I2, Z4): what the text alone says about where a call
//! would go, before a worker's egress policy looks at the address it leads to.
//!
//! A URL is read the way the HTTP client reads it (the WHATWG URL rules of the `url` crate),
//! so the host a check sees is the host a call reaches: `http://0x7f000001/` is
//! `http://127.0.0.1/`, `HTTP://Example.COM./` is `http://example.com./`. Refused outright:
//! a scheme other than http and https, credentials in the URL (they would be stored in the
//! definition, readable by anyone who can read it, and sent to whatever host the URL names),
//! and a URL without a host.

use url::Url;

use crate::limits;
use crate::spec::{DefinitionProblem, DefinitionSpec};

/// The stable names of the rules [`parse`] applies; an `egress_refused` event names one.
pub mod rule {
    /// Not a URL at all.
    pub const BAD_URL: &str = "bad_url";
    /// A scheme other than `http` or `https`.
    pub const SCHEME: &str = "scheme";
    /// A user name or password in the URL.
    pub const USERINFO: &str = "userinfo";
    /// No host to call.
    pub const NO_HOST: &str = "no_host";
}

/// Why a URL cannot be called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlProblem {
    /// One of [`rule`].
    pub rule: &'static str,
    pub reason: String,
}

/// Parses and normalises an http node's URL, refusing what no call may use. The reason never
/// repeats a password the URL holds.
pub fn parse(text: &str) -> Result<Url, UrlProblem> {
    let problem = |rule, reason: String| Err(UrlProblem { rule, reason });
    if text.len() > limits::URL_LEN_MAX {
        return problem(
            rule::BAD_URL,
            format!(
                "the URL is {} bytes; at most {} are accepted",
                text.len(),
                limits::URL_LEN_MAX
            ),
        );
    }
    let url = match Url::parse(text) {
        Ok(url) => url,
        Err(url::ParseError::EmptyHost) => {
            return problem(
                rule::NO_HOST,
                "the URL names no host: write http://HOST[:PORT]/PATH".into(),
            );
        }
        Err(e) => return problem(rule::BAD_URL, format!("not a valid URL: {e}")),
    };
    if !matches!(url.scheme(), "http" | "https") {
        return problem(
            rule::SCHEME,
            format!(
                "the scheme `{}` is not http or https",
                crate::text::storable(url.scheme())
            ),
        );
    }
    if !url.username().is_empty() || url.password().is_some() {
        return problem(
            rule::USERINFO,
            "the URL carries credentials (USER:PASSWORD@HOST): they would be stored in the \
             definition and sent to whatever host it names; remove them and let the node \
             authenticate Rein's calls another way (its network, a proxy or a header it sets)"
                .into(),
        );
    }
    match url.host_str() {
        Some(host) if !host.is_empty() => Ok(url),
        _ => problem(
            rule::NO_HOST,
            "the URL names no host: write http://HOST[:PORT]/PATH".into(),
        ),
    }
}

/// The problems [`parse`] finds in a definition's http URLs, by item. The scheme is left to
/// the definition's own validation, which reports it for stored definitions too.
pub(crate) fn problems(spec: &DefinitionSpec) -> Vec<DefinitionProblem> {
    let mut out = Vec::new();
    for (i, state) in spec.states.iter().enumerate() {
        let Some(http) = &state.http else { continue };
        let urls = std::iter::once(("url", &http.url))
            .chain(http.reconcile_url.iter().map(|u| ("reconcile_url", u)));
        for (what, url) in urls {
            match parse(url) {
                Err(p) if p.rule != rule::SCHEME => out.push(DefinitionProblem {
                    item: format!("states[{i}] ({}).http.{what}", state.name),
                    reason: p.reason,
                }),
                _ => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalised_the_way_the_client_reads_them() {
        for (text, host, port) in [
            ("http://0x7f000001/", "127.0.0.1", 80),
            ("http://2852039166/latest", "169.254.169.254", 80),
            ("http://0251.0376.0251.0376/", "169.254.169.254", 80),
            ("HTTPS://Example.COM:8443/x", "example.com", 8443),
            ("http://[::ffff:169.254.169.254]/", "[::ffff:a9fe:a9fe]", 80),
        ] {
            let url = parse(text).unwrap_or_else(|p| panic!("{text}: {p:?}"));
            assert_eq!(url.host_str(), Some(host), "{text}");
            assert_eq!(url.port_or_known_default(), Some(port), "{text}");
        }
    }

    #[test]
    fn credentials_a_missing_host_and_other_schemes_are_refused() {
        for (text, rule) in [
            ("http://user:hunter2@example.com/", rule::USERINFO),
            ("http://user@example.com/", rule::USERINFO),
            ("http://:hunter2@example.com/", rule::USERINFO),
            ("http://", rule::NO_HOST),
            ("https://:80/", rule::NO_HOST),
            ("ftp://example.com/", rule::SCHEME),
            ("file:///etc/passwd", rule::SCHEME),
            ("not a url", rule::BAD_URL),
            ("http://exa mple.com/", rule::BAD_URL),
        ] {
            let problem = parse(text).expect_err(text);
            assert_eq!(problem.rule, rule, "{text}: {problem:?}");
            assert!(!problem.reason.contains("hunter2"), "{problem:?}");
        }
        let long = format!("http://example.com/{}", "a".repeat(limits::URL_LEN_MAX));
        assert_eq!(parse(&long).unwrap_err().rule, rule::BAD_URL);
    }
}
