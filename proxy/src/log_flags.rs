//! The access log's flags, the same for every command that serves:
//! where lines go, and how they are batched (nginx's `buffer=` and
//! `flush=`).

use std::time::Duration;

use portcullis_obs::access_log::{Destination, Settings};

/// The flags as given.
#[derive(Debug, clap::Args)]
pub struct AccessLogFlags {
    /// Where access lines go: `stderr` (with the other logs) or a file,
    /// appended to and opened again when moved away (logrotate).
    #[arg(
        long,
        value_name = "stderr|FILE",
        env = "PORTCULLIS_ACCESS_LOG",
        default_value = "stderr",
        value_parser = Destination::parse
    )]
    pub access_log: Destination,
    /// A worker's access lines are written once this many bytes wait (0:
    /// each line at once), as nginx's `buffer=`.
    #[arg(
        long,
        value_name = "SIZE",
        env = "PORTCULLIS_ACCESS_LOG_BUFFER",
        default_value = "64KiB",
        value_parser = parse_buffer
    )]
    pub access_log_buffer: usize,
    /// Buffered access lines are written at least this often, and at the
    /// drain and at exit, as nginx's `flush=`.
    #[arg(
        long,
        value_name = "DURATION",
        env = "PORTCULLIS_ACCESS_LOG_FLUSH",
        default_value = "1s",
        value_parser = parse_flush
    )]
    pub access_log_flush: Duration,
}

impl AccessLogFlags {
    /// The writer's settings, in the event log's format.
    pub fn settings(self) -> Settings {
        Settings {
            destination: self.access_log,
            buffer: self.access_log_buffer,
            flush: self.access_log_flush,
            json: portcullis_obs::telemetry::json_format(),
        }
    }
}

/// Up to 16 MiB: more only delays lines.
fn parse_buffer(s: &str) -> Result<usize, String> {
    let n = portcullis_config::parse_size(s)?;
    if n > 16 << 20 {
        return Err(format!("`{s}` is over 16MiB"));
    }
    Ok(n as usize)
}

fn parse_flush(s: &str) -> Result<Duration, String> {
    let d = portcullis_config::parse_duration(s)?;
    if d < Duration::from_millis(1) {
        return Err(format!("`{s}`: the flush interval must be at least 1ms"));
    }
    Ok(d)
}
