//! The registry of runtimes in Redis: what this server holds, published;
//! what the others hold, followed.
//!
//! Keys, all under one hash tag so that the scripts run on Redis Cluster:
//! - `{portcullis-tunnels}:holders`, a hash from `runtime\nserver` to the
//!   holding's JSON ([`Holding`]);
//! - `{portcullis-tunnels}:server:<instance>`, a server's lease: its
//!   advertised address, expiring after [`LEASE`] unless renewed (every
//!   [`RENEW`]). The lease is per server, not per runtime, so the steady
//!   commands per second do not grow with the runtimes held.
//!
//! Every change to the hash is published on `{portcullis-tunnels}:events`
//! in the same transaction (`+runtime\nserver\njson`, `-runtime\nserver`),
//! so every server applies it to its map as soon as Redis has it. A
//! server whose lease ended (it crashed) has its entries deleted by the
//! first other server that notices, by a script that first checks the
//! lease is still gone. After any lost connection a server subscribes
//! again, then reloads the whole hash: a missed message never leaves a
//! stale map.
//!
//! A lease can also go while its server lives: Redis lost its data
//! (restarted without persistence, `FLUSHALL`), or the server was cut
//! off from Redis for longer than a lease. Its runtimes are then not
//! forgotten while it is alive (a link to it is up, or it answers a
//! dial): they are carried until it publishes them again, which it does
//! within a second of noticing its lease had gone.

use std::collections::HashSet;

use futures_util::StreamExt;
use serde::Deserialize;

use super::*;

/// How long a server's entries outlive its last renewal.
const LEASE: Duration = Duration::from_secs(5);
/// How often a server renews its lease and looks for expired ones.
const RENEW: Duration = Duration::from_secs(1);
/// Reconnection backoff bounds.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A session that lasted this long starts the next backoff from scratch.
const STEADY: Duration = Duration::from_secs(10);

const HOLDERS: &str = "{portcullis-tunnels}:holders";
const EVENTS: &str = "{portcullis-tunnels}:events";

fn lease_key(server: &str) -> String {
    format!("{{portcullis-tunnels}}:server:{server}")
}

fn field(runtime: &str, server: &str) -> String {
    format!("{runtime}\n{server}")
}

/// Deletes an expired server's entries, publishing each deletion, unless
/// its lease came back (it reconnected) since it was found gone.
const EXPIRE: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local suffix = '\n' .. ARGV[2]
local gone = 0
for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(field, -#suffix) == suffix then
    redis.call('HDEL', KEYS[2], field)
    redis.call('PUBLISH', ARGV[1], '-' .. field)
    gone = gone + 1
  end
end
return gone
";

/// What a server publishes of a runtime it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    /// The client instance whose tunnels it holds.
    pub client: String,
    /// Its tunnel connections there.
    pub conns: usize,
    /// Held since, Unix milliseconds.
    pub since: u64,
    /// The holder's advertised peer address.
    pub addr: String,
}

/// A runtime this server holds.
pub struct Held {
    pub runtime: String,
    pub client: String,
    pub conns: usize,
    pub since: SystemTime,
}

/// This server's side: what it holds, when that changes, and how to close
/// its tunnels of a runtime that a newer client holds elsewhere.
pub trait Local: Send + Sync + 'static {
    /// Told whenever what it holds changes.
    fn changed(&self) -> &tokio::sync::Notify;
    /// The runtimes it holds now.
    fn held(&self) -> Vec<Held>;
    /// `newer`, a client instance, holds `runtime` elsewhere: closes this
    /// server's tunnels of an older instance.
    fn superseded(&self, runtime: &str, newer: &str);
}

fn redis_error(e: redis::RedisError) -> String {
    e.to_string()
}

