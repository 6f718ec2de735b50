#!/usr/bin/env python3
"""The write path per delegation, for one or more broker builds, alternating
builds in one sitting (this machine is noisy): for each depth, each build
serves on a fresh data directory, its own `bench --addr` drives it, and we
report throughput, latency, the broker process's CPU per delegation, and the
bytes stored per delegation (the signed contract, and the database files).

Every round first measures the floor (`bench --floor`: the same calls
answered with only their crypto and RPC work, no store, no rules) and
prints each build's throughput as a ratio to it. `--in-process` runs the
brokers in the bench's own process too (`bench` without `--addr`), as the
floor is: the shape the write-path targets are stated in. With it, after
each in-process build the store's own floor is measured too (`store-probe`:
the same number of contracts, in the groups that build committed — its
commands per WAL fsync — with no RPC, signature or rule), and the share of
the floor no broker on this store could exceed is printed beside it:
floor CPU / (floor CPU + store floor CPU), both per delegation.

    scripts/write-path-bench.py --build before=/tmp/broker-before \\
        --build after=target/release/delegation-broker --depths 1,8,32

Only the Python standard library; sqlite3 reads the finished database.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sqlite3
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def steal_seconds() -> float:
    """CPU time the hypervisor took from this machine since boot (the
    eighth figure of /proc/stat's "cpu" line): a run during which it rose
    shared its cores with another guest, and is not comparable."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / TICKS if len(fields) > 8 else 0.0


def wait_for_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"broker did not listen on {port}")


def scrape_every_second(port: int, stop: threading.Event) -> None:
    """What a Prometheus server does to a target, a little more often."""
    while not stop.wait(1.0):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        except OSError:
            pass


BENCH_LINE = re.compile(r"delegations: (\d+) issued in ([\d.]+)s = (\d+)/s \(roots opened (\d+)")
LATENCY_LINE = re.compile(r"p50 ([\d.]+)\s+p99 ([\d.]+)\s+p999 ([\d.]+)")


def run_in_process(binary: str, depth: int, args, floor: bool) -> dict:
    """`bench` with its broker (or, with `floor`, the floor) in its own
    process: the whole process's CPU per delegation, roots included."""
    env = {**os.environ, "BROKER_LOG": "warn"}
    command = [binary, "bench", "--depth", str(depth), "--concurrency", str(args.concurrency),
               "--duration-s", str(args.duration_s), "--warmup-s", str(args.warmup_s)]
    if floor:
        command.append("--floor")
    before = os.times()
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env, timeout=600).stdout
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    issued = BENCH_LINE.search(out)
    latency = LATENCY_LINE.search(out)
    measured = int(issued.group(1))
    # Warm-up included: the process's CPU covers it too.
    total = measured * (args.duration_s + args.warmup_s) / args.duration_s
    fsyncs = FSYNCS_LINE.search(out)
    commands = COMMANDS_LINE.search(out)
    return {
        # The measured window's commands (roots included) and how many a
        # WAL fsync covered: what `store-probe` is given.
        "commands": int(commands.group(1)) if commands else 0,
        "per_fsync": int(commands.group(1)) / max(int(fsyncs.group(1)), 1) if commands and fsyncs else 0,
        "rate": int(issued.group(3)),
        "measured": measured,
        "p50": float(latency.group(1)),
        "p99": float(latency.group(2)),
        "p999": float(latency.group(3)),
        "cpu_us_per_delegation": 1e6 * cpu / max(total, 1),
    }


