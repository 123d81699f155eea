//! A filter that counts requests in shared data (compare-and-swap, so
//! every VM's requests count once) and in its own metrics: a counter of
//! requests, a gauge of the last path's length and a histogram of the
//! lengths. Answers with the count it made (`x-shared-count`).

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, MetricType, Status};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

#[derive(Default)]
struct Root {
    requests: u32,
    path_len: u32,
    path_lens: u32,
    ticks: u32,
    ticking: u32,
    dequeued: u32,
    queue: u32,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        let define = |kind, name| hostcalls::define_metric(kind, name).unwrap_or(0);
        self.requests = define(MetricType::Counter, "requests");
        self.path_len = define(MetricType::Gauge, "last_path_len");
        self.path_lens = define(MetricType::Histogram, "path_len");
        self.ticks = define(MetricType::Counter, "ticks");
        self.ticking = define(MetricType::Gauge, "ticking");
        self.dequeued = define(MetricType::Counter, "dequeued");
        self.queue = self.register_shared_queue("paths");
        self.set_tick_period(std::time::Duration::from_millis(10));
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_path)) = self.dequeue_shared_queue(queue_id) {
            hostcalls::increment_metric(self.dequeued, 1).unwrap();
        }
    }

    fn on_tick(&mut self) {
        hostcalls::increment_metric(self.ticks, 1).unwrap();
        hostcalls::record_metric(self.ticking, 1).unwrap();
        add_shared("ticks");
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Counter {
            requests: self.requests,
            path_len: self.path_len,
            path_lens: self.path_lens,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Counter {
    requests: u32,
    path_len: u32,
    path_lens: u32,
}

impl Context for Counter {}

impl HttpContext for Counter {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let count = add_shared("requests");
        hostcalls::increment_metric(self.requests, 1).unwrap();
        let path = self.get_http_request_header(":path").unwrap_or_default();
        let queue = self.resolve_shared_queue("", "paths").expect("registered");
        self.enqueue_shared_queue(queue, Some(path.as_bytes()))
            .unwrap();
        hostcalls::record_metric(self.path_len, path.len() as u64).unwrap();
        hostcalls::record_metric(self.path_lens, path.len() as u64).unwrap();
        self.add_http_request_header("x-shared-count", &count.to_string());
        let (ticks, _) = self.get_shared_data("ticks");
        let ticks = ticks.and_then(|v| String::from_utf8(v).ok());
        self.add_http_request_header("x-shared-ticks", ticks.as_deref().unwrap_or("0"));
        Action::Continue
    }
}

/// Adds one to the number in shared data under `key` (compare-and-swap,
/// so no VM's addition is lost): the new number.
fn add_shared(key: &str) -> u64 {
    loop {
        let (value, cas) = hostcalls::get_shared_data(key).unwrap();
        let n = value
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            + 1;
        match hostcalls::set_shared_data(key, Some(n.to_string().as_bytes()), cas) {
            Ok(()) => return n,
            Err(Status::CasMismatch) => continue,
            Err(status) => panic!("set_shared_data: {status:?}"),
        }
    }
}
