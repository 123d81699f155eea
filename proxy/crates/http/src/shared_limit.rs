//! Rate limits counted across replicas: a route's `rate_limit` with
//! `shared: true`, when `serve --state redis://…` names a Redis.
//!
//! Each request runs one script in Redis: the same GCRA as the local
//! limit ([`crate::rate_limit`]), its cell a key of its own (route,
//! limit, and the client or header value), on Redis's clock so that the
//! replicas agree on "now". One round trip a request, not a budget
//! handed out in batches: a batch lets each replica overrun by what it
//! holds, which at the small rates people share (a login form's
//! `10/m`) is the whole limit; the round trip's cost is in
//! docs/benchmarks.md.
//!
//! No request waits on Redis for more than [`WAIT`]: slower, unreachable
//! or down, the replica counts the request against its own local limit
//! instead, and `/status` and `/metrics` say so.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwapOption;
use portcullis_net::redis_target::RedisTarget;

/// The longest a request waits for Redis's answer before its local limit
/// decides.
pub const WAIT: Duration = Duration::from_millis(5);
/// How often the connection is checked (PING), and the longest wait
/// between reconnection attempts.
const CHECK: Duration = Duration::from_secs(1);

/// The GCRA step: `KEYS[1]` the cell, `ARGV` the interval and tolerance
/// in microseconds. 0 when the request passes; otherwise how long until
/// one would, in microseconds.
const TAKE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval, tolerance = tonumber(ARGV[1]), tonumber(ARGV[2])
local due = tonumber(redis.call('GET', KEYS[1])) or now
if due < now then due = now end
if due - now > tolerance then return due - now - tolerance end
local next = due + interval
redis.call('SET', KEYS[1], string.format('%.0f', next), 'PX', math.floor((next - now) / 1000) + 1)
return 0
";

/// The process's connection to the state store.
pub struct SharedState {
    pub target: RedisTarget,
    conn: ArcSwapOption<redis::aio::MultiplexedConnection>,
    script: redis::Script,
    status: std::sync::Mutex<Status>,
    /// Requests counted in Redis.
    pub counted: AtomicU64,
    /// Requests of shared limits counted locally: Redis down, slow or
    /// failing.
    pub fell_back: AtomicU64,
}

/// Whether the store is reachable, as `/status` shows it.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub up: bool,
    pub since: Option<SystemTime>,
    pub error: Option<String>,
}

static STATE: OnceLock<SharedState> = OnceLock::new();

/// The state store, when `serve --state` named one.
pub fn state() -> Option<&'static SharedState> {
    STATE.get()
}

/// Sets the process's state store (once) and keeps its connection up
/// from the current runtime until the process ends.
pub fn connect(target: RedisTarget) -> Result<(), String> {
    target.client()?;
    let state = SharedState {
        target,
        conn: ArcSwapOption::empty(),
        script: redis::Script::new(TAKE),
        status: Default::default(),
        counted: AtomicU64::new(0),
        fell_back: AtomicU64::new(0),
    };
    STATE
        .set(state)
        .map_err(|_| "the state store is already set".to_owned())?;
    if let Some(state) = STATE.get() {
        tokio::spawn(state.keep_connected());
    }
    Ok(())
}

impl SharedState {
    fn set_status(&self, error: Option<String>) {
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let up = error.is_none();
        if status.up != up || status.since.is_none() {
            status.since = Some(SystemTime::now());
            match &error {
                None => {
                    tracing::info!(state = %self.target.url, "state store connected: shared rate limits are counted there")
                }
                Some(e) => {
                    tracing::warn!(state = %self.target.url, error = %e, "state store unreachable: shared rate limits fall back to each replica's own")
                }
            }
        }
        status.up = up;
        status.error = error;
    }

    /// The connection, while the store is reachable.
    pub fn connection(&self) -> Option<std::sync::Arc<redis::aio::MultiplexedConnection>> {
        self.conn.load_full()
    }

    /// The store's state for `/status`.
    pub fn status(&self) -> Status {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Connects, checks the connection every [`CHECK`], and reconnects
    /// when it fails; requests see no connection meanwhile and count
    /// locally.
    async fn keep_connected(&'static self) {
        loop {
            match self.open().await {
                Ok(conn) => {
                    self.conn.store(Some(std::sync::Arc::new(conn.clone())));
                    self.set_status(None);
                    let error = self.watch(conn).await;
                    self.conn.store(None);
                    self.set_status(Some(error));
                }
                Err(e) => self.set_status(Some(e)),
            }
            tokio::time::sleep(CHECK).await;
        }
    }

    async fn open(&self) -> Result<redis::aio::MultiplexedConnection, String> {
        let client = self.target.client()?;
        let config = RedisTarget::connection_config();
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| e.to_string())
    }

    /// PINGs until one fails; why.
    async fn watch(&self, mut conn: redis::aio::MultiplexedConnection) -> String {
        loop {
            tokio::time::sleep(CHECK).await;
            let ping = redis::cmd("PING");
            match tokio::time::timeout(CHECK, ping.query_async::<String>(&mut conn)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return e.to_string(),
                Err(_) => return format!("no answer to PING within {CHECK:?}"),
            }
        }
    }

    /// Takes one request from the shared cell `key` of a limit stepping
    /// `interval` with `tolerance`: `None` when Redis did not answer in
    /// [`WAIT`] (the caller's local limit decides).
    pub async fn take(
        &self,
        key: &[u8],
        (interval, tolerance): (Duration, Duration),
    ) -> Option<Result<(), Duration>> {
        let Some(conn) = self.conn.load_full() else {
            self.fell_back.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let mut conn = (*conn).clone();
        let mut invocation = self.script.key(key);
        invocation
            .arg(interval.as_micros().max(1) as u64)
            .arg(tolerance.as_micros() as u64);
        let asked = invocation.invoke_async::<u64>(&mut conn);
        match tokio::time::timeout(WAIT, asked).await {
            Ok(Ok(0)) => {
                self.counted.fetch_add(1, Ordering::Relaxed);
                Some(Ok(()))
            }
            Ok(Ok(wait_us)) => {
                self.counted.fetch_add(1, Ordering::Relaxed);
                Some(Err(Duration::from_micros(wait_us)))
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "shared rate limit: Redis failed; counted locally");
                self.fell_back.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(_) => {
                self.fell_back.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}
