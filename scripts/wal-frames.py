#!/usr/bin/env python3
"""Which B-trees a SQLite broker's commits write, in WAL frames per commit.

Serves a broker build on a fresh data directory, drives it with its own
`bench --addr` for a few seconds, kills it (SIGKILL: the WAL stays as the
commits left it), then reads every frame of the WAL file — the current
generation and the older ones still in the file — and names the table or
index each frame's page belongs to (`dbstat` of a checkpointed copy).
A frame is one 4 KiB page image, so this is the write amplification:
a random-keyed index costs a page per row, a hot append end a page per
commit.

    scripts/wal-frames.py --bin target/release/delegation-broker

Only the Python standard library (its sqlite3 must have `dbstat`).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import tempfile

WAL_HEADER_BYTES = 32
FRAME_HEADER_BYTES = 24


def run_broker(binary: str, work: str, duration: int, concurrency: int, depth: int) -> str:
    data = os.path.join(work, "data")
    os.makedirs(data)
    seed_file = os.path.join(work, "attestor.seed")
    public = subprocess.run([binary, "keygen", "--out", seed_file], check=True,
                            capture_output=True, text=True).stdout.strip()
    config = os.path.join(data, "broker.toml")
    with open(config, "w") as f:
        f.write(f'[trust]\nattestors = ["{public}"]\n')
    env = dict(os.environ, BROKER_LOG="error")
    server = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", data,
                               "--config", config], stdout=subprocess.PIPE, env=env, text=True)
    try:
        address = server.stdout.readline().strip().removeprefix("listening on ")
        seed = open(seed_file).read().strip()
        bench = subprocess.run(
            [binary, "bench", "--addr", f"http://{address}", "--attestor-seed", seed,
             "--duration-s", str(duration), "--warmup-s", "1",
             "--concurrency", str(concurrency), "--depth", str(depth)],
            check=True, capture_output=True, text=True)
        print("\n".join(bench.stdout.splitlines()[:2]))
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    return os.path.join(data, "broker.sqlite3")


def owners(db: str, work: str) -> dict[int, str]:
    """Page number -> table or index, from a checkpointed copy."""
    copy = os.path.join(work, "copy.sqlite3")
    shutil.copy(db, copy)
    if os.path.exists(db + "-wal"):
        shutil.copy(db + "-wal", copy + "-wal")
    conn = sqlite3.connect(copy)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    pages = dict(conn.execute("SELECT pageno, name FROM dbstat"))
    conn.close()
    return pages


def frames_by_commit(wal: str, pages: dict[int, str]) -> list[collections.Counter]:
    commits, current = [], collections.Counter()
    with open(wal, "rb") as f:
        header = f.read(WAL_HEADER_BYTES)
        if len(header) < WAL_HEADER_BYTES:
            return commits
        page_bytes = struct.unpack(">I", header[8:12])[0]
        while True:
            frame = f.read(FRAME_HEADER_BYTES)
            if len(frame) < FRAME_HEADER_BYTES:
                break
            page, commit_size = struct.unpack(">II", frame[:8])
            f.seek(page_bytes, 1)
            current[pages.get(page, "(page not in the database)")] += 1
            # The last frame of a commit carries the database's size.
            if commit_size:
                commits.append(current)
                current = collections.Counter()
    return commits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", required=True)
    parser.add_argument("--duration", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="walframes", dir="/tmp")
    try:
        db = run_broker(os.path.abspath(args.bin), work, args.duration, args.concurrency,
                        args.depth)
        wal = os.path.join(work, "wal")
        shutil.copy(db + "-wal", wal)
        commits = frames_by_commit(wal, owners(db, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not commits:
        print("no commits in the WAL")
        return
    total = collections.Counter()
    for commit in commits:
        total.update(commit)
    frames = sum(total.values())
    print(f"{len(commits)} commits, {frames / len(commits):.1f} frames a commit")
    print("| table or index | frames a commit |")
    print("|---|---|")
    for name, count in total.most_common():
        print(f"| {name} | {count / len(commits):.2f} |")


if __name__ == "__main__":
    main()
