//! The smallest useful policy: refuse requests that lack a header.
//!
//! ```yaml
//! plugins: [{ name: require-header, path: example-require-header.wasm }]
//! routes:
//!   - name: api
//!     match: { path_prefix: /api }
//!     upstream: api
//!     plugins: [{ use: require-header, config: { header: x-api-key } }]
//! ```

use portcullis_sdk::{Decision, Plugin, RequestHead, RouteInfo};

#[derive(serde::Deserialize)]
struct Config {
    header: String,
}

struct RequireHeader;

impl Plugin for RequireHeader {
    type Config = Config;

    fn on_request(c: &Config, req: &RequestHead, _: &RouteInfo, _: Option<&[u8]>) -> Decision {
        match req.header(&c.header) {
            Some(_) => portcullis_sdk::forward(),
            None => portcullis_sdk::respond(403, "missing header"),
        }
    }
}

portcullis_sdk::plugin!(RequireHeader);
