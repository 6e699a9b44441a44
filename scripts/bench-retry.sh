#!/usr/bin/env bash
# Retries that cannot storm (issue 36): raahi's route retries against HAProxy's `retries` and
# NGINX's `proxy_next_upstream`, on loopback.
#
# Behind every proxy sit $TARGETS targets (scripts/bench/retry_upstream.py: asyncio HTTP/1.1,
# keep-alive), each counting the requests it receives, so upstream attempts per client request
# are exact. The load is h2load at a fixed rate: one client, HTTP/2 with prior knowledge,
# --rps $RATE with up to $STREAMS streams at once (a stalled request holds one stream, not the
# client; h2load's --rps over HTTP/1.1 would fire every connection's request at the same instant
# and queue behind a stalled one). Every run gets fresh targets and a freshly started proxy
# (no health or budget state carried over). Proxies: one worker each, pinned to PROXY_CPU; the
# targets and h2load share LOADGEN_CPU.
#
# Scenarios (SCENARIOS, in this order by default):
#   outage  every target answers 503, $OUTAGE_SECONDS s: upstream attempts per client request,
#           over the whole run and after the first 10 s (the budget's window full)
#   half    the first half of the targets answer 503, the others 200, $HALF_SECONDS s: share of
#           client requests answered 2xx after the first second
#   stall   every target answers each request at once, except that with a chance of 1 in 100
#           (seeded per target: the same draws every run, independent between targets) it
#           answers after 2 s, $STALL_SECONDS s: client p50/p99 and the extra upstream
#           requests. First a calibration run per proxy with every target answering at once
#           ($CALIBRATE_SECONDS s); raahi's hedge_after_ms is its p95 rounded up to a whole ms
#           (HEDGE_AFTER_MS sets it instead; with ROUNDS > 1, the first round's calibration).
#           HAProxy and NGINX have no hedging: they run plain.
# Configuration:
#   raahi    route retry {"attempts": 3, "on": ["gateway_error", "connect_failure", "reset"]}
#            (outage, half), {"attempts": 2, "hedge_after_ms": H} (stall); the default budget
#            (20 %, 10/s) and the service's default passive ejection (5 failures in 30 s)
#   haproxy  retries 2, retry-on 503 conn-failure, option redispatch 1 (every retry to another
#            server), balance roundrobin, http-reuse always
#   nginx    proxy_next_upstream error timeout http_503, proxy_next_upstream_tries 3, round
#            robin, keepalive; server max_fails/fail_timeout nginx's defaults (1, 10 s) unless
#            NGINX_MAX_FAILS is set: a failed attempt takes its server out for 10 s, and with
#            every server out nginx answers 502 at once ("no live upstreams")
#   nginx-nofail  the same with max_fails=0 (never takes a server out): the plain
#            three-attempt policy; outage and half only (stall has no failures to count)
#
# Usage: scripts/bench-retry.sh   (as root on Debian 12; installs nginx haproxy nghttp2-client
#                                  curl python3 when missing; builds target/release/raahi)
# Environment:
#   RATE=1000             client requests per second
#   STREAMS=100           h2load -m: streams at once on its connection
#   TARGETS=4             targets behind each proxy (half: the first TARGETS/2 answer 503)
#   OUTAGE_SECONDS=18 HALF_SECONDS=10 STALL_SECONDS=16 CALIBRATE_SECONDS=6
#   SCENARIOS="outage half stall"
#   ROUNDS=1              rounds of every scenario (the proxy that goes first rotates); the
#                         tables list every run, "#N" naming its round when ROUNDS > 1
#   PROXIES="raahi haproxy nginx nginx-nofail"
#   HEDGE_AFTER_MS=       raahi's hedge_after_ms in stall (empty: from the calibration; none:
#                         no hedging, raahi measured plain like the others)
#   NGINX_MAX_FAILS=      nginx `server ... max_fails=N` (empty: nginx's default, 1 in 10 s)
#   LOADGEN_CPU=0 PROXY_CPU=1
#   RAAHI_LOG=warn        RUST_LOG for raahi
#   RAAHI_BIN=...         use this raahi binary instead of building target/release/raahi
#   OUT=FILE              keep the JSON lines of the runs (retry_report.py table FILE prints them)
#   KEEP_TMP=1            keep the temporary directory (configs, logs, h2load output)
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
BENCH=$SCRIPT_DIR/bench

