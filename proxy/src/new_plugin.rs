//! `portcullis new-plugin DIR`: a plugin crate to start from, written
//! where the user wants it with the SDK beside it, so it builds with one
//! cargo command and no checkout of this repository (`cargo new` for
//! Portcullis plugins). The files are plugins/template and plugins/sdk,
//! built into the binary; the versions the plugins here are tested with
//! come along as its Cargo.lock.

use std::path::Path;
use std::process::ExitCode;

/// The name the template is written with, in its two spellings.
const TEMPLATE_NAME: &str = "my-plugin";
const TEMPLATE_FILE_NAME: &str = "my_plugin";

/// Where the SDK goes in the new crate, and where the template's manifest
/// names it in this repository.
const SDK_DIR: &str = "portcullis-sdk";
const SDK_IN_REPO: &str = r#"path = "../sdk""#;

/// The template's files: path in the new crate, text.
pub const TEMPLATE: [(&str, &str); 4] = [
    (
        "Cargo.toml",
        include_str!("../../plugins/template/Cargo.toml"),
    ),
    (
        "src/lib.rs",
        include_str!("../../plugins/template/src/lib.rs"),
    ),
    (
        "policy.yaml",
        include_str!("../../plugins/template/policy.yaml"),
    ),
    ("Cargo.lock", include_str!("../../plugins/Cargo.lock")),
];

/// The SDK's files, under `SDK_DIR` (a test keeps this list equal to
/// plugins/sdk's files).
pub const SDK: [(&str, &str); 5] = [
    ("Cargo.toml", include_str!("../../plugins/sdk/Cargo.toml")),
    ("src/lib.rs", include_str!("../../plugins/sdk/src/lib.rs")),
    (
        "src/bearer.rs",
        include_str!("../../plugins/sdk/src/bearer.rs"),
    ),
    (
        "src/recycling.rs",
        include_str!("../../plugins/sdk/src/recycling.rs"),
    ),
    (
        "wit/policy.wit",
        include_str!("../../plugins/sdk/wit/policy.wit"),
    ),
];

/// Writes a plugin crate named `name` (by default `dir`'s last part) into
/// `dir`, which must be missing or empty.
pub fn new_plugin(dir: &Path, name: Option<&str>) -> ExitCode {
    match write(dir, name) {
        Ok(name) => {
            let d = dir.display();
            println!(
                "Created plugin `{name}` in {d} (the SDK in {d}/{SDK_DIR}). Next:\n  \
                 cd {d} && cargo build --release --target wasm32-wasip2   \
                 (once: rustup target add wasm32-wasip2)\n  \
                 portcullis check --policies {d}     # policy.yaml there uses it\n  \
                 portcullis serve --policies {d}"
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("portcullis new-plugin: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write(dir: &Path, name: Option<&str>) -> Result<String, String> {
    let name = match name {
        Some(n) => n.to_owned(),
        None => dir
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| {
                format!(
                    "{} has no name to give the plugin: add --name",
                    dir.display()
                )
            })?
            .to_owned(),
    };
    check_name(&name)?;
    match std::fs::read_dir(dir).map(|mut entries| entries.next().is_some()) {
        Ok(true) => {
            return Err(format!(
                "{} exists and is not empty; pick a new directory",
                dir.display()
            ));
        }
        Ok(false) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    }
    let named = |text: &str| {
        text.replace(TEMPLATE_NAME, &name)
            .replace(TEMPLATE_FILE_NAME, &name.replace('-', "_"))
    };
    let sdk_beside = format!("path = {SDK_DIR:?}");
    let files = TEMPLATE
        .iter()
        .map(|(path, text)| {
            let text = match *path {
                "Cargo.toml" => named(text).replace(SDK_IN_REPO, &sdk_beside),
                "Cargo.lock" => text.to_string(),
                _ => named(text),
            };
            (path.to_string(), text)
        })
        .chain(
            SDK.iter()
                .map(|(path, text)| (format!("{SDK_DIR}/{path}"), text.to_string())),
        );
    for (path, text) in files {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(name)
}

/// A name cargo takes for a package and that stays a file name: letters,
/// digits, `-` and `_`, starting with a letter.
fn check_name(name: &str) -> Result<(), String> {
    let ok = name.starts_with(|c: char| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{name}` is not a plugin name (letters, digits, - and _, starting with a letter): pass --name"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_names_what_is_replaced() {
        let manifest = TEMPLATE[0].1;
        assert!(manifest.contains(SDK_IN_REPO));
        assert!(manifest.contains(&format!("name = {TEMPLATE_NAME:?}")));
        assert!(
            TEMPLATE[2]
                .1
                .contains(&format!("{TEMPLATE_FILE_NAME}.wasm"))
        );
    }

    #[test]
    fn names_cargo_would_refuse_are_refused() {
        assert!(check_name("edge-auth_2").is_ok());
        for bad in ["", "2fa", "a b", "../x", "ünï"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
