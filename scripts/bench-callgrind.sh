#!/usr/bin/env bash
# Instructions per proxied request, counted by callgrind: a figure that stays the same on a busy
# machine, unlike req/s, so each data-path change can be judged while others compile.
#
# Starts three nginx origin servers and raahi (under valgrind --tool=callgrind) as
# scripts/bench-proxy.sh does, warms raahi up, zeroes the counters, sends REQUESTS requests with
# h2load (HTTP/1.1 keep-alive; MODE=close: a new connection per request; MODE=h2c), dumps the counters and prints the
# instructions per request and the functions that cost the most (inclusive and self).
#
# Usage: scripts/bench-callgrind.sh     (needs valgrind, nginx, h2load, curl; builds raahi)
# Environment:
#   REQUESTS=5000    measured requests
#   CONNECTIONS=16   h2load connections
#   MODE=h1          h1 (HTTP/1.1 keep-alive), close (HTTP/1.1, "Connection: close": a new
#                    connection per request) or h2c (prior knowledge, 8 streams a connection)
#   RAAHI_LOG=warn   RUST_LOG for raahi (info writes the access log)
#   WORKERS=1        TOKIO_WORKER_THREADS
#   EVENT_CLIENTS=0  event-stream clients (curl -N on /api/v1/events) connected while measuring
#   ROUTE_EXTRA=...  more fields of the route, as JSON members: '"max_in_flight":1000'
#   RAAHI_BIN=...    use this raahi binary instead of building target/release/raahi
#   OUT=DIR          keep the callgrind output and annotations in DIR (default: a temporary dir,
#                    removed at the end)
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
TEMPLATES=$SCRIPT_DIR/bench
REQUESTS=${REQUESTS:-5000}
CONNECTIONS=${CONNECTIONS:-16}
MODE=${MODE:-h1}
RAAHI_LOG=${RAAHI_LOG:-warn}
WORKERS=${WORKERS:-1}
EVENT_CLIENTS=${EVENT_CLIENTS:-0}

log() { printf '[callgrind] %s\n' "$*" >&2; }
die() { printf '[callgrind] error: %s\n' "$*" >&2; exit 1; }

[[ $REQUESTS =~ ^[0-9]+$ && $REQUESTS -ge 100 ]] || die "REQUESTS must be a whole number >= 100"
[[ $CONNECTIONS =~ ^[0-9]+$ && $CONNECTIONS -ge 1 ]] || die "CONNECTIONS must be at least 1"
[[ $MODE =~ ^(h1|close|h2c)$ ]] || die "MODE must be h1, close or h2c"
[[ $EVENT_CLIENTS =~ ^[0-9]+$ ]] || die "EVENT_CLIENTS must be a whole number"
for cmd in valgrind callgrind_control callgrind_annotate nginx h2load curl; do
    command -v "$cmd" >/dev/null 2>&1 || die "$cmd is missing (apt-get install valgrind nginx nghttp2-client curl)"
done

if [[ -n ${RAAHI_BIN:-} ]]; then
    [[ -x $RAAHI_BIN ]] || die "RAAHI_BIN=$RAAHI_BIN is not an executable file"
    RAAHI_BIN=$(cd "$(dirname "$RAAHI_BIN")" && pwd)/$(basename "$RAAHI_BIN")
