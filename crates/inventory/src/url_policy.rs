//! Repository URL policy: which URLs may be fetched at all, checked before anything touches them.
//!
//! Two entry points: [`check_url`] is synchronous and purely syntactic (for the HTTP API to
//! answer with a precise message); [`vet_url`] (or [`RepoUrl::vet`]) also resolves the host and
//! refuses internal addresses (for the worker, right before fetching). The resolved addresses
//! are kept in [`VettedUrl`] so the fetch can pin them and a second DNS answer cannot differ
//! (DNS rebinding).
//!
//! Accepted: `https://host[:port]/path` with a public host and a port of
//! [`UrlPolicy::allowed_ports`] (443 alone by default); `file:///absolute/path` only when
//! [`UrlPolicy::allow_file_urls`] is set. Refused: every other scheme (`http`, `ssh`, `git`,
//! `ext`, …), scp-style `user@host:path`, any user info (`user@`, `user:pass@`), query strings
//! and fragments, whitespace, control and non-ASCII characters, backslashes, over-long URLs,
//! non-canonical numeric hosts (`2130706433`, `0x7f.1`), internal names (`localhost`, `*.local`,
//! `*.internal`, single-label names) and hosts that are, or resolve to, loopback, private,
//! link-local, shared (CGNAT), unspecified, multicast, broadcast, reserved, documentation or
//! IPv6 unique-local addresses — unless [`UrlPolicy::allow_private_hosts`] is set.
//!
//! Error messages never contain credentials: a URL with user info is refused without echoing
//! any part of it, and [`redact`] scrubs user info from any text (such as git's stderr).
//!
//! Normalisation ([`RepoUrl::as_str`], what git fetches and what `analyses.repository` stores):
//! lower-case scheme and host, no default port (`:443`), runs of `/` in the path collapsed to
//! one, no trailing `/`; the rest of the path is kept verbatim (its case matters on many hosts,
//! and so does `.git`). git asks for `<url>/info/refs` with or without a trailing `/`, and an
//! empty path segment names no repository on any git host (nginx and web frameworks merge
//! them), so what is dropped never changes which repository is fetched.
//!
//! The cache key ([`RepoUrl::cache_key`], SPEC §5 "same repository") also drops one trailing
//! `.git`, so `https://github.com/o/r`, `…/o/r.git`, `…/o/r/` and `https://github.com:443/o/r`
//! are one repository. The `.git` stays in the URL git fetches: GitLab and GitBucket serve
//! `o/r` only through a redirect to `o/r.git`, and fetches never follow redirects, while hosts
//! such as Azure DevOps have no `.git` form at all — so no single spelling clones everywhere,
//! and the user's is kept. A look-up over stored URLs matches both spellings of the key
//! ([`RepoUrl::cache_spellings`]).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

/// What the policy allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlPolicy {
    /// Accept `file://` URLs (tests and local development; the analyzer maps
    /// `ANALYZER_ALLOW_FILE_URLS=true` to this).
    pub allow_file_urls: bool,
    /// Accept hosts that are, or resolve to, internal addresses (never in production).
    pub allow_private_hosts: bool,
    /// Longest URL accepted, in bytes.
    pub max_url_len: usize,
    /// How long a DNS resolution may take.
    pub dns_timeout: Duration,
    /// The ports an https URL may name (sorted, no duplicates; [`parse_ports`] makes such a
    /// list). Only 443 by default: git's answer for another port of a public host (refused,
    /// timed out, not TLS) would tell a caller which of its ports are open, making this service a
    /// port scanner. A git server on another port is opted into by its port.
    pub allowed_ports: Vec<u16>,
}

/// The port of an `https://` URL that names none.
pub const HTTPS_DEFAULT_PORT: u16 = 443;

/// A list of ports (`443, 8443`: separated by commas, spaces or both), sorted and without
/// duplicates; an empty list, a port of 0 or anything that is not a port is an error naming it.
/// Each entry is a port as a URL may write one ([`parse_port`]).
pub fn parse_ports(text: &str) -> Result<Vec<u16>, String> {
    let mut ports = Vec::new();
    for entry in text.split([',', ' ', '\t']).filter(|e| !e.is_empty()) {
        let port = parse_port(entry).map_err(|_| {
            format!(
                "`{}` is not a port (a number from 1 to 65535)",
                entry.escape_debug()
            )
        })?;
        ports.push(port);
    }
    if ports.is_empty() {
        return Err("no port is given (443 is the https default)".to_owned());
    }
    ports.sort_unstable();
    ports.dedup();
    Ok(ports)
}

impl Default for UrlPolicy {
    /// Production defaults: https only, port 443 only, public hosts only, 2048 bytes, 5 s DNS
    /// timeout.
    fn default() -> Self {
        UrlPolicy {
            allow_file_urls: false,
            allow_private_hosts: false,
            max_url_len: 2048,
            dns_timeout: Duration::from_secs(5),
            allowed_ports: vec![HTTPS_DEFAULT_PORT],
        }
    }
}

impl UrlPolicy {
    /// The policy the `ANALYZER_ALLOW_FILE_URLS`, `ANALYZER_ALLOW_PRIVATE_HOSTS` and
    /// `ANALYZER_ALLOWED_PORTS` settings describe: `web`, which accepts a URL, and the analyzer,
    /// which fetches it, both read all three. An error names the variable.
    pub fn from_settings(
        allow_file_urls: bool,
        allow_private_hosts: bool,
        allowed_ports: &str,
    ) -> Result<UrlPolicy, String> {
        Ok(UrlPolicy {
            allow_file_urls,
            allow_private_hosts,
            allowed_ports: parse_ports(allowed_ports)
                .map_err(|e| format!("ANALYZER_ALLOWED_PORTS: {e}"))?,
            ..UrlPolicy::default()
        })
    }

    /// The default policy with `file://` URLs allowed or not.
    pub fn with_file_urls(allow: bool) -> UrlPolicy {
        UrlPolicy {
            allow_file_urls: allow,
            ..UrlPolicy::default()
        }
    }
}

/// A URL scheme the policy can accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// `https://`.
    Https,
    /// `file://` (only when allowed).
    File,
}

/// The host of an https URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// A DNS name (lower-cased).
    Domain(String),
    /// An IPv4 or IPv6 literal.
    Ip(IpAddr),
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Domain(name) => f.write_str(name),
            Host::Ip(IpAddr::V4(v4)) => write!(f, "{v4}"),
            Host::Ip(IpAddr::V6(v6)) => write!(f, "[{v6}]"),
        }
    }
}

