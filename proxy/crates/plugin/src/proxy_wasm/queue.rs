//! Shared queues, as in Envoy: a VM registers a queue by name (its root
//! context is then told of what arrives, `proxy_on_queue_ready`, called
//! soon after on the VM's worker); any VM resolves it by name, enqueues,
//! and dequeues. One set of queues for the process, keyed as Envoy keys
//! them by VM id (always `""` here) and name; a later registration of a
//! name takes its notices over, as in Envoy.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, OnceLock, Weak};

use bytes::Bytes;
use wasmtime::{Caller, Linker};

use super::guest::{Status, give, read, write_u32};
use super::{ProxyWasm, VmState};

/// Status codes only these calls return.
const EMPTY: i32 = 7;
const INTERNAL_FAILURE: i32 = 10;

/// What a queue may hold in all: an enqueuer with no dequeuer fails its
/// calls instead of growing the proxy.
const MAX_QUEUED_BYTES: usize = 16 << 20;

/// The VM a call runs on: its use, worker shard and generation.
#[derive(Clone)]
pub struct Home {
    pub filter: Weak<ProxyWasm>,
    pub shard: usize,
    pub generation: u64,
}

struct Queue {
    items: VecDeque<Bytes>,
    bytes: usize,
    /// The VM that registered it last: told when an item arrives.
    owner: Home,
}

#[derive(Default)]
struct Queues {
    /// By token - 1.
    queues: Vec<Queue>,
    tokens: HashMap<(Vec<u8>, Vec<u8>), u32>,
}

fn queues() -> &'static Mutex<Queues> {
    static QUEUES: OnceLock<Mutex<Queues>> = OnceLock::new();
    QUEUES.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, Queues> {
    queues().lock().unwrap_or_else(|p| p.into_inner())
}

/// Adds the queue calls to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    type C<'a> = Caller<'a, VmState>;
    type R = wasmtime::Result<i32>;
    linker.func_wrap(
        "env",
        "proxy_register_shared_queue",
        |mut c: C<'_>, name_ptr: i32, name_len: i32, ret_token: i32| -> R {
            let name = read(&mut c, name_ptr, name_len)?;
            let owner = c.data().home.clone();
            let token = {
                let mut q = lock();
                match q.tokens.get(&(Vec::new(), name.clone())) {
                    Some(&token) => {
                        q.queues[token as usize - 1].owner = owner;
                        token
                    }
                    None => {
                        q.queues.push(Queue {
                            items: VecDeque::new(),
                            bytes: 0,
                            owner,
                        });
                        let token = q.queues.len() as u32;
                        q.tokens.insert((Vec::new(), name), token);
                        token
                    }
                }
            };
            write_u32(&mut c, ret_token, token)?;
            Ok(Status::Ok as i32)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_resolve_shared_queue",
        |mut c: C<'_>, vm_ptr: i32, vm_len: i32, name_ptr: i32, name_len: i32, ret: i32| -> R {
            let vm_id = read(&mut c, vm_ptr, vm_len)?;
            let name = read(&mut c, name_ptr, name_len)?;
            let token = lock().tokens.get(&(vm_id, name)).copied();
            let Some(token) = token else {
                return Ok(Status::NotFound as i32);
            };
            write_u32(&mut c, ret, token)?;
            Ok(Status::Ok as i32)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_enqueue_shared_queue",
        |mut c: C<'_>, token: i32, ptr: i32, len: i32| -> R {
            let data = Bytes::from(read(&mut c, ptr, len)?);
            let owner = {
                let mut q = lock();
                let Some(queue) = q.queues.get_mut((token as u32 as usize).wrapping_sub(1)) else {
                    return Ok(Status::NotFound as i32);
                };
                if queue.bytes + data.len() > MAX_QUEUED_BYTES {
                    return Ok(INTERNAL_FAILURE);
                }
                queue.bytes += data.len();
                queue.items.push_back(data);
                queue.owner.clone()
            };
            notify(owner, token as u32);
            Ok(Status::Ok as i32)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_dequeue_shared_queue",
        |mut c: C<'_>, token: i32, ret_ptr: i32, ret_len: i32| -> R {
            let item = {
                let mut q = lock();
                let Some(queue) = q.queues.get_mut((token as u32 as usize).wrapping_sub(1)) else {
                    return Ok(Status::NotFound as i32);
                };
                let item = queue.items.pop_front();
                queue.bytes -= item.as_ref().map_or(0, Bytes::len);
                item
            };
            match item {
                None => Ok(EMPTY),
                Some(item) if item.is_empty() => Ok(Status::Ok as i32),
                Some(item) => give(&mut c, &item, (ret_ptr, ret_len)),
            }
        },
    )?;
    Ok(())
}

/// Tells the queue's owner that `token` has an item, soon after and on
/// its own (the enqueuer may be that VM, in a call now).
fn notify(owner: Home, token: u32) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let Some(filter) = owner.filter.upgrade() else {
            return;
        };
        filter.on_home(&owner, |vm, filter| vm.queue_ready(filter, token));
    });
}
