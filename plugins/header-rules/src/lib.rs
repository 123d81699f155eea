//! Header rules: add, set and remove request and response headers, and
//! CORS — preflight requests are answered locally, and allowed origins get
//! the `Access-Control-Allow-*` headers on responses.

use std::collections::BTreeMap;

use portcullis_sdk::{
    Decision, Header, HeaderEdits, Hooks, LocalResponse, Plugin, RequestHead, ResponseDecision,
    ResponseHead, RouteInfo, header,
};
use serde::Deserialize;

/// Edits for one direction.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Edits {
    #[serde(default)]
    add: BTreeMap<String, String>,
    #[serde(default)]
    set: BTreeMap<String, String>,
    #[serde(default)]
    remove: Vec<String>,
}

/// Fields that frame a message or describe one connection: the proxy
/// alone sets them (it would ignore the edit; saying so at `check` is
/// kinder than a silent no-op). The proxy's list (`portcullis_net::
/// framing`), which a plugin cannot link.
const FRAMING: [&str; 8] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
];

impl Edits {
    /// A field named in `direction`'s edits that no plugin may edit.
    fn refuse_framing(&self, direction: &str) -> Result<(), String> {
        let names = (self.add.keys())
            .chain(self.set.keys())
            .chain(self.remove.iter());
        for name in names {
            if FRAMING.iter().any(|f| f.eq_ignore_ascii_case(name)) {
                return Err(format!(
                    "`{direction}` edits `{name}`, which frames the message: the proxy alone sets it \
                     ({}), so remove it from the edits",
                    FRAMING.join(", ")
                ));
            }
        }
        Ok(())
    }

    fn to_wit(&self) -> HeaderEdits {
        HeaderEdits {
            remove: self.remove.iter().map(|n| n.to_ascii_lowercase()).collect(),
            set: self.set.iter().map(|(k, v)| header(k, v)).collect(),
            add: self.add.iter().map(|(k, v)| header(k, v)).collect(),
        }
    }
}

/// CORS settings.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cors {
    allow_origins: Vec<String>,
    #[serde(default = "default_methods")]
    allow_methods: Vec<String>,
    #[serde(default)]
    allow_headers: Vec<String>,
    #[serde(default)]
    expose_headers: Vec<String>,
    #[serde(default)]
    allow_credentials: bool,
    #[serde(default = "default_max_age")]
    max_age: u32,
}

fn default_methods() -> Vec<String> {
    ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        .map(String::from)
        .to_vec()
}

fn default_max_age() -> u32 {
    600
}

impl Cors {
    /// The `Access-Control-Allow-Origin` value for `origin`, if allowed.
    fn allow_origin(&self, origin: &str) -> Option<String> {
        let any = self.allow_origins.iter().any(|o| o == "*");
        if any && !self.allow_credentials {
            Some("*".into())
        } else if any || self.allow_origins.iter().any(|o| o == origin) {
            // `*` cannot go with credentials, so the origin is echoed.
            Some(origin.to_owned())
        } else {
            None
        }
    }

    /// Whether the answer depends on the request's `Origin` (anything but
    /// a plain `*`). Then every response says `Vary: Origin`, those to
    /// requests without one too: a cache that kept an answer without the
    /// CORS headers would otherwise serve it to a browser that needs them.
    fn varies_by_origin(&self) -> bool {
        self.allow_credentials || !self.allow_origins.iter().any(|o| o == "*")
    }

    fn common(&self, origin: String) -> Vec<Header> {
        let mut h = vec![header("access-control-allow-origin", &origin)];
        if self.allow_credentials {
            h.push(header("access-control-allow-credentials", "true"));
        }
        h
    }
}

/// The route's config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    request: Edits,
    #[serde(default)]
    response: Edits,
    cors: Option<Cors>,
}

struct HeaderRules;

impl Plugin for HeaderRules {
    type Config = Config;
    const HOOKS: Hooks = Hooks::REQUEST.union(Hooks::RESPONSE);

    fn validate(c: &Config) -> Result<(), String> {
        c.request.refuse_framing("request")?;
        c.response.refuse_framing("response")
    }

    fn on_request(
        c: &Config,
        req: &RequestHead,
        _route: &RouteInfo,
        _body: Option<&[u8]>,
    ) -> Decision {
        if let (Some(cors), Some(origin)) = (&c.cors, req.header_str("origin"))
            && req.method == "OPTIONS"
            && req.header("access-control-request-method").is_some()
        {
            let Some(allowed) = cors.allow_origin(&origin) else {
                return portcullis_sdk::respond(403, "origin not allowed");
            };
            let mut headers = cors.common(allowed);
            if cors.varies_by_origin() {
                headers.push(header("vary", "Origin"));
            }
            headers.push(header(
                "access-control-allow-methods",
                &cors.allow_methods.join(", "),
            ));
            let requested = req
                .header_str("access-control-request-headers")
                .unwrap_or_default();
            let allow_headers = if cors.allow_headers.is_empty() {
                requested
            } else {
                cors.allow_headers.join(", ")
            };
            if !allow_headers.is_empty() {
                headers.push(header("access-control-allow-headers", &allow_headers));
            }
            headers.push(header("access-control-max-age", &cors.max_age.to_string()));
            return Decision::Respond(LocalResponse {
                status: 204,
                headers,
                body: Vec::new(),
            });
        }
        portcullis_sdk::forward_with(c.request.to_wit())
    }

    fn on_response(
        c: &Config,
        req: &RequestHead,
        _route: &RouteInfo,
        _resp: &ResponseHead,
    ) -> ResponseDecision {
        portcullis_sdk::edit_response(response_edits(c, req))
    }
}

/// The response's header changes: the configured ones, and CORS's.
fn response_edits(c: &Config, req: &RequestHead) -> HeaderEdits {
    let mut edits = c.response.to_wit();
    let Some(cors) = &c.cors else {
        return edits;
    };
    // Added, not set: the upstream's own `Vary` (Accept-Encoding, say)
    // must survive, or caches mix up its variants.
    if cors.varies_by_origin() {
        edits.add.push(header("vary", "Origin"));
    }
    if let Some(origin) = req.header_str("origin")
        && let Some(allowed) = cors.allow_origin(&origin)
    {
        edits.set.extend(cors.common(allowed));
        if !cors.expose_headers.is_empty() {
            edits.set.push(header(
                "access-control-expose-headers",
                &cors.expose_headers.join(", "),
            ));
        }
    } else if !cors.varies_by_origin() {
        // A plain `*` does not vary, so it goes on every response, a
        // cached one included, whoever asked first.
        edits.set.push(header("access-control-allow-origin", "*"));
    }
    edits
}

portcullis_sdk::plugin!(HeaderRules);
