"""`delegation-broker mcp gateway` driven by
the official Python MCP SDK (`mcp` 2.3.0) over stdio.

The gateway is an MCP server that fronts an agent's own MCP tool servers
(here `servers/fs_server.py` and `servers/hostile_server.py`, both built
with the same SDK) and is the *host* of a delegation contract: it forwards
tool calls and records each at the broker (RecordReceipts) before it
answers. Contracts are set up with `mcp tools` processes (test_tools.py's
helpers): the orchestrator opens a root (write scope `out/`, predicate
`result.within_scope`), delegates to the worker naming the gateway's key as
host, the worker accepts, and later completes and gets the verdict.

- b. `test_scope_budget_and_audit`: writes inside the scope are forwarded
  and recorded, metered units show in the contract's spent after each
  answer; in refuse mode writes outside it (`notes/…`, `out/../…`, `/etc/…`)
  are OUT_OF_SCOPE and never reach fs_server (its call log); a call whose
  units exceed the residual is OVER_BUDGET (requested, allowed); the audit
  counts every forwarded call and mutation as host-observed and nothing
  refused; the completion is ACCEPTED, charged exactly the metered units.
  In record mode (a second contract and gateway, `contract =` in its
  config) the out-of-scope writes go through, are recorded as claim
  violations, and the completion comes back `within_scope: false`
  (REJECTED). After a completion the gateway forwards nothing.
- `test_prefixed_names_no_contract_and_revoke`: two servers offering the
  same tools are served as `<server>.<tool>`, each call reaching its own
  server; a gateway whose key hosts no open contract answers NO_CONTRACT;
  after the orchestrator revokes the contract, calls are CONTRACT_ENDED and
  reach no server.
- c. `test_sigkill_mid_run`: concurrent writes with unique paths, the
  gateway SIGKILLed partway, a new gateway process, more writes; every
  answered path is in the audit's mutation paths, no mutation is recorded
  twice, and no more are recorded than were answered or in flight.
- d. `test_hostile_upstreams`: oversized and too deeply nested arguments
  (refused, nothing reaches a server, nothing is recorded), an unknown tool,
  a tool that never answers (UPSTREAM_TIMEOUT within call_timeout_ms plus
  slack, while other calls are answered), a 2 MiB result (RESULT_TOO_LARGE),
  a server announcing 5,000 tools (256 of them served beside the others).
- `test_streamable_http_upstream`: an upstream given by `url` (fs_server
  over streamable HTTP) is served, forwarded and recorded the same way.
- `test_streamable_http_upstream_with_token`: with `tokens_url` and a
  server's `token_header`/`token_resource`, each forwarded call carries a
  JWT the gateway minted as the contract's host; fs_server
  (`--require-token`) verifies it with PyJWT and logs its claims (the
  contract, the delegate as `sub`, the host in `act`); a resource the
  broker does not mint for is TOKEN_REFUSED before the server; nothing
  reaches it after the revocation. `test_token_config_errors`: the
  settings' config errors stop the gateway at start.

The audit (GetAudit) is read over the broker's read-only console (gRPC-Web,
`serve --console`) as a `[readers]` key: no CLI prints one contract's audit,
and the test venv has no gRPC library. The broker this module starts is its
own (not test_tools.py's), configured with that reader; the token test has
another such broker, with a token endpoint (`serve --tokens`).

BROKER_BIN names the broker binary (default: <repo>/target/debug/delegation-broker).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

from mcp import Client, MCPError, StdioServerParameters, stdio_client
from test_tools import (
    HEX64,
    MODES,
    Agent,
    Broker,
    Outputs,
    _leaves,
    assert_hex_id,
    broker_bin,
    connect,
    ledger_of,
    make_agents,
    ok,
    secret_forms,
    show,
    text_of,
)

HERE = Path(__file__).resolve().parent
FS_SERVER = HERE / "servers" / "fs_server.py"
HOSTILE_SERVER = HERE / "servers" / "hostile_server.py"
# The upstream servers run on this interpreter: the test venv's, which has the SDK.
PYTHON = sys.executable

PREDICATE = "result.within_scope"
SCOPE = ["out/"]
FS_TOOLS = {"read_file", "write_file", "list_dir"}
# The gateway's bounds, as the contract states them.
MAX_TOOLS_PER_SERVER = 256
MAX_ARGUMENT_BYTES = 64 * 1024
MAX_ARGUMENT_DEPTH = 32

CALL_TIMEOUT_S = 60.0  # one MCP request, gateway or `mcp tools`
TEST_TIMEOUT_S = 240.0  # one whole test
HANG_TIMEOUT_MS = 1500  # call_timeout_ms of the hostile test's gateway
HANG_SLACK_S = 5.0  # what UPSTREAM_TIMEOUT may take beyond call_timeout_ms
TOKEN_RESOURCE = "https://tools.test"  # the token broker's one [tokens] resource


# --------------------------------------------------------------------------
# A broker with a read-only console, to read audits (GetAudit over gRPC-Web)
# --------------------------------------------------------------------------


@dataclass
class ConsoleBroker(Broker):
    console: str = ""  # http://127.0.0.1:PORT
    token: str = ""
    session_b64: str | None = None
    tokens: str = ""  # http://127.0.0.1:PORT of `serve --tokens`, when started with one


@pytest.fixture(scope="module")
def gbroker() -> Any:
    yield from _console_broker()


@pytest.fixture(scope="module")
def tbroker() -> Any:
    """The same broker with a token endpoint (`serve --tokens`) for TOKEN_RESOURCE."""
    yield from _console_broker(tokens_resources=[TOKEN_RESOURCE])


def _console_broker(tokens_resources: list[str] | None = None) -> Any:
    binary = broker_bin()
    help_run = subprocess.run([binary, "mcp", "gateway", "--help"], capture_output=True, timeout=30)
    if help_run.returncode != 0:
        pytest.fail(
            f"{binary} has no `mcp gateway` command (exit {help_run.returncode}): "
            f"{help_run.stderr.decode(errors='replace')[:500]}",
            pytrace=False,
        )
    workdir = Path(tempfile.mkdtemp(prefix="mcp-gateway-test-"))
    data_dir = workdir / "broker-data"
    data_dir.mkdir()
    reader_key = workdir / "reader.key"
    keygen = subprocess.run([binary, "keygen", "--out", str(reader_key)], capture_output=True, timeout=30)
    assert keygen.returncode == 0, keygen.stderr.decode(errors="replace")
    reader = keygen.stdout.decode().strip()
    assert HEX64.fullmatch(reader), f"keygen printed {reader!r}"
    config = workdir / "broker.toml"
    config_text = f'[readers]\nkeys = ["{reader}"]\n\n[console]\nreader = "{reader}"\n'
    serve_args = [binary, "serve", "--listen", "127.0.0.1:0", "--console", "127.0.0.1:0"]
    if tokens_resources is not None:
        config_text += f"\n[tokens]\nresources = {_toml(tokens_resources)}\n"
        serve_args += ["--tokens", "127.0.0.1:0"]
    config.write_text(config_text)
    stderr_path = workdir / "broker.stderr"
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [*serve_args, "--config", str(config), "--data-dir", str(data_dir)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            # A JSON line per answered call, with its trace id (the trace test).
            env={**os.environ, "NO_COLOR": "1", "BROKER_LOG_FORMAT": "json", "BROKER_LOG": "info,delegation_broker=debug"},
        )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # every stdout line (the first two are read below), so the broker never blocks
        for raw in process.stdout:  # type: ignore[union-attr]
            lines.put(raw.decode(errors="replace").strip())

    threading.Thread(target=pump, daemon=True).start()
    addr = console = token = None
    tokens = None if tokens_resources is not None else ""
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while (addr is None or console is None or tokens is None) and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if m := re.fullmatch(r"listening on (127\.0\.0\.1:\d+)", line):
            addr = f"http://{m.group(1)}"
        elif m := re.fullmatch(r"console on (http://127\.0\.0\.1:\d+)/#token=([0-9a-f]+)", line):
            console, token = m.group(1), m.group(2)
        elif m := re.fullmatch(r"tokens on (http://127\.0\.0\.1:\d+)", line):
            tokens = m.group(1)
    if addr is None or console is None or token is None or tokens is None:
        process.kill()
        process.wait(10)
        pytest.fail(
            f"the broker did not print its address, console URL"
            f"{' and token endpoint' if tokens_resources is not None else ''} (got {seen!r}); "
            f"stderr: {stderr_path.read_text(errors='replace')[-2000:]}",
            pytrace=False,
        )
    yield ConsoleBroker(binary, addr, workdir, process, stderr_path, console=console, token=token, tokens=tokens)
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    if os.environ.get("MCP_TEST_KEEP"):
        print(f"kept {workdir} (MCP_TEST_KEEP)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, Any]]:
    """A protobuf message's fields in order: (number, int or bytes)."""
    out: list[tuple[int, Any]] = []
    at = 0
    while at < len(buf):
        key, at = _varint(buf, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(buf, at)
        elif wire == 2:
            size, at = _varint(buf, at)
            value, at = buf[at : at + size], at + size
        elif wire == 1:
            value, at = int.from_bytes(buf[at : at + 8], "little"), at + 8
        elif wire == 5:
            value, at = int.from_bytes(buf[at : at + 4], "little"), at + 4
        else:
            raise AssertionError(f"unexpected protobuf wire type {wire} (field {number})")
        out.append((number, value))
    return out


# ContractAudit (broker.proto), field number → (name, kind).
_AUDIT_FIELDS = {
    1: ("contract_id", "hex"), 2: ("depth", "int"), 3: ("tool_calls", "int"), 4: ("mutations", "int"),
    5: ("mutation_paths", "strs"), 6: ("claim_violations", "int"), 7: ("completed", "bool"),
    8: ("has_report", "bool"), 9: ("downgrades", "int"), 10: ("parent_scope_hints", "int"),
    11: ("parent_named_files", "int"), 12: ("evidence_paths", "int"), 13: ("discovered_paths", "int"),
    14: ("false_completion", "bool"), 15: ("conflicts", "count"), 16: ("verdict", "int"), 17: ("claim", "str"),
    18: ("named_scope_hints", "strs"), 19: ("named_files", "strs"), 20: ("mutation_path_count", "int"),
    21: ("conflict_count", "int"),
}


def _decode_audit(buf: bytes) -> dict[str, Any]:
    audit: dict[str, Any] = {}
    for name, kind in _AUDIT_FIELDS.values():
        audit[name] = {"int": 0, "bool": False, "str": "", "hex": "", "strs": [], "count": 0}[kind]
    for number, value in _fields(buf):
        if number not in _AUDIT_FIELDS:
            continue
        name, kind = _AUDIT_FIELDS[number]
        if kind == "int":
            audit[name] = value
        elif kind == "bool":
            audit[name] = bool(value)
        elif kind == "str":
            audit[name] = value.decode()
        elif kind == "hex":
            audit[name] = value.hex()
        elif kind == "strs":
            audit[name] = [*audit[name], value.decode()]
        else:
            audit[name] += 1
    return audit


def _http(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def _console_session(broker: ConsoleBroker) -> str:
    if broker.session_b64 is None:
        status, _, body = _http(f"{broker.console}/console/session", b"", {"x-console-token": broker.token})
        assert status == 200, f"the console refused a session: HTTP {status} {body[:300]!r}"
        broker.session_b64 = json.loads(body)["session"]
    return broker.session_b64


def _get_audit_sync(broker: ConsoleBroker, contract_id: str) -> dict[str, Any]:
    request = b"\x0a\x20" + bytes.fromhex(contract_id)  # GetAuditRequest{contract_id = 1}
    status, headers, body = _http(
        f"{broker.console}/delegation.broker.v1.Broker/GetAudit",
        b"\x00" + len(request).to_bytes(4, "big") + request,
        {
            "content-type": "application/grpc-web+proto",
            "x-grpc-web": "1",
            "x-console-token": broker.token,
            "x-broker-session-bin": _console_session(broker).rstrip("="),
        },
    )
    assert status == 200, f"GetAudit over the console: HTTP {status} {body[:300]!r}"
    message: bytes | None = None
    trailers: dict[str, str] = {k: v for k, v in headers.items() if k.startswith("grpc-")}
    at = 0
    while at + 5 <= len(body):
        flag, size = body[at], int.from_bytes(body[at + 1 : at + 5], "big")
        frame = body[at + 5 : at + 5 + size]
        at += 5 + size
        if flag & 0x80:
            for line in frame.decode(errors="replace").split("\r\n"):
                if ":" in line:
                    key, value = line.split(":", 1)
                    trailers[key.strip().lower()] = value.strip()
        else:
            message = frame
    grpc_status = trailers.get("grpc-status", "0" if message is not None else "?")
    assert grpc_status == "0", (
        f"GetAudit({contract_id[:8]}) failed: grpc-status {grpc_status} "
        f"{urllib.parse.unquote(trailers.get('grpc-message', ''))}"
    )
    assert message is not None, f"GetAudit({contract_id[:8]}): no message"
    inner = [value for number, value in _fields(message) if number == 1]  # GetAuditResponse{audit = 1}
    assert inner, f"GetAudit({contract_id[:8]}): no audit in the answer"
    return _decode_audit(inner[0])


async def get_audit(broker: ConsoleBroker, contract_id: str) -> dict[str, Any]:
    """The contract's audit (ContractAudit as a dict), read as the broker's [readers] key."""
    return await anyio.to_thread.run_sync(_get_audit_sync, broker, contract_id)


# --------------------------------------------------------------------------
# Upstream servers and gateways
# --------------------------------------------------------------------------


def fs_server(name: str, root: Path, log: Path, delay_ms: int = 0) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    log.touch()
    args = [str(FS_SERVER), "--root", str(root), "--log", str(log), "--name", name]
    if delay_ms:
        args += ["--delay-ms", str(delay_ms)]
    return {"name": name, "command": PYTHON, "args": args}


def hostile_server(name: str, log: Path, tools: int = 0, extras: bool = True) -> dict[str, Any]:
    log.touch()
    args = [str(HOSTILE_SERVER), "--tools", str(tools), "--log", str(log), "--name", name]
    if not extras:
        args.append("--no-extras")
    return {"name": name, "command": PYTHON, "args": args}


FS_UNITS = {
    "write_file": {"mutates": ["path"], "units": 2},
    "read_file": {"reads": ["path"], "units": 1},
    "list_dir": {"reads": ["path"], "units_from": "units"},
}


def fs_tools(server: str, units: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    return {f"{server}.{tool}": spec for tool, spec in (units or FS_UNITS).items()}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


@dataclass
class Gateway:
    label: str
    workdir: Path
    config: Path
    stderr: Path
    pid_file: Path
    host: Agent
    client: Client | None = None
    results: list[tuple[str, Any]] = field(default_factory=list)  # (tool, CallToolResult), for the secret search

    def tail(self, chars: int = 3000) -> str:
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else "(no stderr yet)"
        return text[-chars:]

    def pid(self) -> int:
        text = self.pid_file.read_text().strip() if self.pid_file.exists() else ""
        assert text.isdigit(), f"{self.label}: no pid in {self.pid_file}"
        return int(text)


def make_gateway(
    broker: Broker,
    label: str,
    host: Agent,
    servers: list[dict[str, Any]],
    tools: dict[str, dict[str, Any]],
    *,
    out_of_scope: str = "refuse",
    contract: str | None = None,
    call_timeout_ms: int = 5000,
    resolve_root: Path | None = None,
    tokens_url: str | None = None,
) -> Gateway:
    workdir = Path(tempfile.mkdtemp(prefix=f"gw-{label}-", dir=broker.workdir))
    lines = [
        f"broker = {_toml(broker.addr)}",
        f"key_file = {_toml(str(host.key_file))}",
        f"out_of_scope = {_toml(out_of_scope)}",
        f"call_timeout_ms = {call_timeout_ms}",
    ]
    if contract is not None:
        lines.append(f"contract = {_toml(contract)}")
    if resolve_root is not None:
        lines.append(f"resolve_root = {_toml(str(resolve_root))}")
    if tokens_url is not None:
        lines.append(f"tokens_url = {_toml(tokens_url)}")
    for server in servers:
        lines += ["", "[[servers]]"] + [f"{key} = {_toml(value)}" for key, value in server.items()]
    for name, spec in tools.items():
        lines += ["", f"[tools.{json.dumps(name)}]"] + [f"{key} = {_toml(value)}" for key, value in spec.items()]
    config = workdir / "gateway.toml"
    config.write_text("\n".join(lines) + "\n")
    return Gateway(label, workdir, config, workdir / "gateway.stderr", workdir / "gateway.pid", host)


async def open_gateway(
    stack: AsyncExitStack, broker: Broker, gateway: Gateway, mode: str, read_timeout: float = CALL_TIMEOUT_S
) -> Client:
    """Spawns `mcp gateway --config …` (through /bin/sh, which writes its pid
    and execs it) and connects the SDK's client to it in `mode`."""
    gateway.pid_file.unlink(missing_ok=True)
    script = (
        f"echo $$ > {shlex.quote(str(gateway.pid_file))}; "
        f"exec {shlex.quote(broker.bin)} mcp gateway --config {shlex.quote(str(gateway.config))}"
    )
    level = os.environ.get("BROKER_LOG") or os.environ.get("RUST_LOG") or "info"
    params = StdioServerParameters(
        command="/bin/sh",
        args=["-c", script],
        env={"BROKER_LOG": level, "RUST_LOG": level, "NO_COLOR": "1"},
    )
    errlog = stack.enter_context(open(gateway.stderr, "a"))  # "a": a restarted gateway's log follows the first's
    client = Client(stdio_client(params, errlog=errlog), mode=mode, read_timeout_seconds=read_timeout)
    try:
        await stack.enter_async_context(client)
    except Exception as error:
        errlog.flush()
        raise AssertionError(
            f"{gateway.label}: connecting to `mcp gateway` in mode={mode!r} failed: {error!r}\n"
            f"gateway stderr:\n{gateway.tail()}"
        ) from error
    print(f"{gateway.label}: mode={mode} negotiated protocol {client.protocol_version}")
    gateway.client = client
    return client


async def list_all_tools(gateway: Gateway) -> list[Any]:
    """Every tool the gateway lists, following next_cursor (at most 100 pages)."""
    assert gateway.client is not None
    tools: list[Any] = []
    cursor: str | None = None
    for _ in range(100):
        try:
            page = await gateway.client.list_tools(cursor=cursor, cache_mode="refresh")
        except (MCPError, ValidationError) as error:
            raise AssertionError(f"{gateway.label}: tools/list failed: {error}\n{gateway.tail()}") from error
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return tools
    raise AssertionError(f"{gateway.label}: tools/list still had a next page after 100 pages")


async def gcall(
    gateway: Gateway,
    tool: str,
    arguments: dict[str, Any],
    timeout: float | None = None,
    meta: dict[str, Any] | None = None,
) -> Any:
    """A tools/call through the gateway that must come back as a tool result."""
    assert gateway.client is not None
    try:
        result = await gateway.client.call_tool(tool, arguments, read_timeout_seconds=timeout, meta=meta)
    except MCPError as error:
        raise AssertionError(
            f"{gateway.label}: {tool}({_brief(arguments)}) was a protocol error "
            f"(code {error.code}: {error}), not a tool result\ngateway stderr:\n{gateway.tail()}"
        ) from error
    except ValidationError as error:  # the SDK refused the result's shape at the negotiated version
        raise AssertionError(
            f"{gateway.label}: {tool}({_brief(arguments)}): the result does not conform to protocol "
            f"{gateway.client.protocol_version} as the SDK reads it: {error}\ngateway stderr:\n{gateway.tail()}"
        ) from error
    except RuntimeError as error:  # e.g. structured content that fails the tool's listed output schema
        raise AssertionError(
            f"{gateway.label}: {tool}({_brief(arguments)}): the SDK refused the result: {error}\n"
            f"gateway stderr:\n{gateway.tail()}"
        ) from error
    gateway.results.append((tool, result))
    return result


async def forwarded(gateway: Gateway, tool: str, arguments: dict[str, Any], meta: dict[str, Any] | None = None) -> Any:
    """A call the gateway forwards and answers (not an error)."""
    result = await gcall(gateway, tool, arguments, meta=meta)
    assert not result.is_error, (
        f"{gateway.label}: {tool}({_brief(arguments)}) failed: {_brief_result(result)}\n"
        f"gateway stderr:\n{gateway.tail()}"
    )
    return result


async def refused(
    gateway: Gateway,
    tool: str,
    arguments: dict[str, Any],
    reason: str | set[str],
    field_name: str | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A call the gateway answers with a tool error of `reason` (the error
    shape of `mcp tools`: structured {"error": {reason, message, field}} and
    a text naming the reason)."""
    result = await gcall(gateway, tool, arguments, meta=meta)
    reasons = {reason} if isinstance(reason, str) else reason
    assert result.is_error, (
        f"{gateway.label}: {tool}({_brief(arguments)}) was not refused (expected {sorted(reasons)}): "
        f"{_brief_result(result)}\ngateway stderr:\n{gateway.tail()}"
    )
    content = result.structured_content
    assert isinstance(content, dict) and isinstance(content.get("error"), dict), (
        f"{gateway.label}: {tool}: a tool error without structured {{'error': ...}}: {_brief_result(result)}"
    )
    error = content["error"]
    assert error.get("reason") in reasons, (
        f"{gateway.label}: {tool}({_brief(arguments)}) refused with {error.get('reason')!r}, expected "
        f"{sorted(reasons)}: {error}\ngateway stderr:\n{gateway.tail()}"
    )
    assert isinstance(error.get("message"), str) and error["message"].strip(), f"an error without a message: {error}"
    assert "field" in error, f"the error has no field key (null when none): {error}"
    if field_name is not None:
        assert error["field"] == field_name, f"the error names field {error['field']!r}, not {field_name!r}: {error}"
    assert error["reason"] in text_of(result), f"the error's text does not name {error['reason']}: {text_of(result)!r}"
    return error


def _brief(value: Any, limit: int = 200) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _brief_result(result: Any, limit: int = 1500) -> str:
    text = show(result)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def log_lines(path: Path) -> list[dict[str, Any]]:
    """The calls an upstream server received, as its --log has them."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_unreached(log: Path, before: int, what: str) -> None:
    lines = log_lines(log)
    assert len(lines) == before, f"{what} reached the upstream server: {lines[before:]}"


async def ledger(outputs: Outputs, agent: Agent, contract_id: str) -> dict[str, Any]:
    state = await ok(outputs, agent, "get_contract", {"contract_id": contract_id})
    return ledger_of(state)


async def assert_spent(outputs: Outputs, agent: Agent, contract_id: str, spent: int, after: str) -> None:
    current = await ledger(outputs, agent, contract_id)
    assert current["spent"] == spent, (
        f"after {after}: the contract's spent is {current['spent']}, expected {spent} (metered at once): {current}"
    )


def assert_no_secrets_through(gateways: list[Gateway], agents: dict[str, Agent]) -> None:
    forms = {agent.name: secret_forms(agent) for agent in agents.values()}
    leaks: list[str] = []
    for gateway in gateways:
        blobs = [(f"its {tool} result", show(result)) for tool, result in gateway.results]
        blobs.append(("its stderr", gateway.stderr.read_text(errors="replace") if gateway.stderr.exists() else ""))
        for where, blob in blobs:
            for owner, secrets in forms.items():
                if any(secret in blob for secret in secrets):
                    leaks.append(f"{gateway.label}: {where} carries {owner}'s seed")
            if "x-broker-session" in blob.lower():
                leaks.append(f"{gateway.label}: {where} mentions x-broker-session")
    leaks = list(dict.fromkeys(leaks))
    assert not leaks, "secrets in the gateway's output:\n" + "\n".join(leaks)


def run(test: Any, agents: dict[str, Agent], gateways: list[Gateway], broker: Broker) -> None:
    """Runs one test's coroutine, bounded; on failure prints the tail of every
    gateway's and `mcp tools` process's stderr (pytest shows it under
    "Captured stdout")."""

    async def bounded() -> None:
        with anyio.fail_after(TEST_TIMEOUT_S):
            await test()

    try:
        try:
            anyio.run(bounded)
        except BaseExceptionGroup as group:  # the SDK's task groups wrap what failed: show that
            leaves = list(_leaves(group))
            if len(leaves) == 1:
                raise leaves[0] from None
            raise
    except BaseException:
        for gateway in gateways:
            print(f"--- {gateway.label}: `mcp gateway` stderr (tail) ---")
            print(gateway.tail(4000))
        for agent in agents.values():
            if agent.log_path.exists():
                print(f"--- {agent.name}'s `mcp tools` stderr (tail) ---")
                print(agent.log_path.read_text(errors="replace")[-2000:])
        print("--- broker stderr (tail) ---")
        print(broker.stderr_path.read_text(errors="replace")[-2000:])
        raise


async def issue(
    outputs: Outputs, orchestrator: Agent, worker: Agent, root_id: str, host: Agent, budget: int, task: str
) -> str:
    """A contract from the root to the worker, hosted by `host`, accepted."""
    issued = await ok(
        outputs,
        orchestrator,
        "delegate",
        {
            "parent_id": root_id,
            "delegate": worker.name,
            "task": task,
            "budget": budget,
            "write_scope": SCOPE,
            # A PRINCIPAL child is judged on its own predicate alone (types.proto).
            "predicate": PREDICATE,
            "host": host.public_key,
        },
    )
    contract_id = issued["contract_id"]
    assert_hex_id(contract_id, "delegate's contract_id")
    accepted = await ok(outputs, worker, "accept", {"contract_id": contract_id})
    assert accepted["status"] == "ACCEPTED", accepted
    state = await ok(outputs, worker, "get_contract", {"contract_id": contract_id})
    assert state["write_scope"] == SCOPE or state["write_scope"] == [s.rstrip("/") for s in SCOPE], state
    assert PREDICATE in state["effective_predicate"], state
    return contract_id


async def open_root(outputs: Outputs, orchestrator: Agent, run_label: str, budget: int = 200) -> str:
    root = await ok(
        outputs,
        orchestrator,
        "open_root",
        {
            "intent": "write the weekly report under out/",
            "budget": budget,
            "write_scope": SCOPE,
            "predicate": PREDICATE,
            "labels": {"run": run_label},
        },
    )
    return root["contract_id"]


# --------------------------------------------------------------------------
# b. scope, budget, audit, record mode
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_scope_budget_and_audit(gbroker: ConsoleBroker, mode: str) -> None:
    agents, names_file = make_agents(gbroker, ["orchestrator", "worker", "refusing_host", "recording_host"])
    orchestrator, worker = agents["orchestrator"], agents["worker"]
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="fs-", dir=gbroker.workdir))
    root_a, log_a = home / "root-a", home / "fs-a.log"
    root_b, log_b = home / "root-b", home / "fs-b.log"
    refusing = make_gateway(
        gbroker, f"refusing-{mode}", agents["refusing_host"], [fs_server("fs", root_a, log_a)], fs_tools("fs")
    )
    gateways = [refusing]

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker):
                await connect(stack, gbroker, agent, names_file, mode)
            root_id = await open_root(outputs, orchestrator, f"gateway-b-{mode}")
            c1 = await issue(
                outputs, orchestrator, worker, root_id, agents["refusing_host"], 10,
                "write the report to out/report.txt",
            )

            # The refusing gateway finds its contract itself (no `contract =`).
            await open_gateway(stack, gbroker, refusing, mode)
            listed = await list_all_tools(refusing)
            names = [tool.name for tool in listed]
            assert sorted(names) == sorted(FS_TOOLS), f"the gateway lists {names}, expected fs_server's tools"
            by_name = {tool.name: tool for tool in listed}
            assert set(by_name["write_file"].input_schema.get("properties", {})) == {"path", "content"}, (
                f"write_file's input schema was not forwarded: {by_name['write_file'].input_schema}"
            )
            assert "units" in (by_name["list_dir"].output_schema or {}).get("properties", {}), (
                f"list_dir's output schema was not forwarded: {by_name['list_dir'].output_schema}"
            )
            assert all(tool.description for tool in listed), "a forwarded tool lost its description"

            # Inside the scope: forwarded, answered, metered at once.
            result = await forwarded(refusing, "write_file", {"path": "out/report.txt", "content": "hello"})
            assert result.structured_content == {"path": "out/report.txt", "bytes": 5}, _brief_result(result)
            assert (root_a / "out/report.txt").read_text() == "hello"
            received = {k: v for k, v in log_lines(log_a)[-1].items() if k != "meta"}
            assert received == {
                "tool": "write_file", "arguments": {"path": "out/report.txt", "content": "hello"}
            }, "fs_server did not receive the call as the agent made it"
            await assert_spent(outputs, worker, c1, 2, "write_file (2 units)")
            result = await forwarded(refusing, "read_file", {"path": "out/report.txt"})
            assert result.structured_content == {"path": "out/report.txt", "content": "hello"}, _brief_result(result)
            await assert_spent(outputs, worker, c1, 3, "read_file (1 unit)")
            result = await forwarded(refusing, "list_dir", {"path": "out"})
            assert result.structured_content == {"path": "out", "entries": ["report.txt"], "units": 1}, (
                _brief_result(result)
            )
            await assert_spent(outputs, worker, c1, 4, "list_dir (units from the result: 1)")

            # Outside the scope: refused, never forwarded, nothing charged.
            before = len(log_lines(log_a))
            for path in ["notes/outside.txt", "out/../escape.txt", "/etc/gateway-test.txt", "outside/out/x.txt"]:
                await refused(refusing, "write_file", {"path": path, "content": "x"}, "OUT_OF_SCOPE", "path")
            assert_unreached(log_a, before, "a write outside the scope (refuse mode)")
            assert not (root_a / "notes").exists() and not (root_a / "escape.txt").exists()
            await assert_spent(outputs, worker, c1, 4, "refused writes")

            audit = await get_audit(gbroker, c1)
            assert (audit["tool_calls"], audit["mutations"], audit["claim_violations"]) == (3, 1, 0), audit
            assert audit["mutation_paths"] == ["out/report.txt"] and audit["mutation_path_count"] == 1, audit
            assert audit["evidence_paths"] == 2, f"reads of out/report.txt and out, a mutation of the first: {audit}"

            # Budget: 10 in all, 4 spent. Two writes (4) and a read (1) leave 1.
            await forwarded(refusing, "write_file", {"path": "out/w1.txt", "content": "1"})
            await assert_spent(outputs, worker, c1, 6, "write_file out/w1.txt")
            await forwarded(refusing, "write_file", {"path": "out/w2.txt", "content": "2"})
            await assert_spent(outputs, worker, c1, 8, "write_file out/w2.txt")
            await forwarded(refusing, "read_file", {"path": "out/w1.txt"})
            await assert_spent(outputs, worker, c1, 9, "read_file out/w1.txt")
            before = len(log_lines(log_a))
            error = await refused(refusing, "write_file", {"path": "out/w3.txt", "content": "3"}, "OVER_BUDGET")
            assert (str(error.get("requested")), str(error.get("allowed"))) == ("2", "1"), (
                f"OVER_BUDGET should carry requested 2 and allowed 1 (the residual): {error}"
            )
            assert_unreached(log_a, before, "a write over the residual")
            assert not (root_a / "out/w3.txt").exists()
            await forwarded(refusing, "read_file", {"path": "out/w2.txt"})  # 1 unit: fits exactly
            current = await ledger(outputs, worker, c1)
            assert (current["spent"], current["residual"]) == (10, 0), current
            error = await refused(refusing, "read_file", {"path": "out/w1.txt"}, "OVER_BUDGET")
            assert (str(error.get("requested")), str(error.get("allowed"))) == ("1", "0"), error
            assert_unreached(log_a, before + 1, "a read over the residual")

            # The audit: every forwarded call host-observed, nothing refused.
            audit = await get_audit(gbroker, c1)
            assert (audit["tool_calls"], audit["mutations"], audit["claim_violations"]) == (7, 3, 0), audit
            assert audit["mutation_paths"] == ["out/report.txt", "out/w1.txt", "out/w2.txt"], audit
            assert audit["mutation_path_count"] == 3, audit

            # The worker completes: judged on what the gateway observed.
            completed = await ok(
                outputs,
                worker,
                "complete",
                {"contract_id": c1, "output": {"files": ["out/report.txt", "out/w1.txt", "out/w2.txt"]},
                 "claim": "wrote the report and two notes under out/", "consumed": 3},
            )
            assert (completed["status"], completed["verdict"]) == ("COMPLETED", "ACCEPTED"), completed
            assert completed["within_scope"] is True and completed["out_of_scope_paths"] == [], completed
            # Host metering replaces the delegate's report (3): 10 charged, nothing returned.
            assert (completed["consumed"], completed["returned"]) == (10, 0), completed

            # Ended: nothing is forwarded. (Without `contract =` the gateway may
            # look for an open contract of its key again and find none.)
            before = len(log_lines(log_a))
            await refused(refusing, "read_file", {"path": "out/report.txt"}, {"CONTRACT_ENDED", "NO_CONTRACT"})
            assert_unreached(log_a, before, "a call after the contract completed")

            # Record mode: a second contract and gateway, named in its config.
            c2 = await issue(
                outputs, orchestrator, worker, root_id, agents["recording_host"], 10,
                "write the summary to out/summary.txt",
            )
            recording = make_gateway(
                gbroker, f"recording-{mode}", agents["recording_host"], [fs_server("fs", root_b, log_b)],
                fs_tools("fs"), out_of_scope="record", contract=c2,
            )
            gateways.append(recording)
            await open_gateway(stack, gbroker, recording, mode)
            await forwarded(recording, "write_file", {"path": "out/summary.txt", "content": "in"})
            await assert_spent(outputs, worker, c2, 2, "an in-scope write (record mode)")
            await forwarded(recording, "write_file", {"path": "notes/leak.txt", "content": "out"})
            assert (root_b / "notes/leak.txt").read_text() == "out", "record mode did not forward the write"
            await assert_spent(outputs, worker, c2, 4, "an out-of-scope write (record mode)")
            await forwarded(recording, "write_file", {"path": "out/../sneak.txt", "content": "out"})
            assert (root_b / "sneak.txt").read_text() == "out"
            await assert_spent(outputs, worker, c2, 6, "a write escaping out/ by '..' (record mode)")
            assert [line["arguments"]["path"] for line in log_lines(log_b)] == [
                "out/summary.txt", "notes/leak.txt", "out/../sneak.txt"
            ], log_lines(log_b)

            audit = await get_audit(gbroker, c2)
            assert (audit["tool_calls"], audit["mutations"], audit["claim_violations"]) == (3, 3, 2), audit
            assert audit["mutation_path_count"] == 3 and "notes/leak.txt" in audit["mutation_paths"], audit
            assert "out/summary.txt" in audit["mutation_paths"], audit

            completed = await ok(
                outputs,
                worker,
                "complete",
                {"contract_id": c2, "output": {"files": ["out/summary.txt"]},
                 "claim": "wrote the summary, all under out/", "consumed": 2},
            )
            assert completed["status"] == "COMPLETED", completed
            assert completed["within_scope"] is False, f"the out-of-scope writes were not judged: {completed}"
            assert completed["verdict"] == "REJECTED", completed
            assert completed["refused_criteria"] and PREDICATE in json.dumps(completed["refused_criteria"]), completed
            outside = completed["out_of_scope_paths"]
            assert len(outside) == 2 and "notes/leak.txt" in outside, completed
            assert any(p.endswith("sneak.txt") for p in outside), completed
            assert (completed["consumed"], completed["returned"]) == (6, 4), completed

            before = len(log_lines(log_b))
            await refused(recording, "write_file", {"path": "out/late.txt", "content": "x"}, "CONTRACT_ENDED")
            assert_unreached(log_b, before, "a call after the contract completed (record mode)")

    run(test, agents, gateways, gbroker)
    assert_no_secrets_through(gateways, agents)


# --------------------------------------------------------------------------
# Prefixed names, NO_CONTRACT, revocation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_prefixed_names_no_contract_and_revoke(gbroker: ConsoleBroker, mode: str) -> None:
    agents, names_file = make_agents(gbroker, ["orchestrator", "worker", "host", "idle_host"])
    orchestrator, worker = agents["orchestrator"], agents["worker"]
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="fs-", dir=gbroker.workdir))
    servers = [fs_server("a", home / "root-a", home / "a.log"), fs_server("b", home / "root-b", home / "b.log")]
    log_a, log_b = home / "a.log", home / "b.log"
    tools = {**fs_tools("a"), **fs_tools("b")}
    idle = make_gateway(gbroker, f"idle-{mode}", agents["idle_host"], servers, tools)
    gateways = [idle]

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker):
                await connect(stack, gbroker, agent, names_file, mode)

            # Two servers offer the same tools: each is served as <server>.<tool>.
            await open_gateway(stack, gbroker, idle, mode)
            names = sorted(tool.name for tool in await list_all_tools(idle))
            expected = sorted(f"{server}.{tool}" for server in ("a", "b") for tool in FS_TOOLS)
            assert names == expected, f"the gateway lists {names}, expected {expected}"

            # No open contract names idle_host as its host.
            await refused(idle, "a.write_file", {"path": "out/x.txt", "content": "x"}, "NO_CONTRACT")
            await refused(idle, "b.read_file", {"path": "out/x.txt"}, "NO_CONTRACT")
            assert_unreached(log_a, 0, "a call without a contract")
            assert_unreached(log_b, 0, "a call without a contract")

            root_id = await open_root(outputs, orchestrator, f"gateway-revoke-{mode}")
            c3 = await issue(outputs, orchestrator, worker, root_id, agents["host"], 20, "tidy out/")
            hosting = make_gateway(gbroker, f"hosting-{mode}", agents["host"], servers, tools, contract=c3)
            gateways.append(hosting)
            await open_gateway(stack, gbroker, hosting, mode)
            await forwarded(hosting, "a.write_file", {"path": "out/x.txt", "content": "from a"})
            await forwarded(hosting, "b.write_file", {"path": "out/y.txt", "content": "from b"})
            assert (home / "root-a/out/x.txt").read_text() == "from a" and not (home / "root-b/out/x.txt").exists()
            assert (home / "root-b/out/y.txt").read_text() == "from b" and not (home / "root-a/out/y.txt").exists()
            assert [line["tool"] for line in log_lines(log_a)] == ["write_file"], log_lines(log_a)
            assert [line["tool"] for line in log_lines(log_b)] == ["write_file"], log_lines(log_b)
            await assert_spent(outputs, worker, c3, 4, "two writes through prefixed names")

            # The orchestrator revokes: the gateway forwards nothing more.
            revoked = await ok(outputs, orchestrator, "revoke", {"contract_id": c3, "reason": "the test revokes"})
            assert revoked["status"] == "REVOKED", revoked
            await refused(hosting, "a.write_file", {"path": "out/z.txt", "content": "x"}, "CONTRACT_ENDED")
            await refused(hosting, "b.read_file", {"path": "out/y.txt"}, "CONTRACT_ENDED")
            await refused(hosting, "a.list_dir", {"path": "out"}, "CONTRACT_ENDED")
            assert_unreached(log_a, 1, "a call after the revocation")
            assert_unreached(log_b, 1, "a call after the revocation")
            assert not (home / "root-a/out/z.txt").exists()

            audit = await get_audit(gbroker, c3)
            assert (audit["tool_calls"], audit["mutations"], audit["claim_violations"]) == (2, 2, 0), audit
            assert audit["mutation_paths"] == ["out/x.txt", "out/y.txt"], audit
            await assert_spent(outputs, worker, c3, 4, "the revocation (metered units stay spent)")

    run(test, agents, gateways, gbroker)
    assert_no_secrets_through(gateways, agents)


