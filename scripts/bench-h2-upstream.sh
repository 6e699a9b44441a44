#!/usr/bin/env bash
# HTTP/2 to the targets: raahi (an `h2c` service) against haproxy (`server ... proto h2`) and
# nginx (`grpc_pass`, the only way nginx sends HTTP/2 upstream), on loopback.
#
# Scenarios (SCENARIOS, in this order by default):
#   h2c   h2load -c$CONNECTIONS -m$STREAMS GETs over HTTP/2 with prior knowledge to the proxy, and
#         HTTP/2 with prior knowledge from the proxy to three nginx origins (`listen PORT http2`)
#   grpc  the same load as gRPC unary calls (POST /raahi.test.Echo/Unary, `application/grpc`, one
#         length-prefixed EchoRequest), to three tonic origins (examples/grpc_echo_origin.rs)
# Each run reports req/s, the proxy's CPU time per request (utime+stime from /proc/PID/stat over
# the run) and the upstream TCP connections the proxy holds mid-run (ss). Rounds interleave the
# proxies; the table shows medians. Then, once, raahi under $WIDE_CONNECTIONS x $STREAMS
# concurrent streams (1,000 by default): its upstream connections per 1,000 streams.
#
# Usage: scripts/bench-h2-upstream.sh  (as root on Debian 12; installs nginx haproxy nghttp2-client
#                                       when missing; builds raahi and the tonic origin in release)
# Environment:
#   DURATION=10  ROUNDS=3  CONNECTIONS=16  STREAMS=8  WIDE_CONNECTIONS=125  WORKERS=1
#   SCENARIOS="h2c grpc"  LOADGEN_CPU=0  PROXY_CPU=1  RAAHI_BIN=...  KEEP_TMP=1
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-16}
STREAMS=${STREAMS:-8}
WIDE_CONNECTIONS=${WIDE_CONNECTIONS:-125}
WORKERS=${WORKERS:-1}
LOADGEN_CPU=${LOADGEN_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
read -r -a SCENARIO_LIST <<<"${SCENARIOS:-h2c grpc}"
PROXIES=(raahi haproxy nginx)

log() { printf '[bench-h2] %s\n' "$*" >&2; }
die() { printf '[bench-h2] error: %s\n' "$*" >&2; exit 1; }

for cmd in nginx haproxy h2load; do
    command -v "$cmd" >/dev/null || {
        apt-get install -y nginx haproxy nghttp2-client >/dev/null || die "cannot install $cmd"
    }
done
if [[ -z ${RAAHI_BIN:-} ]]; then
    (cd "$REPO" && cargo build --release --quiet) || die "raahi build failed"
    RAAHI_BIN=$REPO/target/release/raahi
fi
(cd "$REPO" && cargo build --release --quiet --example grpc_echo_origin) ||
    die "tonic origin build failed"
ORIGIN_BIN=$REPO/target/release/examples/grpc_echo_origin

WORK=$(mktemp -d -t raahi-bench-h2.XXXXXX)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [[ -n ${KEEP_TMP:-} ]] && log "kept $WORK" || rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start NAME CPU CMD...: runs CMD pinned to CPU in the background, its output in WORK/NAME.log.
start() {
    local name=$1 cpu=$2
    shift 2
    taskset -c "$cpu" "$@" >"$WORK/$name.log" 2>&1 </dev/null &
    PIDS+=($!)
    STARTED=$!
}

wait_ready() { # URL [curl args]: until the URL answers
    local url=$1 tries=0
    shift
    until curl -s -o /dev/null --max-time 1 --noproxy '*' "$@" "$url"; do
        ((++tries < 100)) || die "$url never answered"
        sleep 0.1
    done
}

# --- origins ---------------------------------------------------------------------------------
declare -A ORIGIN_PORTS
H2C_PORTS=() GRPC_PORTS=()
for i in 1 2 3; do
    port=$(free_port)
    H2C_PORTS+=("$port")
    mkdir -p "$WORK/origin$i"
    cat >"$WORK/origin$i/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/origin$i/nginx.pid;
error_log $WORK/origin$i/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    keepalive_requests 1000000;
    http2_max_concurrent_streams 1000;
    server {
        listen 127.0.0.1:$port http2;
        location / { return 200 "ok\n"; }
    }
}
EOF
    start "origin$i" "$LOADGEN_CPU" nginx -g 'daemon off;' -c "$WORK/origin$i/nginx.conf"
    port=$(free_port)
    GRPC_PORTS+=("$port")
    start "grpc-origin$i" "$LOADGEN_CPU" "$ORIGIN_BIN" "127.0.0.1:$port" "origin$i"
done
ORIGIN_PORTS[h2c]="${H2C_PORTS[*]}"
ORIGIN_PORTS[grpc]="${GRPC_PORTS[*]}"