/// A syntactically valid repository URL, normalised (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoUrl {
    scheme: Scheme,
    host: Option<Host>,
    /// An explicit port other than the scheme's default.
    port: Option<u16>,
    path: String,
    normalized: String,
    cache_key: String,
}

impl RepoUrl {
    /// The normalised URL (what is handed to git, what `analyses.repository` stores, and safe to
    /// log: it never has credentials): lower-case scheme and host, no `:443`, no repeated or
    /// trailing `/`, and otherwise the path as given, `.git` included.
    pub fn as_str(&self) -> &str {
        &self.normalized
    }

    /// The repository's identity for the analysis cache: [`RepoUrl::as_str`] without one
    /// trailing `.git` (https only, and only after a non-empty name: `https://host/o/.git`
    /// keeps it). Not a URL to fetch: some hosts serve the repository only under `.git`.
    /// `file://` URLs (tests and local development) are their own key, since two local folders
    /// `r` and `r.git` are two repositories.
    pub fn cache_key(&self) -> &str {
        &self.cache_key
    }

    /// The two normalised URLs ([`RepoUrl::as_str`]) with this URL's cache key: the key itself
    /// and the key with `.git` appended (for `file://`, the URL twice). A cache look-up over
    /// stored normalised URLs matches either; this URL is one of them.
    pub fn cache_spellings(&self) -> [String; 2] {
        match self.scheme {
            Scheme::Https => [self.cache_key.clone(), format!("{}.git", self.cache_key)],
            Scheme::File => [self.normalized.clone(), self.normalized.clone()],
        }
    }

    /// The scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The host (`None` for `file://`).
    pub fn host(&self) -> Option<&Host> {
        self.host.as_ref()
    }

    /// The port, explicit or the scheme's default (443); `None` for `file://`.
    pub fn port(&self) -> Option<u16> {
        match self.scheme {
            Scheme::Https => Some(self.port.unwrap_or(HTTPS_DEFAULT_PORT)),
            Scheme::File => None,
        }
    }

    /// The path, normalised for https (for `file://`, the local filesystem path as given).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Resolves the host and checks every address against the policy.
    pub async fn vet(self, policy: &UrlPolicy) -> Result<VettedUrl, UrlError> {
        let addresses = match (&self.host, self.port()) {
            (Some(Host::Ip(ip)), _) => {
                check_address(&self.host_text(), *ip, policy)?;
                vec![*ip]
            }
            (Some(Host::Domain(name)), Some(port)) => resolve_public(name, port, policy).await?,
            _ => Vec::new(),
        };
        Ok(VettedUrl {
            url: self,
            addresses,
        })
    }

    fn host_text(&self) -> String {
        self.host.as_ref().map(Host::to_string).unwrap_or_default()
    }
}

impl fmt::Display for RepoUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.normalized)
    }
}

/// A URL that passed the policy including DNS, with the addresses it resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VettedUrl {
    url: RepoUrl,
    addresses: Vec<IpAddr>,
}

impl VettedUrl {
    /// The checked URL.
    pub fn url(&self) -> &RepoUrl {
        &self.url
    }

    /// The addresses the host resolved to (empty for `file://`).
    pub fn addresses(&self) -> &[IpAddr] {
        &self.addresses
    }

    /// A `host:port:addr[,addr]` pin for curl (git's `http.curloptResolve`), so git connects to
    /// exactly the vetted addresses; `None` for IP literals and `file://`.
    pub fn curl_resolve_pin(&self) -> Option<String> {
        let (Some(Host::Domain(name)), Some(port)) = (&self.url.host, self.url.port()) else {
            return None;
        };
        if self.addresses.is_empty() {
            return None;
        }
        let addrs: Vec<String> = self
            .addresses
            .iter()
            .map(|a| match a {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            })
            .collect();
        Some(format!("{name}:{port}:{}", addrs.join(",")))
    }
}

/// The kind of non-public address a host is or resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressClass {
    /// 127.0.0.0/8, ::1.
    Loopback,
    /// 10/8, 172.16/12, 192.168/16, fec0::/10, 64:ff9b:1::/48.
    Private,
    /// 169.254/16, fe80::/10.
    LinkLocal,
    /// 100.64/10 (carrier-grade NAT).
    SharedCgnat,
    /// 0.0.0.0/8, ::.
    Unspecified,
    /// 224/4, ff00::/8.
    Multicast,
    /// 255.255.255.255.
    Broadcast,
    /// fc00::/7.
    UniqueLocal,
    /// 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32.
    Documentation,
    /// 240/4, 192.0.0/24, 198.18/15, 100::/64, Teredo 2001::/32, other IPv4-compatible forms.
    Reserved,
}

impl fmt::Display for AddressClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddressClass::Loopback => "loopback",
            AddressClass::Private => "private-network",
            AddressClass::LinkLocal => "link-local",
            AddressClass::SharedCgnat => "shared (carrier-grade NAT)",
            AddressClass::Unspecified => "unspecified",
            AddressClass::Multicast => "multicast",
            AddressClass::Broadcast => "broadcast",
            AddressClass::UniqueLocal => "IPv6 unique-local",
            AddressClass::Documentation => "documentation-range",
            AddressClass::Reserved => "reserved",
        })
    }
}

