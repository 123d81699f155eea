#!/usr/bin/env bash
# Tunnels over a slow, lossy link: what the QUIC transport is for. rathole
# and Portcullis over WebSocket and over QUIC, side by side in one run.
#
#   bench/lossy.sh
#   LOSSES="0 0.5 2" RTT_MS=40 RATE_MBIT=100 QUEUE_MS=50 DURATION=10 ROUNDS=3 \
#     CONNECTIONS=32 DOWN_MB=8 TCP_CC=cubic bench/lossy.sh
#
# The tunnel servers and the public clients (wrk, curl) run in one network
# namespace, the tunnel clients and the upstream (one nginx worker) in
# another, and the only way between them is bench/lossy_link.py: RTT_MS of
# round trip, RATE_MBIT each way with QUEUE_MS of queue, and each packet
# dropped with the chance given in LOSSES (percent, each direction), as
# `tc ... netem` would (this VM's kernel has no netem). So the tunnels
# cross a WAN, as a cluster's outbound tunnel does, and the public side and
# the upstream are local to their ends. For each loss rate, ROUNDS rounds
# of, through each tunnel:
#   requests/s  wrk -c$CONNECTIONS on a small body, keep-alive (wrk's
#               timeout 10 s: a request stalled past it is an error);
#   download    one stream: curl fetches DOWN_MB MiB through the tunnel.
# A WebSocket tunnel carries all its requests over one TCP connection, so
# one lost packet holds up every request behind it until it is resent; a
# QUIC tunnel holds up only the stream that lost it; rathole opens a TCP
# connection per public connection. QUIC runs twice: with its default
# congestion control (CUBIC) and with `--quic-congestion bbr` on the
# client (quic-bbr), which sends the downloads. Portcullis's clients keep
# their default two tunnels. TCP's congestion control is the kernel's default
# unless TCP_CC names another (cubic, bbr, reno: what a cluster node runs
# decides how the WebSocket and rathole tunnels recover; QUIC's is
# Portcullis's own, in user space). Needs root (namespaces, TUN devices); installs wrk,
# nginx and rathole if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

LOSSES=${LOSSES:-"0 0.5 2"}
RTT_MS=${RTT_MS:-40}
RATE_MBIT=${RATE_MBIT:-100}
QUEUE_MS=${QUEUE_MS:-50}
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-32}
DOWN_MB=${DOWN_MB:-8}
[ "$(id -u)" = 0 ] || { echo "bench/lossy.sh needs root: network namespaces and TUN devices" >&2; exit 1; }
# shellcheck source=bench/common.sh
. bench/common.sh
command -v rathole >/dev/null || cargo install rathole
export RUST_LOG=warn

SRV=portcullis-bench-srv-$$
CLI=portcullis-bench-cli-$$
ALLOWED=$(sysctl -n net.ipv4.tcp_allowed_congestion_control)
ns_cleanup() {
  # Everything but the link first, newest first, and the link once they
  # are gone: a tunnel client told to stop tells its server, and with the
  # link gone it would wait out its grace period.
  local i p
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    [ "${PIDS[i]}" = "${LINK:-}" ] || kill "${PIDS[i]}" 2>/dev/null || true
  done
  for _ in $(seq 100); do
    for p in "${PIDS[@]}"; do
      [ "$p" != "${LINK:-}" ] && kill -0 "$p" 2>/dev/null && { sleep 0.1; continue 2; }
    done
    break
  done
  cleanup
  sysctl -q -w "net.ipv4.tcp_allowed_congestion_control=$ALLOWED" || true
  ip netns del "$SRV" 2>/dev/null || true
  ip netns del "$CLI" 2>/dev/null || true
  rm -rf "/etc/netns/$CLI"
}
trap ns_cleanup EXIT
ip netns add "$SRV"
ip netns add "$CLI"
# (Background processes are started with `ip netns exec` itself, which
# becomes the command: through a function, $! would be a subshell's, and
# killing it would leave the process behind.)
in_srv() { ip netns exec "$SRV" "$@"; }

