# Shared by the bench/*.sh scripts (sourced, not run): tools, the release
# build, a scratch directory cleaned on exit, free ports, the upstream, and
# wrk's figures.

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/portcullis-target}"

if ! command -v wrk >/dev/null || ! command -v nginx >/dev/null; then
  apt-get update -qq && apt-get install -y -qq wrk nginx-light >/dev/null
fi
cargo build --release --locked -p portcullis
BIN="$CARGO_TARGET_DIR/release/portcullis"

WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The upstream on $1: one nginx worker answering a small fixed body (and
# serving $WORK/big.bin at /big when it exists).
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
  }
}
CONF
  nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" -g 'daemon off;' & PIDS+=($!)
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
