//! The README and docs/: their examples run, their links land, the
//! README stays short.

use std::process::Command;

use crate::support::{binary, check};

/// The container `args` in the Kubernetes page's manifests are flags the
/// binary takes, with values it accepts: clap parses every argument
/// before acting on the `--help` put after them, so a renamed flag or a
/// bad value fails here (a required flag left out would not).
#[test]
fn the_kubernetes_examples_use_flags_that_exist() {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/kubernetes.md"),
    )
    .expect("docs/kubernetes.md");
    let section = page.as_str();
    let mut commands = Vec::new();
    for (at, _) in section.match_indices("args: [") {
        let list = &section[at + "args: ".len()..];
        let list = &list[..=list.find(']').expect("a closed list")];
        let args: Vec<String> = serde_json::from_str(list).expect("args as a JSON-style list");
        let out = Command::new(binary())
            .args(&args)
            .arg("--help")
            .output()
            .expect("run portcullis");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        commands.push(args[0].clone());
    }
    assert_eq!(commands, ["serve", "tunnel-client", "tunnel-server"]);
}

/// The README is short and leads everywhere: its first policy is one
/// `check` takes, every page in docs/ is linked from it, and it stays
/// within 200 lines.
#[test]
fn the_readmes_first_policy_checks_and_every_docs_page_is_linked() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(repo.join("README.md")).expect("README.md");
    assert!(
        readme.lines().count() <= 200,
        "README.md is {} lines",
        readme.lines().count()
    );
    let from = readme.find("## A first policy").expect("the section");
    let block = &readme[from..];
    let start = "```yaml policy\n";
    let block = &block[block.find(start).expect("a yaml block") + start.len()..];
    let block = &block[..block.find("```").expect("its end")];
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("app.yaml"), block).unwrap();
    let (ok, stdout, stderr) = check(dir.path());
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("1 upstreams, 3 routes, 1 plugins"),
        "{stdout}"
    );
    let mut pages = 0;
    for entry in std::fs::read_dir(repo.join("docs")).expect("docs/") {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            assert!(
                readme.contains(&format!("(docs/{name})")),
                "docs/{name} is not linked from the README"
            );
            pages += 1;
        }
    }
    assert!(pages >= 10, "{pages} pages");
}

/// Every link in the README and docs/ to a page, a heading of a page, or
/// a file of the repository lands on one that exists.
#[test]
fn every_link_in_the_docs_lands() {
    // GitHub's anchor of a heading: lower case, spaces to dashes, other
    // punctuation dropped.
    let anchors = |page: &std::path::Path| -> Vec<String> {
        std::fs::read_to_string(page)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with('#'))
            .map(|l| {
                l.trim_start_matches('#')
                    .trim()
                    .to_lowercase()
                    .chars()
                    .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
                    .map(|c| if c == ' ' { '-' } else { c })
                    .collect()
            })
            .collect()
    };
    let pages = pages();
    let mut links = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let dir = page.parent().unwrap();
        for (at, _) in text.match_indices("](") {
            let target = &text[at + 2..];
            let target = &target[..target.find(')').unwrap_or(0)];
            if target.starts_with("http") || target.is_empty() || target.contains(' ') {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let file = if file.is_empty() {
                page.clone()
            } else {
                dir.join(file)
            };
            assert!(
                file.exists(),
                "{}: link to {target}: no such file",
                page.display()
            );
            if !anchor.is_empty() {
                assert!(
                    anchors(&file).iter().any(|a| a == anchor),
                    "{}: link to {target}: no such heading",
                    page.display()
                );
            }
            links += 1;
        }
    }
    assert!(links > 20, "{links} links");
}

