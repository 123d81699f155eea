//! Response compression (a route's `compress`): gzip for clients that
//! accept it, as the nginx this replaces did (`gzip on`), streamed frame
//! by frame.
//!
//! Each frame the upstream sends is compressed and flushed (a deflate
//! sync flush: a few bytes each) before the next is awaited, so a slow
//! stream (a long poll, NDJSON) reaches the client as promptly as it
//! would uncompressed; nothing is held back to fill a block. The
//! compressed body has no known length, so `Content-Length` goes, and a
//! strong `ETag` becomes weak (the bytes differ from the upstream's), as
//! nginx does.

use std::io::Write;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use flate2::write::GzEncoder;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use http_body::{Body as _, Frame};

use crate::body::{Body, BodyError};

/// A route's compression settings.
#[derive(Debug, Clone)]
pub struct Compression {
    /// Media types compressed: `type/subtype` exactly, or `type/*`.
    pub types: Vec<String>,
    /// Responses declaring a shorter `Content-Length` are sent as they are.
    pub min_size: u64,
    /// gzip level, 1 (fastest) to 9 (smallest).
    pub level: u32,
}

/// Compressed unless a route lists its own: text and the structured
/// formats an API answers with (any `+json` or `+xml` type too). Not
/// `text/event-stream`: an event stream is flushed event by event anyway,
/// and some clients and proxies in between handle it compressed badly.
pub const DEFAULT_TYPES: &[&str] = &[
    "text/html",
    "text/plain",
    "text/css",
    "text/csv",
    "text/xml",
    "text/javascript",
    "text/markdown",
    "application/javascript",
    "application/json",
    "application/x-ndjson",
    "application/xml",
    "application/wasm",
    "image/svg+xml",
];

/// Below this, compressing saves little and costs a compressor's set-up.
pub const DEFAULT_MIN_SIZE: u64 = 1024;
/// nginx's default: on a 64 KiB workflow list (`bench/compress.sh`)
/// level 1 compressed 12.7x at 665 MB/s per core, level 5 15.4x at 225.
pub const DEFAULT_LEVEL: u32 = 1;

impl Compression {
    /// Whether responses of this `Content-Type` are compressed.
    fn covers(&self, content_type: &HeaderValue) -> bool {
        let Ok(value) = content_type.to_str() else {
            return false;
        };
        let media = value.split(';').next().unwrap_or("").trim();
        let media = media.to_ascii_lowercase();
        let Some((kind, sub)) = media.split_once('/') else {
            return false;
        };
        if sub.ends_with("+json") || sub.ends_with("+xml") {
            return true;
        }
        self.types.iter().any(|t| match t.strip_suffix("/*") {
            Some(prefix) => prefix == kind,
            None => *t == media,
        })
    }
}

/// Whether a request's `Accept-Encoding` takes gzip (RFC 9110 §12.5.3:
/// `gzip` or `x-gzip`, or `*` when gzip is not named, with a weight
/// above zero).
pub fn accepts_gzip(headers: &HeaderMap) -> bool {
    let mut star = false;
    for value in headers.get_all(header::ACCEPT_ENCODING) {
        let Ok(value) = value.to_str() else { continue };
        for item in value.split(',') {
            let mut parts = item.split(';');
            let coding = parts.next().unwrap_or("").trim();
            let weighted_out = parts.any(|p| {
                let p = p.trim();
                p.strip_prefix("q=")
                    .or_else(|| p.strip_prefix("Q="))
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            if coding.eq_ignore_ascii_case("gzip") || coding.eq_ignore_ascii_case("x-gzip") {
                return !weighted_out;
            }
            if coding == "*" {
                star = !weighted_out;
            }
        }
    }
    star
}

/// Compresses `resp` with gzip when the route compresses its type, the
/// client takes gzip (`accepts`) and nothing rules it out: a body already
/// encoded, `Cache-Control: no-transform`, a status without a body or a
/// partial one (206), a declared length under the minimum, a HEAD
/// request. A compressible response says `Vary: Accept-Encoding` either
/// way, so a cache in between keeps the two apart.
pub fn apply(
    settings: &Compression,
    accepts: bool,
    head: bool,
    resp: Response<Body>,
) -> Response<Body> {
    let status = resp.status();
    if status.is_informational()
        || matches!(
            status,
            StatusCode::NO_CONTENT | StatusCode::PARTIAL_CONTENT | StatusCode::NOT_MODIFIED
        )
    {
        return resp;
    }
    let headers = resp.headers();
    let typed = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| settings.covers(t));
    let encoded = headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"));
    if !typed || encoded || no_transform(headers) {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    add_vary(&mut parts.headers);
    let short = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|l| l.to_str().ok()?.parse::<u64>().ok())
        .is_some_and(|len| len < settings.min_size);
    let empty = body.is_end_stream();
    if !accepts || short || empty || head {
        return Response::from_parts(parts, body);
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(header::ACCEPT_RANGES);
    parts
        .headers
        .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    if let Some(etag) = parts.headers.get(header::ETAG)
        && !etag.as_bytes().starts_with(b"W/")
        && let Ok(weak) = HeaderValue::from_bytes(&[b"W/", etag.as_bytes()].concat())
    {
        parts.headers.insert(header::ETAG, weak);
    }
    let gzip = Gzip {
        inner: body,
        encoder: Some(GzEncoder::new(
            Vec::new(),
            flate2::Compression::new(settings.level),
        )),
        trailers: None,
    };
    Response::from_parts(parts, Body::boxed(gzip))
}

fn no_transform(headers: &HeaderMap) -> bool {
    headers.get_all(header::CACHE_CONTROL).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|d| d.trim().eq_ignore_ascii_case("no-transform"))
        })
    })
}

