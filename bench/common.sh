# Shared by the bench/*.sh scripts (sourced, not run): tools, the release
# build, a scratch directory cleaned on exit, free ports, the upstream, and
# wrk's figures.

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/portcullis-target}"

if ! command -v wrk >/dev/null || ! command -v nginx >/dev/null; then
  apt-get update -qq && apt-get install -y -qq wrk nginx-light >/dev/null
fi
# BENCH_NO_BUILD: the caller brings its binaries (instructions-diff.sh).
# PORTCULLIS_BIN: measure that binary (an older build, to compare) instead
# of building this checkout.
if [ -z "${BENCH_NO_BUILD:-}" ] && [ -z "${PORTCULLIS_BIN:-}" ]; then
  cargo build --release --locked -p portcullis
fi
BIN="${PORTCULLIS_BIN:-$CARGO_TARGET_DIR/release/portcullis}"
# A tunnel server's public connections go on for the whole run, as the
# nginx the benches compare with keeps its clients' (keepalive_requests
# 1000000 below); the routing core's bench listeners say the same.
export PORTCULLIS_PUBLIC_MAX_REQUESTS_PER_CONNECTION=0

WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

# A private CA (ca.pem, ca.key) and a leaf it signed (leaf.pem, leaf.key)
# for the DNS names (or IPv4 addresses) given, in $WORK.
make_pki() {
  local san="" name
  for name in "$@"; do
    if [[ $name =~ ^[0-9.]+$ ]]; then san+="IP:$name,"; else san+="DNS:$name,"; fi
  done
  san=${san%,}
  (
    cd "$WORK"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=bench-ca 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout leaf.key -out leaf.csr -subj "/CN=$1" 2>/dev/null
    printf 'subjectAltName=%s\n' "$san" > leaf.ext
    openssl x509 -req -in leaf.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out leaf.pem -days 2 -extfile leaf.ext 2>/dev/null
  )
}

# rathole's configs for one service through one TLS control channel, in
# $WORK (rh-server.toml, rh-client.toml, and identity.pfx from
# make_pki's leaf): the server binds its control channel on $1 and the
# service's public side on $2; the client dials $3 (host:port), checks
# the server's certificate for host $4 and forwards to $5.
rathole_configs() {
  openssl pkcs12 -export -out "$WORK/identity.pfx" -inkey "$WORK/leaf.key" -in "$WORK/leaf.pem" \
    -certfile "$WORK/ca.pem" -passout pass:bench
  cat > "$WORK/rh-server.toml" <<CONF
[server]
bind_addr = "$1"
[server.transport]
type = "tls"
[server.transport.tls]
pkcs12 = "$WORK/identity.pfx"
pkcs12_password = "bench"
[server.services.web]
token = "bench-token"
bind_addr = "$2"
CONF
  cat > "$WORK/rh-client.toml" <<CONF
[client]
remote_addr = "$3"
[client.transport]
type = "tls"
[client.transport.tls]
trusted_root = "$WORK/ca.pem"
hostname = "$4"
[client.services.web]
token = "bench-token"
local_addr = "$5"
CONF
}

free_port() { free_ports 1; }
# $1 distinct free ports, one per line. All are held until all are chosen:
# separate calls of free_port may be handed the same port twice (for 200
# ports, about one repeat per run), which a server then fails to bind.
free_ports() {
  python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print("\n".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

# The upstream on $1: one nginx worker answering a small fixed body (and
# serving $WORK/big.bin at /big and $WORK/list.json when they exist); in
# the network namespace UP_NETNS when set (bench/lossy.sh).
start_upstream() {
  mkdir -p "$WORK/up"
  cat > "$WORK/up/nginx.conf" <<CONF
worker_processes 1;
pid $WORK/up/nginx.pid;
error_log $WORK/up/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:$1;
    location / { return 200 "hello from upstream\n"; }
    # A large file for throughput runs (bench/tunnel.sh writes it).
    location = /big { alias $WORK/big.bin; }
    # A JSON document (bench/compress.sh writes it).
    location = /list.json { default_type application/json; alias $WORK/list.json; }
$(if [ -n "${SINK_PORT:-}" ]; then
  # Uploads, read whole before the answer by bench/bodies.py's sink
  # (bench/tunnel.sh starts one on SINK_PORT).
  echo "    location = /upload { client_max_body_size 0; proxy_request_buffering off; proxy_http_version 1.1; proxy_pass http://127.0.0.1:$SINK_PORT/up; }"
fi)
  }
}
CONF
  local run=()
  [ -z "${UP_NETNS:-}" ] || run=(ip netns exec "$UP_NETNS")
  "${run[@]}" nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" -g 'daemon off;' & PIDS+=($!)
  UP_PID=$!
}

# User and system CPU time so far, in clock ticks, of process $1 and its
# children (nginx's workers): "user system".
cpu_ticks() { for p in "$1" $(pgrep -P "$1"); do awk '{print $14, $15}' "/proc/$p/stat"; done | awk '{u += $1; s += $2} END {print u, s}'; }
TICK_US=$((1000000 / $(getconf CLK_TCK)))
# Seconds in bash's `times` format (0m1.250s) to microseconds.
times_us() { awk '{ split($0, a, "m"); sub("s", "", a[2]); printf "%.0f", (a[1] * 60 + a[2]) * 1e6 }' <<<"$1"; }

