//! A filter's log: `proxy_log` writes its lines (under the plugin's name,
//! at most so many a second: `containment::may_log`), and
//! `proxy_get_log_level` tells it the level below which they are not
//! written, so the SDKs that ask skip formatting them.

use wasmtime::Linker;

use super::VmState;
use super::abi::{C, R, ok};
use super::guest::{Status, read, write_u32};

/// Adds `proxy_log` and `proxy_get_log_level` to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    let env = "env";
    linker.func_wrap(
        env,
        "proxy_log",
        |mut c: C<'_>, level: i32, ptr: i32, len: i32| -> R {
            // A line at a level nobody reads costs nothing more, and does
            // not use the plugin's lines a second that one read would.
            // While a VM starts, its complaints are kept for the error.
            let starting = c.data().start_log.is_some();
            if !starting && !log_enabled(level) {
                return ok(Status::Ok);
            }
            if !crate::containment::may_log(&c.data().plugin) {
                return ok(Status::Ok);
            }
            let message = read(&mut c, ptr, len)?;
            let message = String::from_utf8_lossy(&message);
            let message = crate::containment::log_line(&message);
            c.data_mut().said(level, message);
            let plugin = &*c.data().plugin;
            match level {
                0 => tracing::trace!(plugin, "{message}"),
                1 => tracing::debug!(plugin, "{message}"),
                2 => tracing::info!(plugin, "{message}"),
                3 => tracing::warn!(plugin, "{message}"),
                _ => tracing::error!(plugin, "{message}"),
            }
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap(env, "proxy_get_log_level", |mut c: C<'_>, ret: i32| -> R {
        use tracing::level_filters::LevelFilter;
        let level = match LevelFilter::current() {
            LevelFilter::TRACE => 0,
            LevelFilter::DEBUG => 1,
            LevelFilter::INFO => 2,
            LevelFilter::WARN => 3,
            LevelFilter::ERROR => 4,
            _ => 5,
        };
        write_u32(&mut c, ret, level)?;
        ok(Status::Ok)
    })?;
    Ok(())
}

/// Whether a filter's line at proxy-wasm `level` would be written.
fn log_enabled(level: i32) -> bool {
    use tracing::Level;
    match level {
        0 => tracing::enabled!(Level::TRACE),
        1 => tracing::enabled!(Level::DEBUG),
        2 => tracing::enabled!(Level::INFO),
        3 => tracing::enabled!(Level::WARN),
        _ => tracing::enabled!(Level::ERROR),
    }
}
