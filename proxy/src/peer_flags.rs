//! The tunnel server's flags for replicas sharing a registry, checked
//! and turned into [`PeerOptions`]: secrets read from their files or the
//! environment, the advertised address worked out.

use std::net::SocketAddr;
use std::path::PathBuf;

use portcullis_net::redis_target::RedisTarget;
use portcullis_tunnel::peers::{PeerOptions, PeerTlsFiles};

/// The flags as given.
#[derive(Debug, clap::Args)]
pub struct PeerFlags {
    /// Removed: replicas find each other through --registry now
    /// (docs/tunnels.md, "Several replicas").
    #[arg(long, hide = true, value_name = "HOST:PORT", env = "PORTCULLIS_PEERS")]
    pub peers: Option<String>,
    /// The registry replicas share, so that a public request for a
    /// runtime held by another replica goes there:
    /// `redis://[USER@]HOST:PORT[/DB]`, or `rediss://` for TLS. The
    /// password comes from --registry-password-file or
    /// PORTCULLIS_REGISTRY_PASSWORD, never from the URL.
    #[arg(long, value_name = "URL", env = "PORTCULLIS_REGISTRY")]
    pub registry: Option<String>,
    /// The CA (PEM) that signs the registry's certificate (rediss://);
    /// default: the system's roots.
    #[arg(
        long,
        value_name = "FILE",
        env = "PORTCULLIS_REGISTRY_CA",
        requires = "registry"
    )]
    pub registry_ca: Option<PathBuf>,
    /// File holding the registry's password (a mounted Secret).
    #[arg(
        long,
        value_name = "FILE",
        env = "PORTCULLIS_REGISTRY_PASSWORD_FILE",
        requires = "registry"
    )]
    pub registry_password_file: Option<PathBuf>,
    /// Where peers forward requests to this server (HTTP/2
    /// authenticated by the peer token; cleartext unless --peer-cert
    /// is given: then keep it on the cluster network).
    #[arg(
        long,
        value_name = "ADDR",
        env = "PORTCULLIS_PEER_LISTEN",
        requires = "registry"
    )]
    pub peer_listen: Option<std::net::SocketAddr>,
    /// Where peers reach --peer-listen, published in the registry;
    /// default: $POD_IP with --peer-listen's port, or --peer-listen
    /// itself when it names an address.
    #[arg(
        long,
        value_name = "HOST:PORT",
        env = "PORTCULLIS_PEER_ADVERTISE",
        requires = "registry"
    )]
    pub peer_advertise: Option<String>,
    /// File holding the token all peers share (a mounted Secret, at
    /// least 16 characters); otherwise PORTCULLIS_PEER_TOKEN.
    #[arg(long, value_name = "FILE", env = "PORTCULLIS_PEER_TOKEN_FILE")]
    pub peer_token_file: Option<PathBuf>,
    /// Mutual TLS between peers: this server's certificate (PEM chain),
    /// served on --peer-listen and presented when dialling a peer. It
    /// must name the host of --peer-advertise.
    /// Renewed files are used from the next handshake on.
    #[arg(long, value_name = "FILE", env = "PORTCULLIS_PEER_CERT", requires_all = ["peer_key", "peer_ca"])]
    pub peer_cert: Option<PathBuf>,
    /// The key of --peer-cert.
    #[arg(long, value_name = "FILE", env = "PORTCULLIS_PEER_KEY", requires_all = ["peer_cert", "peer_ca"])]
    pub peer_key: Option<PathBuf>,
    /// The CA every peer's certificate chains to: a peer connection
    /// without one (either way) fails its handshake.
    #[arg(long, value_name = "FILE", env = "PORTCULLIS_PEER_CA", requires_all = ["peer_cert", "peer_key"])]
    pub peer_ca: Option<PathBuf>,
}

