//! Where an outgoing call may connect (SPEC Z4): the worker's egress policy for http nodes
//! and model actions (every URL a definition names), and the scheduler's for webhook
//! deliveries (every URL `rein webhooks add` registers), checked again when one is
//! registered. Refusals name the process and flag that open an address ([`Caller`]).
//!
//! A definition's author (or a webhook's) chooses the URL; the operator of the process that
//! calls it chooses what it may reach.
//! The URL is parsed and normalised first ([`rein_core::http_url`]: no credentials, a host,
//! http or https), then the address it leads to is checked: an IP written in the URL at once,
//! a host name once it is resolved, by the resolver the HTTP client connects with
//! ([`Resolver`], one per port), so the address checked is the address connected to and a
//! name that resolves to something else the second time (DNS rebinding) gains nothing.
//!
//! Refused unless an entry of the allow list names them exactly:
//! - cloud metadata endpoints (169.254.169.254, 169.254.170.2, fd00:ec2::254,
//!   100.100.100.200, 192.0.0.192) and the rest of the link-local ranges (169.254.0.0/16,
//!   fe80::/10); "exactly" means a host name equal to the URL's, or an address or CIDR
//!   inside the refused range: `0.0.0.0/0` does not open them;
//! - the worker's own services, host:port of its database (and Redis), by name and by
//!   every address the name resolves to (any loopback address when the service is on
//!   loopback); only an entry with that port opens them;
//! - the unspecified addresses (0.0.0.0/8, ::), which reach the local machine, always.
//!
//! With no allow list everything else is allowed, loopback included (local development, the
//! examples, test stand-ins). With one (`rein worker --http-allow`), only what an entry
//! matches: a host name (`api.example.com`), subdomains (`*.example.com`), an address or a
//! CIDR (`10.1.2.3`, `10.0.0.0/8`, `fd00::/8`), each optionally with a port
//! (`api.example.com:8443`, `[fd00::1]:80`). IPv4 addresses embedded in IPv6 ones
//! (`::ffff:169.254.169.254`, `64:ff9b::a9fe:a9fe`) are checked as both.
//!
//! The client connects directly: proxy settings from the environment are ignored, since a
//! proxy would connect to an address the worker never checked.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use rein_core::http_url;
use url::{Host, Url};

/// The stable names of the rules a refusal names (with [`rein_core::http_url::rule`]).
pub mod rule {
    pub use rein_core::http_url::rule::*;
    /// A cloud metadata endpoint.
    pub const METADATA: &str = "metadata";
    /// A link-local address (169.254.0.0/16, fe80::/10).
    pub const LINK_LOCAL: &str = "link_local";
    /// 0.0.0.0/8 or `::`, which reach the local machine.
    pub const UNSPECIFIED: &str = "unspecified";
    /// The worker's database.
    pub const DATABASE: &str = "database";
    /// The worker's Redis.
    pub const REDIS: &str = "redis";
    /// Not matched by any entry of the allow list.
    pub const NOT_ALLOWED: &str = "not_allowed";
    /// The host name resolved to no address at all.
    pub const NO_ADDRESS: &str = "no_address";
}

/// Longest allow-list entry accepted.
pub const ALLOW_ENTRY_BYTES_MAX: usize = 256;
/// Most allow-list entries accepted.
pub const ALLOW_ENTRIES_MAX: usize = 1024;

/// A call the policy does not let out, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (egress rule `{rule}`)")]
pub struct Refused {
    /// One of [`rule`].
    pub rule: &'static str,
    pub reason: String,
}

impl Refused {
    fn new(rule: &'static str, reason: String) -> Refused {
        Refused { rule, reason }
    }
}

/// An address and prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Net {
    addr: IpAddr,
    prefix: u8,
}

impl Net {
    const fn v4(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> Net {
        Net {
            addr: IpAddr::V4(Ipv4Addr::new(a, b, c, d)),
            prefix,
        }
    }

    const fn v6(segments: [u16; 8], prefix: u8) -> Net {
        let [a, b, c, d, e, f, g, h] = segments;
        Net {
            addr: IpAddr::V6(Ipv6Addr::new(a, b, c, d, e, f, g, h)),
            prefix,
        }
    }

    fn host(addr: IpAddr) -> Net {
        let prefix = if addr.is_ipv4() { 32 } else { 128 };
        Net { addr, prefix }
    }

    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }

    /// Whether every address of `self` is in `outer`.
    fn within(&self, outer: &Net) -> bool {
        self.prefix >= outer.prefix && outer.contains(self.addr)
    }

