//! A plugin's stdout and stderr, written to the proxy's log line by line
//! and tagged with the plugin's name: a panicking plugin's message (which
//! its standard library prints to stderr before it traps) is then in the
//! log next to the failed request, instead of lost.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Longest line logged; the rest of a longer one is cut.
const MAX_LINE: usize = 4096;
/// Lines logged per second per stream of one instance; more are counted
/// and reported as skipped, so a plugin cannot flood the log.
const LINES_PER_SECOND: u32 = 20;

/// stdout or stderr of one plugin's instances.
#[derive(Clone)]
pub struct PluginOutput {
    plugin: Arc<str>,
    stream: &'static str,
}

impl PluginOutput {
    /// The plugin's stdout.
    pub fn stdout(plugin: Arc<str>) -> PluginOutput {
        PluginOutput {
            plugin,
            stream: "stdout",
        }
    }

    /// The plugin's stderr.
    pub fn stderr(plugin: Arc<str>) -> PluginOutput {
        PluginOutput {
            plugin,
            stream: "stderr",
        }
    }
}

impl IsTerminal for PluginOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for PluginOutput {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        // Only for WASIp3 guests, which the plugin host does not link.
        Box::new(tokio::io::sink())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(LogLines {
            out: self.clone(),
            pending: Vec::new(),
            window: Instant::now(),
            logged: 0,
            skipped: 0,
        })
    }
}

/// Collects bytes into lines and logs each complete one.
struct LogLines {
    out: PluginOutput,
    pending: Vec<u8>,
    window: Instant,
    logged: u32,
    skipped: u64,
}

impl LogLines {
    fn emit(&mut self, line: &[u8]) {
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        if self.window.elapsed().as_secs() >= 1 {
            if self.skipped > 0 {
                tracing::warn!(target: "plugin", plugin = &*self.out.plugin, stream = self.out.stream,
                    skipped = self.skipped, "plugin output lines skipped (over {LINES_PER_SECOND}/s)");
            }
            self.window = Instant::now();
            self.logged = 0;
            self.skipped = 0;
        }
        if self.logged >= LINES_PER_SECOND {
            self.skipped += 1;
            return;
        }
        self.logged += 1;
        let line = String::from_utf8_lossy(&line[..line.len().min(MAX_LINE)]);
        let line = line.trim_end_matches('\r');
        let (plugin, stream) = (&*self.out.plugin, self.out.stream);
        if stream == "stderr" {
            tracing::warn!(target: "plugin", plugin, stream, "{line}");
        } else {
            tracing::info!(target: "plugin", plugin, stream, "{line}");
        }
    }
}

impl OutputStream for LogLines {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        let mut rest = &bytes[..];
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            if self.pending.is_empty() {
                self.emit(&rest[..end]);
            } else {
                self.pending.extend_from_slice(&rest[..end]);
                let line = std::mem::take(&mut self.pending);
                self.emit(&line);
            }
            rest = &rest[end + 1..];
        }
        // A partial line waits for its end, up to the longest line logged.
        let room = MAX_LINE.saturating_sub(self.pending.len());
        self.pending
            .extend_from_slice(&rest[..rest.len().min(room)]);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            self.emit(&line);
        }
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 << 10)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for LogLines {
    async fn ready(&mut self) {}
}
