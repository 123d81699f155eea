//! The WASI preview 1 calls proxy-wasm filters import (Rust's std and Go's
//! runtime import a dozen or so at start-up), seeing no files, arguments,
//! environment or network: stdout and stderr go to the proxy's log, the
//! clocks and randomness are the host's, everything else is `EBADF` or
//! `ENOSYS` (the calls not written here answer so too: `imports.rs`). Written here rather than taken from wasmtime-wasi's `p1`:
//! its synchronous calls block on a Tokio runtime, which panics on the
//! proxy's worker threads, where filters run.

use wasmtime::{Caller, Linker};

use super::VmState;
use super::guest::{read, write, write_u32};

const SUCCESS: i32 = 0;
const BADF: i32 = 8;
const INVAL: i32 = 28;
const NOSYS: i32 = 52;
/// `filetype::character_device`, what stdout and stderr are.
const CHARACTER_DEVICE: u8 = 2;

type C<'a> = Caller<'a, VmState>;
type R = wasmtime::Result<i32>;

/// Adds the calls to `linker` (module `wasi_snapshot_preview1`).
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    let m = "wasi_snapshot_preview1";
    linker.func_wrap(
        m,
        "fd_write",
        |mut c: C<'_>, fd: i32, iovs: i32, n: i32, ret: i32| -> R {
            if fd != 1 && fd != 2 {
                return Ok(BADF);
            }
            let mut written = 0u32;
            let mut text = Vec::new();
            for i in 0..n.max(0) {
                let iov = read(&mut c, iovs + i * 8, 8)?;
                let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
                text.extend_from_slice(&read(&mut c, ptr, len)?);
                written += len as u32;
            }
            let text = String::from_utf8_lossy(&text);
            let stream = if fd == 1 { "stdout" } else { "stderr" };
            let plugin = c.data().plugin.clone();
            for line in text.lines().filter(|l| !l.is_empty()) {
                if !crate::containment::may_log(&plugin) {
                    break;
                }
                let line = crate::containment::log_line(line);
                tracing::info!(plugin = %plugin, stream, "{line}");
                // Go filters log through stdout and stderr.
                let level = if fd == 2 { 4 } else { 2 };
                c.data_mut().said(level, line);
            }
            write_u32(&mut c, ret, written)?;
            Ok(SUCCESS)
        },
    )?;
    // Go's runtime makes stdio non-blocking as it starts: nothing to do
    // for streams that go to the log, and no other descriptor exists.
    linker.func_wrap(
        m,
        "fd_fdstat_set_flags",
        |_: C<'_>, fd: i32, _flags: i32| -> R {
            Ok(if (0..=2).contains(&fd) { SUCCESS } else { BADF })
        },
    )?;
    linker.func_wrap(m, "fd_fdstat_get", |mut c: C<'_>, fd: i32, ret: i32| -> R {
        if !(0..=2).contains(&fd) {
            return Ok(BADF);
        }
        // fdstat: filetype u8, flags u16, rights base u64, rights inheriting u64.
        let mut stat = [0u8; 24];
        stat[0] = CHARACTER_DEVICE;
        write(&mut c, ret, &stat)?;
        Ok(SUCCESS)
    })?;
    for name in ["fd_close", "fd_sync", "fd_datasync"] {
        linker.func_wrap(m, name, |_: C<'_>, _fd: i32| -> R { Ok(BADF) })?;
    }
    linker.func_wrap(m, "fd_prestat_get", |_: C<'_>, _fd: i32, _ret: i32| -> R {
        Ok(BADF)
    })?;
    linker.func_wrap(
        m,
        "fd_prestat_dir_name",
        |_: C<'_>, _fd: i32, _p: i32, _l: i32| -> R { Ok(BADF) },
    )?;
    linker.func_wrap(
        m,
        "fd_read",
        |_: C<'_>, _fd: i32, _i: i32, _n: i32, _r: i32| -> R { Ok(BADF) },
    )?;
    linker.func_wrap(
        m,
        "fd_seek",
        |_: C<'_>, _fd: i32, _o: i64, _w: i32, _r: i32| -> R { Ok(BADF) },
    )?;
    for (sizes, get) in [
        ("environ_sizes_get", "environ_get"),
        ("args_sizes_get", "args_get"),
    ] {
        linker.func_wrap(m, sizes, |mut c: C<'_>, count: i32, size: i32| -> R {
            write_u32(&mut c, count, 0)?;
            write_u32(&mut c, size, 0)?;
            Ok(SUCCESS)
        })?;
        linker.func_wrap(m, get, |_: C<'_>, _a: i32, _b: i32| -> R { Ok(SUCCESS) })?;
    }
    linker.func_wrap(
        m,
        "clock_time_get",
        |mut c: C<'_>, id: i32, _precision: i64, ret: i32| -> R {
            let nanos = match id {
                // realtime
                0 => std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64),
                // monotonic, process and thread CPU time: a monotonic clock
                1..=3 => monotonic_nanos(),
                _ => return Ok(INVAL),
            };
            write(&mut c, ret, &nanos.to_le_bytes())?;
            Ok(SUCCESS)
        },
    )?;
    linker.func_wrap(
        m,
        "clock_res_get",
        |mut c: C<'_>, _id: i32, ret: i32| -> R {
            write(&mut c, ret, &1u64.to_le_bytes())?;
            Ok(SUCCESS)
        },
    )?;
    linker.func_wrap(m, "random_get", |mut c: C<'_>, ptr: i32, len: i32| -> R {
        let mut bytes = vec![0u8; len.max(0) as usize];
        if getrandom::fill(&mut bytes).is_err() {
            return Ok(NOSYS);
        }
        write(&mut c, ptr, &bytes)?;
        Ok(SUCCESS)
    })?;
    linker.func_wrap(m, "sched_yield", |_: C<'_>| -> R { Ok(SUCCESS) })?;
    linker.func_wrap(
        m,
        "poll_oneoff",
        |_: C<'_>, _i: i32, _o: i32, _n: i32, _r: i32| -> R { Ok(NOSYS) },
    )?;
    linker.func_wrap(
        m,
        "proc_exit",
        |c: C<'_>, code: i32| -> wasmtime::Result<()> {
            wasmtime::bail!("plugin `{}` exited with code {code}", c.data().plugin)
        },
    )?;
    Ok(())
}

fn monotonic_nanos() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}
