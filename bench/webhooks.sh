#!/usr/bin/env bash
# What large signed webhooks do to the rest of the traffic: the default
# policies (WEBHOOK_SECRET set, so every webhook is hashed by the
# webhook-signature plugin), wrk on /app-proxy/ alone, then again while a
# client posts signed webhooks of WEBHOOK_MB back to back.
#   DURATION=10 WEBHOOK_MB=8 bench/webhooks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
WEBHOOK_MB="${WEBHOOK_MB:-8}"
source bench/common.sh

UP_PORT=$(free_port)
PC_PORT=$(free_port)
start_upstream "$UP_PORT"
head -c $((WEBHOOK_MB << 20)) /dev/urandom > "$WORK/webhook"
SIG=$(python3 -c 'import hmac, hashlib, sys; print("sha256=" + hmac.new(b"bench-secret", open(sys.argv[1], "rb").read(), hashlib.sha256).hexdigest())' "$WORK/webhook")

WEBHOOK_SECRET=bench-secret EVENTSOURCE_URL="http://127.0.0.1:$UP_PORT" \
  APP_PROXY_URL="http://127.0.0.1:$UP_PORT" PORTCULLIS_LISTEN="127.0.0.1:$PC_PORT" \
  "$BIN" serve --admin off >"$WORK/proxy.log" 2>&1 & PIDS+=($!)
for _ in $(seq 100); do curl -fs "http://127.0.0.1:$PC_PORT/healthz" >/dev/null && break; sleep 0.1; done

traffic() { wrk -t1 -c16 -d"${DURATION}s" --latency "http://127.0.0.1:$PC_PORT/app-proxy/" | wrk_figures; }

echo "app-proxy alone:            $(traffic) (rps p50_us p99_us)"
# Webhooks back to back for the length of the wrk run; each must pass the
# signature check (the upstream then refuses the body: nginx's 1 MiB
# client_max_body_size, answered 413, which counts as passed here).
(
  end=$((SECONDS + DURATION + 1)); n=0; refused=0
  while [ $SECONDS -lt $end ]; do
    code=$(curl -s -o /dev/null -w '%{http_code}' -H "X-Hub-Signature-256: $SIG" \
      -H 'X-GitHub-Event: push' --data-binary @"$WORK/webhook" \
      "http://127.0.0.1:$PC_PORT/webhooks/ns/source/push")
    n=$((n + 1))
    case "$code" in 401|5*) refused=$((refused + 1)) ;; esac
  done
  echo "webhooks: $n of ${WEBHOOK_MB} MiB, $refused refused by the proxy" >"$WORK/webhooks"
) &
HOOKS=$!
sleep 0.5
echo "app-proxy during webhooks:  $(traffic) (rps p50_us p99_us)"
wait "$HOOKS"
cat "$WORK/webhooks"
