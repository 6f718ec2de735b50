#!/usr/bin/env bash
# buf lint, and buf breaking against the previous commit of this branch, so
# a wire-incompatible change to proto/ cannot land unnoticed. buf comes
# from the npm package @bufbuild/buf, pinned, installed under target/tools.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUF_VERSION=1.75.0
TOOLS=target/tools/buf
BUF="$TOOLS/node_modules/.bin/buf"
if [[ ! -x "$BUF" ]] || [[ "$("$BUF" --version 2>/dev/null)" != "$BUF_VERSION" ]]; then
    mkdir -p "$TOOLS"
    npm install --silent --no-audit --no-fund --prefix "$TOOLS" "@bufbuild/buf@$BUF_VERSION"
fi

"$BUF" lint
echo "buf lint: ok"

# The previous commit; a shallow clone is deepened by one to find it.
if ! git rev-parse --verify --quiet HEAD~1 >/dev/null; then
    git fetch --quiet --deepen=1 2>/dev/null || true
fi
if ! git rev-parse --verify --quiet HEAD~1 >/dev/null; then
    echo "buf breaking: FAILED to find the previous commit (HEAD~1) to compare against" >&2
    exit 1
fi
if [[ -z "$(git ls-tree -r --name-only HEAD~1 -- proto buf.yaml)" ]]; then
    echo "buf breaking: HEAD~1 has no proto/ or buf.yaml yet; nothing to compare against"
    exit 0
fi
"$BUF" breaking --against ".git#ref=HEAD~1"
echo "buf breaking: ok against $(git rev-parse --short HEAD~1)"
