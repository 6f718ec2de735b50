"""`delegation-broker mcp tools` driven by the
official Python MCP SDK (`mcp` 2.3.0) over stdio.

One broker (`serve`), three agents (orchestrator, planner, executor), each
with its own key and its own `mcp tools` process, spawned by the SDK's stdio
client transport. Every test runs twice: `mode="legacy"` (the 2025-11-25
initialize handshake) and `mode="auto"` (the SDK's default: it probes
`server/discover` at 2026-07-28 and falls back to initialize).

- the tool list: the expected names, every input (and output) schema a valid
  Draft 2020-12 JSON Schema;
- `whoami` for each agent: its public key, key id and address-book name,
  and the open contracts it holds (an issued contract listed, gone once
  completed);
- seed 001's chain: the planner's over-budget liable child is refused as a
  tool error (NO_RETRY_HEADROOM, requested 5, allowed 12) that reserves
  nothing; the corrected call (13) is issued at depth 2 and leaves the
  planner 12 free and 13 reserved; the executor's own server accepts and
  completes and the verdict comes back ACCEPTED; `tree` draws the three
  contracts; `verify_chain` verifies the three;
- bad inputs (a string budget, a negative budget, bad hex, an unknown
  delegate name) are tool errors naming the field, never protocol errors,
  and issue nothing;
- no tool output (text or structured), and no line the `mcp tools`
  processes log, carries an agent's seed; no tool output mentions a session
  header or the word "seed".

BROKER_BIN names the broker binary (default: <repo>/target/debug/delegation-broker).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from mcp import Client, MCPError, StdioServerParameters, stdio_client
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, KNOWN_PROTOCOL_VERSIONS

REPO_ROOT = Path(__file__).resolve().parents[2]
MODES = ["legacy", "auto"]

EXPECTED_TOOLS = {
    "whoami",
    "open_root",
    "delegate",
    "accept",
    "decline",
    "escalate",
    "revoke",
    "complete",
    "get_contract",
    "tree",
    "verify_chain",
}

SEED_001_PREDICATE = "result.schema_valid && result.within_scope"
ESCALATION = "broker://escalate"
HEX64 = re.compile(r"[0-9a-f]{64}")

# Per call; a whole test is bounded by TEST_TIMEOUT_S.
CALL_TIMEOUT_S = 60.0
TEST_TIMEOUT_S = 240.0


# --------------------------------------------------------------------------
# The broker binary and the broker process
# --------------------------------------------------------------------------


def broker_bin() -> str:
    path = os.environ.get("BROKER_BIN") or str(REPO_ROOT / "target/debug/delegation-broker")
    if not os.path.isabs(path):
        path = str(Path.cwd() / path) if (Path.cwd() / path).exists() else str(REPO_ROOT / path)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"no broker binary at {path} (set BROKER_BIN)", pytrace=False)
    return path


@dataclass
class Broker:
    bin: str
    addr: str
    workdir: Path
    process: subprocess.Popen[bytes]
    stderr_path: Path


@pytest.fixture(scope="module")
def broker() -> Any:
    binary = broker_bin()
    help_run = subprocess.run([binary, "mcp", "tools", "--help"], capture_output=True, timeout=30)
    if help_run.returncode != 0:
        pytest.fail(
            f"{binary} has no `mcp tools` command (exit {help_run.returncode}): "
            f"{help_run.stderr.decode(errors='replace')[:500]}",
            pytrace=False,
        )
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tools-test-"))
    data_dir = workdir / "broker-data"
    data_dir.mkdir()
    stderr_path = workdir / "broker.stderr"
    stderr = open(stderr_path, "wb")
    process = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
    )
    stderr.close()
    first: list[bytes] = []
    reader = threading.Thread(target=lambda: first.append(process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(60)
    line = first[0].decode(errors="replace").strip() if first else ""
    match = re.fullmatch(r"listening on (127\.0\.0\.1:\d+)", line)
    if not match:
        process.kill()
        process.wait(10)
        pytest.fail(
            f"the broker did not print `listening on 127.0.0.1:PORT` (got {line!r}); "
            f"stderr: {stderr_path.read_text(errors='replace')[-2000:]}",
            pytrace=False,
        )

    def drain() -> None:  # the rest of stdout, so the broker never blocks on a full pipe
        for _ in process.stdout:  # type: ignore[union-attr]
            pass

    threading.Thread(target=drain, daemon=True).start()
    yield Broker(binary, f"http://{match.group(1)}", workdir, process, stderr_path)
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


# --------------------------------------------------------------------------
# Agents: a key each, an address book, one `mcp tools` process each
# --------------------------------------------------------------------------


@dataclass
class Agent:
    name: str
    public_key: str
    seed_hex: str
    key_file: Path
    log_path: Path
    client: Client | None = None


@dataclass
class Outputs:
    """Every output of every tool call, and every tool listing, for the secret search."""

    results: list[tuple[str, str, Any]] = field(default_factory=list)  # (agent, tool, CallToolResult)
    listings: list[tuple[str, Any]] = field(default_factory=list)  # (agent, ListToolsResult)


def make_agents(broker: Broker, names: list[str]) -> tuple[dict[str, Agent], Path]:
    home = Path(tempfile.mkdtemp(prefix="agents-", dir=broker.workdir))
    agents: dict[str, Agent] = {}
    for name in names:
        key_file = home / f"{name}.key"
        keygen = subprocess.run([broker.bin, "keygen", "--out", str(key_file)], capture_output=True, timeout=30)
        assert keygen.returncode == 0, keygen.stderr.decode(errors="replace")
        public_key = keygen.stdout.decode().strip()
        assert HEX64.fullmatch(public_key), f"keygen printed {public_key!r}, not a hex public key"
        seed_hex = key_file.read_text().strip().lower()
        assert re.fullmatch(r"[0-9a-f]{64}", seed_hex), "keygen's key file is not a 32-byte hex seed"
        agents[name] = Agent(name, public_key, seed_hex, key_file, home / f"{name}.mcp.stderr")
    names_file = home / "names.toml"
    names_file.write_text("".join(f'"{a.public_key}" = "{a.name}"\n' for a in agents.values()))
    return agents, names_file


async def connect(
    stack: AsyncExitStack,
    broker: Broker,
    agent: Agent,
    names_file: Path,
    mode: str,
    message_handler: Any = None,
) -> Client:
    params = StdioServerParameters(
        command=broker.bin,
        args=[
            "mcp",
            "tools",
            "--key-file",
            str(agent.key_file),
            "--addr",
            broker.addr,
            "--names",
            str(names_file),
        ],
        env={"RUST_LOG": os.environ.get("RUST_LOG", "info"), "NO_COLOR": "1"},
    )
    errlog = stack.enter_context(open(agent.log_path, "w"))
    client = Client(
        stdio_client(params, errlog=errlog),
        mode=mode,
        read_timeout_seconds=CALL_TIMEOUT_S,
        message_handler=message_handler,
    )
    try:
        await stack.enter_async_context(client)
    except BaseException as error:  # the handshake itself failed: say which mode and show the server's log
        errlog.flush()
        raise AssertionError(
            f"{agent.name}: connecting in mode={mode!r} failed: {error!r}\n"
            f"server stderr:\n{agent.log_path.read_text(errors='replace')[-3000:]}"
        ) from error
    agent.client = client
    return client


def text_of(result: Any) -> str:
    return "\n".join(block.text for block in result.content if getattr(block, "type", None) == "text")


def show(result: Any) -> str:
    return result.model_dump_json(by_alias=True, exclude_none=True)


async def call(outputs: Outputs, agent: Agent, tool: str, arguments: dict[str, Any]) -> Any:
    """A tools/call that must come back as a tool result (never a protocol error)."""
    assert agent.client is not None
    try:
        result = await agent.client.call_tool(tool, arguments)
    except MCPError as error:
        raise AssertionError(
            f"{agent.name}: {tool}({json.dumps(arguments)}) was a protocol error "
            f"(code {error.code}: {error}), not a tool result"
        ) from error
    outputs.results.append((agent.name, tool, result))
    return result


async def ok(outputs: Outputs, agent: Agent, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A successful tool call's structured content."""
    result = await call(outputs, agent, tool, arguments)
    assert not result.is_error, f"{agent.name}: {tool}({json.dumps(arguments)}) failed: {show(result)}"
    assert isinstance(result.structured_content, dict), f"{tool}: no structured content: {show(result)}"
    return result.structured_content


