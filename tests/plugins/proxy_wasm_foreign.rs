//! A filter's foreign function calls (`proxy_call_foreign_function`), in
//! Portcullis as in Envoy 1.40: Envoy's `compress` and `uncompress`
//! (zlib), and `NotFound` for a name the host lacks.

use super::*;

/// What the filter told the upstream of a request calling `name` on `arg`.
async fn called(addr: std::net::SocketAddr, name: &str, arg: &str) -> Vec<(String, String)> {
    let req = Request::get(format!("http://{addr}/f"))
        .header("x-foreign", name)
        .header("x-foreign-arg", arg);
    let a = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    assert_eq!(a.status, 200, "{addr}: {:?}", a.body);
    let seen = a.json()["headers"].clone();
    [
        "x-foreign-status",
        "x-foreign-roundtrip",
        "x-foreign-compressed",
    ]
    .iter()
    .filter_map(|h| Some((h.to_string(), seen[*h].as_str()?.to_owned())))
    .collect()
}

#[tokio::test]
pub(super) async fn a_filters_foreign_calls_answer_as_in_envoy() {
    let app = upstream::echo("app").await;
    let filter = plugin_file("proxy-wasm-headers");
    let envoy = crate::support::envoy::Envoy::with_filter(&filter, "t", app.addr).await;
    let dir = super::proxy_wasm::headers_filter_everywhere(&app);
    let proxy = Proxy::start_dir(dir, &[]).await;
    let text = "a header value, a header value, a header value, a header value";
    let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    // Compressed and back: the same text in both (zlib's bytes and
    // miniz_oxide's may differ; their format is the same).
    let ours = called(proxy.addr, "compress", text).await;
    let theirs = called(envoy.addr, "compress", text).await;
    for seen in [&ours, &theirs] {
        assert_eq!(seen[0], pair("x-foreign-roundtrip", text), "{seen:?}");
        let length: usize = seen[1].1.parse().unwrap();
        assert!(length < text.len(), "{seen:?}");
    }
    // What is not zlib: SerializationFailure; a name the host lacks:
    // NotFound (Higress's wasm-go asks for `get_log_level`).
    for (name, arg, status) in [
        ("uncompress", "not zlib", "SerializationFailure"),
        ("get_log_level", "", "NotFound"),
    ] {
        let expected = vec![pair("x-foreign-status", status)];
        assert_eq!(called(proxy.addr, name, arg).await, expected, "{name}");
        assert_eq!(
            called(envoy.addr, name, arg).await,
            expected,
            "{name} in Envoy"
        );
    }
}