CONTRACT_META_KEY = "delegation-broker/contract_id"


@pytest.mark.parametrize("mode", MODES)
def test_acts_only_for_what_it_hosts(gbroker: ConsoleBroker, mode: str) -> None:
    """A call naming the root, a sibling's contract (another host's), a
    second contract of this host after the session named one, or the
    agent's own contract once revoked is refused before any tool server
    sees it; the same for a path whose text is in the scope but whose
    symlink lands outside it, with `resolve_root` (text mode lets that
    write through: the reason for resolved mode)."""
    agents, names_file = make_agents(gbroker, ["orchestrator", "worker", "sibling", "host", "other_host"])
    orchestrator, worker, sibling = agents["orchestrator"], agents["worker"], agents["sibling"]
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="fs-", dir=gbroker.workdir))
    root, log = home / "root", home / "fs.log"
    server = fs_server("fs", root, log)
    (root / "out").mkdir()
    (root / "secret").mkdir()
    (root / "out" / "link").symlink_to(root / "secret")
    resolving = make_gateway(gbroker, f"resolving-{mode}", agents["host"], [server], fs_tools("fs"), resolve_root=root)
    textual = make_gateway(gbroker, f"textual-{mode}", agents["other_host"], [server], fs_tools("fs"))
    gateways = [resolving, textual]

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker, sibling):
                await connect(stack, gbroker, agent, names_file, mode)
            root_id = await open_root(outputs, orchestrator, f"gateway-hosts-{mode}")
            own = await issue(outputs, orchestrator, worker, root_id, agents["host"], 20, "write out/")
            second = await issue(outputs, orchestrator, worker, root_id, agents["host"], 20, "write out/ again")
            theirs = await issue(outputs, orchestrator, sibling, root_id, agents["other_host"], 20, "the sibling's")
            await open_gateway(stack, gbroker, resolving, mode)
            write = {"path": "out/a.txt", "content": "x"}

            def naming(contract_id: str) -> dict[str, Any]:
                return {CONTRACT_META_KEY: contract_id}

            # Somebody else's contracts: the root (no host) and the sibling's.
            await refused(resolving, "write_file", write, "NOT_HOST", meta=naming(root_id))
            await refused(resolving, "write_file", write, "NOT_HOST", meta=naming(theirs))
            assert_unreached(log, 0, "a call naming a contract the gateway does not host")

            # Its own: forwarded, and the session is pinned to it.
            await forwarded(resolving, "write_file", write, meta=naming(own))
            assert len(log_lines(log)) == 1, log_lines(log)
            await refused(resolving, "write_file", write, "CONTRACT_PINNED", meta=naming(second))
            assert_unreached(log, 1, "a call naming a second contract in one session")

            # Resolved mode: out/link/x.txt lands in secret/, outside the scope.
            error = await refused(resolving, "write_file", {"path": "out/link/x.txt", "content": "x"}, "OUT_OF_SCOPE")
            assert "secret/x.txt" in json.dumps(error), error
            escape = home / "elsewhere"
            escape.mkdir()
            (root / "out" / "away").symlink_to(escape)
            await refused(resolving, "write_file", {"path": "out/away/x.txt", "content": "x"}, "OUT_OF_ROOT")
            assert_unreached(log, 1, "a write through a symlink out of the scope")
            assert not (root / "secret" / "x.txt").exists()

            # Its own contract once revoked.
            revoked = await ok(outputs, orchestrator, "revoke", {"contract_id": own, "reason": "the test revokes"})
            assert revoked["status"] == "REVOKED", revoked
            await refused(resolving, "write_file", write, "CONTRACT_ENDED", meta=naming(own))
            assert_unreached(log, 1, "a call naming the revoked contract")
            audit = await get_audit(gbroker, own)
            assert audit["mutation_paths"] == ["out/a.txt"], audit

            # Text mode checks the text only: the same symlink write goes through.
            await open_gateway(stack, gbroker, textual, mode)
            await forwarded(textual, "write_file", {"path": "out/link/x.txt", "content": "x"}, meta=naming(theirs))
            assert (root / "secret" / "x.txt").exists(), "text mode let the write through the symlink"

    run(test, agents, gateways, gbroker)
    assert_no_secrets_through(gateways, agents)


