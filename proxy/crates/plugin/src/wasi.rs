//! The WASI a plugin gets: what a toolchain's standard library imports
//! (stdio, environment, exit, clocks, random), linked for synchronous calls
//! that never block.
//!
//! Plugins are called synchronously on the worker thread: no fiber to set
//! up per call, and the epoch deadline bounds how long a call can hold the
//! thread. wasmtime-wasi's synchronous `wasi:io` would block on a Tokio
//! runtime for its `blocking-*` functions, which panics on a thread that
//! already runs one. Nothing a plugin can reach ever needs to wait (stdout
//! and stderr go to the log, stdin is empty), so here those functions run
//! their operation once: done if it is ready, a trap if it would have had
//! to wait. Files and sockets are linked with nothing behind them (no
//! directory preopened, every network use refused), because interpreters'
//! runtimes (CPython, as componentize-py builds it) import them whether or
//! not the plugin touches them. A plugin importing more than this set
//! (`wasi:http`, say) does not link: `check` and a reload refuse it,
//! naming the import.

use futures_util::FutureExt;
use wasmtime::component::{Linker, Resource, ResourceTable};
use wasmtime_wasi::WasiView;
use wasmtime_wasi::cli::{WasiCli, WasiCliView};
use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView};
use wasmtime_wasi::p2::bindings::io::{poll as async_poll, streams as async_streams};
use wasmtime_wasi::p2::bindings::sync::io::{poll, streams};
use wasmtime_wasi::p2::bindings::{cli, clocks, random};
use wasmtime_wasi::p2::{DynPollable, StreamError, StreamResult};
use wasmtime_wasi::random::{WasiRandom, WasiRandomView};

use streams::{InputStream, OutputStream};

/// Adds the plugin WASI set to `linker`.
pub fn add_to_linker<T: WasiView>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    let l = linker;
    wasmtime_wasi::p2::bindings::io::error::add_to_linker::<T, NonBlockingIo>(l, |t| {
        NonBlocking(t.ctx().table)
    })?;
    streams::add_to_linker::<T, NonBlockingIo>(l, |t| NonBlocking(t.ctx().table))?;
    poll::add_to_linker::<T, NonBlockingIo>(l, |t| NonBlocking(t.ctx().table))?;
    cli::exit::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::environment::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::stdin::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::stdout::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::stderr::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::terminal_input::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::terminal_output::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::terminal_stdin::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::terminal_stdout::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    cli::terminal_stderr::add_to_linker::<T, WasiCli>(l, <T as WasiCliView>::cli)?;
    clocks::wall_clock::add_to_linker::<T, WasiClocks>(l, <T as WasiClocksView>::clocks)?;
    clocks::monotonic_clock::add_to_linker::<T, WasiClocks>(l, <T as WasiClocksView>::clocks)?;
    random::random::add_to_linker::<T, WasiRandom>(l, <T as WasiRandomView>::random)?;
    random::insecure::add_to_linker::<T, WasiRandom>(l, <T as WasiRandomView>::random)?;
    random::insecure_seed::add_to_linker::<T, WasiRandom>(l, <T as WasiRandomView>::random)?;
    add_empty_filesystem(l)?;
    add_closed_sockets(l)?;
    Ok(())
}

/// `wasi:filesystem` with nothing in it: no directory is preopened, so
/// `get-directories` is empty and no descriptor can ever exist for the
/// other functions to act on. Interpreters' standard libraries (CPython,
/// as componentize-py builds it) import the interface whether or not the
/// plugin touches a file; linking it empty lets them load and keeps
/// plugins without files. (None of it can block: every blocking function
/// takes a descriptor.)
fn add_empty_filesystem<T: WasiView>(l: &mut Linker<T>) -> wasmtime::Result<()> {
    use wasmtime_wasi::filesystem::{WasiFilesystem, WasiFilesystemView};
    wasmtime_wasi::p2::bindings::sync::filesystem::types::add_to_linker::<T, WasiFilesystem>(
        l,
        <T as WasiFilesystemView>::filesystem,
    )?;
    wasmtime_wasi::p2::bindings::filesystem::preopens::add_to_linker::<T, WasiFilesystem>(
        l,
        <T as WasiFilesystemView>::filesystem,
    )
}

/// `wasi:sockets` with every use refused: the context allows no TCP, no
/// UDP and no name lookup (`State::new`), so creating a socket or looking
/// a name up fails with `access-denied`, and no socket ever exists for
/// the functions that could wait. Linked for the same standard libraries
/// as the filesystem.
fn add_closed_sockets<T: WasiView>(l: &mut Linker<T>) -> wasmtime::Result<()> {
    use wasmtime_wasi::p2::bindings::sockets as s;
    use wasmtime_wasi::p2::bindings::sync::sockets as sync;
    use wasmtime_wasi::sockets::{WasiSockets, WasiSocketsView};
    let view = <T as WasiSocketsView>::sockets;
    s::network::add_to_linker::<T, WasiSockets>(l, &Default::default(), view)?;
    s::instance_network::add_to_linker::<T, WasiSockets>(l, view)?;
    s::tcp_create_socket::add_to_linker::<T, WasiSockets>(l, view)?;
    sync::udp_create_socket::add_to_linker::<T, WasiSockets>(l, view)?;
    sync::tcp::add_to_linker::<T, WasiSockets>(l, view)?;
    sync::udp::add_to_linker::<T, WasiSockets>(l, view)?;
    sync::ip_name_lookup::add_to_linker::<T, WasiSockets>(l, view)
}

/// `wasi:io` over the instance's resource table, never waiting.
pub struct NonBlocking<'a>(&'a mut ResourceTable);

