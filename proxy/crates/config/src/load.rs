//! Reading policy sources: a directory of `*.yaml` files (a mounted
//! ConfigMap) or the default set compiled into the binary.

use std::path::Path;
use std::sync::Arc;

use super::raw::PolicyFile;
use super::{Config, ConfigError, ConfigErrors, Pos, build};

/// One policy file's name and text.
#[derive(Debug, Clone)]
pub struct Source {
    /// Name shown in errors: the path it was read from.
    pub name: String,
    /// The YAML text.
    pub text: String,
}

/// The default policy set that ships in `policies/`, compiled in so the
/// binary runs anywhere without a policy directory.
pub fn default_sources() -> Vec<Source> {
    vec![Source {
        name: "policies/routing.yaml".into(),
        text: include_str!("../../../../policies/routing.yaml").into(),
    }]
}

/// The policies of `dir`, or the built-in default policies without one,
/// with `${ENV}` from the process environment.
pub fn load_policies(dir: Option<&Path>) -> Result<Config, ConfigErrors> {
    match dir {
        Some(dir) => load_dir(dir),
        None => load_sources(&default_sources(), &|n| std::env::var(n).ok()),
    }
}

/// Reads every `*.yaml`/`*.yml` file of `dir` in name order and builds the
/// configuration. Dot-files are skipped: a ConfigMap mount keeps its real
/// files under `..data` and timestamped `..2026_…` directories, and shows
/// each key as a symlink at the top level.
pub fn load_dir(dir: &Path) -> Result<Config, ConfigErrors> {
    load_dir_with_env(dir, &|name| std::env::var(name).ok())
}

/// [`load_dir`] with `${ENV}` references looked up with `env`.
pub fn load_dir_with_env(
    dir: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigErrors> {
    load_sources(&read_dir(dir)?, env)
}

/// The policy files of `dir` (see [`load_dir`]), read.
pub fn read_dir(dir: &Path) -> Result<Vec<Source>, ConfigErrors> {
    let dir_error = |message: String| {
        ConfigErrors(vec![ConfigError {
            pos: Pos {
                file: dir.display().to_string().into(),
                line: 0,
                column: 0,
            },
            message,
        }])
    };
    let entries = std::fs::read_dir(dir)
        .map_err(|e| dir_error(format!("cannot read policy directory: {e}")))?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| dir_error(format!("cannot read policy directory: {e}")))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        // `metadata` follows symlinks, which is what a ConfigMap key is.
        // Anything but a directory: a FIFO or a device named `*.yaml` is
        // refused by name when read, not skipped without a word.
        if !name.starts_with('.') && is_yaml && entry.path().metadata().is_ok_and(|m| !m.is_dir()) {
            paths.push(entry.path());
        }
    }
    paths.sort();
    if paths.is_empty() {
        return Err(dir_error("no *.yaml policy files in this directory".into()));
    }
    let mut sources = Vec::with_capacity(paths.len());
    let mut errors = Vec::new();
    for path in paths {
        match portcullis_net::files::read_bounded_text(&path, portcullis_net::files::POLICY_LIMIT) {
            Ok(text) => sources.push(Source {
                name: path.display().to_string(),
                text,
            }),
            Err(e) => errors.push(ConfigError {
                pos: Pos {
                    file: path.display().to_string().into(),
                    line: 0,
                    column: 0,
                },
                message: format!("cannot read policy file: {e}"),
            }),
        }
    }
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    Ok(sources)
}

