#!/usr/bin/env bash
# Runs Raahi's whole test suite on a fresh machine: installs what the tests need, starts a
# throwaway PostgreSQL cluster for the PostgreSQL store and multi-instance tests, then checks
# formatting, lints and runs every test. Exits with the tests' status; the cluster is stopped and
# removed on every exit, failed tests included.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages the tests use (Knot DNS for the dns and dns-srv discovery tests, Chromium and
# its WebDriver for the dashboard tests, PostgreSQL for the shared store), installed only when
# missing.
required_packages=(knot knot-dnsutils chromium chromium-driver)
missing=()
for package in "${required_packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
  missing+=(postgresql)
fi
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

# The newest installed PostgreSQL server (a newer client-only install has no initdb).
pg_bin=$(dirname "$(ls -d /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")

# initdb refuses to run as root: the cluster belongs to the postgres user then.
as_cluster_owner() {
  if [ "$(id -u)" -eq 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

pg_dir=$(mktemp -d -t raahi-pg.XXXXXX)
pg_started=false
stop_postgres() {
  local status=$?
  # Also when the start timed out: the server may be up anyway.
  if [ -f "$pg_dir/data/postmaster.pid" ]; then
    as_cluster_owner "$pg_bin/pg_ctl" -D "$pg_dir/data" -m immediate stop >/dev/null 2>&1 || true
  fi
  rm -rf "$pg_dir"
  exit "$status"
}
trap stop_postgres EXIT

if [ "$(id -u)" -eq 0 ]; then
  chown postgres "$pg_dir"
fi
as_cluster_owner "$pg_bin/initdb" -D "$pg_dir/data" -A trust -U postgres --no-sync >/dev/null

# A free loopback port: try random high ports until the server starts on one (another process may
# take a port between any check and the start, so the start itself is the check).
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  pg_port=$((20000 + RANDOM % 40000))
  if as_cluster_owner "$pg_bin/pg_ctl" -D "$pg_dir/data" -l "$pg_dir/log" -w -t 30 \
    -o "-p $pg_port -k $pg_dir -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300" \
    start >/dev/null; then
    pg_started=true
    break
  fi
  echo "PostgreSQL did not start on port $pg_port (attempt $attempt); retrying" >&2
done
if [ "$pg_started" != true ]; then
  echo "cannot start a throwaway PostgreSQL cluster; its log:" >&2
  cat "$pg_dir/log" >&2 || true
  exit 1
fi
export RAAHI_TEST_POSTGRES_URL="postgres://postgres@127.0.0.1:$pg_port/postgres"
echo "throwaway PostgreSQL at $RAAHI_TEST_POSTGRES_URL" >&2

# A CI run builds once from a clean clone: incremental artifacts would only take disk.
if [ "${CI:-}" = true ]; then
  export CARGO_INCREMENTAL=0
fi

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked

# Every test target but `memory` (what `--all-targets` selects: unit tests of the library and
# the binary, the benches in test mode, and each test target cargo finds in tests/ the way cargo
# finds them); then the memory tests, which measure this process's resident memory, alone in
# their own process, one at a time. Both run whatever fails; the script fails if either did.
test_targets=()
for file in tests/*.rs tests/*/main.rs; do
  [ -e "$file" ] || continue
  name=$(basename "${file%/main.rs}" .rs)
  [ "$name" = memory ] || test_targets+=(--test "$name")
done
# One process runs every integration test: let it open as many files as the hard limit allows.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
status=0
cargo test --lib --bins --benches --examples "${test_targets[@]}" --locked --no-fail-fast ||
  status=$?
cargo test --test memory --locked --no-fail-fast -- --test-threads=1 || status=$?
exit "$status"
