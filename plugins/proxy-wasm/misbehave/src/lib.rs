//! A filter that misbehaves on request, as `x-misbehave` says:
//! - `loop` spins for ever, `trap` panics, `hoard` allocates without bound;
//! - `framing` sets the fields that frame messages: `transfer-encoding`,
//!   `content-length` and `connection` on the request, `content-length`
//!   and `transfer-encoding` on the response (and removes none);
//! - `local-101` and `local-65736` answer with those statuses (a status
//!   of no answer, and one past 16 bits: the SDK panics if the host
//!   refuses them), `local-twice` answers twice (403 `first`, then 200
//!   `second`);
//! - `metrics` defines `x-count` counters of its own (default 5,000),
//!   each named after the request (`x-name`), and adds one to each;
//! - `logs` logs `x-count` lines (default 2,000), at warning level or at
//!   `x-level: debug`;
//! - `callouts` makes `x-count` calls to the cluster `x-cluster` (`GET
//!   /slow`) without waiting for them, and goes on;
//! - `slow-call` calls `x-cluster` (`GET /slow`, timeout `x-call-ms`) and
//!   waits for the answer, then goes on;
//! - `fill` stores `x-fill-bytes` bytes (default 16 MiB, keys and values)
//!   in shared data, under `fill-N` with values of up to 64 KiB, and
//!   answers 200 (`x-stored`); a write the store refuses makes the SDK
//!   panic: the request fails.
//!
//! With `x-state: VALUE` (any mode), it keeps VALUE as the request's
//! filter state (`proxy_set_property` at `x_state`) and reads it back on
//! the response into `x-state-seen`.
//!
//! Otherwise it answers with how many requests its VM has seen
//! (`x-vm-requests`), so a test can tell a fresh VM from the old one, how
//! many root contexts the VM has that are not done (`x-vm-roots`), the
//! plugin configuration its root context was given (`x-config`; with
//! `"configure_ms": N` in it, its configure takes N ms) and the
//! host's plugin configuration as the response comes (`x-config-now`),
//! and the route it was told it is on (`x-route-name`, the `route_name`
//! property).

use std::cell::Cell;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};

thread_local! {
    static SEEN: Cell<u64> = const { Cell::new(0) };
    /// Root contexts made and not yet done.
    static ROOTS: Cell<u64> = const { Cell::new(0) };
}

proxy_wasm::main! {{
    // Every line goes to the host, which decides what is written (as a
    // filter that logs by its own level, not the host's, does).
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        ROOTS.with(|r| r.set(r.get() + 1));
        Box::new(Root {
            config: String::new(),
        })
    });
}}

