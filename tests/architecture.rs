//! The workspace's crates depend on each other only in the order
//! docs/architecture.md gives, as `cargo metadata` reports them, and
//! wasmtime is linked by one crate; inside the crates, files import each
//! other in no circle; a crate
//! makes a module public only with a reason and a user outside it.

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
/// none (the last, the body type and the forwarding, went when the
/// forwarding became its own crate). A new circle fails here, by name.
#[test]
fn no_import_circle() {
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
    assert!(circles.is_empty(), "{text}");
}

/// Every `.rs` file under `dir`, with its text.
fn rust_files(dir: &Path, out: &mut Vec<(std::path::PathBuf, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("source");
            out.push((path, text));
        }
    }
}

/// Whether `text` names module `module` of crate `lib` by the crate's
/// name or `alias`: `lib::module` or `lib::{..., module, ...}`.
fn names_module(text: &str, lib: &str, module: &str) -> bool {
    let path = format!("{lib}::");
    text.match_indices(&path).any(|(at, _)| {
        // `lib` itself, not the end of a longer name.
        let starts = !text[..at].ends_with(|c: char| c == '_' || c.is_alphanumeric());
        let rest = &text[at + path.len()..];
        let word_ends = |r: &str| !r.starts_with(|c: char| c == '_' || c.is_alphanumeric());
        starts
            && match rest.strip_prefix('{') {
                Some(list) => list
                    .split('}')
                    .next()
                    .unwrap_or("")
                    .split(|c: char| c == ',' || c.is_whitespace())
                    .any(|item| item == module),
                None => rest.strip_prefix(module).is_some_and(word_ends),
            }
    })
}

/// The names `lib` goes by where it is imported under another
/// (`use portcullis_plugin as plugin`, `use portcullis_plugin::{self as
/// plugin, ...}`).
fn aliases(sources: &[(std::path::PathBuf, String)], lib: &str) -> Vec<String> {
    let mut names = vec![lib.to_owned()];
    let import = format!("{lib}::{{");
    let renamed = format!("{lib} as ");
    for (_, text) in sources {
        let after_import = text.match_indices(&import).filter_map(|(at, _)| {
            text[at + import.len()..]
                .trim_start()
                .strip_prefix("self as ")
        });
        let after_as = text
            .match_indices(&renamed)
            .map(|(at, _)| &text[at + renamed.len()..]);
        for rest in after_import.chain(after_as) {
            let name: String = rest
                .chars()
                .take_while(|c| *c == '_' || c.is_alphanumeric())
                .collect();
            if !name.is_empty() && !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

/// Modules are private unless something outside their crate uses them by
/// path: every `pub mod` in a crate's root says why on the line before
/// (`// Public: what, for whom`), and something outside the crate (a
/// crate above, the binary, the tests, the fuzz targets) does name it.
#[test]
fn every_public_module_says_why_and_is_used_outside_its_crate() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut sources = Vec::new();
    for dir in ["proxy", "tests"] {
        rust_files(&repo.join(dir), &mut sources);
    }
    // The binary's own crate is used by its `main.rs`, in its directory.
    let mut roots = vec![(repo.join("proxy/src/lib.rs"), "portcullis".to_owned(), None)];
    for entry in std::fs::read_dir(repo.join("proxy/crates")).expect("crates") {
        let dir = entry.expect("crate").path();
        let name = dir
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        roots.push((
            dir.join("src/lib.rs"),
            format!("portcullis_{name}"),
            Some(dir),
        ));
    }
    let mut wrong = Vec::new();
    for (root, lib, own) in roots {
        let own = own.as_deref();
        let names = aliases(&sources, &lib);
        let text = std::fs::read_to_string(&root).expect("lib.rs");
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some(module) = line
                .strip_prefix("pub mod ")
                .and_then(|m| m.strip_suffix(';'))
            else {
                continue;
            };
            let at = format!("{}:{}", root.display(), i + 1);
            // The comment block right above it, first line first.
            let block = lines[..i]
                .iter()
                .rev()
                .take_while(|l| l.trim_start().starts_with("//"))
                .last();
            if !block.is_some_and(|l| l.trim_start().starts_with("// Public: ")) {
                wrong.push(format!(
                    "{at}: `pub mod {module}` without `// Public: why` above it"
                ));
            }
            // Outside the crate: its own files name it `crate::...`, and
            // may take the names it goes by elsewhere for other things.
            let outside = sources
                .iter()
                .filter(|(p, _)| !own.is_some_and(|d| p.starts_with(d)));
            if !outside
                .clone()
                .any(|(_, t)| names.iter().any(|n| names_module(t, n, module)))
            {
                wrong.push(format!(
                    "{at}: `{module}` is used by nothing outside `{lib}`: make it private"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn a_module_is_named_from_outside_only_by_its_path() {
    assert!(names_module(
        "use portcullis_net::shard::this_thread;",
        "portcullis_net",
        "shard"
    ));
    assert!(names_module(
        "pub use portcullis_http::{chain, forward};",
        "portcullis_http",
        "forward"
    ));
    assert!(!names_module(
        "use portcullis_net::sharding;",
        "portcullis_net",
        "shard"
    ));
    assert!(!names_module(
        "use portcullis::shard;",
        "portcullis_net",
        "shard"
    ));
    assert!(!names_module(
        "use portcullis_portcullis::shard;",
        "portcullis",
        "shard"
    ));
    assert!(!names_module(
        "use portcullis_http::{chain};",
        "portcullis_http",
        "forward"
    ));
}