# The link, its devices and addresses; the clients find the servers as
# tunnel.bench (`ip netns exec` shows /etc/netns/NAME/hosts as /etc/hosts).
set_link() { echo "$1 $RTT_MS $RATE_MBIT $QUEUE_MS" > "$WORK/link"; }
set_link 0
python3 bench/lossy_link.py "$SRV" "$CLI" "$WORK/link" "$WORK/link.ready" 2> "$WORK/link.log" & PIDS+=($!)
LINK=$!
for _ in $(seq 100); do [ -e "$WORK/link.ready" ] && break; sleep 0.1; done
[ -e "$WORK/link.ready" ] || { cat "$WORK/link.log" >&2; exit 1; }
ip -n "$SRV" addr add 10.77.0.1 peer 10.77.0.2 dev tun0
ip -n "$CLI" addr add 10.77.0.2 peer 10.77.0.1 dev tun0
# A namespace may only pick what the host allows; allowed until the end.
if [ -n "${TCP_CC:-}" ] && ! grep -qw "$TCP_CC" <<<"$ALLOWED"; then
  sysctl -q -w "net.ipv4.tcp_allowed_congestion_control=$ALLOWED $TCP_CC"
fi
for ns in "$SRV" "$CLI"; do
  ip -n "$ns" link set lo up; ip -n "$ns" link set tun0 up
  [ -z "${TCP_CC:-}" ] || ip netns exec "$ns" sysctl -q -w "net.ipv4.tcp_congestion_control=$TCP_CC"
done
TCP_CC=$(ip netns exec "$CLI" sysctl -n net.ipv4.tcp_congestion_control)
mkdir -p "/etc/netns/$CLI"
printf '127.0.0.1 localhost\n10.77.0.1 tunnel.bench\n' > "/etc/netns/$CLI/hosts"

make_pki tunnel.bench
head -c "$((DOWN_MB << 20))" /dev/urandom > "$WORK/big.bin"
chmod a+rx "$WORK"; chmod a+r "$WORK/big.bin"

# Every port is free in namespaces of our own.
UP=9000; PUB=8080; TUN=8443; RH_CTL=2333; RH_PUB=8081
UP_NETNS=$CLI start_upstream "$UP"

hash=$(printf bench-token-not-a-secret | "$BIN" hash-token)
printf 'bench: %s\nbenchq: %s\nbenchb: %s\n' "$hash" "$hash" "$hash" > "$WORK/tokens.yaml"
ip netns exec "$SRV" "$BIN" tunnel-server --public "127.0.0.1:$PUB" --tunnel-listen "10.77.0.1:$TUN" \
  --domain bench.test --tokens "$WORK/tokens.yaml" --cert "$WORK/leaf.pem" --key "$WORK/leaf.key" \
  --tunnel-quic --admin off & PIDS+=($!)
rathole_configs "10.77.0.1:$RH_CTL" "127.0.0.1:$RH_PUB" "tunnel.bench:$RH_CTL" tunnel.bench "127.0.0.1:$UP"
ip netns exec "$SRV" rathole --server "$WORK/rh-server.toml" > "$WORK/rh-server.log" 2>&1 & PIDS+=($!)
sleep 0.5
ip netns exec "$CLI" rathole --client "$WORK/rh-client.toml" > "$WORK/rh-client.log" 2>&1 & PIDS+=($!)
# A Portcullis tunnel client in front of the upstream, with arguments $@.
pc_client() {
  PORTCULLIS_TOKEN=bench-token-not-a-secret ip netns exec "$CLI" "$BIN" tunnel-client --server "wss://tunnel.bench:$TUN" \
    --ca "$WORK/ca.pem" --upstream "http://127.0.0.1:$UP" --admin off "$@" & PIDS+=($!)
}
pc_client --runtime-id bench
pc_client --runtime-id benchq --transport quic
pc_client --runtime-id benchb --transport quic --quic-congestion bbr

wait_ok() { for _ in $(seq 100); do in_srv curl -sf -o /dev/null "$@" && return 0; sleep 0.2; done; echo "not answering: $*" >&2; exit 1; }
wait_ok "http://127.0.0.1:$RH_PUB/"
wait_ok -H "Host: bench.bench.test" "http://127.0.0.1:$PUB/"
wait_ok -H "Host: benchq.bench.test" "http://127.0.0.1:$PUB/"
wait_ok -H "Host: benchb.bench.test" "http://127.0.0.1:$PUB/"

