#!/usr/bin/env bash
# The Go client's checks and tests, against the real broker binary:
#   1. Debian's Go toolchain and packages (golang-go, golang-google-grpc-dev,
#      golang-google-protobuf-dev, golang-github-golang-protobuf-1-5-dev,
#      protoc-gen-go, protoc-gen-go-grpc), apt-get installed (through sudo
#      when not root) if missing; the module is built from them offline, in
#      GOPATH mode (GOPATH=<tmp>:/usr/share/gocode, GO111MODULE=off), as
#      Debian builds Go packages;
#   2. for the cross-language test and buf generate: the TypeScript client's
#      node_modules (npm ci, when missing) and build (dist/, when missing or
#      older than its sources), and clients/typescript/.venv-python with the
#      Python client and grpcio-tools, set up exactly as
#      clients/typescript/run-tests.sh does (shared with it);
#   3. drift check: buf generate with the repository's buf.gen.yaml into a
#      temporary directory must reproduce gen/ exactly;
#   4. gofmt and go vet;
#   5. go test: every test starts its own broker from $BROKER_BIN on
#      127.0.0.1:0.
#
#   BROKER_BIN=/path/to/delegation-broker clients/go/run-tests.sh [go test args]
#
# BROKER_BIN defaults to <repo>/target/debug/delegation-broker; a relative
# path is taken from the current directory if it exists there, else from the
# repo root. PYTHON picks the interpreter for the venv (default python3.11,
# else python3). Exits non-zero on the first failing step.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"
MODULE="github.com/delegation-broker/delegation-broker/clients/go"
TS="$REPO_ROOT/clients/typescript"

BROKER_BIN="${BROKER_BIN:-target/debug/delegation-broker}"
if [[ "$BROKER_BIN" != /* ]]; then
    if [[ -e "$PWD/$BROKER_BIN" ]]; then BROKER_BIN="$PWD/$BROKER_BIN"; else BROKER_BIN="$REPO_ROOT/$BROKER_BIN"; fi
fi
if [[ ! -x "$BROKER_BIN" ]]; then
    echo "run-tests.sh: no broker binary at $BROKER_BIN (cargo build --bin delegation-broker, or set BROKER_BIN)" >&2
    exit 2
fi
export BROKER_BIN REPO_ROOT

step() { printf -- '--> %s\n' "$*"; }

step "Debian's Go toolchain and packages"
missing=()
for package in golang-go golang-google-grpc-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev protoc-gen-go protoc-gen-go-grpc; do
    if [[ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)" != "install ok installed" ]]; then
        missing+=("$package")
    fi
done
if ((${#missing[@]})); then
    apt=(env DEBIAN_FRONTEND=noninteractive apt-get)
    if [[ $(id -u) -ne 0 ]]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "run-tests.sh: ${missing[*]} not installed and no sudo to install them (apt-get install ${missing[*]})" >&2
            exit 2
        fi
        apt=(sudo "${apt[@]}")
    fi
    if ! "${apt[@]}" install -y --no-install-recommends "${missing[@]}"; then
        "${apt[@]}" update
        "${apt[@]}" install -y --no-install-recommends "${missing[@]}"
    fi
fi
go version

fresh="$(mktemp -d)"
trap 'rm -rf "$fresh"' EXIT

step "the TypeScript client (node_modules, dist/) for buf generate and the cross-language test"
if [[ ! -x "$TS/node_modules/.bin/buf" || ! -x "$TS/node_modules/.bin/tsc" ]]; then
    (cd "$TS" && npm ci --no-audit --no-fund --loglevel=error)
fi
if [[ ! -f "$TS/dist/index.js" ]] || [[ -n "$(find "$TS/src" "$TS/tsconfig.json" "$TS/package.json" -newer "$TS/dist/index.js" -print -quit)" ]]; then
    (cd "$TS" && rm -rf dist && node_modules/.bin/tsc -p tsconfig.json)
fi
export CROSS_TS_DIST="$TS/dist"

step "clients/typescript/.venv-python: the Python client (cross-language test) and grpcio-tools (buf generate)"
VENV="$TS/.venv-python"
if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "run-tests.sh: $PYTHON not found: the cross-language test (the Python client) and buf generate (grpcio-tools) need Python 3 with venv and pip; set PYTHON" >&2
    exit 2
fi
if [[ -d "$VENV" ]] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$VENV"
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PYCLIENT="$REPO_ROOT/clients/python"
# The same stamp as clients/typescript/run-tests.sh: either script installs, the other reuses.
stamp="$(
    cd "$PYCLIENT"
    {
        "$VENV/bin/python" -c 'import sys; print(sys.version)'
        find pyproject.toml README.md src -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha256sum | cut -d' ' -f1
)"
if [[ "$(cat "$VENV/.installed-stamp" 2>/dev/null || true)" != "$stamp" ]]; then
    copy="$fresh/python-client"
    mkdir -p "$copy"
    cp -R "$PYCLIENT/pyproject.toml" "$PYCLIENT/README.md" "$PYCLIENT/src" "$copy/"
    find "$copy" -name '__pycache__' -prune -exec rm -rf {} + -o -name '*.egg-info' -prune -exec rm -rf {} +
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    "$VENV/bin/python" -m pip install --quiet "setuptools>=77"
    "$VENV/bin/python" -m pip install --quiet --no-build-isolation --force-reinstall --no-deps "$copy"
    "$VENV/bin/python" -m pip install --quiet --no-build-isolation "$copy"
    echo "$stamp" >"$VENV/.installed-stamp"
fi
export CROSS_PYTHON="$VENV/bin/python"
tools="$(grep -o '"grpcio-tools==[^"]*"' "$PYCLIENT/pyproject.toml" | head -1 | tr -d '"')"
if ! "$VENV/bin/python" -c "import grpc_tools, importlib.metadata as m, sys; sys.exit(m.version('grpcio-tools') != '${tools#grpcio-tools==}')" 2>/dev/null; then
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install --quiet "$tools"
fi
export GRPC_TOOLS_PYTHON="$VENV/bin/python"

step "drift check: buf generate (buf.gen.yaml) against the committed gen/"
(cd "$REPO_ROOT" && "$TS/node_modules/.bin/buf" generate --template buf.gen.yaml -o "$fresh/out")
if ! diff -r "$fresh/out/clients/go/gen" "$HERE/gen"; then
    echo "run-tests.sh: gen/ drifted from proto/: regenerate with '$TS/node_modules/.bin/buf generate' from the repository root and commit" >&2
    exit 1
fi

# GOPATH mode on Debian's sources: the module at its import path in a
# temporary GOPATH, Debian's packages in the second entry.
export GO111MODULE=off GOPATH="$fresh/gopath:/usr/share/gocode" GOFLAGS="${GOFLAGS:--p=1}" GOCACHE="${GOCACHE:-$HOME/.cache/go-build}"
mkdir -p "$fresh/gopath/src/$(dirname "$MODULE")"
ln -s "$HERE" "$fresh/gopath/src/$MODULE"
cd "$fresh/gopath/src/$MODULE"

step "gofmt and go vet"
unformatted="$(gofmt -l broker internal examples)"
if [[ -n "$unformatted" ]]; then
    echo "run-tests.sh: not gofmt'ed: $unformatted" >&2
    exit 1
fi
go vet ./...

step "go test (broker: $BROKER_BIN)"
go test -count=1 "$@" ./...
