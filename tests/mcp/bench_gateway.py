"""Benchmark (not a test) of `mcp gateway`: the latency it adds to
a tool call, and how many calls it records per second.

    BROKER_BIN=target/release/delegation-broker tests/mcp/run-tests.sh bench_gateway.py -s

Run through run-tests.sh (the venv), with a release build. Prints, for the
same filesystem tool server (servers/fs_server.py on stdio) and the same
client (the official Python SDK, legacy mode):

- sequential `write_file` calls, direct to the server and through the
  gateway: median, p90 and p99 latency, and the median the gateway adds
  (each call through the gateway reads the contract and is recorded at the
  broker, SQLite with an fsync per commit, before it is answered);
- the same with the broker's commit made cheap (`read_file` with no
  units... still recorded: every call is) — so the gateway's own share;
- CONCURRENCY clients' worth of calls in flight through one gateway:
  calls answered (= recorded) per second, and calls per RecordReceipts
  request (from the broker's /metrics: the group commit at work);
- the disk's floor: `disk-probe` at the same rate for 5 s (the fsync
  latency no broker commit can beat).

Knobs: BENCH_CALLS (sequential calls per arm, default 300), BENCH_CONCURRENT
(calls in the throughput run, default 3000), BENCH_CONCURRENCY (default 64).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

from mcp import Client, StdioServerParameters, stdio_client
from test_gateway import FS_SERVER, PYTHON, fs_server, fs_tools, issue, make_gateway, open_gateway, open_root
from test_tools import Broker, Outputs, broker_bin, connect, make_agents

CALLS = int(os.environ.get("BENCH_CALLS", "300"))
CONCURRENT = int(os.environ.get("BENCH_CONCURRENT", "3000"))
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "64"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bbroker() -> Any:
    """A broker as an operator runs it: warnings only, metrics on."""
    binary = broker_bin()
    workdir = Path(tempfile.mkdtemp(prefix="mcp-bench-"))
    metrics = free_port()
    process = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(workdir / "data"),
         "--metrics", f"127.0.0.1:{metrics}"],
        stdout=subprocess.PIPE, stderr=open(workdir / "broker.stderr", "wb"), stdin=subprocess.DEVNULL,
        env={**os.environ, "BROKER_LOG": "warn"},
    )
    line = process.stdout.readline().decode().strip()  # type: ignore[union-attr]
    match = re.fullmatch(r"listening on (127\.0\.0\.1:\d+)", line)
    assert match, line
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # type: ignore[union-attr]
    broker = Broker(binary, f"http://{match.group(1)}", workdir, process, workdir / "broker.stderr")
    broker.metrics = f"http://127.0.0.1:{metrics}/metrics"  # type: ignore[attr-defined]
    yield broker
    process.terminate()
    process.wait(15)
    shutil.rmtree(workdir, ignore_errors=True)


def record_receipts_calls(broker: Any) -> float:
    text = urllib.request.urlopen(broker.metrics, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total") and "RecordReceipts" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median_ms": statistics.median(ordered) * 1e3, "p90_ms": at(0.9) * 1e3, "p99_ms": at(0.99) * 1e3}


async def timed(client: Client, tool: str, arguments: Any) -> float:
    start = time.perf_counter()
    result = await client.call_tool(tool, arguments)
    took = time.perf_counter() - start
    assert not result.is_error, result
    return took


def test_gateway_latency_and_throughput(bbroker: Any) -> None:
    agents, names_file = make_agents(bbroker, ["orchestrator", "worker", "host"])
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="fs-", dir=bbroker.workdir))
    report: dict[str, Any] = {}

    async def bench() -> None:
        async with AsyncExitStack() as stack:
            for name in ("orchestrator", "worker"):
                await connect(stack, bbroker, agents[name], names_file, "legacy")
            root_id = await open_root(outputs, agents["orchestrator"], "bench", budget=10**12)
            contract = await issue(outputs, agents["orchestrator"], agents["worker"], root_id, agents["host"],
                                   10**11, "bench")
            server = fs_server("fs", home / "root", home / "fs.log")
            units = {"write_file": {"mutates": ["path"], "units": 1}, "read_file": {"reads": ["path"]}}
            gateway = make_gateway(bbroker, "bench", agents["host"], [server], fs_tools("fs", units),
                                   contract=contract, call_timeout_ms=30000)
            through = await open_gateway(stack, bbroker, gateway, "legacy")
            direct = Client(
                stdio_client(StdioServerParameters(command=PYTHON, args=server["args"]),
                             errlog=stack.enter_context(open(home / "direct.stderr", "w"))),
                mode="legacy",
            )
            await stack.enter_async_context(direct)
            # Warm both paths, then alternate them call by call (the machine is noisy).
            for i in range(20):
                await timed(direct, "write_file", {"path": f"out/w{i}", "content": "x"})
                await timed(through, "write_file", {"path": f"out/w{i}", "content": "x"})
            arms: dict[str, list[float]] = {"direct": [], "gateway": []}
            for i in range(CALLS):
                args = {"path": f"out/s{i}", "content": "x" * 64}
                arms["direct"].append(await timed(direct, "write_file", args))
                arms["gateway"].append(await timed(through, "write_file", args))
            report["sequential write_file"] = {arm: summary(s) for arm, s in arms.items()}
            report["added median ms"] = (statistics.median(arms["gateway"]) - statistics.median(arms["direct"])) * 1e3

            async def concurrently(client: Client, prefix: str) -> tuple[float, list[float]]:
                limit = anyio.Semaphore(CONCURRENCY)
                latencies: list[float] = []

                async def one(i: int) -> None:
                    async with limit:
                        latencies.append(await timed(client, "write_file", {"path": f"out/{prefix}{i}", "content": "y"}))

                start = time.perf_counter()
                async with anyio.create_task_group() as group:
                    for i in range(CONCURRENT):
                        group.start_soon(one, i)
                return time.perf_counter() - start, latencies

            # The same load straight to the tool server: what the client and
            # the server manage without the gateway.
            direct_elapsed, direct_latencies = await concurrently(direct, "d")
            report["concurrent, direct"] = {"calls per s": CONCURRENT / direct_elapsed, **summary(direct_latencies)}
            before = record_receipts_calls(bbroker)
            elapsed, latencies = await concurrently(through, "c")
            requests = record_receipts_calls(bbroker) - before
            report["concurrent"] = {
                "calls": CONCURRENT,
                "concurrency": CONCURRENCY,
                "calls recorded per s": CONCURRENT / elapsed,
                "RecordReceipts requests": requests,
                "calls per request": CONCURRENT / requests if requests else None,
                **summary(latencies),
            }

    anyio.run(bench)
    probe = subprocess.run(
        [bbroker.bin, "disk-probe", "--dir", str(bbroker.workdir), "--rate", "1000", "--duration-s", "5"],
        capture_output=True, timeout=120, text=True,
    )
    report["disk-probe (rate 1000/s, 5 s)"] = probe.stdout.strip()[-1500:] or probe.stderr.strip()[-500:]
    print(json.dumps(report, indent=1))
