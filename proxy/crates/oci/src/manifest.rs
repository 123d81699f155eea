//! Which layer of a manifest holds the module, and the module out of it:
//! the two forms Istio's `WasmPlugin` accepts — an OCI artifact whose
//! layer is the module itself, and an image whose one layer (a tar,
//! gzipped or not) holds `plugin.wasm`.

use std::io::Read;

use serde::Deserialize;

/// Asked for when fetching a manifest.
pub const ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
application/vnd.docker.distribution.manifest.v2+json, \
application/vnd.oci.image.index.v1+json, \
application/vnd.docker.distribution.manifest.list.v2+json";

/// Layer types that are the module itself: the compat variant Istio
/// documents, the wasm-to-oci one, and `application/wasm`.
const MODULE_LAYERS: [&str; 3] = [
    "application/vnd.module.wasm.content.layer.v1+wasm",
    "application/vnd.wasm.content.layer.v1+wasm",
    "application/wasm",
];

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    media_type: Option<String>,
    #[serde(default)]
    layers: Vec<Descriptor>,
    /// Set on an index (a multi-platform list).
    manifests: Option<Vec<Descriptor>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: u64,
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
}

/// What a manifest says to fetch next.
#[derive(Debug)]
pub enum Next {
    /// An index: the manifest for the wasm platform (or its only one).
    Manifest(Descriptor),
    /// The layer that is the module.
    Module(Descriptor),
    /// The image layer holding `plugin.wasm`.
    Image(Descriptor),
}