struct Root {
    config: String,
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        ROOTS.with(|r| r.set(r.get() - 1));
        true
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        self.config = String::from_utf8_lossy(&config).into_owned();
        // `"configure_ms": N` in its config: a configure that takes N ms.
        let ms: u64 = (self.config.split("\"configure_ms\":").nth(1))
            .map(|rest| {
                rest.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
            })
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let began = self.get_current_time();
        while self.get_current_time() < began + Duration::from_millis(ms) {}
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter {
            seen: 0,
            framing: false,
            config: self.config.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter {
    seen: u64,
    /// Whether it sets framing fields on the response too.
    framing: bool,
    /// Its root context's plugin configuration.
    config: String,
}

impl Context for Filter {
    fn on_http_call_response(&mut self, _token: u32, _: usize, _: usize, _: usize) {
        let status = self.get_http_call_response_header(":status");
        self.set_http_request_header("x-call-status", status.as_deref().or(Some("none")));
        self.resume_http_request();
    }
}

impl Filter {
    /// The request header `name` as a number, or `default`.
    fn number(&self, name: &str, default: u64) -> u64 {
        self.get_http_request_header(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    /// `GET /slow` on the cluster `x-cluster`, with `timeout`.
    fn call(&self, timeout: Duration) -> Result<u32, proxy_wasm::types::Status> {
        let cluster = self
            .get_http_request_header("x-cluster")
            .unwrap_or_default();
        let head = vec![
            (":method", "GET"),
            (":path", "/slow"),
            (":authority", "slow.local"),
        ];
        self.dispatch_http_call(&cluster, head, None, vec![], timeout)
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if let Some(state) = self.get_http_request_header("x-state") {
            self.set_property(vec!["x_state"], Some(state.as_bytes()));
        }
        match self.get_http_request_header("x-misbehave").as_deref() {
            Some("loop") => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            Some("trap") => panic!("asked to trap"),
            Some("hoard") => {
                let mut kept = Vec::new();
                loop {
                    kept.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&kept);
                }
            }
            Some("framing") => {
                self.framing = true;
                self.set_http_request_header("transfer-encoding", Some("chunked"));
                self.set_http_request_header("content-length", Some("5"));
                self.set_http_request_header("connection", Some("close"));
            }
            Some(local @ ("local-101" | "local-65736")) => {
                let status: u32 = local["local-".len()..].parse().unwrap_or(500);
                self.send_http_response(status, vec![], Some(b"odd\n"));
                return Action::Pause;
            }
            Some("local-twice") => {
                self.send_http_response(403, vec![("x-which", "first")], Some(b"first\n"));
                self.send_http_response(200, vec![("x-which", "second")], Some(b"second\n"));
                return Action::Pause;
            }
            Some("metrics") => {
                let name = self.get_http_request_header("x-name").unwrap_or_default();
                for i in 0..self.number("x-count", 5_000) {
                    let id = hostcalls::define_metric(MetricType::Counter, &format!("{name}_{i}"));
                    // A definition the host refused still gives an id to use.
                    if let Ok(id) = id {
                        hostcalls::increment_metric(id, 1).unwrap();
                    }
                }
            }
            Some("logs") => {
                let debug = self.get_http_request_header("x-level").as_deref() == Some("debug");
                for i in 0..self.number("x-count", 2_000) {
                    match debug {
                        true => log::debug!("chattering, line {i}"),
                        false => log::warn!("flooding the log, line {i}"),
                    }
                }
            }
            Some("callouts") => {
                for _ in 0..self.number("x-count", 100) {
                    if self.call(Duration::from_secs(30)).is_err() {
                        break;
                    }
                }
            }
            Some("slow-call") => {
                let ms = self.number("x-call-ms", 10_000);
                return match self.call(Duration::from_millis(ms)) {
                    Ok(_) => Action::Pause,
                    Err(e) => {
                        let status = format!("{e:?}");
                        self.send_http_response(500, vec![("x-call-error", &status)], None);
                        Action::Pause
                    }
                };
            }
            Some("fill") => {
                let target = self.number("x-fill-bytes", 16 << 20) as usize;
                let mut stored = 0;
                for n in 0.. {
                    let key = format!("fill-{n}");
                    let room = target - stored;
                    if room <= key.len() {
                        break;
                    }
                    let value = vec![b'x'; (room - key.len()).min(64 << 10)];
                    let _ = hostcalls::set_shared_data(&key, Some(&value), None);
                    stored += key.len() + value.len();
                }
                let stored = stored.to_string();
                self.send_http_response(200, vec![("x-stored", &stored)], None);
                return Action::Pause;
            }
            _ => {}
        }
        self.seen = SEEN.with(|s| {
            s.set(s.get() + 1);
            s.get()
        });
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.set_http_response_header("x-vm-requests", Some(&self.seen.to_string()));
        let roots = ROOTS.with(Cell::get).to_string();
        self.set_http_response_header("x-vm-roots", Some(&roots));
        self.set_http_response_header("x-config", Some(&self.config));
        // What the host gives as the plugin configuration now: that of
        // the use whose context this is, while another's is in the VM.
        let buffer = proxy_wasm::types::BufferType::PluginConfiguration;
        if let Ok(Some(now)) = hostcalls::get_buffer(buffer, 0, usize::MAX) {
            let now = String::from_utf8_lossy(&now).into_owned();
            self.set_http_response_header("x-config-now", Some(&now));
        }
        if let Some(route) = self.get_property(vec!["route_name"]) {
            let route = String::from_utf8_lossy(&route).into_owned();
            self.set_http_response_header("x-route-name", Some(&route));
        }
        if let Some(state) = self.get_property(vec!["x_state"]) {
            let state = String::from_utf8_lossy(&state).into_owned();
            self.set_http_response_header("x-state-seen", Some(&state));
        }
        if self.framing {
            self.set_http_response_header("content-length", Some("1"));
            self.add_http_response_header("transfer-encoding", "chunked");
        }
        Action::Continue
    }
}