/// Classifies an address; `None` means public (allowed).
pub fn classify_ip(ip: IpAddr) -> Option<AddressClass> {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<AddressClass> {
    let [a, b, c, _] = ip.octets();
    let class = match (a, b, c) {
        (0, _, _) => AddressClass::Unspecified,
        (10, _, _) => AddressClass::Private,
        (100, 64..=127, _) => AddressClass::SharedCgnat,
        (127, _, _) => AddressClass::Loopback,
        (169, 254, _) => AddressClass::LinkLocal,
        (172, 16..=31, _) => AddressClass::Private,
        (192, 168, _) => AddressClass::Private,
        (192, 0, 0) => AddressClass::Reserved,
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => AddressClass::Documentation,
        (198, 18..=19, _) => AddressClass::Reserved,
        (224..=239, _, _) => AddressClass::Multicast,
        (255, 255, 255) if ip == Ipv4Addr::BROADCAST => AddressClass::Broadcast,
        (240..=255, _, _) => AddressClass::Reserved,
        _ => return None,
    };
    Some(class)
}

fn classify_v6(ip: Ipv6Addr) -> Option<AddressClass> {
    if ip.is_unspecified() {
        return Some(AddressClass::Unspecified);
    }
    if ip.is_loopback() {
        return Some(AddressClass::Loopback);
    }
    if let Some(v4) = ip.to_ipv4_mapped() {
        return classify_v4(v4);
    }
    let s = ip.segments();
    let embedded_low =
        || Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    match s[0] {
        // ::/96 (IPv4-compatible, deprecated) and other ::/8 forms.
        0 => Some(AddressClass::Reserved),
        0x0064 if s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] => classify_v4(embedded_low()),
        0x0064 if s[1] == 0xff9b && s[2] == 1 => Some(AddressClass::Private),
        0x0100 if s[1..4] == [0, 0, 0] => Some(AddressClass::Reserved),
        0x2001 if s[1] == 0 => Some(AddressClass::Reserved),
        0x2001 if s[1] == 0x0db8 => Some(AddressClass::Documentation),
        0x2002 => classify_v4(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        )),
        x if x & 0xfe00 == 0xfc00 => Some(AddressClass::UniqueLocal),
        x if x & 0xffc0 == 0xfe80 => Some(AddressClass::LinkLocal),
        x if x & 0xffc0 == 0xfec0 => Some(AddressClass::Private),
        x if x & 0xff00 == 0xff00 => Some(AddressClass::Multicast),
        _ => None,
    }
}

/// Why a URL was refused. Messages say exactly what is wrong and never contain credentials.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Nothing was given.
    #[error("the repository URL is empty")]
    Empty,
    /// Longer than [`UrlPolicy::max_url_len`].
    #[error("the repository URL is {len} bytes long; at most {max} are allowed")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Whitespace, control, non-ASCII characters or backslashes.
    #[error("the repository URL contains {what}")]
    InvalidCharacters {
        /// What was found.
        what: &'static str,
    },
    /// `user@host:path` or `host:path`.
    #[error("scp-style addresses like `user@host:path` are not allowed; use an https:// URL")]
    ScpStyle,
    /// No `scheme://`.
    #[error("the repository URL has no scheme; expected https://host/owner/repository")]
    NotAUrl,
    /// A malformed scheme.
    #[error("the repository URL's scheme is malformed; expected https://host/owner/repository")]
    MalformedScheme,
    /// A well-formed scheme other than https (or file when allowed).
    #[error("the `{scheme}` scheme is not allowed; only https:// repository URLs are accepted")]
    SchemeNotAllowed {
        /// The scheme, lower-cased.
        scheme: String,
    },
    /// `file://` while the policy refuses it.
    #[error("file:// repository URLs are not allowed on this service; use an https:// URL")]
    FileUrlsNotAllowed,
    /// User info before `@` in the authority.
    #[error(
        "the repository URL contains credentials (a user name or password before `@`); \
         credentials are never accepted, so remove them (only public repositories can be analysed)"
    )]
    Credentials,
    /// `?` or `#`.
    #[error("query strings and fragments (`?`, `#`) are not allowed in repository URLs")]
    QueryOrFragment,
    /// `https:///path`.
    #[error("the repository URL has no host")]
    MissingHost,
    /// A host that is not a valid DNS name or IP literal.
    #[error("the repository URL's host is invalid: {reason}")]
    InvalidHost {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A bad port.
    #[error("the repository URL's port is invalid: {reason}")]
    InvalidPort {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A port the policy does not fetch from ([`UrlPolicy::allowed_ports`]).
    #[error("port {port} is not allowed; repositories are fetched from {allowed} only")]
    PortNotAllowed {
        /// The port named.
        port: u16,
        /// The ports allowed, as a phrase (`port 443`, `ports 443 and 8443`).
        allowed: String,
    },
    /// A bad path.
    #[error("the repository URL's path is invalid: {reason}")]
    InvalidPath {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `localhost`, `*.local`, a single-label name…
    #[error("host `{host}` is an internal name ({why}); only public hosts are allowed")]
    InternalHostName {
        /// The host.
        host: String,
        /// Why it counts as internal.
        why: &'static str,
    },
    /// The host is a non-public address, written as such.
    #[error("host `{host}` is {address}, a {class} address; only public addresses are allowed")]
    ForbiddenAddress {
        /// The host as written.
        host: String,
        /// The offending address.
        address: IpAddr,
        /// Its class.
        class: AddressClass,
    },
    /// The host is a name that resolves to a non-public address. The message names neither the
    /// address nor its class: a caller must not learn what an internal name resolves to (the
    /// address is logged on the server).
    #[error(
        "host `{host}` resolves to an address that is not public; only public hosts are allowed"
    )]
    ResolvesToForbiddenAddress {
        /// The host as written.
        host: String,
        /// The offending address.
        address: IpAddr,
        /// Its class.
        class: AddressClass,
    },
    /// The DNS answered that the name does not exist, or has no address (glibc's `EAI_NONAME`,
    /// `EAI_NODATA`): unlike a failure to reach the resolver, this is its answer.
    #[error("host `{host}` does not exist (the DNS knows no such name)")]
    UnknownHost {
        /// The host.
        host: String,
    },
    /// DNS failed.
    #[error("could not resolve host `{host}`: {reason}")]
    Resolution {
        /// The host.
        host: String,
        /// The resolver's error.
        reason: String,
    },
    /// DNS took too long.
    #[error("resolving host `{host}` took longer than {timeout:?}")]
    ResolutionTimedOut {
        /// The host.
        host: String,
        /// The limit.
        timeout: Duration,
    },
    /// DNS returned nothing.
    #[error("host `{host}` resolved to no addresses")]
    NoAddresses {
        /// The host.
        host: String,
    },
}

