#!/usr/bin/env bash
# Creates clients/python/.venv (once), installs the package with its test
# extras (again only when the package's files changed), and runs pytest
# against the real broker binary.
#
#   BROKER_BIN=/path/to/delegation-broker clients/python/run-tests.sh [pytest args]
#
# BROKER_BIN defaults to <repo>/target/debug/delegation-broker; a relative path
# is taken from the current directory if it exists there, else from the repo
# root. PYTHON picks the interpreter for the venv (default python3.11, else
# python3). Exits with pytest's status.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv"

BROKER_BIN="${BROKER_BIN:-target/debug/delegation-broker}"
if [[ "$BROKER_BIN" != /* ]]; then
    if [[ -e "$PWD/$BROKER_BIN" ]]; then BROKER_BIN="$PWD/$BROKER_BIN"; else BROKER_BIN="$REPO_ROOT/$BROKER_BIN"; fi
fi
if [[ ! -x "$BROKER_BIN" ]]; then
    echo "run-tests.sh: no broker binary at $BROKER_BIN (cargo build --bin delegation-broker, or set BROKER_BIN)" >&2
    exit 2
fi
export BROKER_BIN

if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

# A venv whose interpreter no longer runs (moved or upgraded Python) is rebuilt.
if [[ -d "$VENV" ]] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "run-tests.sh: rebuilding broken venv $VENV" >&2
    rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

# Reinstall only when pyproject.toml, the sources or the interpreter changed.
stamp="$(
    cd "$HERE"
    {
        "$VPY" -c 'import sys; print(sys.version)'
        find pyproject.toml README.md src -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha256sum | cut -d' ' -f1
)"
if [[ "$(cat "$VENV/.installed-stamp" 2>/dev/null || true)" != "$stamp" ]]; then
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    "$VPY" -m pip install --quiet "setuptools>=77"
    # Non-editable, so the tests exercise what a user would install; local
    # directories are always rebuilt, pinned dependencies already present are kept.
    "$VPY" -m pip install --quiet --no-build-isolation "$HERE[test]"
    rm -rf "$HERE/build"
    echo "$stamp" >"$VENV/.installed-stamp"
fi

cd "$HERE"
exec "$VPY" -m pytest "$@"
