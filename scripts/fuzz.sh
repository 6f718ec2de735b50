#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ (cargo fuzz, libFuzzer) for a bounded
# time and fails if any of them finds a crash (panic, failed assertion,
# stack overflow, abort, per-input timeout or out-of-memory). See
# SECURITY.md §Fuzzing for what each target asserts and the figures of a
# longer run.
#
#   FUZZ_SECONDS    seconds per target (default 20)
#   FUZZ_TARGETS    space-separated targets (default: all five)
#   FUZZ_SANITIZER  none (default) or address
#   FUZZ_TIMEOUT    seconds one input may take before it counts as a
#                   crash (default 30; the judge's own cap is 2 s per
#                   evaluation, the conversion deadline 10 s)
#
# libFuzzer needs unstable rustc flags (-Z), so the build runs on the
# stable toolchain with RUSTC_BOOTSTRAP=1, for the fuzz build only.
# Inputs under fuzz/regressions/<target>/ (reproducers of past findings)
# run first, on every run; new corpus entries go to fuzz/corpus/<target>/
# (not committed) and crashes to fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO_FUZZ_VERSION=0.13.2
seconds="${FUZZ_SECONDS:-20}"
targets="${FUZZ_TARGETS:-decode_convert predicate schema scope invariants}"
sanitizer="${FUZZ_SANITIZER:-none}"
timeout="${FUZZ_TIMEOUT:-30}"

if [[ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]]; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --quiet
fi

# The targets build against exactly the dependency versions the broker
# ships with; cargo adds only libfuzzer-sys and arbitrary to this copy.
cp Cargo.lock fuzz/Cargo.lock

fuzz() {
    # One codegen unit (cargo-fuzz's default) makes the build several
    # minutes longer on two cores for no benefit to short runs.
    RUSTC_BOOTSTRAP=1 cargo fuzz "$1" --sanitizer "$sanitizer" --codegen-units 16 "${@:2}"
}

start=$(date +%s)
fuzz build
echo "fuzz targets built in $(($(date +%s) - start)) s"

mkdir -p fuzz/artifacts/logs
failed=()
for target in $targets; do
    corpus="fuzz/corpus/$target"
    mkdir -p "$corpus"
    dirs=("$corpus")
    [[ -d "fuzz/regressions/$target" ]] && dirs+=("fuzz/regressions/$target")
    log="fuzz/artifacts/logs/$target.log"
    if fuzz run "$target" "${dirs[@]}" -- \
        -max_total_time="$seconds" -timeout="$timeout" -print_final_stats=1 \
        >"$log" 2>&1; then
        # e.g. "#81234  DONE   cov: 3131 ft: 6331 corp: 449/38Kb ... exec/s: 5124"
        printf '%-15s %s\n' "$target" "$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1)"
    else
        printf '%-15s CRASHED (log: %s)\n' "$target" "$log"
        grep -v -E '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse|RELOAD)' "$log" | tail -n 60
        failed+=("$target")
    fi
done
echo "fuzzing took $(($(date +%s) - start)) s in all"
if ((${#failed[@]})); then
    echo "fuzz targets that crashed: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
