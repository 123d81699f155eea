//! A header filter as Envoy users write them: refuses requests carrying
//! `x-deny` with its own 403, otherwise tags the request with its
//! configuration and the path it saw, drops `x-remove-me`, and tags the
//! response with the status it saw. Its VM configuration and root id,
//! when set, tag the request too (`x-pw-vm`, `x-pw-root`). On trailers
//! (a gRPC call's, say) it does the same: a request trailer `x-deny`
//! is refused with 403; otherwise `x-remove-me` goes and `x-pw-trailers`
//! counts the fields it was given; a response's trailers get
//! `x-pw-grpc-status` with their `grpc-status`. With `x-audit: CLUSTER`
//! it posts the path it saw to `/audit` on that cluster and goes on
//! without waiting for the answer. `x-reset: request` resets the request
//! before it goes anywhere; `x-reset: response` resets it once the
//! response head comes (`proxy_close_stream`). `x-foreign: NAME` calls
//! the host's foreign function NAME on `x-foreign-arg`: for `compress`,
//! the result is given to `uncompress` and what comes back goes upstream
//! as `x-foreign-roundtrip` (with the compressed length,
//! `x-foreign-compressed`); another name's answer is `x-foreign-status`
//! (`Ok` or the failure).

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { tag: String::new(), vm: String::new(), root: String::new() })
    });
}}

struct Root {
    tag: String,
    vm: String,
    root: String,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        let vm = self.get_vm_configuration().unwrap_or_default();
        self.vm = String::from_utf8_lossy(&vm).into_owned();
        let root = self
            .get_property(vec!["plugin_root_id"])
            .unwrap_or_default();
        self.root = String::from_utf8_lossy(&root).into_owned();
        true
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        match String::from_utf8(config) {
            // A configuration of "refuse" is refused, as a filter refuses
            // a configuration it cannot use.
            Ok(tag) if tag != "refuse" => {
                log::info!("configured with tag {tag}");
                self.tag = tag;
                true
            }
            _ => false,
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter {
            tag: self.tag.clone(),
            vm: self.vm.clone(),
            root: self.root.clone(),
            reset_response: false,
            read_request_late: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter {
    tag: String,
    vm: String,
    root: String,
    reset_response: bool,
    /// Whether to read the request head while the response passes (asked
    /// with `x-read-request-late`; Envoy refuses that read, see below).
    read_request_late: bool,
}

impl Context for Filter {}

impl Filter {
    /// Calls foreign function `name` (see the crate's documentation).
    fn foreign(&self, name: &str) {
        use proxy_wasm::hostcalls::call_foreign_function;
        let arg = self
            .get_http_request_header("x-foreign-arg")
            .unwrap_or_default();
        let called = call_foreign_function(name, Some(arg.as_bytes()));
        let packed = match (name, called) {
            ("compress", Ok(packed)) => packed.unwrap_or_default(),
            (_, Ok(_)) => return self.set_http_request_header("x-foreign-status", Some("Ok")),
            (_, Err(status)) => {
                let status = format!("{status:?}");
                return self.set_http_request_header("x-foreign-status", Some(&status));
            }
        };
        let length = packed.len().to_string();
        self.set_http_request_header("x-foreign-compressed", Some(&length));
        let back = call_foreign_function("uncompress", Some(&packed));
        let back = match back {
            Ok(back) => String::from_utf8_lossy(&back.unwrap_or_default()).into_owned(),
            Err(status) => format!("{status:?}"),
        };
        self.set_http_request_header("x-foreign-roundtrip", Some(&back));
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        match self.get_http_request_header("x-reset").as_deref() {
            Some("request") => {
                self.reset_http_request();
                return Action::Pause;
            }
            Some("response") => self.reset_response = true,
            _ => {}
        }
        self.read_request_late = self
            .get_http_request_header("x-read-request-late")
            .is_some();
        if let Some(name) = self.get_http_request_header("x-foreign") {
            self.foreign(&name);
        }
        if self.get_http_request_header("x-deny").as_deref() == Some("quietly") {
            self.send_http_response(401, vec![], None);
            return Action::Pause;
        }
        if self.get_http_request_header("x-deny").is_some() {
            self.send_http_response(
                403,
                vec![("x-denied-by", "proxy-wasm-headers")],
                Some(b"denied by the filter\n"),
            );
            return Action::Pause;
        }
        let path = self.get_http_request_header(":path").unwrap_or_default();
        let method = self.get_http_request_header(":method").unwrap_or_default();
        self.set_http_request_header("x-pw-tag", Some(&self.tag));
        if !self.vm.is_empty() {
            self.set_http_request_header("x-pw-vm", Some(&self.vm));
        }
        if !self.root.is_empty() {
            self.set_http_request_header("x-pw-root", Some(&self.root));
        }
        self.set_http_request_header("x-pw-saw", Some(&format!("{method} {path}")));
        if let Some(cluster) = self.get_http_request_header("x-audit") {
            let headers = vec![
                (":method", "POST"),
                (":path", "/audit"),
                (":authority", "audit"),
            ];
            let timeout = std::time::Duration::from_secs(5);
            let sent =
                self.dispatch_http_call(&cluster, headers, Some(path.as_bytes()), vec![], timeout);
            self.set_http_request_header(
                "x-pw-audit",
                Some(if sent.is_ok() { "sent" } else { "refused" }),
            );
        }
        self.set_http_request_header("x-remove-me", None);
        self.add_http_request_header("x-pw-added", "one");
        self.add_http_request_header("x-pw-added", "two");
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if self.reset_response {
            self.reset_http_response();
            return Action::Pause;
        }
        let status = self.get_http_response_header(":status").unwrap_or_default();
        self.set_http_response_header("x-pw-status", Some(&status));
        let count = self.get_http_response_headers().len();
        self.set_http_response_header("x-pw-response-fields", Some(&count.to_string()));
        // The request as it was forwarded, read while the response passes:
        // the filter's own edit, a field it removed, one the proxy added.
        // Envoy 1.40 lets go of the request head once its callback has
        // continued, and this read fails there (the SDK then panics).
        if self.read_request_late {
            let saw = ["x-pw-tag", "x-remove-me", "x-forwarded-proto"]
                .map(|name| {
                    self.get_http_request_header(name)
                        .unwrap_or_else(|| "-".into())
                })
                .join(" ");
            self.set_http_response_header("x-pw-request-saw", Some(&saw));
        }
        Action::Continue
    }

    fn on_http_request_trailers(&mut self, trailers: usize) -> Action {
        if self.get_http_request_trailer("x-deny").is_some() {
            self.send_http_response(403, vec![], Some(b"denied by the filter's trailer check\n"));
            return Action::Pause;
        }
        self.set_http_request_trailer("x-remove-me", None);
        self.add_http_request_trailer("x-pw-trailers", &trailers.to_string());
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _trailers: usize) -> Action {
        let status = self
            .get_http_response_trailer("grpc-status")
            .unwrap_or_default();
        self.set_http_response_trailer("x-pw-grpc-status", Some(&status));
        Action::Continue
    }
}
