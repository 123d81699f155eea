#!/usr/bin/env bash
# The routing core's instructions per request beside nginx-tuned's, in one
# run, counted by valgrind (cachegrind): the figure #66 sets its target in,
# since it repeats where CPU time and requests/s swing 10-30% on shared
# cores. Kernel time is not in it (bench/core.sh has CPU time).
#
#   bench/versus-nginx.sh                        # 3000 requests, one run each
#   REQUESTS=5000 REPEAT=3 bench/versus-nginx.sh
#   PORTCULLIS_BIN=/path/to/portcullis bench/versus-nginx.sh
#
# Each server runs with one worker (nginx with `master_process off`) and
# forwards to the same one-worker nginx upstream answering a fixed 200:
#   nginx-tuned          upstream keep-alive, the X-Forwarded-* headers
#                        Portcullis sends (bench/core.sh's nginx-tuned);
#   portcullis-default   the default policies (policies/), `/app-proxy/x`:
#                        the app-proxy route as deployed (CORS on errors,
#                        compression, websocket, trusted forwarded headers);
#   portcullis-plain     one listener, one upstream, one route.
# Both proxies keep their own defaults for a client connection (1,000
# requests, then closed); the client opens a new one as any would.
# With access logs off, then on: nginx's combined line to a file,
# unbuffered (as ingress-nginx writes it); Portcullis's default line to a
# file (`--access-log`), buffered as it ships.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${REQUESTS:-3000}
REPEAT=${REPEAT:-1}
if ! command -v valgrind >/dev/null; then
  apt-get update -qq && apt-get install -y -qq valgrind >/dev/null
fi
# shellcheck source=bench/common.sh
. bench/common.sh
read -r UP_PORT NG_PORT PD_PORT PP_PORT < <(free_ports 4 | xargs)
start_upstream "$UP_PORT"
wait_port "$UP_PORT"

mkdir -p "$WORK/nginx" "$WORK/plain"
nginx_conf() { # $1: access_log's argument
  cat <<CONF
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log;
events { worker_connections 4096; }
http {
  access_log $1;
  upstream app { server 127.0.0.1:$UP_PORT; keepalive 256; }
  server {
    listen 127.0.0.1:$NG_PORT;
    location / {
      proxy_pass http://app;
      proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto \$scheme;
      proxy_set_header X-Forwarded-Host \$http_host;
    }
  }
}
CONF
}
nginx_conf off > "$WORK/nginx/off.conf"
nginx_conf "$WORK/nginx/access.log" > "$WORK/nginx/on.conf"
cat > "$WORK/plain/plain.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$PP_PORT" }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP_PORT"] }]
routes: [{ name: plain, match: { path_prefix: / }, upstream: app }]
YAML

python3 - "$WORK" "$BIN" "$(pwd)/policies" "$UP_PORT" "$NG_PORT" "$PD_PORT" "$PP_PORT" <<'PY'
import json, sys
work, bin_, policies, up, ng, pd, pp = sys.argv[1:8]
setups = []
for log in ("off", "on"):
    setups.append({"name": "nginx-tuned", "log": log, "port": int(ng), "path": "/app-proxy/x", "env": {},
                   "cmd": ["nginx", "-p", f"{work}/nginx", "-c", f"{work}/nginx/{log}.conf",
                           "-g", "daemon off; master_process off;"]})
    for name, pol, port, path, env in [
        ("portcullis-default", policies, pd, "/app-proxy/x",
         {"PORTCULLIS_LISTEN": f"127.0.0.1:{pd}", "APP_PROXY_URL": f"http://127.0.0.1:{up}"}),
        ("portcullis-plain", f"{work}/plain", pp, "/x", {}),
    ]:
        cmd = [bin_, "serve", "--workers", "1", "--policies", pol, "--admin", "off"]
        if log == "on":
            cmd += ["--access-log", f"{work}/{name}.access.log"]
        env = dict(env, RUST_LOG="info" if log == "on" else "warn")
        setups.append({"name": name, "log": log, "port": int(port), "path": path, "env": env, "cmd": cmd})
json.dump(setups, open(f"{work}/setups.json", "w"))
PY

echo "# $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes'), $REQUESTS requests, 1 worker each, median of $REPEAT run(s)"
python3 bench/versus_nginx.py "$WORK" "$REQUESTS" "$REPEAT"
# A log that stayed empty would make the "on" row a second "off" row.
for f in "$WORK/nginx/access.log" "$WORK/portcullis-default.access.log" "$WORK/portcullis-plain.access.log"; do
  [ -s "$f" ] || { echo "no access lines in $f" >&2; exit 1; }
done
echo "(access lines written: $(cat "$WORK/nginx/access.log" | wc -l) nginx, $(cat "$WORK/portcullis-default.access.log" | wc -l) portcullis-default)"