# One gRPC request: EchoRequest { text: "bench" } in a length-prefixed message.
printf '\x00\x00\x00\x00\x07\x12\x05bench' >"$WORK/grpc-request.bin"

# --- proxies: one listener per scenario ----------------------------------------------------------
declare -A PORT PID
# raahi: one service per scenario, routed by path prefix (gRPC paths start with /raahi.test).
RAAHI_PORT=$(free_port) ADMIN_PORT=$(free_port)
TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
mkdir -p "$WORK/raahi"
start raahi "$PROXY_CPU" env -C "$WORK/raahi" -u RAAHI_CONFIG \
    RAAHI_PROXY_LISTEN="127.0.0.1:$RAAHI_PORT" RAAHI_ADMIN_LISTEN="127.0.0.1:$ADMIN_PORT" \
    RAAHI_DATABASE_URL="sqlite://$WORK/raahi/raahi.db" RAAHI_ADMIN_TOKEN="$TOKEN" \
    RUST_LOG=warn TOKIO_WORKER_THREADS="$WORKERS" "$RAAHI_BIN" serve
PID[raahi]=$STARTED
wait_ready "http://127.0.0.1:$ADMIN_PORT/healthz"
api() { curl -sf --noproxy '*' -H "Authorization: Bearer $TOKEN" -H 'content-type: application/json' \
    -X POST --data "$2" "http://127.0.0.1:$ADMIN_PORT$1"; }
for scenario in h2c grpc; do
    id=$(api /api/v1/services "{\"name\":\"$scenario\",\"protocol\":\"h2c\"}" | grep -o '"id": *[0-9]*' | head -1 | grep -o '[0-9]*$')
    for p in ${ORIGIN_PORTS[$scenario]}; do
        api "/api/v1/services/$id/targets" "{\"host\":\"127.0.0.1\",\"port\":$p}" >/dev/null
    done
    prefix=/
    [[ $scenario == grpc ]] && prefix=/raahi.test.Echo
    api /api/v1/routes "{\"name\":\"$scenario\",\"path_prefix\":\"$prefix\",\"service_id\":$id}" >/dev/null
done
PORT[raahi]=$RAAHI_PORT

# haproxy: a frontend per scenario, HTTP/2 with prior knowledge both ways.
HAPROXY_H2C=$(free_port) HAPROXY_GRPC=$(free_port)
servers() { local i=0 p; for p in $1; do i=$((i + 1)); echo "    server s$i 127.0.0.1:$p proto h2"; done; }
cat >"$WORK/haproxy.cfg" <<EOF
global
    nbthread $WORKERS
    maxconn 4000
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend h2c_in
    bind 127.0.0.1:$HAPROXY_H2C proto h2
    default_backend h2c
frontend grpc_in
    bind 127.0.0.1:$HAPROXY_GRPC proto h2
    default_backend grpc
backend h2c
    balance roundrobin
$(servers "${ORIGIN_PORTS[h2c]}")
backend grpc
    balance roundrobin
$(servers "${ORIGIN_PORTS[grpc]}")
EOF
start haproxy "$PROXY_CPU" haproxy -db -f "$WORK/haproxy.cfg"
PID[haproxy]=$STARTED

