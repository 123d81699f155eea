//! What a plugin is told of a request, and its header edits applied.

use super::*;

/// What a plugin's view of the request is made from. The WIT records
/// (`request-head`, `route-info`, six strings and a list) are built from
/// these only when a plugin asks for them, which most header checks never do.
#[derive(Debug, Clone)]
pub struct RequestFacts {
    /// Method.
    pub method: http::Method,
    /// The request target as received (a clone shares its bytes).
    pub uri: http::Uri,
    /// The normalized path, when it differs from the target's.
    pub normalized: Option<String>,
    /// The path and query a plugin set; later plugins see it.
    pub rewritten: Option<http::uri::PathAndQuery>,
    /// The client's address.
    pub client: std::net::IpAddr,
    /// Whether the client connection is TLS.
    pub tls: bool,
    /// The server name the client asked for in its TLS handshake.
    pub sni: Option<std::sync::Arc<str>>,
    /// The client's verified certificate (mutual TLS).
    pub client_cert: Option<Arc<portcullis_net::client_cert::ClientCertificate>>,
    /// The route's index in the config.
    pub route: usize,
    /// The route's path parameters (empty for routes without any).
    pub params: Vec<(String, String)>,
    /// Whether the request has no body (its head ended it).
    pub bodiless: bool,
}

impl RequestFacts {
    /// The request head as plugins see it; `headers` supplies the host
    /// when the target has no authority (HTTP/1.1 origin form).
    pub fn head(&self, headers: &http::HeaderMap) -> RequestHead {
        let authority = self
            .uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| {
                headers
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        let (path, query) = match &self.rewritten {
            Some(pq) => (pq.path(), pq.query()),
            None => (
                self.normalized.as_deref().unwrap_or(self.uri.path()),
                self.uri.query(),
            ),
        };
        RequestHead {
            method: self.method.as_str().to_owned(),
            scheme: if self.tls { "https" } else { "http" }.to_owned(),
            authority,
            path: path.to_owned(),
            query: query.map(str::to_owned),
            client_addr: self.client.to_canonical().to_string(),
            tls: self.tls,
            sni: self.sni.as_deref().map(str::to_owned),
        }
    }

    /// The name of the request's route: `own`, the route of a use on a
    /// route (which a use kept across a reload knows whatever the route's
    /// index now), or for a global use the name at its index in `names`.
    pub fn route_name<'a>(
        &self,
        own: Option<&'a Arc<str>>,
        names: &'a [Arc<str>],
    ) -> Option<&'a Arc<str>> {
        own.or_else(|| names.get(self.route))
    }

    /// The route as plugins see it.
    pub fn route_info(&self, own: Option<&Arc<str>>, names: &[Arc<str>]) -> RouteInfo {
        RouteInfo {
            name: self
                .route_name(own, names)
                .map_or_else(String::new, |n| n.to_string()),
            params: self.params.clone(),
        }
    }
}

/// Headers in the plugin's form.
pub fn to_wit_headers(headers: &http::HeaderMap) -> Vec<Header> {
    headers
        .iter()
        .map(|(k, v)| Header {
            name: k.as_str().to_owned(),
            value: v.as_bytes().to_vec(),
        })
        .collect()
}

/// Applies a plugin's header edits; invalid names or values are skipped
/// and reported, and edits of the fields that frame the message are
/// ignored and counted (`containment::may_edit`).
pub fn apply_edits(headers: &mut http::HeaderMap, edits: &HeaderEdits, plugin: &Arc<str>) {
    use crate::containment::Edit;
    use http::{HeaderName, HeaderValue};
    for name in &edits.remove {
        if let Ok(n) = HeaderName::from_bytes(name.as_bytes())
            && crate::containment::may_edit(plugin, n.as_str(), Edit::Remove)
        {
            headers.remove(n);
        }
    }
    let valid = |h: &Header| match (
        HeaderName::from_bytes(h.name.as_bytes()),
        HeaderValue::from_bytes(&h.value),
    ) {
        (Ok(n), Ok(v)) => {
            crate::containment::may_edit(plugin, n.as_str(), Edit::Set).then_some((n, v))
        }
        _ => {
            tracing::warn!(plugin = &**plugin, header = %h.name, "plugin set an invalid header; skipped");
            None
        }
    };
    for h in &edits.set {
        if let Some((n, v)) = valid(h) {
            headers.insert(n, v);
        }
    }
    for h in &edits.add {
        if let Some((n, v)) = valid(h) {
            headers.append(n, v);
        }
    }
}