fn add_vary(headers: &mut HeaderMap) {
    let named = headers.get_all(header::VARY).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',').any(|f| {
                let f = f.trim();
                f == "*" || f.eq_ignore_ascii_case("accept-encoding")
            })
        })
    });
    if !named {
        headers.append(header::VARY, HeaderValue::from_static("accept-encoding"));
    }
}

pin_project_lite::pin_project! {
    /// A body compressed with gzip as it streams.
    struct Gzip {
        #[pin]
        inner: Body,
        // `None` once the gzip trailer is out.
        encoder: Option<GzEncoder<Vec<u8>>>,
        // The upstream's trailers, sent after the gzip stream ends.
        trailers: Option<HeaderMap>,
    }
}

impl http_body::Body for Gzip {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        loop {
            let Some(encoder) = this.encoder.as_mut() else {
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            };
            match ready!(this.inner.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        if data.is_empty() {
                            continue;
                        }
                        // Writing into a Vec does not fail; the compressor
                        // itself reports no other error.
                        encoder.write_all(&data)?;
                        encoder.flush()?;
                        let out = std::mem::take(encoder.get_mut());
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out.into()))));
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            *this.trailers = Some(trailers);
                        }
                        return Poll::Ready(Some(finish(this.encoder)));
                    }
                },
                Some(Err(e)) => {
                    // Cut short upstream, cut short here: no gzip trailer,
                    // so the client sees the body is incomplete.
                    *this.encoder = None;
                    return Poll::Ready(Some(Err(e)));
                }
                None => return Poll::Ready(Some(finish(this.encoder))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.encoder.is_none() && self.trailers.is_none()
    }
}

/// The end of the gzip stream (the last block and the CRC and length).
fn finish(encoder: &mut Option<GzEncoder<Vec<u8>>>) -> Result<Frame<Bytes>, BodyError> {
    let encoder = encoder.take().ok_or("the gzip stream has already ended")?;
    Ok(Frame::data(encoder.finish()?.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(accept: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for a in accept {
            h.append(header::ACCEPT_ENCODING, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn accept_encoding_is_read_with_its_weights() {
        for yes in [
            "gzip",
            "br, gzip;q=0.5",
            "deflate, GZIP",
            "x-gzip",
            "*",
            "br;q=1, *;q=0.1",
            "gzip ; q=1.0",
        ] {
            assert!(accepts_gzip(&headers(&[yes])), "{yes}");
        }
        for no in [
            "",
            "br",
            "identity",
            "gzip;q=0",
            "*;q=0",
            "gzip;q=0, *",
            "br, deflate",
        ] {
            assert!(!accepts_gzip(&headers(&[no])), "{no}");
        }
        assert!(accepts_gzip(&headers(&["br", "gzip"])));
    }

    fn settings() -> Compression {
        Compression {
            types: DEFAULT_TYPES.iter().map(|s| s.to_string()).collect(),
            min_size: DEFAULT_MIN_SIZE,
            level: DEFAULT_LEVEL,
        }
    }

    #[test]
    fn types_match_exactly_by_family_or_by_suffix() {
        let s = settings();
        for yes in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/vnd.api+json",
            "application/atom+xml",
            "text/html;charset=utf-8",
        ] {
            assert!(s.covers(&HeaderValue::from_static(yes)), "{yes}");
        }
        for no in [
            "image/png",
            "text/event-stream",
            "application/octet-stream",
            "json",
        ] {
            assert!(!s.covers(&HeaderValue::from_static(no)), "{no}");
        }
        let family = Compression {
            types: vec!["text/*".into()],
            ..settings()
        };
        assert!(family.covers(&HeaderValue::from_static("text/event-stream")));
        assert!(!family.covers(&HeaderValue::from_static("application/json")));
    }
}
