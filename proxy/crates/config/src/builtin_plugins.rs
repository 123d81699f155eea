//! The standard plugins, built into the binary (see `embed_plugins.rs`, this crate's build script): a
//! policy names one as `path: builtin:NAME`, with no file beside it.

include!(concat!(env!("OUT_DIR"), "/builtin_plugins.rs"));

/// The prefix of a plugin `path` that names a built-in plugin.
pub const PREFIX: &str = "builtin:";

/// The component of the built-in plugin `name`.
pub fn get(name: &str) -> Option<&'static [u8]> {
    PLUGINS.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}

/// The keys of standard plugin `name`'s config that name an upstream of
/// the policies (the part of its config schema the policies check: a
/// typo there would otherwise pass `check` and fail every request the
/// plugin sends on, with 500 "plugin chose an unknown upstream").
pub fn upstream_keys(name: &str) -> &'static [&'static str] {
    match name {
        "canary-route" | "token-introspection" => &["upstream"],
        _ => &[],
    }
}

/// The built-in plugins' names, comma-separated, for error messages.
pub fn names() -> String {
    PLUGINS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_standard_plugin_is_built_in_as_a_component() {
        assert_eq!(super::PLUGINS.len(), 8, "{}", super::names());
        for (name, bytes) in super::PLUGINS {
            // A component's preamble: `\0asm`, then layer 1.
            assert_eq!(&bytes[..4], b"\0asm", "{name}");
            assert_eq!(
                bytes[6..8],
                [1, 0],
                "{name} is a core module, not a component"
            );
        }
        assert!(super::get("webhook-signature").is_some());
        assert!(super::get("nope").is_none());
    }
}
