//! The client's address behind trusted proxies (`HTTP_TRUSTED_PROXIES`): which address of a
//! request's `X-Forwarded-For` chain the rate limiter's `remote_address` is, and why a client
//! cannot choose it.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::HeaderMap;
use http::header::HeaderName;

/// `X-Forwarded-For`: each proxy appends the address it received the request from.
pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// An address range: an address and how many leading bits of it a member shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpRange {
    base: IpAddr,
    prefix: u8,
}

impl IpRange {
    /// Whether `ip` is in the range (an IPv4-mapped IPv6 address counts as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.base, canonical(ip)) {
            (IpAddr::V4(base), IpAddr::V4(ip)) => {
                mask_v4(u32::from(base), self.prefix) == mask_v4(u32::from(ip), self.prefix)
            }
            (IpAddr::V6(base), IpAddr::V6(ip)) => {
                mask_v6(u128::from(base), self.prefix) == mask_v6(u128::from(ip), self.prefix)
            }
            _ => false,
        }
    }
}

fn mask_v4(bits: u32, prefix: u8) -> u32 {
    bits.checked_shr(32 - u32::from(prefix)).unwrap_or(0)
}

fn mask_v6(bits: u128, prefix: u8) -> u128 {
    bits.checked_shr(128 - u32::from(prefix)).unwrap_or(0)
}

impl fmt::Display for IpRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix)
    }
}

impl std::str::FromStr for IpRange {
    type Err = String;

    /// `10.0.0.0/8`, `fd00::/8`, or one address (`10.1.2.3`, a range of one).
    fn from_str(s: &str) -> Result<IpRange, String> {
        let (addr, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (s, None),
        };
        let base: IpAddr = addr
            .parse()
            .map_err(|_| format!("`{}` is not an IP address", addr.escape_debug()))?;
        let base = canonical(base);
        let max = if base.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(|| {
                format!(
                    "`{}` is not a prefix length of {base} (0 to {max})",
                    p.escape_debug()
                )
            })?,
        };
        Ok(IpRange { base, prefix })
    }
}

/// IPv4-mapped IPv6 (`::ffff:192.0.2.1`, as a dual-stack listener reports IPv4 peers) as IPv4.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 @ IpAddr::V4(_) => v4,
    }
}

/// The proxies whose `X-Forwarded-For` is believed. Empty (the default): the TCP peer is the
/// client, and the header is ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<IpRange>);

impl TrustedProxies {
    /// A comma-separated list of ranges and addresses (`10.0.0.0/8, 192.0.2.7`); empty or blank
    /// trusts no one.
    pub fn parse(list: &str) -> Result<TrustedProxies, String> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::parse)
            .collect::<Result<Vec<IpRange>, String>>()
            .map(TrustedProxies)
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|range| range.contains(ip))
    }

    /// The client of a request from `peer` with `headers`.
    ///
    /// A peer that is not trusted is the client, whatever it sends. From a trusted peer the
    /// `X-Forwarded-For` addresses (every such header, in order) are read from the right, the
    /// nearest hop first: each trusted one is a proxy of ours, and the first that is not is the
    /// client. Addresses to its left were written by the client itself and are never used, so a
    /// client cannot pick the address it is limited by. An entry that is not an address ends
    /// the walk at the last address read (the proxy that passed it on); so does a chain of
    /// trusted addresses only.
    pub fn client(&self, peer: SocketAddr, headers: &HeaderMap) -> IpAddr {
        let mut client = canonical(peer.ip());
        if !self.trusts(client) {
            return client;
        }
        // Split as bytes, each entry read on its own: a proxy appends the client's address to
        // the line the client sent, so a byte that is not ASCII in the client's part must not
        // cost the line the address the proxy wrote after it.
        let entries: Vec<&[u8]> = headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .flat_map(|value| value.as_bytes().split(|b| *b == b','))
            .collect();
        for entry in entries.iter().rev() {
            let Some(hop) = std::str::from_utf8(entry).ok().and_then(forwarded_ip) else {
                return client;
            };
            client = hop;
            if !self.trusts(hop) {
                return client;
            }
        }
        client
    }
}