/// Keeps this server's entries in the registry and its map of the others'
/// up to date until `stop`, reconnecting with backoff when Redis goes.
pub(crate) async fn run(peers: Arc<Peers>, local: Arc<dyn Local>, stop: CancellationToken) {
    let mut backoff = MIN_BACKOFF;
    let mut last_error = String::new();
    loop {
        let began = Instant::now();
        let Err(e) = session(&peers, &*local, &stop).await else {
            return;
        };
        if peers.registry().up {
            tracing::warn!(registry = %peers.registry.url, error = %e, "registry lost: serving this server's runtimes and forwarding by the last known map; reconnecting");
        } else if e != last_error {
            tracing::warn!(registry = %peers.registry.url, error = %e, "cannot reach the registry; retrying");
        }
        last_error.clone_from(&e);
        peers.registry_state(Some(e));
        if began.elapsed() > STEADY {
            backoff = MIN_BACKOFF;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One connection's worth: subscribe, load, then follow until it breaks.
async fn session(peers: &Peers, local: &dyn Local, stop: &CancellationToken) -> Result<(), String> {
    let client = peers.registry.client()?;
    let config = portcullis_net::redis_target::RedisTarget::connection_config();
    let connect = async {
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(EVENTS).await?;
        Ok::<_, redis::RedisError>((conn, pubsub))
    };
    let timeout = portcullis_net::redis_target::CONNECT_TIMEOUT * 2;
    let (mut conn, pubsub) = tokio::time::timeout(timeout, connect)
        .await
        .map_err(|_| format!("no connection within {timeout:?}"))?
        .map_err(redis_error)?;
    let mut events = pubsub.into_on_message();
    let expire = redis::Script::new(EXPIRE);
    let mut published = HashMap::new();
    // The lease before any entry: entries never outlive their server.
    renew(&mut conn, peers).await?;
    load(&mut conn, peers, local, &expire, &mut published).await?;
    peers.registry_state(None);
    tracing::info!(registry = %peers.registry.url, peers = peers.servers().len(), "registry connected");
    reconcile(&mut conn, peers, local, &mut published).await?;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + RENEW, RENEW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => {
                withdraw(&mut conn, peers, &published).await;
                return Ok(());
            }
            msg = events.next() => {
                let Some(msg) = msg else {
                    return Err("the subscription ended".to_owned());
                };
                apply(peers, local, &msg);
            }
            _ = local.changed().notified() => reconcile(&mut conn, peers, local, &mut published).await?,
            _ = tick.tick() => {
                if !renew(&mut conn, peers).await? {
                    // The lease had ended (a long pause, or Redis lost its
                    // data): others may have deleted entries. Start over.
                    tracing::warn!(registry = %peers.registry.url, "this server's registry lease had ended; publishing its runtimes again");
                    load(&mut conn, peers, local, &expire, &mut published).await?;
                    reconcile(&mut conn, peers, local, &mut published).await?;
                }
                let servers = peers.servers();
                for gone in dead_servers(&mut conn, servers).await? {
                    // A lease can go with the server alive (Redis lost its
                    // data; the server was cut off from Redis for a
                    // while): its runtimes stay while it answers.
                    if super::alive(peers, &gone).await {
                        if peers.carry(&gone) {
                            tracing::info!(peer = %gone, "peer's registry lease is gone but it answers; its runtimes are kept until it publishes them again");
                        }
                        continue;
                    }
                    expire_server(&mut conn, &expire, &gone).await?;
                    peers.forget(&gone);
                }
                settle_carried(&mut conn, peers).await?;
            }
        }
    }
}

/// Settles the carried holdings whose time ran out by what the registry
/// lists now (see `Peers::settle`).
async fn settle_carried(
    conn: &mut redis::aio::MultiplexedConnection,
    peers: &Peers,
) -> Result<(), String> {
    let due = peers.carried_due();
    if due.is_empty() {
        return Ok(());
    }
    let fields: Vec<String> = due.iter().map(|(s, r)| field(r, s)).collect();
    let listed: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(HOLDERS)
        .arg(fields)
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    for ((server, runtime), listed) in due.iter().zip(listed) {
        peers.settle(server, runtime, listed.is_some());
    }
    Ok(())
}

/// Renews this server's lease; whether it was still there.
async fn renew(
    conn: &mut redis::aio::MultiplexedConnection,
    peers: &Peers,
) -> Result<bool, String> {
    let previous: Option<String> = redis::cmd("SET")
        .arg(lease_key(&peers.instance))
        .arg(&peers.advertise)
        .arg("PX")
        .arg(LEASE.as_millis() as u64)
        .arg("GET")
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    Ok(previous.is_some())
}

/// Which of `servers` have no lease any more.
async fn dead_servers(
    conn: &mut redis::aio::MultiplexedConnection,
    servers: Vec<String>,
) -> Result<Vec<String>, String> {
    if servers.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = servers.iter().map(|s| lease_key(s)).collect();
    let leases: Vec<Option<String>> = redis::cmd("MGET")
        .arg(keys)
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    Ok(servers
        .into_iter()
        .zip(leases)
        .filter_map(|(server, lease)| lease.is_none().then_some(server))
        .collect())
}

/// Deletes a server's entries once its lease is gone.
async fn expire_server(
    conn: &mut redis::aio::MultiplexedConnection,
    expire: &redis::Script,
    server: &str,
) -> Result<(), String> {
    let gone: u64 = expire
        .key(lease_key(server))
        .key(HOLDERS)
        .arg(EVENTS)
        .arg(server)
        .invoke_async(conn)
        .await
        .map_err(redis_error)?;
    if gone > 0 {
        tracing::info!(
            peer = server,
            runtimes = gone,
            "peer's registry lease ended; its runtimes are no longer forwarded to it"
        );
    }
    Ok(())
}

/// Loads the whole registry: the others' holdings into the map (those of
/// servers whose lease ended deleted), this server's into `published`.
async fn load(
    conn: &mut redis::aio::MultiplexedConnection,
    peers: &Peers,
    local: &dyn Local,
    expire: &redis::Script,
    published: &mut HashMap<String, Holding>,
) -> Result<(), String> {
    let all: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(HOLDERS)
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    published.clear();
    let mut others = Vec::new();
    for (field, json) in all {
        let Some((runtime, server)) = field.split_once('\n') else {
            continue;
        };
        let Ok(holding) = serde_json::from_str::<Holding>(&json) else {
            tracing::warn!(field, "registry entry is not a holding; ignored");
            continue;
        };
        if server == peers.instance {
            published.insert(runtime.to_owned(), holding);
        } else {
            others.push((server.to_owned(), runtime.to_owned(), holding));
        }
    }
    let servers: HashSet<String> = others.iter().map(|(s, _, _)| s.clone()).collect();
    let mut dead = HashSet::new();
    for server in dead_servers(conn, servers.iter().cloned().collect()).await? {
        if !super::alive(peers, &server).await {
            expire_server(conn, expire, &server).await?;
            dead.insert(server);
        }
    }
    others.retain(|(server, _, _)| !dead.contains(server));
    for (_, runtime, holding) in &others {
        local.superseded(runtime, &holding.client);
    }
    // Servers known before that the registry no longer shows (it lost
    // its data, or their entries expired while they were cut off): what
    // they held is carried while they are alive, until they publish it
    // again.
    let mut alive = HashSet::new();
    for server in peers.servers().into_iter().filter(|s| !servers.contains(s)) {
        if super::alive(peers, &server).await {
            alive.insert(server);
        }
    }
    peers.replace(others, &alive);
    Ok(())
}

/// Applies one published change to the map.
fn apply(peers: &Peers, local: &dyn Local, msg: &redis::Msg) {
    let Ok(payload) = msg.get_payload::<String>() else {
        return;
    };
    let (op, rest) = payload.split_at_checked(1).unwrap_or(("", ""));
    let mut parts = rest.splitn(3, '\n');
    let (Some(runtime), Some(server)) = (parts.next(), parts.next()) else {
        return;
    };
    if server == peers.instance {
        return;
    }
    match (op, parts.next()) {
        ("+", Some(json)) => match serde_json::from_str::<Holding>(json) {
            Ok(holding) => {
                local.superseded(runtime, &holding.client);
                peers.held(server.to_owned(), runtime.to_owned(), holding);
            }
            Err(e) => tracing::warn!(error = %e, "registry event is not a holding; ignored"),
        },
        ("-", None) => peers.released(server, runtime),
        _ => tracing::debug!(payload, "unknown registry event; ignored"),
    }
}

/// Publishes what changed in this server's holdings since `published`,
/// in one transaction: a burst of tunnels (a reconnect storm) is one
/// round trip, whatever its size.
async fn reconcile(
    conn: &mut redis::aio::MultiplexedConnection,
    peers: &Peers,
    local: &dyn Local,
    published: &mut HashMap<String, Holding>,
) -> Result<(), String> {
    let desired: HashMap<String, Holding> = local
        .held()
        .into_iter()
        .map(|h| {
            let since = h
                .since
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let holding = Holding {
                client: h.client,
                conns: h.conns,
                since,
                addr: peers.advertise.clone(),
            };
            (h.runtime, holding)
        })
        .collect();
    let mut pipe = redis::pipe();
    pipe.atomic();
    let mut changes = 0;
    for (runtime, holding) in &desired {
        if published.get(runtime) != Some(holding) {
            let field = field(runtime, &peers.instance);
            let json = serde_json::to_string(holding).unwrap_or_default();
            pipe.hset(HOLDERS, &field, &json).ignore();
            pipe.publish(EVENTS, format!("+{field}\n{json}")).ignore();
            changes += 1;
        }
    }
    for runtime in published.keys().filter(|r| !desired.contains_key(*r)) {
        let field = field(runtime, &peers.instance);
        pipe.hdel(HOLDERS, &field).ignore();
        pipe.publish(EVENTS, format!("-{field}")).ignore();
        changes += 1;
    }
    if changes > 0 {
        pipe.query_async::<()>(conn).await.map_err(redis_error)?;
    }
    *published = desired;
    Ok(())
}

/// On a clean stop: this server's entries and lease deleted, so peers
/// stop forwarding to it at once rather than after the lease.
async fn withdraw(
    conn: &mut redis::aio::MultiplexedConnection,
    peers: &Peers,
    published: &HashMap<String, Holding>,
) {
    let mut pipe = redis::pipe();
    pipe.atomic();
    for runtime in published.keys() {
        let field = field(runtime, &peers.instance);
        pipe.hdel(HOLDERS, &field).ignore();
        pipe.publish(EVENTS, format!("-{field}")).ignore();
    }
    pipe.del(lease_key(&peers.instance)).ignore();
    if let Err(e) = pipe.query_async::<()>(conn).await {
        tracing::warn!(registry = %peers.registry.url, error = %e, "cannot withdraw from the registry; peers forget this server when its lease ends");
    }
}
