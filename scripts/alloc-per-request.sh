#!/usr/bin/env bash
# Heap allocations (and instructions) per proxied request on the two TLS paths of issue 38 item 9's
# review, counted by callgrind as calls into jemalloc's entry points (raahi's global allocator):
#   PATH_UNDER=tls-listener  h2load --h1 over TLS to raahi's TLS listener -> a plain nginx target
#   PATH_UNDER=https-target  h2load --h1 to raahi's plain listener -> an nginx https target
#                            (TLS, ALPN http/1.1 only, so raahi sends on hyper-util's client)
# Usage: RAAHI_BIN=... PATH_UNDER=... [REQUESTS=4000] [CONNECTIONS=4] bash scripts/alloc-per-request.sh
# Only 127.0.0.1 is contacted.
set -euo pipefail
REQUESTS=${REQUESTS:-4000}
CONNECTIONS=${CONNECTIONS:-4}
PATH_UNDER=${PATH_UNDER:?tls-listener or https-target}
RAAHI_BIN=${RAAHI_BIN:?a raahi release binary}
MAX_ATTEMPTS=${MAX_ATTEMPTS:-3}

WORK=$(mktemp -d /tmp/raahi-alloc.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    [[ -n ${KEEP:-} ]] || rm -rf "$WORK"
}
trap cleanup EXIT
port_free() { ! grep -qE "^ *[0-9]+: [0-9A-F]+:$(printf '%04X' "$1") " /proc/net/tcp; }
free_port() { local p; while :; do p=$((20000 + RANDOM % 12000)); port_free "$p" && { echo "$p"; return; }; done; }
wait_200() {
    local deadline=$((SECONDS + $2))
    until [[ $(curl -sk -o /dev/null -w '%{http_code}' --max-time 2 --noproxy '*' "$1" || true) == 200 ]]; do
        ((SECONDS < deadline)) || { echo "no 200 from $1" >&2; exit 1; }
        sleep 0.2
    done
}

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=localhost \
    -addext 'subjectAltName=DNS:localhost,IP:127.0.0.1' \
    -keyout "$WORK/key.pem" -out "$WORK/cert.pem" >/dev/null 2>&1
chmod 644 "$WORK"/*.pem

plain_port=$(free_port)
tls_origin_port=$(free_port)
mkdir -p "$WORK/nginx"
cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    client_body_temp_path $WORK/nginx/cb; proxy_temp_path $WORK/nginx/p;
    fastcgi_temp_path $WORK/nginx/f; uwsgi_temp_path $WORK/nginx/u; scgi_temp_path $WORK/nginx/s;
    keepalive_timeout 120s;
    keepalive_requests 100000000;
    server {
        listen 127.0.0.1:$plain_port;
        listen 127.0.0.1:$tls_origin_port ssl;
        ssl_certificate $WORK/cert.pem;
        ssl_certificate_key $WORK/key.pem;
        location / { return 200 "ok\n"; }
    }
}
EOF
nginx -p "$WORK/nginx/" -e "$WORK/nginx/error.log" -c "$WORK/nginx/nginx.conf" >/dev/null 2>&1 </dev/null &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$plain_port/" 30

port=$(free_port)
tls_port=$(free_port)
admin_port=$(free_port)
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
mkdir -p "$WORK/raahi"
(
    cd "$WORK/raahi"
    exec env -u RAAHI_CONFIG RAAHI_PROXY_LISTEN="127.0.0.1:$port" \
        RAAHI_PROXY_TLS_LISTEN="127.0.0.1:$tls_port" RAAHI_TLS_CERT_FILE="$WORK/cert.pem" \
        RAAHI_TLS_KEY_FILE="$WORK/key.pem" \
        RAAHI_ADMIN_LISTEN="127.0.0.1:$admin_port" RAAHI_DATABASE_URL="sqlite://$WORK/raahi/raahi.db" \
        RAAHI_ADMIN_TOKEN="$token" RUST_LOG=warn TOKIO_WORKER_THREADS=1 \
        valgrind --tool=callgrind --callgrind-out-file="$WORK/raahi/callgrind.out.%p" "$RAAHI_BIN" serve
) >"$WORK/raahi/log" 2>&1 </dev/null &
RAAHI_PID=$!
PIDS+=("$RAAHI_PID")
wait_200 "http://127.0.0.1:$admin_port/healthz" 300
admin_post() {
    curl -sf --max-time 30 --noproxy '*' -H "Authorization: Bearer $token" \
        -H 'Content-Type: application/json' -X POST --data "$2" "http://127.0.0.1:$admin_port$1"
}
if [[ $PATH_UNDER == tls-listener ]]; then
    service='{"name":"bench","max_attempts":'$MAX_ATTEMPTS'}'
    target_port=$plain_port
    url=https://127.0.0.1:$tls_port/
else
    service='{"name":"bench","protocol":"https","tls_verify":false,"max_attempts":'$MAX_ATTEMPTS'}'
    target_port=$tls_origin_port
    url=http://127.0.0.1:$port/
fi
service_id=$(admin_post /api/v1/services "$service" | grep -o '"id": *[0-9]*' | head -n 1 | grep -o '[0-9]*$')
admin_post "/api/v1/services/$service_id/targets" "{\"host\":\"127.0.0.1\",\"port\":$target_port}" >/dev/null
admin_post /api/v1/routes "{\"name\":\"all\",\"service_id\":$service_id}" >/dev/null
wait_200 "$url" 60

load=(h2load -c"$CONNECTIONS" --h1)
"${load[@]}" -n 1000 "$url" >"$WORK/warmup.txt" 2>&1
callgrind_control -z "$RAAHI_PID" >/dev/null 2>&1
"${load[@]}" -n "$REQUESTS" "$url" >"$WORK/load.txt" 2>&1
callgrind_control -d "$RAAHI_PID" >/dev/null 2>&1
succeeded=$(awk '/^requests: / {print $8}' "$WORK/load.txt")
[[ $succeeded == "$REQUESTS" ]] || { cat "$WORK/load.txt" >&2; exit 1; }
sleep 1
dump=$(find "$WORK/raahi" -name 'callgrind.out.*.[0-9]*' -printf '%T@ %p\n' | sort -rn | awk 'NR == 1 {print $2}')
python3 - "$dump" "$REQUESTS" "$PATH_UNDER" <<'PY'
import re, sys
path, n, under = sys.argv[1], int(sys.argv[2]), sys.argv[3]
names, counts, total = {}, {}, 0
current = None
for line in open(path, errors="replace"):
    if line.startswith(("summary:", "totals:")):
        total = int(line.split()[1])
    m = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?", line)
    if m:
        if m.group(3):
            names[m.group(2)] = m.group(3).strip()
        current = names.get(m.group(2)) if m.group(1) == "cfn" else None
        continue
    if line.startswith("calls=") and current is not None:
        counts[current] = counts.get(current, 0) + int(line.split()[0][6:])
        current = None
alloc = ("_rjem_malloc", "_rjem_mallocx", "_rjem_calloc", "malloc", "calloc")
made = sum(c for f, c in counts.items() if f in alloc)
regrown = sum(c for f, c in counts.items() if f in ("_rjem_rallocx", "_rjem_realloc", "realloc"))
print(f"{under}: {n} requests: allocations per request {made / n:.2f}, reallocations "
      f"{regrown / n:.2f}, instructions per request {total / n:.0f}")
PY