/// One `X-Forwarded-For` entry as an address: `192.0.2.1`, `2001:db8::1`, or either with a port
/// (`192.0.2.1:4711`, `[2001:db8::1]:4711`), as some proxies write it.
fn forwarded_ip(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Ok(addr) = entry.parse::<SocketAddr>() {
        return Some(canonical(addr.ip()));
    }
    let bracketed = entry.strip_prefix('[')?.strip_suffix(']')?;
    bracketed
        .parse::<Ipv6Addr>()
        .ok()
        .map(|v6| canonical(IpAddr::V6(v6)))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(&X_FORWARDED_FOR, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    fn peer(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), 40_000)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ranges_contain_their_addresses_only() {
        let r: IpRange = "10.0.0.0/8".parse().unwrap();
        assert!(r.contains(ip("10.255.1.2")));
        assert!(!r.contains(ip("11.0.0.1")));
        assert!(r.contains(ip("::ffff:10.1.1.1")), "IPv4-mapped");
        assert!(!r.contains(ip("::1")));
        let one: IpRange = "192.0.2.7".parse().unwrap();
        assert!(one.contains(ip("192.0.2.7")));
        assert!(!one.contains(ip("192.0.2.8")));
        let v6: IpRange = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12:3456::1")));
        assert!(!v6.contains(ip("fe80::1")));
        assert!(!v6.contains(ip("10.0.0.1")));
        let all: IpRange = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("203.0.113.9")));
        let all6: IpRange = "::/0".parse().unwrap();
        assert!(all6.contains(ip("2001:db8::1")));
        let host6: IpRange = "2001:db8::1/128".parse().unwrap();
        assert!(host6.contains(ip("2001:db8::1")));
        assert!(!host6.contains(ip("2001:db8::2")));
        // Host bits after the prefix are ignored, as `ip route` does.
        let loose: IpRange = "10.1.2.3/8".parse().unwrap();
        assert!(loose.contains(ip("10.9.9.9")));
        assert_eq!(loose.to_string(), "10.1.2.3/8");
    }

    #[test]
    fn a_list_that_is_not_ranges_is_refused_naming_the_entry() {
        assert_eq!(
            TrustedProxies::parse("").unwrap(),
            TrustedProxies::default()
        );
        assert_eq!(
            TrustedProxies::parse(" , ").unwrap(),
            TrustedProxies::default()
        );
        assert_eq!(
            TrustedProxies::parse("10.0.0.0/8, 192.0.2.7,fd00::/8")
                .unwrap()
                .0
                .len(),
            3
        );
        for (list, message) in [
            (
                "10.0.0.0/8, proxy.internal",
                "`proxy.internal` is not an IP address",
            ),
            (
                "10.0.0.0/33",
                "`33` is not a prefix length of 10.0.0.0 (0 to 32)",
            ),
            (
                "fd00::/129",
                "`129` is not a prefix length of fd00:: (0 to 128)",
            ),
            (
                "10.0.0.0/",
                "`` is not a prefix length of 10.0.0.0 (0 to 32)",
            ),
            (
                "10.0.0.0/-1",
                "`-1` is not a prefix length of 10.0.0.0 (0 to 32)",
            ),
            (
                "10.0.0.0/8/8",
                "`8/8` is not a prefix length of 10.0.0.0 (0 to 32)",
            ),
        ] {
            assert_eq!(TrustedProxies::parse(list).unwrap_err(), message, "{list}");
        }
    }

    #[test]
    fn without_trusted_proxies_the_peer_is_the_client_whatever_it_sends() {
        let none = TrustedProxies::default();
        let h = headers(&["203.0.113.1"]);
        assert_eq!(none.client(peer("10.0.0.5"), &h), ip("10.0.0.5"));
        assert_eq!(none.client(peer("::ffff:10.0.0.5"), &h), ip("10.0.0.5"));
        let trusted = TrustedProxies::parse("10.0.0.0/8").unwrap();
        assert_eq!(
            trusted.client(peer("198.51.100.4"), &h),
            ip("198.51.100.4"),
            "an untrusted peer cannot claim an address"
        );
    }

    #[test]
    fn the_client_is_the_nearest_address_that_is_not_a_trusted_proxy() {
        let proxies = TrustedProxies::parse("10.0.0.0/8").unwrap();
        let p = peer("10.0.0.5");
        assert_eq!(
            proxies.client(p, &headers(&["203.0.113.1"])),
            ip("203.0.113.1")
        );
        // A client's own header is to the left of what the proxies append: never believed.
        assert_eq!(
            proxies.client(p, &headers(&["198.51.100.66, 203.0.113.1"])),
            ip("203.0.113.1")
        );
        // Through two proxies of ours.
        assert_eq!(
            proxies.client(p, &headers(&["198.51.100.66, 203.0.113.1, 10.9.9.9"])),
            ip("203.0.113.1")
        );
        // Several header lines are one list, in order.
        assert_eq!(
            proxies.client(p, &headers(&["198.51.100.66", "203.0.113.1", "10.9.9.9"])),
            ip("203.0.113.1")
        );
        // Ports and brackets, as some proxies write them; IPv4-mapped as IPv4.
        assert_eq!(
            proxies.client(p, &headers(&["203.0.113.1:5555"])),
            ip("203.0.113.1")
        );
        assert_eq!(
            proxies.client(p, &headers(&["[2001:db8::7]:5555"])),
            ip("2001:db8::7")
        );
        assert_eq!(
            proxies.client(p, &headers(&["[2001:db8::7]"])),
            ip("2001:db8::7")
        );
        assert_eq!(
            proxies.client(p, &headers(&[" 2001:db8::7 "])),
            ip("2001:db8::7")
        );
        assert_eq!(
            proxies.client(p, &headers(&["::ffff:203.0.113.1"])),
            ip("203.0.113.1")
        );
        // No header, or only proxies: the last proxy read.
        assert_eq!(proxies.client(p, &HeaderMap::new()), ip("10.0.0.5"));
        assert_eq!(
            proxies.client(p, &headers(&["10.1.1.1, 10.2.2.2"])),
            ip("10.1.1.1")
        );
        // Garbage stops the walk at the hop that passed it on.
        assert_eq!(
            proxies.client(p, &headers(&["203.0.113.1, unknown, 10.2.2.2"])),
            ip("10.2.2.2")
        );
        assert_eq!(proxies.client(p, &headers(&["unknown"])), ip("10.0.0.5"));
        // A byte that is not ASCII in the client's part of the line does not lose the address
        // the proxy appended to it.
        let mut raw = HeaderMap::new();
        raw.append(
            &X_FORWARDED_FOR,
            HeaderValue::from_bytes(b"\xff\xfe, 203.0.113.1").unwrap(),
        );
        assert_eq!(proxies.client(p, &raw), ip("203.0.113.1"));
        assert_eq!(proxies.client(p, &headers(&[""])), ip("10.0.0.5"));
    }
}
