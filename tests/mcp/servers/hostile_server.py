"""A hostile MCP tool server (stdio) for the `mcp gateway` tests.

Built on the official Python SDK's low-level `Server` (`mcp` 2.3.0), which
lets it announce any number of tools with hand-written definitions. It
offers, in this order:

- `echo(value)`: answers at once, text `json.dumps(value)` and structured
  content `{"value": value}` (it declares an output schema);
- `hang()`: never answers (it waits until the call is cancelled or the
  process ends);
- `huge()`: answers with one text block of `--huge-bytes` characters
  (default 2 MiB);
- `t0` … `t{N-1}` for `--tools N` (default 0): each answers its own name.

`--no-extras` leaves out echo, hang and huge (a flood of numbered tools
only). `--page-size K` pages tools/list K tools at a time (cursor = the
offset as a decimal string); 0 (the default) lists everything in one page.
Every tools/call received is appended as one JSON line
`{"tool": NAME, "arguments": {...}}` to `--log`, when given, before it is
handled. Logs go to stderr.

    python hostile_server.py [--tools N] [--no-extras] [--page-size K] [--huge-bytes B] [--log FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types

from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

EXTRAS = ("echo", "hang", "huge")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", type=int, default=0, help="how many numbered tools t0..tN-1 to announce")
    parser.add_argument("--no-extras", action="store_true", help="announce the numbered tools only")
    parser.add_argument("--page-size", type=int, default=0, help="tools per tools/list page (0: one page)")
    parser.add_argument("--huge-bytes", type=int, default=2 * 1024 * 1024, help="size of huge's text")
    parser.add_argument("--log", type=Path, default=None, help="append one JSON line per received tools/call")
    parser.add_argument("--name", default="hostile", help="the server's name in its initialize/discover answer")
    return parser.parse_args(argv)


def tool_list(count: int, extras: bool) -> list[types.Tool]:
    tools: list[types.Tool] = []
    if extras:
        tools.append(
            types.Tool(
                name="echo",
                description="Answers with its argument.",
                input_schema={
                    "type": "object",
                    "properties": {"value": {"description": "anything JSON"}},
                    "required": ["value"],
                },
                output_schema={
                    "type": "object",
                    "properties": {"value": {}},
                    "required": ["value"],
                },
            )
        )
        tools.append(
            types.Tool(name="hang", description="Never answers.", input_schema={"type": "object", "properties": {}})
        )
        tools.append(
            types.Tool(
                name="huge",
                description="Answers with a very large text.",
                input_schema={"type": "object", "properties": {}},
            )
        )
    # Small definitions, so even thousands fit well under a megabyte.
    tools.extend(types.Tool(name=f"t{i}", input_schema={"type": "object"}) for i in range(count))
    return tools


def build(args: argparse.Namespace) -> Server[Any]:
    tools = tool_list(args.tools, not args.no_extras)
    names = {tool.name for tool in tools}
    huge_text = "x" * args.huge_bytes

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        if args.page_size <= 0:
            return types.ListToolsResult(tools=tools)
        cursor = params.cursor if params is not None else None
        try:
            start = int(cursor) if cursor else 0
        except ValueError:
            raise MCPError(types.INVALID_PARAMS, f"bad cursor {cursor!r}") from None
        end = start + args.page_size
        return types.ListToolsResult(
            tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None
        )

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        name, arguments = params.name, params.arguments or {}
        if args.log is not None:
            with open(args.log, "a", encoding="utf-8") as out:
                out.write(json.dumps({"tool": name, "arguments": arguments}, sort_keys=True) + "\n")
        if name not in names:
            return types.CallToolResult(content=[types.TextContent(type="text", text=f"unknown tool {name}")], is_error=True)
        if name == "echo":
            value = arguments.get("value")
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=json.dumps(value))],
                structured_content={"value": value},
            )
        if name == "hang":
            await anyio.sleep_forever()
        if name == "huge":
            return types.CallToolResult(content=[types.TextContent(type="text", text=huge_text)])
        return types.CallToolResult(content=[types.TextContent(type="text", text=name)])

    return Server(args.name, on_list_tools=list_tools, on_call_tool=call_tool)


async def serve(server: Server[Any]) -> None:
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    anyio.run(serve, build(args))


if __name__ == "__main__":
    main(sys.argv[1:])
