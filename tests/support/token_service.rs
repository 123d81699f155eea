//! A registry's token service (the Docker token authentication the big
//! registries use: Docker Hub, GHCR, Harbor), for a `docker-registry`
//! started with token auth: `GET /token?service=…&scope=…` with the
//! user's Basic credentials answers an ES256 JWT whose `x5c` certificate
//! the registry trusts (its `rootcertbundle`), granting what the scope
//! asks. Outside the product, as a registry's auth service is.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use super::registry::{PASSWORD, USER};
use super::tls::TestPki;

/// The `service` and `issuer` the registry is told to expect.
pub const SERVICE: &str = "portcullis-test-registry";
pub const ISSUER: &str = "portcullis-test-token-service";

/// A running token service.
pub struct TokenService {
    pub addr: SocketAddr,
    /// The CA the registry trusts tokens from (its `rootcertbundle`).
    pub ca_pem: String,
    /// The scopes asked for so far, as the query gave them.
    pub asked: Arc<Mutex<Vec<String>>>,
    signer: Arc<Signer>,
    task: tokio::task::JoinHandle<()>,
}

struct Signer {
    key: ring::signature::EcdsaKeyPair,
    /// The leaf certificate, base64 DER, for the tokens' `x5c`.
    x5c: String,
}

impl Drop for TokenService {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TokenService {
    pub async fn start() -> TokenService {
        use base64::Engine as _;
        let pki = TestPki::new();
        let key = ring::signature::EcdsaKeyPair::from_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &pki.leaf_key,
            &ring::rand::SystemRandom::new(),
        )
        .expect("the leaf key is P-256");
        let x5c = base64::engine::general_purpose::STANDARD.encode(pki.leaf_chain[0].as_ref());
        let signer = Arc::new(Signer { key, x5c });
        let asked = Arc::new(Mutex::new(Vec::new()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (s, a) = (signer.clone(), asked.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (s, a) = (s.clone(), a.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |req| {
                        let answer = answer(&s, &a, &req);
                        async move { Ok::<_, std::convert::Infallible>(answer) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        TokenService {
            addr,
            ca_pem: pki.ca_pem.clone(),
            asked,
            signer,
            task,
        }
    }

    /// The `realm` the registry sends clients to.
    pub fn realm(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    /// Makes tokens granting push and pull on a repository, as the
    /// service would give them.
    pub fn minter(&self) -> impl Fn(&str) -> String + Send + Sync + 'static {
        let signer = self.signer.clone();
        move |repo| signer.token(repo, &["pull", "push"])
    }
}

impl Signer {
    fn token(&self, repo: &str, actions: &[&str]) -> String {
        use base64::Engine as _;
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let header = serde_json::json!({ "alg": "ES256", "typ": "JWT", "x5c": [self.x5c] });
        let claims = serde_json::json!({
            "iss": ISSUER, "sub": USER, "aud": SERVICE,
            "iat": now, "nbf": now - 10, "exp": now + 300, "jti": format!("t{now}{repo}"),
            "access": [{ "type": "repository", "name": repo, "actions": actions }],
        });
        let signed = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let signature = self
            .key
            .sign(&ring::rand::SystemRandom::new(), signed.as_bytes())
            .expect("sign");
        format!("{signed}.{}", b64(signature.as_ref()))
    }
}

/// The answer to a token request: a token for what `scope` asks, to the
/// user with the right password; 401 to anyone else.
fn answer(
    signer: &Signer,
    asked: &Mutex<Vec<String>>,
    req: &http::Request<hyper::body::Incoming>,
) -> http::Response<Full<Bytes>> {
    use base64::Engine as _;
    let query = req.uri().query().unwrap_or("");
    let params: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect();
    let scope = params
        .iter()
        .find(|(k, _)| k == "scope")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    asked.lock().unwrap().push(scope.clone());
    let expected = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"))
    );
    let authorized = req
        .headers()
        .get("authorization")
        .is_some_and(|v| v.as_bytes() == expected.as_bytes());
    let service = params.iter().any(|(k, v)| k == "service" && v == SERVICE);
    if !authorized || !service {
        return http::Response::builder()
            .status(401)
            .body(Full::new(Bytes::from_static(b"{\"errors\":[]}")))
            .expect("answer");
    }
    // `repository:team/x:pull,push`
    let mut parts = scope.splitn(3, ':');
    let (_, repo, actions) = (parts.next(), parts.next(), parts.next());
    let actions: Vec<&str> = actions.unwrap_or("").split(',').collect();
    let token = signer.token(repo.unwrap_or(""), &actions);
    let body = serde_json::json!({ "token": token, "access_token": token, "expires_in": 300 });
    http::Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("answer")
}
