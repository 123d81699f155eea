//! A real OCI registry (Debian's `docker-registry`, the CNCF
//! distribution server; the test command installs it) on a loopback
//! port, plain or with TLS and basic auth, and pushes to it through the
//! distribution API, as `oras push` makes them.

use std::process::Stdio;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::process::{Child, Command};

/// The user and password of a registry with auth.
pub const USER: &str = "puller";
pub const PASSWORD: &str = "pull-s3cret";
/// bcrypt of [`PASSWORD`] (what `htpasswd -B` writes; the registry reads
/// only bcrypt).
const HTPASSWD: &str = "puller:$2b$05$5H2wyrbFbT50fckldWe2zOV3w23uMOU/1mYPIn2RD6BjMEZoh0APO\n";

/// The layer type of a module pushed as an artifact (Istio's compat variant).
pub const WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";

/// A running `docker-registry`; killed when dropped.
pub struct Registry {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    /// The CA of its certificate, when it speaks TLS.
    pub ca_pem: Option<String>,
    /// With token auth: a token for a repository, for the pushes here.
    minter: Option<Minter>,
}

/// Makes a push-and-pull token for a repository.
type Minter = Box<dyn Fn(&str) -> String + Send + Sync>;

impl Registry {
    /// Plain HTTP, no auth.
    pub async fn start() -> Registry {
        Self::launch(None).await
    }

    /// TLS (a certificate for 127.0.0.1 from a fresh CA) and basic auth
    /// ([`USER`], [`PASSWORD`]).
    pub async fn start_secure() -> Registry {
        Self::launch(Some(super::tls::TestPki::new())).await
    }

    /// Plain HTTP with token auth: clients get tokens from `tokens`
    /// (Docker Hub's and GHCR's way), which the registry checks against
    /// the token service's CA.
    pub async fn start_with_tokens(tokens: &super::token_service::TokenService) -> Registry {
        let mut registry = Self::launch(None).await;
        registry.kill().await;
        let d = registry.dir.path().to_owned();
        std::fs::write(d.join("token-ca.pem"), &tokens.ca_pem).expect("write the token CA");
        let config = std::fs::read_to_string(d.join("config.yml")).expect("config");
        let auth = format!(
            "auth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
            tokens.realm(),
            super::token_service::SERVICE,
            super::token_service::ISSUER,
            d.join("token-ca.pem").display()
        );
        std::fs::write(d.join("config.yml"), config + &auth).expect("write config");
        let signer = tokens.minter();
        registry.minter = Some(Box::new(move |repo| signer(repo)));
        registry.restart().await;
        registry
    }