    fn is_host(&self) -> bool {
        self.prefix == if self.addr.is_ipv4() { 32 } else { 128 }
    }
}

impl fmt::Display for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_host() {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{}/{}", self.addr, self.prefix)
        }
    }
}

/// Ranges refused unless an entry inside them is allowed; the first that holds an address
/// names the rule.
const REFUSED_RANGES: [(&str, Net, &str); 9] = [
    (
        rule::UNSPECIFIED,
        Net::v4(0, 0, 0, 0, 8),
        "an unspecified address",
    ),
    (
        rule::UNSPECIFIED,
        Net::v6([0; 8], 128),
        "the unspecified address",
    ),
    (
        rule::METADATA,
        Net::v4(169, 254, 169, 254, 32),
        "a cloud metadata endpoint",
    ),
    (
        rule::METADATA,
        Net::v4(169, 254, 170, 2, 32),
        "a container metadata endpoint",
    ),
    (
        rule::METADATA,
        Net::v6([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254], 128),
        "a cloud metadata endpoint",
    ),
    (
        rule::METADATA,
        Net::v4(100, 100, 100, 200, 32),
        "a cloud metadata endpoint",
    ),
    (
        rule::METADATA,
        Net::v4(192, 0, 0, 192, 32),
        "a cloud metadata endpoint",
    ),
    (
        rule::LINK_LOCAL,
        Net::v4(169, 254, 0, 0, 16),
        "a link-local address",
    ),
    (
        rule::LINK_LOCAL,
        Net::v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10),
        "a link-local address",
    ),
];

/// The forms of one address a rule may match: the address, and the IPv4 address an IPv6
/// one carries (mapped `::ffff:a.b.c.d`, NAT64 `64:ff9b::a.b.c.d`).
fn forms(ip: IpAddr) -> Vec<IpAddr> {
    let mut out = vec![ip];
    if let IpAddr::V6(v6) = ip {
        let nat64 = Net::v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96);
        if let Some(v4) = v6.to_ipv4_mapped() {
            out.push(IpAddr::V4(v4));
        } else if nat64.contains(ip) {
            let [.., a, b, c, d] = v6.octets();
            out.push(IpAddr::V4(Ipv4Addr::new(a, b, c, d)));
        }
    }
    out
}

/// A host name as rules compare it: lower case, without a final dot.
fn name_key(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    Name(String),
    Subdomains(String),
    Net(Net),
}

/// One entry of the allow list: a host name, `*.domain`, an address or a CIDR, optionally
/// with a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    pattern: Pattern,
    port: Option<u16>,
}

