//! A filter that asks Redis before a request goes on, as Higress's
//! filters do through its host extension (`proxy_redis_init`,
//! `proxy_redis_call`, `proxy_on_redis_call_response`; not in the Rust
//! SDK, so declared here): with `x-redis: COMMAND ARG...` it sends the
//! command, RESP-encoded, to the cluster `outbound|6379||redis`, pauses,
//! and on the reply sets `x-redis-reply` (the reply, with CR and LF
//! written `\r` and `\n`) or, when none came, `x-redis-status` (the
//! callback's status), and lets the request go on. A call the host
//! refuses is `x-redis-refused: STATUS`.

use std::cell::RefCell;
use std::collections::HashMap;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType};

const CLUSTER: &str = "outbound|6379||redis";
/// Higress's buffer of a Redis call's reply.
const REDIS_CALL_RESPONSE: u32 = 9;

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    fn proxy_redis_init(
        cluster: *const u8,
        cluster_len: usize,
        user: *const u8,
        user_len: usize,
        password: *const u8,
        password_len: usize,
        timeout_ms: u32,
    ) -> u32;
    fn proxy_redis_call(
        cluster: *const u8,
        cluster_len: usize,
        query: *const u8,
        query_len: usize,
        token: *mut u32,
    ) -> u32;
    fn proxy_get_buffer_bytes(
        buffer: u32,
        start: usize,
        max: usize,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> u32;
}

thread_local! {
    /// The context each call in flight is for, by token.
    static WAITING: RefCell<HashMap<u32, u32>> = RefCell::new(HashMap::new());
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

/// Higress's callback for a Redis call's reply, on the root context.
#[unsafe(no_mangle)]
pub extern "C" fn proxy_on_redis_call_response(_root: u32, token: u32, status: u32, size: usize) {
    let Some(context) = WAITING.with(|w| w.borrow_mut().remove(&token)) else {
        return;
    };
    hostcalls::set_effective_context(context).unwrap();
    if status == 0 {
        let reply = reply(size);
        let shown = String::from_utf8_lossy(&reply)
            .replace('\r', "\\r")
            .replace('\n', "\\n");
        hostcalls::set_map_value(MapType::HttpRequestHeaders, "x-redis-reply", Some(&shown))
            .unwrap();
    } else {
        let status = status.to_string();
        hostcalls::set_map_value(MapType::HttpRequestHeaders, "x-redis-status", Some(&status))
            .unwrap();
    }
    hostcalls::resume_http_request().unwrap();
}

/// The reply's bytes, from buffer 9.
fn reply(size: usize) -> Vec<u8> {
    let (mut data, mut len) = (std::ptr::null_mut(), 0);
    let status =
        unsafe { proxy_get_buffer_bytes(REDIS_CALL_RESPONSE, 0, size, &mut data, &mut len) };
    if status != 0 || data.is_null() {
        return Vec::new();
    }
    // Allocated for the host by the SDK's allocator, handed over here.
    unsafe { Vec::from_raw_parts(data, len, len) }
}

/// `words` as a RESP array of bulk strings, as a Redis client sends a
/// command.
fn resp(words: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", words.len()).into_bytes();
    for word in words {
        out.extend_from_slice(format!("${}\r\n{word}\r\n", word.len()).as_bytes());
    }
    out
}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let none = b"";
        unsafe {
            proxy_redis_init(
                CLUSTER.as_ptr(),
                CLUSTER.len(),
                none.as_ptr(),
                0,
                none.as_ptr(),
                0,
                500,
            );
        }
        true
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter { context_id }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter {
    context_id: u32,
}

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(command) = self.get_http_request_header("x-redis") else {
            return Action::Continue;
        };
        let words: Vec<&str> = command.split_whitespace().collect();
        let query = resp(&words);
        let mut token = 0;
        let status = unsafe {
            proxy_redis_call(
                CLUSTER.as_ptr(),
                CLUSTER.len(),
                query.as_ptr(),
                query.len(),
                &mut token,
            )
        };
        if status != 0 {
            self.set_http_request_header("x-redis-refused", Some(&status.to_string()));
            return Action::Continue;
        }
        WAITING.with(|w| w.borrow_mut().insert(token, self.context_id));
        Action::Pause
    }
}
