//! A filter that counts requests in shared data (compare-and-swap, so
//! every VM's requests count once) and in its own metrics: a counter of
//! requests and a gauge of the last path's length. Answers with the count
//! it made (`x-shared-count`).

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
}

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        let define = |kind, name| hostcalls::define_metric(kind, name).unwrap_or(0);
        self.requests = define(MetricType::Counter, "requests");
        self.path_len = define(MetricType::Gauge, "last_path_len");
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Counter {
            requests: self.requests,
            path_len: self.path_len,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Counter {
    requests: u32,
    path_len: u32,
}

impl Context for Counter {}

impl HttpContext for Counter {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let count = loop {
            let (value, cas) = self.get_shared_data("requests");
            let n = value
                .and_then(|v| String::from_utf8(v).ok())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                + 1;
            match self.set_shared_data("requests", Some(n.to_string().as_bytes()), cas) {
                Ok(()) => break n,
                Err(Status::CasMismatch) => continue,
                Err(status) => panic!("set_shared_data: {status:?}"),
            }
        };
        hostcalls::increment_metric(self.requests, 1).unwrap();
        let path = self.get_http_request_header(":path").unwrap_or_default();
        hostcalls::record_metric(self.path_len, path.len() as u64).unwrap();
        self.add_http_request_header("x-shared-count", &count.to_string());
        Action::Continue
    }
}