# --------------------------------------------------------------------------
# c. SIGKILL mid-run
# --------------------------------------------------------------------------

KILL_CALLS = 48  # writes fired before the kill
KILL_AFTER = 12  # answers seen before the gateway is killed
KILL_LAUNCH_GAP_S = 0.02  # between two launches: calls overlap, the kill lands mid-run
KILL_WRITE_DELAY_MS = 200  # fs_server's time per write
AFTER_CALLS = 5  # writes through the new gateway process


def test_sigkill_mid_run(gbroker: ConsoleBroker) -> None:
    mode = "legacy"
    agents, names_file = make_agents(gbroker, ["orchestrator", "worker", "host"])
    orchestrator, worker = agents["orchestrator"], agents["worker"]
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="fs-", dir=gbroker.workdir))
    log = home / "fs.log"
    server = fs_server("fs", home / "root", log, delay_ms=KILL_WRITE_DELAY_MS)
    units = {"write_file": {"mutates": ["path"], "units": 1}}
    gateways: list[Gateway] = []

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker):
                await connect(stack, gbroker, agent, names_file, mode)
            root_id = await open_root(outputs, orchestrator, "gateway-sigkill", budget=1000)
            contract = await issue(outputs, orchestrator, worker, root_id, agents["host"], 500, "write out/k/")
            first = make_gateway(gbroker, "killed", agents["host"], [server], fs_tools("fs", units), contract=contract)
            gateways.append(first)

            started: dict[str, float] = {}
            answered: dict[str, float] = {}
            failed: dict[str, str] = {}
            killed_at: list[float] = []
            enough = anyio.Event()

            async def write(client: Client, path: str) -> None:
                started[path] = time.monotonic()
                try:
                    result = await client.call_tool("write_file", {"path": path, "content": path})
                except Exception as error:  # the gateway died under the call
                    failed[path] = repr(error)
                    return
                if result.is_error:
                    failed[path] = _brief_result(result, 300)
                    return
                answered[path] = time.monotonic()
                if len(answered) >= KILL_AFTER:
                    enough.set()

            session = AsyncExitStack()
            try:
                # A short read timeout: a call the dead process never answers ends in seconds.
                client = await open_gateway(session, gbroker, first, mode, read_timeout=15)
                pid = first.pid()
                async with anyio.create_task_group() as group:
                    for i in range(KILL_CALLS):
                        if enough.is_set():
                            break
                        group.start_soon(write, client, f"out/k/{i:03d}.txt")
                        await anyio.sleep(KILL_LAUNCH_GAP_S)
                    with anyio.move_on_after(30):
                        await enough.wait()
                    os.kill(pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
                    print(f"killed the gateway (pid {pid}) after {len(answered)} answers, {len(started)} started")
            finally:
                try:
                    await session.aclose()  # the transport of a dead process: errors are expected
                except Exception as error:
                    print(f"closing the killed gateway's client: {error!r}")
            kill = killed_at[0]
            print(f"the calls in flight ended {time.monotonic() - kill:.2f} s after the kill; "
                  f"{len(failed)} failed, e.g. {next(iter(failed.values()), None)}")
            answered_before = {p for p, t in answered.items() if t <= kill}
            assert len(answered_before) >= KILL_AFTER, (
                f"only {len(answered_before)} writes were answered in 30 s (failed: {failed})\n{first.tail()}"
            )
            in_flight = set(started) - set(answered)
            assert in_flight, "every write was answered before the kill: nothing was in flight"
            print(f"answered {len(answered)}, in flight at the kill {len(in_flight)}")

            # A new gateway process for the same contract carries on.
            second = make_gateway(gbroker, "restarted", agents["host"], [server], fs_tools("fs", units), contract=contract)
            second.stderr = first.stderr  # one log, both processes
            gateways.append(second)
            await open_gateway(stack, gbroker, second, mode)
            after = [f"out/after/{i}.txt" for i in range(AFTER_CALLS)]
            for path in after:
                await forwarded(second, "write_file", {"path": path, "content": path})
            answered_paths = set(answered) | set(after)

            audit = await get_audit(gbroker, contract)
            print(f"recorded {audit['mutations']} mutations: {len(answered_paths)} answered, {len(in_flight)} in flight")
            paths = set(audit["mutation_paths"])
            missing = sorted(answered_paths - paths)
            assert not missing, f"answered writes missing from the audit (record-before-answer): {missing}"
            assert audit["mutations"] == audit["mutation_path_count"] == len(paths), (
                f"a mutation was recorded twice: {audit['mutations']} mutations of "
                f"{audit['mutation_path_count']} distinct paths"
            )
            assert paths <= set(started) | set(after), f"paths recorded that were never written: {paths - set(started)}"
            bound = len(answered_paths) + len(in_flight)
            assert audit["mutations"] <= bound, (
                f"{audit['mutations']} mutations recorded, more than answered ({len(answered_paths)}) "
                f"+ in flight at the kill ({len(in_flight)})"
            )
            assert audit["tool_calls"] == audit["mutations"], f"one tool call per recorded write: {audit}"
            # Each recorded call was metered once (1 unit a write).
            await assert_spent(outputs, worker, contract, audit["tool_calls"], "the kill and the restart")
            # Everything fs_server wrote came through a call it logged.
            logged = [line["arguments"]["path"] for line in log_lines(log)]
            assert set(answered_paths) <= set(logged), "an answered write is not in fs_server's log"

    run(test, agents, gateways, gbroker)


# --------------------------------------------------------------------------
# d. hostile inputs and upstreams
# --------------------------------------------------------------------------


def nested(depth: int) -> Any:
    """A JSON value `depth` levels deep (a list inside a list …)."""
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


def test_hostile_upstreams(gbroker: ConsoleBroker) -> None:
    mode = "legacy"
    agents, names_file = make_agents(gbroker, ["orchestrator", "worker", "host"])
    orchestrator, worker = agents["orchestrator"], agents["worker"]
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="hostile-", dir=gbroker.workdir))
    fs_log, hostile_log, flood_log = home / "fs.log", home / "hostile.log", home / "flood.log"
    servers = [
        fs_server("fs", home / "root", fs_log),
        hostile_server("hostile", hostile_log),  # echo, hang, huge
        hostile_server("flood", flood_log, tools=5000, extras=False),  # t0 … t4999
    ]
    tools = {
        **fs_tools("fs"),
        "hostile.echo": {"units": 1},
        "hostile.hang": {"units": 1},
        "hostile.huge": {"units": 1},
    }
    gateways: list[Gateway] = []

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker):
                await connect(stack, gbroker, agent, names_file, mode)
            root_id = await open_root(outputs, orchestrator, "gateway-hostile", budget=1000)
            contract = await issue(outputs, orchestrator, worker, root_id, agents["host"], 500, "survive out/")
            gateway = make_gateway(
                gbroker, "hostile", agents["host"], servers, tools, contract=contract, call_timeout_ms=HANG_TIMEOUT_MS
            )
            gateways.append(gateway)
            await open_gateway(stack, gbroker, gateway, mode)

            # 5,000 tools announced: 256 taken, the other servers' tools beside them.
            started = time.monotonic()
            listed = await list_all_tools(gateway)
            print(f"tools/list: {len(listed)} tools in {time.monotonic() - started:.2f} s")
            names = [tool.name for tool in listed]
            assert len(names) == len(set(names)), "duplicate tool names in the listing"
            flood = [n for n in names if re.fullmatch(r"t\d+", n)]
            others = set(names) - set(flood)
            assert others == FS_TOOLS | {"echo", "hang", "huge"}, f"the other servers' tools: {sorted(others)}"
            assert len(flood) == MAX_TOOLS_PER_SERVER, (
                f"{len(flood)} of the flood's 5,000 tools listed, expected {MAX_TOOLS_PER_SERVER}"
            )
            assert all(int(n[1:]) < 5000 for n in flood), flood
            unlisted = next(f"t{i}" for i in range(5000) if f"t{i}" not in set(flood))

            # Refused before forwarding: nothing reaches a server, nothing is recorded.
            big = "x" * (MAX_ARGUMENT_BYTES + 1024)
            await refused(gateway, "echo", {"value": big}, "ARGUMENTS_TOO_LARGE")
            await refused(gateway, "write_file", {"path": "out/big.txt", "content": big}, "ARGUMENTS_TOO_LARGE")
            await refused(gateway, "echo", {"value": nested(MAX_ARGUMENT_DEPTH + 8)}, "ARGUMENTS_TOO_DEEP")
            await refused(gateway, "echo", {"value": {"a": {"b": nested(MAX_ARGUMENT_DEPTH)}}}, "ARGUMENTS_TOO_DEEP")
            await refused(gateway, "no_such_tool", {}, "UNKNOWN_TOOL")
            await refused(gateway, unlisted, {}, "UNKNOWN_TOOL")
            await refused(gateway, "fs.write_file", {"path": "out/x.txt", "content": "x"}, "UNKNOWN_TOOL")
            for log in (fs_log, hostile_log, flood_log):
                assert_unreached(log, 0, f"a refused call ({log.name})")
            audit = await get_audit(gbroker, contract)
            assert (audit["tool_calls"], audit["mutations"]) == (0, 0), f"a refused call was recorded: {audit}"
            await assert_spent(outputs, worker, contract, 0, "refused calls")

            # Within the bounds: forwarded and answered.
            under = "y" * (MAX_ARGUMENT_BYTES - 4096)
            result = await forwarded(gateway, "write_file", {"path": "out/h.txt", "content": under})
            assert result.structured_content == {"path": "out/h.txt", "bytes": len(under)}, _brief_result(result)
            deep_ok = nested(MAX_ARGUMENT_DEPTH - 8)
            result = await forwarded(gateway, "echo", {"value": deep_ok})
            assert result.structured_content == {"value": deep_ok}, _brief_result(result)
            answered_units = 2 + 1
            answered_calls = 2
            audit = await get_audit(gbroker, contract)
            assert (audit["tool_calls"], audit["mutations"]) == (answered_calls, 1), audit
            await assert_spent(outputs, worker, contract, answered_units, "two answered calls")

            # A tool that never answers: UPSTREAM_TIMEOUT after call_timeout_ms; other calls go on meanwhile.
            hang_outcome: dict[str, Any] = {}

            async def hang() -> None:
                assert gateway.client is not None
                t0 = time.monotonic()
                try:
                    hang_outcome["result"] = await gateway.client.call_tool(
                        "hang", {}, read_timeout_seconds=HANG_TIMEOUT_MS / 1000 + HANG_SLACK_S
                    )
                except MCPError as error:
                    hang_outcome["error"] = error
                hang_outcome["elapsed"] = time.monotonic() - t0

            async with anyio.create_task_group() as group:
                group.start_soon(hang)
                with anyio.fail_after(10):  # until hostile_server has the call
                    while not any(line["tool"] == "hang" for line in log_lines(hostile_log)):
                        await anyio.sleep(0.05)
                t0 = time.monotonic()
                result = await forwarded(gateway, "echo", {"value": "during the hang"})
                during = time.monotonic() - t0
                # Answered while hang is still pending: calls are not queued behind it.
                assert not hang_outcome, f"echo was answered only after hang came back: {hang_outcome}"
                assert result.structured_content == {"value": "during the hang"}, _brief_result(result)
                print(f"echo answered in {during:.3f} s while hang was pending")
                answered_units += 1
                answered_calls += 1
            elapsed = hang_outcome["elapsed"]
            assert "error" not in hang_outcome, (
                f"hang: no tool result after {elapsed:.2f} s (call_timeout_ms {HANG_TIMEOUT_MS}): "
                f"{hang_outcome['error']!r}\ngateway stderr:\n{gateway.tail()}"
            )
            result = hang_outcome["result"]
            gateway.results.append(("hang", result))
            assert result.is_error, f"hang was answered: {_brief_result(result)}"
            assert (result.structured_content or {}).get("error", {}).get("reason") == "UPSTREAM_TIMEOUT", (
                _brief_result(result)
            )
            assert HANG_TIMEOUT_MS / 1000 * 0.9 <= elapsed <= HANG_TIMEOUT_MS / 1000 + HANG_SLACK_S, (
                f"UPSTREAM_TIMEOUT after {elapsed:.2f} s; call_timeout_ms is {HANG_TIMEOUT_MS}"
            )
            result = await forwarded(gateway, "echo", {"value": "after the hang"})
            assert result.structured_content == {"value": "after the hang"}
            answered_units += 1
            answered_calls += 1

            # 2 MiB of result: refused as too large, never passed on whole.
            result = await gcall(gateway, "huge", {})
            assert result.is_error, f"a 2 MiB result was passed on ({len(show(result))} bytes)"
            reason = (result.structured_content or {}).get("error", {}).get("reason")
            assert reason == "RESULT_TOO_LARGE", _brief_result(result)
            assert len(show(result)) < 64 * 1024, f"the refusal carries {len(show(result))} bytes"
            result = await forwarded(gateway, "echo", {"value": "after huge"})
            assert result.structured_content == {"value": "after huge"}
            await forwarded(gateway, "write_file", {"path": "out/h2.txt", "content": "h2"})
            answered_units += 1 + 2
            answered_calls += 2

            # Recorded: every answered call; hang and huge reached hostile_server
            # and may be recorded as tool calls (at most 1 unit each), nothing else.
            audit = await get_audit(gbroker, contract)
            assert audit["mutations"] == 2 and audit["mutation_paths"] == ["out/h.txt", "out/h2.txt"], audit
            extra = audit["tool_calls"] - answered_calls
            assert 0 <= extra <= 2, f"{audit['tool_calls']} tool calls recorded, {answered_calls} answered + hang, huge"
            spent = (await ledger(outputs, worker, contract))["spent"]
            assert answered_units <= spent <= answered_units + extra, (
                f"spent {spent}: the answered calls metered {answered_units}, and {extra} unanswered calls recorded"
            )
            assert [line["tool"] for line in log_lines(flood_log)] == [], "a flood tool was called"

    run(test, agents, gateways, gbroker)
    assert_no_secrets_through(gateways, agents)