impl Allow {
    /// Parses `api.example.com`, `api.example.com:8443`, `*.example.com`, `10.1.2.3`,
    /// `10.1.2.3:80`, `[fd00::1]:80`, `fd00::1`, `10.0.0.0/8` or `fd00::/8`.
    pub fn parse(text: &str) -> Result<Allow, String> {
        let text = text.trim();
        let hint = "give a host name, *.domain, an IP address or a CIDR, each optionally with \
                    :PORT (e.g. api.example.com:443, 10.0.0.0/8)";
        if text.is_empty() {
            return Err(format!("an empty entry: {hint}"));
        }
        if text.len() > ALLOW_ENTRY_BYTES_MAX {
            return Err(format!(
                "an entry is at most {ALLOW_ENTRY_BYTES_MAX} bytes; {hint}"
            ));
        }
        let shown = rein_core::text::storable(text);
        if let Some((addr, prefix)) = text.split_once('/') {
            let addr: IpAddr = addr
                .parse()
                .map_err(|_| format!("`{shown}`: `{addr}` is not an IP address; {hint}"))?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let prefix = prefix
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("`{shown}`: the prefix length must be 0..={max}"))?;
            if addr != masked(addr, prefix) {
                return Err(format!(
                    "`{shown}` has bits set past its prefix; write {}/{prefix}",
                    masked(addr, prefix)
                ));
            }
            return Ok(Allow {
                pattern: Pattern::Net(Net { addr, prefix }),
                port: None,
            });
        }
        let (host, port) = split_port(text).map_err(|e| format!("`{shown}`: {e}"))?;
        let pattern = if let Some(domain) = host.strip_prefix("*.") {
            match Host::parse(domain) {
                Ok(Host::Domain(d)) => Pattern::Subdomains(name_key(&d)),
                _ => return Err(format!("`{shown}`: `*.` takes a domain name; {hint}")),
            }
        } else if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse() {
            Pattern::Net(Net::host(ip))
        } else {
            match Host::parse(host) {
                Ok(Host::Domain(d)) => Pattern::Name(name_key(&d)),
                Ok(Host::Ipv4(a)) => Pattern::Net(Net::host(IpAddr::V4(a))),
                Ok(Host::Ipv6(a)) => Pattern::Net(Net::host(IpAddr::V6(a))),
                Err(e) => return Err(format!("`{shown}`: {e}; {hint}")),
            }
        };
        Ok(Allow { pattern, port })
    }

    fn port_matches(&self, port: Option<u16>) -> bool {
        self.port.is_none() || self.port == port
    }

    /// Whether the entry lets a call to (`name`, `ip`, `port`) through the allow list.
    fn matches(&self, name: Option<&str>, ip: Option<IpAddr>, port: Option<u16>) -> bool {
        self.port_matches(port)
            && match (&self.pattern, name, ip) {
                (Pattern::Name(n), Some(name), _) => *n == name,
                (Pattern::Subdomains(d), Some(name), _) => {
                    name.len() > d.len() + 1
                        && name.ends_with(d.as_str())
                        && name.as_bytes()[name.len() - d.len() - 1] == b'.'
                }
                (Pattern::Net(net), _, Some(ip)) => forms(ip).into_iter().any(|f| net.contains(f)),
                _ => false,
            }
    }

    /// Whether the entry names the refused `range` exactly enough to open it: the very host
    /// name, or an address or CIDR inside the range.
    fn opens_range(&self, range: &Net, name: Option<&str>, ip: IpAddr, port: Option<u16>) -> bool {
        self.port_matches(port)
            && match &self.pattern {
                Pattern::Name(n) => name == Some(n.as_str()),
                Pattern::Subdomains(_) => false,
                Pattern::Net(net) => {
                    net.within(range) && forms(ip).into_iter().any(|f| net.contains(f))
                }
            }
    }

    /// Whether the entry opens a service of the worker's own at `port`: it must name the
    /// port, and the host name or the very address.
    fn opens_service(&self, name: Option<&str>, ip: Option<IpAddr>, port: Option<u16>) -> bool {
        self.port.is_some()
            && self.port == port
            && match (&self.pattern, name, ip) {
                (Pattern::Name(n), Some(name), _) => *n == name,
                (Pattern::Net(net), _, Some(ip)) => {
                    net.is_host() && forms(ip).into_iter().any(|f| net.contains(f))
                }
                _ => false,
            }
    }
}

impl fmt::Display for Allow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = match &self.pattern {
            Pattern::Name(n) => n.clone(),
            Pattern::Subdomains(d) => format!("*.{d}"),
            Pattern::Net(net) if self.port.is_some() && net.addr.is_ipv6() => {
                format!("[{net}]")
            }
            Pattern::Net(net) => net.to_string(),
        };
        match self.port {
            Some(port) => write!(f, "{host}:{port}"),
            None => write!(f, "{host}"),
        }
    }
}

fn masked(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask))
        }
        IpAddr::V6(a) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask))
        }
    }
}

/// `host[:port]`, `[v6][:port]` or a bare IPv6 address.
fn split_port(text: &str) -> Result<(&str, Option<u16>), String> {
    let port = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .map(Some)
            .ok_or_else(|| format!("`{p}` is not a port (1..=65535)"))
    };
    if let Some(rest) = text.strip_prefix('[') {
        let (v6, after) = rest
            .split_once(']')
            .ok_or("an IPv6 address opened with `[` needs its `]`")?;
        return match after {
            "" => Ok((&text[..v6.len() + 2], None)),
            _ => match after.strip_prefix(':') {
                Some(p) => Ok((&text[..v6.len() + 2], port(p)?)),
                None => Err(format!("unexpected `{after}` after the address")),
            },
        };
    }
    if text.parse::<Ipv6Addr>().is_ok() {
        return Ok((text, None));
    }
    match text.rsplit_once(':') {
        Some((host, p)) => Ok((host, port(p)?)),
        None => Ok((text, None)),
    }
}

/// A service of the worker's own that calls may not reach: its database, its Redis.
#[derive(Debug)]
struct Service {
    /// The rule that refuses it: [`rule::DATABASE`] or [`rule::REDIS`].
    rule: &'static str,
    /// Its host: a name (compared as [`name_key`]) or an address.
    host: Host<String>,
    port: u16,
    /// The addresses the name resolved to, looked up on first use.
    resolved: tokio::sync::OnceCell<Vec<IpAddr>>,
}

