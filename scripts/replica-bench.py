#!/usr/bin/env python3
"""Throughput, latency and CPU per delegation of the broker on SQLite and on
PostgreSQL with one and with several replicas, measured in one sitting.
Every configuration runs real `delegation-broker serve`
processes driven by `delegation-broker bench --addr A,B,C`; configurations
alternate round by round (this machine is noisy).

CPU is read from /proc: utime + stime of each broker process and of every
process of the PostgreSQL server's user (the postmaster and its backends),
over the measured window only (after the warm-up).

    scripts/replica-bench.py --bin target/release/delegation-broker \\
        --rounds 2 --configs sqlite,pg1,pg3,sqlite-hot,pg1-hot,pg3-hot

With `--build NAME=BIN` (repeated) instead of `--bin`, each round runs
every configuration on every build in turn.

A configuration is `sqlite` or `pgN` (N replicas), `wK` after it for K
writers a replica (`pg1w2`), `-hot` after that for `bench --hot-parent`.

Prints one markdown table row per run, then the means. With
`--statements N`, the server loads pg_stat_statements and each PostgreSQL
run also prints its N statements with the most execution time, per
delegation and per call (where the database's CPU per delegation goes),
and each table's updated rows per delegation with the share that were HOT
(heap-only: no index entries written).
"""

import argparse
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TICKS = os.sysconf("SC_CLK_TCK")
# `limits.database_writers` of the replicas (--writers); None: default.
WRITERS = None


def cpu_seconds(pid):
    """utime + stime of one process, in seconds (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0


def user_cpu_seconds(uid):
    """utime + stime of every live process of `uid`, plus what its reaped
    children used (cutime + cstime of the postmaster covers backends that
    exited)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return total


def start_postgres(workdir, statements=False, settings=()):
    pgdir = os.path.join(workdir, "pg")
    os.makedirs(pgdir)
    out = subprocess.run(
        [os.path.join(HERE, "pg.sh"), "start", pgdir],
        check=True, capture_output=True, text=True,
    ).stdout
    url = re.search(r"BROKER_TEST_POSTGRES_URL=(\S+)", out).group(1)
    if statements:
        try:
            subprocess.run(["psql", url, "-qc",
                            "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"],
                           check=True)
            subprocess.run([os.path.join(HERE, "pg.sh"), "restart", pgdir],
                           check=True, capture_output=True)
            # Known only once the library is loaded.
            for sql in ("ALTER SYSTEM SET pg_stat_statements.track_planning = on",
                        "SELECT pg_reload_conf()"):
                subprocess.run(["psql", url, "-qc", sql], check=True, capture_output=True)
        except BaseException:
            subprocess.run([os.path.join(HERE, "pg.sh"), "stop", pgdir], capture_output=True)
            raise
    try:
        for setting in settings:
            name, value = setting.split("=", 1)
            subprocess.run(["psql", url, "-qc", f"ALTER SYSTEM SET {name} = '{value}'"],
                           check=True, capture_output=True)
        if settings:
            subprocess.run(["psql", url, "-qc", "SELECT pg_reload_conf()"],
                           check=True, capture_output=True)
    except BaseException:
        subprocess.run([os.path.join(HERE, "pg.sh"), "stop", pgdir], capture_output=True)
        raise
    owner = os.stat(os.path.join(pgdir, "data")).st_uid
    return pgdir, url, owner


def create_database(admin_url, name):
    subprocess.run(["psql", admin_url, "-qc", f"CREATE DATABASE {name}"], check=True)
    return admin_url.rsplit("/", 1)[0] + "/" + name


