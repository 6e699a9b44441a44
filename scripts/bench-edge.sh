#!/usr/bin/env bash
# Edge hardening benchmark (issues 20 and 31): attacks against raahi, nginx and haproxy on
# loopback.
#
#   rapid-reset  one h2c client sends bursts of 19 x (HEADERS with END_STREAM for GET /, then
#                RST_STREAM CANCEL) every 5 ms, reading and discarding frames, and reconnects at
#                once whenever the proxy cuts it off (CVE-2023-44487, paced below per-read limits)
#   slow-upload  500 HTTP/1.1 clients each send POST /upload with Content-Length: 100000, then
#                one body byte a second; a client the proxy cuts off reconnects at once
#   big-uploads  the same with Content-Length: 2000000 (--big-body-bytes)
#   byte-bodies  500 HTTP/1.1 clients each send POST /upload with Content-Length: 100000, then
#                the body one byte per TCP segment (TCP_NODELAY, one send a byte), 10 bytes a
#                second each (--byte-rate); a client cut off reconnects at once
#   byte-bodies-h2  the same over h2c: HEADERS with content-length, then one DATA frame of one
#                byte per segment
#   admin-hold   on the management port (raahi's admin API; nginx stub_status and haproxy stats
#                on a port of their own), 500 connections send half a request head and stop and
#                500 send one keep-alive GET (raahi /healthz) and sit idle, for --hold-seconds;
#                nobody reconnects; counted: how many are still open at 10 s, 35 s, 65 s, the end
# During each attack a normal client sends one GET every 100 ms, each on a new connection of
# its own (h2c for rapid-reset and byte-bodies-h2, HTTP/1.1 otherwise; on the management port
# for admin-hold). Behind every proxy sits the same origin (scripts/edge/origin.py: asyncio
# HTTP/1.1, keep-alive, 200 "ok"), which counts the upstream connections it accepts and how many
# are open at once. The proxy's memory (RSS of its processes) is read at the start, every 250 ms,
# at the end of the attack and --settle-seconds after the clients left. Every run gets a fresh
# origin and a freshly started proxy. Proxies run one worker each, pinned to PROXY_CPU; the
# origin and the clients share LOADGEN_CPU. One markdown table per attack, proxies side by side.
#
# Usage: scripts/bench-edge.sh [options]    (as root on Debian 12; installs nginx haproxy curl
#                                           python3 when missing)
#   --raahi LABEL=BINARY   a raahi binary to run under LABEL (repeatable); without any, "raahi"
#                          is built from this checkout (cargo build --release --locked)
#   --proxies LIST         comma-separated labels, nginx, haproxy (default: every raahi, nginx,
#                          haproxy); the order of the table's columns and of the runs
#   --attacks LIST         of rapid-reset, slow-upload, big-uploads, byte-bodies, byte-bodies-h2,
#                          admin-hold (default rapid-reset,slow-upload)
#   --reset-seconds N      length of a rapid-reset run (default 30)
#   --upload-seconds N     length of a slow-upload or big-uploads run (default 40)
#   --uploaders N          slow uploaders, and byte-bodies clients (default 500)
#   --body-bytes N         the Content-Length they declare (default 100000)
#   --big-body-bytes N     the Content-Length big-uploads declare (default 2000000)
#   --byte-seconds N       length of a byte-bodies(-h2) run (default 30)
#   --byte-rate N          byte-bodies: body bytes (segments) a second per client (default 10)
#   --admin-clients N      admin-hold: connections of each kind (default 500)
#   --hold-seconds N       length of an admin-hold run (default 40)
#   --settle-seconds N     after the clients left, wait this long and read the memory (default 5)
#   --max-rss-mib N        end an attack early when the proxy's RSS passes this (default 4096)
#   --rounds N             runs of each attack and proxy, interleaved (default 1)
#   --origin-delay-ms N    the origin waits this long before answering (default 0)
#   --out FILE             keep the runs' JSON lines (scripts/edge/report.py prints them again)
# Environment: LOADGEN_CPU=0 PROXY_CPU=1 RAAHI_LOG=warn KEEP_TMP=1 (keep configs and logs).
# Raahi gets the same configuration whatever its version: one service with the origin as its
# only target and a catch-all route, created through the admin API, every limit at its default.
# NGINX gets client_max_body_size = --big-body-bytes for big-uploads (its 1m default answers 413).
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
EDGE=$SCRIPT_DIR/edge