async def tool_error(
    outputs: Outputs, agent: Agent, tool: str, arguments: dict[str, Any], field_name: str | None = None
) -> dict[str, Any]:
    """A bad input or a broker error: a tool error with a structured `error`
    (naming `field_name`, when given)."""
    result = await call(outputs, agent, tool, arguments)
    assert result.is_error, f"{tool}({json.dumps(arguments)}) was not refused: {show(result)}"
    content = result.structured_content
    assert isinstance(content, dict) and isinstance(content.get("error"), dict), (
        f"{tool}({json.dumps(arguments)}): no structured {{'error': ...}}: {show(result)}"
    )
    error = content["error"]
    assert isinstance(error.get("reason"), str) and error["reason"], f"error without a reason: {error}"
    assert isinstance(error.get("message"), str) and error["message"], f"error without a message: {error}"
    assert "field" in error, f"the error has no field key (null when none): {error}"
    if field_name is not None:
        assert error["field"] == field_name, f"the error names field {error.get('field')!r}, not {field_name!r}: {error}"
    assert text_of(result).strip(), f"a tool error without text for the model: {show(result)}"
    return error


def assert_hex_id(value: Any, what: str) -> None:
    assert isinstance(value, str) and HEX64.fullmatch(value), f"{what} is not a 64-hex id: {value!r}"