else
    log "building raahi (cargo build --release)"
    (cd "$REPO" && cargo build --release >&2)
    RAAHI_BIN=${CARGO_TARGET_DIR:-$REPO/target}/release/raahi
    [[ $RAAHI_BIN == /* ]] || RAAHI_BIN=$REPO/$RAAHI_BIN
fi

WORK=$(mktemp -d /tmp/raahi-callgrind.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() {
    local rc=$? pid
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [[ -n ${OUT:-} ]]; then
        mkdir -p "$OUT" && cp -r "$WORK"/. "$OUT"/ && log "kept the output in $OUT"
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

USED_PORTS=" "
free_port() { # sets FREE_PORT to a port no local socket uses
    local port hex
    while :; do
        port=$((20000 + RANDOM % 12000))
        [[ $USED_PORTS == *" $port "* ]] && continue
        hex=$(printf '%04X' "$port")
        grep -qE "^ *[0-9]+: [0-9A-F]+:$hex " /proc/net/tcp /proc/net/tcp6 2>/dev/null && continue
        USED_PORTS+="$port "
        FREE_PORT=$port
        return 0
    done
}

wait_200() { # URL SECONDS [PID that must stay alive]
    local deadline=$((SECONDS + $2))
    until [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 --noproxy '*' "$1" || true) == 200 ]]; do
        ((SECONDS < deadline)) || die "$1 does not answer 200 after $2 s"
        [[ -z ${3:-} ]] || kill -0 "$3" 2>/dev/null || die "the server for $1 exited (see its log in OUT=...)"
        sleep 0.2
    done
}

head -c 1048576 /dev/zero >"$WORK/big.bin"
UPSTREAM_PORTS=()
for i in 1 2 3; do
    dir=$WORK/upstream$i
    mkdir -p "$dir"
    free_port
    UPSTREAM_PORTS+=("$FREE_PORT")
    sed -e "s|@DIR@|$dir|g" -e "s|@PORT@|$FREE_PORT|g" -e "s|@NAME@|u$i|g" -e "s|@BIG_FILE@|$WORK/big.bin|g" \
        "$TEMPLATES/upstream-nginx.conf.tmpl" >"$dir/nginx.conf"
    nginx -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf" >"$dir/stderr.log" 2>&1 </dev/null &
    PIDS+=("$!")
    wait_200 "http://127.0.0.1:$FREE_PORT/" 30
done

dir=$WORK/raahi
mkdir -p "$dir"
free_port && port=$FREE_PORT
free_port && admin_port=$FREE_PORT
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
(
    cd "$dir"
    exec env -u RAAHI_CONFIG RAAHI_PROXY_LISTEN="127.0.0.1:$port" \
        RAAHI_ADMIN_LISTEN="127.0.0.1:$admin_port" RAAHI_DATABASE_URL="sqlite://$dir/raahi.db" \
        RAAHI_ADMIN_TOKEN="$token" RAAHI_LOG_FORMAT=json RUST_LOG="$RAAHI_LOG" \
        TOKIO_WORKER_THREADS="$WORKERS" \
        valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.out.%p" "$RAAHI_BIN" serve
) >"$dir/raahi.log" 2>"$dir/raahi.err" </dev/null &
RAAHI_PID=$!
PIDS+=("$RAAHI_PID")
log "raahi under callgrind: pid $RAAHI_PID, port $port"
wait_200 "http://127.0.0.1:$admin_port/healthz" 300 "$RAAHI_PID"

admin_post() {
    curl -sf --max-time 30 --noproxy '*' -H "Authorization: Bearer $token" \
        -H 'Content-Type: application/json' -X POST --data "$2" "http://127.0.0.1:$admin_port$1" ||
        die "POST $1 failed"
}
service_id=$(admin_post /api/v1/services '{"name":"bench"}' | grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$')
for p in "${UPSTREAM_PORTS[@]}"; do
    admin_post "/api/v1/services/$service_id/targets" "{\"host\":\"127.0.0.1\",\"port\":$p}" >/dev/null
done
admin_post /api/v1/routes "{\"name\":\"all\",\"service_id\":$service_id${ROUTE_EXTRA:+,$ROUTE_EXTRA}}" >/dev/null
wait_200 "http://127.0.0.1:$port/" 60

for ((i = 0; i < EVENT_CLIENTS; i++)); do
    curl -sN --noproxy '*' -H "Authorization: Bearer $token" \
        "http://127.0.0.1:$admin_port/api/v1/events" >"$WORK/events$i.txt" 2>/dev/null &
    PIDS+=("$!")
done
if ((EVENT_CLIENTS > 0)); then
    deadline=$((SECONDS + 60))
    until (($(grep -l '^event: snapshot' "$WORK"/events*.txt 2>/dev/null | wc -l) == EVENT_CLIENTS)); do
        ((SECONDS < deadline)) || die "the event-stream clients got no snapshot"
        sleep 0.2
    done
    log "$EVENT_CLIENTS event-stream clients connected"
fi

load=(h2load -c"$CONNECTIONS" --h1)
[[ $MODE == close ]] && load=(h2load -c"$CONNECTIONS" --h1 -H 'Connection: close')
[[ $MODE == h2c ]] && load=(h2load -c"$CONNECTIONS" -m8)
log "warm-up: 1000 requests"
"${load[@]}" -n 1000 "http://127.0.0.1:$port/" >"$WORK/warmup.txt" 2>&1 || die "warm-up load failed"

callgrind_control -z "$RAAHI_PID" >/dev/null 2>&1
log "measuring $REQUESTS requests ($MODE, $CONNECTIONS connections)"
"${load[@]}" -n "$REQUESTS" "http://127.0.0.1:$port/" >"$WORK/load.txt" 2>&1 || die "load failed"
callgrind_control -d "$RAAHI_PID" >/dev/null 2>&1
succeeded=$(awk '/^requests: / {print $8}' "$WORK/load.txt")
[[ $succeeded == "$REQUESTS" ]] || { cat "$WORK/load.txt" >&2; die "only $succeeded of $REQUESTS requests succeeded"; }

# the dump written by -d is the newest callgrind.out.PID.N
sleep 1
dump=$(find "$dir" -name 'callgrind.out.*.[0-9]*' -printf '%T@ %p\n' | sort -rn | awk 'NR == 1 {print $2}')
[[ -n $dump ]] || die "no callgrind dump in $dir"
total=$(awk '/^(summary|totals):/ {print $2; exit}' "$dump")
# (whole files: head in a pipe would end callgrind_annotate with SIGPIPE, and pipefail with it)
callgrind_annotate --inclusive=yes "$dump" >"$WORK/inclusive.txt" 2>/dev/null
callgrind_annotate "$dump" >"$WORK/self.txt" 2>/dev/null
cp "$dump" "$WORK/measured.callgrind"

echo "raahi $(git -C "$REPO" describe --always --dirty --abbrev=12 2>/dev/null || echo '?'), $MODE," \
    "RUST_LOG=$RAAHI_LOG, $CONNECTIONS connections, $REQUESTS requests, $EVENT_CLIENTS event-stream clients"
awk -v t="$total" -v n="$REQUESTS" 'BEGIN { printf "instructions per request: %.0f (all threads, total %d)\n", t / n, t }'
echo
echo "Top functions by self cost:"
sed -n '/^ *Ir/,$p' "$WORK/self.txt" | sed -n 1,30p
