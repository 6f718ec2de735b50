#!/usr/bin/env bash
# Creates clients/python/.venv (once), installs the package with its test
# extras (again only when the package's files changed), checks the client as
# an artifact, and runs pytest against the real broker binary:
#   1. the wheel: pip wheel (no dependencies) from a copy of pyproject.toml,
#      README.md and src/, which must hold the generated modules, their .pyi
#      stubs and py.typed;
#   2. installed into a fresh, empty virtualenv (no pip, no setuptools) with
#      its dependencies from the index, each at the lowest version its range
#      admits (protobuf, grpcio, ...: read from the wheel's metadata);
#   3. examples/three_hops.py run from that virtualenv (python -I, outside the
#      checkout) against the real broker, started and stopped here;
#   4. protobuf below 7 (what a package pinning protobuf<7 brings) in that
#      virtualenv: importing the client must fail with its ImportError naming
#      the protobuf it needs;
#   5. pytest.
#
#   BROKER_BIN=/path/to/delegation-broker clients/python/run-tests.sh [pytest args]
#
# BROKER_BIN defaults to <repo>/target/debug/delegation-broker; a relative path
# is taken from the current directory if it exists there, else from the repo
# root. PYTHON picks the interpreter for the venv (default python3.11, else
# python3). Exits with pytest's status.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../../scripts/broker.sh
source "$HERE/../../scripts/broker.sh"
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

step() { printf -- '--> %s\n' "$*"; }
artifact="$(mktemp -d)"
broker_pid=""
cleanup() {
    if [[ -n "$broker_pid" ]] && kill -0 "$broker_pid" 2>/dev/null; then kill -KILL "$broker_pid" 2>/dev/null || true; fi
    rm -rf "$artifact"
}
trap cleanup EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
started=$SECONDS
# pip --python (installing into a venv that has no pip) needs pip 22.3.
if ! "$VPY" -c 'import pip, sys; sys.exit(tuple(int(p) for p in pip.__version__.split(".")[:2]) < (22, 3))'; then
    "$VPY" -m pip install --quiet 'pip>=22.3'
fi