log() { printf '[edge] %s\n' "$*" >&2; }
die() { printf '[edge] error: %s\n' "$*" >&2; exit 1; }

declare -A RAAHI_BINS=()
RAAHI_ORDER=()
PROXY_LIST=
ATTACK_LIST=rapid-reset,slow-upload
RESET_SECONDS=30
UPLOAD_SECONDS=40
UPLOADERS=500
BODY_BYTES=100000
BIG_BODY_BYTES=2000000
BYTE_SECONDS=30
BYTE_RATE=10
ADMIN_CLIENTS=500
HOLD_SECONDS=40
SETTLE_SECONDS=5
MAX_RSS_MIB=4096
ROUNDS=1
ORIGIN_DELAY_MS=0
OUT=
LOADGEN_CPU=${LOADGEN_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
RAAHI_LOG=${RAAHI_LOG:-warn}

while (($#)); do
    case $1 in
    --raahi)
        [[ ${2:-} == *=* ]] || die "--raahi wants LABEL=BINARY"
        label=${2%%=*} bin=${2#*=}
        [[ $label =~ ^[A-Za-z0-9._-]+$ && $label != nginx && $label != haproxy ]] || die "bad raahi label '$label'"
        [[ -x $bin ]] || die "$bin is not an executable file"
        RAAHI_BINS[$label]=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
        RAAHI_ORDER+=("$label")
        shift 2 ;;
    --proxies) PROXY_LIST=$2; shift 2 ;;
    --attacks) ATTACK_LIST=$2; shift 2 ;;
    --reset-seconds) RESET_SECONDS=$2; shift 2 ;;
    --upload-seconds) UPLOAD_SECONDS=$2; shift 2 ;;
    --uploaders) UPLOADERS=$2; shift 2 ;;
    --body-bytes) BODY_BYTES=$2; shift 2 ;;
    --big-body-bytes) BIG_BODY_BYTES=$2; shift 2 ;;
    --byte-seconds) BYTE_SECONDS=$2; shift 2 ;;
    --byte-rate) BYTE_RATE=$2; shift 2 ;;
    --admin-clients) ADMIN_CLIENTS=$2; shift 2 ;;
    --hold-seconds) HOLD_SECONDS=$2; shift 2 ;;
    --settle-seconds) SETTLE_SECONDS=$2; shift 2 ;;
    --max-rss-mib) MAX_RSS_MIB=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --origin-delay-ms) ORIGIN_DELAY_MS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
done
for var in RESET_SECONDS UPLOAD_SECONDS UPLOADERS BODY_BYTES BIG_BODY_BYTES BYTE_SECONDS \
    ADMIN_CLIENTS HOLD_SECONDS SETTLE_SECONDS MAX_RSS_MIB ROUNDS ORIGIN_DELAY_MS; do
    [[ ${!var} =~ ^[0-9]+$ ]] || die "$var must be a whole number, got '${!var}'"
done
if [[ ! $BYTE_RATE =~ ^[0-9]+(\.[0-9]+)?$ || $BYTE_RATE =~ ^0*(\.0*)?$ ]]; then
    die "--byte-rate must be a number above 0, got '$BYTE_RATE'"
fi
((RESET_SECONDS >= 1 && UPLOAD_SECONDS >= 1 && BYTE_SECONDS >= 1 && HOLD_SECONDS >= 1)) ||
    die "durations must be at least 1"
((UPLOADERS >= 1 && ADMIN_CLIENTS >= 1 && ROUNDS >= 1 && BODY_BYTES >= 1 && BIG_BODY_BYTES >= 1)) ||
    die "uploaders, admin clients, body sizes and rounds must be at least 1"
IFS=, read -r -a ATTACKS <<<"$ATTACK_LIST"
for attack in "${ATTACKS[@]}"; do
    [[ $attack =~ ^(rapid-reset|slow-upload|big-uploads|byte-bodies|byte-bodies-h2|admin-hold)$ ]] ||
        die "unknown attack '$attack'"
