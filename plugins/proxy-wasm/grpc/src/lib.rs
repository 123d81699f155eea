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
//!
//! Streams, from the root context as a filter that keeps one open does:
//! `x-grpc-stream: CLUSTER|SERVICE/METHOD|M1,M2|END` has the root open a
//! stream (through a shared queue), send the messages (`#N`: one of N
//! bytes) and then, by END,
//! `close` it (half-close), `end` it (an empty last message with
//! end_stream), `cancel` it, or leave it `open`; the request is answered
//! 202. What the root is told of its streams is a transcript in shared
//! data, which `x-grpc-transcript` answers with (200).

use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

const QUEUE: &str = "grpc-streams";
const TRANSCRIPT: &str = "grpc-transcript";

struct Root;

impl Root {
    /// Opens a stream by `plan` (see the crate's documentation).
    fn open(&self, plan: &str) {
        let parts: Vec<&str> = plan.split('|').collect();
        let [cluster, target, messages, end] = parts[..] else {
            return note(self, &format!("bad plan {plan}"));
        };
        let (service, method) = target.split_once('/').unwrap_or((target, ""));
        let metadata = vec![("x-from", &b"filter"[..])];
        let token = match self.open_grpc_stream(cluster, service, method, metadata) {
            Ok(token) => token,
            Err(status) => return note(self, &format!("refused {status:?}")),
        };
        for message in messages.split(',').filter(|m| !m.is_empty()) {
            // `#N`: a message of N bytes, larger than a header holds.
            let message = match message.strip_prefix('#').map(str::parse::<usize>) {
                Some(Ok(n)) => vec![b'x'; n],
                _ => message.as_bytes().to_vec(),
            };
            self.send_grpc_stream_message(token, Some(&message), false);
        }
        match end {
            "close" => self.close_grpc_stream(token),
            "end" => self.send_grpc_stream_message(token, None, true),
            "cancel" => {
                self.cancel_grpc_stream(token);
                note(self, "cancelled");
            }
            _ => {}
        }
    }
}

/// Appends `line` to the transcript.
fn note(context: &dyn Context, line: &str) {
    loop {
        let (old, cas) = context.get_shared_data(TRANSCRIPT);
        let mut all = old.unwrap_or_default();
        all.extend_from_slice(line.as_bytes());
        all.push(b'\n');
        if context.set_shared_data(TRANSCRIPT, Some(&all), cas).is_ok() {
            return;
        }
    }
}

fn text(bytes: Option<Vec<u8>>) -> String {
    String::from_utf8_lossy(&bytes.unwrap_or_default()).into_owned()
}

impl Context for Root {
    fn on_grpc_stream_initial_metadata(&mut self, _token: u32, _count: u32) {
        let server = text(self.get_grpc_stream_initial_metadata_value("x-server"));
        note(self, &format!("head x-server={server}"));
    }

    fn on_grpc_stream_message(&mut self, _token: u32, size: usize) {
        let message = text(self.get_grpc_stream_message(0, size));
        note(self, &format!("message {message}"));
    }

    fn on_grpc_stream_trailing_metadata(&mut self, _token: u32, _count: u32) {
        let count = text(self.get_grpc_stream_trailing_metadata_value("x-count"));
        note(self, &format!("trailers x-count={count}"));
    }

    fn on_grpc_stream_close(&mut self, _token: u32, status: u32) {
        let (_, message) = self.get_grpc_status();
        note(
            self,
            &format!("close {status} {}", message.unwrap_or_default()),
        );
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        self.register_shared_queue(QUEUE);
        true
    }

    fn on_queue_ready(&mut self, queue: u32) {
        while let Ok(Some(plan)) = self.dequeue_shared_queue(queue) {
            self.open(&String::from_utf8_lossy(&plan));
        }
    }

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
            let reply = self
                .get_grpc_call_response_body(0, size)
                .unwrap_or_default();
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
        if let Some(plan) = self.get_http_request_header("x-grpc-stream") {
            let queue = self.resolve_shared_queue("", QUEUE).expect("registered");
            self.enqueue_shared_queue(queue, Some(plan.as_bytes()))
                .expect("queued");
            self.send_http_response(202, vec![], None);
            return Action::Pause;
        }
        if self.get_http_request_header("x-grpc-transcript").is_some() {
            let (transcript, _) = self.get_shared_data(TRANSCRIPT);
            self.send_http_response(200, vec![], Some(&transcript.unwrap_or_default()));
            return Action::Pause;
        }
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