impl Service {
    async fn addresses(&self) -> Vec<IpAddr> {
        match &self.host {
            Host::Ipv4(a) => vec![IpAddr::V4(*a)],
            Host::Ipv6(a) => vec![IpAddr::V6(*a)],
            Host::Domain(name) => {
                let looked_up = self
                    .resolved
                    .get_or_try_init(|| async {
                        lookup(name).await.map_err(|e| {
                            tracing::warn!(service = self.rule, error = %e,
                                "cannot resolve the worker's own service; calls to it are \
                                 refused by name only until it resolves");
                        })
                    })
                    .await;
                looked_up.cloned().unwrap_or_default()
            }
        }
    }

    fn is_named(&self, name: &str) -> bool {
        matches!(&self.host, Host::Domain(n) if name_key(n) == name)
    }
}

async fn lookup(name: &str) -> std::io::Result<Vec<IpAddr>> {
    Ok(tokio::net::lookup_host((name, 0))
        .await?
        .map(|a| a.ip())
        .collect())
}

/// Who calls out under a policy, as its refusals name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// What makes the calls: `http nodes`.
    pub calls: &'static str,
    /// The process whose database and Redis are protected, and whose flag narrows or opens
    /// what calls reach: `worker`.
    pub role: &'static str,
    /// That flag: `--http-allow`.
    pub flag: &'static str,
}

impl Caller {
    /// A worker's http nodes and model actions (`rein worker --http-allow`).
    pub const WORKER: Caller = Caller {
        calls: "http nodes",
        role: "worker",
        flag: "--http-allow",
    };
    /// Webhook deliveries, posted by schedulers and checked when `rein webhooks add`
    /// registers one (`--webhook-allow` on both).
    pub const WEBHOOKS: Caller = Caller {
        calls: "webhooks",
        role: "scheduler",
        flag: "--webhook-allow",
    };
}

impl Default for Caller {
    fn default() -> Caller {
        Caller::WORKER
    }
}

/// What calls may reach; see the module documentation.
#[derive(Debug, Default)]
pub struct Policy {
    allow: Vec<Allow>,
    services: Vec<Service>,
    caller: Caller,
}

impl Policy {
    /// Everything but the refused ranges (and the services added with [`Policy::protect`]).
    pub fn new() -> Policy {
        Policy::default()
    }

    /// Only what an entry of `allow` matches (none: everything not refused).
    pub fn allowing(allow: Vec<Allow>) -> Result<Policy, String> {
        if allow.len() > ALLOW_ENTRIES_MAX {
            return Err(format!(
                "{} allow-list entries; at most {ALLOW_ENTRIES_MAX}",
                allow.len()
            ));
        }
        Ok(Policy {
            allow,
            services: Vec::new(),
            caller: Caller::WORKER,
        })
    }

    /// The same rules, with refusals naming `caller`'s calls, process and flag.
    pub fn for_caller(mut self, caller: Caller) -> Policy {
        self.caller = caller;
        self
    }

