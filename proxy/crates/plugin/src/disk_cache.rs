//! Compiled plugins kept on disk (`--plugin-cache DIR`), so a restarted
//! proxy loads a component's machine code instead of compiling it again:
//! an interpreter-based plugin (CPython's or SpiderMonkey's 12-18 MB
//! component) takes seconds to compile and milliseconds to load.
//!
//! Loading compiled code runs it, so a file is only loaded when this
//! process's user made it (a file another user put there, or one others
//! may write, is refused) and when its digest matches (a half-written or
//! damaged file is refused). Either way the plugin is compiled as if the
//! cache were not there and the file replaced: the cache can make start-up
//! faster, never make it fail.
//!
//! A file's name is the module's sha256 and a digest of the engine's
//! compatibility (wasmtime version, compiler flags, memory settings), so a
//! new binary never loads another's code; files no policy uses any longer
//! are removed after each reload ([`DiskCache::retain`]).

use std::fs::OpenOptions;
use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Files this cache writes end with this (and only those are removed).
const SUFFIX: &str = ".cwasm";
/// The length of a digest in hex.
const HEX: usize = 64;

/// A directory of compiled components for one engine.
pub struct DiskCache {
    dir: PathBuf,
    /// Hex digest of the engine's compatibility hash.
    engine: String,
}

/// Feeds `Hash` output into sha256: a digest that is the same in every
/// process of one binary, which `DefaultHasher` does not promise.
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    fn finish(&self) -> u64 {
        unreachable!("read through finalize")
    }
}

impl DiskCache {
    /// The cache in `dir` (made, user-only, if missing) for `engine`.
    pub fn open(dir: &Path, engine: &Engine) -> Result<DiskCache, String> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot make plugin cache {}: {e}", dir.display()))?;
        if !std::fs::metadata(dir).is_ok_and(|m| m.is_dir()) {
            return Err(format!("plugin cache {} is not a directory", dir.display()));
        }
        let mut hasher = Sha256Hasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut hasher);
        Ok(DiskCache {
            dir: dir.to_owned(),
            engine: hex::encode(hasher.0.finalize()),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path_of(&self, module: &[u8; 32]) -> PathBuf {
        self.dir
            .join(format!("{}-{}{SUFFIX}", hex::encode(module), self.engine))
    }

    /// The compiled component of the module with digest `module`, when a
    /// file for it and this engine is present and sound. `Err` says why a
    /// file that is there was not used (`Ok(None)`: no file).
    pub fn load(&self, engine: &Engine, module: &[u8; 32]) -> Result<Option<Component>, String> {
        let Some((code, shown)) = self.load_code(module)? else {
            return Ok(None);
        };
        // SAFETY: the bytes are what `store` wrote from
        // `Component::serialize` for this engine and this module: the
        // file is this user's, no one else may write it, its digest
        // matches and it names the module. wasmtime checks the header and
        // the engine settings again.
        unsafe { Component::deserialize(engine, &code) }
            .map(Some)
            .map_err(|e| format!("cannot load {shown}: {e:#}"))
    }

    /// [`Self::load`] for a core module (a proxy-wasm filter).
    pub fn load_module(
        &self,
        engine: &Engine,
        module: &[u8; 32],
    ) -> Result<Option<wasmtime::Module>, String> {
        let Some((code, shown)) = self.load_code(module)? else {
            return Ok(None);
        };
        // SAFETY: as in `load`, from `Module::serialize`; a component's
        // file under a core module's digest cannot be (the digest names
        // the bytes compiled), and wasmtime refuses the other kind anyway.
        unsafe { wasmtime::Module::deserialize(engine, &code) }
            .map(Some)
            .map_err(|e| format!("cannot load {shown}: {e:#}"))
    }

    /// The compiled code in the file for `module`, checked (see
    /// [`Self::load`]), and the file's path as shown in errors.
    fn load_code(&self, module: &[u8; 32]) -> Result<Option<(Vec<u8>, String)>, String> {
        let path = self.path_of(module);
        let mut file = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot open {}: {e}", path.display())),
        };
        let shown = path.display().to_string();
        let meta = file
            .metadata()
            .map_err(|e| format!("cannot read {shown}: {e}"))?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !meta.is_file() {
            return Err(format!("{shown} is not a regular file"));
        }
        if meta.uid() != me {
            return Err(format!(
                "{shown} belongs to user {}, not to this process's user {me}",
                meta.uid()
            ));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(format!("{shown} is writable by other users"));
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        file.read_to_end(&mut bytes)
            .map_err(|e| format!("cannot read {shown}: {e}"))?;
        // The code, the module's digest, and a digest of both: a file
        // renamed to another module's name (in a directory others may
        // write, such as an emptyDir) names its own module.
        let Some(split) = bytes.len().checked_sub(64) else {
            return Err(format!("{shown} is truncated"));
        };
        let (signed, digest) = bytes.split_at(split + 32);
        if Sha256::digest(signed).as_slice() != digest {
            return Err(format!("{shown} is damaged (its digest does not match)"));
        }
        let named = &signed[split..];
        if named != module {
            return Err(format!(
                "{shown} holds the code of another module ({})",
                hex::encode(named)
            ));
        }
        bytes.truncate(split);
        Ok(Some((bytes, shown)))
    }

    /// Writes `component` as the compiled code of module `module`: to a
    /// new file, renamed into place, so a reader never sees half of it.
    pub fn store(&self, module: &[u8; 32], component: &Component) -> Result<PathBuf, String> {
        let code = component
            .serialize()
            .map_err(|e| format!("cannot serialize the compiled plugin: {e:#}"))?;
        self.store_code(module, &code)
    }

    /// [`Self::store`] for a core module (a proxy-wasm filter).
    pub fn store_module(
        &self,
        module: &[u8; 32],
        compiled: &wasmtime::Module,
    ) -> Result<PathBuf, String> {
        let code = compiled
            .serialize()
            .map_err(|e| format!("cannot serialize the compiled plugin: {e:#}"))?;
        self.store_code(module, &code)
    }

    fn store_code(&self, module: &[u8; 32], code: &[u8]) -> Result<PathBuf, String> {
        let path = self.path_of(module);
        let mut digest = Sha256::new();
        digest.update(code);
        digest.update(module);
        let digest = digest.finalize();
        let temp = self.dir.join(format!(
            ".{}.{}.tmp",
            hex::encode(&module[..8]),
            std::process::id()
        ));
        let written = (|| {
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temp)?;
            file.write_all(code)?;
            file.write_all(module)?;
            file.write_all(&digest)?;
            file.sync_data()?;
            std::fs::rename(&temp, &path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            return Err(format!("cannot write {}: {e}", path.display()));
        }
        Ok(path)
    }

    /// Removes this cache's files for modules not in `keep` (and files of
    /// other engines: an older binary's), leaving anything else in the
    /// directory alone. Returns how many it removed.
    pub fn retain(&self, keep: &[[u8; 32]]) -> usize {
        let wanted: Vec<String> = keep
            .iter()
            .map(|m| format!("{}-{}{SUFFIX}", hex::encode(m), self.engine))
            .collect();
        sweep(&self.dir, &wanted)
    }
}

/// Removes every compiled plugin in the cache `dir` (when the policies
/// use none, and so no engine was made to tell this binary's files from
/// others'), and abandoned temporary files; anything else stays.
pub fn clear(dir: &Path) -> usize {
    sweep(dir, &[])
}

/// Removes the cache files in `dir` not named in `wanted`, and temporary
/// files a crash left. Returns how many it removed.
fn sweep(dir: &Path, wanted: &[String]) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let unused = is_cache_file(name) && !wanted.iter().any(|w| w == name);
        // A write cut short (the process killed mid-file) leaves its
        // temporary file; one this old is no write in progress.
        let abandoned = is_temp_file(name)
            && entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > ABANDONED));
        if (unused || abandoned) && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// How old a temporary file must be to count as a write that was cut
