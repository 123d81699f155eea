//! Plugins pulled from OCI registries, as Istio's `WasmPlugin` pulls
//! them: a reference (`oci://HOST[:PORT]/REPO[:TAG][@sha256:DIGEST]`) is
//! resolved with the distribution API, its digest verified, and the
//! module kept on disk by digest (see [`cache`]).
//!
//! Pulls are blocking calls with a deadline: policies are read on a
//! blocking thread, and a plugin is pulled before the policy naming it
//! takes traffic.

mod auth;
mod cache;
mod client;
mod manifest;
mod reference;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rustls_pki_types::CertificateDer;
use sha2::{Digest, Sha256};

pub use auth::Credentials;
pub use reference::{Reference, SCHEME};

/// When a reference goes to the registry (Istio's `imagePullPolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullPolicy {
    /// From the cache when pulled before; a digest is never pulled twice.
    IfNotPresent,
    /// A tag is resolved again on every policy load (a digest still
    /// comes from the cache).
    Always,
}

impl PullPolicy {
    /// Istio's default: `Always` for `latest` (or no tag), else `IfNotPresent`.
    pub fn default_for(reference: &Reference) -> PullPolicy {
        match (&reference.digest, reference.tag.as_deref()) {
            (None, Some("latest") | None) => PullPolicy::Always,
            _ => PullPolicy::IfNotPresent,
        }
    }
}

/// How to pull one plugin.
#[derive(Debug, Clone)]
pub struct Pull {
    pub policy: PullPolicy,
    /// A Docker config file (`.dockerconfigjson`) with the registry's
    /// credentials.
    pub secret: Option<PathBuf>,
    /// CAs for a private registry's certificate, beside the system's.
    pub ca: Vec<CertificateDer<'static>>,
    /// Plain HTTP allowed and certificates not verified.
    pub insecure: bool,
    /// The whole pull's deadline.
    pub deadline: Duration,
    /// The module's largest size (and any layer's).
    pub limit: u64,
}

/// A module pulled (or found in the cache).
#[derive(Debug)]
pub struct Pulled {
    pub module: Vec<u8>,
    /// The manifest's digest, `sha256:…`.
    pub digest: String,
    /// Not from the registry this time.
    pub from_cache: bool,
}

static CACHE_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Where pulled modules are kept: set once by the binary (beside
/// `--plugin-cache`), else [`default_cache_dir`].
pub fn set_cache_dir(dir: PathBuf) {
    *CACHE_DIR.lock().unwrap_or_else(|p| p.into_inner()) = Some(dir);
}

/// `$XDG_CACHE_HOME/portcullis/oci`, `$HOME/.cache/portcullis/oci`, or
/// under the temporary directory for a user without a home (a container
/// run as a numeric user): somewhere a non-root user may write.
pub fn default_cache_dir() -> PathBuf {
    let home = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .filter(|p| p.is_absolute());
    match home {
        Some(base) => base.join("portcullis").join("oci"),
        // SAFETY: geteuid has no preconditions.
        None => std::env::temp_dir().join(format!("portcullis-{}-oci", unsafe { libc::geteuid() })),
    }
}

fn cache_dir() -> PathBuf {
    let set = CACHE_DIR.lock().unwrap_or_else(|p| p.into_inner()).clone();
    set.unwrap_or_else(default_cache_dir)
}

/// Pulls the module `reference` names, or takes it from the cache as
/// `pull.policy` allows; blocks the calling thread until done or
/// `pull.deadline` passes.
pub fn pull(reference: &Reference, pull: &Pull) -> Result<Pulled, String> {
    let cache = cache::Cache::open(&cache_dir());
    if let Some(digest) = &reference.digest
        && let Some(module) = cache.by_manifest(digest)
    {
        tracing::debug!(reference = %reference, "plugin from the pull cache");
        return Ok(Pulled {
            module,
            digest: digest.clone(),
            from_cache: true,
        });
    }
    let shown = reference.to_string();
    // What the tag last named: read (a module file) only when it may be used.
    let cached_tag = || {
        cache
            .tag(&shown)
            .and_then(|d| cache.by_manifest(&d).map(|m| (d, m)))
    };
    if pull.policy == PullPolicy::IfNotPresent
        && let Some((digest, module)) = cached_tag()
    {
        tracing::debug!(reference = %reference, digest = %digest, "plugin from the pull cache");
        return Ok(Pulled {
            module,
            digest,
            from_cache: true,
        });
    }
    let deadline = pull.deadline;
    // Its own thread and runtime: callers are blocking threads, some
    // inside a tokio runtime (whose threads may not block on another).
    let fetched = std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Failure::Refused(format!("cannot start a pull: {e}")))?;
            rt.block_on(async {
                match tokio::time::timeout(deadline, fetch(reference, pull)).await {
                    Ok(r) => r,
                    Err(_) => Err(Failure::Unreachable(format!(
                        "the pull took over {deadline:?}"
                    ))),
                }
            })
        })
        .join()
        .unwrap_or_else(|_| Err(Failure::Refused("the pull crashed".into())))
    });
    match fetched {
        Ok((digest, module)) => {
            if let Err(e) = cache.store(
                reference.tag.is_some().then_some(shown.as_str()),
                &digest,
                &module,
            ) {
                tracing::warn!(reference = %shown, error = %e, "pulled plugin not cached");
            }
            tracing::info!(reference = %shown, digest = %digest, bytes = module.len(), "plugin pulled");
            Ok(Pulled {
                module,
                digest,
                from_cache: false,
            })
        }
        // The registry cannot be reached: what the tag last named, as
        // a restart with the registry down starts from the cache.
        Err(Failure::Unreachable(e)) => match cached_tag() {
            Some((digest, module)) => {
                tracing::warn!(reference = %shown, error = %e, digest = %digest, "registry unreachable; using the module this tag named when last pulled");
                Ok(Pulled {
                    module,
                    digest,
                    from_cache: true,
                })
            }
            None => Err(format!("cannot pull {shown}: {e}")),
        },
        Err(Failure::Refused(e)) => Err(format!("cannot pull {shown}: {e}")),
    }
}

