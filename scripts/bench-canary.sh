#!/usr/bin/env bash
# Canary goals (issue 34): two gateways on one PostgreSQL.
#  1. share: a canary held at a 5 % step gets 5.0 % ± 0.3 points of REQUESTS requests sent half
#     through each gateway, with 1 and with 3 canary targets;
#  2. rollback: a canary progressing on INTERVAL_MS intervals under steady load starts failing
#     one request in ten; the time until both gateways send it nothing, in intervals (goal: two
#     of the first bad one), and the canary's requests after that (goal: none).
#
# Usage: scripts/bench-canary.sh     (needs h2load, curl, python3, PostgreSQL 15; builds raahi)
# Environment:
#   REQUESTS=20000     requests of the share measurement (half through each gateway)
#   CANARY_TARGETS="1 3"
#   INTERVAL_MS=5000   the rollback scenario's step_interval_ms
#   RPS=200            the rollback scenario's load per gateway, requests/s
#   RAAHI_BIN=...      use this raahi binary instead of building target/release/raahi
#   OUT=DIR            keep the logs in DIR
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
REQUESTS=${REQUESTS:-20000}
CANARY_TARGETS=${CANARY_TARGETS:-1 3}
INTERVAL_MS=${INTERVAL_MS:-5000}
RPS=${RPS:-200}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}

log() { printf '[canary] %s\n' "$*" >&2; }
die() { printf '[canary] error: %s\n' "$*" >&2; exit 1; }

for cmd in h2load curl python3 runuser; do
    command -v "$cmd" >/dev/null 2>&1 || die "$cmd is missing (apt-get install nghttp2-client curl python3)"
done
[[ -x $PG_BIN/initdb ]] || die "PostgreSQL is missing at $PG_BIN (apt-get install postgresql-15)"

# shellcheck source=bench/cluster-lib.sh
source "$SCRIPT_DIR/bench/cluster-lib.sh"
resolve_raahi_bin
bench_workdir canary
now_ms() { date +%s%3N; }

start_postgres

# Targets: counting asyncio servers (scripts/bench/retry_upstream.py), two stable, three canary.
declare -A UPSTREAM_PORT
for name in s1 s2 c1 c2 c3; do
    free_port && UPSTREAM_PORT[$name]=$FREE_PORT
    python3 "$SCRIPT_DIR/bench/retry_upstream.py" --port "$FREE_PORT" --name "$name" \
        >"$WORK/$name.out" 2>"$WORK/$name.err" </dev/null &
    PIDS+=("$!")
done
for name in s1 s2 c1 c2 c3; do
    deadline=$((SECONDS + 30))
    until curl -sf --noproxy '*' "http://127.0.0.1:${UPSTREAM_PORT[$name]}/__hits" >/dev/null; do
        ((SECONDS < deadline)) || die "upstream $name does not answer"
        sleep 0.1
    done
done
hits() { # NAME...: the sum of their hits
    local total=0 name n
    for name in "$@"; do
        n=$(curl -sf --noproxy '*' "http://127.0.0.1:${UPSTREAM_PORT[$name]}/__hits" |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["hits"])')
        total=$((total + n))
    done
    echo "$total"
}

token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
PROXY_PORTS=()
ADMIN_PORTS=()
for i in 1 2; do
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
            RAAHI_ADMIN_TOKEN="$token" RAAHI_CLUSTER_INSTANCE_ID="gw$i" RUST_LOG=warn \
            "$RAAHI_BIN" serve
    ) >"$dir/raahi.log" 2>"$dir/raahi.err" </dev/null &
    PIDS+=("$!")
    wait_200 "http://127.0.0.1:$admin_port/healthz" 120
done

api() { # METHOD PATH [BODY]
    curl -sf --max-time 30 --noproxy '*' -H "Authorization: Bearer $token" \
        -H 'Content-Type: application/json' -X "$1" ${3:+--data "$3"} \
        "http://127.0.0.1:${ADMIN_PORTS[0]}$2" || die "$1 $2 failed"
}
id_of() { python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])'; }
service() { # NAME TARGET...: prints the service id
    local id name
    id=$(api POST /api/v1/services "{\"name\":\"$1\"}" | id_of)
    shift
    for name in "$@"; do
        api POST "/api/v1/services/$id/targets" \
            "{\"host\":\"127.0.0.1\",\"port\":${UPSTREAM_PORT[$name]}}" >/dev/null
    done
    echo "$id"
}
weight_on() { # ADMIN_PORT ROUTE_NAME: raahi_canary_weight of the route on that gateway
    curl -s --noproxy '*' "http://127.0.0.1:$1/metrics" |
        awk -v series="raahi_canary_weight{route=\"$2\"}" '$1 == series {print $2}'
}
wait_weight() { # ROUTE_NAME WEIGHT SECONDS: both gateways apply it
    local deadline=$((SECONDS + $3)) port
    for port in "${ADMIN_PORTS[@]}"; do
        until [[ $(weight_on "$port" "$1") == "$2" ]]; do
            ((SECONDS < deadline)) || die "gateway $port does not apply weight $2 to $1"
            sleep 0.05
        done
    done
}

