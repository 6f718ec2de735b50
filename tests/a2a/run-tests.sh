#!/usr/bin/env bash
# End-to-end tests of `delegation-broker a2a-gateway` (the delegation
# extension for A2A, proto/delegation/broker/v1/a2a-extension.md), driven by
# the official A2A Python SDK (a2a-sdk 1.3.0):
#   1. .venv: created (or reused) with the exact pins below, plus the repo's
#      Python client (clients/python, installed without its dependencies,
#      which the pins provide),
#   2. pytest on test_a2a.py: it starts its own broker (`serve`), makes agent
#      keys (`keygen`), runs the stock A2A agents of agents/ (built with the
#      SDK, on the venv's Python) and one `a2a-gateway` in front of each, all
#      from $BROKER_BIN, and talks to the gateways with the SDK's client and
#      to the broker over gRPC (as a [readers] key, and with the
#      orchestrator's key for the contracts a principal would make).
#
#   BROKER_BIN=/path/to/delegation-broker tests/a2a/run-tests.sh [pytest args]
#
# BROKER_BIN defaults to <repo>/target/debug/delegation-broker; a relative
# path is taken from the current directory if it exists there, else from the
# repo root. PYTHON picks the interpreter for the venv (default python3.11,
# else python3; a2a-sdk 1.3.0 needs Python >= 3.10). Tests marked `later`
# need parts of the extension that come after the first cut (INPUT_REQUIRED
# escalation seen at once, revocation and CancelTask reaching the agent, a
# gateway restarted mid-task): `-m 'not later'` leaves them out. Exits
# non-zero when a step or a test fails.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"
CLIENT="$REPO_ROOT/clients/python"

# Exact pins: the SDK with its JSON-RPC server and gRPC extras, the server
# and test runner, and everything the repo's client needs (its own ranges
# admit these).
PINS=(
    "a2a-sdk[http-server,grpc]==1.3.0"
    uvicorn==0.54.0
    httpx==0.28.1
    starlette==1.10.0
    sse-starlette==3.7.0
    pytest==9.2.0
    grpcio==1.85.3
    grpcio-status==1.85.3
    grpcio-tools==1.85.1
    grpcio-reflection==1.85.1
    protobuf==7.36.2
    googleapis-common-protos==1.76.0
    pynacl==1.6.2
    "setuptools==84.2.1"
)

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

VENV="$HERE/.venv"
if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "run-tests.sh: $PYTHON not found: the test needs Python 3 (>= 3.10) with venv and pip; set PYTHON" >&2
    exit 2
fi

step ".venv: ${PINS[*]} + clients/python"
# A venv whose interpreter is gone (moved, upgraded) is made again.
if [[ -d "$VENV" ]] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$VENV"
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# Reinstall when the interpreter, a pin or the client's sources change.
stamp="$(
    {
        "$VENV/bin/python" -c 'import sys; print(sys.version)'
        printf '%s\n' "${PINS[@]}"
        cd "$CLIENT"
        find pyproject.toml README.md src -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha256sum | cut -d' ' -f1
)"
if [[ "$(cat "$VENV/.installed-stamp" 2>/dev/null || true)" != "$stamp" ]]; then
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    "$VENV/bin/python" -m pip install --quiet "${PINS[@]}"
    # Non-editable, from a copy, so nothing is built inside the checkout.
    build="$(mktemp -d)"
    cp -r "$CLIENT/pyproject.toml" "$CLIENT/README.md" "$CLIENT/src" "$build/"
    rm -rf "$build/src/"*.egg-info
    status=0
    "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation "$build" || status=$?
    rm -rf "$build"
    [[ $status -eq 0 ]] || exit "$status"
    "$VENV/bin/python" -c 'import a2a.client, a2a.server.routes, uvicorn, delegation_broker, grpc, nacl' \
        || { echo "run-tests.sh: the venv does not import what the tests need" >&2; exit 2; }
    echo "$stamp" >"$VENV/.installed-stamp"
fi

step "pytest test_a2a.py (broker: $BROKER_BIN)"
cd "$HERE"
export PYTHONDONTWRITEBYTECODE=1
exec "$VENV/bin/python" -m pytest -p no:cacheprovider --rootdir "$HERE" -v "$@" "$HERE/test_a2a.py"
