//! One access line, formatted straight into its worker's buffer, in the
//! shape the event log has (`tracing-subscriber`'s text and JSON lines):
//! `2026-11-29T04:51:43.263878Z  INFO access: method=GET path="/x" ...`
//! or `{"timestamp":"…","level":"INFO","method":"GET",…,"target":"access"}`.
//! Written by hand, not through `tracing`'s event machinery: the field
//! visitor, its `fmt` calls and a locked write per line cost 5.6 µs a
//! request (issue 51); this costs a few hundred nanoseconds.

use std::fmt::Display;
use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

/// A line being written: fields go in by name, in order.
pub struct Line<'a> {
    out: &'a mut Vec<u8>,
    json: bool,
}

/// A field's name as each format writes it before the value (` name=`,
/// `"name":`), made once by [`field!`](crate::field): one copy a field.
#[derive(Clone, Copy)]
pub struct Field {
    #[doc(hidden)]
    pub text: &'static str,
    #[doc(hidden)]
    pub json: &'static str,
}

/// The [`Field`] named `$name`.
#[macro_export]
macro_rules! field {
    ($name:literal) => {
        $crate::access_line::Field {
            text: concat!(" ", $name, "="),
            json: concat!("\"", $name, "\":"),
        }
    };
}

/// The wall clock as lines print it, its seconds formatted once a second.
#[derive(Default)]
pub(crate) struct Clock {
    second: u64,
    /// `2026-11-29T04:51:43`, the `second` above.
    text: [u8; 19],
}

impl Clock {
    /// Appends now as `2026-11-29T04:51:43.263878Z`.
    fn stamp(&mut self, out: &mut Vec<u8>) {
        let now = SystemTime::now();
        let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
        if since.as_secs() != self.second || self.text[0] == 0 {
            self.second = since.as_secs();
            let whole = UNIX_EPOCH + std::time::Duration::from_secs(self.second);
            let text = humantime::format_rfc3339_seconds(whole).to_string();
            if let Some(date) = text.as_bytes().get(..19) {
                self.text.copy_from_slice(date);
            }
        }
        out.extend_from_slice(&self.text);
        out.push(b'.');
        digits(out, since.subsec_micros(), 6);
        out.push(b'Z');
    }
}

/// `n` in exactly `width` decimal digits, zero-padded.
fn digits(out: &mut Vec<u8>, mut n: u32, width: usize) {
    let mut buf = [b'0'; 10];
    for d in buf[..width].iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out.extend_from_slice(&buf[..width]);
}