/// Checks a URL syntactically (no I/O). See the module documentation for the rules.
pub fn check_url(url: &str, policy: &UrlPolicy) -> Result<RepoUrl, UrlError> {
    if url.is_empty() {
        return Err(UrlError::Empty);
    }
    if url.len() > policy.max_url_len {
        return Err(UrlError::TooLong {
            len: url.len(),
            max: policy.max_url_len,
        });
    }
    if let Some(what) = bad_characters(url) {
        return Err(UrlError::InvalidCharacters { what });
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        let before_slash = url.split('/').next().unwrap_or(url);
        return Err(
            if before_slash.contains(':') || before_slash.contains('@') {
                UrlError::ScpStyle
            } else {
                UrlError::NotAUrl
            },
        );
    };
    let scheme_ok = scheme.len() <= 32
        && scheme
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !scheme_ok {
        return Err(UrlError::MalformedScheme);
    }
    let scheme = scheme.to_ascii_lowercase();
    let (authority, path) = match rest.find('/') {
        Some(slash) => rest.split_at(slash),
        None => (rest, ""),
    };
    if authority.contains('@') {
        return Err(UrlError::Credentials);
    }
    match scheme.as_str() {
        "https" => {}
        "file" if policy.allow_file_urls => {}
        "file" => return Err(UrlError::FileUrlsNotAllowed),
        _ => return Err(UrlError::SchemeNotAllowed { scheme }),
    }
    if rest.contains('?') || rest.contains('#') {
        return Err(UrlError::QueryOrFragment);
    }
    if scheme == "file" {
        return check_file_url(authority, path);
    }
    let (host, port) = parse_authority(authority)?;
    check_port(port.unwrap_or(HTTPS_DEFAULT_PORT), policy)?;
    check_host(&host, policy)?;
    check_https_path(path)?;
    let port = port.filter(|&p| p != HTTPS_DEFAULT_PORT);
    let port_text = port.map(|p| format!(":{p}")).unwrap_or_default();
    let path = normalize_https_path(path);
    Ok(RepoUrl {
        scheme: Scheme::Https,
        normalized: format!("https://{host}{port_text}{path}"),
        cache_key: format!("https://{host}{port_text}{}", without_git_suffix(&path)),
        host: Some(host),
        port,
        path,
    })
}

/// Refuses a port outside [`UrlPolicy::allowed_ports`].
fn check_port(port: u16, policy: &UrlPolicy) -> Result<(), UrlError> {
    if policy.allowed_ports.contains(&port) {
        return Ok(());
    }
    let names: Vec<String> = policy.allowed_ports.iter().map(u16::to_string).collect();
    let allowed = match names.as_slice() {
        [] => "no port".to_owned(),
        [one] => format!("port {one}"),
        [first @ .., last] => format!("ports {} and {last}", first.join(", ")),
    };
    Err(UrlError::PortNotAllowed { port, allowed })
}

/// `path` (checked: it has a character other than `/`) with every run of `/` collapsed to one
/// and no trailing `/` (see the module documentation for why this fetches the same repository).
fn normalize_https_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if !(c == '/' && out.ends_with('/')) {
            out.push(c);
        }
    }
    let kept = out.trim_end_matches('/').len();
    out.truncate(kept);
    out
}

/// A normalised path without one trailing `.git`, unless nothing would be left of its last
/// segment (`/o/.git`).
fn without_git_suffix(path: &str) -> &str {
    match path.strip_suffix(".git") {
        Some(stem) if stem.rsplit('/').next().is_some_and(|name| !name.is_empty()) => stem,
        _ => path,
    }
}

/// Checks a URL syntactically, then resolves its host and checks the addresses.
pub async fn vet_url(url: &str, policy: &UrlPolicy) -> Result<VettedUrl, UrlError> {
    check_url(url, policy)?.vet(policy).await
}

fn bad_characters(url: &str) -> Option<&'static str> {
    if url.chars().any(char::is_whitespace) {
        Some("whitespace")
    } else if url.chars().any(char::is_control) {
        Some("control characters")
    } else if !url.is_ascii() {
        Some("non-ASCII characters (percent-encode them)")
    } else if url.contains('\\') {
        Some("backslashes")
    } else {
        None
    }
}

fn check_file_url(authority: &str, path: &str) -> Result<RepoUrl, UrlError> {
    if !authority.is_empty() && !authority.eq_ignore_ascii_case("localhost") {
        return Err(UrlError::InvalidHost {
            reason: "a file:// URL must have an empty host (file:///absolute/path)",
        });
    }
    if path.trim_matches('/').is_empty() {
        return Err(UrlError::InvalidPath {
            reason: "a file:// URL needs an absolute repository path",
        });
    }
    if path.contains('%') {
        return Err(UrlError::InvalidPath {
            reason: "percent-encoded file paths are not supported",
        });
    }
    if !path
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-._~/+@=,:".contains(c))
    {
        return Err(UrlError::InvalidPath {
            reason: "a file:// path may only contain letters, digits and -._~/+@=,:",
        });
    }
    Ok(RepoUrl {
        scheme: Scheme::File,
        host: None,
        port: None,
        path: path.to_string(),
        normalized: format!("file://{path}"),
        cache_key: format!("file://{path}"),
    })
}

fn parse_authority(authority: &str) -> Result<(Host, Option<u16>), UrlError> {
    if authority.is_empty() {
        return Err(UrlError::MissingHost);
    }
    let (host_text, port_text) = if let Some(inner) = authority.strip_prefix('[') {
        let Some((v6, after)) = inner.split_once(']') else {
            return Err(UrlError::InvalidHost {
                reason: "unclosed `[` in an IPv6 literal",
            });
        };
        if v6.contains('%') {
            return Err(UrlError::InvalidHost {
                reason: "IPv6 zone identifiers are not allowed",
            });
        }
        let ip: Ipv6Addr = v6.parse().map_err(|_| UrlError::InvalidHost {
            reason: "not a valid IPv6 address",
        })?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or(UrlError::InvalidHost {
                reason: "unexpected characters after the IPv6 literal",
            })?),
        };
        return Ok((Host::Ip(IpAddr::V6(ip)), port.map(parse_port).transpose()?));
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = port_text.map(parse_port).transpose()?;
    Ok((parse_host(host_text)?, port))
}

fn parse_port(text: &str) -> Result<u16, UrlError> {
    if text.is_empty() {
        return Err(UrlError::InvalidPort {
            reason: "empty port",
        });
    }
    if !text.chars().all(|c| c.is_ascii_digit()) || text.len() > 5 {
        return Err(UrlError::InvalidPort {
            reason: "a port must be a number from 1 to 65535",
        });
    }
    match text.parse::<u16>() {
        Ok(0) | Err(_) => Err(UrlError::InvalidPort {
            reason: "a port must be a number from 1 to 65535",
        }),
        Ok(port) => Ok(port),
    }
}