step "wheel: pip wheel --no-deps from a copy of pyproject.toml, README.md and src/"
mkdir -p "$artifact/source"
cp -R "$HERE/pyproject.toml" "$HERE/README.md" "$HERE/src" "$artifact/source/"
find "$artifact/source" -name '__pycache__' -prune -exec rm -rf {} + -o -name '*.egg-info' -prune -exec rm -rf {} +
"$VPY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$artifact/dist" "$artifact/source"
wheels=("$artifact"/dist/*.whl)
if [[ ${#wheels[@]} -ne 1 || ! -f "${wheels[0]}" ]]; then
    echo "run-tests.sh: pip wheel did not write exactly one wheel: ${wheels[*]}" >&2
    exit 1
fi
wheel="${wheels[0]}"
# Its files: every module of src/ (the generated ones included), their .pyi
# stubs and py.typed; and the lowest version each dependency's range admits.
"$VPY" - "$wheel" "$HERE/src" "$artifact/lowest.txt" <<'PY'
import pathlib, re, sys, zipfile
wheel, src, lowest = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    metadata = z.read(meta).decode()
wanted = {str(p.relative_to(src)) for p in src.rglob("*")
          if p.is_file() and p.suffix in {".py", ".pyi", ".typed"} and "__pycache__" not in p.parts}
missing = sorted(wanted - names)
if missing or "delegation_broker/py.typed" not in names:
    sys.exit(f"run-tests.sh: the wheel lacks {missing or ['delegation_broker/py.typed']}")
pins = []
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:") or "extra ==" in line:
        continue
    requirement = line.split(":", 1)[1].strip()
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    floor = re.search(r">=\s*([0-9][^,;\s)]*)", requirement)
    if not floor:
        sys.exit(f"run-tests.sh: dependency {requirement!r} has no lower bound to test")
    pins.append(f"{name}=={floor.group(1)}")
protobuf = [line.split(":", 1)[1].replace(" ", "") for line in metadata.splitlines()
            if re.match(r"Requires-Dist:\s*protobuf\b", line) and "extra ==" not in line]
if len(protobuf) != 1:
    sys.exit(f"run-tests.sh: the wheel declares {protobuf} for protobuf")
(lowest.parent / "protobuf-requirement").write_text(protobuf[0])
lowest.write_text("\n".join(pins) + "\n")
print(f"    {pathlib.Path(wheel).name}: {len(names)} files; lowest dependencies: {' '.join(pins)}")
PY

step "fresh virtualenv (nothing installed, not even pip): the wheel and its dependencies at their lowest versions"
"$PYTHON" -m venv --without-pip "$artifact/venv"
FPY="$artifact/venv/bin/python"
# This venv's pip installs into it (--python); pip's cache is shared.
"$VPY" -m pip --python "$FPY" install --quiet --constraint "$artifact/lowest.txt" "$wheel"
"$FPY" -I - "$artifact/lowest.txt" "$artifact/venv" <<'PY'
import importlib.metadata as m, pathlib, sys
import delegation_broker
def same(a, b):  # 1.5 == 1.5.0 (plain release numbers: what the floors are)
    strip = lambda v: v.split(".") + ["0"] * (8 - v.count("."))
    return strip(a)[:8] == strip(b)[:8]
pins = [line.split("==") for line in pathlib.Path(sys.argv[1]).read_text().split()]
wrong = [f"{name} {m.version(name)} (wanted {version})" for name, version in pins if not same(m.version(name), version)]
if wrong:
    sys.exit(f"run-tests.sh: not the lowest versions: {wrong}")
if not delegation_broker.__file__.startswith(str(pathlib.Path(sys.argv[2]).resolve())):
    sys.exit(f"run-tests.sh: delegation_broker imported from {delegation_broker.__file__}, not the fresh venv")
print("    installed:", ", ".join(sorted(f"{d.metadata['Name']} {d.version}" for d in m.distributions())))
PY

step "examples/three_hops.py from that virtualenv, against the real broker ($BROKER_BIN)"
mkdir -p "$artifact/broker" "$artifact/run"
start_attested_broker "$artifact/broker"
cp "$HERE/examples/three_hops.py" "$artifact/run/"
if ! (cd "$artifact/run" && "$FPY" -I three_hops.py --target "$address" \
        --attestor-seed "$(cat "$artifact/broker/attestor.seed")") >"$artifact/run/out" 2>&1; then
    echo "run-tests.sh: examples/three_hops.py failed in the fresh virtualenv:" >&2
    cat "$artifact/run/out" >&2
    exit 1
fi
sed 's/^/    /' "$artifact/run/out"
if ! grep -q "^verified a chain of 4 contracts: 3 hash links and the leaf's signature" "$artifact/run/out"; then
    echo "run-tests.sh: examples/three_hops.py did not verify its chain" >&2
    exit 1
fi
kill -TERM "$broker_pid"
for _ in $(seq 150); do kill -0 "$broker_pid" 2>/dev/null || break; sleep 0.1; done
code=0
wait "$broker_pid" || code=$?
broker_pid=""
if [[ $code -ne 0 ]]; then
    echo "run-tests.sh: the broker exited with $code on SIGTERM; log:" >&2
    cat "$artifact/broker/log" >&2
    exit 1
fi

step "protobuf<7 in that virtualenv (as a package pinning it would bring): import must fail, naming what it needs"
# pip installs it, warning that delegation-broker-client requires protobuf>=7.
"$VPY" -m pip --python "$FPY" install --quiet 'protobuf<7' >"$artifact/pip-protobuf6.log" 2>&1 \
    || { cat "$artifact/pip-protobuf6.log" >&2; exit 1; }
if "$FPY" -I -c 'import delegation_broker' >"$artifact/import.log" 2>&1; then
    echo "run-tests.sh: delegation_broker imported under $("$FPY" -I -c 'import google.protobuf as p; print("protobuf", p.__version__)')" >&2
    exit 1
fi
protobuf_req="$(cat "$artifact/protobuf-requirement")"
if ! grep -q "^ImportError: delegation_broker cannot import its generated modules: VersionError" "$artifact/import.log" \
    || ! grep -qF "It needs $protobuf_req (installed: 6." "$artifact/import.log"; then
    echo "run-tests.sh: importing under protobuf<7 did not fail with the client's ImportError naming $protobuf_req:" >&2
    cat "$artifact/import.log" >&2
    exit 1
fi
grep '^ImportError' "$artifact/import.log" | cut -c1-160 | sed 's/^/    /'

cleanup
trap - EXIT
printf -- '--> wheel checks: %ss\n' "$((SECONDS - started))"

step "pytest"
cd "$HERE"
exec "$VPY" -m pytest "$@"
