#!/usr/bin/env bash
# The console's checks and its browser test, against the real broker binary:
#   1. npm ci (the exact versions of package-lock.json),
#   2. drift check: build.mjs rebuilds the page into a temporary directory,
#      which must equal the committed dist/ (index.html, console.js,
#      console.css: what the broker embeds),
#   3. tsc --noEmit over the page (src/, with the client sources it imports)
#      and the test,
#   4. Debian's chromium, installed with apt-get when no `chromium` is on PATH,
#   5. the test bundled for Node (build/) and run with node --test: it starts
#      the broker from $BROKER_BIN with --console and drives chromium headless
#      through playwright-core; screenshots go to test-output/.
#
#   BROKER_BIN=/path/to/delegation-broker console/run-tests.sh [node --test args]
#
# BROKER_BIN defaults to <repo>/target/debug/delegation-broker; a relative
# path is taken from the current directory if it exists there, else from the
# repo root. CHROMIUM_BIN overrides the browser. Exits non-zero on the first
# failing step.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/.." && pwd)"

BROKER_BIN="${BROKER_BIN:-target/debug/delegation-broker}"
if [[ "$BROKER_BIN" != /* ]]; then
    if [[ -e "$PWD/$BROKER_BIN" ]]; then BROKER_BIN="$PWD/$BROKER_BIN"; else BROKER_BIN="$REPO_ROOT/$BROKER_BIN"; fi
fi
if [[ ! -x "$BROKER_BIN" ]]; then
    echo "run-tests.sh: no broker binary at $BROKER_BIN (cargo build --bin delegation-broker, or set BROKER_BIN)" >&2
    exit 2
fi
export BROKER_BIN

step() { printf -- '--> %s\n' "$*"; }
cd "$HERE"

step "npm ci"
npm ci --no-audit --no-fund --loglevel=error

step "drift check: the page rebuilt against the committed dist/"
fresh="$(mktemp -d)"
trap 'rm -rf "$fresh"' EXIT
node build.mjs "$fresh/dist"
if ! diff -r "$fresh/dist" "$HERE/dist"; then
    echo "run-tests.sh: console/dist drifted from its sources: rebuild with 'node build.mjs' (in console/) and commit dist/" >&2
    exit 1
fi

step "tsc --noEmit (the page with the client sources, and the test)"
"$HERE/node_modules/.bin/tsc" -p tsconfig.json --noEmit
"$HERE/node_modules/.bin/tsc" -p test/tsconfig.json --noEmit

if [[ -z "${CHROMIUM_BIN:-}" ]]; then
    if ! command -v chromium >/dev/null 2>&1; then
        step "installing Debian's chromium"
        SUDO=""
        if [[ "$(id -u)" != 0 ]]; then SUDO="sudo"; fi
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
    fi
    CHROMIUM_BIN="$(command -v chromium)"
fi
export CHROMIUM_BIN

step "the browser test (broker: $BROKER_BIN, browser: $CHROMIUM_BIN)"
rm -rf build test-output
node build.mjs --tests build
mkdir -p test-output
node --test "$@" build/*.test.mjs
