//! The network layer under everything else: listening sockets and
//! spreading connections over the workers, the PROXY protocol, TLS on a
//! listening port and the certificates it serves, connection plumbing
//! (HTTP/1 or HTTP/2, the request head's deadline, lingering close,
//! graceful drain), dialing and host lookups, and a few small utilities.
//!
//! It knows nothing of policies or requests' routes: every other crate
//! of the proxy may use it, and it uses none of them.

pub mod balance;
pub mod cert_expiry;
pub mod cert_files;
pub mod cert_identity;
pub mod client_addr;
pub mod client_cert;
pub mod client_tls;
pub mod coarse_clock;
pub mod der;
pub mod drain;
pub mod files;
pub mod framing;
pub mod h1_or_h2;
pub mod handshake_head;
pub mod head_deadline;
pub mod linger;
pub mod pem;
pub mod proxy_protocol;
pub mod redis_target;
pub mod request_key;
pub mod resolve;
pub mod shard;
pub mod shared_dial;
pub mod sockets;
pub mod ticket_keys;
pub mod tls_errors;
pub mod tls_listen;
pub mod tls_live;
pub mod unparsed_head;
pub mod worker_beat;
pub mod worker_idle;
