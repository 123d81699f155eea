//! A filter that asks a gRPC service before it lets a request go, as
//! Envoy users write one with the Rust SDK: with `x-grpc-call: CLUSTER`
//! it calls `SERVICE/METHOD` (`x-grpc-method`, default `test.Echo/Say`)
//! on that cluster with the message `x-grpc-message` (default `hello`),
//! the metadata `x-from: filter` and a timeout of `x-grpc-timeout-ms`
//! (default 5000), and waits. The answer's message goes upstream as
//! `x-grpc-reply`; a failed call's status as `x-grpc-status` and
//! `x-grpc-error`. A call the host refuses is `x-grpc-refused: STATUS`.
//! With `x-grpc-cancel`, it cancels the call at once and goes on
//! (`x-grpc-cancelled: yes`); the answer never reaches it.

use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter;

impl Context for Filter {
    fn on_grpc_call_response(&mut self, _token: u32, status: u32, size: usize) {
        if status == 0 {
            let reply = self.get_grpc_call_response_body(0, size).unwrap_or_default();
            let reply = String::from_utf8_lossy(&reply).into_owned();
            self.set_http_request_header("x-grpc-reply", Some(&reply));
        } else {
            let (code, message) = self.get_grpc_status();
            self.set_http_request_header("x-grpc-status", Some(&code.to_string()));
            self.set_http_request_header("x-grpc-error", Some(&message.unwrap_or_default()));
        }
        self.resume_http_request();
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(cluster) = self.get_http_request_header("x-grpc-call") else {
            return Action::Continue;
        };
        let target = self
            .get_http_request_header("x-grpc-method")
            .unwrap_or_else(|| "test.Echo/Say".into());
        let (service, method) = target.split_once('/').unwrap_or((&target, ""));
        let message = self
            .get_http_request_header("x-grpc-message")
            .unwrap_or_else(|| "hello".into());
        let ms = self
            .get_http_request_header("x-grpc-timeout-ms")
            .and_then(|ms| ms.parse().ok())
            .unwrap_or(5000);
        let sent = self.dispatch_grpc_call(
            &cluster,
            service,
            method,
            vec![("x-from", b"filter")],
            Some(message.as_bytes()),
            Duration::from_millis(ms),
        );
        match sent {
            Err(status) => {
                self.set_http_request_header("x-grpc-refused", Some(&format!("{status:?}")));
                Action::Continue
            }
            Ok(token) if self.get_http_request_header("x-grpc-cancel").is_some() => {
                self.cancel_grpc_call(token);
                self.set_http_request_header("x-grpc-cancelled", Some("yes"));
                Action::Continue
            }
            Ok(_) => Action::Pause,
        }
    }
}