/// Why a pull failed: the registry not reached (the cache may stand in)
/// or its answer refused.
enum Failure {
    Unreachable(String),
    Refused(String),
}

/// Resolves the manifest and fetches the module; its digest and bytes.
async fn fetch(reference: &Reference, pull: &Pull) -> Result<(String, Vec<u8>), Failure> {
    let credentials = match &pull.secret {
        Some(path) => {
            Credentials::from_docker_config(path, &reference.registry).map_err(Failure::Refused)?
        }
        None => None,
    };
    let plain = pull.insecure || reference.is_loopback();
    let mut client = client::Client::new(
        reference.endpoint(),
        plain,
        !pull.insecure,
        &pull.ca,
        credentials,
    );
    let repo = &reference.repository;
    let unreachable = |e: String| {
        if e.starts_with("connect") || e.contains("did not answer") {
            Failure::Unreachable(e)
        } else {
            Failure::Refused(e)
        }
    };
    let mut manifest_ref = reference.manifest_ref().to_owned();
    // An index names the manifest to fetch next: at most one step.
    for _ in 0..2 {
        let answer = client
            .get(
                &format!("/v2/{repo}/manifests/{manifest_ref}"),
                manifest::ACCEPT,
                4 << 20,
            )
            .await
            .map_err(unreachable)?;
        if answer.status.is_server_error() {
            return Err(Failure::Unreachable(format!(
                "the registry answered {} for the manifest",
                answer.status
            )));
        }
        if !answer.status.is_success() {
            return Err(Failure::Refused(refusal(
                answer.status,
                &answer.body,
                "manifest",
                reference,
            )));
        }
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&answer.body)));
        if manifest_ref.starts_with("sha256:") && digest != manifest_ref {
            return Err(Failure::Refused(format!(
                "the manifest's digest is {digest}, not {manifest_ref}: refused"
            )));
        }
        // The first manifest's digest is what a pin names.
        let pinned = reference.digest.clone().unwrap_or(digest.clone());
        let layer = match manifest::next(&answer.body).map_err(Failure::Refused)? {
            manifest::Next::Manifest(d) => {
                manifest_ref = reference::parse_digest(&d.digest).map_err(Failure::Refused)?;
                continue;
            }
            manifest::Next::Module(layer) => (layer, false),
            manifest::Next::Image(layer) => (layer, true),
        };
        let (layer, image) = layer;
        let want = reference::parse_digest(&layer.digest).map_err(Failure::Refused)?;
        if layer.size > pull.limit {
            return Err(Failure::Refused(format!(
                "its layer is {} bytes, over the bound of {}",
                layer.size, pull.limit
            )));
        }
        let blob = client
            .get(&format!("/v2/{repo}/blobs/{want}"), "*/*", pull.limit)
            .await
            .map_err(unreachable)?;
        if !blob.status.is_success() {
            return Err(Failure::Refused(refusal(
                blob.status,
                &blob.body,
                "layer",
                reference,
            )));
        }
        let got = format!("sha256:{}", hex::encode(Sha256::digest(&blob.body)));
        if got != want {
            return Err(Failure::Refused(format!(
                "the layer's bytes hash to {got}, not {want} as the manifest says: refused"
            )));
        }
        let module = if image {
            manifest::plugin_from_image(&blob.body, pull.limit).map_err(Failure::Refused)?
        } else {
            blob.body.to_vec()
        };
        return Ok((pinned, module));
    }
    Err(Failure::Refused("an index named another index".into()))
}

/// A registry's refusal, with its own error message when it sent one.
fn refusal(status: http::StatusCode, body: &[u8], what: &str, reference: &Reference) -> String {
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<Error>,
    }
    #[derive(serde::Deserialize)]
    struct Error {
        code: Option<String>,
        message: Option<String>,
    }
    let said = serde_json::from_slice::<Errors>(body)
        .ok()
        .and_then(|e| e.errors.into_iter().next())
        .map(|e| {
            format!(
                ": {} {}",
                e.code.unwrap_or_default(),
                e.message.unwrap_or_default()
            )
        })
        .unwrap_or_default();
    let hint = match status.as_u16() {
        401 | 403 => " (check `pull_secret`: the credentials for this registry)",
        404 => " (no such repository, tag or digest)",
        _ => "",
    };
    format!(
        "the registry {} answered {status} for the {what}{said}{hint}",
        reference.registry
    )
}
