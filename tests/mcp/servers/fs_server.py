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

With `--require-token JWKS_URL,ISSUER,AUDIENCE` (HTTP only) each
`tools/call` must carry `Authorization: Bearer <JWT>`, a broker-minted token
verified with PyJWT as docs/tokens.md says (the keys from `JWKS_URL`, EdDSA
only, that issuer and audience): its log line then also has `"jose"` (the
token's header) and `"claims"` (the verified claims), or `"token_error"`
when the token is missing or does not verify, and such a call is answered
with a tool error (`TOKEN_INVALID: …`) without running. `initialize` and
`tools/list` need no token.

    python fs_server.py --root DIR --log FILE [--delay-ms N] [--http PORT]
                        [--require-token JWKS_URL,ISSUER,AUDIENCE]
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
    parser.add_argument("--require-token", default=None, metavar="JWKS_URL,ISSUER,AUDIENCE",
                        help="(with --http) each tools/call must carry a verified `Authorization: Bearer` JWT")
    args = parser.parse_args(argv)
    if args.require_token is not None:
        parts = args.require_token.split(",")
        if len(parts) != 3 or not all(parts):
            parser.error("--require-token: give JWKS_URL,ISSUER,AUDIENCE")
        if args.http is None:
            parser.error("--require-token goes with --http (a token comes in an HTTP header)")
    return args


class TokenCheck:
    """Verifies a broker-minted JWT as a resource server would (docs/tokens.md)."""

    def __init__(self, spec: str) -> None:
        import jwt  # PyJWT[crypto]: only needed with --require-token

        self.jwt = jwt
        jwks_url, self.issuer, self.audience = spec.split(",")
        self.keys = jwt.PyJWKClient(jwks_url)

    def verify(self, authorization: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the token's JOSE header, its verified claims); raises ValueError with the reason."""
        if not authorization:
            raise ValueError("no Authorization header")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ValueError(f"Authorization is not `Bearer <token>` (scheme {scheme!r})")
        token = token.strip()
        try:
            key = self.keys.get_signing_key_from_jwt(token)
            claims = self.jwt.decode(
                token, key, algorithms=["EdDSA"], audience=self.audience, issuer=self.issuer,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]},
            )
            header = self.jwt.get_unverified_header(token)  # its signature is verified just above
        except self.jwt.PyJWTError as error:
            raise ValueError(f"{error.__class__.__name__}: {error}") from None
        return header, claims


def build(root: Path, log: Path, delay_ms: int = 0, name: str = "fs", require_token: str | None = None) -> MCPServer:
    root = root.resolve(strict=True)
    check = TokenCheck(require_token) if require_token else None

    class CallLog:
        """Logs each tools/call as received, before validation or the tool
        itself; with --require-token, with its verified token (or why not),
        and a call without a good token goes no further."""

        async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Any:
            if ctx.method == "tools/call":
                params = dict(ctx.params or {})
                entry = {"tool": params.get("name"), "arguments": params.get("arguments"), "meta": params.get("_meta")}
                if check is not None:
                    headers = getattr(ctx.request, "headers", None) or {}
                    try:
                        # PyJWKClient fetches the JWKS with urllib: off the event loop.
                        entry["jose"], entry["claims"] = await anyio.to_thread.run_sync(
                            check.verify, headers.get("authorization")
                        )
                    except ValueError as error:
                        entry["token_error"] = str(error)
                with open(log, "a", encoding="utf-8") as out:
                    out.write(json.dumps(entry, sort_keys=True) + "\n")
                    out.flush()
                if "token_error" in entry:
                    return {
                        "content": [{"type": "text", "text": f"TOKEN_INVALID: {entry['token_error']}"}],
                        "isError": True,
                    }
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
    server = build(args.root, args.log, args.delay_ms, args.name, args.require_token)
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http, streamable_http_path="/mcp")


if __name__ == "__main__":
    main(sys.argv[1:])
