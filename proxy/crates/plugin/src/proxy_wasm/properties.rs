//! `proxy_get_property`: the attributes filters read most, in Envoy's
//! encodings (strings as their bytes, integers as 8 bytes little-endian,
//! booleans as one byte). A path is its segments joined by NUL
//! (`request\0path`). A path that is no attribute is the filter state
//! the request's context set there (`proxy_set_property`); others are
//! `NotFound`, as in Envoy for an attribute it does not have.

use super::VmState;

/// The value of the attribute at `path`.
pub fn get(state: &VmState, path: &[u8]) -> Option<Vec<u8>> {
    let segments: Vec<&[u8]> = path.split(|b| *b == 0).collect();
    let call = &state.call;
    let text = |s: &str| Some(s.as_bytes().to_vec());
    match segments.as_slice() {
        [b"plugin_name"] => text(&state.plugin),
        [b"plugin_root_id"] => text(&state.root_id),
        [b"response", b"code"] => call.status.map(|s| i64::from(s).to_le_bytes().to_vec()),
        [b"request", rest @ ..] => {
            let facts = call.facts()?;
            match rest {
                [b"path"] => text(match (&call.path, &facts.rewritten) {
                    (Some(p), _) => p.as_str(),
                    (None, Some(pq)) => pq.as_str(),
                    (None, None) => facts.uri.path_and_query().map_or("/", |p| p.as_str()),
                }),
                [b"url_path"] => text(facts.uri.path()),
                [b"method"] => text(facts.method.as_str()),
                [b"scheme"] => text(if facts.tls { "https" } else { "http" }),
                [b"host"] => match facts.uri.authority() {
                    Some(a) => text(a.as_str()),
                    None => Some(
                        call.request_headers()
                            .get(http::header::HOST)?
                            .as_bytes()
                            .to_vec(),
                    ),
                },
                [b"query"] => text(facts.uri.query().unwrap_or("")),
                [b"id"] => Some(
                    call.request_headers()
                        .get("x-request-id")?
                        .as_bytes()
                        .to_vec(),
                ),
                [b"headers", name] => {
                    let name = http::HeaderName::from_bytes(name).ok()?;
                    Some(call.request_headers().get(name)?.as_bytes().to_vec())
                }
                _ => None,
            }
        }
        [b"source", b"address"] => text(&call.facts()?.client.to_canonical().to_string()),
        [b"connection", b"mtls"] => Some(vec![u8::from(call.facts()?.client_cert.is_some())]),
        [b"route_name"] => {
            let facts = call.facts()?;
            text(facts.route_name(state.route.as_ref(), &state.route_names)?)
        }
        _ => {
            let value = state.filter_state.get(state.context, path)?;
            Some(value.to_vec())
        }
    }
}
