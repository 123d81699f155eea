//! The workspace's crates depend on each other only in the order
//! docs/architecture.md gives, as `cargo metadata` reports them, and
//! wasmtime is linked by one crate; inside the crates, files import each
//! other in no circle but the one docs/architecture.md names.

use std::collections::HashMap;
use std::path::Path;

/// The crates in docs/architecture.md's table, in its order.
fn documented_order(repo: &Path) -> Vec<String> {
    let page =
        std::fs::read_to_string(repo.join("docs/architecture.md")).expect("architecture page");
    page.lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`').map(|(name, _)| name.to_owned()))
        .filter(|name| name.starts_with("portcullis"))
        .collect()
}

/// Each workspace package's direct dependencies (normal ones: the tests'
/// may reach further), from `cargo metadata`.
fn workspace_dependencies(repo: &Path) -> HashMap<String, Vec<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(repo)
        .output()
        .expect("cargo metadata");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().expect("name").to_owned())
                .collect();
            (p["name"].as_str().expect("name").to_owned(), deps)
        })
        .collect()
}

#[test]
fn crates_depend_only_on_those_before_them_and_one_links_wasmtime() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let order = documented_order(&repo);
    let packages = workspace_dependencies(&repo);
    let mut names: Vec<_> = packages.keys().cloned().collect();
    names.sort();
    let mut documented = order.clone();
    documented.sort();
    assert_eq!(
        names, documented,
        "every workspace crate, and only those, in the table"
    );
    for (i, name) in order.iter().enumerate() {
        for dep in &packages[name] {
            if let Some(j) = order.iter().position(|o| o == dep) {
                assert!(j < i, "{name} uses {dep}, which comes after it");
            }
        }
    }
    let linking: Vec<_> = order
        .iter()
        .filter(|name| packages[*name].iter().any(|d| d.starts_with("wasmtime")))
        .collect();
    assert_eq!(linking, ["portcullis-plugin"]);
}

/// `bench/module_cycles.py --all`'s circles of files importing each other:
/// only the one docs/architecture.md owns to (the body type and the
/// forwarding, until the forwarding is a crate of its own). A new circle
/// fails here, by name.
#[test]
fn no_import_circle_but_the_one_documented() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("python3")
        .arg(repo.join("bench/module_cycles.py"))
        .arg("--all")
        .arg(&repo)
        .output()
        .expect("python3 runs bench/module_cycles.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let circles: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("cycle: "))
        .collect();
    assert_eq!(
        circles,
        ["portcullis_http/body.rs portcullis_http/forward/mod.rs"],
        "{text}"
    );
}
