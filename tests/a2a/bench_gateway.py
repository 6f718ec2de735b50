"""Benchmark (not a test) of `delegation-broker a2a-gateway`: the latency the
gateways add to a SendMessage round trip, and their CPU per admitted task
next to the broker's CPU per delegation. Target: at most 5 ms added at the
median on this machine (a delegated call needs three commits: Delegate,
Accept, Complete).

    tests/a2a/.venv/bin/python tests/a2a/bench_gateway.py --calls 300
    BROKER_BIN=target/debug/delegation-broker tests/a2a/.venv/bin/python tests/a2a/bench_gateway.py

(The venv is the one run-tests.sh makes.) BROKER_BIN picks the binary;
unset: target/release/delegation-broker if present, else target/debug (the
choice is printed, with a warning when the release build is older than the
debug one). One broker (test_a2a.start_broker: SQLite, an fsync per commit),
one stock worker agent (agents/worker.py --mode good: completes at once)
and two gateways, all started with test_a2a's helpers and stopped at the end
(they also die with this process). Logging is BROKER_LOG=warn unless set.

The client is the A2A Python SDK's (test_a2a.A2AUser, JSON-RPC, blocking
SendMessage), one message per call in a new context, the two arms
alternated call by call after a warm-up (the machine is noisy):

- direct: to the worker agent itself;
- through: the client plays a caller agent whose outbound client points at
  its own gateway's egress, `EGRESS/peers/worker`. That gateway is egress
  only (`egress_listen`, no `listen`/`upstream`), holds the caller's key,
  has the worker in its address book and a route carving 1 unit per call;
  the caller's key holds one root (budget 10^9), so the egress delegates
  from it (ListHeld finds the single held contract, then a Delegate; the
  root's terms and chain are read once, and the new contract's chain is
  the root's and the Delegate's answer). The worker sits behind its own gateway (ingress: chain
  verified offline, GetContract, SendMessage to the agent, Accept, GetTask,
  Complete with the predicate judged, then the answer). So a call is two
  more HTTP hops and every broker call above.

Prints p50/p90/p99 of each arm and the median added; the CPU (user+system,
/proc/PID/stat, before and after the measured phase, divided by the calls)
of each gateway and of the broker, with each process's idle CPU rate over a
few seconds before (the measured phase includes the direct calls' time, when
gateways and broker are idle); the worker agent's GetTask per through call
(1: the gateway's follower found the task settled at once; more: it waited
poll_ms); and the root's ledger after the run. Load average at start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_a2a import (  # noqa: E402
    EGRESS_LINE,
    GATEWAY_START_S,
    REPO_ROOT,
    WORKER_ROUTE,
    A2AUser,
    BrokerSide,
    Peer,
    Proc,
    StartError,
    await_agent,
    await_gateway,
    expect_lines,
    ext_of,
    gateway_config,
    keygen,
    output_of,
    run,
    show,
    start_agent,
    start_broker,
    start_gateway,
    state_of,
    task_message,
)

DEFAULT_POLL_MS = 250  # the gateway's own default (crates/a2a/src/config.rs)
ADDED_TARGET_MS = 5.0  # the most the two gateways may add at the median
IDLE_S = 3.0  # the idle CPU window before the measured phase
CLK_TCK = os.sysconf("SC_CLK_TCK")


def choose_binary() -> tuple[str, str]:
    """BROKER_BIN, else the release build if present, else the debug one; and
    a line saying which and why."""
    release = REPO_ROOT / "target/release/delegation-broker"
    debug = REPO_ROOT / "target/debug/delegation-broker"
    named = os.environ.get("BROKER_BIN")
    if named:
        path = Path(named)
        if not path.is_absolute():
            path = Path.cwd() / path if (Path.cwd() / path).exists() else REPO_ROOT / path
        why = "BROKER_BIN"
    elif release.exists():
        path, why = release, "BROKER_BIN unset: the release build"
    else:
        path, why = debug, "BROKER_BIN unset, no release build: the debug build"
    if not (path.is_file() and os.access(path, os.X_OK)):
        sys.exit(f"bench_gateway: no broker binary at {path} (set BROKER_BIN)")
    kind = "release" if "/release/" in str(path) else "debug" if "/debug/" in str(path) else "?"
    built = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    line = f"binary: {path} ({kind}; {why}; built {built})"
    if kind == "release" and debug.exists() and debug.stat().st_mtime > path.stat().st_mtime:
        line += "\n  WARNING: the release build is older than the debug build: it may predate the sources"
    return str(path), line


def cpu_seconds(pid: int) -> float:
    """user + system time of a process (all its threads), from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields from 3 (state) on
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime (14), stime (15)


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": statistics.median(ordered) * 1e3, "p90_ms": at(0.9) * 1e3, "p99_ms": at(0.99) * 1e3}