def ledger_of(state: dict[str, Any]) -> dict[str, Any]:
    ledger = state["ledger"]
    assert ledger["budget"] == ledger["residual"] + ledger["reserved"] + ledger["spent"], (
        f"the ledger does not balance: {ledger}"
    )
    return ledger


def run(test: Any, agents: dict[str, Agent]) -> None:
    """Runs one test's coroutine, bounded; on failure prints the tail of each
    `mcp tools` process's stderr (pytest shows it under "Captured stdout")."""

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
        for agent in agents.values():
            if agent.log_path.exists():
                print(f"--- {agent.name}'s `mcp tools` stderr (tail) ---")
                print(agent.log_path.read_text(errors="replace")[-4000:])
        raise


def _leaves(error: BaseException) -> Any:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


# --------------------------------------------------------------------------
# No secret in any output
# --------------------------------------------------------------------------


def secret_forms(agent: Agent) -> list[str]:
    seed = bytes.fromhex(agent.seed_hex)
    return [
        agent.seed_hex,
        agent.seed_hex.upper(),
        base64.b64encode(seed).decode(),
        base64.urlsafe_b64encode(seed).decode().rstrip("="),
        base64.b64encode(seed).decode().rstrip("="),
    ]


def assert_no_secrets(outputs: Outputs, agents: dict[str, Agent]) -> None:
    assert outputs.results, "no tool output was recorded"
    forms = {agent.name: secret_forms(agent) for agent in agents.values()}
    leaks: list[str] = []
    for who, tool, result in outputs.results:
        blobs = [text_of(result), json.dumps(result.structured_content), show(result)]
        for blob in blobs:
            lowered = blob.lower()
            for owner, secrets in forms.items():
                if any(secret in blob for secret in secrets):
                    leaks.append(f"{who}'s {tool} output carries {owner}'s seed")
            if "x-broker-session" in lowered:
                leaks.append(f"{who}'s {tool} output mentions x-broker-session: {blob[:300]}")
            if "seed" in lowered:
                leaks.append(f"{who}'s {tool} output contains 'seed': {blob[:300]}")
    for who, listing in outputs.listings:
        blob = listing.model_dump_json(by_alias=True)
        for owner, secrets in forms.items():
            if any(secret in blob for secret in secrets):
                leaks.append(f"{who}'s tool listing carries {owner}'s seed")
        if "x-broker-session" in blob.lower():
            leaks.append(f"{who}'s tool listing mentions x-broker-session")
    # The issue: no key, seed or session in a tool result *or log*.
    for agent in agents.values():
        log = agent.log_path.read_text(errors="replace") if agent.log_path.exists() else ""
        for owner, secrets in forms.items():
            if any(secret in log for secret in secrets):
                leaks.append(f"{agent.name}'s `mcp tools` stderr carries {owner}'s seed")
    leaks = list(dict.fromkeys(leaks))
    assert not leaks, "secrets in the output:\n" + "\n".join(leaks)


