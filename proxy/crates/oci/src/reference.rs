//! `oci://HOST[:PORT]/REPO[:TAG][@sha256:DIGEST]`, as Istio's
//! `WasmPlugin` `url` names a module in a registry.

use std::fmt;

/// What `oci://` names, parsed and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `HOST[:PORT]`, as credentials are keyed in a Docker config.
    pub registry: String,
    /// The repository: lower-case path components.
    pub repository: String,
    /// The tag; `latest` when neither a tag nor a digest is given.
    pub tag: Option<String>,
    /// `sha256:<64 hex>`, the manifest's digest, when pinned.
    pub digest: Option<String>,
}

/// The scheme a plugin's `path:` names a registry with.
pub const SCHEME: &str = "oci://";

/// Docker Hub, as references name it, the names it also goes by, and
/// where its API answers.
pub const DOCKER_HUB: &str = "docker.io";
pub const DOCKER_HUB_NAMES: [&str; 3] = ["docker.io", "index.docker.io", "registry-1.docker.io"];
const DOCKER_HUB_API: &str = "registry-1.docker.io";

impl Reference {
    /// Parses `text` (with or without the `oci://` scheme).
    pub fn parse(text: &str) -> Result<Reference, String> {
        let rest = text.trim().strip_prefix(SCHEME).unwrap_or(text.trim());
        let shape = "an OCI reference is oci://HOST[:PORT]/REPOSITORY[:TAG][@sha256:DIGEST]";
        let Some((registry, name)) = rest.split_once('/') else {
            return Err(format!("`{text}` names no repository: {shape}"));
        };
        if registry.is_empty()
            || !registry
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
        {
            return Err(format!("`{registry}` is not a registry host: {shape}"));
        }
        let (name, digest) = match name.split_once('@') {
            Some((name, digest)) => (name, Some(parse_digest(digest)?)),
            None => (name, None),
        };
        // A tag follows the last `:` of the last path component (a port's
        // `:` is in the registry, already cut off).
        let last = name.rfind('/').map_or(0, |i| i + 1);
        let (repository, tag) = match name[last..].find(':') {
            Some(i) => (&name[..last + i], Some(&name[last + i + 1..])),
            None => (name, None),
        };
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && c.as_bytes()[0].is_ascii_alphanumeric()
        };
        if !repository.split('/').all(component_ok) {
            return Err(format!(
                "`{repository}` is not a repository name (lower-case letters, digits, `.`, `_`, `-`, components split by `/`): {shape}"
            ));
        }
        if let Some(tag) = tag {
            let ok = (1..=128).contains(&tag.len())
                && tag
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                && !tag.starts_with(['.', '-']);
            if !ok {
                return Err(format!(
                    "`{tag}` is not a tag (letters, digits, `.`, `_`, `-`, at most 128): {shape}"
                ));
            }
        }
        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_owned()),
            (None, Some(_)) => None,
            (None, None) => Some("latest".to_owned()),
        };
        // Docker Hub goes by several names, and its official images by
        // their bare names (`docker.io/nginx` is `library/nginx`), as the
        // Docker CLI reads them.
        let (registry, repository) = if DOCKER_HUB_NAMES.contains(&registry) {
            let repository = match repository.contains('/') {
                true => repository.to_owned(),
                false => format!("library/{repository}"),
            };
            (DOCKER_HUB.to_owned(), repository)
        } else {
            (registry.to_owned(), repository.to_owned())
        };
        Ok(Reference {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// Where the registry's API answers: Docker Hub's at
    /// `registry-1.docker.io`, any other at its own name.
    pub fn endpoint(&self) -> &str {
        if self.registry == DOCKER_HUB {
            DOCKER_HUB_API
        } else {
            &self.registry
        }
    }

    /// What a manifest is asked for by: the digest when pinned, else the tag.
    pub fn manifest_ref(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }

    /// The host without the port, for deciding about loopback.
    pub fn host(&self) -> &str {
        let r = self.registry.as_str();
        if let Some(v6) = r.strip_prefix('[') {
            return v6.split(']').next().unwrap_or(v6);
        }
        r.rsplit_once(':').map_or(r, |(h, _)| h)
    }

    /// A registry on this machine: plain HTTP is allowed there, as Docker
    /// allows it for `localhost` and 127.0.0.0/8.
    pub fn is_loopback(&self) -> bool {
        let host = self.host();
        host.eq_ignore_ascii_case("localhost")
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
}

/// `sha256:<64 lower-case hex>`; other algorithms are refused by name.
pub fn parse_digest(text: &str) -> Result<String, String> {
    let Some(hex) = text.strip_prefix("sha256:") else {
        return Err(format!(
            "`{text}` is not a sha256 digest (sha256:<64 hex digits>)"
        ));
    };
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "`{text}` is not a sha256 digest (sha256:<64 hex digits>)"
        ));
    }
    Ok(format!("sha256:{}", hex.to_ascii_lowercase()))
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SCHEME}{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn docker_hub_goes_by_its_names_and_official_images_by_theirs() {
        for text in [
            "oci://docker.io/nginx:1",
            "oci://index.docker.io/library/nginx:1",
            "oci://registry-1.docker.io/nginx:1",
        ] {
            let r = Reference::parse(text).unwrap();
            assert_eq!(
                (r.registry.as_str(), r.repository.as_str(), r.endpoint()),
                ("docker.io", "library/nginx", "registry-1.docker.io"),
                "{text}"
            );
            assert_eq!(r.to_string(), "oci://docker.io/library/nginx:1");
        }
        let r = Reference::parse("oci://docker.io/team/authz:v2").unwrap();
        assert_eq!(r.repository, "team/authz");
        // Elsewhere a bare name stays bare, and the API is the registry's own.
        let r = Reference::parse("oci://ghcr.io/authz:v2").unwrap();
        assert_eq!((r.repository.as_str(), r.endpoint()), ("authz", "ghcr.io"));
    }

    #[test]
    fn the_forms_istio_accepts_parse() {
        let r = Reference::parse("oci://127.0.0.1:5000/team/authz:v2").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "team/authz");
        assert_eq!(r.tag.as_deref(), Some("v2"));
        assert!(r.is_loopback());
        let r = Reference::parse(&format!("oci://ghcr.io/a/b@{D}")).unwrap();
        assert_eq!((r.tag, r.digest.as_deref()), (None, Some(D)));
        let r = Reference::parse("oci://ghcr.io/a/b").unwrap();
        assert_eq!(r.tag.as_deref(), Some("latest"));
        assert!(!r.is_loopback());
        let r = Reference::parse(&format!("oci://localhost:5000/b:1.0@{D}")).unwrap();
        assert_eq!(r.manifest_ref(), D);
        assert!(r.is_loopback());
        assert_eq!(r.to_string(), format!("oci://localhost:5000/b:1.0@{D}"));
        assert!(
            Reference::parse("oci://[::1]:5000/b")
                .unwrap()
                .is_loopback()
        );
    }

    #[test]
    fn malformed_references_say_what_is_wrong() {
        let e = Reference::parse("oci://ghcr.io").unwrap_err();
        assert!(e.contains("names no repository"), "{e}");
        let e = Reference::parse("oci://ghcr.io/Team/x").unwrap_err();
        assert!(e.contains("`Team/x` is not a repository name"), "{e}");
        let e = Reference::parse("oci://ghcr.io/x:bad tag").unwrap_err();
        assert!(e.contains("is not a tag"), "{e}");
        let e = Reference::parse("oci://ghcr.io/x@md5:abc").unwrap_err();
        assert!(e.contains("not a sha256 digest"), "{e}");
    }
}
