//! Listeners: address, limits, timeouts, request ids, TLS (certificates, client certificates, session tickets).

use super::*;

pub(super) fn listener(ctx: &mut Ctx, raw: &Spanned<RawListener>) -> Option<Listener> {
    let l = &raw.value;
    let name = name(ctx, &l.name, "listener");
    let bind = ctx.parse(&l.bind, |s| {
        // `:8080` is shorthand for all IPv4 interfaces, as in Go and nginx.
        let full = if s.starts_with(':') {
            format!("0.0.0.0{s}")
        } else {
            s.to_owned()
        };
        SocketAddr::from_str(&full).map_err(|_| {
            format!("`{s}` is not a bind address; write it like 0.0.0.0:8080 or [::]:8080")
        })
    });
    let max_connections = ctx.parse_or(&l.max_connections, DEFAULT_MAX_CONNECTIONS, |s| match s
        .parse::<usize>()
    {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{s}` is not a positive number of connections")),
    });
    let header_read_timeout = ctx.duration(&l.header_read_timeout, DEFAULT_HEADER_READ_TIMEOUT);
    let keepalive_timeout = ctx.duration(&l.keepalive_timeout, DEFAULT_KEEPALIVE_TIMEOUT);
    let max_requests_per_connection = requests_per_connection(ctx, &l.max_requests_per_connection);
    let connection_lifetime = ctx.duration(&l.connection_lifetime, DEFAULT_TIMEOUTS.lifetime);
    let max_request_header_size =
        ctx.parse_or(&l.max_request_header_size, DEFAULT_MAX_HEADER_SIZE, |s| {
            let n = parse_size(s)?;
            if (1024..=1 << 20).contains(&n) {
                Ok(n as usize)
            } else {
                Err(format!(
                    "`{s}` is out of range: the request header limit must be between 1KiB and 1MiB"
                ))
            }
        });
    let trust_forwarded_headers = ctx.flag(&l.trust_forwarded_headers, false);
    let proxy_protocol = ctx.flag(&l.proxy_protocol, false);
    let request_id = ctx.parse_or(&l.request_id, RequestIds::Keep, |s| match boolean_word(s) {
        "keep" => Ok(RequestIds::Keep),
        // `on`, `off` and their kin are taken as the modes they suggest.
        "make" | "true" => Ok(RequestIds::Make),
        "off" | "false" => Ok(RequestIds::Off),
        _ => Err(format!(
            "`{s}` is not a request id mode; use keep, make or off"
        )),
    });
    let tls = l
        .tls
        .as_ref()
        .and_then(|t| listener_tls(ctx, t, name.as_deref().unwrap_or_default()));
    // `true` for the standard port, or the HTTPS listener's port.
    let redirect_https = l.redirect_https.as_ref().and_then(|t| {
        ctx.parse(t, |s| match boolean_word(s) {
            "false" => Ok(None),
            "true" => Ok(Some(443)),
            _ => match s.parse::<u16>() {
                Ok(port) if port > 0 => Ok(Some(port)),
                _ => Err(format!("`{s}` is neither true, false nor a port")),
            },
        })
        .flatten()
    });
    if let (Some(_), Some(t)) = (&l.tls, &l.redirect_https)
        && redirect_https.is_some()
    {
        ctx.err(
            &t.referenced,
            "an HTTPS listener does not redirect to https",
        );
    }
    let http3 = l.http3.as_ref().and_then(|t| {
        ctx.parse(t, |s| match boolean_word(s) {
            "false" => Ok(None),
            "true" => Ok(Some(Http3 {
                advertised_port: None,
            })),
            _ => match s.parse::<u16>() {
                Ok(port) if port > 0 => Ok(Some(Http3 {
                    advertised_port: Some(port),
                })),
                _ => Err(format!(
                    "`{s}` is neither true, false nor a port to advertise in Alt-Svc"
                )),
            },
        })
        .flatten()
    });
    if let (None, Some(t), Some(_)) = (&l.tls, &l.http3, http3) {
        ctx.err(
            &t.referenced,
            "HTTP/3 runs over QUIC, which is always encrypted: give this listener `tls:` or drop `http3`",
        );
    }
    Some(Listener {
        name: name?,
        bind: bind?,
        max_connections,
        header_read_timeout,
        keepalive_timeout,
        max_requests_per_connection,
        connection_lifetime,
        max_request_header_size,
        trust_forwarded_headers,
        proxy_protocol,
        request_id,
        tls,
        redirect_https,
        http3,
        defined_at: ctx.pos(&raw.referenced),
    })
}

/// A listener's `tls`: the certificate and key are read (and checked to
/// belong together) now, so `check` reports a bad pair at its line.
pub(super) fn listener_tls(
    ctx: &mut Ctx,
    raw: &Spanned<RawListenerTls>,
    listener: &str,
) -> Option<ListenerTls> {
    let t = &raw.value;
    // `cert` and `key` for one certificate; `certificates` for several,
    // chosen by SNI.
    let pairs: Vec<(&Text, &Text)> = match (&t.cert, &t.key, &t.certificates) {
        (Some(cert), Some(key), None) => vec![(cert, key)],
        (None, None, Some(list)) if !list.value.is_empty() => list
            .value
            .iter()
            .map(|p| (&p.value.cert, &p.value.key))
            .collect(),
        (None, None, Some(list)) => {
            ctx.err(&list.referenced, "`certificates` lists no certificate");
            return None;
        }
        (_, _, None) => {
            ctx.err(
                &raw.referenced,
                "`tls` needs both `cert` and `key` (or a `certificates` list)",
            );
            return None;
        }
        (_, _, Some(list)) => {
            ctx.err(
                &list.referenced,
                "give either `cert` and `key`, or `certificates`, not both",
            );
            return None;
        }
    };
    let optional = match &t.client_auth {
        None => false,
        Some(mode) => {
            let optional = ctx.parse(mode, |s| match s {
                "required" => Ok(false),
                "optional" => Ok(true),
                _ => Err(format!(
                    "client_auth `{s}`: expected `required` or `optional`"
                )),
            })?;
            if t.client_ca.is_none() {
                ctx.err(
                    &mode.referenced,
                    "`client_auth` needs `client_ca`: the CA client certificates must chain to",
                );
                return None;
            }
            optional
        }
    };
    let client_auth = match &t.client_ca {
        None => None,
        Some(ca) => {
            let path = ctx.path(ca)?;
            match portcullis_net::pem::certificates(&path) {
                Ok(roots) => Some(portcullis_net::tls_listen::ClientAuth { roots, optional }),
                Err(e) => {
                    ctx.err(&ca.referenced, format!("client_ca: {e}"));
                    return None;
                }
            }
        }
    };
    // Each pair is read here, so a bad one is reported at its own line.
    let mut paths = Vec::with_capacity(pairs.len());
    for (cert_text, key_text) in pairs {
        let (Some(cert), Some(key)) = (ctx.path(cert_text), ctx.path(key_text)) else {
            continue;
        };
        match portcullis_net::cert_files::CertFiles::load(cert.clone(), key.clone()) {
            Ok(_) => paths.push((cert, key)),
            Err(e) => ctx.err(&cert_text.referenced, e),
        }
    }
    let mode = match &client_auth {
        None => ClientAuthMode::Off,
        Some(auth) if auth.optional => ClientAuthMode::Optional,
        Some(_) => ClientAuthMode::Required,
    };
    // What a session resumed here was authenticated against: the listener
    // and its client-certificate rules. Bound into file-keyed tickets, and
    // part of the config's fingerprint, so a rotated client CA or ticket
    // key file is a change a reload applies.
    let mut material = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(listener.as_bytes());
        h.update([0, mode as u8]);
        for root in client_auth.iter().flat_map(|a| &a.roots) {
            h.update((root.len() as u64).to_le_bytes());
            h.update(root.as_ref());
        }
        <[u8; 32]>::from(h.finalize())
    };
    let tickets: Option<Arc<dyn rustls::server::ProducesTickets>> = match &t.session_ticket_keys {
        None => None,
        Some(list) => {
            let files: Vec<_> = list.iter().filter_map(|f| ctx.path(f)).collect();
            if files.len() != list.len() {
                return None;
            }
            match portcullis_net::ticket_keys::FileTicketer::from_files(&files, material) {
                Ok((ticketer, keys)) => {
                    use sha2::Digest;
                    material = sha2::Sha256::new()
                        .chain_update(material)
                        .chain_update(keys)
                        .finalize()
                        .into();
                    Some(Arc::new(ticketer))
                }
                Err(e) => {
                    let at = list.first().map_or(&raw.referenced, |f| &f.referenced);
                    ctx.err(at, e);
                    return None;
                }
            }
        }
    };
    let keyed = tickets.is_some();
    let template = portcullis_net::tls_listen::template_by_name(
        &paths,
        client_auth,
        tickets,
        portcullis_net::tls_listen::HTTP_ALPN,
    );
    match template {
        Ok((template, certificates)) if !paths.is_empty() => Some(ListenerTls {
            template,
            keyed,
            cert: paths[0].0.clone(),
            pairs: paths,
            certificates,
            client_auth: mode,
            material,
        }),
        Ok(_) => None,
        Err(e) => {
            ctx.err(&raw.referenced, e);
            None
        }
    }
}
