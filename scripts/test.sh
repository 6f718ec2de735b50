#!/usr/bin/env bash
# Runs every test of the repository, setting up what it needs on a fresh
# machine (Rust toolchain and Python 3 with pip assumed, npm for buf):
#   1. formatting and clippy,
#   2. Rust unit, property and end-to-end tests (real gRPC on 127.0.0.1:0),
#   3. a short bounded run of every fuzz target (scripts/fuzz.sh; installs
#      cargo-fuzz if missing),
#   4. the Python client's tests against the real broker binary,
#   5. buf lint and buf breaking against the previous commit.
# .ci/run calls exactly this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n==> %s\n' "$*"; }

step "cargo fmt --check"
cargo fmt --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --locked -- -D warnings

step "Rust tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --locked --no-fail-fast
else
    cargo test --locked --no-fail-fast
fi

step "Fuzzing: each target in fuzz/ for ${FUZZ_SECONDS:-20} s (scripts/fuzz.sh)"
scripts/fuzz.sh

step "Python client tests"
cargo build --locked --bin delegation-broker
BROKER_BIN="$PWD/target/debug/delegation-broker" clients/python/run-tests.sh -q

step "buf lint and breaking"
scripts/buf.sh
