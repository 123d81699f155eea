//! Plugins named `oci://…`: pulled from their registry (or taken from
//! the pull cache) while the policies are read, so a pull happens before
//! the policy naming it takes traffic, and a failed one fails the load.

use super::*;
use crate::raw::RawPlugin;
use portcullis_oci::{Pull, PullPolicy, Reference};

/// One pull's deadline (the policies' whole read has its own, longer).
pub const PULL_DEADLINE: Duration = Duration::from_secs(30);

/// Whether `path` names a registry.
pub(super) fn is_oci(path: &str) -> bool {
    path.trim().starts_with(portcullis_oci::SCHEME)
}

/// The module `text` (an `oci://` reference) names, and the reference as
/// its path.
pub(super) fn pulled(
    ctx: &mut Ctx,
    p: &RawPlugin,
    text: &str,
) -> Option<(std::path::PathBuf, Vec<u8>)> {
    let reference = match Reference::parse(text) {
        Ok(r) => r,
        Err(e) => {
            ctx.err(&p.path.referenced, e);
            return None;
        }
    };
    let policy = match &p.pull_policy {
        None => Some(PullPolicy::default_for(&reference)),
        Some(t) => ctx.parse(t, |s| match s {
            "IfNotPresent" => Ok(PullPolicy::IfNotPresent),
            "Always" => Ok(PullPolicy::Always),
            _ => Err(format!(
                "`{s}` is not a pull policy; write IfNotPresent or Always"
            )),
        }),
    };
    // `Some(None)`: set, and refused (reported); read on so that the
    // other settings' mistakes are reported in the same run.
    let secret = p.pull_secret.as_ref().map(|t| ctx.path(t));
    let mut ca = Vec::new();
    if let Some(t) = &p.registry_ca
        && let Some(path) = ctx.path(t)
    {
        match portcullis_net::pem::certificates(&path) {
            Ok(certs) => ca = certs,
            Err(e) => ctx.err(&t.referenced, format!("registry_ca: {e}")),
        }
    }
    let insecure = ctx.flag(&p.insecure_registry, false);
    let policy = policy?;
    if matches!(secret, Some(None)) {
        return None;
    }
    let pull = Pull {
        policy,
        secret: secret.flatten(),
        ca,
        insecure,
        deadline: PULL_DEADLINE,
        limit: portcullis_net::files::PLUGIN_LIMIT,
    };
    match portcullis_oci::pull(&reference, &pull) {
        Ok(got) => Some((std::path::PathBuf::from(reference.to_string()), got.module)),
        Err(e) => {
            ctx.err(&p.path.referenced, e);
            None
        }
    }
}

/// The pull settings on a plugin whose path is a file: said, not ignored.
pub(super) fn settings_without_registry(ctx: &mut Ctx, p: &RawPlugin) {
    let set = [
        ("pull_policy", &p.pull_policy),
        ("pull_secret", &p.pull_secret),
        ("registry_ca", &p.registry_ca),
        ("insecure_registry", &p.insecure_registry),
    ];
    for (name, t) in set {
        if let Some(t) = t {
            ctx.err(
                &t.referenced,
                format!("`{name}` applies to a plugin pulled from a registry (`path: oci://…`), not to a file"),
            );
        }
    }
}