def run(binary: str, depth: int, args, metrics: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="write-path-") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "BROKER_LOG": "warn"}
        public = subprocess.run(
            [binary, "keygen", "--out", str(tmp / "attestor.key")],
            check=True, capture_output=True, text=True, env=env,
        ).stdout.strip()
        seed = (tmp / "attestor.key").read_text().strip()
        (tmp / "config.toml").write_text(f'[trust]\nattestors = ["{public}"]\n')
        port = free_port()
        data = tmp / "data"
        serve = [binary, "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", str(data),
                 "--config", str(tmp / "config.toml")]
        metrics_port = free_port()
        if metrics:
            serve += ["--metrics", f"127.0.0.1:{metrics_port}"]
        server = subprocess.Popen(serve, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop_scraping = threading.Event()
        if metrics:
            threading.Thread(target=scrape_every_second, args=(metrics_port, stop_scraping), daemon=True).start()
        try:
            wait_for_port(port)
            cpu_before = cpu_seconds(server.pid)
            out = subprocess.run(
                [binary, "bench", "--addr", f"http://127.0.0.1:{port}", "--attestor-seed", seed,
                 "--depth", str(depth), "--concurrency", str(args.concurrency),
                 "--duration-s", str(args.duration_s), "--warmup-s", str(args.warmup_s)],
                check=True, capture_output=True, text=True, env=env, timeout=600,
            ).stdout
            cpu = cpu_seconds(server.pid) - cpu_before
        finally:
            stop_scraping.set()
            server.terminate()
            server.wait(timeout=30)
        issued = BENCH_LINE.search(out)
        latency = LATENCY_LINE.search(out)
        db = sqlite3.connect(data / "broker.sqlite3")
        children, envelope_bytes, row_count = db.execute(
            "SELECT COUNT(*), SUM(LENGTH(e.envelope)), (SELECT COUNT(*) FROM contracts) "
            "FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq WHERE c.parent_seq IS NOT NULL"
        ).fetchone()
        deepest = db.execute(
            "SELECT AVG(LENGTH(e.envelope)) FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq "
            "WHERE c.depth = (SELECT MAX(depth) FROM contracts)"
        ).fetchone()[0]
        db.close()
        files = sum(p.stat().st_size for p in data.glob("broker.sqlite3*"))
        # Every delegation the run made (warm-up and measured, finished
        # chains or not) left one child row: the disk per delegation.
        return {
            "rate": int(issued.group(3)),
            "measured": int(issued.group(1)),
            "p50": float(latency.group(1)),
            "p99": float(latency.group(2)),
            "p999": float(latency.group(3)),
            "cpu_us_per_delegation": 1e6 * cpu / max(children, 1),
            "contract_bytes": envelope_bytes / max(children, 1),
            "deepest_contract_bytes": deepest,
            "db_bytes_per_contract": files / max(row_count, 1),
        }


FSYNCS_LINE = re.compile(r"WAL fsyncs: (\d+)")
COMMANDS_LINE = re.compile(r"per command \((\d+) commands")
STORE_FLOOR_LINE = re.compile(r"store floor: ([\d.]+) µs")


def has_store_probe(binary: str) -> bool:
    """Older builds have no `store-probe`."""
    return subprocess.run([binary, "store-probe", "--help"], capture_output=True).returncode == 0


def store_floor(binary: str, depth: int, args, contracts: int, group: int) -> float:
    """`store-probe`'s CPU per delegation for `contracts` in groups of `group`."""
    with tempfile.TemporaryDirectory() as scratch:
        out = subprocess.run(
            [binary, "store-probe", "--dir", scratch, "--workers", str(args.concurrency),
             "--depth", str(depth), "--group", str(group), "--contracts", str(contracts)],
            check=True, capture_output=True, text=True, timeout=600,
            env={**os.environ, "BROKER_LOG": "warn"}).stdout
    return float(STORE_FLOOR_LINE.search(out).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="append", required=True, help="name=path of a broker binary")
    parser.add_argument("--depths", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration-s", type=int, default=10)
    parser.add_argument("--warmup-s", type=int, default=2)
    parser.add_argument("--metrics", action="append", default=[],
                        help="name of a build to serve with --metrics (scraped every second)")
    parser.add_argument("--in-process", action="store_true",
                        help="run each broker inside its bench process, as the floor runs")
    parser.add_argument("--floor-build", help="binary whose `bench --floor` measures the floor "
                        "(default: the last --build; older builds have no --floor)")
    args = parser.parse_args()
    builds = [b.split("=", 1) for b in args.build]
    floor_binary = args.floor_build or builds[-1][1]
    cpu_column = "process CPU µs/delegation (bench included)" if args.in_process else "broker CPU µs/delegation"
    sizes_columns = ("store floor µs/delegation | at most (of the floor) | |" if args.in_process
                     else "signed contract B (mean child) | deepest contract B | DB bytes/contract |")
    print(f"| round | depth | build | delegations/s | of the floor | p50 ms | p99 ms | p999 ms | {cpu_column} "
          f"| {sizes_columns} steal s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for round_ in range(1, args.rounds + 1):
        for depth in [int(d) for d in args.depths.split(",")]:
            stolen = steal_seconds()
            floor = run_in_process(floor_binary, depth, args, floor=True)
            stolen = steal_seconds() - stolen
            print(f"| {round_} | {depth} | floor | {floor['rate']} | 100% | {floor['p50']:.2f} | "
                  f"{floor['p99']:.2f} | {floor['p999']:.2f} | {floor['cpu_us_per_delegation']:.0f} "
                  f"(bench included) | | | | {stolen:.2f} |", flush=True)
            order = builds if round_ % 2 else list(reversed(builds))
            for name, binary in order:
                stolen = steal_seconds()
                if args.in_process:
                    r = run_in_process(binary, depth, args, floor=False)
                    stolen = steal_seconds() - stolen
                    sizes = "| | |"
                    # The store's floor for the groups this build committed,
                    # measured with the floor's build (the newest schema).
                    group = max(1, min(args.concurrency, round(r["per_fsync"])))
                    if r["commands"] and has_store_probe(floor_binary):
                        contracts = round(r["commands"] * (args.duration_s + args.warmup_s) / args.duration_s)
                        store = store_floor(floor_binary, depth, args, contracts, group)
                        ceiling = 100.0 * floor["cpu_us_per_delegation"] / (
                            floor["cpu_us_per_delegation"] + store)
                        sizes = f"{store:.0f} (groups of {group}) | {ceiling:.0f}% | |"
                else:
                    r = run(binary, depth, args, metrics=name in args.metrics)
                    stolen = steal_seconds() - stolen
                    sizes = (f"{r['contract_bytes']:.0f} | {r['deepest_contract_bytes']:.0f} | "
                             f"{r['db_bytes_per_contract']:.0f} |")
                ratio = 100.0 * r["rate"] / max(floor["rate"], 1)
                print(f"| {round_} | {depth} | {name} | {r['rate']} | {ratio:.0f}% | {r['p50']:.2f} | "
                      f"{r['p99']:.2f} | {r['p999']:.2f} | {r['cpu_us_per_delegation']:.0f} | {sizes} "
                      f"{stolen:.2f} |", flush=True)


if __name__ == "__main__":
    main()