    /// Refuses calls to `host:port`, the worker's own database or Redis (`rule`), by name
    /// and by the addresses the name resolves to. A host that is no network address (a Unix
    /// socket's directory) is ignored.
    pub fn protect(mut self, rule: &'static str, host: &str, port: u16) -> Policy {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let host = match host.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) => Host::Ipv4(a),
            Ok(IpAddr::V6(a)) => Host::Ipv6(a),
            Err(_) => match Host::parse(host) {
                Ok(host) => host,
                Err(_) => return self,
            },
        };
        self.services.push(Service {
            rule,
            host,
            port,
            resolved: tokio::sync::OnceCell::new(),
        });
        self
    }

    /// [`Policy::protect`] for the host and port of a service's URL (`redis://HOST:PORT`),
    /// `default_port` when it names none; a URL without a host is ignored.
    pub fn protect_url(self, rule: &'static str, text: &str, default_port: u16) -> Policy {
        let Ok(url) = Url::parse(text) else {
            return self;
        };
        match url.host_str() {
            Some(host) if !host.is_empty() => {
                let port = url.port().unwrap_or(default_port);
                self.protect(rule, host, port)
            }
            _ => self,
        }
    }

    /// The allow list, as given (empty: not narrowed).
    pub fn allow_list(&self) -> &[Allow] {
        &self.allow
    }

    /// Parses `text` and checks what can be checked before resolving its host: the URL's
    /// shape, an address written in it, a host name against the allow list and the worker's
    /// own services. The host name's addresses are checked by [`Resolver`].
    pub async fn check_url(&self, text: &str) -> Result<Url, Refused> {
        let url = http_url::parse(text).map_err(|p| Refused::new(p.rule, p.reason))?;
        let port = url.port_or_known_default();
        let services = self.service_addresses().await;
        match url.host() {
            Some(Host::Ipv4(a)) => self.check_address(None, IpAddr::V4(a), port, &services)?,
            Some(Host::Ipv6(a)) => self.check_address(None, IpAddr::V6(a), port, &services)?,
            Some(Host::Domain(name)) => self.check_name(&name_key(name), port)?,
            None => {
                return Err(Refused::new(rule::NO_HOST, "the URL names no host".into()));
            }
        }
        Ok(url)
    }

    fn check_name(&self, name: &str, port: Option<u16>) -> Result<(), Refused> {
        for service in &self.services {
            if service.is_named(name)
                && Some(service.port) == port
                && !self
                    .allow
                    .iter()
                    .any(|a| a.opens_service(Some(name), None, port))
            {
                return Err(self.service_refusal(service, &format!("{name}:{}", service.port)));
            }
        }
        let by_address = self
            .allow
            .iter()
            .any(|a| matches!(a.pattern, Pattern::Net(_)));
        if !self.allow.is_empty()
            && !by_address
            && !self.allow.iter().any(|a| a.matches(Some(name), None, port))
        {
            return Err(self.not_allowed(&with_port(name, port)));
        }
        Ok(())
    }

    /// Checks one address a call would connect to, reached through host name `name` (or
    /// written in the URL), on `port` (`None`: any port).
    fn check_address(
        &self,
        name: Option<&str>,
        ip: IpAddr,
        port: Option<u16>,
        services: &[Vec<IpAddr>],
    ) -> Result<(), Refused> {
        let shown = match (name, port) {
            (Some(name), _) => format!("{} ({ip})", with_port(name, port)),
            (None, Some(port)) => std::net::SocketAddr::new(ip, port).to_string(),
            (None, None) => ip.to_string(),
        };
        for (refused_by, range, what) in &REFUSED_RANGES {
            if forms(ip).into_iter().any(|f| range.contains(f))
                && (*refused_by == rule::UNSPECIFIED
                    || !self
                        .allow
                        .iter()
                        .any(|a| a.opens_range(range, name, ip, port)))
            {
                let Caller { calls, role, flag } = self.caller;
                let open = if *refused_by == rule::UNSPECIFIED {
                    String::new()
                } else {
                    format!(
                        "; a {role} started with {flag} {} may call it",
                        Net::host(ip)
                    )
                };
                return Err(Refused::new(
                    refused_by,
                    format!("{shown} is {what} ({range}), which {calls} may not call{open}"),
                ));
            }
        }
        for (service, addresses) in self.services.iter().zip(services) {
            let same_port = port.is_none_or(|p| p == service.port);
            let same_host = forms(ip).into_iter().any(|f| {
                addresses
                    .iter()
                    .any(|a| *a == f || (a.is_loopback() && f.is_loopback()))
            });
            if same_port
                && same_host
                && !self
                    .allow
                    .iter()
                    .any(|a| a.opens_service(name, Some(ip), port))
            {
                return Err(self.service_refusal(service, &shown));
            }
        }
        if !self.allow.is_empty() && !self.allow.iter().any(|a| a.matches(name, Some(ip), port)) {
            return Err(self.not_allowed(&shown));
        }
        Ok(())
    }

    fn service_refusal(&self, service: &Service, shown: &str) -> Refused {
        let what = if service.rule == rule::DATABASE {
            "database"
        } else {
            "Redis"
        };
        let Caller { calls, role, flag } = self.caller;
        Refused::new(
            service.rule,
            format!(
                "{shown} is the {role}'s own {what}, which {calls} may not call; a {role} \
                 started with {flag} HOST:{} may",
                service.port
            ),
        )
    }

    fn not_allowed(&self, shown: &str) -> Refused {
        let list: Vec<String> = self.allow.iter().take(8).map(ToString::to_string).collect();
        Refused::new(
            rule::NOT_ALLOWED,
            format!(
                "{shown} is not in this {}'s {} list ({}{})",
                self.caller.role,
                self.caller.flag,
                list.join(", "),
                if self.allow.len() > list.len() {
                    ", ..."
                } else {
                    ""
                }
            ),
        )
    }

    async fn service_addresses(&self) -> Vec<Vec<IpAddr>> {
        let mut out = Vec::with_capacity(self.services.len());
        for service in &self.services {
            out.push(service.addresses().await);
        }
        out
    }

    /// The addresses of `found` that a call through host name `name` may connect to on
    /// `port`; refused when none is left.
    fn admit(
        &self,
        name: &str,
        found: &[IpAddr],
        port: u16,
        services: &[Vec<IpAddr>],
    ) -> Result<Vec<IpAddr>, Refused> {
        let mut admitted = Vec::new();
        let mut first_refusal = None;
        for ip in found {
            match self.check_address(Some(name), *ip, Some(port), services) {
                Ok(()) => admitted.push(*ip),
                Err(refused) => {
                    first_refusal.get_or_insert(refused);
                }
            }
        }
        match (admitted.is_empty(), first_refusal) {
            (false, _) => Ok(admitted),
            (true, Some(refused)) => Err(refused),
            (true, None) => Err(Refused::new(
                rule::NO_ADDRESS,
                format!("{name} resolves to no address"),
            )),
        }
    }

    /// The resolver for a client that connects only on `port` (the port of every URL it is
    /// given): it checks each address a name resolves to for that port and returns only
    /// those admitted. A resolver learns no port from the client, hence one per port.
    pub fn resolver(self: &Arc<Policy>, port: u16) -> Arc<Resolver> {
        Arc::new(Resolver {
            policy: self.clone(),
            port,
        })
    }
}

