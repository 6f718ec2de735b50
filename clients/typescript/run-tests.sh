#!/usr/bin/env bash
# The TypeScript client's checks and tests, against the real broker binary:
#   1. npm ci (the exact versions of package-lock.json),
#   2. .venv-python: grpcio-tools (pinned as clients/python's codegen extra)
#      for buf.gen.yaml's Python plugins, and the Python client (again only
#      when clients/python changed) for the cross-language test,
#   3. Debian's protoc-gen-go and protoc-gen-go-grpc for buf.gen.yaml's Go
#      plugins (apt-get, through sudo when not root, if missing),
#   4. drift check: buf generate with the repository's buf.gen.yaml into a
#      temporary directory must reproduce src/gen/ exactly; its Python output
#      (not committed) must be there, and the Python modules import (the Go
#      output is clients/go's, checked by clients/go/run-tests.sh),
#   5. tsc --noEmit over the generated code and the sources,
#   6. the build (dist/: ESM and .d.ts) and the tests' build (build/),
#   7. the package as an artifact: npm pack (the tarball must hold every file
#      package.json's main, types and exports name), installed into a fresh
#      folder (npm init -y, npm install <tarball>, nothing else);
#      examples/three-hops.ts, which may import only the package, compiled
#      there against the installed package (tsc and @types/node from this
#      folder, not installed there) and run against the real broker, started
#      and stopped here; beside it, a few lines using the token endpoint's
#      exports (TokenEndpoint, TokenEndpointError, signAssertion), compiled
#      and run the same way (offline),
#   8. node --test: every test file starts its own broker from $BROKER_BIN.
#
#   BROKER_BIN=/path/to/delegation-broker clients/typescript/run-tests.sh [node --test args]
#
# BROKER_BIN defaults to <repo>/target/debug/delegation-broker; a relative
# path is taken from the current directory if it exists there, else from the
# repo root. PYTHON picks the interpreter for the venv (default python3.11,
# else python3). Exits non-zero on the first failing step.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../../scripts/broker.sh
source "$HERE/../../scripts/broker.sh"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"

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

fresh="$(mktemp -d)"
broker_pid=""
cleanup() {
    if [[ -n "$broker_pid" ]] && kill -0 "$broker_pid" 2>/dev/null; then kill -KILL "$broker_pid" 2>/dev/null || true; fi
    rm -rf "$fresh"
}
trap cleanup EXIT

