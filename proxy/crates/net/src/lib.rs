//! The network layer under everything else: listening sockets and
//! spreading connections over the workers, the PROXY protocol, TLS on a
//! listening port and the certificates it serves, connection plumbing
//! (HTTP/1 or HTTP/2, the request head's deadline, lingering close,
//! graceful drain), dialing and host lookups, and a few small utilities.
//!
//! It knows nothing of policies or requests' routes: every other crate
//! of the proxy may use it, and it uses none of them.

// Public: the workers' connection counts and pick, for the routing core's and
// the tunnel server's listeners (http, tunnel).
pub mod balance;
// Public: reading a certificate's expiry, for its fuzz target.
pub mod cert_expiry;
// Public: certificate and key files watched and loaded, for listeners and
// their checks (config, http, tunnel).
pub mod cert_files;
// Public: a certificate's names, for its fuzz target.
pub mod cert_identity;
// Public: the client address behind a trusted proxy, for the request path and
// the access log (http, obs).
pub mod client_addr;
// Public: a client certificate's facts, for the request path, the log and
// plugins (http, obs, plugin).
pub mod client_cert;
// Public: the TLS client configuration upstreams and registries share (http,
// oci).
pub mod client_tls;
// Public: the cheap clock of the request path's deadlines (http).
pub mod coarse_clock;
// Public: long waits kept by a worker's list and its anchor tick, for the
// upstream exchange's timeout (forward, http).
pub mod coarse_deadline;
// Public: the DER reader, for its fuzz target.
pub mod der;
// Public: graceful drain of connections, for both kinds of server (http,
// tunnel).
pub mod drain;
// Public: a connection's field names kept parsed from one head to the
// next, for the heads the forwarding reads and the server codec's (forward).
pub mod field_names;
// Public: the forwarding fields a request still lacks, made and written by
// the forwarding, added to the map a plugin reads (forward, plugin, http).
pub mod forwarded_fields;
// Public: reading files with errors that name them, for the binary, the
// config, logs and tunnel tokens (bin, config, obs, tunnel).
pub mod files;
// Public: the names of framing fields nothing may set, for policies, plugins
// and the forwarding (config, http, plugin; fuzz).
pub mod framing;
// Public: serving HTTP/1.1 or HTTP/2 on one connection, for both kinds of
// server and the admin listener (http, obs, tunnel).
pub mod h1_or_h2;
// Public: an HTTP/1.1 request's head and body framing as the server
// codec of our own reads them (#66), fuzzed before it serves (fuzz).
pub mod h1_request;
// Public: an HTTP/1.1 response head as the server codec of our own
// writes it (#66), held to hyper's bytes by its tests (fuzz).
pub mod h1_response;
// The server codec of our own's connection (#66): not serving yet, so only
// its tests use it; it becomes public when the listeners take it up.
#[cfg_attr(not(test), allow(dead_code))]
mod h1_server;
// Public: the tunnel handshake's head, for the tunnel server and its fuzz
// target (tunnel, fuzz).
pub mod handshake_head;
// Public: the request head's deadline, for both kinds of server (http,
// tunnel).
pub mod head_deadline;
// Public: lingering close after a refused body, for both kinds of server
// (http, tunnel).
pub mod linger;
// Public: PEM files read, for listeners' and tunnels' certificates (config,
// tunnel).
pub mod pem;
// Public: the PROXY protocol header, for the tunnel server and its fuzz target
// (tunnel, fuzz).
pub mod proxy_protocol;
// Public: a Redis address and its options, for the state store and the peer
// registry (bin, http, tunnel).
pub mod redis_target;
// Public: what a rate limit or cache keys a request on, for routes and plugins
// (http, plugin).
pub mod request_key;
// Public: host lookups of upstream endpoints (http).
pub mod resolve;
// Public: the worker a thread is, for state kept per worker (http, obs,
// plugin, tunnel).
pub mod shard;
// Public: dialing shared by upstreams and the tunnel (http, tunnel).
pub mod shared_dial;
// Public: listening sockets, one per worker, for every listener (http, obs,
// tunnel).
pub mod sockets;
// Public: a request's precise time stamps and durations (http, obs).
pub mod stamp;
// Public: TLS session ticket keys from files, for listeners' settings
// (config).
pub mod ticket_keys;
// Public: TLS handshake failures counted by kind, for both kinds of server
// (http, tunnel).
pub mod tls_errors;
// Public: a listener's TLS settings and handshake, for the config that checks
// them and the servers that use them (config, http, tunnel).
pub mod tls_listen;
// Public: a listener's live TLS state kept across reloads (config, http).
pub mod tls_live;
// Public: a request head hyper refused, answered (http).
pub mod unparsed_head;
// Public: workers' heartbeats for the watchdog (http, tunnel).
pub mod worker_beat;
// Public: the workers' runtime and what they do when idle, set by the binary
// (bin, http, tunnel).
pub mod worker_idle;