stable_id=$(service stable s1 s2)

printf '\n| canary targets | requests | canary share | goal |\n|---|---|---|---|\n'
for count in $CANARY_TARGETS; do
    names=(c1 c2 c3)
    names=("${names[@]:0:count}")
    canary_id=$(service "canary-$count" "${names[@]}")
    route_id=$(api POST /api/v1/routes "{\"name\":\"share-$count\",\"path_prefix\":\"/share-$count\",
        \"backends\":[{\"service_id\":$stable_id},{\"service_id\":$canary_id}],
        \"canary\":{\"backend\":1,\"steps\":[5,100],\"step_interval_ms\":86400000}}" | id_of)
    wait_weight "share-$count" 5 30
    stable_before=$(hits s1 s2)
    canary_before=$(hits "${names[@]}")
    half=$((REQUESTS / 2))
    h2load --h1 -c 10 -n "$half" "http://127.0.0.1:${PROXY_PORTS[0]}/share-$count/" >"$WORK/share-$count-1.txt" 2>&1 &
    first=$!
    h2load --h1 -c 10 -n "$half" "http://127.0.0.1:${PROXY_PORTS[1]}/share-$count/" >"$WORK/share-$count-2.txt" 2>&1
    wait "$first"
    stable=$(($(hits s1 s2) - stable_before))
    canary=$(($(hits "${names[@]}") - canary_before))
    printf '| %d | %d | **%.2f %%** | 5.0 %% ± 0.3 |\n' "$count" $((stable + canary)) \
        "$(echo "100 * $canary / ($stable + $canary)" | bc -l)"
    api DELETE "/api/v1/routes/$route_id" >/dev/null
done

# Rollback: progressing under steady load, then one request in ten fails.
canary_id=$(service canary-rollback c1 c2 c3)
route_id=$(api POST /api/v1/routes "{\"name\":\"rollback\",\"path_prefix\":\"/rollback\",
    \"backends\":[{\"service_id\":$stable_id},{\"service_id\":$canary_id}],
    \"canary\":{\"backend\":1,\"steps\":[5,25,50,100],\"step_interval_ms\":$INTERVAL_MS,
        \"min_requests\":50,\"max_error_percent\":1.0}}" | id_of)
duration=$(( (INTERVAL_MS * 6) / 1000 + 10 ))
for i in 0 1; do
    h2load --h1 -c 4 --rps $((RPS / 4)) -D "$duration" "http://127.0.0.1:${PROXY_PORTS[$i]}/rollback/" \
        >"$WORK/rollback-load-$i.txt" 2>&1 &
    PIDS+=("$!")
done
wait_weight rollback 25 $((INTERVAL_MS * 3 / 1000 + 10))
bad_at=$(now_ms)
for name in c1 c2 c3; do
    curl -sf --noproxy '*' "http://127.0.0.1:${UPSTREAM_PORT[$name]}/__mode/500-1-in-10" >/dev/null
done
deadline=$((SECONDS + INTERVAL_MS * 4 / 1000 + 10))
for port in "${ADMIN_PORTS[@]}"; do
    until [[ $(weight_on "$port" rollback) == 0 ]]; do
        ((SECONDS < deadline)) || die "the canary was not rolled back on $port"
        sleep 0.05
    done
done
zero_at=$(now_ms)
# Requests already on their way when the weight went to 0 may still arrive; then none.
sleep 1
after_before=$(hits c1 c2 c3)
sleep "$(echo "2 * $INTERVAL_MS / 1000" | bc -l)"
after=$(($(hits c1 c2 c3) - after_before))
view=$(api GET "/api/v1/routes/$route_id/canary")
reason=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["reason"])' "$view")
printf '\n| scenario | from the first bad request to 0 %% on both gateways | canary requests in the 2 intervals after | goal |\n|---|---|---|---|\n'
printf '| 10 %% errors at step 2 (25 %%), %d ms intervals, %d req/s per gateway | **%d ms (%.2f intervals)** | **%d** | ≤ 2 intervals, then 0 |\n' \
    "$INTERVAL_MS" "$RPS" $((zero_at - bad_at)) "$(echo "($zero_at - $bad_at) / $INTERVAL_MS" | bc -l)" "$after"
log "the decision: $reason"
