#!/usr/bin/env bash
# Runs Raahi's whole test suite on a fresh machine: installs what the tests need, then checks
# formatting, lints and runs every test. Exits non-zero when anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages the tests use (Knot DNS for the dns and dns-srv discovery tests), installed
# only when missing.
required_packages=(knot knot-dnsutils)
missing=()
for package in "${required_packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --all-targets --locked --no-fail-fast