# Where each tunnel's public side is, and the Host that picks it.
TUNNELS=(rathole portcullis portcullis-quic quic-bbr)
declare -A URL=([rathole]="http://127.0.0.1:$RH_PUB" [portcullis]="http://127.0.0.1:$PUB"
  [portcullis-quic]="http://127.0.0.1:$PUB" [quic-bbr]="http://127.0.0.1:$PUB")
declare -A HOST=([rathole]=localhost [portcullis]=bench.bench.test [portcullis-quic]=benchq.bench.test
  [quic-bbr]=benchb.bench.test)
# MiB/s of one download of big.bin; fails the run unless all of it came.
download() {
  in_srv curl -s --max-time 300 -o /dev/null -w '%{http_code} %{size_download} %{speed_download}\n' \
    -H "Host: ${HOST[$1]}" "${URL[$1]}/big" |
    awk -v want="$((DOWN_MB << 20))" -v t="$1" '$1 != 200 || $2 != want { print t " download failed: " $0 > "/dev/stderr"; exit 1 } { printf "%.2f\n", $3 / 1048576 }'
}
# "rps p50_us p99_us errors" of a wrk run through tunnel $1 (errors: wrk's
# socket errors, timeouts included, and non-2xx answers).
load() {
  in_srv wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" --timeout 10s --latency -H "Host: ${HOST[$1]}" "${URL[$1]}/" > "$WORK/wrk.out"
  printf '%s %s\n' "$(wrk_figures < "$WORK/wrk.out" 2>/dev/null)" \
    "$(awk '/Socket errors/ { gsub(",", ""); e += $4 + $6 + $8 + $10 } /Non-2xx/ { e += $NF } END { print e + 0 }' "$WORK/wrk.out")"
}

echo
echo "Tunnels over a lossy link: RTT $RTT_MS ms, $RATE_MBIT Mbit/s each way ($QUEUE_MS ms of queue), TCP congestion control $TCP_CC, $(nproc) cores"
echo "wrk -t2 -c$CONNECTIONS -d${DURATION}s --timeout 10s; one-stream download of $DOWN_MB MiB; median of $ROUNDS rounds"
printf '%-8s %-16s %11s %9s %9s %7s %11s\n' loss tunnel "requests/s" "p50 (ms)" "p99 (ms)" errors "down MiB/s"
for loss in $LOSSES; do
  set_link "$loss"; kill -HUP "$LINK"
  for t in "${TUNNELS[@]}"; do : > "$WORK/rps.$t"; : > "$WORK/down.$t"; done
  for _ in $(seq "$ROUNDS"); do
    for t in "${TUNNELS[@]}"; do
      load "$t" >> "$WORK/rps.$t"
      download "$t" >> "$WORK/down.$t"
    done
  done
  for t in "${TUNNELS[@]}"; do
    read -r rps p50 p99 errors < <(median "$WORK/rps.$t" 1)
    down=$(sort -n "$WORK/down.$t" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)')
    printf '%-8s %-16s %11s %9.1f %9.1f %7s %11s\n' "$loss%" "$t" "$rps" "$(awk -v v="$p50" 'BEGIN{print v/1000}')" \
      "$(awk -v v="$p99" 'BEGIN{print v/1000}')" "$errors" "$down"
    echo "$loss $t $rps $p50 $p99 $errors $down" >> "$WORK/summary"
  done
done
kill -USR1 "$LINK"; sleep 0.2
echo
awk '
  { rps[$1, $2] = $3; p99[$1, $2] = $5; down[$1, $2] = $7; if (!($1 in seen)) { seen[$1] = 1; order[++n] = $1 } }
  function vs(l, a, b) { return sprintf("requests/s %.2fx, p99 %.2fx, download %.2fx", rps[l, a] / rps[l, b], p99[l, a] / p99[l, b], down[l, a] / down[l, b]) }
  END {
    for (i = 1; i <= n; i++) { l = order[i]
      printf "%s%% loss: quic / websocket %s\n", l, vs(l, "portcullis-quic", "portcullis")
      printf "%s%% loss: quic-bbr / websocket %s\n", l, vs(l, "quic-bbr", "portcullis")
      printf "%s%% loss: quic-bbr / rathole %s\n", l, vs(l, "quic-bbr", "rathole") }
  }' "$WORK/summary"
echo "the link's own count per setting (random drops should match the loss asked for):"
sed -n 's/^lossy_link: /  /p' "$WORK/link.log" | tail -n +3
