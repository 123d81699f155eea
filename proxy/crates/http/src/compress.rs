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

pub use portcullis_config::{Compression, DEFAULT_BROTLI};
use portcullis_forward::{Body, BodyError};

/// brotli's window: 256 KiB, not its 4 MiB default, which it would
/// allocate per response in flight.
const BROTLI_WINDOW_BITS: u32 = 18;

/// A content coding the proxy compresses with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Brotli,
}

impl Coding {
    fn token(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Brotli => "br",
        }
    }
}

/// The coding to answer a request with, by its `Accept-Encoding` (RFC
/// 9110 §12.5.3, weights read: `gzip;q=0` refuses gzip, `*` stands for a
/// coding not named): brotli when the route has it and the client weighs
/// it at least as high as gzip (browsers send `gzip, deflate, br, zstd`),
/// else gzip, else none.
pub fn negotiate(headers: &HeaderMap, settings: &Compression) -> Option<Coding> {
    let (mut gzip, mut br, mut star) = (None, None, None);
    for value in headers.get_all(header::ACCEPT_ENCODING) {
        let Ok(value) = value.to_str() else { continue };
        for item in value.split(',') {
            let mut parts = item.split(';');
            let coding = parts.next().unwrap_or("").trim();
            let weight = parts
                .find_map(|p| {
                    let p = p.trim();
                    p.strip_prefix("q=").or_else(|| p.strip_prefix("Q="))
                })
                .map_or(1.0, |q| q.trim().parse::<f32>().unwrap_or(0.0));
            if coding.eq_ignore_ascii_case("gzip") || coding.eq_ignore_ascii_case("x-gzip") {
                gzip = Some(weight);
            } else if coding.eq_ignore_ascii_case("br") {
                br = Some(weight);
            } else if coding == "*" {
                star = Some(weight);
            }
        }
    }
    let gzip = gzip.or(star).unwrap_or(0.0);
    let br = br.or(star).unwrap_or(0.0);
    if settings.brotli.is_some() && br > 0.0 && br >= gzip {
        Some(Coding::Brotli)
    } else if gzip > 0.0 {
        Some(Coding::Gzip)
    } else {
        None
    }
}

/// Compresses `resp` with `coding` (what the client takes, if anything)
/// when the route compresses its type and nothing rules it out: a body already
/// encoded, `Cache-Control: no-transform`, a status without a body or a
/// partial one (206), a length under the minimum (the body's own when it
/// knows it, else its declared one), a HEAD request. A compressible
/// response says `Vary: Accept-Encoding` either way, so a cache in
/// between keeps the two apart; not one whose length is under the
/// minimum, which no client gets compressed (nginx's `gzip_vary` the
/// same).
pub fn apply(
    settings: &Compression,
    coding: Option<Coding>,
    head: bool,
    mut resp: Response<Body>,
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
    // The body's own exact length, when it knows it, is its declared
    // one (the upstream reader's is read from `Content-Length`): parsing
    // the field again cost ~200 instructions a response. Not a HEAD
    // answer's: its body is empty, its field the GET's length.
    let exact = (!head)
        .then(|| http_body::Body::size_hint(resp.body()).exact())
        .flatten();
    // A body shorter than the minimum by its own length is sent as it
    // is, and does not vary, whatever its fields say: decided before
    // they are read (~400 instructions a response), as nginx checks the
    // length first.
    if exact.is_some_and(|len| len < settings.min_size) {
        return resp;
    }
    let Some(Fields { short, vary_named }) = compressible(resp.headers(), settings, exact) else {
        return resp;
    };
    // Too short to be compressed for anyone: the answer does not vary.
    if short {
        return resp;
    }
    if !vary_named {
        resp.headers_mut()
            .append(header::VARY, HeaderValue::from_static("accept-encoding"));
    }
    let empty = resp.body().is_end_stream();
    let Some(coding) = coding.filter(|_| !(empty || head)) else {
        return resp;
    };
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(header::ACCEPT_RANGES);
    parts.headers.insert(
        header::CONTENT_ENCODING,
        HeaderValue::from_static(coding.token()),
    );
    if let Some(etag) = parts.headers.get(header::ETAG)
        && !etag.as_bytes().starts_with(b"W/")
        && let Ok(weak) = HeaderValue::from_bytes(&[b"W/", etag.as_bytes()].concat())
    {
        parts.headers.insert(header::ETAG, weak);
    }
    let encoder = match coding {
        Coding::Gzip => Encoder::Gzip(GzEncoder::new(
            Vec::new(),
            flate2::Compression::new(settings.level),
        )),
        Coding::Brotli => Encoder::Brotli(Box::new(brotli::CompressorWriter::new(
            Vec::new(),
            4096,
            settings.brotli.unwrap_or(DEFAULT_BROTLI),
            BROTLI_WINDOW_BITS,
        ))),
    };
    let compressed = Compressed {
        inner: body,
        encoder: Some(encoder),
        trailers: None,
    };
    Response::from_parts(parts, Body::boxed(compressed))
}

/// What decides a response's compression besides its coding.
struct Fields {
    /// A declared length under the route's minimum.
    short: bool,
    /// `Vary` already names `Accept-Encoding` (or is `*`).
    vary_named: bool,
}

