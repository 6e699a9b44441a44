#!/usr/bin/env bash
# A/B CPU per request of two raahi set-ups on this machine, side by side: both run at once on
# the same CPU behind the same three nginx origins, and short wrk runs alternate between them
# (A B A B ...), so a noisy machine (a VM whose speed drifts by ±15 % over a minute) slows both
# alike. Prints each pair's CPU µs per request and the median ratio B/A.
#
# Usage: A_BIN=path B_BIN=path [B_ENV="RAAHI_TRACING_OTLP_ENDPOINT=... ..."] scripts/bench-ab.sh
# Environment:
#   A_BIN, B_BIN    the two raahi binaries (may be the same file)
#   A_ENV, B_ENV    extra environment for each, space-separated NAME=VALUE pairs
#   PAIRS=10        alternations
#   DURATION=3      seconds per wrk run
#   CONNECTIONS=64  wrk -c (keep-alive, one thread)
#   PROXY_CPU=1     CPU both raahi processes are pinned to; wrk and the origins get the other
#   LOADGEN_CPU=0
# Only 127.0.0.1 is ever contacted. Needs nginx, wrk, curl.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATES=$SCRIPT_DIR/bench
PAIRS=${PAIRS:-10}
DURATION=${DURATION:-3}
CONNECTIONS=${CONNECTIONS:-64}
PROXY_CPU=${PROXY_CPU:-1}
LOADGEN_CPU=${LOADGEN_CPU:-0}

log() { printf '[ab] %s\n' "$*" >&2; }
die() { printf '[ab] error: %s\n' "$*" >&2; exit 1; }
[[ -x ${A_BIN:-} && -x ${B_BIN:-} ]] || die "set A_BIN and B_BIN to raahi binaries"
for cmd in nginx wrk curl taskset; do command -v "$cmd" >/dev/null || die "$cmd is missing"; done

WORK=$(mktemp -d /tmp/raahi-ab.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

wait_200() {
    local url=$1 deadline=$((SECONDS + 60))
    until [[ $(curl -s -o /dev/null -w '%{http_code}' --noproxy '*' "$url" || true) == 200 ]]; do
        ((SECONDS < deadline)) || die "$url does not answer 200"
        sleep 0.2
    done
}

head -c 16 /dev/zero >"$WORK/big.bin"
ORIGINS=()
for i in 1 2 3; do
    dir=$WORK/origin$i
    mkdir -p "$dir"
    port=$(free_port)
    sed -e "s|@DIR@|$dir|g" -e "s|@PORT@|$port|g" -e "s|@NAME@|u$i|g" -e "s|@BIG_FILE@|$WORK/big.bin|g" \
        "$TEMPLATES/upstream-nginx.conf.tmpl" >"$dir/nginx.conf"
    taskset -c "$LOADGEN_CPU" nginx -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf" \
        >"$dir/out.log" 2>&1 </dev/null &
    PIDS+=("$!")
    wait_200 "http://127.0.0.1:$port/"
    ORIGINS+=("$port")
done

declare -A PROXY_PORT PROXY_PID
for side in A B; do
    dir=$WORK/raahi-$side
    mkdir -p "$dir"
    port=$(free_port)
    admin=$(free_port)
    token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    bin_var=${side}_BIN
    env_var=${side}_ENV
    # shellcheck disable=SC2086 # the extra environment is NAME=VALUE words on purpose
    taskset -c "$PROXY_CPU" env -C "$dir" -u RAAHI_CONFIG ${!env_var:-} \
        RAAHI_PROXY_LISTEN="127.0.0.1:$port" RAAHI_ADMIN_LISTEN="127.0.0.1:$admin" \
        RAAHI_DATABASE_URL="sqlite://$dir/raahi.db" RAAHI_ADMIN_TOKEN="$token" \
        RUST_LOG=warn TOKIO_WORKER_THREADS=1 "${!bin_var}" serve >"$dir/raahi.log" 2>&1 </dev/null &
    PROXY_PID[$side]=$!
    PIDS+=("$!")
    wait_200 "http://127.0.0.1:$admin/healthz"
    post() {
        curl -sf --noproxy '*' -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
            -X POST --data "$2" "http://127.0.0.1:$admin$1"
    }
    service=$(post /api/v1/services '{"name":"ab"}' | grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$')
    for origin in "${ORIGINS[@]}"; do
        post "/api/v1/services/$service/targets" "{\"host\":\"127.0.0.1\",\"port\":$origin}" >/dev/null
    done
    post /api/v1/routes "{\"name\":\"all\",\"service_id\":$service}" >/dev/null
    wait_200 "http://127.0.0.1:$port/"
    PROXY_PORT[$side]=$port
    log "$side: ${!bin_var} ${!env_var:-} on port $port (pid ${PROXY_PID[$side]})"
done

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# CPU µs per request of one wrk run against `side`.
run() {
    local side=$1 before after requests
    before=$(cpu_ticks "${PROXY_PID[$side]}")
    requests=$(taskset -c "$LOADGEN_CPU" wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" \
        "http://127.0.0.1:${PROXY_PORT[$side]}/" | awk '/requests in/ {print $1}')
    after=$(cpu_ticks "${PROXY_PID[$side]}")
    awk -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" -v n="$requests" \
        'BEGIN { printf "%.2f", t / hz * 1e6 / n }'
}

run A >/dev/null
run B >/dev/null
RATIOS=()
printf 'pair  A µs/req  B µs/req  B/A\n'
for ((pair = 1; pair <= PAIRS; pair++)); do
    if ((pair % 2)); then a=$(run A); b=$(run B); else b=$(run B); a=$(run A); fi
    ratio=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", b / a }')
    RATIOS+=("$ratio")
    printf '%4d  %8s  %8s  %s\n' "$pair" "$a" "$b" "$ratio"
done
printf '%s\n' "${RATIOS[@]}" | sort -n | awk '{ r[NR] = $1 } END {
    m = (NR % 2) ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2
    printf "median B/A over %d pairs: %.3f (min %.3f, max %.3f)\n", NR, m, r[1], r[NR] }'
