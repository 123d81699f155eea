//! The admin token file that turns bad while the proxy runs (gone, short,
//! oversized, a FIFO): the probes and `/metrics` stay open as
//! docs/security.md says (they used to answer 500), and the last good
//! token stays in force until a good one replaces it.

use super::*;

async fn get_with(url: String, token: Option<&str>) -> Answer {
    let mut req = Request::get(url);
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await
}

#[tokio::test]
async fn a_token_file_that_turns_bad_keeps_the_last_good_token_and_the_probes_open() {
    let secrets = tempfile::tempdir().unwrap();
    let file = secrets.path().join("admin-token");
    let first = "first-admin-token-0123456789";
    std::fs::write(&file, format!("{first}\n")).unwrap();
    let proxy = ProxyProcess::start(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes: [{ name: ok, match: { path: /ok }, respond: { status: 200 } }]
"#,
        &["--admin-token-file", &file.display().to_string()],
    )
    .await;
    let status = |token| get_with(proxy.admin_url("/status"), token);
    assert_eq!(status(Some(first)).await.status, 200);
    assert_eq!(status(None).await.status, 401);
    let fifo = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
    let turns: [(&str, &dyn Fn()); 4] = [
        ("gone", &|| std::fs::remove_file(&file).unwrap()),
        ("short", &|| std::fs::write(&file, "short").unwrap()),
        ("oversized", &|| {
            std::fs::write(&file, vec![b'a'; 1 << 20]).unwrap()
        }),
        ("a FIFO", &|| {
            std::fs::remove_file(&file).unwrap();
            // SAFETY: a valid path; mkfifo only creates the file.
            assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        }),
    ];
    for (what, turn_bad) in turns {
        turn_bad();
        for path in ["/healthz", "/readyz", "/metrics"] {
            let answer = get_with(proxy.admin_url(path), None).await;
            assert_eq!(answer.status, 200, "{what}: {path}: {:?}", answer.body);
            // With a token too: nothing on the way reads the file to fail.
            let answer = get_with(proxy.admin_url(path), Some(first)).await;
            assert_eq!(answer.status, 200, "{what}: {path} with the token");
        }
        assert_eq!(status(Some(first)).await.status, 200, "{what}");
        assert_eq!(status(Some("short")).await.status, 401, "{what}");
    }
    // Rotated to a good one: it alone opens /status.
    std::fs::remove_file(&file).unwrap();
    let second = "second-admin-token-0123456789-x";
    std::fs::write(&file, format!("{second}\n")).unwrap();
    assert_eq!(status(Some(second)).await.status, 200);
    assert_eq!(status(Some(first)).await.status, 401);
}