/// docs/commands.md's reference is what the binary prints from its
/// command-line definitions: a flag added, renamed or reworded shows up
/// there, or this fails (regenerate the section with
/// `portcullis reference commands`).
#[test]
fn the_commands_reference_is_what_the_binary_prints() {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/commands.md"),
    )
    .expect("docs/commands.md");
    let begin = "<!-- BEGIN generated by `portcullis reference commands` -->\n";
    let from = page.find(begin).expect("the generated section's start") + begin.len();
    let to = page.find("<!-- END generated -->").expect("its end");
    let out = Command::new(binary())
        .args(["reference", "commands"])
        .output()
        .expect("run portcullis");
    assert!(out.status.success());
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(printed.contains("`--admin-token-file FILE`"), "{printed}");
    assert_eq!(&page[from..to], printed, "docs/commands.md is out of date");
}

/// docs/metrics.md has a row for every metric family the code defines
/// (a `"portcullis_…"` name in the proxy's sources), and no row for one
/// it does not.
#[test]
fn the_metrics_reference_lists_every_family_the_code_defines() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut in_code = std::collections::BTreeSet::new();
    let mut dirs = vec![repo.join("proxy/src"), repo.join("proxy/crates")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for quote in ["\"portcullis_", "HELP portcullis_"] {
                    for (at, _) in text.match_indices(quote) {
                        let name: String = text[at + quote.len() - "portcullis_".len()..]
                            .chars()
                            .take_while(|c| {
                                c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_'
                            })
                            .collect();
                        let family = ["_bucket", "_count", "_sum"]
                            .iter()
                            .find_map(|s| name.strip_suffix(s))
                            .unwrap_or(&name)
                            .to_owned();
                        in_code.insert(family);
                    }
                }
            }
        }
    }
    assert!(in_code.len() > 30, "{in_code:?}");
    let page = std::fs::read_to_string(repo.join("docs/metrics.md")).unwrap();
    let in_doc: std::collections::BTreeSet<String> = page
        .lines()
        .filter_map(|l| l.strip_prefix("| `portcullis_"))
        .map(|l| format!("portcullis_{}", &l[..l.find('`').unwrap()]))
        .collect();
    let undocumented: Vec<_> = in_code.difference(&in_doc).collect();
    let gone: Vec<_> = in_doc.difference(&in_code).collect();
    assert!(
        undocumented.is_empty(),
        "not in docs/metrics.md: {undocumented:?}"
    );
    assert!(
        gone.is_empty(),
        "in docs/metrics.md, not in the code: {gone:?}"
    );
}

/// The Markdown pages a user reads: the README, deploy/README.md and
/// every page in docs/.
fn pages() -> Vec<std::path::PathBuf> {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut pages = vec![repo.join("README.md"), repo.join("deploy/README.md")];
    for entry in std::fs::read_dir(repo.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    pages
}

/// Every YAML block marked as a policy (```` ```yaml policy ````) in the
/// README and docs/ is one `portcullis check` takes as it is.
#[test]
fn every_policy_block_in_the_docs_passes_check() {
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let start = "```yaml policy\n";
        for (at, _) in text.match_indices(start) {
            let block = &text[at + start.len()..];
            let block = &block[..block.find("```").expect("the block's end")];
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("policy.yaml"), block).unwrap();
            let (ok, _, stderr) = check(dir.path());
            let line = text[..at].lines().count() + 1;
            assert!(
                ok,
                "{}:{line}: the policy block fails check:\n{stderr}",
                page.display()
            );
            checked += 1;
        }
    }
    assert!(checked >= 7, "{checked} policy blocks");
}