    async fn launch(pki: Option<super::tls::TestPki>) -> Registry {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("probe port")
            .port();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.path().join("data").display()
        );
        if let Some(pki) = &pki {
            for (file, pem) in [("cert.pem", &pki.leaf_pem), ("key.pem", &pki.leaf_key_pem)] {
                std::fs::write(dir.path().join(file), pem).expect("write a TLS file");
            }
            std::fs::write(dir.path().join("htpasswd"), HTPASSWD).expect("write htpasswd");
            let d = dir.path().display();
            config.push_str(&format!(
                "  tls:\n    certificate: {d}/cert.pem\n    key: {d}/key.pem\nauth:\n  htpasswd:\n    realm: test\n    path: {d}/htpasswd\n"
            ));
        }
        std::fs::write(dir.path().join("config.yml"), config).expect("write config");
        let mut registry = Registry {
            child: None,
            port,
            dir,
            ca_pem: pki.map(|p| p.ca_pem),
            minter: None,
        };
        registry.restart().await;
        registry
    }

    /// `127.0.0.1:PORT`, as a reference names it.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts it (again) on its port, with what was pushed before.
    pub async fn restart(&mut self) {
        let mut child = Command::new(
            std::env::var("PORTCULLIS_DOCKER_REGISTRY")
                .unwrap_or_else(|_| "docker-registry".into()),
        )
        .arg("serve")
        .arg(self.dir.path().join("config.yml"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("docker-registry (Debian's docker-registry package; tests/run.sh installs it)");
        let stderr = child.stderr.take().expect("stderr");
        super::wait_ready(
            stderr,
            "listening on",
            &format!("docker-registry on port {}", self.port),
        )
        .await;
        self.child = Some(child);
    }

    /// Stops it and waits for it to be gone.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// A Docker config (`.dockerconfigjson`) with this registry's
    /// credentials, `password` as given.
    pub fn docker_config(&self, password: &str) -> String {
        use base64::Engine as _;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{password}"));
        format!(r#"{{"auths":{{"{}":{{"auth":"{auth}"}}}}}}"#, self.host())
    }

    /// Pushes `blob` and returns its digest.
    pub async fn push_blob(&self, repo: &str, blob: &[u8]) -> String {
        let digest = digest(blob);
        let (status, headers, body) = self
            .send(
                "POST",
                &format!("/v2/{repo}/blobs/uploads/"),
                None,
                Bytes::new(),
            )
            .await;
        assert_eq!(status, 202, "starting an upload: {body}");
        let location = headers
            .get("location")
            .and_then(|v| v.to_str().ok())
            .expect("upload location")
            .to_owned();
        let path = location
            .split_once("://")
            .map_or(location.as_str(), |(_, rest)| {
                &rest[rest.find('/').unwrap_or(0)..]
            });
        let sep = if path.contains('?') { '&' } else { '?' };
        let (status, _, body) = self
            .send(
                "PUT",
                &format!("{path}{sep}digest={digest}"),
                Some("application/octet-stream"),
                Bytes::copy_from_slice(blob),
            )
            .await;
        assert_eq!(status, 201, "finishing an upload: {body}");
        digest
    }

    /// Pushes `module` as an OCI artifact (one layer of type
    /// [`WASM_LAYER`]) tagged `tag`; the manifest's digest.
    pub async fn push_artifact(&self, repo: &str, tag: &str, module: &[u8]) -> String {
        self.push_layer(repo, tag, module, WASM_LAYER).await
    }

    /// Pushes `layer` as the one layer (of `media_type`) of a manifest
    /// tagged `tag`; the manifest's digest.
    pub async fn push_layer(
        &self,
        repo: &str,
        tag: &str,
        layer: &[u8],
        media_type: &str,
    ) -> String {
        let config = b"{}";
        let config_digest = self.push_blob(repo, config).await;
        let layer_digest = self.push_blob(repo, layer).await;
        let manifest = format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config_digest}","size":{}}},"layers":[{{"mediaType":"{media_type}","digest":"{layer_digest}","size":{}}}]}}"#,
            config.len(),
            layer.len()
        );
        let (status, _, body) = self
            .send(
                "PUT",
                &format!("/v2/{repo}/manifests/{tag}"),
                Some("application/vnd.oci.image.manifest.v1+json"),
                Bytes::from(manifest.clone()),
            )
            .await;
        assert_eq!(status, 201, "pushing a manifest: {body}");
        digest(manifest.as_bytes())
    }

    /// Pushes `module` as an image whose one layer (a gzipped tar) holds
    /// `plugin.wasm`; the manifest's digest.
    pub async fn push_image(&self, repo: &str, tag: &str, module: &[u8]) -> String {
        let mut tar = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(module.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, "plugin.wasm", module)
            .expect("tar");
        let tar = tar.into_inner().expect("tar");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).expect("gzip");
        let layer = gz.finish().expect("gzip");
        self.push_layer(
            repo,
            tag,
            &layer,
            "application/vnd.oci.image.layer.v1.tar+gzip",
        )
        .await
    }

    /// One request to the registry (TLS and basic auth when it has them).
    async fn send(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Bytes,
    ) -> (u16, http::HeaderMap, String) {
        use base64::Engine as _;
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .expect("connect to the registry");
        let mut request = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.host())
            .header("content-length", body.len());
        if let Some(t) = content_type {
            request = request.header("content-type", t);
        }
        if let Some(mint) = &self.minter {
            // `/v2/REPO/blobs/...` or `/v2/REPO/manifests/...`
            let repo = path.trim_start_matches("/v2/");
            let end = ["/blobs/", "/manifests/"]
                .iter()
                .filter_map(|m| repo.find(m))
                .min()
                .unwrap_or(repo.len());
            request = request.header("authorization", format!("Bearer {}", mint(&repo[..end])));
        } else if self.ca_pem.is_some() {
            let auth =
                base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
            request = request.header("authorization", format!("Basic {auth}"));
        }
        let request = request.body(Full::new(body)).expect("request");
        let response = match &self.ca_pem {
            None => exchange(TokioIo::new(tcp), request).await,
            Some(ca) => {
                let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("name");
                let tls = super::tls::connector(ca, &[], None)
                    .connect(name, tcp)
                    .await
                    .expect("TLS to the registry");
                exchange(TokioIo::new(tls), request).await
            }
        };
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("registry body").to_bytes();
        (
            parts.status.as_u16(),
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }
}

async fn exchange<I>(
    io: I,
    request: http::Request<Full<Bytes>>,
) -> http::Response<hyper::body::Incoming>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .expect("handshake");
    tokio::spawn(conn);
    send.send_request(request).await.expect("registry answer")
}

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}
