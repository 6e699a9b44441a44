#!/usr/bin/env bash
# Load comparison of raahi against nginx and haproxy as reverse proxies, on loopback.
#
# Three nginx origin servers (one worker each, keep-alive, `return 200 "ok\n"`, and a 1 MiB file at
# /big) sit behind each proxy; every proxy is set up the same way: those three targets,
# round-robin, keep-alive connections to the upstreams and the same number of workers. The load
# generator and the origins are pinned to one CPU, the proxy under test to another.
#
# Scenarios (SCENARIOS, in this order by default):
#   keepalive  HTTP/1.1 keep-alive, wrk -c$CONNECTIONS
#   logs       keepalive with an access log line per request written to a file, set up the way
#              each proxy's users run it in production, on a listener of its own:
#              nginx: a server with `access_log FILE combined buffer=64k flush=1s`;
#              haproxy: a frontend with `option httplog` and `log stdout format raw`, haproxy's
#              stdout going to a file (its stderr to another);
#              raahi: its access log is process-wide, so a second raahi process with RUST_LOG=info
#              and RAAHI_LOG_FORMAT=json (JSON lines on stderr, to a file), configured like the
#              first; its CPU is what this scenario measures for raahi.
#              Each run counts the lines each proxy added to its file against wrk's requests.
#   close      HTTP/1.1 with a new client connection per request (wrk, "Connection: close")
#   h2c        HTTP/2 prior knowledge, h2load -c$H2_CONNECTIONS -m$H2_STREAMS
#   tls        HTTPS, TLS 1.3, a new connection per request resuming the TLS session (wrk over
#              https with "Connection: close": wrk keeps each connection's session and resumes it)
#   big        a 1 MiB response body, wrk -c$BIG_CONNECTIONS, keep-alive
# Rounds interleave every scenario and proxy (the proxy order rotates each round); the tables
# show medians over the rounds: req/s, p99 latency, the proxy's CPU time per request (from
# /proc/PID/stat, steadier than req/s on a shared machine) and ratios to nginx.
# Memory (MEMORY=1): the proxy's RSS idle before any load, idle after the load, and holding
# $IDLE_CONNECTIONS idle client connections (scripts/bench/idle_clients.py), once connected
# without a request yet, once as keep-alive connections that each made one request.
# Syscalls (SYSCALLS=1): after the rounds, each scenario's load runs once more per proxy for
# $SYSCALL_SECONDS while `perf stat` counts, in the kernel, the syscalls of the proxy's process
# tree (every thread that exists when it attaches): per completed request, in all, by syscall (with
# how many failed with EAGAIN: a read, write or accept that found nothing to do) and by thread,
# with the wake-ups the proxy makes, its context switches, page faults and the TCP segments sent.
#
# Usage: scripts/bench-proxy.sh   (as root on Debian 12; installs nginx haproxy wrk nghttp2-client
#                                  curl openssl python3 when missing, and linux-perf for SYSCALLS=1)
# Environment:
#   DURATION=10        seconds per measured run
#   ROUNDS=3           interleaved rounds
#   SCENARIOS="keepalive logs close h2c tls big"
#   CONNECTIONS=64     wrk connections for keepalive, close and tls (wrk -t1)
#   H2_CONNECTIONS=16  h2load connections (h2load -t1)
#   H2_STREAMS=8       concurrent streams per h2load connection
#   BIG_CONNECTIONS=16 wrk connections for the 1 MiB scenario
#   WORKERS=1          workers per proxy (nginx worker_processes, haproxy nbthread,
#                      raahi TOKIO_WORKER_THREADS)
#   WARMUP=1           seconds of unmeasured load per scenario and proxy before the rounds (0: none)
#   MEMORY=1           measure memory (0: skip)
#   IDLE_CONNECTIONS=10000
#   SYSCALLS=0         count each proxy's syscalls per request with perf stat (1: after the rounds)
#   SYSCALL_SECONDS=3  seconds of load per scenario and proxy for the syscall counts
#   LOADGEN_CPU=0      CPU for the load generator and the origin servers
#   PROXY_CPU=1        CPU(s) for the proxy under test (taskset -c syntax)
#   RAAHI_LOG=warn     RUST_LOG for raahi (raahi's own default, info, writes the access log);
#                      the logs scenario's raahi always runs with RUST_LOG=info
#   RAAHI_BIN=...      use this raahi binary instead of building target/release/raahi
#   KEEP_TMP=1         keep the temporary directory (configs, logs, load generator output)
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
TEMPLATES=$SCRIPT_DIR/bench

DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-64}
H2_CONNECTIONS=${H2_CONNECTIONS:-16}
H2_STREAMS=${H2_STREAMS:-8}
BIG_CONNECTIONS=${BIG_CONNECTIONS:-16}
WORKERS=${WORKERS:-1}
WARMUP=${WARMUP:-1}
MEMORY=${MEMORY:-1}
IDLE_CONNECTIONS=${IDLE_CONNECTIONS:-10000}
SYSCALLS=${SYSCALLS:-0}
SYSCALL_SECONDS=${SYSCALL_SECONDS:-3}
LOADGEN_CPU=${LOADGEN_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
RAAHI_LOG=${RAAHI_LOG:-warn}
read -r -a SCENARIO_LIST <<<"${SCENARIOS:-keepalive logs close h2c tls big}"
PROXIES=(raahi nginx haproxy)

log() { printf '[bench] %s\n' "$*" >&2; }
die() { printf '[bench] error: %s\n' "$*" >&2; exit 1; }

for var in DURATION ROUNDS CONNECTIONS H2_CONNECTIONS H2_STREAMS BIG_CONNECTIONS WORKERS WARMUP \
    MEMORY IDLE_CONNECTIONS SYSCALLS SYSCALL_SECONDS; do
    [[ ${!var} =~ ^[0-9]+$ ]] || die "$var must be a whole number, got '${!var}'"
done
((DURATION >= 1 && ROUNDS >= 1 && CONNECTIONS >= 1 && WORKERS >= 1 && H2_CONNECTIONS >= 1 &&
    H2_STREAMS >= 1 && BIG_CONNECTIONS >= 1 && SYSCALL_SECONDS >= 1)) ||
    die "DURATION, ROUNDS, WORKERS, SYSCALL_SECONDS and the connection and stream counts must be at least 1"
((${#SCENARIO_LIST[@]} > 0)) || die "SCENARIOS is empty"
for scenario in "${SCENARIO_LIST[@]}"; do
    [[ $scenario =~ ^(keepalive|logs|close|h2c|tls|big)$ ]] ||
        die "unknown scenario '$scenario' (keepalive logs close h2c tls big)"
done

# Every proxy holds IDLE_CONNECTIONS client sockets at once, and so does the idle client.
fd_limit=$(ulimit -Hn)
[[ $fd_limit == unlimited ]] && fd_limit=1048576
wanted=$((IDLE_CONNECTIONS + 2048))
((wanted > fd_limit)) && die "IDLE_CONNECTIONS=$IDLE_CONNECTIONS needs $wanted file descriptors; the hard limit is $fd_limit"
ulimit -n "$fd_limit"

# ---------------------------------------------------------------------------------------------
# Tools

install_missing() {
    local missing=() cmd
    local -A package=([nginx]=nginx [haproxy]=haproxy [wrk]=wrk [h2load]=nghttp2-client
        [curl]=curl [openssl]=openssl [python3]=python3 [perf]=linux-perf)
    local needed=(nginx haproxy wrk h2load curl openssl python3)
    ((SYSCALLS)) && needed+=(perf)
    for cmd in "${needed[@]}"; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("${package[$cmd]}")
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
        "${missing[@]}"; } >&2 || rc=$?
    ((made_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get failed (exit $rc)"
    for cmd in "${needed[@]}" taskset; do
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

# The syscalls SYSCALLS=1 counts one by one (syscalls:sys_enter_NAME), the rest only in the total
# (raw_syscalls:sys_enter) as "other": perf stat waits for an RCU grace period for each syscall
# tracepoint it closes (about 36 ms here), 13 s for all ~360. EAGAIN_SYSCALLS: those whose
# EAGAIN failures are counted (syscalls:sys_exit_NAME filtered on the return value).
SYSCALL_NAMES=(read write readv writev pread64 pwrite64 recvfrom sendto recvmsg sendmsg recvmmsg sendmmsg
    sendfile64 splice epoll_wait epoll_pwait epoll_pwait2 epoll_ctl poll ppoll select pselect6
    io_uring_enter accept accept4 connect close shutdown socket setsockopt getsockopt getsockname
    getpeername getpid gettid futex sched_yield nanosleep clock_nanosleep clock_gettime gettimeofday
    timer_settime timerfd_settime madvise mmap munmap mprotect mremap brk openat newfstatat statx
    newfstat lseek fsync fdatasync ioctl fcntl getrandom rt_sigprocmask eventfd2 pipe2)
EAGAIN_SYSCALLS=(read readv recvfrom recvmsg write writev sendto sendmsg accept4)
ENTER_EVENTS='' EXIT_EVENTS=''

check_perf() { # sets ENTER_EVENTS and EXIT_EVENTS from the syscall tracepoints this kernel has
    ((SYSCALLS)) || return 0
    local tracefs dir='' name
    for tracefs in /sys/kernel/tracing /sys/kernel/debug/tracing; do
        [[ -d $tracefs/events/syscalls ]] && { dir=$tracefs/events/syscalls; break; }
    done
    [[ -n $dir ]] || die "SYSCALLS=1: no syscall tracepoints in /sys/kernel/tracing (tracefs)"
    for name in "${SYSCALL_NAMES[@]}"; do
        [[ -d $dir/sys_enter_$name ]] && ENTER_EVENTS+=${ENTER_EVENTS:+,}syscalls:sys_enter_$name
    done
    for name in "${EAGAIN_SYSCALLS[@]}"; do
        [[ -d $dir/sys_exit_$name ]] && EXIT_EVENTS+=${EXIT_EVENTS:+,}syscalls:sys_exit_$name
    done
    [[ -n $ENTER_EVENTS && -n $EXIT_EVENTS ]] || die "SYSCALLS=1: none of the syscall tracepoints expected in $dir"
    perf stat -e raw_syscalls:sys_enter,sched:sched_waking -o /dev/null -- true >/dev/null 2>&1 ||
        die "SYSCALLS=1: perf cannot count tracepoints here" \
            "(it needs root, or kernel.perf_event_paranoid=-1 and access to tracefs)"
}

# ---------------------------------------------------------------------------------------------
# Processes and cleanup

WORK=
PIDS=()          # every long-running process this script started
PORTS=()         # every port handed out to them
LOAD_PID=         # the load generator or idle client running now
TRACE_PID=        # the perf stat running now (SYSCALLS=1)

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
    [[ -n $LOAD_PID ]] && all+=("$LOAD_PID")
    [[ -n $TRACE_PID ]] && all+=("$TRACE_PID")
    for pid in "${PIDS[@]}"; do
        all+=("$pid")
        while read -r child; do all+=("$child"); done < <(descendants "$pid")
    done
    if ((${#all[@]})); then
        for pid in "${PIDS[@]}" ${LOAD_PID:+"$LOAD_PID"} ${TRACE_PID:+"$TRACE_PID"}; do
            kill -TERM "$pid" 2>/dev/null || true
        done
        deadline=$((SECONDS + 10))
        for pid in "${all[@]}"; do
            while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.05; done
            kill -KILL "$pid" 2>/dev/null || true
        done
        for pid in "${PIDS[@]}" ${LOAD_PID:+"$LOAD_PID"} ${TRACE_PID:+"$TRACE_PID"}; do
            wait "$pid" 2>/dev/null || true
        done
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

# start NAME CPU OUTFILE ERRFILE CMD...: starts CMD pinned to CPU, its stdout to OUTFILE and its
# stderr to ERRFILE (both to the one file when they are the same); sets STARTED_PID
start() {
    local name=$1 cpu=$2 out=$3 err=$4
    shift 4
    if [[ $out == "$err" ]]; then
        taskset -c "$cpu" "$@" >"$out" 2>&1 </dev/null &
    else
        taskset -c "$cpu" "$@" >"$out" 2>"$err" </dev/null &
    fi
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

cpu_ticks() { # PID: "utime+stime utime" (clock ticks) of PID and all its live descendants
    local pid total=0 user=0 ticks
    for pid in "$1" $(descendants "$1"); do
        [[ -r /proc/$pid/stat ]] || continue
        # Fields after "pid (comm) ": $1 is field 3 (state), so utime (14) is $12, stime (15) $13.
        ticks=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | awk '{print $12 + $13, $12}') || continue
        [[ -n $ticks ]] || continue
        total=$((total + ${ticks% *}))
        user=$((user + ${ticks#* }))
    done
    echo "$total $user"
}

memory_kib() { # PID: "RSS PSS" in KiB, summed over PID and its live descendants
    local pid rss=0 pss=0 r p
    for pid in "$1" $(descendants "$1"); do
        r=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || continue
        p=$(awk '/^Pss:/ {print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null) || continue
        rss=$((rss + ${r:-0}))
        pss=$((pss + ${p:-0}))
    done
    echo "$rss $pss"
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

# Keyed by "SCENARIO PROXY": per-round values, space separated. PID is keyed by PROXY, and by
# "SCENARIO PROXY" for a scenario served by a process of its own (raahi's logs): see proxy_pid.
declare -A URL PID RPS P99 CPU_US CPU_PCT ERRORS TOTAL_REQS UP_CONNS SKIP LOG_LINES
UPSTREAM_PIDS=()

proxy_pid() { # SCENARIO PROXY: the PID of the process (tree) that serves SCENARIO for PROXY
    echo "${PID[$1 $2]:-${PID[$2]}}"
}

# The logs scenario's access log of each proxy, and how many tenths of a second it must stay the
# same size before the lines of a run count as all written: nginx holds them in its buffer for up
# to 1 s (flush=1s), haproxy writes each line at once and raahi's writer thread right after.
declare -A ACCESS_LOG LOG_QUIET=([raahi]=3 [nginx]=15 [haproxy]=3)

settled_log_size() { # PROXY: waits until its access log stops growing (at most 8 s); prints its size
    local proxy=$1 file=${ACCESS_LOG[$1]} size last=-1 quiet=0 polls
    for ((polls = 0; polls < 80; polls++)); do
        size=$(stat -c %s "$file" 2>/dev/null || echo 0)
        if ((size == last)); then
            quiet=$((quiet + 1))
            ((quiet < ${LOG_QUIET[$proxy]})) || { echo "$size"; return 0; }
        else
            quiet=0 last=$size
        fi
        sleep 0.1
    done
    log "warning: $file still grows 8 s after the run"
    echo "$size"
}

access_lines_since() { # PROXY OFFSET: access-log lines in its file after byte OFFSET
    local file=${ACCESS_LOG[$1]}
    if [[ $1 == raahi ]]; then
        # the logging raahi's stderr also has its other INFO lines (start-up and the like)
        tail -c +"$(($2 + 1))" "$file" | grep -c 'raahi::access' || true
    else
        tail -c +"$(($2 + 1))" "$file" | wc -l
    fi
}

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

# run_load SCENARIO PROXY SECONDS OUTFILE: the scenario's load generator, pinned to LOADGEN_CPU, in
# the background so signals still work
run_load() {
    local scenario=$1 proxy=$2 seconds=$3 out=$4 url=${URL[$1 $2]} cmd
    case $scenario in
    keepalive | logs) cmd=(wrk -t1 -c"$CONNECTIONS" -d"$seconds"s --latency "$url") ;;
    close | tls) cmd=(wrk -t1 -c"$CONNECTIONS" -d"$seconds"s --latency -H 'Connection: close' "$url") ;;
    big) cmd=(wrk -t1 -c"$BIG_CONNECTIONS" -d"$seconds"s --latency "$url") ;;
    h2c) cmd=(h2load -t1 -c"$H2_CONNECTIONS" -m"$H2_STREAMS" -D"$seconds" --log-file="$out.log" "$url") ;;
    esac
    taskset -c "$LOADGEN_CPU" "${cmd[@]}" >"$out" 2>&1 </dev/null &
    LOAD_PID=$!
    local rc=0
    wait "$LOAD_PID" || rc=$?
    LOAD_PID=
    ((rc == 0)) || { cat "$out" >&2; die "${cmd[0]} against $url failed (exit $rc)"; }
}

# parse_load SCENARIO OUTFILE: sets L_RPS L_P99_MS L_REQS L_SECS L_ERRORS from the tool's output
parse_load() {
    local scenario=$1 out=$2
    L_RPS='' L_P99_MS='' L_REQS='' L_SECS='' L_ERRORS=0
    if [[ $scenario == h2c ]]; then
        L_RPS=$(awk '/^finished in / {print $4}' "$out")
        L_SECS=$(awk '/^finished in / {sub(/s,$/, "", $3); print $3}' "$out")
        L_REQS=$(awk '/^requests: / {print $8}' "$out")
        L_ERRORS=$(awk '/^requests: / {print $10 + $12 + $14}' "$out")
        local non2xx
        non2xx=$(awk '/^status codes: / {print $5 + $7 + $9}' "$out")
        L_ERRORS=$((${L_ERRORS:-0} + ${non2xx:-0}))
        # h2load prints no percentiles; its log file has each request's time in microseconds
        [[ -s $out.log ]] && L_P99_MS=$(cut -f3 "$out.log" | sort -n |
            awk '{ a[NR] = $1 } END { if (NR) { i = int(NR * 0.99); if (i < 1) i = 1;
                printf "%.3f", a[i] / 1000 } }')
        rm -f "$out.log"
    else
        local p99 non2xx sockerr
        L_RPS=$(awk '/^Requests\/sec:/ {print $2}' "$out")
        p99=$(awk '$1 == "99%" {print $2}' "$out")
        [[ -n $p99 ]] && L_P99_MS=$(to_ms "$p99")
        L_REQS=$(awk '/ requests in / {print $1}' "$out")
        L_SECS=$(awk '/ requests in / {sub(/s,$/, "", $4); print $4}' "$out")
        non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' "$out")
        # With "Connection: close" the server's close after each response is not an error, and wrk
        # counts no read error for it; connect, write and timeout errors are counted.
        sockerr=$(awk '/Socket errors:/ {gsub(/,/, ""); print $4 + $6 + $8 + $10}' "$out")
        L_ERRORS=$((${non2xx:-0} + ${sockerr:-0}))
    fi
    [[ -n $L_RPS && -n $L_P99_MS && -n $L_REQS ]] || return 1
    [[ -n $L_SECS ]] || L_SECS=$DURATION
    return 0
}

measure() { # SCENARIO PROXY ROUND
    local scenario=$1 proxy=$2 round=$3 key="$1 $2" out="$WORK/load-$1-$2-$3.txt"
    local before after acc_before acc_after user_before user_after pid log_before='' lines=''
    pid=$(proxy_pid "$scenario" "$proxy")
    # lines still on their way from earlier requests (warm-up, probe) are not this run's
    [[ $scenario == logs ]] && log_before=$(settled_log_size "$proxy")
    acc_before=$(upstream_accepts)
    read -r before user_before < <(cpu_ticks "$pid")
    run_load "$scenario" "$proxy" "$DURATION" "$out"
    read -r after user_after < <(cpu_ticks "$pid")
    acc_after=$(upstream_accepts)
    kill -0 "$pid" 2>/dev/null || die "$proxy exited during the $scenario run"
    parse_load "$scenario" "$out" || { cat "$out" >&2; die "cannot parse the $scenario output for $proxy"; }
    ((L_REQS > 0)) || { cat "$out" >&2; die "no requests completed through $proxy ($scenario)"; }
    if [[ $scenario == logs ]]; then
        settled_log_size "$proxy" >/dev/null
        lines=$(access_lines_since "$proxy" "$log_before")
        LOG_LINES[$key]=$((${LOG_LINES[$key]:-0} + lines))
    fi

    local ticks=$((after - before)) us pct user_pct
    # the share of the proxy's CPU time spent in user space (the rest is the kernel's socket work)
    user_pct=$(awk -v u="$((user_after - user_before))" -v t="$ticks" 'BEGIN { printf "%.0f", t ? u / t * 100 : 0 }')
    # connections the proxy opened to the upstreams (the 3 status reads after the run count too)
    local conns=$((acc_after - acc_before - 3))
    us=$(awk -v t="$ticks" -v hz="$CLK_TCK" -v n="$L_REQS" 'BEGIN { printf "%.2f", t / hz * 1e6 / n }')
    pct=$(awk -v t="$ticks" -v hz="$CLK_TCK" -v s="$L_SECS" 'BEGIN { printf "%.0f", t / hz / s * 100 }')
    RPS[$key]+="$L_RPS "
    P99[$key]+="$L_P99_MS "
    CPU_US[$key]+="$us "
    CPU_PCT[$key]+="$pct "
    UP_CONNS[$key]+="$conns "
    ERRORS[$key]=$((${ERRORS[$key]:-0} + L_ERRORS))
    TOTAL_REQS[$key]=$((${TOTAL_REQS[$key]:-0} + L_REQS))
    printf '  round %d  %-9s %-8s %8.0f req/s  p99 %8.3f ms  %7.2f us CPU/req (%3d%% CPU, %3d%% user)  %5d new upstream conns  errors %d%s\n' \
        "$round" "$scenario" "$proxy" "$L_RPS" "$L_P99_MS" "$us" "$pct" "$user_pct" "$conns" "$L_ERRORS" \
        "${lines:+  log lines $lines/requests $L_REQS}"
    # wrk counts no request still in flight when it stops, which the proxy may well have logged:
    # more lines than requests is expected, fewer means lines were lost
    if [[ -n $lines ]] && ((lines < L_REQS)); then
        log "warning: $proxy wrote $lines access log lines for $L_REQS requests (round $round)"
    fi
    if ((L_ERRORS > 0)); then
        grep -E 'Non-2xx|Socket errors|^requests:|^status codes:' "$out" | sed "s/^/           $proxy: /" || true
    fi
}

# check_spread PROXY: 30 single requests must reach all three upstreams, each answering 200
check_spread() {
    local proxy=$1 i headers seen=() bad=0 name
    for ((i = 0; i < 30; i++)); do
        headers=$(curl -s -D - -o /dev/null --max-time 2 --noproxy '*' "${URL[keepalive $proxy]}" 2>/dev/null || true)
        [[ $headers == HTTP/1.1\ 200* ]] || bad=$((bad + 1))
        name=$(printf '%s\n' "$headers" | tr -d '\r' | awk 'tolower($1) == "x-upstream:" {print $2}')
        [[ -n $name && " ${seen[*]} " != *" $name "* ]] && seen+=("$name")
    done
    if ((bad > 0)); then log "warning: $proxy: $bad of 30 probe requests did not answer 200"; fi
    if ((${#seen[@]} != 3)); then
        log "warning: $proxy: probe requests reached ${#seen[@]} upstream(s) (${seen[*]:-none}), expected 3"
    fi
}

# probe SCENARIO PROXY: one request the way the scenario sends them; true when it answers 200
probe() {
    local url=${URL[$1 $2]} extra=()
    case $1 in
    keepalive | logs | close | big) ;;
    h2c) extra=(--http2-prior-knowledge) ;;
    tls) extra=(-k --tlsv1.3) ;;
    esac
    [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 5 --noproxy '*' "${extra[@]}" "$url" 2>/dev/null) == 200 ]]
}

declare -A IDLE_MEM AFTER_MEM CONN_MEM CONN_OPEN
# idle_connections PROXY KIND: memory of PROXY while IDLE_CONNECTIONS idle clients are open; KIND
# "silent": connected, no request sent; "used": keep-alive connections after one request each
idle_connections() {
    local proxy=$1 kind=$2 out="$WORK/idle-$1-$2.txt" port deadline extra=()
    port=${URL[keepalive $proxy]#http://127.0.0.1:}
    port=${port%/}
    [[ $kind == silent ]] && extra=(--no-request)
    taskset -c "$LOADGEN_CPU" python3 "$TEMPLATES/idle_clients.py" --port "$port" \
        --connections "$IDLE_CONNECTIONS" --hold 8 "${extra[@]}" >"$out" 2>&1 </dev/null &
    LOAD_PID=$!
    deadline=$((SECONDS + 300))
    while ! grep -q '^ready ' "$out"; do
        kill -0 "$LOAD_PID" 2>/dev/null || { cat "$out" >&2; die "idle client against $proxy exited"; }
        ((SECONDS < deadline)) || die "idle client against $proxy: no connections after 300s"
        sleep 0.1
    done
    # Steady state with every connection open: raahi parks a resting connection after 0.5-1 s
    # and its allocator returns the freed memory within about a second after that.
    sleep 5
    CONN_MEM[$kind $proxy]=$(memory_kib "${PID[$proxy]}")
    local rc=0
    wait "$LOAD_PID" || rc=$?
    LOAD_PID=
    ((rc == 0)) || { cat "$out" >&2; die "idle client against $proxy failed (exit $rc)"; }
    local ready open
    ready=$(awk '/^ready / {print $2 " opened, " $3 " failed"}' "$out")
    open=$(awk '/^open / {print $2}' "$out")
    CONN_OPEN[$kind $proxy]="$ready, ${open:-?} still open after the hold"
    log "$proxy: $IDLE_CONNECTIONS idle connections ($kind): ${CONN_OPEN[$kind $proxy]}"
    kill -0 "${PID[$proxy]}" 2>/dev/null || die "$proxy exited while holding idle connections"
}

mib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }

# task_switches PID...: "TID voluntary nonvoluntary" context switches of every thread of the PIDs
task_switches() {
    local pid task
    for pid in "$@"; do
        for task in /proc/"$pid"/task/*; do
            awk -v tid="${task##*/}" '/^voluntary_ctxt_switches:/ { v = $2 }
                /^nonvoluntary_ctxt_switches:/ { n = $2 }
                END { if (v != "") print tid, v, n }' "$task/status" 2>/dev/null || true
        done
    done
}

tcp_out_segs() { # TCP segments sent so far, system-wide (all of them on loopback here)
    awk '/^Tcp:/ { if ($2 ~ /^[0-9]+$/) { for (i = 2; i <= NF; i++) if (name[i] == "OutSegs") print $i }
        else for (i = 2; i <= NF; i++) name[i] = $i }' /proc/net/snmp
}

# Keyed by "SCENARIO PROXY": the syscall table's line for that run, and its line by thread.
declare -A SYS_LINE SYS_THREADS

# trace_syscalls SCENARIO PROXY: runs the scenario's load for SYSCALL_SECONDS while perf stat counts
# the syscalls, the failed ones with EAGAIN, the wake-ups and the page faults of the proxy's
# process tree; sets SYS_LINE and SYS_THREADS.
# perf stat counts in the kernel. perf trace, which gets every syscall as an event, slowed the
# proxies about tenfold here (it is woken for each event), and with them how many connections each
# epoll_wait finds ready and how often a read finds nothing: the very counts this is for.
trace_syscalls() {
    local scenario=$1 proxy=$2 key="$1 $2" base="$WORK/syscalls-$1-$2" pid pids=() child
    local fds last=-1 stable=0 polls deadline segs_before segs_after
    pid=$(proxy_pid "$scenario" "$proxy")
    # `perf stat -p PID` counts every thread PID has when perf attaches, and threads started later
    # under the thread that started them; nginx's master and workers are a process tree: a list.
    pids=("$pid")
    while read -r child; do pids+=("$child"); done < <(descendants "$pid")
    task_switches "${pids[@]}" >"$base.switches-before"
    # sched_waking fires in the waker's context: the wake-ups the proxy's threads make (of the load
    # generator, the upstreams, each other). perf runs on the load generator's CPU, as the proxy's
    # CPU is what the measured rounds compare.
    taskset -c "$LOADGEN_CPU" perf stat --per-thread -x, -o "$base.perf" \
        -e "raw_syscalls:sys_enter,page-faults,sched:sched_waking,$ENTER_EVENTS" \
        -e "$EXIT_EVENTS" --filter 'ret == -11' \
        -p "$(IFS=,; echo "${pids[*]}")" >"$base.perf-stdout" 2>&1 </dev/null &
    TRACE_PID=$!
    # counting once it holds its perf events and their number stays the same for a few polls
    for ((polls = 0; stable < 4; polls++)); do
        if ! kill -0 "$TRACE_PID" 2>/dev/null; then
            cat "$base.perf-stdout" "$base.perf" >&2 2>/dev/null || true
            die "perf stat of $proxy ($scenario) exited before the load"
        fi
        ((polls < 400)) || die "perf stat of $proxy ($scenario) still opens events after 20s"
        # (find fails when an fd closes while it lists them: with pipefail that must not end the run)
        fds=$({ find /proc/"$TRACE_PID"/fd -lname '*perf_event*' 2>/dev/null || true; } | wc -l)
        if ((fds > 0 && fds == last)); then stable=$((stable + 1)); else stable=0 last=$fds; fi
        sleep 0.05
    done
    sleep 0.2
    segs_before=$(tcp_out_segs)
    run_load "$scenario" "$proxy" "$SYSCALL_SECONDS" "$base.load"
    segs_after=$(tcp_out_segs)
    # the access log lines still on their way are this run's syscalls too
    if [[ $scenario == logs ]]; then settled_log_size "$proxy" >/dev/null; else sleep 0.2; fi
    task_switches "${pids[@]}" >"$base.switches-after"
    kill -0 "$pid" 2>/dev/null || die "$proxy exited during the $scenario syscall run"
    # SIGINT: perf stops and writes its counts
    kill -INT "$TRACE_PID" 2>/dev/null || true
    deadline=$((SECONDS + 60))
    while kill -0 "$TRACE_PID" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    if kill -0 "$TRACE_PID" 2>/dev/null; then
        kill -KILL "$TRACE_PID" 2>/dev/null || true
        log "warning: perf stat of $proxy ($scenario) did not stop within 60s of SIGINT"
    fi
    wait "$TRACE_PID" 2>/dev/null || true
    TRACE_PID=
    grep -q ',raw_syscalls:sys_enter,' "$base.perf" 2>/dev/null || {
        cat "$base.perf-stdout" >&2
        die "perf stat of $proxy ($scenario) wrote no syscall counts"
    }
    parse_load "$scenario" "$base.load" || { cat "$base.load" >&2; die "cannot parse the $scenario output for $proxy"; }
    ((L_REQS > 0)) || { cat "$base.load" >&2; die "no requests completed through $proxy ($scenario)"; }

    # perf stat --per-thread -x, lines: THREADNAME-TID,COUNT,UNIT,EVENT,... (COUNT may be
    # "<not counted>"); prints "total SYSCALLS WAKEUPS FAULTS", "call N NAME PER_REQ [EAGAIN ...]"
    # per syscall (and "other", the syscalls not counted one by one) and "thread N NAME PER_REQ"
    # per thread name.
    local parsed
    parsed=$(awk -F, -v n="$L_REQS" '
        $2 !~ /^[0-9]+$/ { next }
        {
            thread = $1; sub(/-[0-9]+$/, "", thread); event = $4
            if (event == "raw_syscalls:sys_enter") { by_thread[thread] += $2; total += $2 }
            else if (event ~ /^syscalls:sys_enter_/) {
                sub(/^syscalls:sys_enter_/, "", event); calls[event] += $2; named += $2
            } else if (event ~ /^syscalls:sys_exit_/) {
                sub(/^syscalls:sys_exit_/, "", event); eagain[event] += $2
            } else if (event == "sched:sched_waking") wakeups += $2
            else if (event == "page-faults") faults += $2
        }
        END {
            printf "total %.2f %.2f %.2f\n", total / n, wakeups / n, faults / n
            if (total > named) calls["other"] = total - named
            for (sc in calls) {
                if (calls[sc] / n < 0.005) continue
                printf "call %d %s %.2f%s\n", calls[sc], sc, calls[sc] / n,
                    (eagain[sc] / n >= 0.005 ? sprintf(" [EAGAIN %.2f]", eagain[sc] / n) : "")
            }
            for (t in by_thread)
                if (by_thread[t] / n >= 0.005) printf "thread %d %s %.2f\n", by_thread[t], t, by_thread[t] / n
        }' "$base.perf")
    local total wakeups faults list threads
    # (grep finds nothing when perf counted nothing readable: that must not end the script, whose
    # set -e would do so silently, but show in the table)
    read -r _ total wakeups faults <<<"$(grep '^total ' <<<"$parsed" || true)"
    list=$({ grep '^call ' <<<"$parsed" || true; } | sort -k2,2nr -k3,3 | cut -d' ' -f3- |
        paste -sd' ' -)
    threads=$({ grep '^thread ' <<<"$parsed" || true; } | sort -k2,2nr -k3,3 | cut -d' ' -f3- |
        sed 's/$/,/' | paste -sd' ' - | sed 's/,$//')
    if [[ -z $list ]]; then
        log "warning: perf stat of $proxy ($scenario) counted no syscall it could read; kept in $base.perf"
        list="(none counted)"
    fi

    # context switches per request, from /proc: threads present at both ends, and those started in
    # between (from zero)
    local switches new_threads segs
    switches=$(awk -v n="$L_REQS" 'FNR == NR { v[$1] = $2; nv[$1] = $3; next }
        { dv += $2 - v[$1]; dn += $3 - nv[$1] }
        END { printf "%.2f %.2f", dv / n, dn / n }' "$base.switches-before" "$base.switches-after")
    new_threads=$(awk 'FNR == NR { seen[$1] = 1; next } !($1 in seen) { n++ } END { print n + 0 }' \
        "$base.switches-before" "$base.switches-after")
    segs=$(awk -v d="$((segs_after - segs_before))" -v n="$L_REQS" 'BEGIN { printf "%.2f", d / n }')

    SYS_LINE[$key]=$(printf '%-8s %8.0f %7s %6s %6s %6s %6s %6s  %s' "$proxy" "$L_RPS" "$total" \
        "$wakeups" "${switches% *}" "${switches#* }" "$faults" "$segs" "$list")
    SYS_THREADS[$key]="by thread: ${threads:-none}"
    ((new_threads > 0)) && SYS_THREADS[$key]+="; $new_threads thread(s) started during the run (counted under the thread that started them)"
    log "syscalls: $scenario $proxy: $total per request over $L_REQS requests"
}

# ---------------------------------------------------------------------------------------------
# Main

install_missing
check_cpus
check_perf
build_raahi

WORK=$(mktemp -d /tmp/raahi-bench.XXXXXX)
chmod 755 "$WORK" # nginx workers run as an unprivileged user and create their temp dirs here

raahi_commit=$(git -C "$REPO" describe --always --dirty --abbrev=12 2>/dev/null || echo unknown)
echo "== raahi proxy load comparison ($(date -u '+%Y-%m-%d %H:%M:%SZ'), $(uname -r))"
echo "machine: $(nproc) CPUs, $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)," \
    "load average $(cut -d' ' -f1-3 /proc/loadavg) at start"
with_logs=0 logs_note=
if [[ " ${SCENARIO_LIST[*]} " == *" logs "* ]]; then
    with_logs=1 logs_note=" (logs scenario: a second process, RUST_LOG=info, RAAHI_LOG_FORMAT=json)"
fi
echo "raahi:   commit $raahi_commit, $("$RAAHI_BIN" --version 2>/dev/null || echo '?') ($RAAHI_BIN)," \
    "RUST_LOG=$RAAHI_LOG$logs_note"
echo "nginx:   $(nginx -v 2>&1 | sed 's/^nginx version: //')"
echo "haproxy: $(haproxy -v 2>&1 | head -n 1)"
echo "wrk:     $({ wrk -v 2>&1 || true; } | head -n 1)"
echo "h2load:  $({ h2load --version 2>&1 || true; } | head -n 1)"
echo "load:    ${DURATION}s per run, $ROUNDS round(s), warm-up ${WARMUP}s; scenarios: ${SCENARIO_LIST[*]};" \
    "wrk -t1 -c$CONNECTIONS (1 MiB: -c$BIG_CONNECTIONS), h2load -t1 -c$H2_CONNECTIONS -m$H2_STREAMS;" \
    "$WORKERS worker(s) per proxy; load generator + upstreams on CPU $LOADGEN_CPU, proxy on CPU $PROXY_CPU"
echo

# A self-signed ECDSA P-256 certificate for 127.0.0.1, shared by the three proxies.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=localhost \
    -addext 'subjectAltName=DNS:localhost,IP:127.0.0.1' \
    -keyout "$WORK/key.pem" -out "$WORK/cert.pem" >/dev/null 2>&1 || die "openssl could not make a certificate"
cat "$WORK/cert.pem" "$WORK/key.pem" >"$WORK/cert-and-key.pem"
chmod 644 "$WORK"/*.pem

head -c 1048576 /dev/zero >"$WORK/big.bin"
chmod 644 "$WORK/big.bin"

# Upstreams: three nginx origins, each in its own prefix.
UPSTREAM_PORTS=()
for i in 1 2 3; do
    dir=$WORK/upstream$i
    mkdir -p "$dir"
    free_port
    port=$FREE_PORT
    UPSTREAM_PORTS+=("$port")
    render "$TEMPLATES/upstream-nginx.conf.tmpl" "$dir/nginx.conf" DIR="$dir" PORT="$port" NAME="u$i" \
        BIG_FILE="$WORK/big.bin"
    start "upstream u$i (port $port)" "$LOADGEN_CPU" "$dir/stderr.log" "$dir/stderr.log" \
        nginx -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf"
    UPSTREAM_PIDS+=("$STARTED_PID")
    wait_200 "upstream u$i" "$STARTED_PID" "http://127.0.0.1:$port/" 30 "$dir/stderr.log"
done
up=(UPSTREAM1="${UPSTREAM_PORTS[0]}" UPSTREAM2="${UPSTREAM_PORTS[1]}" UPSTREAM3="${UPSTREAM_PORTS[2]}")

set_urls() { # PROXY HTTP_PORT H2C_PORT TLS_PORT [LOGS_PORT]
    URL[keepalive $1]=http://127.0.0.1:$2/
    URL[close $1]=http://127.0.0.1:$2/
    URL[big $1]=http://127.0.0.1:$2/big
    URL[h2c $1]=http://127.0.0.1:$3/
    URL[tls $1]=https://127.0.0.1:$4/
    if [[ -n ${5:-} ]]; then URL[logs $1]=http://127.0.0.1:$5/; fi
}

# nginx proxy
dir=$WORK/nginx
mkdir -p "$dir"
free_port && port=$FREE_PORT
free_port && h2c_port=$FREE_PORT
free_port && tls_port=$FREE_PORT
free_port && logs_port=$FREE_PORT
render "$TEMPLATES/proxy-nginx.conf.tmpl" "$dir/nginx.conf" DIR="$dir" PORT="$port" H2C_PORT="$h2c_port" \
    TLS_PORT="$tls_port" LOGS_PORT="$logs_port" CERT="$WORK/cert.pem" KEY="$WORK/key.pem" \
    WORKERS="$WORKERS" "${up[@]}"
start "nginx proxy (ports $port, h2c $h2c_port, tls $tls_port, logs $logs_port)" "$PROXY_CPU" \
    "$dir/stderr.log" "$dir/stderr.log" nginx -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf"
PID[nginx]=$STARTED_PID
set_urls nginx "$port" "$h2c_port" "$tls_port" "$logs_port"
ACCESS_LOG[nginx]=$dir/access.log

# haproxy proxy; its stdout carries the access log lines of the logs frontend, its stderr the rest
dir=$WORK/haproxy
mkdir -p "$dir"
free_port && port=$FREE_PORT
free_port && h2c_port=$FREE_PORT
free_port && tls_port=$FREE_PORT
free_port && logs_port=$FREE_PORT
render "$TEMPLATES/proxy-haproxy.cfg.tmpl" "$dir/haproxy.cfg" PORT="$port" H2C_PORT="$h2c_port" \
    TLS_PORT="$tls_port" LOGS_PORT="$logs_port" PEM="$WORK/cert-and-key.pem" WORKERS="$WORKERS" "${up[@]}"
haproxy -c -q -f "$dir/haproxy.cfg" >&2 || die "haproxy rejects $dir/haproxy.cfg"
start "haproxy proxy (ports $port, h2c $h2c_port, tls $tls_port, logs $logs_port)" "$PROXY_CPU" \
    "$dir/access.log" "$dir/stderr.log" haproxy -db -f "$dir/haproxy.cfg"
PID[haproxy]=$STARTED_PID
set_urls haproxy "$port" "$h2c_port" "$tls_port" "$logs_port"
ACCESS_LOG[haproxy]=$dir/access.log

admin_post() { # ADMIN_URL TOKEN PATH JSON: POSTs to a raahi admin API, prints the response body; fails unless 2xx
    local body=$WORK/admin-response.json status
    status=$(curl -s -o "$body" -w '%{http_code}' --max-time 10 --noproxy '*' \
        -H "Authorization: Bearer $2" -H 'Content-Type: application/json' \
        -X POST --data "$4" "$1$3") || die "POST $3: curl failed"
    [[ $status == 2?? ]] || die "POST $3 $4: HTTP $status: $(cat "$body")"
    cat "$body"
}
json_id() { grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$'; }

# start_raahi NAME DIR RUST_LOG LOG_FORMAT: starts a raahi proxy pinned to PROXY_CPU with its own
# ports, admin port, token and sqlite database in DIR, its stdout and stderr to DIR/raahi.log, and
# configures it through its admin API the way the other proxies are set up: a service with the
# three upstream targets and the route "all". HTTP/1.1 and h2c share its plain listener. Sets
# STARTED_PID, RAAHI_PORT and RAAHI_TLS_PORT.
start_raahi() {
    local name=$1 dir=$2 rust_log=$3 format=$4 port tls_port admin_port admin token pid service_id p
    mkdir -p "$dir"
    free_port && port=$FREE_PORT
    free_port && tls_port=$FREE_PORT
    free_port && admin_port=$FREE_PORT
    token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n') # 32 hex characters
    # Run from the private directory (env -C) so config/raahi.toml of the checkout is not picked up.
    start "$name (port $port, tls $tls_port, admin port $admin_port, RUST_LOG=$rust_log, $format)" \
        "$PROXY_CPU" "$dir/raahi.log" "$dir/raahi.log" \
        env -C "$dir" -u RAAHI_CONFIG -u RAAHI_PROXY_CLIENT_HEADER_TIMEOUT_MS \
        RAAHI_PROXY_LISTEN="127.0.0.1:$port" \
        RAAHI_PROXY_TLS_LISTEN="127.0.0.1:$tls_port" \
        RAAHI_TLS_CERT_FILE="$WORK/cert.pem" \
        RAAHI_TLS_KEY_FILE="$WORK/key.pem" \
        RAAHI_ADMIN_LISTEN="127.0.0.1:$admin_port" \
        RAAHI_DATABASE_URL="sqlite://$dir/raahi.db" \
        RAAHI_ADMIN_TOKEN="$token" \
        RAAHI_LOG_FORMAT="$format" RUST_LOG="$rust_log" \
        TOKIO_WORKER_THREADS="$WORKERS" \
        "$RAAHI_BIN" serve
    pid=$STARTED_PID
    admin=http://127.0.0.1:$admin_port
    wait_200 "$name admin API" "$pid" "$admin/healthz" 60 "$dir/raahi.log"

    # Idle upstream connections kept 120 s, as nginx keeps them (its upstream block's
    # `keepalive_timeout 120s`, bench/proxy-nginx.conf.tmpl) and the origins allow: with
    # raahi's default idle_ms (60 s), the logs scenario's process, idle between its runs for
    # longer than that, redialled its upstreams at the start of every run.
    service_id=$(admin_post "$admin" "$token" /api/v1/services \
        '{"name":"bench","timeouts":{"idle_ms":120000}}' | json_id)
    [[ -n $service_id ]] || die "$name: no id in the service creation response"
    for p in "${UPSTREAM_PORTS[@]}"; do
        admin_post "$admin" "$token" "/api/v1/services/$service_id/targets" \
            "{\"host\":\"127.0.0.1\",\"port\":$p}" >/dev/null
    done
    admin_post "$admin" "$token" /api/v1/routes "{\"name\":\"all\",\"service_id\":$service_id}" >/dev/null
    log "$name: service $service_id with 3 targets and route 'all' created"
    wait_200 "$name" "$pid" "http://127.0.0.1:$port/" 30 "$dir/raahi.log"
    STARTED_PID=$pid RAAHI_PORT=$port RAAHI_TLS_PORT=$tls_port
}

# raahi proxy for every scenario but logs, and for the memory measurements
start_raahi "raahi proxy" "$WORK/raahi" "$RAAHI_LOG" text
PID[raahi]=$STARTED_PID
set_urls raahi "$RAAHI_PORT" "$RAAHI_PORT" "$RAAHI_TLS_PORT"
if ((with_logs)); then
    # raahi's access log is process-wide, so the logs scenario has a raahi process of its own
    start_raahi "raahi proxy with access logs" "$WORK/raahi-logs" info json
    PID[logs raahi]=$STARTED_PID
    URL[logs raahi]=http://127.0.0.1:$RAAHI_PORT/
    ACCESS_LOG[raahi]=$WORK/raahi-logs/raahi.log
fi

declare -A PROXY_LOG=([raahi]=$WORK/raahi/raahi.log [nginx]=$WORK/nginx/error.log
    [haproxy]=$WORK/haproxy/stderr.log)
for proxy in "${PROXIES[@]}"; do
    wait_200 "$proxy proxy" "${PID[$proxy]}" "${URL[keepalive $proxy]}" 30 "${PROXY_LOG[$proxy]}"
done
for proxy in "${PROXIES[@]}"; do
    check_spread "$proxy"
    # one response's headers per proxy, for comparison (kept with KEEP_TMP=1)
    curl -s -D "$WORK/headers-$proxy.txt" -o /dev/null --max-time 2 --noproxy '*' "${URL[keepalive $proxy]}" || true
    for scenario in "${SCENARIO_LIST[@]}"; do
        probe "$scenario" "$proxy" && continue
        if [[ $scenario == tls && $proxy == raahi ]]; then
            # raahi's HTTPS listener may be missing from the binary under test
            log "warning: raahi does not answer HTTPS on ${URL[tls raahi]}; the tls scenario runs without it"
            SKIP[tls raahi]=1
        else
            die "$proxy does not answer the $scenario probe on ${URL[$scenario $proxy]}"
        fi
    done
done

if ((MEMORY)); then
    for proxy in "${PROXIES[@]}"; do IDLE_MEM[$proxy]=$(memory_kib "${PID[$proxy]}"); done
fi

if ((WARMUP > 0)); then
    log "warm-up: ${WARMUP}s per scenario and proxy"
    for scenario in "${SCENARIO_LIST[@]}"; do
        for proxy in "${PROXIES[@]}"; do
            [[ -n ${SKIP[$scenario $proxy]:-} ]] && continue
            run_load "$scenario" "$proxy" "$WARMUP" "$WORK/load-$scenario-$proxy-warmup.txt"
        done
    done
fi

for ((round = 1; round <= ROUNDS; round++)); do
    for scenario in "${SCENARIO_LIST[@]}"; do
        # the proxy that goes first changes each round, so none always follows the same one
        for ((i = 0; i < ${#PROXIES[@]}; i++)); do
            proxy=${PROXIES[$(((i + round - 1) % ${#PROXIES[@]}))]}
            [[ -n ${SKIP[$scenario $proxy]:-} ]] && continue
            measure "$scenario" "$proxy" "$round"
        done
    done
done
if ((SYSCALLS)); then
    log "syscalls: ${SYSCALL_SECONDS}s of each scenario's load per proxy, counted by perf stat"
    for scenario in "${SCENARIO_LIST[@]}"; do
        for proxy in "${PROXIES[@]}"; do
            [[ -n ${SKIP[$scenario $proxy]:-} ]] && continue
            trace_syscalls "$scenario" "$proxy"
        done
    done
fi
echo

if ((MEMORY)); then
    for proxy in "${PROXIES[@]}"; do AFTER_MEM[$proxy]=$(memory_kib "${PID[$proxy]}"); done
    for proxy in "${PROXIES[@]}"; do
        idle_connections "$proxy" silent
        idle_connections "$proxy" used
    done
fi

# Tables of medians; ratios are against nginx.
declare -A M_RPS M_P99 M_US M_PCT M_UP_CONNS
for scenario in "${SCENARIO_LIST[@]}"; do
    for proxy in "${PROXIES[@]}"; do
        key="$scenario $proxy"
        [[ -n ${SKIP[$key]:-} ]] && continue
        # shellcheck disable=SC2086 # the per-round values are space separated on purpose
        M_RPS[$key]=$(median ${RPS[$key]})
        # shellcheck disable=SC2086
        M_P99[$key]=$(median ${P99[$key]})
        # shellcheck disable=SC2086
        M_US[$key]=$(median ${CPU_US[$key]})
        # shellcheck disable=SC2086
        M_PCT[$key]=$(median ${CPU_PCT[$key]})
        # shellcheck disable=SC2086
        M_UP_CONNS[$key]=$(median ${UP_CONNS[$key]})
    done
done

declare -A SCENARIO_TITLE=(
    [keepalive]="HTTP/1.1 keep-alive, wrk -c$CONNECTIONS"
    [logs]="HTTP/1.1 keep-alive with access logs to a file, wrk -c$CONNECTIONS"
    [close]="HTTP/1.1, new connection per request, wrk -c$CONNECTIONS"
    [h2c]="h2c, h2load -c$H2_CONNECTIONS -m$H2_STREAMS"
    [tls]="HTTPS TLS 1.3, new connection per request with session resumption, wrk -c$CONNECTIONS"
    [big]="1 MiB response, wrk -c$BIG_CONNECTIONS"
)
echo "Medians over $ROUNDS round(s) of ${DURATION}s (ratios: proxy / nginx)"
for scenario in "${SCENARIO_LIST[@]}"; do
    echo
    echo "-- $scenario: ${SCENARIO_TITLE[$scenario]}"
    printf '%-8s %10s %7s %9s %7s %10s %7s %6s %8s  %s\n' \
        proxy 'req/s' 'ratio' 'p99 ms' 'ratio' 'CPU us/req' 'ratio' 'CPU' 'up conns' 'errors/requests'
    for proxy in "${PROXIES[@]}"; do
        key="$scenario $proxy"
        if [[ -n ${SKIP[$key]:-} ]]; then
            printf '%-8s %10s\n' "$proxy" 'not run'
            continue
        fi
        nkey="$scenario nginx"
        awk -v name="$proxy" -v rps="${M_RPS[$key]}" -v p99="${M_P99[$key]}" -v us="${M_US[$key]}" \
            -v pct="${M_PCT[$key]}" -v nrps="${M_RPS[$nkey]}" -v np99="${M_P99[$nkey]}" \
            -v nus="${M_US[$nkey]}" -v upc="${M_UP_CONNS[$key]}" \
            -v err="${ERRORS[$key]}" -v total="${TOTAL_REQS[$key]}" 'BEGIN {
            printf "%-8s %10.0f %7.2f %9.3f %7.2f %10.2f %7.2f %5.0f%% %8.0f  %s\n",
                name, rps, (nrps > 0 ? rps / nrps : 0), p99, (np99 > 0 ? p99 / np99 : 0),
                us, (nus > 0 ? us / nus : 0), pct, upc, err "/" total }'
    done
    if [[ $scenario == logs ]]; then
        printf 'access log lines/requests over all rounds:'
        for proxy in "${PROXIES[@]}"; do
            key="$scenario $proxy"
            [[ -n ${SKIP[$key]:-} ]] && continue
            printf ' %s %s/%s' "$proxy" "${LOG_LINES[$key]}" "${TOTAL_REQS[$key]}"
        done
        echo
    fi
done
echo
echo "(CPU us/req: user+system CPU time of the proxy process tree per completed request; CPU: its"
echo " share of one CPU during the run; up conns: connections the proxy opened to the upstreams"
echo " during a run; errors: non-2xx responses + socket errors over all rounds)"

# One line per scenario: raahi against nginx, what the goals of issue 8 are judged on.
echo
echo "Summary: raahi / nginx (req/s ratio, p99 ratio)"
for scenario in "${SCENARIO_LIST[@]}"; do
    key="$scenario raahi" nkey="$scenario nginx"
    [[ -n ${SKIP[$key]:-} ]] && { printf '  %-10s not run\n' "$scenario"; continue; }
    awk -v s="$scenario" -v r="${M_RPS[$key]}" -v n="${M_RPS[$nkey]}" -v p="${M_P99[$key]}" \
        -v np="${M_P99[$nkey]}" 'BEGIN { printf "  %-10s req/s %.2fx   p99 %.2fx\n", s, r / n, p / np }'
done

# raahi's CPU per request against both, the goals being a share of the better one's
echo
echo "Summary: raahi CPU us/req against haproxy and nginx (and the goal; p99's is <= 1.00x nginx everywhere)"
printf '  %-10s %9s %10s %8s %9s %7s  %s\n' scenario 'raahi us' 'haproxy us' 'ratio' 'nginx us' 'ratio' goal
for scenario in "${SCENARIO_LIST[@]}"; do
    key="$scenario raahi"
    [[ -n ${SKIP[$key]:-} ]] && { printf '  %-10s not run\n' "$scenario"; continue; }
    case $scenario in
    keepalive | h2c) goal='<= 0.90x haproxy' ;;
    logs) goal='<= 1.00x nginx' ;;
    *) goal=- ;;
    esac
    awk -v s="$scenario" -v r="${M_US[$key]}" -v h="${M_US[$scenario haproxy]}" -v n="${M_US[$scenario nginx]}" \
        -v goal="$goal" 'BEGIN { printf "  %-10s %9.2f %10.2f %7.2fx %9.2f %6.2fx  %s\n",
            s, r, h, (h > 0 ? r / h : 0), n, (n > 0 ? r / n : 0), goal }'
done

if ((SYSCALLS)); then
    echo
    echo "Syscalls and other kernel work per request, ${SYSCALL_SECONDS}s of each scenario's load counted by perf stat"
    for scenario in "${SCENARIO_LIST[@]}"; do
        echo
        echo "-- $scenario: ${SCENARIO_TITLE[$scenario]}"
        printf '%-8s %8s %7s %6s %6s %6s %6s %6s  %s\n' proxy 'req/s' 'sys' 'wakes' 'vcs' 'ics' 'faults' \
            'segs' 'by syscall (>= 0.01; [failed with EAGAIN])'
        for proxy in "${PROXIES[@]}"; do
            key="$scenario $proxy"
            if [[ -n ${SKIP[$key]:-} ]]; then
                printf '%-8s %8s\n' "$proxy" 'not run'
                continue
            fi
            echo "${SYS_LINE[$key]}"
            echo "         ${SYS_THREADS[$key]}"
        done
    done
    echo
    echo "(all per completed request: sys: syscalls of the proxy process tree; wakes: wake-ups its threads"
    echo " made (sched_waking: of the load generator, the upstreams, its own threads); vcs, ics: its"
    echo " voluntary (sleeps) and involuntary (preemptions) context switches, from /proc; faults: its page"
    echo " faults; segs: TCP segments sent by anyone, system-wide, on both sides of the proxy; other: the"
    echo " syscalls not counted one by one (see SYSCALL_NAMES); by thread: syscalls per request by thread"
    echo " name, summed over the threads of that name)"
fi

if ((MEMORY)); then
    echo
    echo "Memory of the proxy process tree, MiB (RSS summed over processes / PSS); $IDLE_CONNECTIONS idle"
    echo "client connections, silent: connected, no request yet; used: keep-alive after one request each:"
    printf '%-8s %15s %17s %17s %17s\n' proxy 'idle at start' 'idle after load' 'silent conns' 'used conns'
    for proxy in "${PROXIES[@]}"; do
        read -r a_rss a_pss <<<"${IDLE_MEM[$proxy]}"
        read -r b_rss b_pss <<<"${AFTER_MEM[$proxy]}"
        read -r c_rss c_pss <<<"${CONN_MEM[silent $proxy]}"
        read -r d_rss d_pss <<<"${CONN_MEM[used $proxy]}"
        printf '%-8s %7s / %5s %9s / %5s %9s / %5s %9s / %5s\n' "$proxy" "$(mib "$a_rss")" "$(mib "$a_pss")" \
            "$(mib "$b_rss")" "$(mib "$b_pss")" "$(mib "$c_rss")" "$(mib "$c_pss")" "$(mib "$d_rss")" "$(mib "$d_pss")"
    done
    for proxy in "${PROXIES[@]}"; do
        echo "  $proxy: silent: ${CONN_OPEN[silent $proxy]}; used: ${CONN_OPEN[used $proxy]}"
    done
fi

# Anything the proxies complained about.
echo
problems=0
raahi_log=$WORK/raahi/raahi.log
if grep -qE ' (WARN|ERROR) ' "$raahi_log"; then
    problems=1
    echo "raahi logged $(grep -cE ' (WARN|ERROR) ' "$raahi_log") warning/error line(s); first ones:"
    grep -E ' (WARN|ERROR) ' "$raahi_log" | head -n 5 | sed 's/^/  /'
fi
raahi_log=$WORK/raahi-logs/raahi.log # JSON lines
if [[ -e $raahi_log ]] && grep -qE '"level": *"(WARN|ERROR)"' "$raahi_log"; then
    problems=1
    echo "raahi (logs) logged $(grep -cE '"level": *"(WARN|ERROR)"' "$raahi_log") warning/error line(s); first ones:"
    grep -E '"level": *"(WARN|ERROR)"' "$raahi_log" | head -n 5 | cut -c1-300 | sed 's/^/  /'
fi
for f in "$WORK"/nginx/error.log "$WORK"/upstream*/error.log "$WORK"/haproxy/stderr.log; do
    if [[ -s $f ]] && grep -qvE '^\s*$' "$f"; then
        problems=1
        echo "${f#"$WORK"/}: $(wc -l <"$f") line(s); first ones:"
        head -n 3 "$f" | sed 's/^/  /'
    fi
done
((problems)) || echo "No warnings or errors in the proxies' logs."
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
