#!/usr/bin/env bash
# Cluster-scope rate limit accuracy (issue 37's goal): three gateways on one PostgreSQL, one
# route limited to RATE requests/s for the whole route ("key": "route", "scope": "cluster"),
# load split 70/20/10 over the gateways at OFFERED requests/s for SECONDS; prints the requests
# each gateway admitted (2xx) and refused (429), the admitted rate against the limit, and the
# store writes of the demand exchange per gateway and second.
#
# Usage: scripts/bench-rate-limit.sh     (needs nginx, h2load, curl, PostgreSQL 15; builds raahi)
# Environment:
#   RATE=1000          the route's limit, requests/s
#   OFFERED="1200 5000" offered loads to measure, requests/s, split 70/20/10
#   SECONDS_EACH=20    measured seconds per offered load (after 3 s of warm-up)
#   RATE_SYNC_MS=250   cluster.rate_sync_ms
#   RAAHI_BIN=...      use this raahi binary instead of building target/release/raahi
#   OUT=DIR            keep the logs in DIR
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
TEMPLATES=$SCRIPT_DIR/bench
RATE=${RATE:-1000}
OFFERED=${OFFERED:-1200 5000}
SECONDS_EACH=${SECONDS_EACH:-20}
RATE_SYNC_MS=${RATE_SYNC_MS:-250}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}

log() { printf '[rate-limit] %s\n' "$*" >&2; }
die() { printf '[rate-limit] error: %s\n' "$*" >&2; exit 1; }

for cmd in nginx h2load curl runuser; do
    command -v "$cmd" >/dev/null 2>&1 || die "$cmd is missing (apt-get install nginx nghttp2-client curl)"
done
[[ -x $PG_BIN/initdb ]] || die "PostgreSQL is missing at $PG_BIN (apt-get install postgresql-15)"

# shellcheck source=bench/cluster-lib.sh
source "$SCRIPT_DIR/bench/cluster-lib.sh"
resolve_raahi_bin
bench_workdir rate-limit
start_postgres
psql_value() { "$PG_BIN/psql" -h 127.0.0.1 -p "$pg_port" -U postgres -At -c "$1" postgres; }

head -c 16 /dev/zero >"$WORK/big.bin"
dir=$WORK/upstream
mkdir -p "$dir"
free_port && upstream_port=$FREE_PORT
sed -e "s|@DIR@|$dir|g" -e "s|@PORT@|$upstream_port|g" -e "s|@NAME@|u1|g" -e "s|@BIG_FILE@|$WORK/big.bin|g" \
    "$TEMPLATES/upstream-nginx.conf.tmpl" >"$dir/nginx.conf"
nginx -p "$dir/" -e "$dir/error.log" -c "$dir/nginx.conf" >"$dir/stderr.log" 2>&1 </dev/null &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$upstream_port/" 30

token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
PROXY_PORTS=()
ADMIN_PORTS=()
for i in 1 2 3; do
    dir=$WORK/raahi$i
    mkdir -p "$dir"
    free_port && port=$FREE_PORT
    free_port && admin_port=$FREE_PORT
    PROXY_PORTS+=("$port")
    ADMIN_PORTS+=("$admin_port")
    (
        cd "$dir"
        exec env -u RAAHI_CONFIG RAAHI_PROXY_LISTEN="127.0.0.1:$port" \
            RAAHI_ADMIN_LISTEN="127.0.0.1:$admin_port" RAAHI_DATABASE_URL="$DATABASE_URL" \
            RAAHI_ADMIN_TOKEN="$token" RAAHI_CLUSTER_INSTANCE_ID="gw$i" \
            RAAHI_CLUSTER_RATE_SYNC_MS="$RATE_SYNC_MS" RUST_LOG=warn TOKIO_WORKER_THREADS=1 \
            "$RAAHI_BIN" serve
    ) >"$dir/raahi.log" 2>"$dir/raahi.err" </dev/null &
    PIDS+=("$!")
    wait_200 "http://127.0.0.1:$admin_port/healthz" 120
done

