//! What a filter may import: the proxy-wasm ABI's calls (`env::proxy_*`)
//! this host offers, and WASI preview 1's. Once the host's own calls are
//! defined, every import is looked at: a WASI call the host lacks gets a
//! stand-in (below); any other call the host lacks refuses the module at
//! load, naming each (`check` and a reload report them), so a filter
//! never learns on a request that a call is missing.
//!
//! A stand-in for a WASI call answers an error, as a sandbox with no
//! files, sockets or processes answers (`EBADF` for a descriptor or a
//! path, `ENOSYS` for the rest): Go's `wasip1` runtime, among others,
//! makes such calls while it starts and carries on when they fail, and a
//! trap there refused every Go filter at load. One with no result to
//! answer with (`proc_exit`) traps, naming the call.

use wasmtime::{Linker, Val, ValType};

use super::VmState;

/// WASI's `errno` values the stand-ins answer.
const BADF: i32 = 8;
const NOSYS: i32 = 52;

/// Defines a stand-in for every WASI call `module` imports that `linker`
/// lacks; the other calls it imports and `linker` lacks, by name, as the
/// error (none: every import is offered).
pub fn stand_ins(linker: &mut Linker<VmState>, module: &wasmtime::Module) -> Result<(), String> {
    // Defining a call the host offers fails: that is how one is known.
    linker.allow_shadowing(false);
    let mut missing = Vec::new();
    for import in module.imports() {
        let (m, name) = (import.module(), import.name());
        let wasmtime::ExternType::Func(ty) = import.ty() else {
            continue;
        };
        let returns_errno =
            ty.results().len() == 1 && matches!(ty.results().next(), Some(ValType::I32));
        let defined = if m != "wasi_snapshot_preview1" {
            let what = format!("{m}::{name}");
            linker
                .func_new(m, name, ty, move |_, _, _| {
                    wasmtime::bail!("{what} is not offered")
                })
                .is_ok()
        } else if returns_errno {
            let errno = if name.starts_with("fd_") || name.starts_with("path_") {
                BADF
            } else {
                NOSYS
            };
            let _offered = linker.func_new(m, name, ty, move |_, _, out: &mut [Val]| {
                out[0] = Val::I32(errno);
                Ok(())
            });
            false
        } else {
            let what = format!("{m}::{name}");
            let _offered = linker.func_new(m, name, ty, move |_, _, _| {
                wasmtime::bail!("the plugin called {what}, which a sandbox cannot honour")
            });
            false
        };
        if defined {
            missing.push(format!("`{m}::{name}`"));
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "it imports {} which this proxy-wasm host does not offer",
        missing.join(", ")
    ))
}
