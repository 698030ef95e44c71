//! What every request passes before a handler, and what every answer carries.
//!
//! The page answers only a request whose `Host` names an address it serves on or a
//! name the service allowed ([`AdminConfig::allow_host`](super::AdminConfig::allow_host)):
//! a page elsewhere on the web that rebinds its own name to this address (DNS
//! rebinding) sends its own name as the Host, so it cannot read the page. Any other
//! Host, or none, is answered 421 Misdirected Request: the request was sent to a name
//! this server does not answer for, which is what 421 says (RFC 9110, 15.5.20); a
//! 403 would say the request was understood and refused.
//!
//! A request that changes something (any method but GET and HEAD: the actions) and
//! carries an `Origin` must come from an origin whose host is allowed the same way,
//! else it is answered 403 before its tokens are looked at. A request without an
//! `Origin` is a client that is no browser (browsers send one with every POST).
//!
//! Every answer, a refusal too, carries headers that keep it out of other pages'
//! frames and keep browsers from guessing types or sending the page's address on:
//! `X-Frame-Options`, `X-Content-Type-Options`, `Referrer-Policy` and a
//! `Content-Security-Policy` that loads scripts, styles and the live feed from the
//! page's own origin only (the pages have no inline script, style or handler).

use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::uri::Authority;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::Refusal;

/// The policy: this origin's scripts, styles, images and connections only; no
/// plugins, no `<base>`, forms posted here only, in no other page's frame.
pub(super) const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; object-src 'none'; \
     base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// A connection [`serve_on`](super::AdminConfig::serve_on) accepted: the address it
/// came to (the one the page serves on, even when the listener is bound to every
/// interface) and the peer's.
#[derive(Clone, Copy, Debug)]
pub(super) struct Served {
    pub(super) local: Option<SocketAddr>,
    pub(super) peer: SocketAddr,
}

impl Connected<axum::serve::IncomingStream<'_, tokio::net::TcpListener>> for Served {
    fn connect_info(stream: axum::serve::IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        Served {
            local: stream.io().local_addr().ok(),
            peer: *stream.remote_addr(),
        }
    }
}

/// A host as a request names it, compared without case: an IP address or a name.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Name {
    Ip(IpAddr),
    Dns(String),
}

/// Parses `host[:port]` (`[v6]:port` for IPv6): the name and the port, if given.
/// `None` for anything else (user info, a path, bad characters, an empty name).
fn parse_authority(text: &str) -> Option<(Name, Option<u16>)> {
    let authority = Authority::from_str(text.trim()).ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    let host = authority.host();
    // Without user info, the authority is the host, then `:port` if any.
    let port = match authority.as_str().get(host.len()..)? {
        "" => None,
        rest => {
            let digits = rest.strip_prefix(':')?;
            if !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some(digits.parse::<u16>().ok()?)
        }
    };
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let name = match bare.parse::<IpAddr>() {
        Ok(ip) => Name::Ip(ip.to_canonical()),
        Err(_) if bare.is_empty() || host.starts_with('[') => return None,
        Err(_) => {
            let dns = bare.to_ascii_lowercase();
            Name::Dns(dns.strip_suffix('.').map(str::to_string).unwrap_or(dns))
        }
    };
    Some((name, port))
}

/// A host the service allowed: a name on any port, or on its port only.
#[derive(Debug)]
struct Allowed {
    name: Name,
    port: Option<u16>,
}

/// The hosts a router answers for, besides the address a connection came to.
#[derive(Debug)]
pub(super) struct Guard {
    allowed: Vec<Allowed>,
}

impl Guard {
    /// The guard for `names` (as [`AdminConfig::allow_host`](super::AdminConfig::allow_host)
    /// took them); one that does not parse is logged and allows nothing.
    pub(super) fn new(names: &[String]) -> Guard {
        let allowed = names
            .iter()
            .filter_map(|text| match parse_authority(text) {
                Some((name, port)) => Some(Allowed { name, port }),
                None => {
                    tracing::warn!(target: crate::targets::ADMIN, host = %text, "the admin page's allowed host is no host[:port]; it allows nothing");
                    None
                }
            })
            .collect();
        Guard { allowed }
    }

    pub(super) fn allows_none(&self) -> bool {
        self.allowed.is_empty()
    }

    /// Whether `name:port` is the address the connection came to (or, on a loopback
    /// address, `localhost` on its port) or a host the service allowed.
    fn allows(&self, name: &Name, port: u16, local: Option<SocketAddr>) -> bool {
        let own = local.is_some_and(|local| {
            let ip = local.ip().to_canonical();
            local.port() == port
                && match name {
                    Name::Ip(named) => *named == ip,
                    Name::Dns(named) => named == "localhost" && ip.is_loopback(),
                }
        });
        own || self
            .allowed
            .iter()
            .any(|a| a.name == *name && a.port.is_none_or(|p| p == port))
    }
}

