//! The PROXY protocol header (HAProxy's, versions 1 and 2) that a TCP
//! balancer such as an AWS NLB puts before a connection's own bytes, to
//! say which client it came from.
//!
//! The header is read without reading past it: the bytes after it are the
//! client's (a TLS handshake or an HTTP request) and stay in the socket
//! for whoever serves the connection, so no buffer has to be replayed.
//! That is done by peeking, and consuming only what is known to be header.
//!
//! Not the `ppp` crate: it would replace only [`parse`] (150 lines,
//! fuzzed in `proxy/fuzz`), not the peeking read that is this file's care.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Version 2's signature.
const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// Version 1's start.
const V1_PREFIX: &[u8] = b"PROXY ";
/// Version 1's longest header, CRLF included (the specification's 107).
const V1_MAX: usize = 107;
/// Version 2's fixed part: signature, version and command, family, length.
const V2_FIXED: usize = 16;
/// The longest version 2 header accepted. Addresses take at most 216
/// bytes; the rest is TLVs (a balancer's endpoint id, TLS facts), which
/// are skipped.
const V2_MAX: usize = 4096;

/// Why a connection's PROXY header was refused.
#[derive(Debug)]
pub enum Error {
    /// The connection closed before its header was complete.
    Closed,
    /// The bytes are not a PROXY header.
    Invalid(&'static str),
    /// Reading the socket failed.
    Io(std::io::Error),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Closed => f.write_str("connection closed before its PROXY protocol header"),
            Error::Invalid(what) => write!(f, "bad PROXY protocol header: {what}"),
            Error::Io(e) => write!(f, "reading the PROXY protocol header: {e}"),
        }
    }
}

/// What parsing the bytes seen so far gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A whole header of this many bytes, with the client's address
    /// (`None` for a header that gives none: a balancer's own health check,
    /// `LOCAL`, or `UNKNOWN`, where the connection's address stands).
    Header(usize, Option<SocketAddr>),
    /// Every byte so far belongs to a header that goes on.
    Partial,
    /// Not a PROXY header; says why.
    Invalid(&'static str),
}

/// Reads the PROXY header that starts `stream`, leaving the bytes after it
/// unread. Returns the client's address it gives, if any.
pub async fn read(stream: &mut TcpStream) -> Result<Option<SocketAddr>, Error> {
    // Bytes consumed so far; all of them header.
    let mut seen: Vec<u8> = Vec::new();
    let mut peeked = [0u8; 256];
    loop {
        let n = stream.peek(&mut peeked).await.map_err(Error::Io)?;
        if n == 0 {
            return Err(Error::Closed);
        }
        let parsed = if seen.is_empty() {
            parse(&peeked[..n])
        } else {
            let mut all = seen.clone();
            all.extend_from_slice(&peeked[..n]);
            parse(&all)
        };
        // Consume exactly the header's bytes (all that was peeked while
        // it goes on): the next peek then waits for new bytes instead of
        // returning the same ones.
        let take = match parsed {
            Parsed::Header(len, _) => len - seen.len(),
            Parsed::Partial => n,
            Parsed::Invalid(what) => return Err(Error::Invalid(what)),
        };
        let start = seen.len();
        seen.resize(start + take, 0);
        stream
            .read_exact(&mut seen[start..])
            .await
            .map_err(Error::Io)?;
        if let Parsed::Header(_, client) = parsed {
            return Ok(client);
        }
    }
}

/// Parses the start of a connection. [`read`] relies on every proper
/// prefix of a header parsing as [`Parsed::Partial`] (the fuzz target
/// `proxy_protocol` checks it).
pub fn parse(bytes: &[u8]) -> Parsed {
    let prefix = |whole: &[u8]| whole.starts_with(&bytes[..bytes.len().min(whole.len())]);
    if prefix(V2_SIGNATURE) {
        parse_v2(bytes)
    } else if prefix(V1_PREFIX) {
        parse_v1(bytes)
    } else {
        Parsed::Invalid("the connection does not start with one (is the balancer set to send it?)")
    }
}

