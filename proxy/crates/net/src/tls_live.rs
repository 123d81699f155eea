//! A TLS listener's live state: the session cache and the ticket key its
//! clients resume from. The policies give a listener's settings (a
//! template: certificates, client-certificate rules, ticket key files);
//! the listener owns what its handshakes build up, and a reload carries
//! it over unless the rules a resumed session was authenticated against
//! changed. Otherwise every ConfigMap edit would cost every client a full
//! handshake on its next connection, the most expensive thing a TLS
//! listener does.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::server::{ProducesTickets, StoresServerSessions};
use tokio_rustls::TlsAcceptor;

/// Sessions a listener remembers for TLS 1.2 session IDs and TLS 1.3
/// clients that take no tickets: rustls' default.
const SESSIONS: usize = 256;

/// What a listener's TLS is made from, as a reload compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSource {
    /// A digest of the rules a resumed session was authenticated against:
    /// the listener, its client-certificate rules, its ticket key files.
    pub rules: [u8; 32],
    /// The certificate files (cert, key), in order.
    pub pairs: Vec<(PathBuf, PathBuf)>,
}

/// A listener's handshake, with the state it keeps between handshakes.
#[derive(Clone)]
pub struct LiveTls {
    /// The handshake, ready to run.
    pub acceptor: TlsAcceptor,
    sessions: Arc<dyn StoresServerSessions>,
    ticketer: Arc<dyn ProducesTickets>,
    source: Option<TlsSource>,
}

impl LiveTls {
    /// `template` made live with a session cache and, unless it has keys
    /// from files (`keyed`), a ticket key of its own. Stateless tickets are
    /// on by default in nginx and Envoy: without them resumption rests on
    /// the cache of 256 sessions, which a few hundred clients (TLS 1.3
    /// stores two per handshake) cycle through. The own key is random,
    /// never leaves the process and rotates every 6 hours (rustls'
    /// ticketer); a restart makes a new one, as in nginx without
    /// `ssl_session_ticket_key`.
    pub fn fresh(template: &Arc<rustls::ServerConfig>, keyed: bool) -> LiveTls {
        let sessions: Arc<dyn StoresServerSessions> =
            rustls::server::ServerSessionMemoryCache::new(SESSIONS);
        let ticketer = if keyed {
            template.ticketer.clone()
        } else {
            match rustls::crypto::ring::Ticketer::new() {
                Ok(ticketer) => ticketer,
                // Only a failing random source refuses; sessions then
                // resume from the cache alone.
                Err(e) => {
                    tracing::warn!(error = %e, "no TLS session ticket key; sessions resume from the cache only");
                    template.ticketer.clone()
                }
            }
        };
        LiveTls::with(template, sessions, ticketer, None)
    }

    /// The live TLS for `template` made from `source`, carrying over what
    /// `previous` kept: all of it (the same handshake) when nothing
    /// changed; its session cache and ticket key when only the
    /// certificate files did (a resumed session skips the certificate);
    /// nothing when the rules did (a session authenticated under other
    /// client-certificate rules or other ticket keys does not resume).
    pub fn carry(
        template: &Arc<rustls::ServerConfig>,
        keyed: bool,
        source: TlsSource,
        previous: Option<&LiveTls>,
    ) -> LiveTls {
        match previous.and_then(|p| Some((p, p.source.as_ref()?))) {
            Some((p, was)) if *was == source => p.clone(),
            Some((p, was)) if was.rules == source.rules => {
                let ticketer = match keyed {
                    true => template.ticketer.clone(),
                    false => p.ticketer.clone(),
                };
                LiveTls::with(template, p.sessions.clone(), ticketer, Some(source))
            }
            _ => LiveTls {
                source: Some(source),
                ..LiveTls::fresh(template, keyed)
            },
        }
    }

    fn with(
        template: &Arc<rustls::ServerConfig>,
        sessions: Arc<dyn StoresServerSessions>,
        ticketer: Arc<dyn ProducesTickets>,
        source: Option<TlsSource>,
    ) -> LiveTls {
        let mut config = (**template).clone();
        config.session_storage = sessions.clone();
        config.ticketer = ticketer.clone();
        LiveTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            sessions,
            ticketer,
            source,
        }
    }
}