/// The fields of a response the route may compress, read in one pass over
/// the head (five lookups cost ~1,000 instructions a response); `None` when
/// its type is not the route's, it is already encoded, or `Cache-Control`
/// says `no-transform`.
fn compressible(headers: &HeaderMap, settings: &Compression, exact: Option<u64>) -> Option<Fields> {
    let (mut typed, mut typed_seen) = (false, false);
    let mut fields = Fields {
        short: false,
        vary_named: false,
    };
    let mut length_seen = false;
    for (name, value) in headers {
        if *name == header::CONTENT_TYPE {
            // The first, as a lookup would give.
            if !typed_seen {
                typed = settings.covers(value);
                typed_seen = true;
            }
        } else if *name == header::CONTENT_ENCODING {
            if !value.as_bytes().eq_ignore_ascii_case(b"identity") {
                return None;
            }
        } else if *name == header::CACHE_CONTROL {
            if lists(value, |d| d.eq_ignore_ascii_case("no-transform")) {
                return None;
            }
        } else if *name == header::VARY {
            fields.vary_named |= lists(value, |f| {
                f == "*" || f.eq_ignore_ascii_case("accept-encoding")
            });
        } else if *name == header::CONTENT_LENGTH && !length_seen {
            length_seen = true;
            let declared = exact.or_else(|| value.to_str().ok()?.parse::<u64>().ok());
            fields.short = declared.is_some_and(|len| len < settings.min_size);
        }
    }
    typed.then_some(fields)
}

/// Whether a comma-separated field value lists an item `is` picks.
fn lists(value: &HeaderValue, is: impl Fn(&str) -> bool) -> bool {
    value
        .to_str()
        .is_ok_and(|v| v.split(',').any(|item| is(item.trim())))
}

/// A streaming compressor writing into a buffer the body drains.
enum Encoder {
    Gzip(GzEncoder<Vec<u8>>),
    /// Boxed: its state is large, and lives as long as the response.
    Brotli(Box<brotli::CompressorWriter<Vec<u8>>>),
}

impl Encoder {
    /// Compresses `data` and flushes: what it gives can be decoded at once.
    fn push(&mut self, data: &[u8]) -> std::io::Result<Vec<u8>> {
        match self {
            Encoder::Gzip(e) => {
                e.write_all(data)?;
                e.flush()?;
                Ok(std::mem::take(e.get_mut()))
            }
            Encoder::Brotli(e) => {
                e.write_all(data)?;
                e.flush()?;
                Ok(std::mem::take(e.get_mut()))
            }
        }
    }

    /// Ends the stream (gzip's trailer, brotli's last meta-block).
    fn finish(self) -> std::io::Result<Vec<u8>> {
        match self {
            Encoder::Gzip(e) => e.finish(),
            Encoder::Brotli(e) => Ok(e.into_inner()),
        }
    }
}

pin_project_lite::pin_project! {
    /// A body compressed as it streams.
    struct Compressed {
        #[pin]
        inner: Body,
        // `None` once the end of the compressed stream is out.
        encoder: Option<Encoder>,
        // The upstream's trailers, sent after the gzip stream ends.
        trailers: Option<HeaderMap>,
    }
}

impl http_body::Body for Compressed {
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
                        let out = encoder.push(&data)?;
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
                    // Cut short upstream, cut short here: no end of the
                    // compressed stream, so the client sees the body is
                    // incomplete.
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

/// The end of the compressed stream.
fn finish(encoder: &mut Option<Encoder>) -> Result<Frame<Bytes>, BodyError> {
    let encoder = encoder
        .take()
        .ok_or("the compressed stream has already ended")?;
    Ok(Frame::data(encoder.finish()?.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use portcullis_config::{DEFAULT_LEVEL, DEFAULT_MIN_SIZE, DEFAULT_TYPES};

    fn headers(accept: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for a in accept {
            h.append(header::ACCEPT_ENCODING, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    fn settings() -> Compression {
        Compression {
            types: DEFAULT_TYPES.iter().map(|s| s.to_string()).collect(),
            min_size: DEFAULT_MIN_SIZE,
            level: DEFAULT_LEVEL,
            brotli: Some(DEFAULT_BROTLI),
        }
    }

    #[test]
    fn accept_encoding_is_read_with_its_weights() {
        let with_br = settings();
        let gzip_only = Compression {
            brotli: None,
            ..settings()
        };
        for (accept, br, gz) in [
            ("gzip", Some(Coding::Gzip), Some(Coding::Gzip)),
            (
                "gzip, deflate, br, zstd",
                Some(Coding::Brotli),
                Some(Coding::Gzip),
            ),
            ("br;q=0.5, gzip", Some(Coding::Gzip), Some(Coding::Gzip)),
            ("br, gzip;q=0.5", Some(Coding::Brotli), Some(Coding::Gzip)),
            ("deflate, GZIP", Some(Coding::Gzip), Some(Coding::Gzip)),
            ("x-gzip", Some(Coding::Gzip), Some(Coding::Gzip)),
            ("*", Some(Coding::Brotli), Some(Coding::Gzip)),
            ("br", Some(Coding::Brotli), None),
            ("gzip ; q=1.0", Some(Coding::Gzip), Some(Coding::Gzip)),
            ("", None, None),
            ("identity", None, None),
            ("gzip;q=0", None, None),
            ("*;q=0", None, None),
            ("gzip;q=0, *", Some(Coding::Brotli), None),
            ("deflate", None, None),
        ] {
            let h = headers(&[accept]);
            assert_eq!(negotiate(&h, &with_br), br, "{accept:?} with brotli");
            assert_eq!(negotiate(&h, &gzip_only), gz, "{accept:?} gzip only");
        }
        let split = headers(&["br;q=0.1", "gzip"]);
        assert_eq!(negotiate(&split, &with_br), Some(Coding::Gzip));
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
            "APPLICATION/VND.X+JSON",
        ] {
            assert!(s.covers(&HeaderValue::from_static(yes)), "{yes}");
        }
        // Longer than the copy the type is lowered into.
        let long = |sub: &str| HeaderValue::from_str(&format!("Application/{sub}")).unwrap();
        assert!(s.covers(&long(&format!("{}+JSON", "x".repeat(200)))));
        assert!(!s.covers(&long(&"x".repeat(200))));
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