/// A secret from `file`, or else from the environment variable `env`.
pub(crate) fn secret(
    file: Option<PathBuf>,
    env: &str,
    what: &str,
) -> Result<Option<String>, String> {
    match file {
        Some(file) => {
            portcullis_net::files::read_bounded_text(&file, portcullis_net::files::SMALL_LIMIT)
                .map(|s| Some(s.trim().to_owned()))
                .map_err(|e| format!("cannot read the {what} file {}: {e}", file.display()))
        }
        None => Ok(std::env::var(env).ok().filter(|s| !s.is_empty())),
    }
}

/// Where peers reach `listen`: `advertise` when given, else `$POD_IP`
/// (`pod_ip`) with its port, else `listen` itself when it names an
/// address.
fn advertised(
    listen: SocketAddr,
    advertise: Option<String>,
    pod_ip: Option<String>,
) -> Result<String, String> {
    if let Some(advertise) = advertise {
        return match advertise.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(advertise),
            _ => Err(format!("--peer-advertise {advertise:?} is not HOST:PORT")),
        };
    }
    if let Some(ip) = pod_ip.filter(|ip| !ip.is_empty()) {
        let ip: std::net::IpAddr = ip
            .parse()
            .map_err(|_| format!("POD_IP {ip:?} is not an IP address"))?;
        return Ok(SocketAddr::new(ip, listen.port()).to_string());
    }
    if listen.ip().is_unspecified() {
        return Err(format!(
            "--peer-listen {listen} does not say where peers reach this server: give --peer-advertise HOST:PORT (or set POD_IP)"
        ));
    }
    Ok(listen.to_string())
}

impl PeerFlags {
    /// The peer options, `None` for a server running alone; an error
    /// says which flag is wrong.
    pub fn options(self) -> Result<Option<PeerOptions>, String> {
        if self.peers.is_some() {
            return Err("--peers was removed: replicas share a registry now (--registry redis://HOST:PORT with --peer-listen); see docs/tunnels.md, \"Several replicas\"".into());
        }
        let Some(url) = self.registry else {
            if self.peer_cert.is_some() || self.peer_token_file.is_some() {
                return Err("--peer-cert and --peer-token-file are for replicas: give --registry and --peer-listen too".into());
            }
            return Ok(None);
        };
        let listen = self
            .peer_listen
            .ok_or("--registry needs --peer-listen: where peers forward requests to this server")?;
        let password = secret(
            self.registry_password_file,
            "PORTCULLIS_REGISTRY_PASSWORD",
            "registry password",
        )?;
        let registry = RedisTarget::new("--registry", &url, self.registry_ca, password)?;
        let token = secret(self.peer_token_file, "PORTCULLIS_PEER_TOKEN", "peer token")?
            .ok_or("--registry needs the peers' token: give --peer-token-file FILE or set PORTCULLIS_PEER_TOKEN")?;
        let tls = match (self.peer_cert, self.peer_key, self.peer_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(PeerTlsFiles { cert, key, ca }),
            _ => None,
        };
        let advertise = advertised(listen, self.peer_advertise, std::env::var("POD_IP").ok())?;
        Ok(Some(PeerOptions {
            listen,
            advertise,
            registry,
            token,
            tls,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advertised_address_comes_from_the_flag_the_pod_or_the_listener() {
        let any: SocketAddr = "0.0.0.0:7946".parse().unwrap();
        let own: SocketAddr = "10.1.2.3:7946".parse().unwrap();
        assert_eq!(
            advertised(
                any,
                Some("peer-0.tunnel:7946".into()),
                Some("10.9.9.9".into())
            )
            .unwrap(),
            "peer-0.tunnel:7946"
        );
        assert_eq!(
            advertised(any, None, Some("10.9.9.9".into())).unwrap(),
            "10.9.9.9:7946"
        );
        assert_eq!(
            advertised(any, None, Some("fd00::9".into())).unwrap(),
            "[fd00::9]:7946"
        );
        assert_eq!(advertised(own, None, None).unwrap(), "10.1.2.3:7946");
        let e = advertised(any, None, None).unwrap_err();
        assert!(e.contains("--peer-advertise"), "{e}");
        let e = advertised(any, Some("no-port".into()), None).unwrap_err();
        assert!(e.contains("HOST:PORT"), "{e}");
    }
}