/// The fields of each standard plugin's table in docs/plugins.md are the
/// fields of that plugin's `Config` (its serde struct, read from its
/// source): a field added, renamed or removed fails here.
#[test]
fn the_standard_plugins_tables_list_their_config_fields() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(repo.join("docs/plugins.md")).unwrap();
    let mut plugins = 0;
    for section in page.split("\n### `builtin:").skip(1) {
        let name = &section[..section.find('`').unwrap()];
        let section = &section[..section.find("\n## ").unwrap_or(section.len())];
        let documented: std::collections::BTreeSet<&str> = section
            .lines()
            .filter(|l| l.starts_with("| `") && !l.starts_with("| `field"))
            .map(|l| l[3..].split('`').next().unwrap())
            .collect();
        let source = std::fs::read_to_string(repo.join(format!("plugins/{name}/src/lib.rs")))
            .unwrap_or_else(|_| panic!("no plugins/{name}"));
        let body = &source[source.find("pub struct Config {").expect("a Config")..];
        let body = &body[..body.find("\n}").unwrap()];
        let fields: std::collections::BTreeSet<&str> = body
            .lines()
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.starts_with("//") && !l.starts_with("#[") && l.contains(':'))
            .map(|l| {
                l.split(':')
                    .next()
                    .unwrap()
                    .trim_start_matches("pub ")
                    .trim()
            })
            .collect();
        assert_eq!(documented, fields, "docs/plugins.md's table for {name}");
        plugins += 1;
    }
    assert_eq!(plugins, 8, "a table per standard plugin");
}

/// Every field the policy format takes, as the parser itself lists them
/// (an unknown field's error names the fields of its place), is in
/// docs/policy.md or, for a plugin's use, docs/plugins.md: a field added
/// to the format without a word in the reference fails here.
#[test]
fn every_policy_field_is_in_the_reference() {
    let probe = r#"zz_probe: 1
listeners:
  - name: http
    bind: "127.0.0.1:0"
    zz_probe: 1
    tls: { cert: a, key: b, zz_probe: 1 }
upstreams:
  - name: u
    endpoints: ["http://127.0.0.1:1"]
    zz_probe: 1
    timeouts: { zz_probe: 1 }
    tls: { zz_probe: 1 }
    health_check: { path: /, zz_probe: 1 }
    retry_budget: { zz_probe: 1 }
plugins:
  - { name: p, path: "builtin:header-rules", zz_probe: 1 }
routes:
  - name: r
    zz_probe: 1
    match: { path: /, zz_probe: 1 }
    respond: { status: 200, zz_probe: 1 }
    redirect: { to: /x, zz_probe: 1 }
    rate_limit: { rate: 1/s, zz_probe: 1 }
    auth_request: { upstream: u, path: /, zz_probe: 1, cache: { ttl: 1s, zz_probe: 1 } }
    mirror: { upstream: u, zz_probe: 1 }
    compress: { zz_probe: 1 }
    error_cors: { allow_origins: ["*"], zz_probe: 1 }
    request_headers: { add: {}, zz_probe: 1 }
    plugins: [{ use: p, zz_probe: 1 }, { use: p, rollout: { to: p, zz_probe: 1 } }]
tracing: { upstream: u, zz_probe: 1 }
"#;
    let dir = crate::support::policy_dir(probe, &[]);
    let (ok, _, stderr) = check(dir.path());
    assert!(!ok);
    let lists: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("unknown field `zz_probe`"))
        .filter_map(|l| l.split("the fields here are ").nth(1))
        .collect();
    // 23: `auth_request`'s `cache` is in flow style inside another, whose
    // sibling errors `check` now reports too; a use's `rollout`.
    assert_eq!(lists.len(), 23, "a probe in every section:\n{stderr}");
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let docs = std::fs::read_to_string(repo.join("docs/policy.md")).unwrap()
        + &std::fs::read_to_string(repo.join("docs/plugins.md")).unwrap();
    let mut missing = std::collections::BTreeSet::new();
    for field in lists.iter().flat_map(|l| l.split(", ")) {
        let field = field.trim().trim_matches('`');
        let named = docs.contains(&format!("`{field}`"))
            || docs.contains(&format!(" {field}:"))
            || docs.contains(&format!("\n{field}:"))
            || docs.contains(&format!("{{{field}:"));
        if !named {
            missing.insert(field.to_owned());
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/policy.md or docs/plugins.md: {missing:?}"
    );
}
