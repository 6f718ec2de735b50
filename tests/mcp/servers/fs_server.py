"""A small file-system MCP tool server (stdio) for the `mcp gateway` tests.

Built with the official Python SDK (`mcp` 2.3.0, `MCPServer`). Three tools
over the directory given by `--root`:

- `read_file(path)`: the file's text, `{"path", "content"}`;
- `write_file(path, content)`: writes the file (parents created),
  `{"path", "bytes"}`;
- `list_dir(path)`: the directory's entries, `{"path", "entries", "units"}`
  where `units` is the number of entries (an integer the gateway can meter).

Every `tools/call` that reaches this process is appended to `--log` as one
JSON line `{"tool": NAME, "arguments": {...}}` *before* anything is checked
or done (a middleware sees the raw request, ahead of argument validation),
so a test can prove a call never reached the server: its log has no line
for it. A path is relative to the root; an absolute path, or one that
resolves (`..`, symlinks) outside the root, is a tool error and touches
nothing. `--delay-ms` makes each `write_file` wait that long after logging
(so a test can have calls in flight); logs go to stderr. With `--http PORT`
it serves streamable HTTP at `http://127.0.0.1:PORT/mcp` instead of stdio.

    python fs_server.py --root DIR --log FILE [--delay-ms N] [--http PORT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel

from mcp.server.context import CallNext, ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError


class ReadResult(BaseModel):
    path: str
    content: str


class WriteResult(BaseModel):
    path: str
    bytes: int


class ListResult(BaseModel):
    path: str
    entries: list[str]
    units: int


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path, help="the directory the tools work in")
    parser.add_argument("--log", required=True, type=Path, help="append one JSON line per received tools/call")
    parser.add_argument("--delay-ms", type=int, default=0, help="wait this long in each write_file, after logging")
    parser.add_argument("--name", default="fs", help="the server's name in its initialize/discover answer")
    parser.add_argument("--http", type=int, default=None, metavar="PORT",
                        help="serve streamable HTTP on 127.0.0.1:PORT at /mcp instead of stdio")
    return parser.parse_args(argv)


def build(root: Path, log: Path, delay_ms: int = 0, name: str = "fs") -> MCPServer:
    root = root.resolve(strict=True)

    class CallLog:
        """Logs each tools/call as received, before validation or the tool itself."""

        async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Any:
            if ctx.method == "tools/call":
                params = dict(ctx.params or {})
                line = json.dumps(
                    {"tool": params.get("name"), "arguments": params.get("arguments"), "meta": params.get("_meta")},
                    sort_keys=True,
                )
                with open(log, "a", encoding="utf-8") as out:
                    out.write(line + "\n")
                    out.flush()
            return await call_next(ctx)

    server = MCPServer(
        name,
        instructions=f"Files under one directory ({root.name}).",
        middleware=[CallLog()],
        log_level="WARNING",
    )

    def resolve(path: str) -> Path:
        if not isinstance(path, str) or path == "" or "\x00" in path:
            raise ToolError("path: not a relative path")
        if os.path.isabs(path) or path.startswith(("/", "\\")):
            raise ToolError(f"path {path!r}: absolute paths are refused; give a path relative to the root")
        target = (root / path).resolve(strict=False)
        if target != root and root not in target.parents:
            raise ToolError(f"path {path!r} escapes the root")
        return target

    @server.tool(description="Read a UTF-8 text file (path relative to the root).")
    def read_file(path: str) -> ReadResult:
        target = resolve(path)
        try:
            return ReadResult(path=path, content=target.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ToolError(f"path {path!r}: no such file") from None
        except (IsADirectoryError, UnicodeDecodeError, PermissionError) as error:
            raise ToolError(f"path {path!r}: cannot read: {error.__class__.__name__}") from None

    @server.tool(description="Write a UTF-8 text file (path relative to the root; parent directories are created).")
    async def write_file(path: str, content: str) -> WriteResult:
        target = resolve(path)
        if delay_ms > 0:
            await anyio.sleep(delay_ms / 1000)
        if target == root:
            raise ToolError(f"path {path!r} is the root directory")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode("utf-8")
            target.write_bytes(data)
        except (IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError) as error:
            raise ToolError(f"path {path!r}: cannot write: {error.__class__.__name__}") from None
        return WriteResult(path=path, bytes=len(data))

    @server.tool(description="List a directory's entries (path relative to the root; '.' is the root). "
                 "`units` is the number of entries.")
    def list_dir(path: str) -> ListResult:
        target = resolve(path)
        try:
            entries = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in target.iterdir())
        except FileNotFoundError:
            raise ToolError(f"path {path!r}: no such directory") from None
        except (NotADirectoryError, PermissionError) as error:
            raise ToolError(f"path {path!r}: cannot list: {error.__class__.__name__}") from None
        return ListResult(path=path, entries=entries, units=len(entries))

    return server


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    server = build(args.root, args.log, args.delay_ms, args.name)
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http, streamable_http_path="/mcp")


if __name__ == "__main__":
    main(sys.argv[1:])