/// Reads a manifest (or index) and says what to fetch.
pub fn next(body: &[u8]) -> Result<Next, String> {
    let m: Manifest = serde_json::from_slice(body)
        .map_err(|e| format!("the manifest is not JSON a registry sends: {e}"))?;
    if let Some(list) = m.manifests {
        let wasm = |d: &&Descriptor| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.architecture == "wasm" || p.os.starts_with("wasi"))
        };
        return match (list.iter().find(wasm), list.as_slice()) {
            (Some(d), _) | (None, [d]) => Ok(Next::Manifest(d.clone())),
            (None, _) => Err(format!(
                "the reference names an index of {} manifests, none for a wasm platform (architecture `wasm` or os `wasi*`)",
                list.len()
            )),
        };
    }
    if let Some(layer) = m
        .layers
        .iter()
        .find(|l| MODULE_LAYERS.contains(&l.media_type.as_str()))
    {
        return Ok(Next::Module(layer.clone()));
    }
    match m.layers.as_slice() {
        [layer] if layer.media_type.contains("tar") => Ok(Next::Image(layer.clone())),
        [] => Err(format!(
            "the manifest ({}) has no layers",
            m.media_type.as_deref().unwrap_or("no media type")
        )),
        layers => Err(format!(
            "no layer holds a wasm module: neither one of type {} nor an image with one layer holding plugin.wasm (layers: {})",
            MODULE_LAYERS[0],
            layers
                .iter()
                .map(|l| l.media_type.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// `plugin.wasm` out of an image layer (a tar, gzipped or not), read up
/// to `limit` bytes.
pub fn plugin_from_image(layer: &[u8], limit: u64) -> Result<Vec<u8>, String> {
    // The bytes say whether it is gzipped; media types are not always honest.
    let reader: Box<dyn Read + '_> = if layer.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::GzDecoder::new(layer))
    } else {
        Box::new(layer)
    };
    // A layer that inflates without end (a gzip bomb) is read no further
    // than twice the module's bound (and a MiB for the tar's own
    // records): the pull's deadline cannot stop work that never waits.
    let expanded = limit.saturating_mul(2).saturating_add(1 << 20);
    let mut archive = tar::Archive::new(reader.take(expanded));
    let entries = archive
        .entries()
        .map_err(|e| format!("the image layer is not a tar: {e}"))?;
    let missing = || {
        format!(
            "the image's layer holds no plugin.wasm in its first {expanded} bytes (an image for a plugin has one layer with plugin.wasm at its root)"
        )
    };
    for entry in entries {
        let mut entry = entry.map_err(|e| {
            // Cut off at the bound (or a tar cut short): the tar crate
            // says so in words, not always by kind.
            let cut = e.kind() == std::io::ErrorKind::UnexpectedEof
                || e.to_string().contains("unexpected EOF");
            if cut {
                missing()
            } else {
                format!("the image layer is not a tar: {e}")
            }
        })?;
        let path = entry
            .path()
            .map_err(|e| format!("the image layer is not a tar: {e}"))?;
        let name = path.to_string_lossy();
        if name.trim_start_matches("./").trim_start_matches('/') != "plugin.wasm" {
            continue;
        }
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err("plugin.wasm in the image layer is not a regular file".into());
        }
        let mut module = Vec::new();
        (&mut entry)
            .take(limit + 1)
            .read_to_end(&mut module)
            .map_err(|e| format!("cannot read plugin.wasm from the image layer: {e}"))?;
        if module.len() as u64 > limit {
            return Err(format!(
                "plugin.wasm in the image layer is over the bound of {limit} bytes"
            ));
        }
        return Ok(module);
    }
    Err(missing())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tarball(name: &str, data: &[u8], gzip: bool) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).unwrap();
        let tar = b.into_inner().unwrap();
        if !gzip {
            return tar;
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn the_module_comes_out_of_either_image_layer() {
        for gzip in [true, false] {
            let layer = tarball("./plugin.wasm", b"\0asm\x01\0\0\0", gzip);
            assert_eq!(plugin_from_image(&layer, 100).unwrap(), b"\0asm\x01\0\0\0");
        }
        let layer = tarball("other.wasm", b"x", true);
        let e = plugin_from_image(&layer, 100).unwrap_err();
        assert!(e.contains("holds no plugin.wasm"), "{e}");
        let mut big = tar::Builder::new(Vec::new());
        for (name, size) in [("padding", 2 << 20), ("plugin.wasm", 8)] {
            let mut h = tar::Header::new_gnu();
            h.set_size(size);
            h.set_mode(0o644);
            h.set_cksum();
            big.append_data(&mut h, name, &vec![0u8; size as usize][..])
                .unwrap();
        }
        let e = plugin_from_image(&big.into_inner().unwrap(), 100).unwrap_err();
        assert!(
            e.contains("no plugin.wasm in its first 1048776 bytes"),
            "{e}"
        );
        let layer = tarball("plugin.wasm", &[0; 200], true);
        let e = plugin_from_image(&layer, 100).unwrap_err();
        assert!(e.contains("over the bound"), "{e}");
    }

    #[test]
    fn manifests_name_the_layer_to_fetch() {
        let d = "sha256:aa";
        let artifact = format!(
            r#"{{"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{}},"layers":[{{"mediaType":"application/vnd.module.wasm.content.layer.v1+wasm","digest":"{d}","size":8}}]}}"#
        );
        assert!(matches!(next(artifact.as_bytes()).unwrap(), Next::Module(l) if l.digest == d));
        let image = format!(
            r#"{{"layers":[{{"mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","digest":"{d}","size":8}}]}}"#
        );
        assert!(matches!(next(image.as_bytes()).unwrap(), Next::Image(_)));
        let two = r#"{"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"a"},{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"b"}]}"#;
        let e = next(two.as_bytes()).unwrap_err();
        assert!(e.contains("no layer holds a wasm module"), "{e}");
        let index = r#"{"manifests":[{"digest":"a","platform":{"architecture":"amd64","os":"linux"}},{"digest":"b","platform":{"architecture":"wasm","os":"wasip1"}}]}"#;
        assert!(matches!(next(index.as_bytes()).unwrap(), Next::Manifest(m) if m.digest == "b"));
    }
}
