use super::*;

fn facts(uri: &str) -> RequestFacts {
    RequestFacts {
        method: http::Method::PATCH,
        uri: uri.parse().unwrap(),
        normalized: None,
        rewritten: None,
        client: "::ffff:10.1.2.3".parse().unwrap(),
        tls: true,
        sni: Some("public.example".into()),
        client_cert: None,
        route: 1,
        params: vec![("name".into(), "hooks".into())],
        bodiless: true,
    }
}

#[test]
fn the_head_is_built_from_the_facts_as_plugins_see_them() {
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::HOST, "public.example".parse().unwrap());
    let f = facts("/a/./b?x=1");
    let head = f.head(&headers);
    assert_eq!(head.method, "PATCH");
    assert_eq!(head.scheme, "https");
    assert!(head.tls);
    assert_eq!(head.sni.as_deref(), Some("public.example"));
    // Origin form: the host comes from the Host header.
    assert_eq!(head.authority, "public.example");
    assert_eq!(
        (head.path.as_str(), head.query.as_deref()),
        ("/a/./b", Some("x=1"))
    );
    // An IPv4 client on a dual-stack socket reads as IPv4.
    assert_eq!(head.client_addr, "10.1.2.3");

    // The normalized path replaces the target's; a plugin's rewrite
    // replaces both, query included.
    let mut f = facts("http://h2.example/a/./b?x=1");
    f.normalized = Some("/a/b".into());
    let head = f.head(&headers);
    assert_eq!(head.authority, "h2.example");
    assert_eq!(
        (head.path.as_str(), head.query.as_deref()),
        ("/a/b", Some("x=1"))
    );
    f.rewritten = Some("/new?y=2".parse().unwrap());
    let head = f.head(&headers);
    assert_eq!(
        (head.path.as_str(), head.query.as_deref()),
        ("/new", Some("y=2"))
    );
}

#[test]
fn the_route_is_named_from_the_config_index() {
    let names: Vec<Arc<str>> = vec!["first".into(), "webhooks".into()];
    let info = facts("/").route_info(None, &names);
    assert_eq!(info.name, "webhooks");
    assert_eq!(info.params, vec![("name".to_owned(), "hooks".to_owned())]);
    let mut f = facts("/");
    f.route = 7;
    assert_eq!(f.route_info(None, &names).name, "");
    let own: Arc<str> = "mine".into();
    assert_eq!(f.route_info(Some(&own), &names).name, "mine");
}