# --------------------------------------------------------------------------
# A streamable-HTTP upstream (`url =` instead of command/args)
# --------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _listening(port: int, server: subprocess.Popen[bytes], stderr_path: Path) -> None:
    """Waits (30 s at most) until fs_server --http listens on `port`."""
    import socket

    with anyio.fail_after(30):
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                assert server.poll() is None, f"fs_server --http exited: {stderr_path.read_text()[-2000:]}"
                await anyio.sleep(0.1)


def test_streamable_http_upstream(gbroker: ConsoleBroker) -> None:
    import socket

    mode = "legacy"
    agents, names_file = make_agents(gbroker, ["orchestrator", "worker", "host"])
    orchestrator, worker = agents["orchestrator"], agents["worker"]
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="web-", dir=gbroker.workdir))
    root, log, stderr_path = home / "root", home / "web.log", home / "web.stderr"
    root.mkdir()
    log.touch()
    port = free_port()
    with open(stderr_path, "wb") as stderr:
        web = subprocess.Popen(
            [PYTHON, str(FS_SERVER), "--root", str(root), "--log", str(log), "--name", "web", "--http", str(port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
        )
    gateways: list[Gateway] = []

    async def test() -> None:
        await _listening(port, web, stderr_path)
        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker):
                await connect(stack, gbroker, agent, names_file, mode)
            root_id = await open_root(outputs, orchestrator, "gateway-http")
            contract = await issue(outputs, orchestrator, worker, root_id, agents["host"], 10, "write out/web.txt")
            gateway = make_gateway(
                gbroker, "http", agents["host"], [{"name": "web", "url": f"http://127.0.0.1:{port}/mcp"}],
                fs_tools("web"), contract=contract,
            )
            gateways.append(gateway)
            await open_gateway(stack, gbroker, gateway, mode)
            names = sorted(tool.name for tool in await list_all_tools(gateway))
            assert names == sorted(FS_TOOLS), f"the gateway lists {names}"
            result = await forwarded(gateway, "write_file", {"path": "out/web.txt", "content": "over http"})
            assert result.structured_content == {"path": "out/web.txt", "bytes": 9}, _brief_result(result)
            assert (root / "out/web.txt").read_text() == "over http"
            await assert_spent(outputs, worker, contract, 2, "a write over streamable HTTP")
            await refused(gateway, "write_file", {"path": "notes/web.txt", "content": "x"}, "OUT_OF_SCOPE", "path")
            assert_unreached(log, 1, "a write outside the scope")
            audit = await get_audit(gbroker, contract)
            assert (audit["tool_calls"], audit["mutations"], audit["mutation_paths"]) == (1, 1, ["out/web.txt"]), audit

    try:
        run(test, agents, gateways, gbroker)
    finally:
        web.terminate()
        try:
            web.wait(10)
        except subprocess.TimeoutExpired:
            web.kill()
            web.wait(10)


def key_id(public_key_hex: str) -> str:
    """A key's id as tokens name it: `ed25519:` + hex of the first 16 bytes of SHA-256(key)."""
    return "ed25519:" + hashlib.sha256(bytes.fromhex(public_key_hex)).digest()[:16].hex()


def test_streamable_http_upstream_with_token(tbroker: ConsoleBroker) -> None:
    """`token_header`/`token_resource` on a `url` server (and `tokens_url`):
    each forwarded call carries a JWT the gateway, as host, minted at the
    broker for the call's contract; fs_server (`--require-token`) verifies it
    with PyJWT against the broker's JWKS and logs its claims. A resource the
    broker does not mint for is TOKEN_REFUSED before the server sees the call;
    after the revocation nothing more reaches the server."""
    import socket

    mode = "legacy"
    agents, names_file = make_agents(tbroker, ["orchestrator", "worker", "host"])
    orchestrator, worker, host = agents["orchestrator"], agents["worker"], agents["host"]
    outputs = Outputs()
    with urllib.request.urlopen(f"{tbroker.tokens}/.well-known/oauth-authorization-server", timeout=30) as answer:
        metadata = json.load(answer)
    assert metadata.get("issuer") == tbroker.tokens, metadata
    assert metadata.get("jwks_uri"), metadata
    home = Path(tempfile.mkdtemp(prefix="web-token-", dir=tbroker.workdir))
    root, log, stderr_path = home / "root", home / "web.log", home / "web.stderr"
    root.mkdir()
    log.touch()
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    require = f"{metadata['jwks_uri']},{metadata['issuer']},{TOKEN_RESOURCE}"
    with open(stderr_path, "wb") as stderr:
        web = subprocess.Popen(
            [PYTHON, str(FS_SERVER), "--root", str(root), "--log", str(log), "--name", "web",
             "--http", str(port), "--require-token", require],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
        )
    gateways: list[Gateway] = []

    def claims_of(line: dict[str, Any]) -> dict[str, Any]:
        assert "claims" in line, f"fs_server did not verify the call's token: {line.get('token_error')!r} ({line})"
        return line["claims"]

    async def test() -> None:
        await _listening(port, web, stderr_path)
        # The server's check is real: a call without a token is refused, unrun.
        async with Client(url, mode=mode, read_timeout_seconds=CALL_TIMEOUT_S) as direct:
            result = await direct.call_tool("write_file", {"path": "out/direct.txt", "content": "no token"})
        assert result.is_error and "TOKEN_INVALID" in text_of(result), show(result)
        assert [line.get("token_error") for line in log_lines(log)] == ["no Authorization header"], log_lines(log)
        assert not (root / "out/direct.txt").exists()
        seen = 1  # fs_server's log lines so far

        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker):
                await connect(stack, tbroker, agent, names_file, mode)
            root_id = await open_root(outputs, orchestrator, "gateway-http-token")
            contract = await issue(outputs, orchestrator, worker, root_id, host, 10, "write out/web.txt")
            token_server = {"url": url, "token_header": "Authorization"}
            gateway = make_gateway(
                tbroker, "http-token", host,
                [
                    {"name": "web", **token_server, "token_resource": TOKEN_RESOURCE},
                    # The same server, for a resource the broker does not mint for.
                    {"name": "elsewhere", **token_server, "token_resource": "https://elsewhere.test"},
                ],
                {**fs_tools("web"), **fs_tools("elsewhere")}, contract=contract, tokens_url=tbroker.tokens,
            )
            gateways.append(gateway)
            await open_gateway(stack, tbroker, gateway, mode)
            names = sorted(tool.name for tool in await list_all_tools(gateway))
            assert names == sorted(f"{server}.{tool}" for server in ("web", "elsewhere") for tool in FS_TOOLS), names
            assert len(log_lines(log)) == seen, "initialize or tools/list was logged as a call"

            # Forwarded with the host's token for the contract, verified by the server.
            result = await forwarded(gateway, "web.write_file", {"path": "out/web.txt", "content": "with a token"})
            assert result.structured_content == {"path": "out/web.txt", "bytes": 12}, _brief_result(result)
            assert (root / "out/web.txt").read_text() == "with a token"
            lines = log_lines(log)
            assert len(lines) == seen + 1, lines[seen:]
            first = lines[seen]
            seen += 1
            claims = claims_of(first)
            print(f"the token's header: {first['jose']}\nits claims: {json.dumps(claims, indent=1)}")
            assert first["jose"].get("alg") == "EdDSA" and first["jose"].get("typ") == "at+jwt", first["jose"]
            assert str(first["jose"].get("kid", "")).startswith("ed25519:"), first["jose"]
            assert claims["aud"] in (TOKEN_RESOURCE, [TOKEN_RESOURCE]), claims
            assert claims["iss"] == metadata["issuer"], claims
            assert claims["tctx"]["contract_id"] == contract, claims
            assert claims["tctx"]["root_id"] == root_id and claims["txn"] == root_id, claims
            assert claims["tctx"]["depth"] == 1, claims
            assert claims["tctx"]["residual"] == 10, f"minted before the call was recorded: {claims}"
            assert claims["tctx"]["write_scope"] in (SCOPE, [p.rstrip("/") for p in SCOPE]), claims
            assert claims["sub"] == key_id(worker.public_key), f"sub is not the delegate's key id: {claims}"
            assert claims["client_id"] == key_id(host.public_key), f"client_id is not the host's key id: {claims}"
            act = claims["act"]
            assert act.get("sub") == key_id(host.public_key) and act.get("host") is True, f"act: {act}"
            assert act.get("act") == {"sub": key_id(orchestrator.public_key), "contract_id": root_id}, (
                f"act.act is not the delegators' chain (the orchestrator, holding the root): {act}"
            )
            await assert_spent(outputs, worker, contract, 2, "a write to a token-checking server")

            # A second call: the same contract's token, from the gateway's cache.
            result = await forwarded(gateway, "web.read_file", {"path": "out/web.txt"})
            assert result.structured_content == {"path": "out/web.txt", "content": "with a token"}
            lines = log_lines(log)
            assert len(lines) == seen + 1, lines[seen:]
            assert claims_of(lines[seen])["jti"] == claims["jti"], "the token was minted again within its lifetime"
            seen += 1

            # A resource the broker does not mint for: refused before the server.
            error = await refused(
                gateway, "elsewhere.write_file", {"path": "out/else.txt", "content": "x"}, "TOKEN_REFUSED"
            )
            print(f"a resource the broker does not mint for: {error}")
            assert_unreached(log, seen, "a call whose token the broker refused")
            assert not (root / "out/else.txt").exists()
            audit = await get_audit(tbroker, contract)
            assert (audit["tool_calls"], audit["mutations"], audit["mutation_paths"]) == (2, 1, ["out/web.txt"]), audit

            # Revoked: nothing more reaches the server (the gateway refuses the
            # ended contract itself, or the broker refuses the token).
            revoked = await ok(outputs, orchestrator, "revoke", {"contract_id": contract, "reason": "the test revokes"})
            assert revoked["status"] == "REVOKED", revoked
            error = await refused(
                gateway, "web.write_file", {"path": "out/late.txt", "content": "x"}, {"TOKEN_REFUSED", "CONTRACT_ENDED"}
            )
            print(f"after the revocation: {error}")
            assert_unreached(log, seen, "a call after the revocation")
            assert not (root / "out/late.txt").exists()
            audit = await get_audit(tbroker, contract)
            assert (audit["tool_calls"], audit["mutations"]) == (2, 1), audit
            await assert_spent(outputs, worker, contract, 3, "the revocation (metered units stay spent)")

    try:
        run(test, agents, gateways, tbroker)
    finally:
        web.terminate()
        try:
            web.wait(10)
        except subprocess.TimeoutExpired:
            web.kill()
            web.wait(10)
    assert_no_secrets_through(gateways, agents)