/// short (writing one takes well under a second).
const ABANDONED: std::time::Duration = std::time::Duration::from_secs(600);

/// Whether `name` has the shape of [`DiskCache::store`]'s temporary files:
/// `.<16 hex>.<pid>.tmp`.
fn is_temp_file(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) else {
        return false;
    };
    let Some((module, pid)) = rest.split_once('.') else {
        return false;
    };
    module.len() == 16
        && module.bytes().all(|b| b.is_ascii_hexdigit())
        && !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `name` has the shape of a file [`DiskCache::store`] writes:
/// `<64 hex>-<64 hex>.cwasm`.
fn is_cache_file(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(SUFFIX) else {
        return false;
    };
    let bytes = stem.as_bytes();
    bytes.len() == 2 * HEX + 1
        && bytes[HEX] == b'-'
        && bytes
            .iter()
            .enumerate()
            .all(|(i, b)| i == HEX || b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        let mut config = wasmtime::Config::new();
        config.wasm_component_model(true);
        Engine::new(&config).expect("engine")
    }

    /// The smallest component there is: `(component)`.
    const EMPTY: &[u8] = b"\0asm\x0d\0\x01\0";

    /// A cache in a new temporary directory, its engine, and the empty
    /// component compiled.
    fn fresh() -> (tempfile::TempDir, Engine, DiskCache, Component) {
        let dir = tempfile::tempdir().expect("tempdir");
        let engine = engine();
        let cache = DiskCache::open(dir.path(), &engine).expect("open");
        let component = Component::new(&engine, EMPTY).expect("compile");
        (dir, engine, cache, component)
    }

    #[test]
    fn a_core_module_is_kept_and_loaded_as_one() {
        let (dir, engine, cache, _) = fresh();
        let core = wasmtime::Module::new(&engine, b"\0asm\x01\0\0\0").expect("compile");
        let id = [9u8; 32];
        cache.store_module(&id, &core).expect("store");
        assert!(cache.load_module(&engine, &id).expect("load").is_some());
        // Its file is not a component's.
        assert!(cache.load(&engine, &id).is_err());
        assert!(matches!(cache.load_module(&engine, &[8u8; 32]), Ok(None)));
        drop(dir);
    }

    #[test]
    fn stores_then_loads_and_refuses_damage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let engine = engine();
        let cache = DiskCache::open(&dir.path().join("cache"), &engine).expect("open");
        let module = [7u8; 32];
        assert!(cache.load(&engine, &module).expect("no file").is_none());
        let component = Component::new(&engine, EMPTY).expect("compile");
        let path = cache.store(&module, &component).expect("store");
        assert!(cache.load(&engine, &module).expect("load").is_some());

        // One byte changed anywhere: refused, naming the file.
        let mut bytes = std::fs::read(&path).expect("read");
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(&path, &bytes).expect("write");
        let err = cache.load(&engine, &module).expect_err("damaged");
        assert!(
            err.contains("damaged") && err.contains(&path.display().to_string()),
            "{err}"
        );

        // Truncated.
        std::fs::write(&path, b"short").expect("write");
        assert!(
            cache
                .load(&engine, &module)
                .expect_err("short")
                .contains("truncated")
        );
    }

    #[test]
    fn a_write_that_fails_says_where_and_leaves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let engine = engine();
        let path = dir.path().join("cache");
        let cache = DiskCache::open(&path, &engine).expect("open");
        let component = Component::new(&engine, EMPTY).expect("compile");
        // The directory went away (an emptyDir wiped, a volume unmounted).
        std::fs::remove_dir(&path).expect("remove");
        let err = cache.store(&[9; 32], &component).expect_err("no directory");
        assert!(
            err.starts_with(&format!("cannot write {}", path.display())),
            "{err}"
        );
        assert!(cache.load(&engine, &[9; 32]).expect("no file").is_none());
        // A file in the way of the final name: the temporary one goes.
        std::fs::create_dir(&path).expect("again");
        std::fs::create_dir(cache.path_of(&[9; 32])).expect("in the way");
        cache
            .store(&[9; 32], &component)
            .expect_err("a directory there");
        let left: Vec<_> = std::fs::read_dir(&path).expect("list").flatten().collect();
        assert_eq!(left.len(), 1, "{left:?}");
    }

    #[test]
    fn a_file_renamed_to_another_modules_name_is_refused() {
        let (_dir, engine, cache, component) = fresh();
        let a = cache.store(&[0xa; 32], &component).expect("store");
        std::fs::rename(&a, cache.path_of(&[0xb; 32])).expect("rename");
        let err = cache
            .load(&engine, &[0xb; 32])
            .expect_err("another module's");
        assert!(
            err.contains("holds the code of another module (0a0a"),
            "{err}"
        );
    }

    #[test]
    fn refuses_files_others_may_write() {
        use std::os::unix::fs::PermissionsExt;
        let (_dir, engine, cache, component) = fresh();
        let module = [1u8; 32];
        let path = cache.store(&module, &component).expect("store");
        assert_eq!(
            std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777,
            0o600
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        let err = cache.load(&engine, &module).expect_err("group-writable");
        assert!(err.contains("writable by other users"), "{err}");
    }

    #[test]
    fn retain_removes_only_its_own_unused_files() {
        let (dir, _engine, cache, component) = fresh();
        let kept = cache.store(&[1; 32], &component).expect("store");
        let dropped = cache.store(&[2; 32], &component).expect("store");
        // An older binary's file for the kept module, and a stranger.
        let older = dir.path().join(format!(
            "{}-{}{SUFFIX}",
            hex::encode([1u8; 32]),
            "0".repeat(64)
        ));
        std::fs::write(&older, b"old").expect("write");
        let stranger = dir.path().join("notes.txt");
        std::fs::write(&stranger, b"mine").expect("write");

        // Temporary files: one a crashed write left an hour ago, one being
        // written now.
        let abandoned = dir.path().join(".0101010101010101.4242.tmp");
        let fresh = dir.path().join(".0202020202020202.4243.tmp");
        for t in [&abandoned, &fresh] {
            std::fs::write(t, b"half").expect("write");
        }
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&abandoned)
            .and_then(|f| f.set_modified(hour_ago))
            .expect("age it");

        assert_eq!(cache.retain(&[[1; 32]]), 3);
        assert!(kept.exists() && fresh.exists());
        assert!(!dropped.exists() && !older.exists() && !abandoned.exists());
        assert!(stranger.exists());
    }

    #[test]
    fn other_engines_do_not_share_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = engine();
        let mut config = wasmtime::Config::new();
        config.wasm_component_model(true).epoch_interruption(true);
        let other = Engine::new(&config).expect("engine");
        let a = DiskCache::open(dir.path(), &plain).expect("open");
        let b = DiskCache::open(dir.path(), &other).expect("open");
        let component = Component::new(&plain, EMPTY).expect("compile");
        a.store(&[3; 32], &component).expect("store");
        assert!(b.load(&other, &[3; 32]).expect("no file").is_none());
    }
}