# Runs a command printing wrk's "rps p50_us p99_us" (DURATION seconds)
# while proxy $1 serves it, and adds CPU per request: the proxy's user and
# system time, and the rest of the loop's (wrk and the upstream, user +
# system): "rps p50_us p99_us user_us sys_us loop_us". On shared cores
# requests/s is about cores / (proxy + loop CPU per request).
with_cpu() {
  local pid=$1 u1 s1 u2 s2 uu1 us1 uu2 us2 out figures wu ws wrk_us
  shift
  read -r u1 s1 <<<"$(cpu_ticks "$pid")"
  read -r uu1 us1 <<<"$(cpu_ticks "$UP_PID")"
  # `times` in the same subshell: the CPU of its children, wrk and awk.
  out=$("$@"; times)
  read -r u2 s2 <<<"$(cpu_ticks "$pid")"
  read -r uu2 us2 <<<"$(cpu_ticks "$UP_PID")"
  figures=$(head -1 <<<"$out")
  read -r wu ws <<<"$(sed -n 3p <<<"$out")"
  wrk_us=$(($(times_us "$wu") + $(times_us "$ws")))
  awk -v f="$figures" -v u=$((u2 - u1)) -v s=$((s2 - s1)) -v up=$((uu2 - uu1 + us2 - us1)) \
    -v w="$wrk_us" -v t="$TICK_US" -v d="$DURATION" \
    'BEGIN { split(f, a, " "); n = a[1] * d; printf "%s %.2f %.2f %.2f\n", f, u * t / n, s * t / n, (up * t + w) / n }'
}

# Reads wrk --latency output on stdin; prints "rps p50_us p99_us" and
# complains on stderr about non-2xx answers or socket errors.
wrk_figures() {
  awk '
    function us(v) { if (v ~ /us$/) return v+0; if (v ~ /ms$/) return (v+0)*1000; if (v ~ /s$/) return (v+0)*1000000; return v }
    /^ +50%/ { p50 = us($2) } /^ +99%/ { p99 = us($2) } /^Requests\/sec/ { rps = $2 }
    /Non-2xx/ { print "ERRORS: " $0 > "/dev/stderr" } /Socket errors/ { print "ERRORS: " $0 > "/dev/stderr" }
    END { printf "%.0f %.2f %.0f\n", rps, p50, p99 }'
}

# The median line of file $1 by column $2 (ROUNDS lines).
median() { sort -n -k"${2:-1}" "$1" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)'; }
# Column $2 of that median line.
col_median() { median "$1" "$2" | awk -v c="$2" '{print $c}'; }

# Waits until http://127.0.0.1:$1/ answers 2xx; ends the run if it never does.
wait_port() { for _ in $(seq 100); do curl -fsS "http://127.0.0.1:$1/" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "port $1 not ready" >&2; exit 1; }

# An HS256 token for the secret `bench-secret`, valid for an hour.
bench_token() {
  python3 - <<'PY'
import base64, hmac, hashlib, json, time
b = lambda d: base64.urlsafe_b64encode(d).rstrip(b"=").decode()
h = b(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
c = b(json.dumps({"sub": "bench", "exp": int(time.time()) + 3600}).encode())
s = b(hmac.new(b"bench-secret", f"{h}.{c}".encode(), hashlib.sha256).digest())
print(f"{h}.{c}.{s}")
PY
}

# Writes the plugin benches' policies into $1: a listener on port $2, the
# upstream on port $3, and the same route with and without plugins:
#   /plain   no plugin
#   /key     the SDK example (require-header): a header-only API-key check
#   /auth    jwt-auth (HS256), the verified token remembered (the default)
#   /verify  jwt-auth with cache_size: 0, the signature checked per request
#   /fresh   jwt-auth, a new instance per request (instances: per-request)
#   /limited no plugin, a rate limit per client too high to refuse anything:
#            what keeping count costs (`PATHS="/plain /limited"`)
plugin_policies() {
  mkdir -p "$1"
  cp plugins/dist/jwt-auth.wasm plugins/dist/example-require-header.wasm plugins/dist/proxy-wasm-require.wasm "$1/"
  cat > "$1/bench.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$2", max_requests_per_connection: 1000000 }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$3"] }]
plugins: [{ name: jwt, path: jwt-auth.wasm }, { name: key, path: example-require-header.wasm }, { name: pw, path: proxy-wasm-require.wasm }]
routes:
  - { name: plain, match: { path: /plain }, upstream: app }
  - { name: key, match: { path: /key }, upstream: app, plugins: [{ use: key, config: { header: authorization } }] }
  - { name: pw, match: { path: /pw }, upstream: app, plugins: [{ use: pw, config: authorization }] }
  - { name: auth, match: { path: /auth }, upstream: app, plugins: [{ use: jwt, config: { hs256_secret: bench-secret } }] }
  - { name: verify, match: { path: /verify }, upstream: app, plugins: [{ use: jwt, config: { hs256_secret: bench-secret, cache_size: 0 } }] }
  - { name: fresh, match: { path: /fresh }, upstream: app, plugins: [{ use: jwt, instances: per-request, config: { hs256_secret: bench-secret } }] }
  - { name: limited, match: { path: /limited }, upstream: app, rate_limit: { rate: 1000000000/s, burst: 1000000 } }
YAML
}
