#!/usr/bin/env bash
# Instructions per ServiceRuntime::pick (10 targets, one tier), counted by callgrind: the
# example examples/pick_instructions.rs runs N and then 2N picks, and the difference of the two
# totals divided by N is one pick, without the set-up or the process's start.
#
# Usage: scripts/pick-instructions.sh [policy] [variant]   (needs valgrind; builds the example)
#   policy:  round_robin (default), random, least_request
#   variant: no_ejection (default), one_ejected, half_open
# Environment: PICKS=100000
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
PICKS=${PICKS:-100000}
POLICY=${1:-round_robin}
VARIANT=${2:-no_ejection}
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }

[ -n "${PICK_BIN:-}" ] || (cd "$REPO" && cargo build --release --example pick_instructions >&2)
BIN=${PICK_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/release/examples/pick_instructions}
WORK=$(mktemp -d /tmp/raahi-pick.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

count() {
    valgrind --tool=callgrind --callgrind-out-file="$WORK/out.$1" "$BIN" "$1" "$POLICY" "$VARIANT" \
        >/dev/null 2>&1
    awk '/^(summary|totals):/ {print $2; exit}' "$WORK/out.$1"
}
once=$(count "$PICKS")
twice=$(count $((2 * PICKS)))
awk -v a="$once" -v b="$twice" -v n="$PICKS" -v p="$POLICY" -v v="$VARIANT" \
    'BEGIN { printf "%s/%s: %.1f instructions per pick (%d picks: %d, %d: %d)\n", p, v, (b - a) / n, n, a, 2 * n, b }'