fn parse_host(text: &str) -> Result<Host, UrlError> {
    if text.is_empty() {
        return Err(UrlError::MissingHost);
    }
    let lower = text.to_ascii_lowercase();
    if let Ok(v4) = lower.parse::<Ipv4Addr>() {
        return Ok(Host::Ip(IpAddr::V4(v4)));
    }
    if lower.ends_with('.') {
        return Err(UrlError::InvalidHost {
            reason: "a host name must not end with a dot",
        });
    }
    let labels: Vec<&str> = lower.split('.').collect();
    let last = labels.last().copied().unwrap_or_default();
    let numeric_looking = labels.iter().any(|l| {
        l.starts_with("0x") && l.len() > 2 && l[2..].chars().all(|c| c.is_ascii_hexdigit())
    }) || (!last.is_empty() && last.chars().all(|c| c.is_ascii_digit()));
    if numeric_looking {
        return Err(UrlError::InvalidHost {
            reason: "a numeric host must be a canonical dotted-decimal IPv4 address",
        });
    }
    if lower.len() > 253 {
        return Err(UrlError::InvalidHost {
            reason: "a host name may be at most 253 characters long",
        });
    }
    for label in &labels {
        if label.is_empty() {
            return Err(UrlError::InvalidHost {
                reason: "a host name has an empty label (`..`)",
            });
        }
        if label.len() > 63 {
            return Err(UrlError::InvalidHost {
                reason: "a host name label may be at most 63 characters long",
            });
        }
        if !label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(UrlError::InvalidHost {
                reason: "a host name may only contain letters, digits, `-` and `.`",
            });
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(UrlError::InvalidHost {
                reason: "a host name label may not start or end with `-`",
            });
        }
    }
    Ok(Host::Domain(lower))
}

/// Internal-name suffixes refused without DNS.
const INTERNAL_SUFFIXES: [(&str, &str); 5] = [
    ("localhost", "loopback name"),
    ("local", "multicast DNS name"),
    ("internal", "private-use name"),
    ("localdomain", "local-domain name"),
    ("home.arpa", "home-network name"),
];

fn check_host(host: &Host, policy: &UrlPolicy) -> Result<(), UrlError> {
    if policy.allow_private_hosts {
        return Ok(());
    }
    match host {
        Host::Ip(ip) => check_address(&host.to_string(), *ip, policy),
        Host::Domain(name) => {
            for (suffix, why) in INTERNAL_SUFFIXES {
                if name == suffix || name.ends_with(&format!(".{suffix}")) {
                    return Err(UrlError::InternalHostName {
                        host: name.clone(),
                        why,
                    });
                }
            }
            if !name.contains('.') {
                return Err(UrlError::InternalHostName {
                    host: name.clone(),
                    why: "single-label name, resolved through local search domains",
                });
            }
            Ok(())
        }
    }
}

/// A literal address (`https://10.0.0.1/…`) the policy refuses, named with its class: the caller
/// wrote it, so telling the class tells nothing new.
fn check_address(host: &str, address: IpAddr, policy: &UrlPolicy) -> Result<(), UrlError> {
    match forbidden_class(address, policy) {
        None => Ok(()),
        Some(class) => Err(UrlError::ForbiddenAddress {
            host: host.to_string(),
            address,
            class,
        }),
    }
}

/// The class of `address` when the policy refuses it.
fn forbidden_class(address: IpAddr, policy: &UrlPolicy) -> Option<AddressClass> {
    if policy.allow_private_hosts {
        None
    } else {
        classify_ip(address)
    }
}

fn check_https_path(path: &str) -> Result<(), UrlError> {
    if path.trim_matches('/').is_empty() {
        return Err(UrlError::InvalidPath {
            reason: "the URL has no repository path (expected https://host/owner/repository)",
        });
    }
    let bytes = path.as_bytes();
    let mut k = 0;
    while k < bytes.len() {
        let c = bytes[k];
        if c == b'%' {
            let hex = bytes.get(k + 1..k + 3);
            match hex {
                Some([h1, h2]) if h1.is_ascii_hexdigit() && h2.is_ascii_hexdigit() => {
                    if *h1 == b'0' && *h2 == b'0' {
                        return Err(UrlError::InvalidPath {
                            reason: "an encoded NUL (%00) is not allowed",
                        });
                    }
                    k += 3;
                    continue;
                }
                _ => {
                    return Err(UrlError::InvalidPath {
                        reason: "malformed percent-encoding",
                    });
                }
            }
        }
        if !(c.is_ascii_alphanumeric() || b"-._~/+@:=,!$&()*;".contains(&c)) {
            return Err(UrlError::InvalidPath {
                reason: "the path contains a character that must be percent-encoded",
            });
        }
        k += 1;
    }
    Ok(())
}

/// Whether a resolver's error (`getaddrinfo`'s message, as Rust reports it) is the DNS's answer
/// that the name does not exist or has no address, rather than a failure to get an answer
/// (`Temporary failure in name resolution`, a server failure, a timeout).
pub fn names_no_host(reason: &str) -> bool {
    [
        "Name or service not known",
        "No address associated with hostname",
        "nodename nor servname provided",
    ]
    .iter()
    .any(|answer| reason.contains(answer))
}

/// Resolves `host` (async DNS) and checks that every address it resolves to is public (unless
/// the policy allows private hosts). Returns the addresses, deduplicated, in resolver order.
pub async fn resolve_public(
    host: &str,
    port: u16,
    policy: &UrlPolicy,
) -> Result<Vec<IpAddr>, UrlError> {
    let lookup = tokio::net::lookup_host((host, port));
    let resolved = match tokio::time::timeout(policy.dns_timeout, lookup).await {
        Err(_) => {
            return Err(UrlError::ResolutionTimedOut {
                host: host.to_string(),
                timeout: policy.dns_timeout,
            });
        }
        Ok(Err(e)) => {
            let reason = e.to_string();
            if names_no_host(&reason) {
                return Err(UrlError::UnknownHost {
                    host: host.to_string(),
                });
            }
            return Err(UrlError::Resolution {
                host: host.to_string(),
                reason,
            });
        }
        Ok(Ok(addrs)) => addrs,
    };
    let mut addresses: Vec<IpAddr> = Vec::new();
    for addr in resolved {
        let ip = addr.ip();
        if !addresses.contains(&ip) {
            addresses.push(ip);
        }
    }
    if addresses.is_empty() {
        return Err(UrlError::NoAddresses {
            host: host.to_string(),
        });
    }
    for &address in &addresses {
        if let Some(class) = forbidden_class(address, policy) {
            tracing::info!(%host, %address, %class, "refused a host that resolves to a non-public address");
            return Err(UrlError::ResolvesToForbiddenAddress {
                host: host.to_string(),
                address,
                class,
            });
        }
    }
    Ok(addresses)
}

