//! A plugin's own answers: made into the client's answer (in the proxy's
//! error shape when it is a bare error, framed by the proxy, only with a
//! final status), and passed through the response hooks of the plugins
//! the request went through, as Envoy passes a filter's local reply.

use super::*;

/// A plugin's own answer. An error answer (4xx, 5xx) with no body, or
/// with the SDK's `{"error": message}` alone, gets the shape of the
/// proxy's own errors (`error`, `status`, `route`, `plugin`, and gRPC's
/// terms for a gRPC client), so clients parse one shape whoever refused
/// them; any other body is the plugin's and goes as it is.
pub(super) fn local_answer(
    binding: &dyn Plugin,
    route: &Route,
    local: LocalAnswer,
) -> Response<Body> {
    if local.reset {
        return crate::answers::reset();
    }
    // Only a final answer: a 1xx is none (a client that asked for no
    // upgrade would wait on a 101 for ever).
    let Some(status) = StatusCode::from_u16(local.status)
        .ok()
        .filter(|s| (200..=599).contains(&s.as_u16()))
    else {
        let message = format!("plugin answered with status {}, not 200-599", local.status);
        tracing::warn!(plugin = %binding.name(), route = %route.name, "{message}");
        return misbehaved(binding, route, &message);
    };
    let shaped = local
        .error_shape
        .then(|| error_message(status, &local.body))
        .flatten();
    let mut resp = match shaped {
        Some(message) => json_error(status, &message, route, Some(binding.name())),
        None => {
            let mut resp = Response::new(Body::full(local.body.clone()));
            *resp.status_mut() = status;
            if let plugin::GrpcReply::TrailersOnly(code) = local.grpc {
                let message = String::from_utf8_lossy(&local.body).into();
                let marker = crate::grpc_local::LocalError(message, code);
                resp.extensions_mut().insert(marker);
            }
            resp
        }
    };
    let ours = resp.headers().contains_key(header::CONTENT_TYPE);
    let mut name = None;
    for (n, value) in local.headers {
        // `None`: another value of the field before.
        name = n.or(name);
        let Some(n) = &name else { continue };
        // The body's own fields are the proxy's (the plugin's hosts let
        // no framing field through; this is the last word on it).
        if (ours && *n == header::CONTENT_TYPE) || portcullis_net::framing::is_framing(n.as_str()) {
            continue;
        }
        resp.headers_mut().append(n.clone(), value);
    }
    resp
}

/// A plugin's own answer on its way out through the response hooks of
/// the plugins up to it (last first) that see local answers, as Envoy
/// sends a filter's local reply through the filters it has passed.
#[allow(clippy::result_large_err)] // unboxed as everywhere on this path
pub(super) fn local_through(
    chain: &[Arc<dyn Plugin>],
    upto: usize,
    progress: &mut Progress<'_>,
    request_headers: &mut http::HeaderMap,
    route: &Route,
    resp: Response<Body>,
) -> Response<Body> {
    let (mut parts, body) = resp.into_parts();
    let mut bytes = body.in_memory().unwrap_or_default();
    // Not forwarded: the proxy's fields are not in it, nor to add.
    let mut none = plugin::Forwarded::default();
    let passed = chain[..=upto].iter().enumerate().rev();
    for (place, binding) in passed.filter(|(_, b)| b.hooks().response && b.hooks().local_answers) {
        let mut stream = progress.streams.get(place);
        let context = &mut *progress.0;
        let facts = &mut context.facts;
        let lent = lend(
            facts,
            (request_headers, &mut none),
            &mut parts,
            bytes.is_empty(),
        );
        let called = binding.on_response(&mut stream, lent);
        let notes = &mut context.notes;
        let mut note = |n: plugin::Noted| notes.get_or_insert_default().0.push(n);
        // Its body in hand: given whole to a plugin that wants it.
        let called = match called {
            Ok(ResponseVerdict::ReadBody(_)) => Ok(true),
            Ok(ResponseVerdict::Noted(noted)) => {
                note(*noted);
                Ok(binding.hooks().response_body && !bytes.is_empty())
            }
            Ok(ResponseVerdict::Continue) => Ok(binding.hooks().response_body && !bytes.is_empty()),
            Ok(ResponseVerdict::Respond(local)) => Err(Ok(local)),
            Err(e) => Err(Err(e)),
        }
        .and_then(|wants_body| {
            if !wants_body {
                return Ok(());
            }
            let lent = lend(facts, (request_headers, &mut none), &mut parts, true);
            match binding.on_response_body(&mut stream, lent, &bytes) {
                Ok(plugin::BodyVerdict::Continue(Some(new))) => {
                    parts
                        .headers
                        .insert(header::CONTENT_LENGTH, new.len().into());
                    bytes = new;
                    Ok(())
                }
                Ok(plugin::BodyVerdict::Continue(None) | plugin::BodyVerdict::Pause) => Ok(()),
                Ok(plugin::BodyVerdict::Noted(noted)) => {
                    note(*noted);
                    Ok(())
                }
                Ok(plugin::BodyVerdict::Respond(local)) => Err(Ok(local)),
                Err(e) => Err(Err(e)),
            }
        });
        progress.streams.set(place, stream);
        match called {
            Ok(()) => {}
            Err(Ok(local)) => return local_answer(&**binding, route, *local),
            Err(Err(e)) => {
                if let Some(answer) = fail(&**binding, route, &e) {
                    return answer;
                }
            }
        }
    }
    Response::from_parts(parts, Body::full(bytes))
}

/// The message of a plugin's error answer that takes the proxy's error
/// shape (see [`local_answer`]); `None` for any other answer.
pub fn error_message(status: StatusCode, body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct SdkError {
        error: String,
    }
    if !(status.is_client_error() || status.is_server_error()) {
        return None;
    }
    if body.is_empty() {
        let reason = status.canonical_reason().unwrap_or("error");
        return Some(reason.to_ascii_lowercase());
    }
    // The SDK's bodies are a few dozen bytes: a large one is the plugin's own.
    if body.len() > 1024 || body.first() != Some(&b'{') {
        return None;
    }
    serde_json::from_slice::<SdkError>(body)
        .ok()
        .map(|e| e.error)
}

/// The 500 for a plugin that answered something the proxy cannot carry out.
pub(super) fn misbehaved(binding: &dyn Plugin, route: &Route, message: &str) -> Response<Body> {
    json_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        message,
        route,
        Some(binding.name()),
    )
}
