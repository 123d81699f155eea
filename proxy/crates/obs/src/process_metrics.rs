//! The process's own metrics under the names Prometheus' client libraries
//! give them (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
//! ...), so dashboards made for any exporter read them: read from
//! `/proc/self` at each scrape, nothing kept or counted per request.

use std::fmt::Write as _;

/// Appends the process families to `out` (nothing where `/proc` is not
/// there to read).
pub fn render(out: &mut String) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // The command name, in parentheses, may hold spaces: fields are
    // counted from the last `)`, the third field being the state.
    let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return;
    };
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| -> f64 {
        fields
            .get(n - 3)
            .and_then(|f| f.parse().ok())
            .unwrap_or(0.0)
    };
    // SAFETY: sysconf and getrlimit read process-wide values into locals.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK).max(1) as f64,
            libc::sysconf(libc::_SC_PAGESIZE).max(1) as f64,
        )
    };
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: as above.
    let max_fds = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<f64>().ok())
        })
        .unwrap_or(0.0);
    let open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let mut family = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    };
    family(
        "process_cpu_seconds_total",
        "counter",
        "User and system CPU time spent, in seconds.",
        (field(14) + field(15)) / ticks,
    );
    family(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
        field(24) * page,
    );
    family(
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual memory size in bytes.",
        field(23),
    );
    family(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since the Unix epoch, in seconds.",
        boot + field(22) / ticks,
    );
    family(
        "process_open_fds",
        "gauge",
        "Open file descriptors (sockets included).",
        open_fds as f64,
    );
    if max_fds {
        family(
            "process_max_fds",
            "gauge",
            "The limit on open file descriptors.",
            limit.rlim_cur as f64,
        );
    }
    family(
        "process_threads",
        "gauge",
        "Threads in the process.",
        field(20),
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_process_families_have_plausible_values() {
        let mut out = String::new();
        super::render(&mut out);
        let value = |name: &str| -> f64 {
            out.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} "))?.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {out}"))
        };
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_threads") >= 1.0);
        let start = value("process_start_time_seconds");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            start <= now + 1.0 && start > now - 86_400.0,
            "{start} vs {now}"
        );
    }
}