/// Replaces user info in any `scheme://user[:pass]@host` inside `text` with `***`, so that
/// tool output can be logged or returned without leaking credentials.
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        let (before, after) = rest.split_at(pos + 3);
        out.push_str(before);
        let authority_end = after
            .find(|c: char| {
                c == '/' || c.is_whitespace() || matches!(c, '\'' | '"' | '<' | '>' | '`')
            })
            .unwrap_or(after.len());
        let authority = &after[..authority_end];
        match authority.rfind('@') {
            Some(at) => {
                out.push_str("***");
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &after[authority_end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {

    #[test]
    fn only_the_dns_saying_no_such_name_is_an_unknown_host() {
        for answer in [
            "failed to lookup address information: Name or service not known",
            "failed to lookup address information: No address associated with hostname",
            "failed to lookup address information: nodename nor servname provided, or not known",
        ] {
            assert!(names_no_host(answer), "{answer}");
        }
        for failure in [
            "failed to lookup address information: Temporary failure in name resolution",
            "failed to lookup address information: Try again",
            "failed to lookup address information: System error",
        ] {
            assert!(!names_no_host(failure), "{failure}");
        }
    }

    /// The resolver's answer for a name under `.invalid` (RFC 6761: never exists).
    #[tokio::test]
    async fn a_name_that_cannot_exist_is_an_unknown_host() {
        match resolve_public("typo.invalid", 443, &UrlPolicy::default()).await {
            Err(UrlError::UnknownHost { host }) => assert_eq!(host, "typo.invalid"),
            // A machine with no resolver at all fails to get an answer instead.
            Err(UrlError::Resolution { reason, .. }) => assert!(!names_no_host(&reason)),
            Err(UrlError::ResolutionTimedOut { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    use super::*;

    fn strict() -> UrlPolicy {
        UrlPolicy::default()
    }

    /// The default policy that also fetches from port 8443.
    fn also_8443() -> UrlPolicy {
        UrlPolicy {
            allowed_ports: vec![443, 8443],
            ..UrlPolicy::default()
        }
    }

    #[test]
    fn only_the_allowed_ports_are_fetched_from() {
        for url in [
            "https://github.com:8443/o/r",
            "https://github.com:22/o/r",
            "https://github.com:80/o/r",
            "https://93.184.216.34:6379/r.git",
            "https://[2606:4700:4700::1111]:25/r.git",
        ] {
            match check_url(url, &strict()) {
                Err(e @ UrlError::PortNotAllowed { .. }) => {
                    assert_eq!(
                        e.to_string().split_once("; ").map(|(_, rest)| rest),
                        Some("repositories are fetched from port 443 only"),
                        "{url}"
                    );
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        check_url("https://github.com:443/o/r", &strict()).unwrap();
        check_url("https://github.com:8443/o/r", &also_8443()).unwrap();
        let e = check_url("https://github.com:22/o/r", &also_8443()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "port 22 is not allowed; repositories are fetched from ports 443 and 8443 only"
        );
        let three = UrlPolicy {
            allowed_ports: vec![443, 8443, 9443],
            ..UrlPolicy::default()
        };
        let e = check_url("https://github.com:1/o/r", &three).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("from ports 443, 8443 and 9443 only"),
            "{e}"
        );
        // Only 8443: the default port is refused too, written or not.
        let only_8443 = UrlPolicy {
            allowed_ports: vec![8443],
            ..UrlPolicy::default()
        };
        for url in ["https://github.com/o/r", "https://github.com:443/o/r"] {
            assert!(
                matches!(
                    check_url(url, &only_8443),
                    Err(UrlError::PortNotAllowed { port: 443, .. })
                ),
                "{url}"
            );
        }
    }

    #[test]
    fn port_lists_parse_sorted_without_duplicates() {
        assert_eq!(parse_ports("443"), Ok(vec![443]));
        assert_eq!(
            parse_ports("8443, 443,443  9418"),
            Ok(vec![443, 8443, 9418])
        );
        for bad in ["", " , ", "0", "65536", "https", "443;8443", "-1", "44 3x"] {
            let e = parse_ports(bad).unwrap_err();
            assert!(
                e.contains("not a port") || e.contains("no port is given"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn accepts_https_and_normalises() {
        let url = check_url("HTTPS://GitHub.com/Owner/Repo.git", &strict()).unwrap();
        assert_eq!(url.as_str(), "https://github.com/Owner/Repo.git");
        assert_eq!(url.port(), Some(443));
        let url = check_url("https://git.example.org:8443/a/b", &also_8443()).unwrap();
        assert_eq!(url.as_str(), "https://git.example.org:8443/a/b");
        assert_eq!(url.port(), Some(8443));
        let url = check_url("https://[2606:4700:4700::1111]/r.git", &strict()).unwrap();
        assert_eq!(
            url.host(),
            Some(&Host::Ip("2606:4700:4700::1111".parse().unwrap()))
        );
        assert_eq!(url.as_str(), "https://[2606:4700:4700::1111]/r.git");
        check_url("https://93.184.216.34/r.git", &strict()).unwrap();
        check_url("https://gitlab.com/group/sub%20group/repo", &strict()).unwrap();
    }

    fn key(url: &str) -> String {
        check_url(url, &also_8443()).unwrap().cache_key().to_owned()
    }

    #[test]
    fn normalises_default_port_slashes_and_keeps_the_path_verbatim() {
        let n = |url: &str| check_url(url, &also_8443()).unwrap().as_str().to_owned();
        assert_eq!(n("https://github.com:443/o/r"), "https://github.com/o/r");
        assert_eq!(
            check_url("https://github.com:443/o/r", &strict())
                .unwrap()
                .port(),
            Some(443)
        );
        assert_eq!(n("https://github.com/o/r/"), "https://github.com/o/r");
        assert_eq!(n("https://github.com/o/r///"), "https://github.com/o/r");
        assert_eq!(n("https://github.com//o///r"), "https://github.com/o/r");
        // `.git` and case stay in the URL git fetches.
        assert_eq!(
            n("https://github.com/O/R.git/"),
            "https://github.com/O/R.git"
        );
        assert_eq!(
            n("https://GITHUB.COM:443/o/r.git"),
            "https://github.com/o/r.git"
        );
        assert_eq!(
            n("https://git.example.org:8443/o/r/"),
            "https://git.example.org:8443/o/r"
        );
        assert_eq!(
            check_url("https://github.com/o//r/", &strict())
                .unwrap()
                .path(),
            "/o/r"
        );
        // Only a path of slashes has nothing left: refused as before.
        for url in [
            "https://github.com",
            "https://github.com/",
            "https://github.com//",
        ] {
            assert!(
                matches!(check_url(url, &strict()), Err(UrlError::InvalidPath { .. })),
                "{url}"
            );
        }
    }

    #[test]
    fn equivalent_spellings_share_one_cache_key() {
        let canonical = "https://github.com/o/r";
        for url in [
            "https://github.com/o/r",
            "https://github.com/o/r.git",
            "https://github.com/o/r/",
            "https://github.com/o/r.git/",
            "https://github.com/o/r//",
            "https://github.com//o//r",
            "https://github.com:443/o/r",
            "https://github.com:443/o/r.git/",
            "HTTPS://GitHub.COM/o/r.git",
        ] {
            assert_eq!(key(url), canonical, "{url}");
            let spellings = check_url(url, &strict()).unwrap().cache_spellings();
            assert_eq!(
                spellings,
                ["https://github.com/o/r", "https://github.com/o/r.git"],
                "{url}"
            );
            let fetched = check_url(url, &strict()).unwrap();
            assert!(spellings.iter().any(|s| s == fetched.as_str()), "{url}");
        }
    }

    #[test]
    fn different_repositories_keep_different_cache_keys() {
        let distinct = [
            "https://github.com/o/r",
            "https://github.com/o/r2",
            "https://github.com/o/R",
            "https://github.com/O/r",
            "https://github.com/o2/r",
            "https://github.com/o/r.git.git",
            "https://github.com/o/r.gitx",
            "https://github.com/o/r.GIT",
            "https://github.com/o/r/sub",
            "https://gitlab.com/o/r",
            "https://github.com:8443/o/r",
            "https://github.com/o",
            "https://github.com/.git",
            "https://github.com/o/.git",
        ];
        let keys: Vec<String> = distinct.iter().map(|u| key(u)).collect();
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // One `.git` is dropped; a name that is only `.git` is kept whole.
        assert_eq!(
            key("https://github.com/o/r.git.git"),
            "https://github.com/o/r.git"
        );
        assert_eq!(key("https://github.com/.git"), "https://github.com/.git");
        assert_eq!(
            key("https://github.com/o/.git/"),
            "https://github.com/o/.git"
        );
        assert_eq!(key("https://github.com/o/R.git"), "https://github.com/o/R");
        assert_eq!(
            key("https://github.com:8443/o/r.git"),
            "https://github.com:8443/o/r"
        );
        assert_eq!(
            key("https://[2606:4700:4700::1111]:443/r.git/"),
            "https://[2606:4700:4700::1111]/r"
        );
    }

    #[test]
    fn file_urls_are_their_own_cache_key() {
        let p = UrlPolicy::with_file_urls(true);
        let url = check_url("file:///srv/repos/x.git", &p).unwrap();
        assert_eq!(url.cache_key(), "file:///srv/repos/x.git");
        assert_eq!(
            url.cache_spellings(),
            ["file:///srv/repos/x.git", "file:///srv/repos/x.git"]
        );
        let bare = check_url("file:///srv/repos/x", &p).unwrap();
        assert_ne!(bare.cache_key(), url.cache_key());
    }

    #[test]
    fn refuses_every_disallowed_form_with_the_right_error() {
        let p = strict();
        let cases: Vec<(&str, UrlError)> = vec![
            ("", UrlError::Empty),
            (
                " https://github.com/a/b",
                UrlError::InvalidCharacters { what: "whitespace" },
            ),
            (
                "https://github.com/a/b\n",
                UrlError::InvalidCharacters { what: "whitespace" },
            ),
            (
                "https://github.com/a\u{0}b",
                UrlError::InvalidCharacters {
                    what: "control characters",
                },
            ),
            (
                "https://gíthub.com/a/b",
                UrlError::InvalidCharacters {
                    what: "non-ASCII characters (percent-encode them)",
                },
            ),
            (
                "https://github.com\\@evil.com/a",
                UrlError::InvalidCharacters {
                    what: "backslashes",
                },
            ),
            ("git@github.com:owner/repo.git", UrlError::ScpStyle),
            ("github.com:owner/repo.git", UrlError::ScpStyle),
            ("github.com/owner/repo", UrlError::NotAUrl),
            ("/srv/repos/x.git", UrlError::NotAUrl),
            (
                "ht tp://x",
                UrlError::InvalidCharacters { what: "whitespace" },
            ),
            ("1http://x/y", UrlError::MalformedScheme),
            (
                "http://github.com/a/b",
                UrlError::SchemeNotAllowed {
                    scheme: "http".into(),
                },
            ),
            ("ssh://git@github.com/a/b", UrlError::Credentials),
            (
                "ssh://github.com/a/b",
                UrlError::SchemeNotAllowed {
                    scheme: "ssh".into(),
                },
            ),
            (
                "git://github.com/a/b",
                UrlError::SchemeNotAllowed {
                    scheme: "git".into(),
                },
            ),
            (
                "ext::sh -c touch% /tmp/x",
                UrlError::InvalidCharacters { what: "whitespace" },
            ),
            ("ext::sh", UrlError::ScpStyle),
            ("file:///srv/repo.git", UrlError::FileUrlsNotAllowed),
            ("https://user:secret@github.com/a/b", UrlError::Credentials),
            ("https://token@github.com/a/b", UrlError::Credentials),
            ("https://github.com@evil.com/a/b", UrlError::Credentials),
            ("https://github.com/a/b?x=1", UrlError::QueryOrFragment),
            ("https://github.com/a/b#frag", UrlError::QueryOrFragment),
            ("https:///a/b", UrlError::MissingHost),
            (
                "https://github.com",
                UrlError::InvalidPath {
                    reason: "the URL has no repository path (expected https://host/owner/repository)",
                },
            ),
            (
                "https://github.com:/a",
                UrlError::InvalidPort {
                    reason: "empty port",
                },
            ),
            (
                "https://github.com:0/a",
                UrlError::InvalidPort {
                    reason: "a port must be a number from 1 to 65535",
                },
            ),
            (
                "https://github.com:99999/a",
                UrlError::InvalidPort {
                    reason: "a port must be a number from 1 to 65535",
                },
            ),
            (
                "https://git_hub.com/a",
                UrlError::InvalidHost {
                    reason: "a host name may only contain letters, digits, `-` and `.`",
                },
            ),
            (
                "https://github.com./a",
                UrlError::InvalidHost {
                    reason: "a host name must not end with a dot",
                },
            ),
            (
                "https://2130706433/a",
                UrlError::InvalidHost {
                    reason: "a numeric host must be a canonical dotted-decimal IPv4 address",
                },
            ),
            (
                "https://0x7f.0.0.1/a",
                UrlError::InvalidHost {
                    reason: "a numeric host must be a canonical dotted-decimal IPv4 address",
                },
            ),
            (
                "https://127.1/a",
                UrlError::InvalidHost {
                    reason: "a numeric host must be a canonical dotted-decimal IPv4 address",
                },
            ),
            (
                "https://[fe80::1%25eth0]/a",
                UrlError::InvalidHost {
                    reason: "IPv6 zone identifiers are not allowed",
                },
            ),
            (
                "https://[::1/a",
                UrlError::InvalidHost {
                    reason: "unclosed `[` in an IPv6 literal",
                },
            ),
            (
                "https://localhost/a",
                UrlError::InternalHostName {
                    host: "localhost".into(),
                    why: "loopback name",
                },
            ),
            (
                "https://api.localhost/a",
                UrlError::InternalHostName {
                    host: "api.localhost".into(),
                    why: "loopback name",
                },
            ),
            (
                "https://metadata.google.internal/a",
                UrlError::InternalHostName {
                    host: "metadata.google.internal".into(),
                    why: "private-use name",
                },
            ),
            (
                "https://intranet/a",
                UrlError::InternalHostName {
                    host: "intranet".into(),
                    why: "single-label name, resolved through local search domains",
                },
            ),
            (
                "https://github.com/a/%zz",
                UrlError::InvalidPath {
                    reason: "malformed percent-encoding",
                },
            ),
            (
                "https://github.com/a/%00",
                UrlError::InvalidPath {
                    reason: "an encoded NUL (%00) is not allowed",
                },
            ),
            (
                "https://github.com/a/\"b",
                UrlError::InvalidPath {
                    reason: "the path contains a character that must be percent-encoded",
                },
            ),
        ];
        for (url, want) in cases {
            assert_eq!(check_url(url, &p), Err(want), "{url:?}");
        }
        let long = format!("https://github.com/{}", "a".repeat(3000));
        assert_eq!(
            check_url(&long, &p),
            Err(UrlError::TooLong {
                len: long.len(),
                max: 2048
            })
        );
    }

    #[test]
    fn refuses_internal_ip_literals_syntactically() {
        let p = strict();
        for (url, class) in [
            ("https://127.0.0.1/a", AddressClass::Loopback),
            ("https://[::1]/a", AddressClass::Loopback),
            ("https://10.0.0.1/a", AddressClass::Private),
            ("https://172.16.5.4/a", AddressClass::Private),
            ("https://192.168.1.1/a", AddressClass::Private),
            ("https://169.254.169.254/a", AddressClass::LinkLocal),
            ("https://100.64.0.1/a", AddressClass::SharedCgnat),
            ("https://0.0.0.0/a", AddressClass::Unspecified),
            ("https://[::]/a", AddressClass::Unspecified),
            ("https://224.0.0.1/a", AddressClass::Multicast),
            ("https://[ff02::1]/a", AddressClass::Multicast),
            ("https://[fd00::1]/a", AddressClass::UniqueLocal),
            ("https://[fe80::1]/a", AddressClass::LinkLocal),
            ("https://[::ffff:127.0.0.1]/a", AddressClass::Loopback),
            ("https://[64:ff9b::10.0.0.1]/a", AddressClass::Private),
            ("https://[2002:a9fe:a9fe::]/a", AddressClass::LinkLocal),
            ("https://255.255.255.255/a", AddressClass::Broadcast),
            ("https://192.0.2.1/a", AddressClass::Documentation),
        ] {
            match check_url(url, &p) {
                Err(UrlError::ForbiddenAddress { class: got, .. }) => {
                    assert_eq!(got, class, "{url}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        let open = UrlPolicy {
            allow_private_hosts: true,
            ..strict()
        };
        check_url("https://127.0.0.1/a", &open).unwrap();
        check_url("https://localhost/a", &open).unwrap();
    }

    #[test]
    fn file_urls_only_when_allowed() {
        let p = UrlPolicy::with_file_urls(true);
        let url = check_url("file:///srv/repos/x.git", &p).unwrap();
        assert_eq!(url.scheme(), Scheme::File);
        assert_eq!(url.path(), "/srv/repos/x.git");
        check_url("file://localhost/srv/x", &p).unwrap();
        assert!(matches!(
            check_url("file://other/srv/x", &p),
            Err(UrlError::InvalidHost { .. })
        ));
        assert!(matches!(
            check_url("file:///", &p),
            Err(UrlError::InvalidPath { .. })
        ));
        assert!(matches!(
            check_url("file:///a%20b", &p),
            Err(UrlError::InvalidPath { .. })
        ));
        // Still no other schemes.
        assert!(matches!(
            check_url("ssh://h.com/x", &p),
            Err(UrlError::SchemeNotAllowed { .. })
        ));
        assert_eq!(
            check_url("file:///srv/x", &strict()),
            Err(UrlError::FileUrlsNotAllowed)
        );
    }

    #[test]
    fn errors_never_echo_credentials() {
        let p = strict();
        for url in [
            "https://alice:hunter2@github.com/a/b",
            "https://alice:hunter2@127.0.0.1/a",
            "http://alice:hunter2@github.com/a/b",
            "ssh://alice:hunter2@github.com/a/b",
            "alice:hunter2@github.com:a/b",
            "https://alice:hunter2@github.com/a b",
            "https://alice:hunter2@github.com/a?b",
        ] {
            let message = check_url(url, &p).unwrap_err().to_string();
            assert!(
                !message.contains("hunter2") && !message.contains("alice"),
                "{url}: {message}"
            );
        }
    }

    #[test]
    fn redacts_user_info() {
        assert_eq!(
            redact("fatal: unable to access 'https://alice:hunter2@github.com/a/': 403"),
            "fatal: unable to access 'https://***@github.com/a/': 403"
        );
        assert_eq!(redact("no urls here"), "no urls here");
        assert_eq!(
            redact("x https://github.com/a y ssh://t@h"),
            "x https://github.com/a y ssh://***@h"
        );
    }

    #[test]
    fn curl_pin_format() {
        let url = check_url("https://example.com/r", &strict()).unwrap();
        let vetted = VettedUrl {
            url,
            addresses: vec![
                "93.184.216.34".parse().unwrap(),
                "2606:2800::1".parse().unwrap(),
            ],
        };
        assert_eq!(
            vetted.curl_resolve_pin().as_deref(),
            Some("example.com:443:93.184.216.34,[2606:2800::1]")
        );
    }
}