@pytest.mark.parametrize(
    ("server", "top", "message"),
    [
        ('url = "http://127.0.0.1:9/mcp"\ntoken_header = "Authorization"', 'tokens_url = "http://127.0.0.1:9"',
         "token_header and token_resource go together"),
        ('url = "http://127.0.0.1:9/mcp"\ntoken_header = "Authorization"\ntoken_resource = "https://tools.test"', "",
         "tokens_url"),
        ('command = "true"\ntoken_header = "Authorization"\ntoken_resource = "https://tools.test"',
         'tokens_url = "http://127.0.0.1:9"', "url server"),
    ],
    ids=["header-without-resource", "without-tokens_url", "on-a-command-server"],
)
def test_token_config_errors(tmp_path: Path, server: str, top: str, message: str) -> None:
    """A token setting the gateway cannot honour stops it at start, naming the key."""
    binary = broker_bin()
    key_file = tmp_path / "host.key"
    keygen = subprocess.run([binary, "keygen", "--out", str(key_file)], capture_output=True, timeout=30)
    assert keygen.returncode == 0, keygen.stderr.decode(errors="replace")
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'broker = "http://127.0.0.1:9"\nkey_file = {_toml(str(key_file))}\n{top}\n\n[[servers]]\nname = "w"\n{server}\n'
    )
    run_ = subprocess.run(
        [binary, "mcp", "gateway", "--config", str(config)],
        stdin=subprocess.DEVNULL, capture_output=True, timeout=30, env={**os.environ, "NO_COLOR": "1"},
    )
    stderr = run_.stderr.decode(errors="replace")
    assert run_.returncode != 0, f"the gateway started with {config.read_text()!r}: {stderr[-1000:]}"
    assert "token_header" in stderr or "token_resource" in stderr, f"the error names no key: {stderr[-1000:]}"
    assert message in stderr, f"expected {message!r} in: {stderr[-1000:]}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", *sys.argv[1:]]))