# --------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_list_tools_and_whoami(broker: Broker, mode: str) -> None:
    agents, names_file = make_agents(broker, ["orchestrator", "planner", "executor"])
    outputs = Outputs()

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in agents.values():
                await connect(stack, broker, agent, names_file, mode)
            first = agents["orchestrator"].client
            assert first is not None
            version = first.protocol_version
            print(f"mode={mode}: negotiated protocol {version}")
            assert version in KNOWN_PROTOCOL_VERSIONS, f"unknown protocol version {version!r}"
            if mode == "legacy":
                assert version in HANDSHAKE_PROTOCOL_VERSIONS, f"legacy mode ended at {version!r}"

            listing = await first.list_tools()
            outputs.listings.append(("orchestrator", listing))
            assert listing.next_cursor is None, "the tool list is paged: expected one page"
            names = [tool.name for tool in listing.tools]
            assert len(names) == len(set(names)), f"duplicate tool names: {names}"
            missing = EXPECTED_TOOLS - set(names)
            assert not missing, f"tools missing: {sorted(missing)} (listed: {sorted(names)})"
            for tool in listing.tools:
                for kind, schema in (("input", tool.input_schema), ("output", tool.output_schema)):
                    if schema is None:
                        continue
                    try:
                        Draft202012Validator.check_schema(schema)
                    except SchemaError as error:
                        raise AssertionError(
                            f"{tool.name}'s {kind} schema is not valid JSON Schema: {error.message}\n"
                            f"{json.dumps(schema, indent=1)}"
                        ) from error
                assert tool.input_schema.get("type") == "object", f"{tool.name}: input schema is not an object schema"
                assert tool.description, f"{tool.name} has no description for the model"
            by_name = {tool.name: tool for tool in listing.tools}
            for tool, required in {
                "delegate": {"parent_id", "delegate", "task", "budget"},
                "open_root": {"intent", "budget"},
                "complete": {"contract_id", "claim", "consumed"},
                "accept": {"contract_id"},
            }.items():
                declared = set(by_name[tool].input_schema.get("properties", {}))
                assert required <= declared, f"{tool}'s input schema lacks {sorted(required - declared)}"

            # Each agent's own server: its own key, its key id, its name.
            for agent in agents.values():
                me = await ok(outputs, agent, "whoami", {})
                assert me["public_key"] == agent.public_key, f"{agent.name}: whoami {me}"
                key_id = "ed25519:" + hashlib.sha256(bytes.fromhex(agent.public_key)).hexdigest()[:32]
                assert me["key_id"] == key_id, f"{agent.name}: whoami key_id {me['key_id']!r}, expected {key_id!r}"
                assert me["name"] == agent.name, f"{agent.name}: whoami name {me['name']!r}"

    run(test, agents)
    assert_no_secrets(outputs, agents)


