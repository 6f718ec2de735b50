#!/usr/bin/env bash
# The open-loop tail against its floors, in one sitting: at
# RATE arrivals a second, `disk-probe` (the disk: append + fdatasync),
# `store-probe --rate` (SQLite doing exactly the broker's writes, with
# its writer, syncer and checkpointer and nothing else) and the broker
# (`bench --rate`), each alone; then both probes again while
# `bench --floor --rate` (the crypto and RPC a broker cannot shed) loads
# the same cores. Prints each one's request p99 and what stalled.
#
#   scripts/open-loop-bench.sh target/release/delegation-broker [RATE] [ROUNDS] [DIR]
#
# DIR (default: a scratch directory under /tmp) should be on the disk the
# broker's data would live on.
set -euo pipefail
bin=${1:?usage: $0 BIN [RATE] [ROUNDS] [DIR]}
rate=${2:-2600}
rounds=${3:-2}
dir=${4:-$(mktemp -d /tmp/open-loop.XXXXXX)}
export BROKER_LOG=error
shown='request floor|delegate latency|fsyncs; the writer|queued to its batch|its batch|committed to answered'

run() { # name, command...
  local name=$1; shift
  echo "== $name"
  "$@" 2>&1 | grep -E "$shown" || true
}

loaded() { # name, command...: the command while the floor runs at the same rate
  local load
  load=$(mktemp)
  "$bin" bench --floor --rate "$rate" --depth 8 --concurrency 64 \
      --duration-s 16 --warmup-s 1 >"$load" 2>&1 &
  local pid=$!
  sleep 3
  run "$1 (under the floor's load)" "${@:2}"
  wait "$pid"
  echo "   (the load: $(grep -m1 -E '^delegations' "$load"))"
  rm -f "$load"
}

for round in $(seq 1 "$rounds"); do
  echo "### round $round, $rate/s, in $dir"
  rm -rf "$dir/disk" "$dir/store"
  mkdir -p "$dir/disk" "$dir/store"
  run disk-probe "$bin" disk-probe --dir "$dir/disk" --rate "$rate" --duration-s 10
  run store-probe "$bin" store-probe --dir "$dir/store" --rate "$rate" --contracts $((rate * 10))
  run broker "$bin" bench --rate "$rate" --depth 8 --concurrency 64 --duration-s 10 --warmup-s 1
  loaded disk-probe "$bin" disk-probe --dir "$dir/disk" --rate "$rate" --duration-s 10
  loaded store-probe "$bin" store-probe --dir "$dir/store" --rate "$rate" --contracts $((rate * 10))
done
rm -rf "$dir/disk" "$dir/store"