step ".venv-python: grpcio-tools (for buf generate) and the Python client (for the cross-language test)"
VENV="$HERE/.venv-python"
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
stamp="$(
    cd "$PYCLIENT"
    {
        "$VENV/bin/python" -c 'import sys; print(sys.version)'
        find pyproject.toml README.md src -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha256sum | cut -d' ' -f1
)"
if [[ "$(cat "$VENV/.installed-stamp" 2>/dev/null || true)" != "$stamp" ]]; then
    # Installed from a copy, so nothing is written into clients/python (build/, *.egg-info).
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
# buf.gen.yaml's Python plugins run grpcio-tools' protoc (scripts/grpc-tools-protoc),
# at the version the Python client's stubs are generated with.
tools="$(grep -o '"grpcio-tools==[^"]*"' "$PYCLIENT/pyproject.toml" | head -1 | tr -d '"')"
if ! "$VENV/bin/python" -c "import grpc_tools, importlib.metadata as m, sys; sys.exit(m.version('grpcio-tools') != '${tools#grpcio-tools==}')" 2>/dev/null; then
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install --quiet "$tools"
fi
export GRPC_TOOLS_PYTHON="$VENV/bin/python"

step "Go protoc plugins (Debian's protoc-gen-go, protoc-gen-go-grpc) for buf generate"
missing=()
for plugin in protoc-gen-go protoc-gen-go-grpc; do
    command -v "$plugin" >/dev/null 2>&1 || missing+=("$plugin")
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

step "drift check: buf generate (buf.gen.yaml) against the committed src/gen; its Python output"
(cd "$REPO_ROOT" && "$HERE/node_modules/.bin/buf" generate --template buf.gen.yaml -o "$fresh")
if ! diff -r "$fresh/clients/typescript/src/gen" "$HERE/src/gen"; then
    echo "run-tests.sh: src/gen drifted from proto/: regenerate with 'npm run generate' (in clients/typescript) and commit" >&2
    exit 1
fi
# Python is not committed: each proto file of our package gave its
# non-empty modules, and they import. (Go's output, clients/go/gen, is
# committed and checked by clients/go/run-tests.sh.)
protos=()
for proto in "$REPO_ROOT"/proto/delegation/broker/v1/*.proto; do protos+=("$(basename "$proto" .proto)"); done
expected=()
for name in "${protos[@]}"; do
    expected+=("python/delegation/broker/v1/${name}_pb2.py"
        "python/delegation/broker/v1/${name}_pb2.pyi" "python/delegation/broker/v1/${name}_pb2_grpc.py")
done
for file in "${expected[@]}"; do
    if [[ ! -s "$fresh/gen/$file" ]]; then
        echo "run-tests.sh: buf generate did not write gen/$file (buf.gen.yaml)" >&2
        exit 1
    fi
done
modules=""
for name in "${protos[@]}"; do modules+="delegation.broker.v1.${name}_pb2, delegation.broker.v1.${name}_pb2_grpc, "; done
PYTHONPATH="$fresh/gen/python" "$VENV/bin/python" -c "import ${modules%, }"
# What buf generated type-checks on its own, too.
cat >"$fresh/tsconfig.json" <<JSON
{
  "extends": "$HERE/tsconfig.json",
  "compilerOptions": { "noEmit": true, "rootDir": "clients/typescript/src/gen", "typeRoots": ["$HERE/node_modules/@types"] },
  "include": ["clients/typescript/src/gen"]
}
JSON
echo '{ "type": "module" }' >"$fresh/package.json"
ln -s "$HERE/node_modules" "$fresh/node_modules"
"$HERE/node_modules/.bin/tsc" -p "$fresh/tsconfig.json"

step "tsc --noEmit (generated code and sources)"
"$HERE/node_modules/.bin/tsc" -p tsconfig.json --noEmit

step "build (dist/) and the tests (build/)"
rm -rf dist build
"$HERE/node_modules/.bin/tsc" -p tsconfig.json
"$HERE/node_modules/.bin/tsc" -p tsconfig.test.json

started=$SECONDS
step "npm pack: the package as a tarball (package.json's files: dist, src, README.md)"
mkdir -p "$fresh/pack"
tarball="$fresh/pack/$(npm pack --silent --pack-destination "$fresh/pack" | tail -1)"
[[ -f "$tarball" ]] || { echo "run-tests.sh: npm pack wrote no tarball" >&2; exit 1; }
tar -tzf "$tarball" >"$fresh/pack/files"
# Every file main, types and exports name, and no tests or build output.
node - "$fresh/pack/files" "$(basename "$tarball")" <<'JS'
const fs = require("node:fs");
const pkg = JSON.parse(fs.readFileSync("package.json", "utf8"));
const files = new Set(fs.readFileSync(process.argv[2], "utf8").split("\n").filter(Boolean));
const named = [pkg.main, pkg.types];
const walk = (v) => (typeof v === "string" ? named.push(v) : Object.values(v ?? {}).forEach(walk));
walk(pkg.exports);
const missing = named.filter((f) => !files.has("package/" + f.replace(/^\.\//, "")));
const stray = [...files].filter((f) => /^package\/(test|build|node_modules|examples)\//.test(f));
if (missing.length || stray.length) {
  console.error(`run-tests.sh: the tarball lacks ${JSON.stringify(missing)}, holds ${JSON.stringify(stray.slice(0, 5))}`);
  process.exit(1);
}
console.log(`    ${process.argv[3]}: ${files.size} files, every one main, types and exports name (${named.length})`);
JS

step "fresh folder: npm init -y, npm install <the tarball> (nothing else)"
app="$fresh/app"
mkdir -p "$app"
(
    cd "$app"
    npm init -y >/dev/null
    npm pkg set type=module   # an ESM project, as the package is ESM only
    npm install --no-audit --no-fund --loglevel=error --prefer-offline "$tarball"
    npm ls --depth=0 | sed '/^$/d; s/^/    /'
)

step "examples/three-hops.ts in that folder: compiled against the installed package, run against the real broker"
cp examples/three-hops.ts "$app/"
# A user's script needs only the package: no import of its runtimes (protobuf-es, connect) beside it.
others="$(grep -oE '^import .* from "[^"]+"|^\s*} from "[^"]+"' "$app/three-hops.ts" | grep -oE '"[^"]+"' | tr -d '"' \
    | grep -vE '^(@delegation-broker/client(/node|/web)?|node:.+)$' || true)"
if [[ -n "$others" ]]; then
    echo "run-tests.sh: examples/three-hops.ts imports beyond the package: $others" >&2
    exit 1
fi
cat >"$app/tsconfig.json" <<JSON
{
  "compilerOptions": {
    "target": "ES2022", "module": "NodeNext", "moduleResolution": "NodeNext", "strict": true,
    "types": ["node"], "typeRoots": ["$HERE/node_modules/@types"], "rootDir": ".", "outDir": "out"
  },
  "files": ["three-hops.ts", "tokens-exports.ts"]
}
JSON
# The token endpoint's exports, as a user imports them from the installed package.
cat >"$app/tokens-exports.ts" <<'TS'
import { Agent, TokenEndpoint, TokenEndpointError, signAssertion, type DelegationTokenClaims, type MintedToken } from "@delegation-broker/client";
const jws = signAssertion(Agent.generate(), new Uint8Array(32), "http://127.0.0.1:1/token");
const endpoint = new TokenEndpoint("http://127.0.0.1:1/");
const error: unknown = new TokenEndpointError("invalid_grant", "replayed", 400);
const typed: [MintedToken | undefined, DelegationTokenClaims | undefined] = [undefined, undefined];
if (jws.split(".").length !== 3 || endpoint.url !== "http://127.0.0.1:1" || !(error instanceof TokenEndpointError) || error.error !== "invalid_grant" || typed.length !== 2) {
  console.error("the installed package's token exports misbehave");
  process.exit(1);
}
console.log(`token exports: TokenEndpoint, TokenEndpointError, signAssertion (an assertion of ${jws.length} characters)`);
TS
"$HERE/node_modules/.bin/tsc" -p "$app/tsconfig.json"
(cd "$app" && node out/tokens-exports.js) | sed 's/^/    /'
mkdir -p "$fresh/broker"
start_attested_broker "$fresh/broker"
if ! (cd "$app" && node out/three-hops.js "$address" "$(cat "$fresh/broker/attestor.seed")") >"$app/run.out" 2>&1; then
    echo "run-tests.sh: examples/three-hops.ts failed in the fresh folder:" >&2
    cat "$app/run.out" >&2
    exit 1
fi
sed 's/^/    /' "$app/run.out"
if ! grep -q "^verified a chain of 4 contracts: 3 hash links and the leaf's signature" "$app/run.out" \
    || ! grep -q "verified again from them: 4 contracts$" "$app/run.out"; then
    echo "run-tests.sh: examples/three-hops.ts did not verify its chain" >&2
    exit 1
fi
kill -TERM "$broker_pid"
for _ in $(seq 150); do kill -0 "$broker_pid" 2>/dev/null || break; sleep 0.1; done
code=0
wait "$broker_pid" || code=$?
broker_pid=""
if [[ $code -ne 0 ]]; then
    echo "run-tests.sh: the broker exited with $code on SIGTERM; log:" >&2
    cat "$fresh/broker/log" >&2
    exit 1
fi
printf -- '--> package checks: %ss\n' "$((SECONDS - started))"

step "node --test (broker: $BROKER_BIN)"
node --test "$@" build/test/*.test.js