@pytest.mark.parametrize("mode", MODES)
def test_seed_001_chain_over_mcp(broker: Broker, mode: str) -> None:
    agents, names_file = make_agents(broker, ["orchestrator", "planner", "executor"])
    orchestrator, planner, executor = agents["orchestrator"], agents["planner"], agents["executor"]
    outputs = Outputs()
    bad_inputs: list[str] = []

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in agents.values():
                await connect(stack, broker, agent, names_file, mode)

            # The orchestrator opens a root of 100.
            root = await ok(
                outputs,
                orchestrator,
                "open_root",
                {"intent": "fix the token refresh in src/auth", "budget": 100, "labels": {"run": mode}},
            )
            assert_hex_id(root["contract_id"], "open_root's contract_id")
            assert (root["depth"], root["budget"]) == (0, 100), root
            assert root["deadline_ms"] > time.time() * 1000, root
            root_id = root["contract_id"]

            # orchestrator → planner (25), liable, with the predicate, by name.
            to_planner = await ok(
                outputs,
                orchestrator,
                "delegate",
                {
                    "parent_id": root_id,
                    "delegate": "planner",
                    "task": "plan the fix of the token refresh in src/auth",
                    "budget": 25,
                    "liability": "delegate",
                    "predicate": SEED_001_PREDICATE,
                    "escalation_channel": ESCALATION,
                    "min_retry_cost": 12,
                },
            )
            assert_hex_id(to_planner["contract_id"], "the planner's contract_id")
            assert (to_planner["depth"], to_planner["budget"]) == (1, 25), to_planner
            assert to_planner["deadline_ms"] <= root["deadline_ms"], "a child outlives its parent"
            assert isinstance(to_planner["cumulative_trust_ppm"], int), to_planner
            planner_id = to_planner["contract_id"]

            state = await ok(outputs, planner, "get_contract", {"contract_id": planner_id})
            assert state["contract_id"] == planner_id and state["depth"] == 1, state
            assert state["status"] == "OPEN" and state["budget"] == 25, state
            assert state["delegate"] in (planner.public_key, "planner"), f"delegate {state['delegate']!r}"
            assert SEED_001_PREDICATE in state["effective_predicate"], state["effective_predicate"]
            assert ledger_of(state)["reserved"] == 0

            executor_task = "implement the token refresh fix in src/auth/refresh.rs"
            to_executor = {
                "parent_id": planner_id,
                "delegate": "executor",
                "task": executor_task,
                "budget": 20,
                "liability": "delegate",
                "escalation_channel": ESCALATION,
                "min_retry_cost": 12,
            }

            # planner → executor (20): the planner would keep 5 < 12. A tool error.
            refused = await call(outputs, planner, "delegate", to_executor)
            assert refused.is_error, f"delegating 20 of 25 with min_retry_cost 12 was issued: {show(refused)}"
            refusal = refused.structured_content
            assert isinstance(refusal, dict), f"a refusal without structured content: {show(refused)}"
            assert refusal.get("refused") is True, refusal
            assert_hex_id(refusal.get("receipt_id"), "the refusal's receipt_id")
            assert refusal.get("primary") == "NO_RETRY_HEADROOM", refusal
            violations = refusal.get("violations")
            assert isinstance(violations, list) and violations, refusal
            assert [v.get("code") for v in violations] == ["NO_RETRY_HEADROOM"], violations
            assert (violations[0].get("requested"), violations[0].get("allowed")) == ("5", "12"), violations
            assert isinstance(violations[0].get("detail"), str) and violations[0]["detail"], violations
            assert isinstance(refusal.get("hint"), str) and refusal["hint"].strip(), refusal
            # The text a model reads names every code with its requested and allowed values.
            text = text_of(refused)
            for v in violations:
                code, requested, allowed = v["code"], v["requested"], v["allowed"]
                assert code in text, f"the refusal's text does not name {code}: {text!r}"
                after = text[text.index(code) :]
                assert re.search(rf"requested\W{{1,6}}{re.escape(requested)}\b", after, re.I), (
                    f"the refusal's text does not give requested {requested} after {code}: {text!r}"
                )
                assert re.search(rf"allowed\W{{1,6}}{re.escape(allowed)}\b", after, re.I), (
                    f"the refusal's text does not give allowed {allowed} after {code}: {text!r}"
                )
            state = await ok(outputs, planner, "get_contract", {"contract_id": planner_id})
            ledger = ledger_of(state)
            assert (ledger["reserved"], ledger["open_children"], ledger["residual"]) == (0, 0, 25), (
                f"a refusal reserved something: {ledger}"
            )

            # Bad inputs from the model: tool errors naming the field; nothing issued.
            # Each is checked in turn and the chain goes on; what failed is reported at the end.
            for tool, arguments, field_name in [
                ("delegate", {**to_executor, "budget": "ten"}, "budget"),
                ("delegate", {**to_executor, "budget": -13}, "budget"),
                ("delegate", {**to_executor, "delegate": "nobody-by-this-name"}, "delegate"),
                ("delegate", {**to_executor, "parent_id": "zz" * 32}, "parent_id"),
                ("get_contract", {"contract_id": "not-hex"}, "contract_id"),
            ]:
                try:
                    await tool_error(outputs, planner, tool, arguments, field_name)
                except AssertionError as error:
                    bad_inputs.append(str(error).splitlines()[0])
            state = await ok(outputs, planner, "get_contract", {"contract_id": planner_id})
            ledger = ledger_of(state)
            assert (ledger["reserved"], ledger["open_children"], ledger["residual"]) == (0, 0, 25), (
                f"a bad input changed the planner's ledger: {ledger}"
            )

            # The corrected call: 13 leaves the planner 12, its retry cost.
            issued = await ok(outputs, planner, "delegate", {**to_executor, "budget": 13})
            assert_hex_id(issued["contract_id"], "the executor's contract_id")
            assert (issued["depth"], issued["budget"]) == (2, 13), issued
            executor_id = issued["contract_id"]
            state = await ok(outputs, planner, "get_contract", {"contract_id": planner_id})
            ledger = ledger_of(state)
            assert (ledger["residual"], ledger["reserved"], ledger["open_children"]) == (12, 13, 1), ledger

            # The executor's own server (its own key) reads, accepts and completes.
            mine = await ok(outputs, executor, "get_contract", {"contract_id": executor_id})
            assert mine["status"] == "OPEN" and mine["depth"] == 2, mine
            assert mine["task"] == executor_task, mine
            # The planner did not forward the predicate; the broker keeps it.
            assert SEED_001_PREDICATE in mine["effective_predicate"], mine["effective_predicate"]
            assert ledger_of(mine)["residual"] == 13, mine
            assert mine["write_scope"] == [], mine

            # whoami lists it among the executor's open work (ListHeld).
            me = await ok(outputs, executor, "whoami", {})
            held = {c["contract_id"]: c for c in me["held"]}
            assert executor_id in held, f"whoami does not list the issued contract: {me}"
            assert (held[executor_id]["status"], held[executor_id]["task"]) == ("OPEN", executor_task), held
            assert planner_id not in held, f"the executor does not hold the planner's contract: {me}"

            accepted = await ok(outputs, executor, "accept", {"contract_id": executor_id})
            assert (accepted["contract_id"], accepted["status"]) == (executor_id, "ACCEPTED"), accepted
            assert_hex_id(accepted["receipt_id"], "the acceptance's receipt_id")

            completed = await ok(
                outputs,
                executor,
                "complete",
                {"contract_id": executor_id, "output": {}, "claim": "done", "consumed": 4},
            )
            assert (completed["contract_id"], completed["status"]) == (executor_id, "COMPLETED"), completed
            assert_hex_id(completed["receipt_id"], "the completion's receipt_id")
            assert completed["verdict"] == "ACCEPTED", completed
            assert completed["refused_criteria"] == [], completed
            assert (completed["consumed"], completed["returned"]) == (4, 9), completed
            assert completed["within_scope"] is True and completed["schema_valid"] is True, completed

            # The planner sees its ledger settled: 4 spent, nothing reserved.
            state = await ok(outputs, planner, "get_contract", {"contract_id": planner_id})
            ledger = ledger_of(state)
            assert (ledger["spent"], ledger["reserved"], ledger["residual"]) == (4, 0, 21), ledger
            mine = await ok(outputs, executor, "get_contract", {"contract_id": executor_id})
            assert mine["status"] == "COMPLETED", mine
            me = await ok(outputs, executor, "whoami", {})
            assert executor_id not in {c["contract_id"] for c in me["held"]}, f"a completed contract is still held: {me}"

            # The orchestrator's tree: the three contracts, each indented below its parent.
            drawn = await call(outputs, orchestrator, "tree", {"contract_id": root_id})
            assert not drawn.is_error, show(drawn)
            tree_text = text_of(drawn)
            lines = tree_text.splitlines()
            columns = []
            for contract_id in (root_id, planner_id, executor_id):
                short = contract_id[:8]
                found = [(i, line.index(short)) for i, line in enumerate(lines) if short in line]
                assert found, f"the tree does not show {short}:\n{tree_text}"
                columns.append(found[0])
            (root_row, root_col), (planner_row, planner_col), (exec_row, exec_col) = columns
            assert root_row < planner_row < exec_row, f"the tree's order is not root, planner, executor:\n{tree_text}"
            assert root_col < planner_col < exec_col, f"the tree is not indented by depth:\n{tree_text}"

            # The chain verifies locally from the broker's keys, for both ends of it.
            for agent in (executor, orchestrator):
                verified = await ok(outputs, agent, "verify_chain", {"contract_id": executor_id})
                assert verified["verified"] is True, verified
                assert verified["contracts"] == 3, verified
                key_ids = verified["key_ids"]
                assert isinstance(key_ids, list) and key_ids, verified
                assert all(re.fullmatch(r"ed25519:[0-9a-f]{32}", k) for k in key_ids), verified

    run(test, agents)
    assert_no_secrets(outputs, agents)
    assert not bad_inputs, "the chain ran, but bad inputs were not answered as the contract says:\n" + "\n".join(
        bad_inputs
    )


