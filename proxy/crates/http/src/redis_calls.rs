//! A plugin's Redis command (Higress's `proxy_redis_call`), sent to the
//! state store (`serve --state redis://…`), the Redis the replicas
//! already share: the command as the plugin encoded it (a RESP array of
//! bulk strings), and the reply handed back RESP-encoded, as Higress's
//! Envoy hands over Redis's reply.

use bytes::Bytes;
use portcullis_plugin::seam::CalloutAnswer;

/// Sends the RESP-encoded `query` to the state store and waits for its
/// reply within `timeout`: answered 200 with the reply (RESP) as the
/// body, an error reply included; failed when there is no state store,
/// it is down, or the query is not a command.
pub async fn send(query: &[u8], timeout: std::time::Duration) -> CalloutAnswer {
    let failed = |why: String| CalloutAnswer::Failed {
        timed_out: false,
        why,
    };
    let Some(state) = crate::shared_limit::state() else {
        return failed(
            "no Redis for plugins: `serve --state redis://…` names the one their Redis calls use"
                .into(),
        );
    };
    let Some(args) = command(query) else {
        return failed("the Redis call is not a command (a RESP array of bulk strings)".into());
    };
    let Some(conn) = state.connection() else {
        return failed(format!(
            "the state store {} is unreachable",
            state.target.url
        ));
    };
    let mut conn = (*conn).clone();
    let mut cmd = redis::Cmd::new();
    for arg in &args {
        cmd.arg(&arg[..]);
    }
    let asked = cmd.query_async::<redis::Value>(&mut conn);
    let reply = match tokio::time::timeout(timeout, asked).await {
        Ok(Ok(value)) => value,
        Ok(Err(e)) => match e.code() {
            // An error reply is Redis's answer, not a failure to get one.
            Some(code) => {
                let line = match e.detail() {
                    Some(detail) => format!("{code} {detail}"),
                    None => code.to_owned(),
                };
                return answered(Bytes::from(format!("-{line}\r\n")));
            }
            None => return failed(format!("Redis: {e}")),
        },
        Err(_) => {
            return CalloutAnswer::Failed {
                timed_out: true,
                why: format!("no reply from Redis within {timeout:?}"),
            };
        }
    };
    let mut out = Vec::new();
    encode(&reply, &mut out);
    answered(out.into())
}

fn answered(body: Bytes) -> CalloutAnswer {
    CalloutAnswer::Answered {
        status: 200,
        headers: http::HeaderMap::new(),
        body,
        trailers: None,
    }
}

/// The arguments of a RESP array of bulk strings (how clients send a
/// command); `None` for anything else.
fn command(query: &[u8]) -> Option<Vec<&[u8]>> {
    let (count, mut rest) = line(query.strip_prefix(b"*")?)?;
    let mut args = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let (len, after) = line(rest.strip_prefix(b"$")?)?;
        let arg = after.get(..len)?;
        rest = after.get(len..)?.strip_prefix(b"\r\n")?;
        args.push(arg);
    }
    (rest.is_empty() && !args.is_empty()).then_some(args)
}

/// A decimal length ended by CRLF, and what follows.
fn line(bytes: &[u8]) -> Option<(usize, &[u8])> {
    let end = bytes.windows(2).position(|w| w == b"\r\n")?;
    let n = std::str::from_utf8(&bytes[..end]).ok()?.parse().ok()?;
    Some((n, &bytes[end + 2..]))
}

/// `value` in RESP2, as a RESP2 client reads it (RESP3's kinds in their
/// RESP2 shapes: a map as an array of pairs, a double as a bulk string).
fn encode(value: &redis::Value, out: &mut Vec<u8>) {
    use redis::Value;
    let bulk = |out: &mut Vec<u8>, bytes: &[u8]| {
        out.extend_from_slice(format!("${}\r\n", bytes.len()).as_bytes());
        out.extend_from_slice(bytes);
        out.extend_from_slice(b"\r\n");
    };
    let array = |out: &mut Vec<u8>, items: &[Value]| {
        out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
        for item in items {
            encode(item, out);
        }
    };
    match value {
        Value::Nil => out.extend_from_slice(b"$-1\r\n"),
        Value::Int(n) => out.extend_from_slice(format!(":{n}\r\n").as_bytes()),
        Value::BulkString(bytes) => bulk(out, bytes),
        Value::Array(items) | Value::Set(items) => array(out, items),
        Value::Push { data, .. } => array(out, data),
        Value::SimpleString(s) => out.extend_from_slice(format!("+{s}\r\n").as_bytes()),
        Value::Okay => out.extend_from_slice(b"+OK\r\n"),
        Value::Map(pairs) => {
            out.extend_from_slice(format!("*{}\r\n", pairs.len() * 2).as_bytes());
            for (k, v) in pairs {
                encode(k, out);
                encode(v, out);
            }
        }
        Value::Attribute { data, .. } => encode(data, out),
        Value::Double(d) => bulk(out, d.to_string().as_bytes()),
        Value::Boolean(b) => out.extend_from_slice(if *b { b":1\r\n" } else { b":0\r\n" }),
        Value::VerbatimString { text, .. } => bulk(out, text.as_bytes()),
        Value::BigNumber(n) => bulk(out, n),
        Value::ServerError(e) => {
            out.extend_from_slice(format!("-{e}\r\n").as_bytes());
        }
        // A kind a later redis-rs adds: nothing a RESP2 client can read.
        _ => out.extend_from_slice(b"$-1\r\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_is_read_as_clients_send_it() {
        let args = command(b"*2\r\n$4\r\nINCR\r\n$3\r\nk\r\n");
        assert_eq!(args, None, "a bulk string shorter than said");
        let args = command(b"*2\r\n$4\r\nINCR\r\n$1\r\nk\r\n").unwrap();
        assert_eq!(args, vec![&b"INCR"[..], b"k"]);
        let binary = command(b"*1\r\n$4\r\na\r\nb\r\n").unwrap();
        assert_eq!(binary, vec![&b"a\r\nb"[..]]);
        assert_eq!(command(b"PING\r\n"), None, "an inline command");
        assert_eq!(command(b"*1\r\n$4\r\nPING\r\nextra"), None);
        assert_eq!(command(b"*0\r\n"), None);
    }

    #[test]
    fn replies_go_back_in_resp2() {
        use redis::Value;
        let reply = Value::Array(vec![
            Value::Int(3),
            Value::BulkString(b"v".to_vec()),
            Value::Nil,
            Value::Okay,
        ]);
        let mut out = Vec::new();
        encode(&reply, &mut out);
        assert_eq!(out, b"*4\r\n:3\r\n$1\r\nv\r\n$-1\r\n+OK\r\n");
    }
}
