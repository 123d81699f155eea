//! A filter that misbehaves on request: `x-misbehave: loop` spins for
//! ever, `trap` panics, `hoard` allocates without bound. Otherwise it
//! answers with how many requests its VM has seen (`x-vm-requests`), so a
//! test can tell a fresh VM from the old one.

use std::cell::Cell;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

thread_local! {
    static SEEN: Cell<u64> = const { Cell::new(0) };
}

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter { seen: 0 }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter {
    seen: u64,
}

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
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
        Action::Continue
    }
}