@pytest.mark.parametrize("mode", MODES)
def test_decline_escalate_revoke(broker: Broker, mode: str) -> None:
    agents, names_file = make_agents(broker, ["orchestrator", "planner", "executor", "stranger"])
    orchestrator, planner, executor = agents["orchestrator"], agents["planner"], agents["executor"]
    stranger = agents["stranger"]
    outputs = Outputs()

    async def test() -> None:
        async with AsyncExitStack() as stack:
            for agent in agents.values():
                await connect(stack, broker, agent, names_file, mode)
            root = await ok(outputs, orchestrator, "open_root", {"intent": "tidy the docs/ tree", "budget": 50})
            root_id = root["contract_id"]

            async def child(to: Agent, budget: int) -> str:
                issued = await ok(
                    outputs,
                    orchestrator,
                    "delegate",
                    # By hex key this time, and with a time-to-live of its own.
                    {"parent_id": root_id, "delegate": to.public_key, "task": "tidy docs/", "budget": budget,
                     "ttl_ms": 600_000},
                )
                assert issued["depth"] == 1 and issued["deadline_ms"] <= root["deadline_ms"], issued
                return issued["contract_id"]

            async def ended(who: Agent, tool: str, contract_id: str, status: str) -> None:
                answer = await ok(outputs, who, tool, {"contract_id": contract_id, "reason": f"{tool} in the test"})
                assert answer["contract_id"] == contract_id, answer
                assert_hex_id(answer["receipt_id"], f"{tool}'s receipt_id")
                state = await ok(outputs, who, "get_contract", {"contract_id": contract_id})
                assert state["status"] == status, f"after {tool}, get_contract's status is {state['status']!r}"
                # The status a lifecycle tool answers is the contract's, as get_contract then shows it.
                assert answer["status"] == status, (
                    f"{tool} answered status {answer['status']!r}, get_contract then shows {status!r}: {answer}"
                )

            declined = await child(planner, 10)
            await ended(planner, "decline", declined, "DECLINED")
            # A broker error (the contract has ended) is a tool error too, not a protocol error.
            error = await tool_error(outputs, planner, "accept", {"contract_id": declined})
            assert error["reason"], error

            escalated = await child(executor, 10)
            accepted = await ok(outputs, executor, "accept", {"contract_id": escalated})
            assert accepted["status"] == "ACCEPTED", accepted
            await ended(executor, "escalate", escalated, "UNRESOLVABLE")

            revoked = await child(planner, 10)
            await ended(orchestrator, "revoke", revoked, "REVOKED")
            # A stranger to the tree learns nothing (NOT_FOUND, as for an unknown id): a tool error.
            error = await tool_error(outputs, stranger, "get_contract", {"contract_id": revoked})
            assert error["reason"], error

            # Every reservation came back.
            state = await ok(outputs, orchestrator, "get_contract", {"contract_id": root_id})
            ledger = ledger_of(state)
            assert (ledger["reserved"], ledger["open_children"], ledger["residual"]) == (0, 0, 50), ledger

    run(test, agents)
    assert_no_secrets(outputs, agents)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", *sys.argv[1:]]))