# --------------------------------------------------------------------------
# traces: _meta.traceparent goes on to the tool server and the broker
# --------------------------------------------------------------------------


def test_trace_context_goes_on(gbroker: ConsoleBroker) -> None:
    """A call sent with `_meta.traceparent` reaches the tool server with the
    same trace (and nothing else of `_meta`), and the broker's calls made
    for it (GetContract, RecordReceipts) are in that trace (the broker's
    JSON log lines carry each call's trace id)."""
    mode = "legacy"
    agents, names_file = make_agents(gbroker, ["orchestrator", "worker", "host"])
    orchestrator, worker = agents["orchestrator"], agents["worker"]
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="fs-", dir=gbroker.workdir))
    log = home / "fs.log"
    gateways: list[Gateway] = []
    trace_id = os.urandom(16).hex()
    traceparent = f"00-{trace_id}-{os.urandom(8).hex()}-01"

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker):
                await connect(stack, gbroker, agent, names_file, mode)
            root_id = await open_root(outputs, orchestrator, "gateway-trace")
            contract = await issue(outputs, orchestrator, worker, root_id, agents["host"], 10, "write out/t.txt")
            gateway = make_gateway(gbroker, "trace", agents["host"], [fs_server("fs", home / "root", log)], fs_tools("fs"))
            gateways.append(gateway)
            client = await open_gateway(stack, gbroker, gateway, mode)
            result = await client.call_tool(
                "write_file",
                {"path": "out/t.txt", "content": "traced"},
                meta={"traceparent": traceparent, "delegation-broker/contract_id": contract, "secret": "x"},
            )
            assert not result.is_error, _brief_result(result)
            received = [line.get("meta") or {} for line in log_lines(log)]
            assert len(received) == 1, received
            assert received[0].get("traceparent", "").split("-")[1:2] == [trace_id], received
            assert "secret" not in received[0] and "delegation-broker/contract_id" not in received[0], received
            # The broker's lines for the gateway's calls carry the trace id.
            def traced_methods() -> set[str]:
                methods = set()
                for raw in gbroker.stderr_path.read_text(errors="replace").splitlines():
                    try:
                        line = json.loads(raw)
                    except ValueError:
                        continue
                    span = line.get("span") or {}
                    if line.get("message") == "call answered" and span.get("trace_id") == trace_id:
                        methods.add(span.get("rpc.method"))
                return methods

            with anyio.fail_after(10):
                while not {"GetContract", "RecordReceipts"} <= traced_methods():
                    await anyio.sleep(0.1)

    run(test, agents, gateways, gbroker)


