//! An external-authorization filter as Envoy users write them: asks the
//! upstream its configuration names (`GET /check` with the request's
//! `authorization`), then lets the request on with the user the answer
//! names (`x-user`, and the answer's body in `x-auth-body`), or answers
//! 401 itself.

use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { upstream: String::new() })
    });
}}

struct Root {
    upstream: String,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        self.upstream = String::from_utf8_lossy(&config).into_owned();
        !self.upstream.is_empty()
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Auth {
            upstream: self.upstream.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Auth {
    upstream: String,
}

impl HttpContext for Auth {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let token = self
            .get_http_request_header("authorization")
            .unwrap_or_default();
        let asked = self.dispatch_http_call(
            &self.upstream,
            vec![
                (":method", "GET"),
                (":path", "/check"),
                (":authority", "authz.local"),
                ("authorization", &token),
            ],
            None,
            vec![],
            Duration::from_secs(2),
        );
        if let Err(status) = asked {
            self.send_http_response(
                500,
                vec![("x-dispatch-error", &format!("{status:?}"))],
                None,
            );
        }
        Action::Pause
    }
}

impl Context for Auth {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let status = self.get_http_call_response_header(":status");
        if status.as_deref() == Some("200") {
            let user = self
                .get_http_call_response_header("x-user")
                .unwrap_or_default();
            let body = self
                .get_http_call_response_body(0, body_size)
                .unwrap_or_default();
            self.set_http_request_header("x-user", Some(&user));
            self.set_http_request_header("x-auth-body", Some(&String::from_utf8_lossy(&body)));
            self.resume_http_request();
            return;
        }
        let status = status.unwrap_or_else(|| "none".to_owned());
        self.send_http_response(
            401,
            vec![("x-auth-status", &status)],
            Some(b"unauthorized\n"),
        );
    }
}