/// A client builder for calls on `port` that connect only where the policy lets them: never
/// through a proxy (a proxy would choose its own address), never following a redirect (a
/// POST is not re-sent somewhere else), to addresses [`Policy::resolver`] admitted.
pub fn client_builder(policy: &Arc<Policy>, port: u16) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .dns_resolver(policy.resolver(port))
        .user_agent(concat!("rein/", env!("CARGO_PKG_VERSION")))
}

fn with_port(host: &str, port: Option<u16>) -> String {
    match port {
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    }
}

/// Resolves host names for an HTTP client that connects on one port, and lets through only
/// the addresses the policy admits there ([`Policy::resolver`]).
pub struct Resolver {
    policy: Arc<Policy>,
    port: u16,
}

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        type BoxError = Box<dyn std::error::Error + Send + Sync>;
        let (policy, port) = (self.policy.clone(), self.port);
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let services = policy.service_addresses().await;
            let found = lookup(&host).await.map_err(BoxError::from)?;
            let admitted = policy
                .admit(&name_key(&host), &found, port, &services)
                .map_err(BoxError::from)?;
            let addrs: reqwest::dns::Addrs = Box::new(
                admitted
                    .into_iter()
                    .map(move |ip| std::net::SocketAddr::new(ip, port)),
            );
            Ok::<_, BoxError>(addrs)
        })
    }
}

