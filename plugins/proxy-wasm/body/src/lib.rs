//! A request-body filter as Envoy users write them: with `x-inspect`, it
//! pauses the headers and buffers the body; a body that says `forbidden`
//! is refused (403), any other goes on with ` (checked)` appended and
//! its original length in `x-body-seen`. With `x-inspect: stream` it
//! does the same as Envoy filters do it: lets the headers go (without
//! their length), keeps the body's pieces until the last, then refuses it
//! or appends ` (streamed)`.
//!
//! On the response, with `x-redact: stream` on the request it does what
//! the SDK's `http_body` example does: lets the head go without its
//! length, keeps the body's pieces until the last, and replaces
//! `secret` in it with `[redacted]`; a body that says `refuse` it
//! answers 403 instead, too late (the head has gone: the response is
//! cut off). With `x-redact: late-write` or `late-read` it sets or reads
//! a response header once the body is in, which fails in Envoy (the
//! head has gone). With `x-redact: hold` it holds the head until the
//! body is in, and also says how long the body was in `x-body-was`.
//! Once a request with `x-redact` is over, it logs `request logged: ` and
//! the header's value (`proxy_on_log`), once.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Inspect {
            redact: None,
            inspect: false,
            stream: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Inspect {
    /// `x-redact` of the request.
    redact: Option<String>,
    /// Whether the request body is inspected (`x-inspect`), and streams
    /// (`x-inspect: stream`).
    inspect: bool,
    stream: bool,
}

impl Context for Inspect {}

impl HttpContext for Inspect {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        self.redact = self.get_http_request_header("x-redact");
        let inspect = self.get_http_request_header("x-inspect");
        if end_of_stream || inspect.is_none() {
            return Action::Continue;
        }
        self.inspect = true;
        if inspect.as_deref() == Some("stream") {
            self.stream = true;
            self.set_http_request_header("content-length", None);
            return Action::Continue;
        }
        // The body may change length: its length goes, as Envoy filters
        // that rewrite bodies do (Envoy would send the old one).
        self.set_http_request_header("content-length", None);
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.inspect {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        if body.windows(9).any(|w| w == b"forbidden") {
            self.send_http_response(403, vec![], Some(b"forbidden body\n"));
            return Action::Pause;
        }
        if self.stream {
            self.set_http_request_body(body_size, 0, b" (streamed)");
            return Action::Continue;
        }
        self.set_http_request_header("x-body-seen", Some(&body.len().to_string()));
        self.set_http_request_body(body_size, 0, b" (checked)");
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            return Action::Continue;
        }
        match self.redact.as_deref() {
            Some("stream") => {
                // The body may change length: its length must go before
                // the head does.
                self.set_http_response_header("content-length", None);
                Action::Continue
            }
            Some("hold") => Action::Pause,
            _ => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.redact.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self
            .get_http_response_body(0, body_size)
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&body);
        match self.redact.as_deref() {
            Some("stream") if text.contains("refuse") => {
                self.send_http_response(403, vec![], Some(b"refused\n"));
                return Action::Pause;
            }
            Some("late-write") => self.set_http_response_header("x-too-late", Some("1")),
            Some("late-read") => {
                let _ = self.get_http_response_header("content-type");
            }
            _ => {}
        }
        if text.contains("secret") {
            let redacted = text.replace("secret", "[redacted]");
            self.set_http_response_body(0, body_size, redacted.as_bytes());
        }
        if self.redact.as_deref() == Some("hold") {
            self.set_http_response_header("content-length", None);
            self.set_http_response_header("x-body-was", Some(&body_size.to_string()));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Some(how) = &self.redact {
            let _ = proxy_wasm::hostcalls::log(LogLevel::Info, &format!("request logged: {how}"));
        }
    }
}
