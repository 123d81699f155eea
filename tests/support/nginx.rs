//! A real nginx (Debian's `nginx-light`; the test command installs it)
//! on a loopback port, as a peer whose HTTP/1.1 parsing is strict where
//! it should be: a request with two `Host` headers is a 400 there.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

/// A running nginx; killed when dropped.
pub struct Nginx {
    _child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Nginx {
    /// Starts one whose `locations` (nginx `location` blocks, written as
    /// they go in a `server`) answer, returning once it accepts
    /// connections.
    pub async fn start(locations: &str) -> Nginx {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let d = dir.path().display();
        let conf = format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log;\nevents {{ worker_connections 256; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
             fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             server {{\n    listen 127.0.0.1:{port};\n    {locations}\n  }}\n}}\n"
        );
        std::fs::write(dir.path().join("nginx.conf"), conf).expect("write nginx.conf");
        let child =
            Command::new(std::env::var("PORTCULLIS_NGINX").unwrap_or_else(|_| "nginx".into()))
                .arg("-p")
                .arg(dir.path())
                .arg("-c")
                .arg(dir.path().join("nginx.conf"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .expect("nginx (Debian's nginx-light package; tests/run.sh installs it)");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "nginx did not listen on {port} within 20 s: {}",
                std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Nginx {
            _child: child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }
}