/// The refusal somewhere in `error`'s chain of sources, if the policy stopped the call.
pub fn refusal_in<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a Refused> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(refused) = e.downcast_ref::<Refused>() {
            return Some(refused);
        }
        next = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow(entries: &[&str]) -> Policy {
        Policy::allowing(entries.iter().map(|e| Allow::parse(e).unwrap()).collect()).unwrap()
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[tokio::test]
    async fn metadata_link_local_and_unspecified_addresses_are_refused_in_any_spelling() {
        let policy = Policy::new();
        for (url, rule) in [
            ("http://169.254.169.254/latest/meta-data/", rule::METADATA),
            ("http://0xa9fea9fe/", rule::METADATA),
            ("http://2852039166/", rule::METADATA),
            ("http://[::ffff:169.254.169.254]/", rule::METADATA),
            ("http://[64:ff9b::a9fe:a9fe]/", rule::METADATA),
            ("http://[fd00:ec2::254]/", rule::METADATA),
            ("http://100.100.100.200/", rule::METADATA),
            ("http://169.254.170.2/v2/credentials", rule::METADATA),
            ("http://169.254.1.1/", rule::LINK_LOCAL),
            ("http://[fe80::1]/", rule::LINK_LOCAL),
            ("http://0.0.0.0:5432/", rule::UNSPECIFIED),
            ("http://0/", rule::UNSPECIFIED),
            ("http://[::]/", rule::UNSPECIFIED),
            ("http://u:p@example.com/", rule::USERINFO),
            ("http://", rule::NO_HOST),
        ] {
            let refused = policy.check_url(url).await.expect_err(url);
            assert_eq!(refused.rule, rule, "{url}: {refused}");
        }
        for url in [
            "http://127.0.0.1:8080/",
            "http://[::1]:8080/",
            "http://0x7f000001/",
            "http://localhost/",
            "https://example.com/",
            "http://10.1.2.3/",
        ] {
            assert!(policy.check_url(url).await.is_ok(), "{url}");
        }
    }

    #[tokio::test]
    async fn the_database_is_refused_by_name_by_address_and_on_any_loopback_address() {
        let policy = Policy::new().protect(rule::DATABASE, "localhost", 5432);
        for url in [
            "http://localhost:5432/",
            "http://LOCALHOST.:5432/",
            "http://127.0.0.1:5432/",
            "http://0x7f000001:5432/",
            "http://127.0.0.2:5432/",
            "http://[::1]:5432/",
        ] {
            let refused = policy.check_url(url).await.expect_err(url);
            assert_eq!(refused.rule, rule::DATABASE, "{url}: {refused}");
        }
        assert!(policy.check_url("http://127.0.0.1:8080/").await.is_ok());
        let remote = Policy::new().protect(rule::DATABASE, "10.0.0.5", 5432);
        let services = remote.service_addresses().await;
        assert!(remote.check_url("http://10.0.0.5:5432/").await.is_err());
        assert!(remote.check_url("http://10.0.0.5:8080/").await.is_ok());
        assert!(remote.check_url("http://127.0.0.1:5432/").await.is_ok());
        // A name that resolves to the database is refused for the database's port.
        let refused = remote
            .admit("evil.example", &[ip("10.0.0.5")], 5432, &services)
            .unwrap_err();
        assert_eq!(refused.rule, rule::DATABASE);
        assert!(
            remote
                .admit("evil.example", &[ip("10.0.0.5")], 80, &services)
                .is_ok()
        );
        let redis = Policy::new()
            .protect_url(rule::REDIS, "redis://:hunter2@10.0.0.6/0", 6379)
            .protect_url(rule::REDIS, "redis+unix:///run/redis.sock", 6379);
        assert_eq!(redis.services.len(), 1);
        let refused = redis.check_url("http://10.0.0.6:6379/").await.unwrap_err();
        assert_eq!(refused.rule, rule::REDIS);
        assert!(!refused.reason.contains("hunter2"));
        // A Unix socket is no address.
        assert!(
            Policy::new()
                .protect(rule::DATABASE, "/var/run/postgresql", 5432)
                .services
                .is_empty()
        );
    }

    #[tokio::test]
    async fn a_name_that_resolves_to_a_refused_address_is_refused_and_others_are_filtered() {
        let policy = Policy::new();
        let refused = policy
            .admit("rebind.example", &[ip("169.254.169.254")], 80, &[])
            .unwrap_err();
        assert_eq!(refused.rule, rule::METADATA);
        assert!(
            refused
                .reason
                .contains("rebind.example:80 (169.254.169.254)"),
            "{refused}"
        );
        assert_eq!(
            policy
                .admit(
                    "mixed.example",
                    &[ip("169.254.169.254"), ip("93.184.216.34")],
                    80,
                    &[]
                )
                .unwrap(),
            [ip("93.184.216.34")]
        );
        assert_eq!(
            policy
                .admit("empty.example", &[], 80, &[])
                .unwrap_err()
                .rule,
            rule::NO_ADDRESS
        );
    }

    #[tokio::test]
    async fn an_allow_list_narrows_what_calls_reach() {
        let policy = allow(&[
            "api.example.com",
            "*.partner.net:443",
            "10.0.0.0/8",
            "[fd00::1]:80",
        ]);
        for url in [
            "http://api.example.com/",
            "https://eu.partner.net/",
            "http://10.200.0.1:9000/",
            "http://[fd00::1]/",
        ] {
            assert!(policy.check_url(url).await.is_ok(), "{url}");
        }
        for url in [
            "http://127.0.0.1/",
            "http://[fd00::1]:81/",
            "http://11.0.0.1/",
        ] {
            let refused = policy.check_url(url).await.expect_err(url);
            assert_eq!(refused.rule, rule::NOT_ALLOWED, "{url}");
            assert!(
                refused
                    .reason
                    .contains("api.example.com, *.partner.net:443"),
                "{refused}"
            );
        }
        // Names are checked again once resolved: CIDR entries match their addresses.
        assert!(
            policy
                .admit("other.example", &[ip("10.1.1.1")], 80, &[])
                .is_ok()
        );
        assert!(
            policy
                .admit("other.example", &[ip("192.168.1.1")], 80, &[])
                .is_err()
        );
        assert!(
            policy
                .admit("partner.net", &[ip("192.168.1.1")], 443, &[])
                .is_err()
        );
        assert!(
            policy
                .admit("eu.partner.net", &[ip("192.168.1.1")], 80, &[])
                .is_err()
        );
        // Without CIDR entries a name is refused before it is resolved.
        let names = allow(&["api.example.com"]);
        assert_eq!(
            names
                .check_url("http://other.example/")
                .await
                .unwrap_err()
                .rule,
            rule::NOT_ALLOWED
        );
    }

    #[tokio::test]
    async fn only_an_exact_entry_opens_a_refused_range_or_service() {
        let broad = allow(&["0.0.0.0/0", "::/0"]);
        assert_eq!(
            broad
                .check_url("http://169.254.169.254/")
                .await
                .unwrap_err()
                .rule,
            rule::METADATA
        );
        let exact = allow(&["169.254.169.254"]);
        assert!(exact.check_url("http://169.254.169.254/").await.is_ok());
        // A CIDR opens the refused ranges it lies inside: link-local, not the metadata
        // endpoint within it.
        let range = allow(&["169.254.0.0/16"]);
        assert!(range.check_url("http://169.254.1.1/").await.is_ok());
        assert_eq!(
            range
                .check_url("http://169.254.169.254/")
                .await
                .unwrap_err()
                .rule,
            rule::METADATA
        );
        let by_name = allow(&["metadata.google.internal"]);
        assert!(
            by_name
                .admit(
                    "metadata.google.internal",
                    &[ip("169.254.169.254")],
                    80,
                    &[]
                )
                .is_ok()
        );
        let wildcard = allow(&["*.google.internal"]);
        assert!(
            wildcard
                .admit(
                    "metadata.google.internal",
                    &[ip("169.254.169.254")],
                    80,
                    &[]
                )
                .is_err()
        );

        let db = |entries: &[&str]| {
            Policy::allowing(entries.iter().map(|e| Allow::parse(e).unwrap()).collect())
                .unwrap()
                .protect(rule::DATABASE, "127.0.0.1", 5432)
        };
        assert!(
            db(&["127.0.0.1"])
                .check_url("http://127.0.0.1:5432/")
                .await
                .is_err()
        );
        assert!(
            db(&["127.0.0.0/8"])
                .check_url("http://127.0.0.1:5432/")
                .await
                .is_err()
        );
        assert!(
            db(&["127.0.0.1:5432"])
                .check_url("http://127.0.0.1:5432/")
                .await
                .is_ok()
        );
        assert!(
            db(&["localhost:5432"])
                .check_url("http://localhost:5432/")
                .await
                .is_ok()
        );
        assert_eq!(
            db(&[])
                .check_url("http://0.0.0.0:5432/")
                .await
                .unwrap_err()
                .rule,
            rule::UNSPECIFIED,
            "never opened"
        );
    }

    #[test]
    fn allow_entries_parse_or_say_what_to_write() {
        for (text, shown) in [
            ("API.Example.com", "api.example.com"),
            ("api.example.com:8443", "api.example.com:8443"),
            ("*.Example.com", "*.example.com"),
            ("10.1.2.3", "10.1.2.3"),
            ("0x0a010203:80", "10.1.2.3:80"),
            ("10.0.0.0/8", "10.0.0.0/8"),
            ("fd00::1", "fd00::1"),
            ("[fd00::1]:80", "[fd00::1]:80"),
            ("fd00::/8", "fd00::/8"),
            (" localhost ", "localhost"),
        ] {
            let entry = Allow::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(entry.to_string(), shown, "{text}");
        }
        for (text, says) in [
            ("", "empty entry"),
            ("10.0.0.1/8", "write 10.0.0.0/8"),
            ("10.0.0.0/33", "0..=32"),
            ("example.com/8", "not an IP address"),
            ("example.com:0", "not a port"),
            ("example.com:http", "not a port"),
            ("[fd00::1", "needs its `]`"),
            ("*.10.0.0.1", "`*.` takes a domain name"),
            ("exa mple.com", "host name"),
        ] {
            let err = Allow::parse(text).expect_err(text);
            assert!(err.contains(says), "{text}: {err}");
        }
        assert!(Allow::parse(&"a".repeat(ALLOW_ENTRY_BYTES_MAX + 1)).is_err());
    }
}