/// Why a request's Host is not answered, if it is not.
fn misdirected(guard: &Guard, request: &Request, local: Option<SocketAddr>) -> Option<String> {
    // HTTP/1 names the host in `Host`; HTTP/2 in the request's authority.
    let named = match request.headers().get(header::HOST) {
        Some(value) => value.to_str().ok(),
        None => request.uri().authority().map(Authority::as_str),
    };
    let Some(named) = named else {
        return Some(if request.headers().contains_key(header::HOST) {
            "misdirected request: the Host header is unreadable".into()
        } else {
            "misdirected request: no Host header; the admin page answers only requests that name its address".into()
        });
    };
    let allowed = parse_authority(named)
        .is_some_and(|(name, port)| guard.allows(&name, port.unwrap_or(80), local));
    if allowed {
        return None;
    }
    let shown: String = named.chars().take(100).collect();
    let hint = if guard.allows_none() && local.is_none() {
        "this admin router allows no host: the service that nests it names its hosts with AdminConfig::allow_host"
    } else {
        "a service that serves the page under another name allows it with AdminConfig::allow_host"
    };
    Some(format!(
        "misdirected request: the Host header {shown:?} names no address this admin page serves ({hint})"
    ))
}

/// Why a state-changing request's `Origin` is refused, if it is.
fn cross_origin(guard: &Guard, request: &Request, local: Option<SocketAddr>) -> Option<String> {
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return None;
    }
    let origin = request.headers().get(header::ORIGIN)?;
    let allowed = origin.to_str().ok().is_some_and(|origin| {
        let (rest, default_port) = match origin.split_once("://") {
            Some(("http", rest)) => (rest, 80),
            Some(("https", rest)) => (rest, 443),
            _ => return false,
        };
        parse_authority(rest)
            .is_some_and(|(name, port)| guard.allows(&name, port.unwrap_or(default_port), local))
    });
    if allowed {
        return None;
    }
    let shown: String = String::from_utf8_lossy(origin.as_bytes())
        .chars()
        .take(100)
        .collect();
    Some(format!(
        "cross-origin request refused: the Origin {shown:?} is not this admin page's"
    ))
}

/// The middleware: the Host (421), an action's Origin (403), then the handler; the
/// security headers on whatever answers.
pub(super) async fn check(
    State(guard): State<Arc<Guard>>,
    request: Request,
    next: Next,
) -> Response {
    let served = request
        .extensions()
        .get::<ConnectInfo<Served>>()
        .map(|c| c.0);
    let local = served.and_then(|s| s.local);
    let peer = || {
        served.map(|s| s.peer).or_else(|| {
            request
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0)
        })
    };
    let mut response = if let Some(why) = misdirected(&guard, &request, local) {
        tracing::warn!(target: crate::targets::ADMIN, peer = ?peer(), path = request.uri().path(), "{why}");
        (
            StatusCode::MISDIRECTED_REQUEST,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            why,
        )
            .into_response()
    } else if let Some(why) = cross_origin(&guard, &request, local) {
        tracing::warn!(target: crate::targets::ADMIN, peer = ?peer(), path = request.uri().path(), "{why}");
        Refusal(StatusCode::FORBIDDEN, why).into_response()
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_parse_with_their_ports_and_without_case() {
        let ip = |s: &str| Name::Ip(s.parse().unwrap());
        let dns = |s: &str| Name::Dns(s.into());
        assert_eq!(
            parse_authority("127.0.0.1:80"),
            Some((ip("127.0.0.1"), Some(80)))
        );
        assert_eq!(parse_authority("[::1]:9092"), Some((ip("::1"), Some(9092))));
        assert_eq!(
            parse_authority("[::ffff:127.0.0.1]:1"),
            Some((ip("127.0.0.1"), Some(1)))
        );
        assert_eq!(
            parse_authority("Ops.Example."),
            Some((dns("ops.example"), None))
        );
        for bad in [
            "", "a@b", "a/b", "[nope]:1", ":80", "a:b", "a:", "a:+80", "a:99999", "a b",
        ] {
            assert_eq!(parse_authority(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_own_address_localhost_on_loopback_and_allowed_names_pass() {
        let guard = Guard::new(&[
            "ops.example".into(),
            "proxy.example:8443".into(),
            "a b".into(),
        ]);
        let ip = |s: &str| Name::Ip(s.parse().unwrap());
        let dns = |s: &str| Name::Dns(s.into());
        let loopback = Some(SocketAddr::from(([127, 0, 0, 1], 9092)));
        let v6 = Some("[::ffff:10.0.0.5]:9092".parse().unwrap());
        assert!(guard.allows(&ip("127.0.0.1"), 9092, loopback));
        assert!(guard.allows(&dns("localhost"), 9092, loopback));
        assert!(!guard.allows(&dns("localhost"), 9093, loopback));
        assert!(!guard.allows(&ip("127.0.0.2"), 9092, loopback));
        assert!(guard.allows(&ip("10.0.0.5"), 9092, v6));
        assert!(!guard.allows(&dns("localhost"), 9092, v6));
        assert!(!guard.allows(&ip("127.0.0.1"), 9092, None));
        assert!(guard.allows(&dns("ops.example"), 1, None));
        assert!(guard.allows(&dns("proxy.example"), 8443, None));
        assert!(!guard.allows(&dns("proxy.example"), 443, None));
        assert!(!guard.allows(&dns("evil.example"), 9092, loopback));
    }
}
