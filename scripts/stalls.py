#!/usr/bin/env python3
"""Where the whole broker stopped: every interval in which no request
thread ran, and what the other threads ran meanwhile.

Runs an in-process `bench` of a broker build under `perf record` (call
graphs, 1,999 samples a second per thread), then lists each interval of
more than `--gap-ms` with no `tokio-rt-worker` sample (the request
threads, and the bench's own client) and, for that interval, the most
frequent stacks of every other thread. A gap in which one thread runs
alone (the writer freeing memory under a lock every request needs, say)
is a stall of the whole broker; a gap in which nothing runs is a wait on
the disk. The closed-loop 140–180 ms stalls of the SQLite writer were found this
way (docs/benchmarks-history.md). Gaps at the very end are the
broker's shutdown.

    scripts/stalls.py --bin target/release/delegation-broker --gap-ms 10

Needs `perf` (Debian: linux-perf) and permission to profile the process.
Only the Python standard library otherwise.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
import time

REQUEST_THREAD = "tokio-rt-worker"
# Gaps this close to the last request-thread sample are the shutdown.
SHUTDOWN_S = 0.5
HEADER = re.compile(r"^\s*(\S.*?)\s+(\d+)\s+(\d+\.\d+):")


def samples(script: str):
    """(time s, thread name, frames innermost first) of every sample."""
    out = []
    for block in script.split("\n\n"):
        rows = block.strip().split("\n")
        match = HEADER.match(rows[0]) if rows and rows[0] else None
        if not match:
            continue
        frames = [r.strip().split(" ", 1)[-1] for r in rows[1:]]
        out.append((float(match.group(3)), match.group(1), frames))
    out.sort(key=lambda s: s[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", required=True, help="a broker binary")
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--duration-s", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--rate", type=int, default=0, help="open loop at this rate (0: closed)")
    parser.add_argument("--stacks", type=int, default=6, help="stacks shown per gap")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "perf.data")
        env = dict(os.environ, BROKER_LOG="error")
        bench = subprocess.Popen(
            [os.path.abspath(args.bin), "bench", "--depth", str(args.depth),
             "--concurrency", str(args.concurrency), "--duration-s", str(args.duration_s),
             "--warmup-s", "1", "--rate", str(args.rate)],
            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(0.3)
        perf = subprocess.Popen(
            ["perf", "record", "-F", "1999", "-e", "cpu-clock", "-g", "-p", str(bench.pid),
             "-o", data], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        output, _ = bench.communicate()
        perf.wait()
        for line in output.splitlines():
            if "/s" in line or "latency" in line:
                print(line)
        script = subprocess.run(
            ["perf", "script", "-i", data, "-F", "comm,tid,time,ip,sym"],
            capture_output=True, text=True, check=True).stdout

    every = samples(script)
    workers = [s for s in every if s[1] == REQUEST_THREAD]
    if not workers:
        raise SystemExit("no request-thread samples: was perf allowed to profile?")
    end = workers[-1][0]
    gaps = [(a[0], b[0]) for a, b in zip(workers, workers[1:])
            if b[0] - a[0] > args.gap_ms / 1000]
    print(f"{len(workers)} request-thread samples; {len(gaps)} gaps over {args.gap_ms} ms")
    for start, stop in gaps:
        inside = [s for s in every if start < s[0] < stop]
        threads = collections.Counter(s[1] for s in inside)
        # The broker's shutdown (its caches freed) follows the last call.
        tail = " (the run's end: shutdown)" if end - stop < SHUTDOWN_S else ""
        print(f"\n{(stop - start) * 1000:.1f} ms at +{start - every[0][0]:.3f} s{tail}; "
              f"samples of other threads: {dict(threads)}")
        stacks = collections.Counter(" <- ".join(f[:60] for f in s[2][:6]) for s in inside)
        for stack, count in stacks.most_common(args.stacks):
            print(f"  {count:4d}  {stack}")


if __name__ == "__main__":
    main()
