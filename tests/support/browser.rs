//! Headless Chromium (Debian's `chromium`, which tests/run.sh installs
//! when missing), for what a person sees in a page.

use std::path::PathBuf;
use std::time::Duration;

/// The Chromium binary.
fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser"] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let path = dir.join(name);
            if path.is_file() {
                return path;
            }
        }
    }
    panic!("no chromium on PATH: tests/run.sh installs Debian's `chromium`");
}

/// Runs Chromium headless on `url` with `extra` arguments; its stdout.
async fn run(url: &str, extra: &[String]) -> String {
    let profile = tempfile::tempdir().expect("tempdir");
    let out = tokio::process::Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            // The page's scripts run this long in virtual time (its first
            // fetches and rendering) before the DOM or picture is taken.
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), out)
        .await
        .expect("chromium finished within 90 s")
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The page at `url` as Chromium has rendered it (its DOM after its
/// scripts ran), as HTML text.
pub async fn rendered(url: &str) -> String {
    run(url, &["--dump-dom".to_owned()]).await
}

/// A PNG screenshot of the page at `url`, `width` x `height`, to `path`.
pub async fn screenshot(url: &str, path: &std::path::Path, (width, height): (u32, u32)) {
    run(
        url,
        &[
            format!("--screenshot={}", path.display()),
            format!("--window-size={width},{height}"),
            "--hide-scrollbars".to_owned(),
        ],
    )
    .await;
}