def spawn_broker(binary, workdir, name, attestor_pub, database_url, writers=None):
    data = os.path.join(workdir, name)
    os.makedirs(data)
    config = os.path.join(data, "broker.toml")
    with open(config, "w") as f:
        f.write(f'[trust]\nattestors = ["{attestor_pub}"]\n')
        writers = writers or WRITERS
        if writers:
            f.write(f"[limits]\ndatabase_writers = {writers}\n")
    args = [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", data, "--config", config]
    if database_url:
        args += ["--database-url", database_url]
    env = dict(os.environ, BROKER_LOG="warn")
    process = subprocess.Popen(args, stdout=subprocess.PIPE, env=env, text=True)
    line = process.stdout.readline().strip()
    address = line.removeprefix("listening on ")
    return process, f"http://{address}"


def run_bench(binary, addrs, seed, hot, args):
    command = [
        binary, "bench", "--addr", ",".join(addrs), "--attestor-seed", seed,
        "--concurrency", str(args.concurrency), "--depth", str(args.depth),
        "--duration-s", str(args.duration), "--warmup-s", str(args.warmup),
    ]
    if hot:
        command.append("--hot-parent")
    if args.rate:
        command += ["--rate", str(args.rate)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def parse(output):
    rate = re.search(r"= (\d+)/s", output)
    issued = re.search(r"delegations: (\d+) issued", output)
    errors = re.search(r"errors (\d+)", output)
    lat = re.search(r"p50 ([\d.]+)\s+p99 ([\d.]+)\s+p999 ([\d.]+)", output)
    if not (rate and issued and lat):
        sys.exit(f"bench output not understood:\n{output}")
    return {
        "rate": int(rate.group(1)),
        "issued": int(issued.group(1)),
        "errors": int(errors.group(1)) if errors else 0,
        "p50": float(lat.group(1)), "p99": float(lat.group(2)), "p999": float(lat.group(3)),
    }


def commits(url):
    """Transactions committed in the database at `url` so far (every
    replica's groups, the sequencer's and the pruner's): delegations per
    commit is the mean group size the replicas reached."""
    out = subprocess.run(
        ["psql", url, "-Atc",
         "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"],
        check=True, capture_output=True, text=True,
    ).stdout
    return int(out.strip() or 0)


def reset_statements(url):
    subprocess.run(["psql", url, "-qc",
                    "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; "
                    "SELECT pg_stat_statements_reset()"],
                   check=True, capture_output=True)


def top_statements(url, count, issued):
    """The `count` statements of this database with the most execution
    plus planning time since the reset (wall time in the server, lock
    waits included): µs per delegation, of it planning, calls per
    delegation, µs per call, and the statement's start."""
    out = subprocess.run(
        ["psql", url, "-AtF", "\t", "-c",
         "SELECT total_exec_time + total_plan_time, total_plan_time, calls, "
         "regexp_replace(query, '\\s+', ' ', 'g') "
         "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
         "WHERE datname = current_database()) ORDER BY total_exec_time + total_plan_time DESC "
         f"LIMIT {int(count)}"],
        check=True, capture_output=True, text=True,
    ).stdout
    lines = []
    for line in out.splitlines():
        total_ms, plan_ms, calls, query = line.split("\t", 3)
        total_ms, plan_ms, calls = float(total_ms), float(plan_ms), int(calls)
        lines.append(f"    {1000 * total_ms / issued:7.1f} µs/delegation "
                     f"(planning {1000 * plan_ms / issued:5.1f}) "
                     f"{calls / issued:5.2f} calls/delegation "
                     f"{1000 * total_ms / max(calls, 1):7.1f} µs/call  {query[:90]}")
    return lines


def table_updates(url):
    """Rows updated so far in each table, and how many of them were HOT
    (heap-only: no index entry written, the new row version on the same
    page): {table: (updated, hot)}. Read before and after the window, as
    the commits are (pg_stat_reset would zero those too)."""
    out = subprocess.run(
        ["psql", url, "-AtF", "\t", "-c",
         "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"],
        check=True, capture_output=True, text=True,
    ).stdout
    counts = {}
    for line in out.splitlines():
        table, updated, hot = line.split("\t")
        counts[table] = (int(updated), int(hot))
    return counts


def hot_lines(before, after, issued):
    """Each table's updated rows per delegation over the window, and the
    HOT share."""
    lines = []
    for table, (updated, hot) in sorted(after.items()):
        updated -= before.get(table, (0, 0))[0]
        hot -= before.get(table, (0, 0))[1]
        if updated > 0:
            lines.append(f"    {table}: {updated / issued:5.2f} rows updated/delegation, "
                         f"{100 * hot / updated:3.0f}% HOT")
    return lines


def idle_ticks():
    """(all, idle + iowait) ticks of the machine since boot: the idle share
    of a window is how much of the two cores no process used (a closed
    loop whose serial path waits leaves cores idle)."""
    fields = [int(f) for f in open("/proc/stat").read().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


def one_run(config, args, workdir, pg, seed, attestor_pub, number, binary):
    backend, _, mode = config.partition("-")
    # `pg1w2`: one replica with two writers (`--writers` for this
    # configuration only, so both counts alternate in one sitting).
    backend, _, writers = backend.partition("w")
    writers = int(writers) if writers else None
    replicas = {"sqlite": 1, "pg1": 1, "pg3": 3}[backend]
    url = None
    if backend != "sqlite":
        url = create_database(pg[1], f"bench_{number}")
    brokers = []
    for i in range(replicas):
        brokers.append(spawn_broker(binary, workdir, f"run{number}-b{i}", attestor_pub, url,
                                    writers))
    addrs = [addr for _, addr in brokers]
    bench = run_bench(binary, addrs, seed, mode == "hot", args)
    # CPU over the measured window only.
    time.sleep(args.warmup)
    before = ([cpu_seconds(p.pid) for p, _ in brokers], user_cpu_seconds(pg[2]) if url else 0.0)
    ticks_before = idle_ticks()
    commits_before = commits(url) if url else 0
    if url and args.statements:
        reset_statements(url)
        updates_before = table_updates(url)
    time.sleep(args.duration)
    after = ([cpu_seconds(p.pid) for p, _ in brokers], user_cpu_seconds(pg[2]) if url else 0.0)
    ticks_after = idle_ticks()
    committed = commits(url) - commits_before if url else 0
    if url and args.statements:
        # Both readings lag the commits by up to a second (backends
        # report their statistics at most once a second): the same lag.
        updates_after = table_updates(url)
    output, _ = bench.communicate()
    result = parse(output)
    if url and args.statements:
        # Over the measured window; calls counted while the bench ran on.
        issued = max(result["issued"], 1)
        result["statements"] = (top_statements(url, args.statements, issued)
                                + hot_lines(updates_before, updates_after, issued))
    for process, _ in brokers:
        process.terminate()
        process.wait()
    broker_cpu = sum(a - b for a, b in zip(after[0], before[0]))
    pg_cpu = after[1] - before[1]
    issued = max(result["issued"], 1)
    result.update(
        config=config,
        broker_us=1e6 * broker_cpu / issued,
        pg_us=1e6 * pg_cpu / issued,
        broker_cpu=broker_cpu,
        pg_cpu=pg_cpu,
        per_commit=result["issued"] / committed if committed else 0.0,
        idle=100 * (ticks_after[1] - ticks_before[1]) / max(ticks_after[0] - ticks_before[0], 1),
    )
    return result


def steal_seconds() -> float:
    """CPU time the hypervisor took from this machine since boot (the
    eighth figure of /proc/stat's "cpu" line): a run during which it rose
    shared its cores with another guest, and is not comparable."""
    fields = open("/proc/stat").read().split("\n", 1)[0].split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", help="the broker binary (or --build)")
    parser.add_argument("--build", action="append", default=[], metavar="NAME=BIN",
                        help="a build to compare, repeated: every round runs each "
                             "configuration on each build in turn (alternating builds "
                             "in one sitting); rows are labelled NAME:configuration")
    parser.add_argument("--configs", default="sqlite,pg1,pg3,sqlite-hot,pg1-hot,pg3-hot")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rate", type=int, default=0,
                        help="open loop: Delegate calls a second in all (0: closed loop)")
    parser.add_argument("--statements", type=int, default=0,
                        help="print each PostgreSQL run's N costliest statements (pg_stat_statements)")
    parser.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE",
                        help="a PostgreSQL server setting for the run (ALTER SYSTEM; "
                             "reloadable settings only), e.g. commit_delay=100")
    parser.add_argument("--writers", type=int, default=None,
                        help="limits.database_writers of the PostgreSQL replicas")
    args = parser.parse_args()
    global WRITERS
    WRITERS = args.writers
    if args.build:
        builds = [b.split("=", 1) for b in args.build]
        if any(len(b) != 2 for b in builds):
            parser.error("--build wants NAME=BIN")
    elif args.bin:
        builds = [("", args.bin)]
    else:
        parser.error("--bin or --build is required")
    builds = [(name, os.path.abspath(binary)) for name, binary in builds]
    args.bin = builds[0][1]
    configs = [c for c in args.configs.split(",") if c]
    workdir = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    # The PostgreSQL server runs as its own user: it must reach its dir.
    os.chmod(workdir, 0o755)
    keyfile = os.path.join(workdir, "attestor.seed")
    attestor_pub = subprocess.run(
        [args.bin, "keygen", "--out", keyfile], check=True, capture_output=True, text=True
    ).stdout.strip()
    seed = open(keyfile).read().strip()
    pg = (start_postgres(workdir, args.statements > 0, args.pg_setting)
          if any(c.startswith("pg") for c in configs) else None)
    print("| round | configuration | delegations/s | p50 ms | p99 ms | p999 ms | errors "
          "| broker CPU s | PostgreSQL CPU s | broker CPU µs/delegation | PostgreSQL CPU µs/delegation "
          "| delegations per commit | idle % | steal s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    number = 0
    try:
        for round_ in range(1, args.rounds + 1):
            runs = [(name, binary, config) for config in configs for name, binary in builds]
            order = runs if round_ % 2 else list(reversed(runs))
            for name, binary, config in order:
                number += 1
                stolen = steal_seconds()
                r = one_run(config, args, workdir, pg, seed, attestor_pub, number, binary)
                stolen = steal_seconds() - stolen
                label = f"{name}:{config}" if name else config
                r["label"] = label
                results.append(r)
                print(f"| {round_} | {label} | {r['rate']} | {r['p50']:.2f} | {r['p99']:.2f} "
                      f"| {r['p999']:.2f} | {r['errors']} | {r['broker_cpu']:.1f} | {r['pg_cpu']:.1f} "
                      f"| {r['broker_us']:.0f} | {r['pg_us']:.0f} | {r['per_commit']:.1f} "
                      f"| {r['idle']:.0f} | {stolen:.2f} |",
                      flush=True)
                for line in r.get("statements", []):
                    print(line, flush=True)
    finally:
        if pg:
            subprocess.run([os.path.join(HERE, "pg.sh"), "stop", pg[0]], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print("\nMeans:")
    labels = list(dict.fromkeys(r["label"] for r in results))
    for label in labels:
        runs = [r for r in results if r["label"] == label]
        mean = lambda k: sum(r[k] for r in runs) / len(runs)
        print(f"- {label}: {mean('rate'):.0f}/s, p99 {mean('p99'):.2f} ms, broker "
              f"{mean('broker_us'):.0f} µs + PostgreSQL {mean('pg_us'):.0f} µs of CPU per delegation, "
              f"{mean('idle'):.0f}% idle")
    # Each PostgreSQL configuration's throughput as a share of SQLite's
    # on the same build (the target: one replica at 85% or more).
    for name, _ in builds:
        prefix = f"{name}:" if name else ""
        sqlite = [r["rate"] for r in results if r["label"] == prefix + "sqlite"]
        if not sqlite:
            continue
        for label in labels:
            if label.startswith(prefix + "pg"):
                rates = [r["rate"] for r in results if r["label"] == label]
                print(f"- {label} of {prefix}sqlite: "
                      f"{100 * sum(rates) / len(rates) / (sum(sqlite) / len(sqlite)):.0f}%")


if __name__ == "__main__":
    main()