struct NonBlockingIo;

impl wasmtime::component::HasData for NonBlockingIo {
    type Data<'a> = NonBlocking<'a>;
}

fn would_block(what: &str) -> wasmtime::Error {
    wasmtime::Error::msg(format!(
        "plugin called `{what}`, which would have to wait; plugins may not block"
    ))
}

/// Runs a `blocking-*` operation if it can finish now.
fn now<R>(what: &str, f: impl Future<Output = R>) -> wasmtime::Result<R> {
    f.now_or_never().ok_or_else(|| would_block(what))
}

fn now_stream<R>(what: &str, f: impl Future<Output = StreamResult<R>>) -> StreamResult<R> {
    f.now_or_never()
        .unwrap_or_else(|| Err(StreamError::Trap(would_block(what))))
}

impl wasmtime_wasi::p2::bindings::io::error::Host for NonBlocking<'_> {}

impl wasmtime_wasi::p2::bindings::io::error::HostError for NonBlocking<'_> {
    fn to_debug_string(
        &mut self,
        err: Resource<wasmtime_wasi::p2::bindings::io::error::Error>,
    ) -> wasmtime::Result<String> {
        wasmtime_wasi::p2::bindings::io::error::HostError::to_debug_string(self.0, err)
    }

    fn drop(
        &mut self,
        err: Resource<wasmtime_wasi::p2::bindings::io::error::Error>,
    ) -> wasmtime::Result<()> {
        wasmtime_wasi::p2::bindings::io::error::HostError::drop(self.0, err)
    }
}

impl streams::Host for NonBlocking<'_> {
    fn convert_stream_error(&mut self, err: StreamError) -> wasmtime::Result<streams::StreamError> {
        streams::Host::convert_stream_error(self.0, err)
    }
}

impl streams::HostOutputStream for NonBlocking<'_> {
    fn drop(&mut self, stream: Resource<OutputStream>) -> wasmtime::Result<()> {
        now(
            "output-stream.drop",
            async_streams::HostOutputStream::drop(self.0, stream),
        )?
    }

    fn check_write(&mut self, stream: Resource<OutputStream>) -> StreamResult<u64> {
        streams::HostOutputStream::check_write(self.0, stream)
    }

    fn write(&mut self, stream: Resource<OutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        streams::HostOutputStream::write(self.0, stream, bytes)
    }

    fn blocking_write_and_flush(
        &mut self,
        stream: Resource<OutputStream>,
        bytes: Vec<u8>,
    ) -> StreamResult<()> {
        now_stream(
            "output-stream.blocking-write-and-flush",
            async_streams::HostOutputStream::blocking_write_and_flush(self.0, stream, bytes),
        )
    }

    fn blocking_write_zeroes_and_flush(
        &mut self,
        stream: Resource<OutputStream>,
        len: u64,
    ) -> StreamResult<()> {
        now_stream(
            "output-stream.blocking-write-zeroes-and-flush",
            async_streams::HostOutputStream::blocking_write_zeroes_and_flush(self.0, stream, len),
        )
    }

    fn subscribe(
        &mut self,
        stream: Resource<OutputStream>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        streams::HostOutputStream::subscribe(self.0, stream)
    }

    fn write_zeroes(&mut self, stream: Resource<OutputStream>, len: u64) -> StreamResult<()> {
        streams::HostOutputStream::write_zeroes(self.0, stream, len)
    }

    fn flush(&mut self, stream: Resource<OutputStream>) -> StreamResult<()> {
        streams::HostOutputStream::flush(self.0, stream)
    }

    fn blocking_flush(&mut self, stream: Resource<OutputStream>) -> StreamResult<()> {
        now_stream(
            "output-stream.blocking-flush",
            async_streams::HostOutputStream::blocking_flush(self.0, stream),
        )
    }

    fn splice(
        &mut self,
        dst: Resource<OutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        streams::HostOutputStream::splice(self.0, dst, src, len)
    }

    fn blocking_splice(
        &mut self,
        dst: Resource<OutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        now_stream(
            "output-stream.blocking-splice",
            async_streams::HostOutputStream::blocking_splice(self.0, dst, src, len),
        )
    }
}

impl streams::HostInputStream for NonBlocking<'_> {
    fn drop(&mut self, stream: Resource<InputStream>) -> wasmtime::Result<()> {
        now(
            "input-stream.drop",
            async_streams::HostInputStream::drop(self.0, stream),
        )?
    }

    fn read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        streams::HostInputStream::read(self.0, stream, len)
    }

    fn blocking_read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        now_stream(
            "input-stream.blocking-read",
            async_streams::HostInputStream::blocking_read(self.0, stream, len),
        )
    }

    fn skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        streams::HostInputStream::skip(self.0, stream, len)
    }

    fn blocking_skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        now_stream(
            "input-stream.blocking-skip",
            async_streams::HostInputStream::blocking_skip(self.0, stream, len),
        )
    }

    fn subscribe(
        &mut self,
        stream: Resource<InputStream>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        streams::HostInputStream::subscribe(self.0, stream)
    }
}

impl poll::Host for NonBlocking<'_> {
    fn poll(&mut self, pollables: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
        now("poll", async_poll::Host::poll(self.0, pollables))?
    }
}

impl poll::HostPollable for NonBlocking<'_> {
    fn ready(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<bool> {
        now(
            "pollable.ready",
            async_poll::HostPollable::ready(self.0, pollable),
        )?
    }

    fn block(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        now(
            "pollable.block",
            async_poll::HostPollable::block(self.0, pollable),
        )?
    }

    fn drop(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        poll::HostPollable::drop(self.0, pollable)
    }
}