admin_post() {
    curl -sf --max-time 30 --noproxy '*' -H "Authorization: Bearer $token" \
        -H 'Content-Type: application/json' -X POST --data "$2" "http://127.0.0.1:${ADMIN_PORTS[0]}$1" ||
        die "POST $1 failed"
}
service_id=$(admin_post /api/v1/services '{"name":"bench"}' | grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$')
admin_post "/api/v1/services/$service_id/targets" "{\"host\":\"127.0.0.1\",\"port\":$upstream_port}" >/dev/null
route_id=$(admin_post /api/v1/routes "{\"name\":\"limited\",\"service_id\":$service_id,
    \"rate_limit\":{\"requests_per_second\":$RATE,\"burst\":$((RATE / 10)),\"key\":\"route\",\"scope\":\"cluster\"}}" |
    grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$')
for port in "${PROXY_PORTS[@]}"; do
    deadline=$((SECONDS + 60))
    until [[ $(curl -s -o /dev/null -w '%{http_code}' --noproxy '*' "http://127.0.0.1:$port/") =~ ^(200|429)$ ]]; do
        ((SECONDS < deadline)) || die "gateway on $port never routed"
        sleep 0.2
    done
done

demand_writes() {
    psql_value "SELECT COALESCE(SUM(n_tup_ins + n_tup_upd), 0) FROM pg_stat_user_tables WHERE relname LIKE 'rate_limit%'"
}

# h2load --rps is per client: CLIENTS clients at RPS each.
load() { # PORT TOTAL_RPS SECONDS OUTFILE
    local clients=$(( ($2 + 99) / 100 )) rps
    rps=$(( $2 / clients ))
    h2load --h1 -c "$clients" --rps "$rps" -D "$3" "http://127.0.0.1:$1/" >"$4" 2>&1 || true
}

status_count() { # FILE CLASS(2xx|4xx|5xx)
    awk -v class="$2" '/^status codes:/ {
        for (i = 1; i <= NF; i++) if ($(i+1) == class",") {print $i; exit}
        for (i = 1; i <= NF; i++) if ($(i+1) == class) {print $i; exit}
    }' "$1"
}

printf '\n| offered/s | gateway | share of load | admitted/s | refused/s | 5xx |\n|---|---|---|---|---|---|\n'
for offered in $OFFERED; do
    split=($((offered * 70 / 100)) $((offered * 20 / 100)) $((offered * 10 / 100)))
    # warm-up: the shares settle
    loads=()
    for i in 0 1 2; do load "${PROXY_PORTS[$i]}" "${split[$i]}" 3 "$WORK/warm$i.txt" & loads+=("$!"); done
    wait "${loads[@]}"
    writes_before=$(demand_writes)
    loads=()
    for i in 0 1 2; do
        load "${PROXY_PORTS[$i]}" "${split[$i]}" "$SECONDS_EACH" "$WORK/load-$offered-$i.txt" &
        loads+=("$!")
    done
    wait "${loads[@]}"
    writes_after=$(demand_writes)
    admitted_total=0
    for i in 0 1 2; do
        file=$WORK/load-$offered-$i.txt
        ok=$(status_count "$file" 2xx); refused=$(status_count "$file" 4xx); failed=$(status_count "$file" 5xx)
        admitted_total=$((admitted_total + ok))
        printf '| %d | gw%d | %d %% | %.1f | %.1f | %d |\n' "$offered" $((i + 1)) $((100 * split[i] / offered)) \
            "$(echo "$ok / $SECONDS_EACH" | bc -l)" "$(echo "$refused / $SECONDS_EACH" | bc -l)" "$failed"
    done
    printf '| %d | **all** | 100 %% | **%.1f** (limit %d: %+.1f %%) | | |\n' "$offered" \
        "$(echo "$admitted_total / $SECONDS_EACH" | bc -l)" "$RATE" \
        "$(echo "100 * ($admitted_total / $SECONDS_EACH - $RATE) / $RATE" | bc -l)"
    log "store writes of the exchange: $(( (writes_after - writes_before) )) rows in $SECONDS_EACH s for 3 gateways and 1 hot key: $(echo "($writes_after - $writes_before) / $SECONDS_EACH / 3" | bc -l | cut -c1-5) per gateway per second"
done
curl -s --noproxy '*' -H "Authorization: Bearer $token" "http://127.0.0.1:${ADMIN_PORTS[0]}/api/v1/routes/$route_id/rate-limit" >"$WORK/view.json" || true
log "gw1's view: $(head -c 1500 "$WORK/view.json")"
