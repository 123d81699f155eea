//! Reading and writing a proxy-wasm guest's memory from a host call:
//! bounds-checked slices, and results handed over in memory the guest
//! allocates (`proxy_on_memory_allocate`, or `malloc` for SDKs that
//! export that), as the ABI's `return_*` pointers expect.

use wasmtime::{Caller, Extern, Memory, TypedFunc};

use super::VmState;

/// The ABI's status codes, as Envoy returns them (the SDKs panic on any
/// other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
}

/// The guest's memory and allocator, found by name once per VM (a host
/// call looking them up by name each time cost ~1,500 instructions).
#[derive(Clone, Default)]
pub struct Exports {
    memory: Option<Memory>,
    alloc: Option<TypedFunc<i32, i32>>,
}

impl Exports {
    /// What `instance` exports.
    pub fn of(instance: &wasmtime::Instance, store: &mut wasmtime::Store<VmState>) -> Exports {
        let memory = instance.get_memory(&mut *store, "memory");
        let alloc = ["proxy_on_memory_allocate", "malloc"]
            .into_iter()
            .find_map(|name| instance.get_typed_func::<i32, i32>(&mut *store, name).ok());
        Exports { memory, alloc }
    }
}

fn memory(caller: &mut Caller<'_, VmState>) -> wasmtime::Result<Memory> {
    if let Some(m) = caller.data().exports.memory {
        return Ok(m);
    }
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => wasmtime::bail!("the module exports no memory"),
    }
}

/// `len` bytes at `ptr`, copied out.
pub fn read(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> wasmtime::Result<Vec<u8>> {
    let mem = memory(caller)?;
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    match mem.data(&caller).get(ptr..ptr.saturating_add(len)) {
        Some(bytes) => Ok(bytes.to_vec()),
        None => wasmtime::bail!("a host call was given memory out of bounds"),
    }
}

/// `f` of the `len` bytes at `ptr`, read in place (not copied out), and
/// of the VM's state.
pub fn viewed<R>(
    caller: &mut Caller<'_, VmState>,
    (ptr, len): (i32, i32),
    f: impl FnOnce(&[u8], &mut VmState) -> R,
) -> wasmtime::Result<R> {
    let mem = memory(caller)?;
    let (data, state) = mem.data_and_store_mut(caller);
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    match data.get(ptr..ptr.saturating_add(len)) {
        Some(bytes) => Ok(f(bytes, state)),
        None => wasmtime::bail!("a host call was given memory out of bounds"),
    }
}

/// Writes `bytes` at `ptr`.
pub fn write(caller: &mut Caller<'_, VmState>, ptr: i32, bytes: &[u8]) -> wasmtime::Result<()> {
    let mem = memory(caller)?;
    copy_in(mem.data_mut(caller), ptr, bytes)
}

/// Copies `bytes` into the guest's memory `data` at `ptr`.
fn copy_in(data: &mut [u8], ptr: i32, bytes: &[u8]) -> wasmtime::Result<()> {
    let ptr = ptr as u32 as usize;
    match data.get_mut(ptr..ptr.saturating_add(bytes.len())) {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            Ok(())
        }
        None => wasmtime::bail!("a host call was given memory out of bounds"),
    }
}

/// Writes a 32-bit word at `ptr`.
pub fn write_u32(caller: &mut Caller<'_, VmState>, ptr: i32, value: u32) -> wasmtime::Result<()> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Hands `bytes` to the guest: allocated by its allocator, the address
/// and length written at `ret_ptr` and `ret_len`.
pub fn give(
    caller: &mut Caller<'_, VmState>,
    bytes: &[u8],
    (ret_ptr, ret_len): (i32, i32),
) -> wasmtime::Result<i32> {
    // Taken for the call and put back, not cloned: a clone copies its
    // registered type (~100 instructions a host call that gives).
    let at = match caller.data_mut().exports.alloc.take() {
        Some(alloc) => {
            let at = alloc.call(&mut *caller, bytes.len() as i32);
            caller.data_mut().exports.alloc = Some(alloc);
            at?
        }
        None => ["proxy_on_memory_allocate", "malloc"]
            .into_iter()
            .find_map(|name| caller.get_export(name).and_then(Extern::into_func))
            .ok_or_else(|| {
                wasmtime::format_err!(
                    "the module exports no allocator (proxy_on_memory_allocate or malloc)"
                )
            })?
            .typed::<i32, i32>(&*caller)?
            .call(&mut *caller, bytes.len() as i32)?,
    };
    if at == 0 && !bytes.is_empty() {
        wasmtime::bail!(
            "the module's allocator returned null for {} bytes",
            bytes.len()
        );
    }
    // The three writes on one borrow of the memory.
    let mem = memory(caller)?;
    let data = mem.data_mut(caller);
    copy_in(data, at, bytes)?;
    copy_in(data, ret_ptr, &(at as u32).to_le_bytes())?;
    copy_in(data, ret_len, &(bytes.len() as u32).to_le_bytes())?;
    Ok(Status::Ok as i32)
}
