#!/usr/bin/env bash
# Load comparison of raahi against nginx and haproxy as HTTP/1.1 reverse proxies, on loopback.
#
# Three nginx origin servers (one worker each, keep-alive, `return 200 "ok\n"`) sit behind each
# proxy; every proxy is set up the same way: those three targets, round-robin, keep-alive
# connections to the upstreams and the same number of workers. wrk and the origins are pinned to
# one CPU, the proxy under test to another, and the proxies are measured interleaved in rounds
# (raahi, nginx, haproxy, raahi, ...). The table shows medians over the rounds: req/s, p99 latency,
# and the proxy's CPU time per request (from /proc/PID/stat), which is steadier than req/s on a
# shared machine.
#
# Usage: scripts/bench-proxy.sh            (as root on Debian 12; installs nginx haproxy wrk curl)
# Environment:
#   DURATION=10      seconds per wrk run
#   ROUNDS=3         interleaved rounds
#   CONNECTIONS=64   wrk connections (wrk -t1)
#   WORKERS=1        workers per proxy (nginx worker_processes, haproxy nbthread,
#                    raahi TOKIO_WORKER_THREADS)
#   WARMUP=1         seconds of unmeasured load per proxy before the rounds (0: none)
#   LOADGEN_CPU=0    CPU for wrk and the origin servers
#   PROXY_CPU=1      CPU(s) for the proxy under test (taskset -c syntax)
#   RAAHI_BIN=...    use this raahi binary instead of building target/release/raahi
#   KEEP_TMP=1       keep the temporary directory (configs, logs, wrk output)
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
TEMPLATES=$SCRIPT_DIR/bench

DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-64}
WORKERS=${WORKERS:-1}
WARMUP=${WARMUP:-1}
LOADGEN_CPU=${LOADGEN_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
PROXIES=(raahi nginx haproxy)

log() { printf '[bench] %s\n' "$*" >&2; }
die() { printf '[bench] error: %s\n' "$*" >&2; exit 1; }

for var in DURATION ROUNDS CONNECTIONS WORKERS WARMUP; do
    [[ ${!var} =~ ^[0-9]+$ ]] || die "$var must be a whole number, got '${!var}'"
done
((DURATION >= 1 && ROUNDS >= 1 && CONNECTIONS >= 1 && WORKERS >= 1)) ||
    die "DURATION, ROUNDS, CONNECTIONS and WORKERS must be at least 1"

# ---------------------------------------------------------------------------------------------
# Tools

install_missing() {
    local missing=() cmd
    for cmd in nginx haproxy wrk curl; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    ((${#missing[@]} == 0)) && return 0
    log "missing: ${missing[*]}; installing with apt-get"
    ((EUID == 0)) || die "installing packages needs root"
    # Keep the packages' init scripts from starting system-wide nginx/haproxy services (port 80)
    # when no policy is in place already; this script must leave nothing listening.
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    fi
    local rc=0
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        nginx haproxy wrk curl; } >&2 || rc=$?
    ((made_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get failed (exit $rc)"
    for cmd in nginx haproxy wrk curl taskset; do
        command -v "$cmd" >/dev/null 2>&1 || die "$cmd is still missing after installing"
    done
}

build_raahi() {
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

check_cpus() {
    taskset -c "$LOADGEN_CPU" true 2>/dev/null || die "cannot pin to LOADGEN_CPU=$LOADGEN_CPU"
    taskset -c "$PROXY_CPU" true 2>/dev/null || die "cannot pin to PROXY_CPU=$PROXY_CPU"
}

# ---------------------------------------------------------------------------------------------
# Processes and cleanup

WORK=
PIDS=()          # every long-running process this script started
PORTS=()         # every port handed out to them
WRK_PID=

descendants() { # PID: prints the PIDs of all its live descendants
    local pid=$1 child file
    for file in /proc/"$pid"/task/*/children; do
        [[ -r $file ]] || continue
        for child in $(<"$file"); do
            echo "$child"
            descendants "$child"
        done
    done 2>/dev/null
}

listening() { # PORT: true when something listens on 127.0.0.1/any address at PORT
    local hex
    hex=$(printf '%04X' "$1")
    grep -qE "^ *[0-9]+: [0-9A-F]+:$hex [0-9A-F]+:[0-9A-F]+ 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

cleanup() {
    local rc=$? pid all=() deadline
    trap - EXIT INT TERM
    [[ -n $WRK_PID ]] && all+=("$WRK_PID")
    for pid in "${PIDS[@]}"; do
        all+=("$pid")
        while read -r child; do all+=("$child"); done < <(descendants "$pid")
    done
    if ((${#all[@]})); then
        for pid in "${PIDS[@]}" ${WRK_PID:+"$WRK_PID"}; do kill -TERM "$pid" 2>/dev/null || true; done
        deadline=$((SECONDS + 10))
        for pid in "${all[@]}"; do
            while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.05; done
            kill -KILL "$pid" 2>/dev/null || true
        done
        for pid in "${PIDS[@]}" ${WRK_PID:+"$WRK_PID"}; do wait "$pid" 2>/dev/null || true; done
    fi
    local port left=()
    for port in "${PORTS[@]}"; do listening "$port" && left+=("$port"); done
    ((${#left[@]})) && log "warning: still listening after cleanup: ${left[*]}"
    if [[ -n $WORK && -d $WORK ]]; then
        if [[ -n ${KEEP_TMP:-} ]]; then log "kept $WORK"; else rm -rf "$WORK"; fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# free_port: sets FREE_PORT to a port no local socket uses and not handed out already (not
# called in a $(...) subshell, so PORTS, which cleanup checks, keeps every port)
free_port() {
    local port hex tries
    for ((tries = 0; tries < 500; tries++)); do
        port=$((20000 + RANDOM % 12000)) # below the usual ephemeral range (32768-60999)
        [[ " ${PORTS[*]} " == *" $port "* ]] && continue
        hex=$(printf '%04X' "$port")
        grep -qE "^ *[0-9]+: [0-9A-F]+:$hex " /proc/net/tcp /proc/net/tcp6 2>/dev/null && continue
        PORTS+=("$port")
        FREE_PORT=$port
        return 0
    done
    die "no free port found"
}

render() { # TEMPLATE OUTPUT KEY=VALUE...: replaces @KEY@ with VALUE
    local template=$1 output=$2 pair script=()
    shift 2
    for pair in "$@"; do script+=(-e "s|@${pair%%=*}@|${pair#*=}|g"); done
    sed "${script[@]}" "$template" >"$output"
    if grep -q '@[A-Z0-9_]*@' "$output"; then die "unfilled placeholder in $output"; fi
}

# start NAME CPU LOGFILE CMD...: starts CMD pinned to CPU, output to LOGFILE; sets STARTED_PID
start() {
    local name=$1 cpu=$2 logfile=$3
    shift 3
    taskset -c "$cpu" "$@" >"$logfile" 2>&1 </dev/null &
    STARTED_PID=$!
    PIDS+=("$STARTED_PID")
    log "started $name (pid $STARTED_PID, CPU $cpu)"
}

http_status() { # URL: prints the HTTP status of a GET (000 when none)
    curl -s -o /dev/null -w '%{http_code}' --max-time 2 --noproxy '*' "$1" 2>/dev/null || true
}

# wait_200 NAME PID URL SECONDS LOGFILE: polls URL until it answers 200; dies, showing the tail
# of LOGFILE, when PID exits or the deadline passes
wait_200() {
    local name=$1 pid=$2 url=$3 deadline=$((SECONDS + $4)) logfile=$5 status problem=
    while :; do
        status=$(http_status "$url")
        [[ $status == 200 ]] && return 0
        if ! kill -0 "$pid" 2>/dev/null; then
            problem="$name (pid $pid) exited"
        elif ((SECONDS >= deadline)); then
            problem="$name: $url still answers '$status' after ${4}s"
        fi
        if [[ -n $problem ]]; then
            if [[ -s $logfile ]]; then log "--- tail of $logfile"; tail -n 20 "$logfile" >&2; fi
            die "$problem"
        fi
        sleep 0.05
    done
}

# ---------------------------------------------------------------------------------------------
# Measurements

CLK_TCK=$(getconf CLK_TCK)

cpu_ticks() { # PID: utime+stime (clock ticks) of PID and all its live descendants
    local pid total=0 ticks
    for pid in "$1" $(descendants "$1"); do
        [[ -r /proc/$pid/stat ]] || continue
        # Fields after "pid (comm) ": $1 is field 3 (state), so utime (14) is $12, stime (15) $13.
        ticks=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | awk '{print $12 + $13}') || continue
        [[ -n $ticks ]] && total=$((total + ticks))
    done
    echo "$total"
}

to_ms() { # wrk latency such as 812.00us, 2.31ms, 1.02s -> milliseconds
    awk -v v="$1" 'BEGIN {
        n = v + 0
        if (v ~ /us$/) n /= 1000; else if (v ~ /ms$/) n = n; else if (v ~ /m$/) n *= 60000;
        else if (v ~ /s$/) n *= 1000
        printf "%.3f", n }'
}

median() { # numbers...: their median
    printf '%s\n' "$@" | sort -g | awk '{ a[NR] = $1 }
        END { if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2];
              else printf "%.6f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}

declare -A URL PID RPS P99 CPU_US CPU_PCT ERRORS TOTAL_REQS UP_US UP_CONNS
UPSTREAM_PIDS=()

upstream_accepts() { # connections accepted so far by the three upstreams together
    local port total=0 n
    for port in "${UPSTREAM_PORTS[@]}"; do
        n=$(curl -s --max-time 2 --noproxy '*' "http://127.0.0.1:$port/__bench_status" |
            awk 'NR == 3 {print $1}') || true
        [[ $n =~ ^[0-9]+$ ]] || die "cannot read the status of the upstream on port $port"
        total=$((total + n))
    done
    echo "$total"
}

upstream_ticks() { # CPU ticks of the three upstream nginx process trees together
    local pid total=0
    for pid in "${UPSTREAM_PIDS[@]}"; do total=$((total + $(cpu_ticks "$pid"))); done
    echo "$total"
}

# run_wrk SECONDS URL OUTFILE: wrk pinned to LOADGEN_CPU, in the background so signals still work
run_wrk() {
    taskset -c "$LOADGEN_CPU" wrk -t1 -c"$CONNECTIONS" -d"$1"s --latency "$2" >"$3" 2>&1 </dev/null &
    WRK_PID=$!
    local rc=0
    wait "$WRK_PID" || rc=$?
    WRK_PID=
    ((rc == 0)) || { cat "$3" >&2; die "wrk against $2 failed (exit $rc)"; }
}

measure() { # PROXY ROUND
    local proxy=$1 round=$2 out="$WORK/wrk-$1-$2.txt" before after up_before up_after acc_before acc_after
    acc_before=$(upstream_accepts)
    up_before=$(upstream_ticks)
    before=$(cpu_ticks "${PID[$proxy]}")
    run_wrk "$DURATION" "${URL[$proxy]}" "$out"
    after=$(cpu_ticks "${PID[$proxy]}")
    up_after=$(upstream_ticks)
    acc_after=$(upstream_accepts)
    kill -0 "${PID[$proxy]}" 2>/dev/null || die "$proxy exited during the run"

    local rps p99 reqs secs non2xx sockerr
    rps=$(awk '/^Requests\/sec:/ {print $2}' "$out")
    p99=$(awk '$1 == "99%" {print $2}' "$out")
    reqs=$(awk '/ requests in / {print $1}' "$out")
    secs=$(awk '/ requests in / {sub(/s,$/, "", $4); print $4}' "$out")
    non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' "$out")
    sockerr=$(awk '/Socket errors:/ {gsub(/,/, ""); print $4 + $6 + $8 + $10}' "$out")
    [[ -n $rps && -n $p99 && -n $reqs ]] || { cat "$out" >&2; die "cannot parse wrk output for $proxy"; }
    ((reqs > 0)) || { cat "$out" >&2; die "no requests completed through $proxy"; }

    local ticks=$((after - before)) p99ms us up_us pct errors=$((${non2xx:-0} + ${sockerr:-0}))
    # connections the proxy opened to the upstreams (the 3 status reads after the run count too)
    local conns=$((acc_after - acc_before - 3))
    p99ms=$(to_ms "$p99")
    us=$(awk -v t="$ticks" -v hz="$CLK_TCK" -v n="$reqs" 'BEGIN { printf "%.2f", t / hz * 1e6 / n }')
    up_us=$(awk -v t="$((up_after - up_before))" -v hz="$CLK_TCK" -v n="$reqs" \
        'BEGIN { printf "%.2f", t / hz * 1e6 / n }')
    pct=$(awk -v t="$ticks" -v hz="$CLK_TCK" -v s="${secs:-$DURATION}" 'BEGIN { printf "%.0f", t / hz / s * 100 }')
    RPS[$proxy]+="$rps "
    P99[$proxy]+="$p99ms "
    CPU_US[$proxy]+="$us "
    CPU_PCT[$proxy]+="$pct "
    UP_US[$proxy]+="$up_us "
    UP_CONNS[$proxy]+="$conns "
    ERRORS[$proxy]=$((${ERRORS[$proxy]:-0} + errors))
    TOTAL_REQS[$proxy]=$((${TOTAL_REQS[$proxy]:-0} + reqs))
    printf '  round %d  %-8s %8.0f req/s  p99 %7.3f ms  %6.2f us CPU/req (%3d%% CPU)  upstreams: %6.2f us/req, %d new conns  errors %d\n' \
        "$round" "$proxy" "$rps" "$p99ms" "$us" "$pct" "$up_us" "$conns" "$errors"
    if ((errors > 0)); then
        grep -E 'Non-2xx|Socket errors' "$out" | sed "s/^/           $proxy: /" || true
    fi
}

# check_spread PROXY: 30 single requests must reach all three upstreams, each answering 200
check_spread() {
    local proxy=$1 i headers seen=() bad=0 name
    for ((i = 0; i < 30; i++)); do
        headers=$(curl -s -D - -o /dev/null --max-time 2 --noproxy '*' "${URL[$proxy]}" 2>/dev/null || true)
        [[ $headers == HTTP/1.1\ 200* ]] || bad=$((bad + 1))
        name=$(printf '%s\n' "$headers" | tr -d '\r' | awk 'tolower($1) == "x-upstream:" {print $2}')
        [[ -n $name && " ${seen[*]} " != *" $name "* ]] && seen+=("$name")
    done
    if ((bad > 0)); then log "warning: $proxy: $bad of 30 probe requests did not answer 200"; fi
    if ((${#seen[@]} != 3)); then
        log "warning: $proxy: probe requests reached ${#seen[@]} upstream(s) (${seen[*]:-none}), expected 3"
    fi
}

# ---------------------------------------------------------------------------------------------
# Main

install_missing
check_cpus
build_raahi

WORK=$(mktemp -d /tmp/raahi-bench.XXXXXX)
chmod 755 "$WORK" # nginx workers run as an unprivileged user and create their temp dirs here

raahi_commit=$(git -C "$REPO" describe --always --dirty --abbrev=12 2>/dev/null || echo unknown)
echo "== raahi proxy load comparison ($(date -u '+%Y-%m-%d %H:%M:%SZ'), $(nproc) CPUs, $(uname -r))"
echo "raahi:   commit $raahi_commit, $("$RAAHI_BIN" --version 2>/dev/null || echo '?') ($RAAHI_BIN)"
echo "nginx:   $(nginx -v 2>&1 | sed 's/^nginx version: //')"
echo "haproxy: $(haproxy -v 2>&1 | head -n 1)"
echo "wrk:     $({ wrk -v 2>&1 || true; } | head -n 1)"
echo "load:    wrk -t1 -c$CONNECTIONS -d${DURATION}s --latency, $ROUNDS round(s), warm-up ${WARMUP}s;" \
    "$WORKERS worker(s) per proxy; wrk + upstreams on CPU $LOADGEN_CPU, proxy on CPU $PROXY_CPU"
echo

# Upstreams: three nginx origins, each in its own prefix.
UPSTREAM_PORTS=()
for i in 1 2 3; do
    dir=$WORK/upstream$i
    mkdir -p "$dir"
    free_port
    port=$FREE_PORT
    UPSTREAM_PORTS+=("$port")
    render "$TEMPLATES/upstream-nginx.conf.tmpl" "$dir/nginx.conf" DIR="$dir" PORT="$port" NAME="u$i"
    start "upstream u$i (port $port)" "$LOADGEN_CPU" "$dir/stderr.log" \
        nginx -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf"
    UPSTREAM_PIDS+=("$STARTED_PID")
    wait_200 "upstream u$i" "$STARTED_PID" "http://127.0.0.1:$port/" 30 "$dir/stderr.log"
done
up=(UPSTREAM1="${UPSTREAM_PORTS[0]}" UPSTREAM2="${UPSTREAM_PORTS[1]}" UPSTREAM3="${UPSTREAM_PORTS[2]}")

# nginx proxy
dir=$WORK/nginx
mkdir -p "$dir"
free_port
port=$FREE_PORT
render "$TEMPLATES/proxy-nginx.conf.tmpl" "$dir/nginx.conf" DIR="$dir" PORT="$port" WORKERS="$WORKERS" "${up[@]}"
start "nginx proxy (port $port)" "$PROXY_CPU" "$dir/stderr.log" \
    nginx -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf"
PID[nginx]=$STARTED_PID
URL[nginx]=http://127.0.0.1:$port/

# haproxy proxy
dir=$WORK/haproxy
mkdir -p "$dir"
free_port
port=$FREE_PORT
render "$TEMPLATES/proxy-haproxy.cfg.tmpl" "$dir/haproxy.cfg" PORT="$port" WORKERS="$WORKERS" "${up[@]}"
haproxy -c -q -f "$dir/haproxy.cfg" >&2 || die "haproxy rejects $dir/haproxy.cfg"
start "haproxy proxy (port $port)" "$PROXY_CPU" "$dir/stderr.log" haproxy -db -f "$dir/haproxy.cfg"
PID[haproxy]=$STARTED_PID
URL[haproxy]=http://127.0.0.1:$port/

# raahi proxy, configured through its admin API
dir=$WORK/raahi
mkdir -p "$dir"
free_port
port=$FREE_PORT
free_port
admin_port=$FREE_PORT
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n') # 32 hex characters
(
    # Run from the private directory so config/raahi.toml of the checkout is not picked up.
    cd "$dir"
    exec env -u RAAHI_CONFIG -u RAAHI_PROXY_CLIENT_HEADER_TIMEOUT_MS \
        RAAHI_PROXY_LISTEN="127.0.0.1:$port" \
        RAAHI_ADMIN_LISTEN="127.0.0.1:$admin_port" \
        RAAHI_DATABASE_URL="sqlite://$dir/raahi.db" \
        RAAHI_ADMIN_TOKEN="$token" \
        RAAHI_LOG_FORMAT=text RUST_LOG=warn \
        TOKIO_WORKER_THREADS="$WORKERS" \
        taskset -c "$PROXY_CPU" "$RAAHI_BIN" serve
) >"$dir/raahi.log" 2>&1 </dev/null &
PID[raahi]=$!
PIDS+=("${PID[raahi]}")
log "started raahi proxy (pid ${PID[raahi]}, port $port, admin port $admin_port, CPU $PROXY_CPU)"
URL[raahi]=http://127.0.0.1:$port/
ADMIN=http://127.0.0.1:$admin_port

wait_200 "raahi admin API" "${PID[raahi]}" "$ADMIN/healthz" 60 "$dir/raahi.log"

admin_post() { # PATH JSON: POSTs to the admin API, prints the response body; fails unless 2xx
    local body=$WORK/raahi/response.json status
    status=$(curl -s -o "$body" -w '%{http_code}' --max-time 10 --noproxy '*' \
        -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
        -X POST --data "$2" "$ADMIN$1") || die "POST $1: curl failed"
    [[ $status == 2?? ]] || die "POST $1 $2: HTTP $status: $(cat "$body")"
    cat "$body"
}
json_id() { grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$'; }

service_id=$(admin_post /api/v1/services '{"name":"bench"}' | json_id)
[[ -n $service_id ]] || die "no id in the service creation response"
for p in "${UPSTREAM_PORTS[@]}"; do
    admin_post "/api/v1/services/$service_id/targets" "{\"host\":\"127.0.0.1\",\"port\":$p}" >/dev/null
done
admin_post /api/v1/routes "{\"name\":\"all\",\"service_id\":$service_id}" >/dev/null
log "raahi: service $service_id with 3 targets and route 'all' created"

declare -A PROXY_LOG=([raahi]=$WORK/raahi/raahi.log [nginx]=$WORK/nginx/error.log
    [haproxy]=$WORK/haproxy/stderr.log)
for proxy in "${PROXIES[@]}"; do
    wait_200 "$proxy proxy" "${PID[$proxy]}" "${URL[$proxy]}" 30 "${PROXY_LOG[$proxy]}"
done
for proxy in "${PROXIES[@]}"; do
    check_spread "$proxy"
    # one response's headers per proxy, for comparison (kept with KEEP_TMP=1)
    curl -s -D "$WORK/headers-$proxy.txt" -o /dev/null --max-time 2 --noproxy '*' "${URL[$proxy]}" || true
done

if ((WARMUP > 0)); then
    log "warm-up: ${WARMUP}s per proxy"
    for proxy in "${PROXIES[@]}"; do run_wrk "$WARMUP" "${URL[$proxy]}" "$WORK/wrk-$proxy-warmup.txt"; done
fi

for ((round = 1; round <= ROUNDS; round++)); do
    for proxy in "${PROXIES[@]}"; do measure "$proxy" "$round"; done
done
echo

# Table of medians; ratios are against nginx.
declare -A M_RPS M_P99 M_US M_PCT M_UP_US M_UP_CONNS
for proxy in "${PROXIES[@]}"; do
    # shellcheck disable=SC2086 # the per-round values are space separated on purpose
    M_RPS[$proxy]=$(median ${RPS[$proxy]})
    # shellcheck disable=SC2086
    M_P99[$proxy]=$(median ${P99[$proxy]})
    # shellcheck disable=SC2086
    M_US[$proxy]=$(median ${CPU_US[$proxy]})
    # shellcheck disable=SC2086
    M_PCT[$proxy]=$(median ${CPU_PCT[$proxy]})
    # shellcheck disable=SC2086
    M_UP_US[$proxy]=$(median ${UP_US[$proxy]})
    # shellcheck disable=SC2086
    M_UP_CONNS[$proxy]=$(median ${UP_CONNS[$proxy]})
done
echo "Medians over $ROUNDS round(s) of ${DURATION}s, $CONNECTIONS connections (ratios: proxy / nginx):"
printf '%-8s %9s %8s %11s %10s %9s %9s %10s %9s  %s\n' \
    proxy 'req/s' 'p99 ms' 'req/s ratio' 'CPU us/req' 'CPU ratio' 'proxy CPU' 'upstr us' 'upstr new' 'errors/requests'
printf '%-8s %9s %8s %11s %10s %9s %9s %10s %9s\n' '' '' '' '' '' '' '' '/req' 'conns'

for proxy in "${PROXIES[@]}"; do
    awk -v name="$proxy" -v rps="${M_RPS[$proxy]}" -v p99="${M_P99[$proxy]}" -v us="${M_US[$proxy]}" \
        -v pct="${M_PCT[$proxy]}" -v nrps="${M_RPS[nginx]}" -v nus="${M_US[nginx]}" \
        -v err="${ERRORS[$proxy]}" -v total="${TOTAL_REQS[$proxy]}" -v upus="${M_UP_US[$proxy]}" \
        -v upc="${M_UP_CONNS[$proxy]}" 'BEGIN {
        printf "%-8s %9.0f %8.3f %11.2f %10.2f %9.2f %8.0f%% %10.2f %9.0f  %s\n",
            name, rps, p99, (nrps > 0 ? rps / nrps : 0), us, (nus > 0 ? us / nus : 0), pct,
            upus, upc, err "/" total }'
done
echo "(CPU us/req: user+system CPU time of the proxy process tree per completed request;"
echo " proxy CPU: its share of one CPU during the run; upstr us/req: CPU of the three origin"
echo " servers per request; upstr new conns: connections the proxy opened to them during a run;"
echo " errors: non-2xx responses + socket errors, over all rounds)"

# Anything the proxies complained about.
echo
problems=0
raahi_log=$WORK/raahi/raahi.log
if grep -qE ' (WARN|ERROR) ' "$raahi_log"; then
    problems=1
    echo "raahi logged $(grep -cE ' (WARN|ERROR) ' "$raahi_log") warning/error line(s); first ones:"
    grep -E ' (WARN|ERROR) ' "$raahi_log" | head -n 5 | sed 's/^/  /'
fi
for f in "$WORK"/nginx/error.log "$WORK"/upstream*/error.log "$WORK"/haproxy/stderr.log; do
    if [[ -s $f ]] && grep -qvE '^\s*$' "$f"; then
        problems=1
        echo "${f#"$WORK"/}: $(wc -l <"$f") line(s); first ones:"
        head -n 3 "$f" | sed 's/^/  /'
    fi
done
((problems)) || echo "No warnings or errors in the proxies' logs."