/// Parses and validates a set of sources, looking up `${ENV}` references
/// with `env`.
pub fn load_sources(
    sources: &[Source],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigErrors> {
    let (mut config, errors) = load_files(sources, env, false);
    if errors.is_empty() {
        config.fingerprint = fingerprint(sources, &config);
        Ok(config)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// [`load_sources`] for `check`: also what of the config is valid when
/// some of it is not (to go on to the plugins), with every error in
/// reading order, as a compiler reports them; and every plugin the
/// policies define is read, used or not (serving reads only those used,
/// so a definition waiting for its file does not stop a reload), so a
/// mistake in one shows before a route uses it.
pub fn load_partial(
    sources: &[Source],
    env: &dyn Fn(&str) -> Option<String>,
) -> (Config, Vec<ConfigError>) {
    load_files(sources, env, true)
}

/// The config of `sources`, what of it is valid and the errors;
/// `every_plugin`: plugins no route uses are read too.
fn load_files(
    sources: &[Source],
    env: &dyn Fn(&str) -> Option<String>,
    every_plugin: bool,
) -> (Config, Vec<ConfigError>) {
    let mut files = Vec::with_capacity(sources.len());
    let mut errors = Vec::new();
    let mut unparsed: Vec<Arc<str>> = Vec::new();
    let mut lost: Vec<String> = Vec::new();
    let mut blanked = Vec::new();
    for source in sources {
        let file: Arc<str> = source.name.as_str().into();
        match parse(&source.text) {
            Ok(policy) => files.push((file, policy)),
            // Every structural mistake in the file, not only the first.
            Err(_) => {
                let parse_only = |text: &str| parse(text).map(|_| ());
                let found = crate::diagnose::structural_errors(&file, &source.text, parse_only);
                errors.extend(found.errors);
                lost.extend(found.lost);
                blanked.push((file.clone(), found.blanked));
                unparsed.push(file.clone());
                // What parses of it once its faulty entries are blanked is
                // checked too (`check` names the mistakes in its values in
                // the same run); the file still fails.
                if let Some(policy) = found.rest.and_then(|text| parse(&text).ok()) {
                    files.push((file, policy));
                }
            }
        }
    }
    let (config, more) = build::build(&files, env, (&unparsed, &lost, every_plugin));
    // Not what a blanked field's absence brings about.
    let consequence = |e: &ConfigError| {
        blanked
            .iter()
            .any(|(f, b): &(Arc<str>, Vec<crate::diagnose::Blanked>)| {
                *f == e.pos.file && b.iter().any(|b| b.explains(e))
            })
    };
    errors.extend(more.into_iter().filter(|e| !consequence(e)));
    sort_errors(&mut errors);
    (config, errors)
}

/// Puts errors in reading order: file, line, column.
pub fn sort_errors(errors: &mut [ConfigError]) {
    errors.sort_by(|a, b| {
        (&*a.pos.file, a.pos.line, a.pos.column).cmp(&(&*b.pos.file, b.pos.line, b.pos.column))
    });
}

/// Hashes what the config was built from; see [`Config::fingerprint`].
fn fingerprint(sources: &[Source], config: &Config) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    // Length-prefixed, so bytes moving from one field to the next change it.
    let mut put = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    for source in sources {
        put(source.name.as_bytes());
        put(source.text.as_bytes());
    }
    for plugin in &config.plugins {
        put(&plugin.sha256);
    }
    for upstream in &config.upstreams {
        for cert in &upstream.tls.ca_certs {
            put(cert.as_ref());
        }
    }
    for tls in config.listeners.iter().filter_map(|l| l.tls.as_ref()) {
        put(&tls.material);
    }
    let uses = config.routes.iter().flat_map(|r| &r.plugins);
    for plugin_use in uses.chain(&config.global_plugins) {
        put(plugin_use.config_json.as_bytes());
    }
    hash.finalize().into()
}

fn parse(text: &str) -> Result<PolicyFile, serde_saphyr::Error> {
    // A file of only comments (a placeholder ConfigMap key) is an empty policy.
    let blank = text.lines().all(|l| {
        let l = l.trim();
        l.is_empty() || l.starts_with('#') || l == "---"
    });
    if blank {
        return Ok(PolicyFile::default());
    }
    serde_saphyr::from_str(text)
}
