//! A plugin's stdout and stderr, written to the proxy's log line by line
//! and tagged with the plugin's name: a panicking plugin's message (which
//! its standard library prints to stderr before it traps) is then in the
//! log next to the failed request, instead of lost. Its lines count
//! against the plugin's log budget (`containment::may_log`).

use std::sync::Arc;

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Longest line logged; the rest of a longer one is cut.
const MAX_LINE: usize = crate::containment::MAX_LOG_LINE;

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
        })
    }
}

/// Collects bytes into lines and logs each complete one.
struct LogLines {
    out: PluginOutput,
    pending: Vec<u8>,
}

impl LogLines {
    fn emit(&mut self, line: &[u8]) {
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        if !crate::containment::may_log(&self.out.plugin) {
            return;
        }
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
