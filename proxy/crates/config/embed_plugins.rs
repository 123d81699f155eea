//! Builds the standard plugins (`plugins/`) for wasm32-wasip2 and embeds
//! them, so a policy can name one as `builtin:NAME` with no file and no
//! build step of its own (the default policies' webhook check among
//! them). A nested cargo, in a target directory of its own beside this
//! build's: sharing this build's would wait on its lock.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The standard plugins, by package name.
const BUILTIN: &[&str] = &[
    "webhook-signature",
    "header-rules",
    "jwt-auth",
    "ip-allow",
    "basic-auth",
    "client-cert-allow",
    "canary-route",
    "token-introspection",
];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"));
    let plugins = manifest.join("../../../plugins");
    for watched in ["Cargo.toml", "Cargo.lock", "sdk"].iter().chain(BUILTIN) {
        println!("cargo:rerun-if-changed={}", plugins.join(watched).display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        manifest.join("../../../wit").display()
    );
    // Builds that need no plugin (the fuzz targets, on a nightly that may
    // lack the wasm32-wasip2 target) leave them out.
    println!("cargo:rerun-if-env-changed=PORTCULLIS_NO_BUILTIN_PLUGINS");
    if std::env::var_os("PORTCULLIS_NO_BUILTIN_PLUGINS").is_some() {
        let empty = "/// The standard plugins, by name (none in this build).\n\
                     pub static PLUGINS: &[(&str, &[u8])] = &[];\n";
        std::fs::write(out.join("builtin_plugins.rs"), empty).expect("write the plugin table");
        return;
    }
    let target = plugin_target_dir(&out);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args([
            "build",
            "--locked",
            "--release",
            "--target",
            "wasm32-wasip2",
        ])
        .arg("--manifest-path")
        .arg(plugins.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target);
    for p in BUILTIN {
        build.args(["-p", p]);
    }
    // This build's own flags and wrappers (a fuzz build's coverage
    // instrumentation, clippy) are not the plugins'.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_TARGET",
    ] {
        build.env_remove(var);
    }
    let status = build.status().expect("run cargo for the standard plugins");
    assert!(
        status.success(),
        "building the standard plugins (plugins/, wasm32-wasip2) failed; \
         `rustup target add wasm32-wasip2` if the target is missing"
    );
    let mut table = String::from(
        "/// The standard plugins, by name.\npub static PLUGINS: &[(&str, &[u8])] = &[\n",
    );
    for p in BUILTIN {
        let built = target.join(format!(
            "wasm32-wasip2/release/{}.wasm",
            p.replace('-', "_")
        ));
        let kept = out.join(format!("{p}.wasm"));
        std::fs::copy(&built, &kept).unwrap_or_else(|e| panic!("copying {}: {e}", built.display()));
        table.push_str(&format!(
            "    ({p:?}, include_bytes!({:?})),\n",
            kept.display().to_string()
        ));
    }
    table.push_str("];\n");
    std::fs::write(out.join("builtin_plugins.rs"), table).expect("write the plugin table");
}

/// `<target>/builtin-plugins`, `<target>` being this build's target
/// directory (OUT_DIR is `<target>[/<triple>]/<profile>/build/<pkg>/out`):
/// one for debug and release builds alike, kept across `cargo clean -p`.
fn plugin_target_dir(out: &Path) -> PathBuf {
    let build = out
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "build"))
        .expect("OUT_DIR lies under a build directory");
    let profile = build.parent().expect("a profile directory");
    profile.parent().unwrap_or(profile).join("builtin-plugins")
}
