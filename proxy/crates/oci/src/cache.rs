//! Pulled modules on disk, by digest, so a pinned reference is pulled
//! once and a restart with the registry down starts from what was pulled:
//!
//! - `modules/<sha256 of the module>.wasm`: the module;
//! - `manifests/<manifest digest's hex>`: the module's sha256 hex;
//! - `tags/<sha256 of the reference>`: the manifest digest a tag last named.
//!
//! A module file is used only when its bytes still hash to its name.

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub struct Cache {
    dir: PathBuf,
}

impl Cache {
    /// The cache in `dir`, made (user-only) if missing. One that cannot
    /// be made is a warning: pulls go on, uncached.
    pub fn open(dir: &Path) -> Cache {
        for sub in ["modules", "manifests", "tags"] {
            let made = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir.join(sub));
            if let Err(e) = made {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot make the plugin pull cache; pulled plugins are not kept (set --plugin-cache to a writable directory)");
                break;
            }
        }
        Cache {
            dir: dir.to_owned(),
        }
    }

    /// The module the manifest `digest` (`sha256:…`) was pulled as.
    pub fn by_manifest(&self, digest: &str) -> Option<Vec<u8>> {
        let hex = digest.strip_prefix("sha256:")?;
        let module = std::fs::read_to_string(self.dir.join("manifests").join(hex)).ok()?;
        self.module(module.trim())
    }

    /// The manifest digest `reference` (a tag) named when last resolved.
    pub fn tag(&self, reference: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.dir.join("tags").join(key(reference))).ok()?;
        crate::reference::parse_digest(text.trim()).ok()
    }

    fn module(&self, hex: &str) -> Option<Vec<u8>> {
        let bytes = std::fs::read(self.dir.join("modules").join(format!("{hex}.wasm"))).ok()?;
        (hex::encode(Sha256::digest(&bytes)) == hex).then_some(bytes)
    }

    /// Keeps `module` as what manifest `digest` holds, and `reference`
    /// (when a tag) as naming it.
    pub fn store(
        &self,
        reference: Option<&str>,
        digest: &str,
        module: &[u8],
    ) -> Result<(), String> {
        let hex = hex::encode(Sha256::digest(module));
        self.write(
            &self.dir.join("modules").join(format!("{hex}.wasm")),
            module,
        )?;
        let manifest = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.write(&self.dir.join("manifests").join(manifest), hex.as_bytes())?;
        if let Some(reference) = reference {
            self.write(
                &self.dir.join("tags").join(key(reference)),
                digest.as_bytes(),
            )?;
        }
        Ok(())
    }

    /// Writes whole or not at all: a file beside, then renamed.
    fn write(&self, path: &Path, bytes: &[u8]) -> Result<(), String> {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
            .and_then(|()| std::fs::rename(&tmp, path));
        written.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!(
                "cannot write {} in the plugin pull cache: {e}",
                path.display()
            )
        })
    }
}

/// A file name for a reference.
fn key(reference: &str) -> String {
    hex::encode(Sha256::digest(reference.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_are_found_by_manifest_and_tag_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path());
        let digest = format!("sha256:{}", "ab".repeat(32));
        assert!(cache.by_manifest(&digest).is_none());
        cache
            .store(Some("oci://r/x:1"), &digest, b"\0asm module")
            .unwrap();
        assert_eq!(cache.by_manifest(&digest).unwrap(), b"\0asm module");
        assert_eq!(cache.tag("oci://r/x:1").as_deref(), Some(digest.as_str()));
        assert!(cache.tag("oci://r/x:2").is_none());
        // A module file whose bytes changed is not used.
        let hex = hex::encode(Sha256::digest(b"\0asm module"));
        std::fs::write(
            dir.path().join("modules").join(format!("{hex}.wasm")),
            b"other",
        )
        .unwrap();
        assert!(cache.by_manifest(&digest).is_none());
    }
}