# nginx: grpc_pass is nginx's only HTTP/2 upstream; it proxies plain HTTP/2 requests too.
NGINX_H2C=$(free_port) NGINX_GRPC=$(free_port)
upstream_block() { local p; echo "upstream $1 {"; for p in $2; do echo "    server 127.0.0.1:$p;"; done; echo "    keepalive 64;"; echo "}"; }
mkdir -p "$WORK/nginx"
cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes $WORKERS;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 10000; }
http {
    access_log off;
    keepalive_requests 1000000;
    http2_max_concurrent_streams 1000;
$(upstream_block h2c "${ORIGIN_PORTS[h2c]}")
$(upstream_block grpc "${ORIGIN_PORTS[grpc]}")
    server { listen 127.0.0.1:$NGINX_H2C http2; location / { grpc_pass grpc://h2c; } }
    server { listen 127.0.0.1:$NGINX_GRPC http2; location / { grpc_pass grpc://grpc; } }
}
EOF
start nginx "$PROXY_CPU" nginx -g 'daemon off;' -c "$WORK/nginx/nginx.conf"
PID[nginx]=$STARTED

declare -A URL
URL[h2c raahi]=http://127.0.0.1:$RAAHI_PORT/
URL[grpc raahi]=http://127.0.0.1:$RAAHI_PORT/raahi.test.Echo/Unary
URL[h2c haproxy]=http://127.0.0.1:$HAPROXY_H2C/
URL[grpc haproxy]=http://127.0.0.1:$HAPROXY_GRPC/raahi.test.Echo/Unary
URL[h2c nginx]=http://127.0.0.1:$NGINX_H2C/
URL[grpc nginx]=http://127.0.0.1:$NGINX_GRPC/raahi.test.Echo/Unary
for proxy in "${PROXIES[@]}"; do
    wait_ready "${URL[h2c $proxy]}" --http2-prior-knowledge
done

cpu_ticks() { # PID: utime+stime of PID and its children (clock ticks)
    local total=0 pid ticks
    for pid in $1 $(pgrep -P "$1" || true); do
        ticks=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | awk '{print $12 + $13}') || continue
        total=$((total + ${ticks:-0}))
    done
    echo "$total"
}

upstream_connections() { # PID SCENARIO: established connections from PID's process tree to the origins
    local filter="" p pids
    for p in ${ORIGIN_PORTS[$2]}; do filter+="${filter:+ or }dport = :$p"; done
    pids=$(echo "$1" $(pgrep -P "$1" || true) | tr ' ' '|')
    ss -Htnp state established "( $filter )" | grep -cE "pid=($pids)," || true
}

# run SCENARIO PROXY CONNECTIONS: one measured run; prints "requests ticks upstream_conns"
run() {
    local scenario=$1 proxy=$2 connections=$3 out=$WORK/h2load.out before after conns
    local load=(h2load -c"$connections" -m"$STREAMS" -t1 -D "$DURATION")
    [[ $scenario == grpc ]] && load+=(-d "$WORK/grpc-request.bin" -H 'content-type: application/grpc' -H 'te: trailers')
    before=$(cpu_ticks "${PID[$proxy]}")
    taskset -c "$LOADGEN_CPU" "${load[@]}" "${URL[$scenario $proxy]}" >"$out" 2>&1 &
    local loader=$!
    sleep $((DURATION / 2))
    conns=$(upstream_connections "${PID[$proxy]}" "$scenario")
    wait "$loader" || die "h2load failed: $(tail -5 "$out")"
    after=$(cpu_ticks "${PID[$proxy]}")
    local succeeded
    succeeded=$(grep -o '[0-9]* succeeded' "$out" | head -1 | grep -o '^[0-9]*')
    grep -q ' 0 failed' "$out" || log "warning: $scenario via $proxy had failures: $(grep 'requests:' "$out")"
    grep -q '2xx' "$out" && [[ $(grep -o '[0-9]* 2xx' "$out" | grep -o '^[0-9]*') == "$succeeded" ]] ||
        log "warning: $scenario via $proxy: not every answer was 2xx: $(grep 'status codes' "$out")"
    echo "$succeeded $((after - before)) $conns"
}

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
TICK_US=$((1000000 / $(getconf CLK_TCK)))

log "warming up"
for scenario in "${SCENARIO_LIST[@]}"; do
    for proxy in "${PROXIES[@]}"; do DURATION=2 run "$scenario" "$proxy" "$CONNECTIONS" >/dev/null; done
done

declare -A RPS CPU CONNS
for round in $(seq 1 "$ROUNDS"); do
    order=("${PROXIES[@]:round%3}" "${PROXIES[@]:0:round%3}")
    for scenario in "${SCENARIO_LIST[@]}"; do
        for proxy in "${order[@]}"; do
            read -r requests ticks conns < <(run "$scenario" "$proxy" "$CONNECTIONS")
            log "round $round $scenario $proxy: $requests requests, $ticks ticks, $conns upstream connections"
            RPS[$scenario $proxy]+="$((requests / DURATION)) "
            CPU[$scenario $proxy]+="$(awk -v t="$ticks" -v us="$TICK_US" -v n="$requests" 'BEGIN {printf "%.2f", t * us / n}') "
            CONNS[$scenario $proxy]+="$conns "
        done
    done
done

printf '\n| scenario | proxy | req/s | CPU µs/request | upstream connections |\n|---|---|---:|---:|---:|\n'
for scenario in "${SCENARIO_LIST[@]}"; do
    for proxy in "${PROXIES[@]}"; do
        printf '| %s | %s | %s | %s | %s |\n' "$scenario" "$proxy" \
            "$(tr ' ' '\n' <<<"${RPS[$scenario $proxy]}" | grep . | median)" \
            "$(tr ' ' '\n' <<<"${CPU[$scenario $proxy]}" | grep . | median)" \
            "$(tr ' ' '\n' <<<"${CONNS[$scenario $proxy]}" | grep . | median)"
    done
done

read -r requests ticks conns < <(run h2c raahi "$WIDE_CONNECTIONS")
printf '\nraahi, %d concurrent streams (h2load -c%d -m%d): %d upstream connections, %d req/s\n' \
    $((WIDE_CONNECTIONS * STREAMS)) "$WIDE_CONNECTIONS" "$STREAMS" "$conns" $((requests / DURATION))