@pytest.mark.parametrize("mode", MODES)
def test_contract_resource_follows_the_contract(broker: Broker, mode: str) -> None:
    """`contract://{id}`: a template, the contract as JSON, and a
    subscription (resources/subscribe before 2026-07-28, subscriptions/listen
    from it) that hears of a delegation below the contract."""
    agents, names_file = make_agents(broker, ["orchestrator", "planner"])
    orchestrator = agents["orchestrator"]
    outputs = Outputs()
    updates: list[str] = []
    heard = anyio.Event()

    async def on_message(message: Any) -> None:  # legacy subscriptions arrive here
        root = getattr(message, "root", message)
        if getattr(root, "method", None) == "notifications/resources/updated":
            updates.append(root.params.uri)
            heard.set()

    async def test() -> None:
        async with AsyncExitStack() as stack:
            client = await connect(stack, broker, orchestrator, names_file, mode, on_message)
            templates = await client.list_resource_templates()
            assert [t.uri_template for t in templates.resource_templates] == ["contract://{contract_id}"], templates
            root = await ok(outputs, orchestrator, "open_root", {"intent": "resources", "budget": 50})
            uri = f"contract://{root['contract_id']}"
            read = await client.read_resource(uri)
            state = json.loads(read.contents[0].text)
            assert (state["contract_id"], state["status"]) == (root["contract_id"], "OPEN"), state
            assert ledger_of(state)["reserved"] == 0, state
            with pytest.raises(MCPError):
                await client.read_resource("contract://not-hex")

            async def delegate_then_read() -> dict[str, Any]:
                nonlocal heard
                # The stored events (the root's issuance) are heard first...
                with anyio.fail_after(20):
                    await heard.wait()
                heard = anyio.Event()
                before = len(updates)
                # ...then the delegation below it, live.
                await ok(
                    outputs,
                    orchestrator,
                    "delegate",
                    {"parent_id": root["contract_id"], "delegate": "planner", "task": "t", "budget": 20, "ttl_ms": 600_000},
                )
                with anyio.fail_after(20):
                    await heard.wait()
                assert len(updates) > before and updates[-1] == uri, updates
                return json.loads((await client.read_resource(uri)).contents[0].text)

            if client.protocol_version >= "2026-07-28":
                async with client.listen(resource_subscriptions=[uri]) as subscription:
                    async def consume() -> None:
                        async for event in subscription:
                            updates.append(getattr(event, "uri", repr(event)))
                            heard.set()

                    async with anyio.create_task_group() as group:
                        group.start_soon(consume)
                        after = await delegate_then_read()
                        group.cancel_scope.cancel()
            else:
                await client.subscribe_resource(uri)
                after = await delegate_then_read()
                await client.unsubscribe_resource(uri)
            assert updates, "no update was heard"
            assert ledger_of(after)["reserved"] == 20, f"the contract read after the update: {after}"

    run(test, agents)