done

# ---------------------------------------------------------------------------------------------
# Tools

install_missing() {
    local missing=() cmd
    local -A package=([nginx]=nginx [haproxy]=haproxy [curl]=curl [python3]=python3 [taskset]=util-linux)
    for cmd in nginx haproxy curl python3 taskset; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("${package[$cmd]}")
    done
    ((${#missing[@]} == 0)) && return 0
    log "missing: ${missing[*]}; installing with apt-get"
    ((EUID == 0)) || die "installing packages needs root"
    # Keep the packages' init scripts from starting system-wide services.
    local policy=/usr/sbin/policy-rc.d made_policy=0 rc=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    fi
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${missing[@]}"; } >&2 || rc=$?
    ((made_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get failed (exit $rc)"
}

install_missing
taskset -c "$LOADGEN_CPU" true 2>/dev/null || die "cannot pin to LOADGEN_CPU=$LOADGEN_CPU"
taskset -c "$PROXY_CPU" true 2>/dev/null || die "cannot pin to PROXY_CPU=$PROXY_CPU"

# Without --raahi, "raahi" is this checkout's release build, built only when it is to run.
if ((${#RAAHI_ORDER[@]} == 0)) && [[ -z $PROXY_LIST || ,$PROXY_LIST, == *,raahi,* ]]; then
    cargo=$(command -v cargo || true)
    [[ -z $cargo && -x $HOME/.cargo/bin/cargo ]] && cargo=$HOME/.cargo/bin/cargo
    [[ -n $cargo ]] || die "cargo not found (install Rust, or pass --raahi LABEL=BINARY)"
    log "building raahi (cargo build --release --locked) in $REPO"
    (cd "$REPO" && "$cargo" build --release --locked >&2)
    bin=${CARGO_TARGET_DIR:-$REPO/target}/release/raahi
    [[ $bin == /* ]] || bin=$REPO/$bin
    [[ -x $bin ]] || die "build finished but $bin is missing"
    RAAHI_BINS[raahi]=$bin
    RAAHI_ORDER=(raahi)
fi
[[ -n $PROXY_LIST ]] || PROXY_LIST=$(IFS=,; echo "${RAAHI_ORDER[*]}${RAAHI_ORDER[*]:+,}nginx,haproxy")
IFS=, read -r -a PROXIES <<<"$PROXY_LIST"
for proxy in "${PROXIES[@]}"; do
    [[ $proxy == nginx || $proxy == haproxy || -n ${RAAHI_BINS[$proxy]:-} ]] ||
        die "unknown proxy '$proxy' (nginx, haproxy, or a --raahi label)"
done

# 500 uploaders hold a descriptor each in the client, and two in a proxy that streams uploads;
# admin-hold's 2 x 500 connections one each in the client and in the proxy.
fd_limit=$(ulimit -Hn)
[[ $fd_limit == unlimited ]] && fd_limit=1048576
((fd_limit >= 4 * UPLOADERS + 1024)) || die "the descriptor hard limit $fd_limit is too low for $UPLOADERS uploaders"
((fd_limit >= 4 * ADMIN_CLIENTS + 1024)) || die "the descriptor hard limit $fd_limit is too low for $ADMIN_CLIENTS admin clients"
ulimit -n "$fd_limit"

# ---------------------------------------------------------------------------------------------
# Processes, ports, cleanup

WORK=$(mktemp -d /tmp/raahi-edge.XXXXXX)
chmod 755 "$WORK" # nginx workers run as an unprivileged user
RESULTS=$WORK/results.jsonl
: >"$RESULTS"
PIDS=()  # live processes started by this script
PORTS=() # ports handed out

descendants() {
    local file child
    for file in /proc/"$1"/task/*/children; do
        [[ -r $file ]] || continue
        for child in $(<"$file"); do echo "$child"; descendants "$child"; done
    done 2>/dev/null
}

stop_pid() { # PID: TERM, then KILL what is left of its tree after 10 s
    local pid=$1 all=("$1") child deadline
    while read -r child; do all+=("$child"); done < <(descendants "$pid")
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    for child in "${all[@]}"; do
        while kill -0 "$child" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.05; done
        kill -KILL "$child" 2>/dev/null || true
    done
    wait "$pid" 2>/dev/null || true
    local keep=() p
    for p in "${PIDS[@]}"; do [[ $p == "$pid" ]] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}

cleanup() {
    local rc=$? pid
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
    if [[ -n ${KEEP_TMP:-} ]]; then log "kept $WORK"; else rm -rf "$WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { # sets FREE_PORT: one no socket uses, below the ephemeral range
    local port hex tries
    for ((tries = 0; tries < 500; tries++)); do
        port=$((20000 + RANDOM % 12000))
        [[ " ${PORTS[*]} " == *" $port "* ]] && continue
        hex=$(printf '%04X' "$port")
        grep -qE "^ *[0-9]+: [0-9A-F]+:$hex " /proc/net/tcp /proc/net/tcp6 2>/dev/null && continue
        PORTS+=("$port")
        FREE_PORT=$port
        return 0
    done
    die "no free port found"
}

start() { # CPU LOG COMMAND...: starts COMMAND pinned to CPU in the background; sets STARTED_PID
    local cpu=$1 logfile=$2
    shift 2
    taskset -c "$cpu" "$@" >"$logfile" 2>&1 </dev/null &
    STARTED_PID=$!
    PIDS+=("$STARTED_PID")
}

wait_200() { # WHAT PID URL [curl options...]: until URL answers 200 (30 s)
    local what=$1 pid=$2 url=$3 deadline=$((SECONDS + 30))
    shift 3
    until [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 --noproxy '*' "$@" "$url" 2>/dev/null) == 200 ]]; do
        kill -0 "$pid" 2>/dev/null || die "$what exited (see its log under $WORK)"
        ((SECONDS < deadline)) || die "$what did not answer 200 on $url within 30 s"
        sleep 0.1
    done
}

render() { # TEMPLATE OUT KEY=VALUE...
    local template=$1 out=$2 text pair
    shift 2
    text=$(<"$template")
    for pair in "$@"; do text=${text//@${pair%%=*}@/${pair#*=}}; done
    [[ $text == *@[A-Z]*@* ]] && die "unfilled placeholder in $out"
    printf '%s\n' "$text" >"$out"
}

# ---------------------------------------------------------------------------------------------
# One run

ORIGIN_PID='' PROXY_PID='' HTTP_PORT='' H2C_PORT='' ADMIN_PORT='' ADMIN_PATH='' ORIGIN_PORT='' STATS_PORT=''

start_origin() { # DIR
    free_port && ORIGIN_PORT=$FREE_PORT
    free_port && STATS_PORT=$FREE_PORT
    start "$LOADGEN_CPU" "$1/origin.log" python3 "$EDGE/origin.py" --port "$ORIGIN_PORT" \
        --stats-port "$STATS_PORT" --delay-ms "$ORIGIN_DELAY_MS"
    ORIGIN_PID=$STARTED_PID
    wait_200 origin "$ORIGIN_PID" "http://127.0.0.1:$ORIGIN_PORT/"
}

start_nginx() { # DIR ATTACK
    local max_body=1m # nginx's default
    [[ $2 == big-uploads ]] && max_body=$BIG_BODY_BYTES
    free_port && HTTP_PORT=$FREE_PORT
    free_port && H2C_PORT=$FREE_PORT
    free_port && ADMIN_PORT=$FREE_PORT
    ADMIN_PATH=/
    render "$EDGE/nginx.conf.tmpl" "$1/nginx.conf" DIR="$1" PORT="$HTTP_PORT" H2C_PORT="$H2C_PORT" \
        ADMIN_PORT="$ADMIN_PORT" ORIGIN="$ORIGIN_PORT" MAX_BODY="$max_body"
    start "$PROXY_CPU" "$1/stderr.log" nginx -p "$1/" -e "$1/error.log" -c "$1/nginx.conf"
    PROXY_PID=$STARTED_PID
}

start_haproxy() { # DIR
    free_port && HTTP_PORT=$FREE_PORT
    free_port && H2C_PORT=$FREE_PORT
    free_port && ADMIN_PORT=$FREE_PORT
    ADMIN_PATH=/
    render "$EDGE/haproxy.cfg.tmpl" "$1/haproxy.cfg" PORT="$HTTP_PORT" H2C_PORT="$H2C_PORT" \
        ADMIN_PORT="$ADMIN_PORT" ORIGIN="$ORIGIN_PORT"
    haproxy -c -q -f "$1/haproxy.cfg" >&2 || die "haproxy rejects $1/haproxy.cfg"
    start "$PROXY_CPU" "$1/stderr.log" haproxy -db -f "$1/haproxy.cfg"
    PROXY_PID=$STARTED_PID
}

start_raahi() { # DIR BINARY
    local dir=$1 bin=$2 admin_port token admin body status
    free_port && HTTP_PORT=$FREE_PORT
    H2C_PORT=$HTTP_PORT # h2c prior knowledge and HTTP/1.1 share raahi's plain listener
    free_port && admin_port=$FREE_PORT
    ADMIN_PORT=$admin_port ADMIN_PATH=/healthz
    token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    # from the run's own directory, so no config/raahi.toml is picked up
    (cd "$dir" && exec env -u RAAHI_CONFIG -u RAAHI_PROXY_CLIENT_HEADER_TIMEOUT_MS \
        RAAHI_PROXY_LISTEN="127.0.0.1:$HTTP_PORT" RAAHI_ADMIN_LISTEN="127.0.0.1:$admin_port" \
        RAAHI_ADMIN_TOKEN="$token" RAAHI_DATABASE_URL="sqlite://$dir/raahi.db" \
        RAAHI_PROXY_SHUTDOWN_GRACE_MS=1000 RAAHI_LOG_FORMAT=text RUST_LOG="$RAAHI_LOG" \
        TOKIO_WORKER_THREADS=1 taskset -c "$PROXY_CPU" "$bin" serve) >"$dir/raahi.log" 2>&1 </dev/null &
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    admin=http://127.0.0.1:$admin_port
    wait_200 "raahi admin API" "$PROXY_PID" "$admin/healthz"
    post() { # PATH JSON: prints the response body
        body=$dir/response.json
        status=$(curl -s -o "$body" -w '%{http_code}' --max-time 10 --noproxy '*' \
            -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
            -X POST --data "$2" "$admin$1") || die "POST $1: curl failed"
        [[ $status == 2?? ]] || die "POST $1 $2: HTTP $status: $(cat "$body")"
        cat "$body"
    }
    local id
    id=$(post /api/v1/services '{"name":"edge"}' | grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$')
    [[ -n $id ]] || die "no id in raahi's service creation response"
    post "/api/v1/services/$id/targets" "{\"host\":\"127.0.0.1\",\"port\":$ORIGIN_PORT}" >/dev/null
    post /api/v1/routes "{\"name\":\"all\",\"service_id\":$id}" >/dev/null
}

proxy_version() {
    case $1 in
    nginx) nginx -v 2>&1 | sed 's/^nginx version: //' ;;
    haproxy) haproxy -v 2>&1 | head -n 1 ;;
    *) echo "raahi $("${RAAHI_BINS[$1]}" --version 2>/dev/null | awk '{print $NF}') (${RAAHI_BINS[$1]})" ;;
    esac
}

run_one() { # ATTACK PROXY ROUND
    local attack=$1 proxy=$2 round=$3 dir=$WORK/$1-$2-$3 seconds port
    mkdir -p "$dir"
    chmod 755 "$dir"
    start_origin "$dir"
    case $proxy in
    nginx) start_nginx "$dir" "$attack" ;;
    haproxy) start_haproxy "$dir" ;;
    *) start_raahi "$dir" "${RAAHI_BINS[$proxy]}" ;;
    esac
    wait_200 "$proxy" "$PROXY_PID" "http://127.0.0.1:$HTTP_PORT/"
    wait_200 "$proxy (h2c)" "$PROXY_PID" "http://127.0.0.1:$H2C_PORT/" --http2-prior-knowledge
    wait_200 "$proxy (management port)" "$PROXY_PID" "http://127.0.0.1:$ADMIN_PORT$ADMIN_PATH"
    sleep 1
    local body_bytes=$BODY_BYTES extra=()
    case $attack in
    rapid-reset) seconds=$RESET_SECONDS port=$H2C_PORT ;;
    slow-upload) seconds=$UPLOAD_SECONDS port=$HTTP_PORT ;;
    big-uploads) seconds=$UPLOAD_SECONDS port=$HTTP_PORT body_bytes=$BIG_BODY_BYTES ;;
    byte-bodies) seconds=$BYTE_SECONDS port=$HTTP_PORT extra=(--byte-rate "$BYTE_RATE") ;;
    byte-bodies-h2) seconds=$BYTE_SECONDS port=$H2C_PORT extra=(--byte-rate "$BYTE_RATE") ;;
    admin-hold) seconds=$HOLD_SECONDS port=$ADMIN_PORT extra=(--path "$ADMIN_PATH" --clients "$ADMIN_CLIENTS") ;;
    esac
    log "round $round: $attack against $proxy for ${seconds}s (port $port)"
    local rc=0
    taskset -c "$LOADGEN_CPU" python3 "$EDGE/attack.py" "$attack" --port "$port" \
        --origin-stats "$STATS_PORT" --seconds "$seconds" --label "$proxy" --proxy-pid "$PROXY_PID" \
        --uploaders "$UPLOADERS" --body-bytes "$body_bytes" --settle-seconds "$SETTLE_SECONDS" \
        --max-rss-mib "$MAX_RSS_MIB" "${extra[@]}" >"$dir/result.json" 2>"$dir/attack.log" || rc=$?
    ((rc == 0)) || { cat "$dir/attack.log" >&2; die "the $attack client failed against $proxy (exit $rc)"; }
    kill -0 "$PROXY_PID" 2>/dev/null || log "warning: $proxy exited during the run"
    cat "$dir/result.json" >>"$RESULTS"
    python3 "$EDGE/report.py" --brief "$dir/result.json" >&2
    stop_pid "$PROXY_PID"
    stop_pid "$ORIGIN_PID"
    sleep 2
}

