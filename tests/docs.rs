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
    let block = &block[block.find("```yaml\n").expect("a yaml block") + 8..];
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
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
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
    let mut pages = vec![repo.join("README.md"), repo.join("deploy/README.md")];
    for entry in std::fs::read_dir(repo.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
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