fn parse_v1(bytes: &[u8]) -> Parsed {
    let Some(newline) = bytes.iter().position(|&b| b == b'\n') else {
        return if bytes.len() >= V1_MAX {
            Parsed::Invalid("version 1 line longer than 107 bytes")
        } else {
            Parsed::Partial
        };
    };
    let len = newline + 1;
    if len > V1_MAX {
        return Parsed::Invalid("version 1 line longer than 107 bytes");
    }
    if newline == 0 || bytes[newline - 1] != b'\r' {
        return Parsed::Invalid("version 1 line ends without CR LF");
    }
    let end = newline - 1;
    let Ok(line) = std::str::from_utf8(&bytes[V1_PREFIX.len()..end]) else {
        return Parsed::Invalid("version 1 line is not text");
    };
    let mut fields = line.split(' ');
    let family = fields.next().unwrap_or_default();
    if family == "UNKNOWN" {
        // The rest of the line is to be ignored.
        return Parsed::Header(len, None);
    }
    let fields: Vec<&str> = fields.collect();
    let [source, _dest, source_port, _dest_port] = fields[..] else {
        return Parsed::Invalid("version 1 line needs two addresses and two ports");
    };
    let ip: Option<IpAddr> = match family {
        "TCP4" => source.parse::<Ipv4Addr>().ok().map(IpAddr::V4),
        "TCP6" => source.parse::<Ipv6Addr>().ok().map(IpAddr::V6),
        _ => return Parsed::Invalid("version 1 family is not TCP4, TCP6 or UNKNOWN"),
    };
    let Some(ip) = ip else {
        return Parsed::Invalid("version 1 source address does not match its family");
    };
    // Ports are decimal without a sign or leading zeros (the spec's form);
    // `u16::from_str` alone would take "+80".
    let port_ok = |p: &str| {
        !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && (p == "0" || !p.starts_with('0'))
    };
    match source_port.parse::<u16>() {
        Ok(port) if port_ok(source_port) => Parsed::Header(len, Some(SocketAddr::new(ip, port))),
        _ => Parsed::Invalid("version 1 source port is not a port"),
    }
}

