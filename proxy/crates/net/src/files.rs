//! Reading a file that a user or a policy names: a regular file of
//! bounded size, opened without blocking. A policy naming `/dev/zero`
//! would otherwise be read until memory runs out, and one naming a FIFO
//! would hang the read (and every reload queued behind it) until a writer
//! came. Nothing under `/proc`, `/sys` or `/dev` is read at all: their
//! "regular files" are the kernel's (`/proc/self/pagemap` says it is
//! empty, then reads without end).

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The largest policy file read (a policy set is kilobytes).
pub const POLICY_LIMIT: u64 = 4 << 20;
/// The largest plugin module read (a Python or JavaScript component,
/// interpreter included, is 20-40 MB).
pub const PLUGIN_LIMIT: u64 = 256 << 20;
/// The largest secret, certificate, CA bundle, key or tokens file read.
pub const SMALL_LIMIT: u64 = 16 << 20;

/// Reads `path` whole: a regular file (or a symlink to one) of at most
/// `limit` bytes. The error says which rule the file broke, without the
/// path (callers name it with what it is for).
pub fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    refuse_kernel_files(path)?;
    // O_NONBLOCK: opening a FIFO for reading would wait for a writer; the
    // flag changes nothing for a regular file's reads.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    // What was opened, wherever its path led (a link, a bind mount).
    refuse_kernel_filesystem(&file)?;
    // The type of what was opened, not of what the path named a moment
    // before: the file may have been swapped in between.
    let meta = file.metadata()?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() {
            "a character device"
        } else if kind.is_block_device() {
            "a block device"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{what}, not a regular file: only regular files are read"),
        ));
    }
    if meta.len() > limit {
        return Err(too_large(meta.len(), limit));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // One byte past the limit tells a file that grew since the stat.
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64, limit));
    }
    Ok(bytes)
}

/// The trees of the kernel's own files.
const KERNEL_TREES: [&str; 3] = ["/proc", "/sys", "/dev"];

/// Refuses a path in [`KERNEL_TREES`], as written or once its links are
/// followed, before anything is opened.
fn refuse_kernel_files(path: &Path) -> std::io::Result<()> {
    let resolved = std::fs::canonicalize(path);
    let paths = std::iter::once(path).chain(resolved.as_deref().ok());
    for p in paths {
        if let Some(tree) = KERNEL_TREES.iter().find(|t| p.starts_with(t)) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("under {tree}, the kernel's files: not read"),
            ));
        }
    }
    Ok(())
}

/// Refuses an open file on procfs or sysfs, wherever they are mounted.
fn refuse_kernel_filesystem(file: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    const PROC_SUPER_MAGIC: libc::__fsword_t = 0x9fa0;
    const SYSFS_MAGIC: libc::__fsword_t = 0x6265_6572;
    let mut stat = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: the descriptor is open (borrowed from `file`) and `stat` is
    // room for one `statfs`, which the call fills when it returns 0.
    if unsafe { libc::fstatfs(file.as_raw_fd(), stat.as_mut_ptr()) } != 0 {
        return Ok(());
    }
    // SAFETY: filled, as the call returned 0.
    let kind = unsafe { stat.assume_init() }.f_type;
    if kind == PROC_SUPER_MAGIC || kind == SYSFS_MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "on the kernel's procfs or sysfs: not read",
        ));
    }
    Ok(())
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_bounded_text(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_bounded(path, limit)?).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "not UTF-8 text (an invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

fn too_large(len: u64, limit: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "{} or more, over the limit of {} for this kind of file",
            size(len),
            size(limit)
        ),
    )
}

fn size(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_regular_file_and_refuses_devices_fifos_and_large_files() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("ok");
        std::fs::write(&ok, "hello").unwrap();
        assert_eq!(read_bounded(&ok, 5).unwrap(), b"hello");
        let err = read_bounded(&ok, 4).unwrap_err().to_string();
        assert!(err.contains("over the limit of 4 bytes"), "{err}");

        for kernel in [
            "/dev/zero",
            "/proc/self/pagemap",
            "/sys/kernel/mm/transparent_hugepage/enabled",
        ] {
            let err = read_bounded(Path::new(kernel), 1 << 20)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("the kernel's files: not read"),
                "{kernel}: {err}"
            );
        }
        // A link into them is no way round.
        let link = dir.path().join("pagemap");
        std::os::unix::fs::symlink("/proc/self/pagemap", &link).unwrap();
        let err = read_bounded(&link, 1 << 20).unwrap_err().to_string();
        assert!(err.contains("under /proc"), "{err}");

        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = read_bounded(&fifo, 1 << 20).unwrap_err().to_string();
        assert!(err.starts_with("a FIFO"), "{err}");

        let err = read_bounded(dir.path(), 1 << 20).unwrap_err().to_string();
        assert!(err.starts_with("a directory"), "{err}");

        std::fs::write(&ok, [0xff, 0xfe]).unwrap();
        let err = read_bounded_text(&ok, 10).unwrap_err().to_string();
        assert!(err.contains("not UTF-8"), "{err}");
    }
}