impl<'a> Line<'a> {
    /// Starts a line in `out`: time, level, target and, when given, a
    /// message.
    pub(crate) fn begin(
        out: &'a mut Vec<u8>,
        json: bool,
        clock: &mut Clock,
        message: Option<&str>,
    ) -> Self {
        if json {
            out.extend_from_slice(br#"{"timestamp":""#);
            clock.stamp(out);
            out.extend_from_slice(br#"","level":"INFO","#);
        } else {
            clock.stamp(out);
            out.extend_from_slice(b"  INFO access:");
        }
        let mut line = Line { out, json };
        if let Some(message) = message {
            if json {
                line.str(crate::field!("message"), message);
            } else {
                line.out.push(b' ');
                line.out.extend_from_slice(message.as_bytes());
            }
        }
        line
    }

    /// Ends the line.
    pub(crate) fn end(self) {
        if self.json {
            self.out.extend_from_slice(b"\"target\":\"access\"}\n");
        } else {
            self.out.push(b'\n');
        }
    }

    /// Inlined where the fields are written, as the writers below are:
    /// each name is then a copy of known length, a few moves, not a call
    /// to `memcpy` (~25 instructions a field).
    #[inline(always)]
    fn name(&mut self, name: Field) {
        let name = if self.json { name.json } else { name.text };
        self.out.extend_from_slice(name.as_bytes());
    }

    #[inline(always)]
    fn next(&mut self) {
        if self.json {
            self.out.push(b',');
        }
    }

    /// A string field: quoted in both formats.
    #[inline]
    pub fn str(&mut self, name: Field, value: &str) {
        self.name(name);
        quoted(self.out, value, self.json);
        self.next();
    }

    /// A word: bare in text, a string in JSON (a method, `-`).
    #[inline]
    pub fn word(&mut self, name: Field, value: &str) {
        if self.json {
            return self.str(name, value);
        }
        self.name(name);
        self.out.extend_from_slice(value.as_bytes());
    }

    /// A field shown as it displays: bare in text, a string in JSON.
    pub fn display(&mut self, name: Field, value: &dyn Display) {
        self.name(name);
        if self.json {
            let start = self.out.len();
            let _ = write!(self.out, "{value}");
            if needs_escape(&self.out[start..], true) {
                let text = String::from_utf8_lossy(&self.out[start..]).into_owned();
                self.out.truncate(start);
                quoted(self.out, &text, true);
            } else {
                self.out.insert(start, b'"');
                self.out.push(b'"');
            }
        } else {
            let _ = write!(self.out, "{value}");
        }
        self.next();
    }

    /// A socket address, as it displays (IPv4 written directly: the
    /// formatting machinery cost a few hundred instructions a line).
    pub fn addr(&mut self, name: Field, addr: &std::net::SocketAddr) {
        let std::net::SocketAddr::V4(v4) = addr else {
            return self.display(name, addr);
        };
        self.name(name);
        if self.json {
            self.out.push(b'"');
        }
        let mut n = itoa::Buffer::new();
        for (i, octet) in v4.ip().octets().into_iter().enumerate() {
            if i > 0 {
                self.out.push(b'.');
            }
            self.out.extend_from_slice(n.format(octet).as_bytes());
        }
        self.out.push(b':');
        self.out.extend_from_slice(n.format(v4.port()).as_bytes());
        if self.json {
            self.out.push(b'"');
        }
        self.next();
    }

    /// A whole number.
    #[inline]
    pub fn uint(&mut self, name: Field, value: u64) {
        self.name(name);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
        self.next();
    }

    /// Microseconds as milliseconds with three decimals (`0.208`).
    #[inline]
    pub fn millis(&mut self, name: Field, micros: u128) {
        self.name(name);
        let whole = u64::try_from(micros / 1000).unwrap_or(u64::MAX);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(whole).as_bytes());
        self.out.push(b'.');
        digits(self.out, (micros % 1000) as u32, 3);
        self.next();
    }

    /// `true` or `false`.
    #[inline]
    pub fn bool(&mut self, name: Field, value: bool) {
        self.name(name);
        self.out
            .extend_from_slice(if value { b"true" } else { b"false" });
        self.next();
    }
}

/// Whether `bytes` need escaping inside quotes: JSON's `"`, `\` and
/// control characters; text lines escape as Rust's `{:?}` does, so
/// anything beyond printable ASCII too. Eight bytes at a time (the last
/// word overlapping the one before): byte by byte, the scan of a line's
/// few quoted values was ~300 instructions.
fn needs_escape(bytes: &[u8], json: bool) -> bool {
    if bytes.len() < 8 {
        return bytes.iter().any(|&b| byte_escapes(b, json));
    }
    let word = |at: usize| {
        let mut w = [0; 8];
        w.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let mut at = 0;
    while at + 8 <= bytes.len() {
        if word_escapes(word(at), json) {
            return true;
        }
        at += 8;
    }
    at < bytes.len() && word_escapes(word(bytes.len() - 8), json)
}

fn byte_escapes(b: u8, json: bool) -> bool {
    b == b'"' || b == b'\\' || b < 0x20 || (!json && b >= 0x7f)
}

/// [`byte_escapes`] for any of the eight bytes of `w`. The tests below
/// (from "Bit Twiddling Hacks") can flag a byte next to one that truly
/// escapes, never miss one that does: a false flag only sends the value
/// the careful way.
fn word_escapes(w: u64, json: bool) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero_byte = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let below_space = w.wrapping_sub(ONES * 0x20) & !w & HIGH;
    let quote = zero_byte(w ^ (ONES * u64::from(b'"')));
    let backslash = zero_byte(w ^ (ONES * u64::from(b'\\')));
    // DEL and up: a byte over 0x7e once 1 is added, or with its top bit.
    let high = match json {
        true => 0,
        false => (w.wrapping_add(ONES) | w) & HIGH,
    };
    below_space | quote | backslash | high != 0
}

/// `value` in double quotes, escaped for the format.
fn quoted(out: &mut Vec<u8>, value: &str, json: bool) {
    if !needs_escape(value.as_bytes(), json) {
        out.push(b'"');
        out.extend_from_slice(value.as_bytes());
        out.push(b'"');
    } else if json {
        let _ = serde_json::to_writer(&mut *out, value);
    } else {
        let _ = write!(out, "{value:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(json: bool, fill: impl FnOnce(&mut Line<'_>)) -> String {
        let mut out = Vec::new();
        let mut clock = Clock::default();
        let mut line = Line::begin(&mut out, json, &mut clock, None);
        fill(&mut line);
        line.end();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn json_lines_parse_whatever_the_values() {
        let text = line(true, |l| {
            l.str(crate::field!("path"), "/a\"b\\c\u{1}é");
            l.display(crate::field!("error"), &"bad \"thing\"\n");
            l.display(crate::field!("client"), &"127.0.0.1:80");
            l.uint(crate::field!("status"), 404);
            l.millis(crate::field!("duration_ms"), 12_005);
            l.bool(crate::field!("aborted"), false);
        });
        assert!(text.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["path"], "/a\"b\\c\u{1}é");
        assert_eq!(v["error"], "bad \"thing\"\n");
        assert_eq!(v["client"], "127.0.0.1:80");
        assert_eq!(v["status"], 404);
        assert_eq!(v["duration_ms"], 12.005);
        assert_eq!(v["aborted"], false);
        assert_eq!(v["target"], "access");
        assert_eq!(v["level"], "INFO");
        let stamp = v["timestamp"].as_str().unwrap();
        assert!(humantime::parse_rfc3339(stamp).is_ok(), "{stamp}");
    }

    #[test]
    fn text_lines_read_as_the_event_log_writes_them() {
        let text = line(false, |l| {
            l.display(crate::field!("method"), &http::Method::GET);
            l.str(crate::field!("path"), "/x y\"");
            l.millis(crate::field!("duration_ms"), 208);
            l.uint(crate::field!("worker"), 1);
        });
        let (stamp, rest) = text.split_once("  ").unwrap();
        assert!(humantime::parse_rfc3339(stamp).is_ok(), "{stamp}");
        assert_eq!(
            rest,
            "INFO access: method=GET path=\"/x y\\\"\" duration_ms=0.208 worker=1\n"
        );
    }

    #[test]
    fn addresses_read_as_they_display() {
        for addr in ["127.0.0.1:80", "10.200.0.255:65535", "[::1]:443"] {
            let addr: std::net::SocketAddr = addr.parse().unwrap();
            let json = line(true, |l| l.addr(crate::field!("client"), &addr));
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            assert_eq!(v["client"], addr.to_string());
            let text = line(false, |l| l.addr(crate::field!("client"), &addr));
            assert!(
                text.ends_with(&format!("access: client={addr}\n")),
                "{text}"
            );
        }
    }

    #[test]
    fn the_word_scan_finds_what_the_byte_scan_finds() {
        // Every byte value at every place of values of 1 to 24 bytes,
        // among bytes that need no escaping: plain ones, and ones next
        // to which a word test might flag falsely (0x7e, 0x21, 0x23,
        // 0x5b: one off DEL, `"` and `\`).
        for fill in [b'a', 0x7e, 0x21, 0x23, 0x5b] {
            for len in 1..=24 {
                for at in 0..len {
                    for b in 0..=255u8 {
                        let mut bytes = vec![fill; len];
                        bytes[at] = b;
                        for json in [false, true] {
                            let slow = bytes.iter().any(|&c| byte_escapes(c, json));
                            assert_eq!(needs_escape(&bytes, json), slow, "{bytes:?} json={json}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_message_comes_first() {
        let mut out = Vec::new();
        let mut clock = Clock::default();
        let mut l = Line::begin(&mut out, false, &mut clock, Some("request head refused"));
        l.uint(crate::field!("status"), 400);
        l.end();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.ends_with("INFO access: request head refused status=400\n"),
            "{text}"
        );
    }
}