# ---------------------------------------------------------------------------------------------
# Main

echo "== raahi edge benchmark ($(date -u '+%Y-%m-%d %H:%M:%SZ'), $(uname -r))"
echo "machine: $(nproc) CPUs, $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)," \
    "load average $(cut -d' ' -f1-3 /proc/loadavg) at start; proxy on CPU $PROXY_CPU, origin and clients on CPU $LOADGEN_CPU"
for proxy in "${PROXIES[@]}"; do echo "$proxy: $(proxy_version "$proxy")"; done
echo "python: $(python3 --version 2>&1); origin delay ${ORIGIN_DELAY_MS} ms; attacks ${ATTACKS[*]}; $ROUNDS round(s)"
echo "rapid reset ${RESET_SECONDS}s; slow uploads ${UPLOAD_SECONDS}s x $UPLOADERS (Content-Length $BODY_BYTES; big $BIG_BODY_BYTES);" \
    "byte bodies ${BYTE_SECONDS}s x $UPLOADERS at $BYTE_RATE B/s; admin hold ${HOLD_SECONDS}s x 2 x $ADMIN_CLIENTS;" \
    "memory read ${SETTLE_SECONDS}s after the clients left, attacks end at $MAX_RSS_MIB MiB"
echo

for ((round = 1; round <= ROUNDS; round++)); do
    for attack in "${ATTACKS[@]}"; do
        # the first proxy changes each round
        for ((i = 0; i < ${#PROXIES[@]}; i++)); do
            run_one "$attack" "${PROXIES[$(((i + round - 1) % ${#PROXIES[@]}))]}" "$round"
        done
    done
done

[[ -n $OUT ]] && cp "$RESULTS" "$OUT"
# columns in the order given, whatever order the rounds ran in
python3 - "$RESULTS" "${PROXIES[@]}" >"$WORK/ordered.jsonl" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
order = sys.argv[2:]
for r in sorted(runs, key=lambda r: order.index(r["proxy"])):
    print(json.dumps(r))
PY
python3 "$EDGE/report.py" "$WORK/ordered.jsonl"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
