# Shared by the benchmarks that run several gateways on a throwaway PostgreSQL
# (scripts/bench-rate-limit.sh, scripts/bench-canary.sh). Source it after defining log, die,
# REPO and PG_BIN; it defines:
#   resolve_raahi_bin       RAAHI_BIN as given, or target/release/raahi built now
#   bench_workdir NAME      WORK (a temporary folder), PIDS, and the traps that stop every PID,
#                           stop PostgreSQL, keep WORK in $OUT when set, and remove it
#   free_port               FREE_PORT: a port no local socket uses
#   wait_200 URL SECONDS    until URL answers 200
#   start_postgres          a throwaway cluster in $WORK/pg: pg_port, DATABASE_URL
# Only 127.0.0.1 is ever contacted.

resolve_raahi_bin() {
    if [[ -n ${RAAHI_BIN:-} ]]; then
        [[ -x $RAAHI_BIN ]] || die "RAAHI_BIN=$RAAHI_BIN is not an executable file"
    else
        log "building raahi (cargo build --release)"
        (cd "$REPO" && cargo build --release >&2)
        RAAHI_BIN=${CARGO_TARGET_DIR:-$REPO/target}/release/raahi
        [[ $RAAHI_BIN == /* ]] || RAAHI_BIN=$REPO/$RAAHI_BIN
    fi
}

bench_cleanup() {
    local rc=$? pid
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    [[ -d $PG_DATA ]] && runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DATA" -m immediate stop >/dev/null 2>&1 || true
    if [[ -n ${OUT:-} ]]; then
        mkdir -p "$OUT" && cp -r "$WORK"/. "$OUT"/ && log "kept the output in $OUT"
    fi
    rm -rf "$WORK"
    exit "$rc"
}

bench_workdir() { # NAME
    WORK=$(mktemp -d "/tmp/raahi-$1.XXXXXX")
    chmod 755 "$WORK"
    PIDS=()
    PG_DATA=$WORK/pg/data
    trap bench_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

USED_PORTS=" "
free_port() {
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

wait_200() { # URL SECONDS
    local deadline=$((SECONDS + $2))
    until [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 --noproxy '*' "$1" || true) == 200 ]]; do
        ((SECONDS < deadline)) || die "$1 does not answer 200 after $2 s"
        sleep 0.2
    done
}

start_postgres() { # initdb refuses to run as root
    mkdir -p "$WORK/pg" && chown postgres "$WORK/pg"
    free_port && pg_port=$FREE_PORT
    runuser -u postgres -- "$PG_BIN/initdb" -D "$PG_DATA" -A trust -U postgres --no-sync >/dev/null
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$WORK/pg/log" -w \
        -o "-p $pg_port -k $WORK/pg -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
    DATABASE_URL="postgres://postgres@127.0.0.1:$pg_port/postgres"
}
