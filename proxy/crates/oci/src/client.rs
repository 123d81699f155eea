//! One registry's HTTP: GETs over HTTPS (or plain HTTP where allowed),
//! answers read up to a bound, redirects followed (a registry may send
//! blobs from a storage service), and the registry's challenge answered
//! with the credentials it asks for.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

use crate::auth::{Challenge, Credentials};

/// How many redirects one GET follows.
const MAX_REDIRECTS: usize = 5;

/// What a GET answered: status, headers and the body (whole, bounded).
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// How to reach one registry.
pub struct Client {
    /// `https` or `http`: decided on the first exchange.
    scheme: &'static str,
    registry: String,
    /// Plain HTTP may be tried when HTTPS fails to connect.
    plain_allowed: bool,
    tls: Arc<ClientConfig>,
    credentials: Option<Credentials>,
    /// What to send once the registry's challenge is answered.
    authorization: Option<HeaderValue>,
}

impl Client {
    pub fn new(
        registry: &str,
        plain_allowed: bool,
        verify: bool,
        ca: &[CertificateDer<'static>],
        credentials: Option<Credentials>,
    ) -> Client {
        Client {
            scheme: "https",
            registry: registry.to_owned(),
            plain_allowed,
            tls: Arc::new(tls_config(verify, ca)),
            credentials,
            authorization: None,
        }
    }

    /// GETs `path` (under `/v2/`) with `accept`, answering the registry's
    /// challenge once; the body is read up to `limit` bytes.
    pub async fn get(&mut self, path: &str, accept: &str, limit: u64) -> Result<Answer, String> {
        let url = format!("{}://{}{path}", self.scheme, self.registry);
        let answer = match self.follow(&url, accept, limit).await {
            // As Docker with an insecure (or loopback) registry: when
            // HTTPS cannot be spoken there, plain HTTP. A certificate
            // refused is not that: the registry speaks TLS.
            Err(e)
                if self.scheme == "https"
                    && self.plain_allowed
                    && e.starts_with("connect")
                    && !e.contains("certificate") =>
            {
                let url = format!("http://{}{path}", self.registry);
                match self.follow(&url, accept, limit).await {
                    // A TLS server's answer to plain HTTP: its TLS error
                    // is the one to show.
                    Ok(a) if a.status == StatusCode::BAD_REQUEST => return Err(e),
                    Ok(a) => {
                        self.scheme = "http";
                        a
                    }
                    Err(_) => return Err(e),
                }
            }
            other => other?,
        };
        if answer.status != StatusCode::UNAUTHORIZED || self.authorization.is_some() {
            return Ok(answer);
        }
        let challenge = answer
            .headers
            .get(header::WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .map(Challenge::parse)
            .ok_or_else(|| {
                format!(
                    "registry {} answered 401 without a challenge",
                    self.registry
                )
            })?;
        self.authorization = Some(self.answer(&challenge).await?);
        let url = format!("{}://{}{path}", self.scheme, self.registry);
        self.follow(&url, accept, limit).await
    }

    /// The `Authorization` that answers `challenge`.
    async fn answer(&mut self, challenge: &Challenge) -> Result<HeaderValue, String> {
        let who = &self.registry;
        match challenge {
            Challenge::Basic => match &self.credentials {
                Some(c) => Ok(c.basic()),
                None => Err(format!(
                    "registry {who} asks for credentials (Basic) and the plugin has none for it: set `pull_secret` to a Docker config file with an entry for {who}"
                )),
            },
            Challenge::Bearer {
                realm,
                service,
                scope,
            } => {
                let mut url = realm.clone();
                let mut sep = if url.contains('?') { '&' } else { '?' };
                for (k, v) in [("service", service), ("scope", scope)] {
                    if let Some(v) = v {
                        let v = percent_encoding::utf8_percent_encode(
                            v,
                            percent_encoding::NON_ALPHANUMERIC,
                        );
                        url.push_str(&format!("{sep}{k}={v}"));
                        sep = '&';
                    }
                }
                let basic = self.credentials.as_ref().map(Credentials::basic);
                let answer = self
                    .request(&url, "application/json", basic.as_ref(), 1 << 20)
                    .await?;
                if !answer.status.is_success() {
                    return Err(format!(
                        "registry {who}'s token service {realm} answered {}{}",
                        answer.status,
                        if self.credentials.is_none() {
                            " (the plugin has no credentials for this registry: set `pull_secret`)"
                        } else {
                            ""
                        }
                    ));
                }
                #[derive(serde::Deserialize)]
                struct Token {
                    token: Option<String>,
                    access_token: Option<String>,
                }
                let token: Token = serde_json::from_slice(&answer.body).map_err(|e| {
                    format!("registry {who}'s token service {realm} sent no token: {e}")
                })?;
                let token = token.token.or(token.access_token).ok_or_else(|| {
                    format!("registry {who}'s token service {realm} sent no token")
                })?;
                HeaderValue::try_from(format!("Bearer {token}"))
                    .map_err(|_| format!("registry {who}'s token service sent an unusable token"))
            }
            Challenge::Other(scheme) => Err(format!(
                "registry {who} asks for `{scheme}` authentication, which is not supported (Basic and Bearer are)"
            )),
        }
    }

    /// GETs `url`, following redirects; the registry's authorization goes
    /// only to the registry itself.
    async fn follow(&self, url: &str, accept: &str, limit: u64) -> Result<Answer, String> {
        let mut url = url.to_owned();
        for _ in 0..=MAX_REDIRECTS {
            let uri: Uri = url.parse().map_err(|_| format!("`{url}` is not a URL"))?;
            let ours = uri.authority().is_some_and(|a| a.as_str() == self.registry);
            let auth = if ours {
                self.authorization.as_ref()
            } else {
                None
            };
            let answer = self.request(&url, accept, auth, limit).await?;
            if !answer.status.is_redirection() {
                return Ok(answer);
            }
            let Some(next) = answer
                .headers
                .get(header::LOCATION)
                .and_then(|v| v.to_str().ok())
            else {
                return Ok(answer);
            };
            url = if next.starts_with('/') {
                format!(
                    "{}://{}{next}",
                    uri.scheme_str().unwrap_or("https"),
                    uri.authority().map_or("", |a| a.as_str())
                )
            } else {
                next.to_owned()
            };
        }
        Err(format!(
            "more than {MAX_REDIRECTS} redirects fetching {url}"
        ))
    }

    /// One GET on a fresh connection.
    async fn request(
        &self,
        url: &str,
        accept: &str,
        auth: Option<&HeaderValue>,
        limit: u64,
    ) -> Result<Answer, String> {
        let uri: Uri = url.parse().map_err(|_| format!("`{url}` is not a URL"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("`{url}` is neither http nor https")),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| format!("`{url}` names no host"))?
            .clone();
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tcp = TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("connect to {authority}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let mut request = Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
            .header(header::HOST, authority.as_str())
            .header(
                header::USER_AGENT,
                concat!("portcullis/", env!("CARGO_PKG_VERSION")),
            )
            .header(header::ACCEPT, accept);
        if let Some(auth) = auth {
            request = request.header(header::AUTHORIZATION, auth);
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        if https {
            let name = ServerName::try_from(host.clone())
                .map_err(|_| format!("`{host}` is not a name TLS can verify"))?;
            let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| format!("connect to {authority} (TLS): {e}"))?;
            exchange(TokioIo::new(tls), request, limit, &authority).await
        } else {
            exchange(TokioIo::new(tcp), request, limit, &authority).await
        }
    }
}

/// Sends `request` on `io` and reads the answer, its body up to `limit`.
async fn exchange<I>(
    io: I,
    request: Request<Empty<Bytes>>,
    limit: u64,
    authority: &http::uri::Authority,
) -> Result<Answer, String>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("connect to {authority}: {e}"))?;
    let conn = tokio::spawn(conn);
    let response = send
        .send_request(request)
        .await
        .map_err(|e| format!("{authority} did not answer: {e}"))?;
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, limit as usize)
        .collect()
        .await
        .map_err(|e| format!("reading from {authority}: {e} (the bound is {limit} bytes)"))?
        .to_bytes();
    conn.abort();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// rustls for registries: the system's roots and `ca`, or no
/// verification at all for a registry the policy calls insecure.
fn tls_config(verify: bool, ca: &[CertificateDer<'static>]) -> ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions");
    if !verify {
        return builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(portcullis_net::client_tls::NoVerify(
                provider,
            )))
            .with_no_client_auth();
    }
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(portcullis_net::client_tls::system_roots().iter().cloned());
    for cert in ca {
        if let Err(e) = roots.add(cert.clone()) {
            tracing::warn!(error = %e, "skipped an unusable certificate from the registry CA file");
        }
    }
    builder.with_root_certificates(roots).with_no_client_auth()
}
