#!/usr/bin/env bash
# Runs every test of the repository, setting up what it needs on a fresh
# machine (Rust toolchain and Python 3 with pip assumed, npm for buf):
#   1. formatting and clippy,
#   2. a throwaway PostgreSQL server (scripts/pg.sh; installs the Debian
#      package if missing) on which each test creates its own database:
#      BROKER_TEST_POSTGRES_URL and BROKER_PG_DIR are exported to the rest
#      of the run, and the server and its data are removed on exit,
#   3. Rust unit, property and end-to-end tests (real gRPC on 127.0.0.1:0),
#      then the end-to-end tests again on PostgreSQL,
#   4. with FUZZ_SECONDS set, a bounded coverage-guided run of every fuzz
#      target (scripts/fuzz.sh; installs cargo-fuzz if missing); their
#      regression and random inputs run in step 3 either way,
#   5. the Python, TypeScript and Go clients' tests against the real broker
#      binary (clients/typescript/run-tests.sh: npm ci, generated-code drift,
#      tsc, node --test, chains verified across the three languages;
#      clients/go/run-tests.sh: Debian's Go packages, generated-code drift,
#      go vet, go test, chains verified across the four languages),
#   6. the browser console's tests (console/run-tests.sh: npm ci, page
#      drift, tsc, a Playwright test in Debian's headless chromium, which it
#      installs if missing),
#   7. `mcp tools` driven by the official Python MCP SDK (tests/mcp),
#   8. `a2a-gateway` in front of stock agents of the official Python A2A
#      SDK (tests/a2a),
#   9. the Docker image built and run (scripts/docker-test.sh), where a
#      Docker daemon answers; skipped with a message otherwise,
#  10. buf lint and buf breaking against the previous commit.
# .ci/run calls exactly this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# A one-off run gains nothing from incremental compilation, whose caches
# would double the target directory on disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# Each step's time is printed when it ends, and all of them at the end
# (a failed run too: the EXIT trap prints what ran).
run_started=$SECONDS
step_started=$SECONDS
current_step=""
step_times=()
end_step() {
    if [[ -n "$current_step" ]]; then
        local took=$((SECONDS - step_started))
        step_times+=("$(printf '%6d s  %s' "$took" "$current_step")")
        printf '<== %s: %d s\n' "$current_step" "$took"
    fi
    current_step=""
}
step() {
    end_step
    current_step="$*"
    step_started=$SECONDS
    printf '\n==> %s\n' "$*"
}
report_times() {
    end_step
    printf '\nStep times (%d s in all):\n' $((SECONDS - run_started))
    printf '%s\n' "${step_times[@]}"
}
trap report_times EXIT

step "cargo fmt --check"
cargo fmt --check

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "Throwaway PostgreSQL (scripts/pg.sh)"
BROKER_PG_DIR="$(mktemp -d)"
export BROKER_PG_DIR # a test may run: scripts/pg.sh restart "$BROKER_PG_DIR"
pg_sh="$PWD/scripts/pg.sh"
trap '"$pg_sh" stop "$BROKER_PG_DIR"; report_times' EXIT
trap 'exit 130' INT # exit, so that the EXIT trap stops the server
trap 'exit 143' TERM
# Not eval "$(...)": that would hide a failed start from set -e.
pg_env="$("$pg_sh" start "$BROKER_PG_DIR")"
eval "$pg_env" # exports BROKER_TEST_POSTGRES_URL

step "Rust tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --locked --no-fail-fast
else
    cargo test --workspace --locked --no-fail-fast
fi

# Every end-to-end test that is not about SQLite itself, again with the
# broker's state in PostgreSQL (tests named sqlite_* are SQLite's own;
# replicas::* run on PostgreSQL in the first pass already; the crowd and
# drain measurements are the service's and the drain pacing's, which the
# store suite runs on PostgreSQL: once is enough for their minutes; bench,
# readme and sockets start brokers of their own that ignore the backend,
# tokens_hostile tests the token listener's bounds, not the store, and
# a2a_followers' thousand tasks are the gateway's load; WatchContracts
# itself runs here in watch_contracts).
step "End-to-end tests on PostgreSQL (BROKER_TEST_BACKEND=postgres)"
if cargo nextest --version >/dev/null 2>&1; then
    BROKER_TEST_BACKEND=postgres cargo nextest run --locked --no-fail-fast --test e2e \
        -E 'not (test(/^replicas::/) | test(/::sqlite_/) | test(/^drains::/) | test(/^fairness::a_thousand_free_keys/) | test(/^bench::/) | test(/^readme::/) | test(/^sockets::/) | test(/^tokens_hostile::/) | test(/^a2a_followers::/))'
else
    BROKER_TEST_BACKEND=postgres cargo test --locked --no-fail-fast --test e2e -- \
        --skip replicas:: --skip ::sqlite_ --skip drains:: --skip fairness::a_thousand_free_keys \
        --skip bench:: --skip readme:: --skip sockets:: --skip tokens_hostile:: \
        --skip a2a_followers::
fi

# The fuzz targets' regression and random inputs ran above, as ordinary
# tests of the fuzz crate. The coverage-guided search needs its own
# instrumented build of the whole dependency tree (7 minutes on two cores,
# more than the rest of this script's budget): it runs here when
# FUZZ_SECONDS is set, e.g. FUZZ_SECONDS=60; SECURITY.md gives the longer
# search.
if [[ "${FUZZ_SECONDS:-0}" -gt 0 ]]; then
    step "Fuzzing: each target in fuzz/ for $FUZZ_SECONDS s (scripts/fuzz.sh)"
    scripts/fuzz.sh
else
    printf '\n(coverage-guided fuzzing skipped: FUZZ_SECONDS=60 scripts/test.sh runs it)\n'
fi

step "Python client tests"
# The binary the end-to-end tests ran (built with the test run's
# features: a plain `cargo build` would resolve others and rebuild).
cargo test --workspace --locked --no-run --quiet
BROKER_BIN="$PWD/target/debug/delegation-broker" clients/python/run-tests.sh -q

step "TypeScript client tests"
BROKER_BIN="$PWD/target/debug/delegation-broker" clients/typescript/run-tests.sh

step "Go client tests"
BROKER_BIN="$PWD/target/debug/delegation-broker" clients/go/run-tests.sh

step "Console tests (console/run-tests.sh: page drift, tsc, the browser test in headless chromium)"
BROKER_BIN="$PWD/target/debug/delegation-broker" console/run-tests.sh

step "MCP tools with the official Python MCP SDK (tests/mcp/run-tests.sh)"
BROKER_BIN="$PWD/target/debug/delegation-broker" tests/mcp/run-tests.sh -q

step "A2A gateway with stock agents of the official Python A2A SDK (tests/a2a/run-tests.sh)"
BROKER_BIN="$PWD/target/debug/delegation-broker" tests/a2a/run-tests.sh -q

step "The Docker image (scripts/docker-test.sh; skipped with a message where Docker is not available)"
scripts/docker-test.sh

step "buf lint and breaking"
scripts/buf.sh