fn parse_v2(bytes: &[u8]) -> Parsed {
    if bytes.len() < V2_FIXED {
        return Parsed::Partial;
    }
    let version_command = bytes[12];
    if version_command >> 4 != 2 {
        return Parsed::Invalid("version 2 signature with another version");
    }
    let local = match version_command & 0x0f {
        0 => true,
        1 => false,
        _ => return Parsed::Invalid("version 2 command is neither LOCAL nor PROXY"),
    };
    let family = bytes[13];
    let len = V2_FIXED + u16::from_be_bytes([bytes[14], bytes[15]]) as usize;
    if len > V2_MAX {
        return Parsed::Invalid("version 2 header longer than 4096 bytes");
    }
    // What the addresses of each family take; the length must hold them.
    let needs = match family >> 4 {
        1 => 12,
        2 => 36,
        3 => 216,
        _ => 0,
    };
    if len < V2_FIXED + needs {
        return Parsed::Invalid("version 2 length too short for its addresses");
    }
    if bytes.len() < len {
        return Parsed::Partial;
    }
    // A LOCAL header is the balancer's own connection (a health check);
    // UNIX sockets and unspecified families give no IP address. Those keep
    // the connection's address, as the specification says.
    if local {
        return Parsed::Header(len, None);
    }
    let a = &bytes[V2_FIXED..];
    let source = match family {
        // TCP or UDP over IPv4, then IPv6: source address, destination
        // address, source port, destination port.
        0x11 | 0x12 => {
            let ip = Ipv4Addr::new(a[0], a[1], a[2], a[3]);
            Some(SocketAddr::new(ip.into(), u16::from_be_bytes([a[8], a[9]])))
        }
        0x21 | 0x22 => {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&a[..16]);
            let ip = Ipv6Addr::from(octets);
            Some(SocketAddr::new(
                ip.into(),
                u16::from_be_bytes([a[32], a[33]]),
            ))
        }
        _ => None,
    };
    Parsed::Header(len, source)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2(command: u8, family: u8, addresses: &[u8], tlvs: &[u8]) -> Vec<u8> {
        let mut h = V2_SIGNATURE.to_vec();
        h.push(0x20 | command);
        h.push(family);
        h.extend_from_slice(&((addresses.len() + tlvs.len()) as u16).to_be_bytes());
        h.extend_from_slice(addresses);
        h.extend_from_slice(tlvs);
        h
    }

    fn addr(s: &str) -> Option<SocketAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn version_1_gives_the_source() {
        let line = b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n";
        let with_data = [&line[..], b"GET / HTTP/1.1\r\n"].concat();
        assert_eq!(
            parse(&with_data),
            Parsed::Header(line.len(), addr("203.0.113.7:51234"))
        );
        let line = b"PROXY TCP6 2001:db8::1 2001:db8::2 4000 80\r\n";
        assert_eq!(
            parse(line),
            Parsed::Header(line.len(), addr("[2001:db8::1]:4000"))
        );
        assert_eq!(
            parse(b"PROXY UNKNOWN whatever\r\n"),
            Parsed::Header(24, None)
        );
    }

    #[test]
    fn version_1_partial_until_its_line_ends() {
        for line in [
            &b"PRO"[..],
            b"PROXY TCP4 203.0.113.7 10.0.0.1 5",
            b"PROXY UNKNOWN\r",
        ] {
            assert_eq!(parse(line), Parsed::Partial, "{line:?}");
        }
    }

    #[test]
    fn version_1_refuses_what_is_not_one() {
        for line in [
            &b"GET / HTTP/1.1\r\n"[..],
            b"\x16\x03\x01\x02\x00",
            b"PROXY TCP5 1.2.3.4 1.2.3.5 1 2\r\n",
            b"PROXY TCP4 1.2.3.4 1.2.3.5 1\r\n",
            b"PROXY TCP4 ::1 ::1 1 2\r\n",
            b"PROXY TCP4 1.2.3.4 1.2.3.5 +1 2\r\n",
            b"PROXY TCP4 1.2.3.4 1.2.3.5 65536 2\r\n",
            b"PROXY TCP4 1.2.3.4 1.2.3.5 1 2\n",
        ] {
            assert!(matches!(parse(line), Parsed::Invalid(_)), "{line:?}");
        }
        let long = [V1_PREFIX, &[b'x'; 120][..]].concat();
        assert!(matches!(parse(&long), Parsed::Invalid(_)));
    }

    #[test]
    fn version_2_gives_the_source_and_skips_tlvs() {
        let v4 = [203, 0, 113, 7, 10, 0, 0, 1, 0xc8, 0x22, 0x01, 0xbb];
        let h = v2(1, 0x11, &v4, &[0xea, 0, 3, b'v', b'p', b'c']);
        let mut with_data = h.clone();
        with_data.extend_from_slice(b"\x16\x03\x01");
        assert_eq!(
            parse(&with_data),
            Parsed::Header(h.len(), addr("203.0.113.7:51234"))
        );

        let mut v6 = [0u8; 36];
        v6[0] = 0x20;
        v6[1] = 0x01;
        v6[15] = 9;
        v6[32..34].copy_from_slice(&4000u16.to_be_bytes());
        let h = v2(1, 0x21, &v6, &[]);
        assert_eq!(parse(&h), Parsed::Header(52, addr("[2001::9]:4000")));
    }

    #[test]
    fn version_2_local_and_unspecified_keep_the_connection_address() {
        let h = v2(0, 0x00, &[], &[]);
        assert_eq!(parse(&h), Parsed::Header(16, None));
        let h = v2(0, 0x11, &[0; 12], &[]);
        assert_eq!(parse(&h), Parsed::Header(28, None));
        let h = v2(1, 0x00, &[], &[]);
        assert_eq!(parse(&h), Parsed::Header(16, None));
    }

    #[test]
    fn version_2_partial_and_refused() {
        let h = v2(1, 0x11, &[1; 12], &[]);
        for cut in [1, 12, 15, 16, 27] {
            assert_eq!(parse(&h[..cut]), Parsed::Partial, "cut at {cut}");
        }
        let mut bad_version = h.clone();
        bad_version[12] = 0x11;
        let mut bad_command = h.clone();
        bad_command[12] = 0x22;
        let short = v2(1, 0x21, &[0; 12], &[]);
        let mut long = v2(1, 0x11, &[0; 12], &[]);
        long[14..16].copy_from_slice(&5000u16.to_be_bytes());
        for h in [bad_version, bad_command, short, long] {
            assert!(matches!(parse(&h), Parsed::Invalid(_)), "{h:?}");
        }
    }

    /// Both ends of a loopback connection: client, server.
    async fn connected() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap());
        let (client, accepted) = tokio::join!(client, listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    #[tokio::test]
    async fn read_stops_at_the_header_even_when_it_comes_in_pieces() {
        use tokio::io::AsyncWriteExt;
        let (mut client, mut server) = connected().await;
        let reader = tokio::spawn(async move {
            let client = read(&mut server).await.unwrap();
            let mut rest = Vec::new();
            server.read_to_end(&mut rest).await.unwrap();
            (client, rest)
        });
        // The pieces may arrive alone or run together in the socket;
        // either way the reader must stop at the line's end.
        for piece in [
            &b"PROXY TCP4 203.0.113"[..],
            b".7 10.0.0.1 5",
            b"1234 443\r",
            b"\nhello",
        ] {
            client.write_all(piece).await.unwrap();
            client.flush().await.unwrap();
            tokio::task::yield_now().await;
        }
        client.shutdown().await.unwrap();
        let (source, rest) = reader.await.unwrap();
        assert_eq!(source, addr("203.0.113.7:51234"));
        assert_eq!(rest, b"hello");
    }

    #[tokio::test]
    async fn read_reports_a_connection_closed_mid_header() {
        use tokio::io::AsyncWriteExt;
        let (mut client, mut server) = connected().await;
        client.write_all(b"PROXY TCP4 1.2").await.unwrap();
        client.shutdown().await.unwrap();
        assert!(matches!(read(&mut server).await, Err(Error::Closed)));
    }
}