@pytest.mark.parametrize("mode", MODES)
def test_streamable_http_listen(broker: Broker, mode: str) -> None:
    """`mcp tools --listen 127.0.0.1:0`: the address on stdout, the same
    tools over streamable HTTP, whoami answered, in both connect modes."""
    agents, _ = make_agents(broker, ["solo"])
    agent = agents["solo"]
    process = subprocess.Popen(
        [broker.bin, "mcp", "tools", "--key-file", str(agent.key_file), "--addr", broker.addr,
         "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=open(agent.log_path, "wb"), stdin=subprocess.DEVNULL,
        env={**os.environ, "NO_COLOR": "1"},
    )
    try:
        first: list[bytes] = []
        reader = threading.Thread(target=lambda: first.append(process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(30)
        line = first[0].decode().strip() if first else ""
        match = re.fullmatch(r"mcp on (http://127\.0\.0\.1:\d+/mcp)", line)
        assert match, f"`mcp tools --listen` printed {line!r}, not `mcp on http://127.0.0.1:PORT/mcp`"

        async def test() -> None:
            async with Client(match.group(1), mode=mode, read_timeout_seconds=CALL_TIMEOUT_S) as client:
                names = {tool.name for tool in (await client.list_tools()).tools}
                assert EXPECTED_TOOLS <= names, names
                me = await client.call_tool("whoami", {})
                assert not me.is_error and me.structured_content["public_key"] == agent.public_key, me

        run(test, agents)
    finally:
        process.terminate()
        process.wait(15)
