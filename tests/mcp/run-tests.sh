#!/usr/bin/env bash
# `delegation-broker mcp tools` and `mcp gateway`
# driven over stdio by the official Python MCP SDK, in both of its connect
# modes (legacy, auto).
#   1. .venv: created (or reused) with the exact pins below,
#   2. pytest on test_tools.py and test_gateway.py: each starts its own broker
#      (`serve`), makes agent keys (`keygen`) and spawns `mcp tools` per agent
#      and `mcp gateway` processes (in front of servers/*.py, run on the
#      venv's Python), all from $BROKER_BIN.
#
#   BROKER_BIN=/path/to/delegation-broker tests/mcp/run-tests.sh [pytest args]
#
# BROKER_BIN defaults to <repo>/target/debug/delegation-broker; a relative
# path is taken from the current directory if it exists there, else from the
# repo root. PYTHON picks the interpreter for the venv (default python3.11,
# else python3; mcp 2.3.0 needs Python >= 3.10). Exits non-zero when a step
# or a test fails.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"

PINS=(mcp==2.3.0 pytest==9.2.0 jsonschema==4.26.0 "PyJWT[crypto]==2.15.1")  # PyJWT: fs_server.py --require-token

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

step ".venv: ${PINS[*]}"
# A venv whose interpreter is gone (moved, upgraded) is made again.
if [[ -d "$VENV" ]] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$VENV"
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
stamp="$({ "$VENV/bin/python" -c 'import sys; print(sys.version)'; printf '%s\n' "${PINS[@]}"; } | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$VENV/.installed-stamp" 2>/dev/null || true)" != "$stamp" ]]; then
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install --quiet "${PINS[@]}"
    echo "$stamp" >"$VENV/.installed-stamp"
fi

step "pytest test_tools.py test_gateway.py (broker: $BROKER_BIN)"
cd "$HERE"
export PYTHONDONTWRITEBYTECODE=1
exec "$VENV/bin/python" -m pytest -p no:cacheprovider --rootdir "$HERE" -v "$@" "$HERE/test_tools.py" "$HERE/test_gateway.py"