def egress_only_config(path: Path, **kwargs: Any) -> Path:
    """test_a2a.gateway_config without `listen` and `upstream`: an egress-only gateway."""
    gateway_config(path, upstream="http://127.0.0.1:1", **kwargs)
    lines = path.read_text().splitlines()
    kept = [line for line in lines if not line.startswith(("listen = ", "upstream = "))]
    assert len(kept) == len(lines) - 2, lines
    path.write_text("\n".join(kept) + "\n")
    return path


async def timed(user: A2AUser, url: str, through: bool) -> float:
    message = task_message("six times seven?")
    start = time.perf_counter()
    task = await user.send(url, message)
    took = time.perf_counter() - start
    user.raw.clear()  # the client's hook keeps every raw answer: not needed here
    assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
    assert output_of(task) == {"answer": 42}, show(task)
    if through:
        assert ext_of(task).get("verdict") == "ACCEPTED", show(task)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="measured calls per arm (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up calls per arm (default 20)")
    parser.add_argument("--poll-ms", type=int, default=DEFAULT_POLL_MS,
                        help=f"both gateways' poll_ms (default {DEFAULT_POLL_MS}, the gateway's default)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="the whole run at most (default 900)")
    args = parser.parse_args()
    assert args.calls > 0 and args.warmup >= 0

    # SIGTERM as KeyboardInterrupt-like exit, so `finally` stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("BROKER_LOG", "warn")  # broker and gateways (start_gateway reads it)
    os.environ.setdefault("RUST_LOG", "warn")
    binary, which = choose_binary()
    print(which)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"machine: {os.cpu_count()} cores, load average {' '.join(load)} (1, 5, 15 min) at start")
    print(
        f"calls: {args.calls} per arm after {args.warmup} warm-up, alternated direct/through; "
        f"poll_ms {args.poll_ms}; BROKER_LOG={os.environ['BROKER_LOG']}"
    )
    sys.stdout.flush()

    workdir = Path(tempfile.mkdtemp(prefix="a2a-gateway-bench-"))
    started: list[Proc] = []
    broker: BrokerSide | None = None
    try:
        keys = {name: keygen(binary, name, workdir) for name in ("auditor", "caller", "worker")}
        broker_proc, broker_addr = start_broker(binary, workdir, keys["auditor"])
        started.append(broker_proc)
        broker = BrokerSide(broker_addr, keys["auditor"].signer)

        agent = start_agent(workdir, "worker", "worker.py", ["--mode", "good"], keys["worker"])
        started.append(agent.proc)
        await_agent(agent)

        worker_gw = start_gateway(
            binary, workdir, "worker",
            gateway_config(workdir / "worker.gateway.toml", broker=broker_addr, key=keys["worker"],
                           upstream=agent.url, poll_ms=args.poll_ms),
        )
        started.append(worker_gw.proc)
        await_gateway(worker_gw)

        caller_gw = start_gateway(
            binary, workdir, "caller",
            egress_only_config(
                workdir / "caller.gateway.toml", broker=broker_addr, key=keys["caller"], poll_ms=args.poll_ms,
                peers=[Peer("worker", keys["worker"], worker_gw.ingress)],
                routes={"worker": {**WORKER_ROUTE, "budget": 1}},
            ),
        )
        started.append(caller_gw.proc)
        caller_gw.egress = expect_lines(caller_gw.proc, {"egress": EGRESS_LINE}, GATEWAY_START_S)["egress"]

        # The caller's one contract. max_children bounds children open at
        # once (a completed child is settled and closed), so the helper's 16
        # covers sequential calls; the broker's ceiling is 1024.
        budget = 10**9
        root = broker.open_root(keys["caller"], budget=budget, max_depth=2,
                                ttl_ms=int(args.timeout_s * 1000) + 600_000)

        direct_url = agent.url
        through_url = f"{caller_gw.egress}/peers/worker"
        procs = {"caller gateway (egress)": caller_gw.proc, "worker gateway (ingress)": worker_gw.proc,
                 "broker": broker_proc}

        async def bench() -> dict[str, Any]:
            async with A2AUser(timeout=120) as user:
                for _ in range(args.warmup):
                    await timed(user, direct_url, False)
                    await timed(user, through_url, True)
                idle_before = {name: cpu_seconds(p.popen.pid) for name, p in procs.items()}
                await asyncio.sleep(IDLE_S)
                idle = {name: (cpu_seconds(p.popen.pid) - idle_before[name]) / IDLE_S for name, p in procs.items()}

                mark = agent.mark()
                before = {name: cpu_seconds(p.popen.pid) for name, p in procs.items()}
                wall = time.perf_counter()
                arms: dict[str, list[float]] = {"direct": [], "through": []}
                for _ in range(args.calls):
                    arms["direct"].append(await timed(user, direct_url, False))
                    arms["through"].append(await timed(user, through_url, True))
                wall = time.perf_counter() - wall
                after = {name: cpu_seconds(p.popen.pid) for name, p in procs.items()}
                gets = [e for e in agent.since(mark, "rpc") if e.get("method") in ("GetTask", "tasks/get")]
                return {
                    "arms": arms,
                    "wall_s": wall,
                    "idle_ms_per_s": {name: v * 1e3 for name, v in idle.items()},
                    "cpu_ms_per_call": {name: (after[name] - before[name]) * 1e3 / args.calls for name in procs},
                    "agent_gettask_per_through_call": len(gets) / args.calls,
                }

        result = run(bench(), args.timeout_s)
        root_state = broker.state(root.id)
    except StartError as error:
        sys.exit(f"bench_gateway: {error}")
    except BaseException:
        for proc in started:
            print(f"\n===== {proc.name} (exit {proc.popen.poll()}) stderr tail =====\n{proc.tail(2000)}",
                  file=sys.stderr)
        raise
    finally:
        for proc in reversed(started):
            proc.stop()
        if broker is not None:
            broker.close()
        if os.environ.get("A2A_TEST_KEEP"):
            print(f"kept {workdir} (A2A_TEST_KEEP)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    arms = result["arms"]
    stats = {arm: summary(samples) for arm, samples in arms.items()}
    added = (statistics.median(arms["through"]) - statistics.median(arms["direct"])) * 1e3
    print(f"\nSendMessage round trip (blocking), {args.calls} calls per arm, measured phase {result['wall_s']:.1f} s")
    print(f"  {'':<28}{'p50':>10}{'p90':>10}{'p99':>10}")
    for arm, label in (("direct", "direct to the agent"), ("through", "through both gateways")):
        s = stats[arm]
        print(f"  {label:<28}{s['p50_ms']:>7.2f} ms{s['p90_ms']:>7.2f} ms{s['p99_ms']:>7.2f} ms")
    print(f"  {'added at the median':<28}{added:>7.2f} ms   (target: at most {ADDED_TARGET_MS} ms: {'met' if added <= ADDED_TARGET_MS else 'NOT met'})")
    print(f"  worker agent GetTask per through call: {result['agent_gettask_per_through_call']:.2f} "
          "(the ingress's follower; above 1: its first read found the task still running)")

    cpu = result["cpu_ms_per_call"]
    print("\nCPU per call (user+system, /proc/PID/stat, measured phase / calls; idle rate over "
          f"{IDLE_S:.0f} s before the phase)")
    for name, value in cpu.items():
        idle = result["idle_ms_per_s"][name]
        print(f"  {name:<28}{value:>7.3f} ms per call   (idle {idle:.2f} ms/s: "
              f"{idle * result['wall_s'] / args.calls:.3f} ms per call of it over the phase)")
    broker_cpu = cpu["broker"]
    for name in ("caller gateway (egress)", "worker gateway (ingress)"):
        ratio = cpu[name] / broker_cpu if broker_cpu else float("inf")
        print(f"  {name} / broker: {ratio:.2f}  (target: at most 1: {'met' if ratio <= 1 else 'NOT met'})")

    both = cpu["caller gateway (egress)"] + cpu["worker gateway (ingress)"]
    print(f"  both gateways / broker: {both / broker_cpu if broker_cpu else float('inf'):.2f}  "
          f"(CPU clock ticks of {1e3 / CLK_TCK:.0f} ms: resolution {1e3 / CLK_TCK / args.calls:.3f} ms per call)")

    ledger = root_state.ledger
    print(f"\nroot after the run: budget {ledger.budget}, spent {ledger.spent}, reserved {ledger.reserved}, "
          f"residual {ledger.residual}, open children {ledger.open_children} "
          f"({args.warmup + args.calls} delegations of 1 unit)")
    print(json.dumps({"calls": args.calls, "warmup": args.warmup, "poll_ms": args.poll_ms, "binary": binary,
                      "load_average_at_start": load, **{arm: stats[arm] for arm in stats}, "added_p50_ms": added,
                      "cpu_ms_per_call": cpu, "idle_cpu_ms_per_s": result["idle_ms_per_s"],
                      "agent_gettask_per_through_call": result["agent_gettask_per_through_call"]}, indent=1))


if __name__ == "__main__":
    main()
