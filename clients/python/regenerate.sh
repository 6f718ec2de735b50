#!/usr/bin/env bash
# Regenerates src/delegation_broker/_gen/ and src/delegation_broker/pb.py from
# the repo's proto/ tree with the pinned grpcio-tools. Run after any .proto
# change, then commit the result (tests/test_generated.py fails on drift).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
if [[ ! -x "$VENV/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
tools="$(grep -o '"grpcio-tools==[^"]*"' "$HERE/pyproject.toml" | head -1 | tr -d '"')"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$tools"
exec "$VENV/bin/python" "$HERE/regenerate.py" "$@"