RATE=${RATE:-1000}
STREAMS=${STREAMS:-100}
TARGETS=${TARGETS:-4}
OUTAGE_SECONDS=${OUTAGE_SECONDS:-18}
HALF_SECONDS=${HALF_SECONDS:-10}
STALL_SECONDS=${STALL_SECONDS:-16}
CALIBRATE_SECONDS=${CALIBRATE_SECONDS:-6}
ROUNDS=${ROUNDS:-1}
HEDGE_AFTER_MS=${HEDGE_AFTER_MS:-}
NGINX_MAX_FAILS=${NGINX_MAX_FAILS:-}
LOADGEN_CPU=${LOADGEN_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
RAAHI_LOG=${RAAHI_LOG:-warn}
read -r -a SCENARIO_LIST <<<"${SCENARIOS:-outage half stall}"
read -r -a PROXY_LIST <<<"${PROXIES:-raahi haproxy nginx nginx-nofail}"

log() { printf '[bench-retry] %s\n' "$*" >&2; }
die() { printf '[bench-retry] error: %s\n' "$*" >&2; exit 1; }

for var in RATE STREAMS TARGETS OUTAGE_SECONDS HALF_SECONDS STALL_SECONDS CALIBRATE_SECONDS ROUNDS; do
    [[ ${!var} =~ ^[0-9]+$ ]] || die "$var must be a whole number, got '${!var}'"
done
[[ -z $HEDGE_AFTER_MS || $HEDGE_AFTER_MS =~ ^([0-9]+|none)$ ]] || die "HEDGE_AFTER_MS must be a whole number or none"
[[ -z $NGINX_MAX_FAILS || $NGINX_MAX_FAILS =~ ^[0-9]+$ ]] || die "NGINX_MAX_FAILS must be a whole number"
((RATE >= 1 && STREAMS >= 1 && ROUNDS >= 1 && TARGETS >= 2)) ||
    die "RATE, STREAMS and ROUNDS must be at least 1, TARGETS at least 2"
((OUTAGE_SECONDS >= 12)) || die "OUTAGE_SECONDS must be at least 12 (the budget's 10 s window, then measured seconds)"
((HALF_SECONDS >= 3 && STALL_SECONDS >= 6 && CALIBRATE_SECONDS >= 5)) ||
    die "HALF_SECONDS must be at least 3, STALL_SECONDS at least 6, CALIBRATE_SECONDS at least 5"
for scenario in "${SCENARIO_LIST[@]}"; do
    [[ $scenario =~ ^(outage|half|stall)$ ]] || die "unknown scenario '$scenario' (outage half stall)"
done
for proxy in "${PROXY_LIST[@]}"; do
    [[ $proxy =~ ^(raahi|haproxy|nginx|nginx-nofail)$ ]] || die "unknown proxy '$proxy' (raahi haproxy nginx nginx-nofail)"
done
((${#SCENARIO_LIST[@]} && ${#PROXY_LIST[@]})) || die "SCENARIOS and PROXIES must not be empty"
with_raahi=0
[[ " ${PROXY_LIST[*]} " == *" raahi "* ]] && with_raahi=1

# ---------------------------------------------------------------------------------------------
# Tools

install_missing() {
    local missing=() cmd
    local -A package=([nginx]=nginx [haproxy]=haproxy [h2load]=nghttp2-client [curl]=curl
        [python3]=python3 [taskset]=util-linux)
    for cmd in nginx haproxy h2load curl python3 taskset; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("${package[$cmd]}")
    done
    ((${#missing[@]} == 0)) && return 0
    log "missing: ${missing[*]}; installing with apt-get"
    ((EUID == 0)) || die "installing packages needs root"
    # keep the packages' init scripts from starting system-wide nginx/haproxy services
    local policy=/usr/sbin/policy-rc.d made_policy=0 rc=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    fi
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${missing[@]}"; } >&2 || rc=$?
    ((made_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get failed (exit $rc)"
}

build_raahi() {
    ((with_raahi)) || return 0
    if [[ -n ${RAAHI_BIN:-} ]]; then
        [[ -x $RAAHI_BIN ]] || die "RAAHI_BIN=$RAAHI_BIN is not an executable file"
        RAAHI_BIN=$(cd "$(dirname "$RAAHI_BIN")" && pwd)/$(basename "$RAAHI_BIN")
        return 0
    fi
    local cargo
    cargo=$(command -v cargo || true)
    [[ -z $cargo && -x $HOME/.cargo/bin/cargo ]] && cargo=$HOME/.cargo/bin/cargo
    [[ -n $cargo ]] || die "cargo not found (install Rust, or set RAAHI_BIN)"
    log "building raahi (cargo build --release) in $REPO"
    (cd "$REPO" && "$cargo" build --release >&2)
    RAAHI_BIN=${CARGO_TARGET_DIR:-$REPO/target}/release/raahi
    [[ $RAAHI_BIN == /* ]] || RAAHI_BIN=$REPO/$RAAHI_BIN
    [[ -x $RAAHI_BIN ]] || die "build finished but $RAAHI_BIN is missing"
}

install_missing
build_raahi
taskset -c "$LOADGEN_CPU" true 2>/dev/null || die "cannot pin to LOADGEN_CPU=$LOADGEN_CPU"
taskset -c "$PROXY_CPU" true 2>/dev/null || die "cannot pin to PROXY_CPU=$PROXY_CPU"

# ---------------------------------------------------------------------------------------------
# Processes and cleanup

WORK=$(mktemp -d /tmp/raahi-bench-retry.XXXXXX)
chmod 755 "$WORK"
RESULTS=$WORK/results.jsonl
: >"$RESULTS"
PIDS=()  # every process this script started and has not stopped yet
PORTS=() # every port handed out

stop_pids() { # PID...: TERM, up to 5 s, then KILL; forgets them
    local pid deadline=$((SECONDS + 5)) keep=() p
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "$@"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.05; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    for p in "${PIDS[@]}"; do [[ " $* " == *" $p "* ]] || keep+=("$p"); done
    PIDS=(${keep[@]+"${keep[@]}"})
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    ((${#PIDS[@]})) && stop_pids "${PIDS[@]}"
    if [[ -n ${OUT:-} && -s $RESULTS ]]; then cp "$RESULTS" "$OUT" && log "results kept in $OUT"; fi
    if [[ -n ${KEEP_TMP:-} ]]; then log "kept $WORK"; else rm -rf "$WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { # sets FREE_PORT to a port no local socket uses and not handed out already
    local port hex tries
    for ((tries = 0; tries < 500; tries++)); do
        port=$((20000 + RANDOM % 12000)) # below the usual ephemeral range
        [[ " ${PORTS[*]} " == *" $port "* ]] && continue
        hex=$(printf '%04X' "$port")
        grep -qE "^ *[0-9]+: [0-9A-F]+:$hex " /proc/net/tcp /proc/net/tcp6 2>/dev/null && continue
        PORTS+=("$port")
        FREE_PORT=$port
        return 0
    done
    die "no free port found"
}

start() { # CPU LOGFILE CMD...: starts CMD pinned to CPU, stdout and stderr to LOGFILE; sets STARTED_PID
    local cpu=$1 out=$2
    shift 2
    taskset -c "$cpu" "$@" >"$out" 2>&1 </dev/null &
    STARTED_PID=$!
    PIDS+=("$STARTED_PID")
}

http_status() { # URL [CURL OPTION...]: the HTTP status of a GET (000 when none)
    local url=$1
    shift
    curl -s -o /dev/null -w '%{http_code}' --max-time 3 --noproxy '*' "$@" "$url" 2>/dev/null || true
}

# wait_for NAME PID URL PATTERN SECONDS LOGFILE [CURL OPTION...]: polls URL until its status
# matches PATTERN (a regex); dies with the tail of LOGFILE when PID exits or time runs out
wait_for() {
    local name=$1 pid=$2 url=$3 pattern=$4 deadline=$((SECONDS + $5)) logfile=$6 status
    shift 6
    while :; do
        status=$(http_status "$url" "$@")
        [[ $status =~ ^($pattern)$ ]] && return 0
        if ! kill -0 "$pid" 2>/dev/null || ((SECONDS >= deadline)); then
            [[ -s $logfile ]] && { log "--- tail of $logfile"; tail -n 20 "$logfile" >&2; }
            die "$name: $url answers '$status' (wanted $pattern)$(kill -0 "$pid" 2>/dev/null || echo '; it exited')"
        fi
        sleep 0.1
    done
}

# ---------------------------------------------------------------------------------------------
# Targets

UP_PORTS=() UP_PIDS=()

start_targets() { # DIR MODE...: one target per MODE; sets UP_PORTS and UP_PIDS
    local dir=$1 mode i=0
    shift
    UP_PORTS=() UP_PIDS=()
    for mode in "$@"; do
        i=$((i + 1))
        free_port
        start "$LOADGEN_CPU" "$dir/target$i.log" python3 "$BENCH/retry_upstream.py" \
            --port "$FREE_PORT" --mode "$mode" --name "u$i"
        UP_PORTS+=("$FREE_PORT") UP_PIDS+=("$STARTED_PID")
    done
    i=0
    for mode in "$@"; do
        wait_for "target u$((i + 1))" "${UP_PIDS[$i]}" "http://127.0.0.1:${UP_PORTS[$i]}/__hits" 200 20 \
            "$dir/target$((i + 1)).log"
        i=$((i + 1))
    done
}

read_hits() { # DIR WHEN: each target's counters to DIR/hits-WHEN-N.json
    local i
    for i in "${!UP_PORTS[@]}"; do
        curl -sf --max-time 5 --noproxy '*' -o "$1/hits-$2-$((i + 1)).json" \
            "http://127.0.0.1:${UP_PORTS[$i]}/__hits" || die "cannot read the hits of target u$((i + 1))"
    done
}

# ---------------------------------------------------------------------------------------------
# Proxies: start_PROXY DIR RETRY_JSON sets PROXY_URL, PROXY_PID and PROXY_LOG

start_nginx() { # DIR RETRY_JSON [MAX_FAILS]
    local dir=$1 max_fails=${3:-$NGINX_MAX_FAILS} port p servers=''
    free_port && port=$FREE_PORT
    for p in "${UP_PORTS[@]}"; do
        servers+="        server 127.0.0.1:$p${max_fails:+ max_fails=$max_fails};"$'\n'
    done
    cat >"$dir/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $dir/client_body;
    proxy_temp_path $dir/proxy;
    fastcgi_temp_path $dir/fastcgi;
    uwsgi_temp_path $dir/uwsgi;
    scgi_temp_path $dir/scgi;
    keepalive_timeout 120s;
    keepalive_requests 100000000;
    http2_max_concurrent_streams 1024;
    upstream retry {
$servers        keepalive 256;
        keepalive_requests 100000000;
        keepalive_timeout 120s;
    }
    server {
        listen 127.0.0.1:$port http2 backlog=4096;
        location / {
            proxy_pass http://retry;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_next_upstream error timeout http_503;
            proxy_next_upstream_tries 3;
        }
    }
}
EOF
    nginx -t -q -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf" >&2 || die "nginx rejects $dir/nginx.conf"
    start "$PROXY_CPU" "$dir/stderr.log" nginx -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf"
    PROXY_PID=$STARTED_PID PROXY_URL=http://127.0.0.1:$port/ PROXY_LOG=$dir/error.log
}

start_nginx-nofail() { start_nginx "$1" "$2" 0; }

start_haproxy() {
    local dir=$1 port i
    free_port && port=$FREE_PORT
    {
        cat <<EOF
global
    nbthread 1
    maxconn 4096
defaults
    mode http
    option http-keep-alive
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 120s
frontend retry_in
    bind 127.0.0.1:$port proto h2
    default_backend retry
backend retry
    balance roundrobin
    http-reuse always
    retries 2
    retry-on 503 conn-failure
    option redispatch 1
EOF
        for i in "${!UP_PORTS[@]}"; do echo "    server u$((i + 1)) 127.0.0.1:${UP_PORTS[$i]}"; done
    } >"$dir/haproxy.cfg"
    haproxy -c -q -f "$dir/haproxy.cfg" >&2 || die "haproxy rejects $dir/haproxy.cfg"
    start "$PROXY_CPU" "$dir/stderr.log" haproxy -db -f "$dir/haproxy.cfg"
    PROXY_PID=$STARTED_PID PROXY_URL=http://127.0.0.1:$port/ PROXY_LOG=$dir/stderr.log
}

RAAHI_ADMIN='' RAAHI_TOKEN=''

admin_post() { # PATH JSON: POSTs to raahi's admin API, prints the response body; dies unless 2xx
    local body=$WORK/admin-response.json status
    status=$(curl -s -o "$body" -w '%{http_code}' --max-time 10 --noproxy '*' \
        -H "Authorization: Bearer $RAAHI_TOKEN" -H 'Content-Type: application/json' \
        -X POST --data "$2" "$RAAHI_ADMIN$1") || die "POST $1: curl failed"
    [[ $status == 2?? ]] || die "POST $1 $2: HTTP $status: $(cat "$body")"
    cat "$body"
}
json_id() { grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$'; }

start_raahi() {
    local dir=$1 retry=$2 port admin_port service_id p
    free_port && port=$FREE_PORT
    free_port && admin_port=$FREE_PORT
    RAAHI_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    RAAHI_ADMIN=http://127.0.0.1:$admin_port
    # from the run's directory (env -C), so the checkout's config/raahi.toml is not picked up
    start "$PROXY_CPU" "$dir/raahi.log" env -C "$dir" -u RAAHI_CONFIG \
        RAAHI_PROXY_LISTEN="127.0.0.1:$port" RAAHI_ADMIN_LISTEN="127.0.0.1:$admin_port" \
        RAAHI_DATABASE_URL="sqlite://$dir/raahi.db" RAAHI_ADMIN_TOKEN="$RAAHI_TOKEN" \
        RUST_LOG="$RAAHI_LOG" TOKIO_WORKER_THREADS=1 "$RAAHI_BIN" serve
    PROXY_PID=$STARTED_PID PROXY_URL=http://127.0.0.1:$port/ PROXY_LOG=$dir/raahi.log
    wait_for "raahi admin API" "$PROXY_PID" "$RAAHI_ADMIN/healthz" 200 60 "$PROXY_LOG"
    service_id=$(admin_post /api/v1/services '{"name":"bench"}' | json_id)
    [[ -n $service_id ]] || die "raahi: no id in the service creation response"
    for p in "${UP_PORTS[@]}"; do
        admin_post "/api/v1/services/$service_id/targets" "{\"host\":\"127.0.0.1\",\"port\":$p}" >/dev/null
    done
    admin_post /api/v1/routes "{\"name\":\"all\",\"service_id\":$service_id,\"retry\":$retry}" >"$dir/route.json"
}

raahi_metrics() { # FILE: raahi's retry, budget, hedge and ejection counters
    curl -s --max-time 5 --noproxy '*' -H "Authorization: Bearer $RAAHI_TOKEN" "$RAAHI_ADMIN/metrics" |
        grep -E '^raahi_(retr|hedge|eject|outlier)[a-z_]*(\{| )' | grep -v ' 0$' >"$1" || true
}

# ---------------------------------------------------------------------------------------------
# One run: fresh targets, a fresh proxy, the fixed-rate load, the counts

RETRY_STATUS='{"attempts": 3, "on": ["gateway_error", "connect_failure", "reset"]}'

# run NAME PROXY SECONDS SKIP TAIL RETRY_JSON MODE...: appends the run's JSON line to RESULTS
run() {
    local name=$1 proxy=$2 seconds=$3 skip=$4 tail=$5 retry=$6 dir settle=1 status
    shift 6
    dir=$WORK/$name-$proxy-$ROUND
    mkdir -p "$dir"
    start_targets "$dir" "$@"
    "start_$proxy" "$dir" "$retry"
    # the route is live once the proxy answers anything but 404 (raahi: no route yet) through it
    wait_for "$proxy" "$PROXY_PID" "$PROXY_URL" '[1-35][0-9][0-9]' 30 "$PROXY_LOG" --http2-prior-knowledge
    # probes and set-up requests are not counted: the counters are read after them
    read_hits "$dir" before
    log "round $ROUND, $name, $proxy: ${seconds}s at $RATE requests/s"
    taskset -c "$LOADGEN_CPU" h2load -c1 -m"$STREAMS" --rps "$RATE" -D "$seconds" \
        --log-file="$dir/requests.log" "$PROXY_URL" >"$dir/h2load.txt" 2>&1 </dev/null || {
        tail -n 5 "$dir/h2load.txt" >&2
        die "h2load failed against $proxy"
    }
    # attempts still in flight (a stalled one, a hedge) reach the targets before the count
    [[ $name == stall ]] && settle=3
    sleep "$settle"
    read_hits "$dir" after
    [[ $proxy == raahi ]] && raahi_metrics "$dir/metrics.txt"
    status=$(http_status "$PROXY_URL" --http2-prior-knowledge)
    stop_pids "$PROXY_PID" "${UP_PIDS[@]}"
    [[ $status == 000 ]] && log "warning: $proxy did not answer after the run"
    python3 "$BENCH/retry_report.py" run --scenario "$name" --proxy "$proxy" --round "$ROUND" \
        --dir "$dir" --skip "$skip" --tail "$tail" >>"$RESULTS" || die "no figures for $name, $proxy"
    python3 - "$RESULTS" >&2 <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][-1]
w = r["window"]
print(f"[bench-retry]   {r['requests']} requests at {r['rate']}/s, {r['upstream_hits']} attempts "
      f"({r['attempts_per_request']}/request; window {w['attempts_per_request']}), "
      f"success {100 * r['success']:.3f} % (after 1 s {100 * r['success_after_1s']:.3f} %), "
      f"p50 {w['p50_ms']} ms p99 {w['p99_ms']} ms, statuses {r['statuses']}")
PY
    for f in "$dir"/error.log "$dir"/stderr.log "$dir"/raahi.log; do
        [[ -s $f ]] && grep -qE 'WARN|ERROR|\[alert\]|\[emerg\]|\[crit\]' "$f" &&
            log "  $(basename "$f") of $proxy: $(grep -cE 'WARN|ERROR|\[alert\]|\[emerg\]|\[crit\]' "$f") warning/error line(s), first: $(grep -m1 -E 'WARN|ERROR|\[alert\]|\[emerg\]|\[crit\]' "$f" | cut -c1-200)"
    done
    return 0
}

modes() { # N MODE: MODE N times
    local i
    for ((i = 0; i < $1; i++)); do printf '%s\n' "$2"; done
}

# hedge_after_ms from the first round's calibration of raahi, unless HEDGE_AFTER_MS is set
hedge_from_calibration() {
    python3 -c '
import json, math, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["scenario"] == "calibrate" and r["proxy"] == "raahi":
        print(max(1, math.ceil(r["window"]["p95_ms"])))
        break' "$RESULTS"
}

for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    # the proxy that goes first changes each round, so none always follows the same one
    order=()
    for ((i = 0; i < ${#PROXY_LIST[@]}; i++)); do
        order+=("${PROXY_LIST[$(((i + ROUND - 1) % ${#PROXY_LIST[@]}))]}")
    done
    for scenario in "${SCENARIO_LIST[@]}"; do
        case $scenario in
        outage)
            mapfile -t target_modes < <(modes "$TARGETS" 503)
            for proxy in "${order[@]}"; do
                run outage "$proxy" "$OUTAGE_SECONDS" 10 1 "$RETRY_STATUS" "${target_modes[@]}"
            done
            ;;
        half)
            mapfile -t target_modes < <(modes $((TARGETS / 2)) 503; modes $((TARGETS - TARGETS / 2)) ok)
            for proxy in "${order[@]}"; do
                run half "$proxy" "$HALF_SECONDS" 0 1 "$RETRY_STATUS" "${target_modes[@]}"
            done
            ;;
        stall)
            mapfile -t target_modes < <(modes "$TARGETS" ok)
            for proxy in "${order[@]}"; do
                [[ $proxy == nginx-nofail ]] && continue
                run calibrate "$proxy" "$CALIBRATE_SECONDS" 1 1 '{"attempts": 2}' "${target_modes[@]}"
            done
            if ((with_raahi)) && [[ -z $HEDGE_AFTER_MS ]]; then
                HEDGE_AFTER_MS=$(hedge_from_calibration)
                log "raahi's p95 with every target answering at once: hedge_after_ms $HEDGE_AFTER_MS"
            fi
            hedge=${HEDGE_AFTER_MS:-null}
            [[ $hedge == none ]] && hedge=null
            mapfile -t target_modes < <(modes "$TARGETS" stall-1-in-100)
            for proxy in "${order[@]}"; do
                [[ $proxy == nginx-nofail ]] && continue
                run stall "$proxy" "$STALL_SECONDS" 1 3 "{\"attempts\": 2, \"hedge_after_ms\": $hedge}" \
                    "${target_modes[@]}"
            done
            ;;
        esac
    done
done

echo
echo "Retries, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?');" \
    "$RATE requests/s (h2load -c1 -m$STREAMS --rps $RATE, h2c), $TARGETS targets, one worker per proxy"
((with_raahi)) && echo "raahi: $RAAHI_BIN; stall: hedge_after_ms ${HEDGE_AFTER_MS:-?}"
echo "nginx: $(nginx -v 2>&1 | sed 's/.*nginx\///'), max_fails ${NGINX_MAX_FAILS:-1 (default)}; haproxy: $(haproxy -v | head -n 1 | awk '{print $3}'); h2load: $(h2load --version | awk 'NR == 1 {print $2}')"
python3 "$BENCH/retry_report.py" table "$RESULTS"
echo
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
