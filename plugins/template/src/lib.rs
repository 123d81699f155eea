//! A plugin to start from: it answers requests under `deny_prefix` with
//! 403 and, on every other request, tells the upstream who let it
//! through (`x-checked-by: <name>`). Edit `Config` and `on_request`.

use portcullis_sdk::{Decision, Plugin, RequestHead, RouteInfo};

/// The plugin's config: the `config:` of a route's plugin use, as JSON.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    /// Requests whose path starts with this are refused.
    deny_prefix: String,
    /// Put in `x-checked-by` on the requests let through.
    name: String,
}

struct MyPlugin;

impl Plugin for MyPlugin {
    type Config = Config;

    /// Refuses a config `portcullis check` (and a reload) should not take.
    fn validate(c: &Config) -> Result<(), String> {
        if !c.deny_prefix.starts_with('/') {
            return Err("`deny_prefix` must start with /".into());
        }
        Ok(())
    }

    fn on_request(c: &Config, req: &RequestHead, _: &RouteInfo, _: Option<&[u8]>) -> Decision {
        if req.path.starts_with(&c.deny_prefix) {
            // The proxy gives this its error shape: error, status, route, plugin.
            return portcullis_sdk::respond(403, "denied by my-plugin");
        }
        let mut edits = portcullis_sdk::no_edits();
        edits.set.push(portcullis_sdk::header("x-checked-by", &c.name));
        portcullis_sdk::forward_with(edits)
    }
}

portcullis_sdk::plugin!(MyPlugin);