def test_gateway_over_streamable_http(gbroker: ConsoleBroker) -> None:
    """`mcp gateway --listen 127.0.0.1:0`: served over streamable HTTP in
    both connect modes, the same checks and recording as on stdio."""
    agents, names_file = make_agents(gbroker, ["orchestrator", "worker", "host"])
    orchestrator, worker = agents["orchestrator"], agents["worker"]
    outputs = Outputs()
    home = Path(tempfile.mkdtemp(prefix="fs-", dir=gbroker.workdir))
    log = home / "fs.log"
    gateways: list[Gateway] = []
    processes: list[subprocess.Popen[bytes]] = []

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in (orchestrator, worker):
                await connect(stack, gbroker, agent, names_file, "legacy")
            root_id = await open_root(outputs, orchestrator, "gateway-listen")
            contract = await issue(outputs, orchestrator, worker, root_id, agents["host"], 20, "write out/")
            gateway = make_gateway(gbroker, "listen", agents["host"], [fs_server("fs", home / "root", log)], fs_tools("fs"))
            gateways.append(gateway)
            process = subprocess.Popen(
                [gbroker.bin, "mcp", "gateway", "--config", str(gateway.config), "--listen", "127.0.0.1:0"],
                stdout=subprocess.PIPE, stderr=open(gateway.stderr, "wb"), stdin=subprocess.DEVNULL,
                env={**os.environ, "NO_COLOR": "1"},
            )
            processes.append(process)
            line = await anyio.to_thread.run_sync(process.stdout.readline)  # type: ignore[union-attr]
            match = re.fullmatch(r"mcp on (http://127\.0\.0\.1:\d+/mcp)", line.decode().strip())
            assert match, f"`mcp gateway --listen` printed {line!r}\n{gateway.tail()}"
            for i, mode in enumerate(["legacy", "auto"]):
                async with Client(match.group(1), mode=mode, read_timeout_seconds=CALL_TIMEOUT_S) as client:
                    gateway.client = client
                    names = sorted(tool.name for tool in (await client.list_tools()).tools)
                    assert names == sorted(FS_TOOLS), names
                    await forwarded(gateway, "write_file", {"path": f"out/{mode}.txt", "content": mode})
                    await refused(gateway, "write_file", {"path": "notes/x.txt", "content": "x"}, "OUT_OF_SCOPE", "path")
                    assert_unreached(log, i + 1, "a write outside the scope, over HTTP")
            audit = await get_audit(gbroker, contract)
            assert audit["mutation_paths"] == ["out/auto.txt", "out/legacy.txt"], audit

    try:
        run(test, agents, gateways, gbroker)
    finally:
        for process in processes:
            process.terminate()
            process.wait(15)
