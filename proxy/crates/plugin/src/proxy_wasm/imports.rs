//! What a filter may import: the proxy-wasm ABI's calls (`env::proxy_*`)
//! and WASI preview 1's. Every such import is first defined as a stand-in
//! (below); the host's own calls, added after with shadowing allowed,
//! replace those it offers. Any other import is left undefined, so
//! linking refuses the module naming it (and `check` reports it).
//!
//! A stand-in for an ABI call fails its request naming the call (the
//! SDKs import the whole ABI, and most filters call a handful of it). A
//! stand-in for a WASI call answers an error, as a sandbox with no files,
//! sockets or processes answers (`EBADF` for a descriptor or a path,
//! `ENOSYS` for the rest): Go's `wasip1` runtime, among others, makes
//! such calls while it starts and carries on when they fail, and a trap
//! there refused every Go filter at load.

use wasmtime::{Linker, Val, ValType};

use super::VmState;

/// WASI's `errno` values the stand-ins answer.
const BADF: i32 = 8;
const NOSYS: i32 = 52;

/// Defines a stand-in for every ABI and WASI call `module` imports.
pub fn stub_imports(
    linker: &mut Linker<VmState>,
    module: &wasmtime::Module,
) -> wasmtime::Result<()> {
    for import in module.imports() {
        let (m, name) = (import.module(), import.name());
        let wasmtime::ExternType::Func(ty) = import.ty() else {
            continue;
        };
        let wasi = m == "wasi_snapshot_preview1";
        let abi = m == "env" && name.starts_with("proxy_");
        let returns_errno =
            ty.results().len() == 1 && matches!(ty.results().next(), Some(ValType::I32));
        if wasi && returns_errno {
            let errno = if name.starts_with("fd_") || name.starts_with("path_") {
                BADF
            } else {
                NOSYS
            };
            linker.func_new(m, name, ty, move |_, _, out: &mut [Val]| {
                out[0] = Val::I32(errno);
                Ok(())
            })?;
            continue;
        }
        if !abi && !wasi {
            continue;
        }
        let what = format!("{m}::{name}");
        linker.func_new(m, name, ty, move |_, _, _| {
            wasmtime::bail!(
                "the plugin called {what}, which this proxy-wasm host does not offer yet"
            )
        })?;
    }
    Ok(())
}
