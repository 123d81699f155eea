//! A filter that fetches what it checks requests against from a service,
//! as JWT filters fetch their key sets: its root context calls the
//! `keys` upstream (`GET /keys`) from a tick until it has an answer, and
//! each request then carries what it got (`x-keys`, or `none` before).

use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { keys: None, asked: None })
    });
}}

struct Root {
    keys: Option<String>,
    /// The call in flight.
    asked: Option<u32>,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if self.asked != Some(token) {
            return;
        }
        self.asked = None;
        let status = self.get_http_call_response_header(":status");
        if status.as_deref() == Some("200") {
            let body = self
                .get_http_call_response_body(0, body_size)
                .unwrap_or_default();
            self.keys = Some(String::from_utf8_lossy(&body).into_owned());
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        self.set_tick_period(Duration::from_millis(20));
        true
    }

    fn on_tick(&mut self) {
        if self.keys.is_some() || self.asked.is_some() {
            return;
        }
        let head = vec![
            (":method", "GET"),
            (":path", "/keys"),
            (":authority", "keys"),
        ];
        self.asked = self
            .dispatch_http_call("keys", head, None, vec![], Duration::from_secs(1))
            .ok();
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stamp {
            keys: self.keys.clone().unwrap_or_else(|| "none".into()),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stamp {
    keys: String,
}

impl Context for Stamp {}

impl HttpContext for Stamp {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.set_http_request_header("x-keys", Some(&self.keys));
        Action::Continue
    }
}
