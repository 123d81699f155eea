//! A ConfigMap volume as the kubelet writes it (its `AtomicWriter`): the
//! files live in a timestamped directory, `..data` is a symlink to it, and
//! each key is a symlink `key -> ..data/key`. An update writes a new
//! timestamped directory, points a new `..data_tmp` link at it, renames
//! that over `..data` (the atomic step), adds or removes key links, and
//! deletes the old directory.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// A mounted ConfigMap in a temporary directory.
pub struct ConfigMap {
    dir: tempfile::TempDir,
    current: Option<PathBuf>,
    keys: Vec<String>,
    serial: u32,
}

impl ConfigMap {
    /// A volume holding `files` (key, content).
    pub fn new(files: &[(&str, &[u8])]) -> ConfigMap {
        let mut map = ConfigMap {
            dir: tempfile::tempdir().expect("tempdir"),
            current: None,
            keys: Vec::new(),
            serial: 0,
        };
        map.update(files);
        map
    }

    /// The mount point (what `--policies` is given).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Replaces the whole content with `files`, as the kubelet does when
    /// the ConfigMap changes.
    pub fn update(&mut self, files: &[(&str, &[u8])]) {
        let root = self.dir.path();
        self.serial += 1;
        // The kubelet's names look like `..2026_11_22_01_49_27.123456789`.
        let stamp = format!("..2026_11_22_00_00_00.{:09}", self.serial);
        let target = root.join(&stamp);
        std::fs::create_dir(&target).expect("timestamped dir");
        for (key, content) in files {
            std::fs::write(target.join(key), content).expect("write key");
        }
        let tmp = root.join("..data_tmp");
        symlink(&stamp, &tmp).expect("..data_tmp link");
        std::fs::rename(&tmp, root.join("..data")).expect("rename over ..data");
        let keys: Vec<String> = files.iter().map(|(k, _)| k.to_string()).collect();
        for key in &keys {
            if !self.keys.contains(key) {
                symlink(format!("..data/{key}"), root.join(key)).expect("key link");
            }
        }
        for old in &self.keys {
            if !keys.contains(old) {
                std::fs::remove_file(root.join(old)).expect("remove key link");
            }
        }
        if let Some(old) = self.current.replace(target) {
            std::fs::remove_dir_all(old).expect("remove old dir");
        }
        self.keys = keys;
    }
}
