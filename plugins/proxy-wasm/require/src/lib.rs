//! The header-only check of the component SDK's example
//! (`example-require-header`) as an Envoy filter: a request without the
//! header its configuration names (default `x-api-key`) is answered 401;
//! any other goes on untouched. The benchmark's proxy-wasm filter
//! (bench/plugins.sh), run alike in Portcullis and in Envoy.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { header: "x-api-key".into() })
    });
}}

struct Root {
    header: String,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        if let Some(config) = self.get_plugin_configuration() {
            match String::from_utf8(config) {
                Ok(name) if !name.trim().is_empty() => self.header = name.trim().to_owned(),
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Require {
            header: self.header.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Require {
    header: String,
}

impl Context for Require {}

impl HttpContext for Require {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if self.get_http_request_header(&self.header).is_some() {
            return Action::Continue;
        }
        self.send_http_response(401, vec![], Some(b"missing credentials\n"));
        Action::Pause
    }
}
