"""End-to-end tests of `delegation-broker a2a-gateway`: the delegation
extension for A2A (proto/delegation/broker/v1/a2a-extension.md), with stock
agents built on the official A2A Python SDK (a2a-sdk 1.3.0, agents/) behind
one gateway each, a real broker (`serve`), the SDK's client on the caller's
side and the repo's Python client (clients/python) for what the test does
and reads at the broker.

The module starts one broker (with a [readers] key, the test's "auditor", so
the test reads every tree), keys for each agent (`keygen`), the agents and
their gateways:

    orchestrator (orchestrator.py)  -> egress /peers/{worker-a, worker-b, worker-c, slow-1, slow-2, worker-i}
    worker-a (good), worker-b (bad), third (good), slow-1, slow-2 (slow), worker-i (input)
    worker-c (call-peer)            -> egress /peers/third

Every A2A message of the tests goes through gateways. Roots are opened by
the test with the orchestrator's key (a root's delegate is the key that
opens it: the test plays the orchestrator's principal); contracts a test
sends straight to a worker are delegated from such a root the same way.

Bindings (acceptance e): every test taking `world` runs once per A2A
binding, `[jsonrpc]` then `[grpc]`, each with a world of its own
(pytest_generate_tests; `@pytest.mark.bindings(...)` narrows a test). In the
gRPC world the agents serve the gRPC binding too (listed in their cards) and
their outbound clients take only a card's GRPC interface, every gateway has
`grpc_listen`, `egress_grpc_listen` and `upstream_binding = "grpc"`, and the
test's own client takes the gateway card's GRPC interface: the test's calls,
the agents' calls to their egress (the peer picked by the interface's
`tenant`) and the gateway->agent hop are all gRPC; gateway->gateway stays
JSON-RPC. The tests check that it was so (the binding each agent logged a
request over, the binding each outcome's client took). Over gRPC an error is
read from the call's google.rpc.Status: the JSON-RPC code's gRPC code
(grpc_code_for), the same ErrorInfo reason, domain and metadata, the
Status's message the call's. The JSON-RPC world has none of the gRPC keys
(its configs are those from before gRPC).

- test_agents_work_directly[binding]: every agent mode against the SDK's
  client with no gateway and no broker (the agents themselves are sound, on
  either binding).
- test_cards: the gateway's card (its own URL, streaming and push off, the
  extension required with the agent's key; over gRPC also its gRPC address,
  never the agent's) and the egress card of a peer (over gRPC with a GRPC
  interface whose tenant is the peer's name); test_egress_unknown_peer: a
  peer missing from the address book (-32001 NOT_FOUND; gRPC NOT_FOUND);
  test_grpc_unserved_methods (gRPC only): ListTasks and
  SendStreamingMessage are UNIMPLEMENTED and reach no agent.
- a. test_fanout_judged_by_broker: the orchestrator fans out to worker-a
  (good) and worker-b (bad) under route terms with a result schema; both
  children depth 1, budgets carved from the root, lineage the root's;
  worker-a COMPLETED/ACCEPTED, worker-b FAILED/REJECTED on schema_valid, in
  the orchestrator's artifact and at the broker (ListChildren, GetChain
  verified offline, completion receipts, the root's ledger).
- b. test_overspending_fanout_refused_at_egress: with 40 of the root's 100
  left, a fan-out asking 60 per peer is refused at the egress,
  BUDGET_EXCEEDS_PARENT (requested 60, allowed 40) in the error text, the
  refusal receipts at the broker, nothing reaching either worker.
  test_depth_limit_refused_at_egress: under a root of max_depth 1, worker-c
  (depth 1) calling the third agent is refused DEPTH_EXCEEDED (requested 2,
  allowed 1) and the third agent receives nothing.
- c. test_bypass_refused: messages straight to worker-a's gateway without
  the extension's metadata or its chain (-32008 INVALID_FIELD), with an
  undecodable chain (UNDECODABLE_MESSAGE), a tampered one (a signature byte,
  a payload byte: BAD_SIGNATURE), a foreign one (another agent's, the
  root's: NOT_DELEGATE), a revoked leaf (ENDED), an expired one or one past its
  deadline but not yet expired (LATE; the broker runs no expiry sweep here),
  replayed after completion, or already bound to a running task (ENDED):
  each refused with the spec's code,
  reason and domain, nothing reaching worker-a; the open contract itself is
  admitted once and judged.
- later (marked `later`): test_input_required_escalates_at_once (the
  escalation is at the broker when the INPUT_REQUIRED answer is back; a
  follow-up is refused ENDED), test_revoke_cancels_upstream_tasks (revoking
  the root cancels both slow workers' tasks and the orchestrator's, and the
  caller's pending SendMessage is answered),
  test_cancel_through_principal_gateway (the orchestrator's CancelTask
  through its egress revokes the child, then reaches the worker),
  test_gateway_restart_mid_task (a worker's gateway SIGKILLed mid-task and
  started again: the contract is still completed and judged).

- streaming (marked `streaming`; a streaming worker, a non-streaming one,
  their gateways and an egress-only caller gateway started beside the world
  by the `streamers` fixture): test_stream_cards (a gateway's card streams
  when its agent's does), test_stream_through_both_gateways (the SDK's
  streaming client through the caller's egress and the worker's ingress:
  each status update and artifact as the worker sends it, the broker's
  verdict in the final event, the agent followed by its stream and not
  polled), test_stream_subscribe_through_both_gateways (SubscribeToTask on
  a running task), test_stream_revoked_mid_stream_ends_canceled (a revoke
  mid-stream ends the stream CANCELED),
  test_ingress_follows_streaming_agents_by_stream_and_polls_the_rest.
  test_agents_work_directly_streaming checks the streaming worker itself,
  with no gateway.

A failing test prints the tail of every process's stderr and agent log.
A2A_TEST_KEEP=1 keeps the temporary directory (configs, keys, logs).
BROKER_BIN names the broker binary (default: <repo>/target/debug/delegation-broker).
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2

from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.transports.grpc import GrpcTransport
from a2a.client.transports.tenant_decorator import TenantTransportDecorator
from a2a.helpers import new_data_part, new_text_part
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import JSON_RPC_ERROR_CODE_MAP, A2AError

REPO_ROOT = Path(__file__).resolve().parents[2]
try:
    from delegation_broker import Agent, BrokerKeys, error_info, now_ms, pb, session_stub, verify_chain, verify_receipt
except ImportError:  # a venv without the client installed: take it from the checkout
    sys.path.insert(0, str(REPO_ROOT / "clients/python/src"))
    from delegation_broker import Agent, BrokerKeys, error_info, now_ms, pb, session_stub, verify_chain, verify_receipt

HERE = Path(__file__).resolve().parent
AGENTS = HERE / "agents"
# The agents run on this interpreter: the test venv's, which has the SDK.
PYTHON = sys.executable

URI = "urn:delegation-broker:a2a:delegation:v1"
DOMAIN = "delegation.broker.v1"
ESCALATION = "broker://escalate"
PREDICATE = "result.schema_valid"
# Draft 2020-12: 42.0 (what a protobuf Value carries) is an integer.
SCHEMA = json.dumps(
    {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["answer"],
        "properties": {"answer": {"type": "integer"}},
    }
)
HEX64 = re.compile(r"[0-9a-f]{64}")

# The A2A bindings the core tests run over (a `world` per binding, see
# pytest_generate_tests): the test's own client, the agents' outbound clients
# and the gateway->agent hop all on it; gateway->gateway stays JSON-RPC.
BINDINGS = ("jsonrpc", "grpc")
# A JSON-RPC error code's gRPC status code, for the gateway's errors over gRPC.
GRPC_CODE_OF_JSONRPC = {
    -32602: "INVALID_ARGUMENT",
    -32008: "FAILED_PRECONDITION",
    -32002: "FAILED_PRECONDITION",
    -32001: "NOT_FOUND",
    -32004: "UNIMPLEMENTED",
    -32003: "UNIMPLEMENTED",
    -32601: "UNIMPLEMENTED",
}


def grpc_code_for(code: int, reason: str) -> str:
    if reason == "UNAVAILABLE":
        return "UNAVAILABLE"
    return GRPC_CODE_OF_JSONRPC.get(code, "INTERNAL")

AGENT_START_S = 120.0  # several Python agents importing the SDK at once on 2 cores
GATEWAY_START_S = 60.0
BROKER_START_S = 60.0
CALL_TIMEOUT_S = 120.0  # one A2A call through gateways
STATE_TIMEOUT_S = 30.0  # a state the broker or an agent must reach
TEST_TIMEOUT_S = 300.0  # one whole test

TERMINAL = {
    TaskState.TASK_STATE_COMPLETED,
    TaskState.TASK_STATE_CANCELED,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_REJECTED,
}
INTERRUPTED = {TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED}

T = TypeVar("T")


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------

# Every process started by this module, for the logs shown when a test fails.
PROCS: list[Proc] = []
AGENT_LOGS: list[Path] = []


class StartError(Exception):
    pass


@dataclass
class Proc:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    stderr_path: Path
    lines: queue.Queue[str | None]
    seen: list[str] = field(default_factory=list)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-chars:]
        except OSError as error:
            return f"<{error}>"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(sig)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
            except ProcessLookupError:
                pass
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the test process dies (Linux),
    so a killed pytest leaves no broker, agent or gateway behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None) -> Proc:
    stderr_path = workdir / f"{name}.stderr"
    with open(stderr_path, "ab") as stderr:
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "NO_COLOR": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=workdir,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # every stdout line, so the process never blocks on a full pipe
        try:
            for raw in popen.stdout:  # type: ignore[union-attr]
                lines.put(raw.decode(errors="replace").rstrip("\r\n"))
        except (OSError, ValueError):
            pass
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name=f"stdout-{name}").start()
    proc = Proc(name, argv, popen, stderr_path, lines)
    PROCS.append(proc)
    return proc


def expect_lines(proc: Proc, patterns: dict[str, re.Pattern[str]], timeout: float) -> dict[str, str]:
    """Reads the process's stdout until every pattern matched a line (its
    group 1 is returned under the pattern's key), it exits or time is up."""
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(patterns):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            line = proc.lines.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            if proc.popen.poll() is not None and proc.lines.empty():
                break
            continue
        if line is None:
            break
        proc.seen.append(line)
        for key, pattern in patterns.items():
            if key not in found and (match := pattern.fullmatch(line.strip())):
                found[key] = match.group(1)
    if len(found) < len(patterns):
        raise StartError(
            f"{proc.name} ({' '.join(proc.argv[:3])} ...) did not print "
            f"{[p.pattern for k, p in patterns.items() if k not in found]} within {timeout:.0f} s "
            f"(exit status {proc.popen.poll()}); stdout so far {proc.seen!r}; stderr:\n{proc.tail()}"
        )
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def broker_bin() -> str:
    path = os.environ.get("BROKER_BIN") or str(REPO_ROOT / "target/debug/delegation-broker")
    if not os.path.isabs(path):
        path = str(Path.cwd() / path) if (Path.cwd() / path).exists() else str(REPO_ROOT / path)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"no broker binary at {path} (set BROKER_BIN)", pytrace=False)
    return path


def wait_for(what: str, check: Callable[[], T | None], timeout: float = STATE_TIMEOUT_S, interval: float = 0.05) -> T:
    """Polls `check` until it returns something truthy, and returns that."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


async def await_for(
    what: str, check: Callable[[], T | None], timeout: float = STATE_TIMEOUT_S, interval: float = 0.05
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)


def run(coro: Awaitable[T], timeout: float = TEST_TIMEOUT_S) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Keys and the broker
# --------------------------------------------------------------------------


@dataclass
class Key:
    name: str
    public_hex: str
    key_file: Path
    signer: Agent

    @property
    def public(self) -> bytes:
        return bytes.fromhex(self.public_hex)


def keygen(binary: str, name: str, home: Path) -> Key:
    key_file = home / f"{name}.key"
    done = subprocess.run([binary, "keygen", "--out", str(key_file)], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    public_hex = done.stdout.decode().strip()
    assert HEX64.fullmatch(public_hex), f"keygen printed {public_hex!r}"
    seed = bytes.fromhex(key_file.read_text().strip())
    signer = Agent.from_seed(seed)
    assert signer.public_key.hex() == public_hex
    return Key(name, public_hex, key_file, signer)


@dataclass
class Root:
    id: bytes
    lineage: bytes
    deadline_ms: int
    budget: int


class BrokerSide:
    """The broker as the test sees it: mutations signed by the keys the test
    holds, reads as the auditor (a [readers] key: it reads every tree)."""

    def __init__(self, addr: str, auditor: Agent):
        target = addr.removeprefix("http://")
        self.addr = addr
        self.channel = grpc.insecure_channel(target)
        self.stub = pb.BrokerStub(self.channel)
        self.read_channel = grpc.insecure_channel(target)
        self.reads = session_stub(self.read_channel, auditor)
        self.keys = BrokerKeys.fetch(self.stub)

    def close(self) -> None:
        self.channel.close()
        self.read_channel.close()

    def open_root(
        self,
        holder: Key,
        *,
        budget: int = 100,
        max_depth: int = 4,
        ttl_ms: int = 600_000,
        predicate: str = PREDICATE,
        intent: str | None = None,
    ) -> Root:
        deadline = now_ms() + ttl_ms
        response = self.stub.OpenRoot(
            holder.signer.open_root(
                intent=intent or f"answer the question ({uuid.uuid4().hex[:8]})",
                budget=budget,
                deadline_ms=deadline,
                policy=pb.Policy(max_depth=max_depth, max_children=16, min_cumulative_trust_ppm=0),
                predicate=predicate,
            ),
            timeout=30,
        )
        verified = verify_chain([response.issued.contract], self.keys, response.issued.contract_id)[-1]
        assert verified.contract.delegate_public_key == holder.public, "a root's delegate is the key that opened it"
        return Root(bytes(response.issued.contract_id), bytes(verified.contract.intent_lineage_hash), deadline, budget)

    def delegate(
        self,
        holder: Key,
        parent: Root | bytes,
        delegate: Key,
        *,
        lineage: bytes | None = None,
        budget: int = 10,
        task: str = "answer the question",
        deadline_ms: int = 0,
        predicate: str = PREDICATE,
        schema: str = SCHEMA,
    ) -> bytes:
        parent_id = parent.id if isinstance(parent, Root) else parent
        if lineage is None:
            assert isinstance(parent, Root)
            lineage = parent.lineage
        response = self.stub.Delegate(
            holder.signer.delegate(
                parent_id=parent_id,
                intent_lineage_hash=lineage,
                task=task,
                delegate_public_key=delegate.public,
                budget=budget,
                deadline_ms=deadline_ms,
                liability=pb.LIABILITY_DELEGATE,
                predicate=predicate,
                escalation_channel=ESCALATION,
                result_schema_json=schema,
            ),
            timeout=30,
        )
        if response.WhichOneof("outcome") != "issued":
            receipt = verify_receipt(response.refused.receipt, self.keys).message
            raise AssertionError(f"the test's own Delegate was refused: {receipt.violations}")
        return bytes(response.issued.contract_id)

    def revoke(self, holder: Key, contract_id: bytes, reason: str = "revoked by the test") -> pb.Receipt:
        response = self.stub.Revoke(holder.signer.revoke(contract_id=contract_id, reason=reason), timeout=30)
        return verify_receipt(response.receipt, self.keys, response.receipt_id).message

    def chain(self, contract_id: bytes) -> pb.GetChainResponse:
        return self.reads.GetChain(pb.GetChainRequest(contract_id=contract_id), timeout=30)

    def chain_b64(self, contract_id: bytes) -> str:
        return base64.b64encode(self.chain(contract_id).SerializeToString()).decode()

    def state(self, contract_id: bytes) -> pb.ContractState:
        return self.reads.GetContract(pb.GetContractRequest(contract_id=contract_id), timeout=30).contract

    def contract(self, contract_id: bytes) -> pb.Contract:
        """The contract's terms, its whole chain verified offline."""
        return verify_chain(self.chain(contract_id), self.keys, contract_id)[-1].contract

    def children(self, contract_id: bytes) -> list[pb.ContractState]:
        out: list[pb.ContractState] = []
        token = b""
        while True:
            page = self.reads.ListChildren(
                pb.ListChildrenRequest(contract_id=contract_id, page_size=100, page_token=token), timeout=30
            )
            out.extend(page.children)
            token = page.next_page_token
            if not token:
                return out

    def receipt(self, receipt_id: bytes | str) -> pb.Receipt:
        rid = bytes.fromhex(receipt_id) if isinstance(receipt_id, str) else receipt_id
        sealed = self.reads.GetReceipt(pb.GetReceiptRequest(receipt_id=rid), timeout=30).receipt
        return verify_receipt(sealed, self.keys, rid).message

    def wait_status(self, contract_id: bytes, *statuses: int, timeout: float = STATE_TIMEOUT_S) -> pb.ContractState:
        names = [pb.ContractStatus.Name(s) for s in statuses]

        def check() -> pb.ContractState | None:
            state = self.state(contract_id)
            return state if state.status in statuses else None

        return wait_for(f"contract {contract_id.hex()[:12]} to be {names}", check, timeout)


def status_name(state: pb.ContractState) -> str:
    return pb.ContractStatus.Name(state.status)


def terms_of(state: pb.ContractState) -> pb.Contract:
    return pb.Contract.FromString(state.contract.payload)


def assert_ledger_balances(state: pb.ContractState, what: str) -> None:
    ledger = state.ledger
    assert ledger.budget == ledger.residual + ledger.reserved + ledger.spent, (
        f"{what}: budget {ledger.budget} != residual {ledger.residual} + reserved {ledger.reserved} + spent {ledger.spent}"
    )


# --------------------------------------------------------------------------
# Agents and gateways
# --------------------------------------------------------------------------

AGENT_LINE = re.compile(r"agent on (http://127\.0\.0\.1:\d+)")
AGENT_GRPC_LINE = re.compile(r"agent grpc on (127\.0\.0\.1:\d+)")
INGRESS_LINE = re.compile(r"a2a ingress on (http://127\.0\.0\.1:\d+)")
EGRESS_LINE = re.compile(r"a2a egress on (http://127\.0\.0\.1:\d+)")
INGRESS_GRPC_LINE = re.compile(r"a2a ingress grpc on (127\.0\.0\.1:\d+)")
EGRESS_GRPC_LINE = re.compile(r"a2a egress grpc on (127\.0\.0\.1:\d+)")


@dataclass
class AgentProc:
    name: str
    proc: Proc
    log_path: Path
    key: Key | None = None
    url: str = ""
    binding: str = "jsonrpc"  # grpc: serves the gRPC binding too, and calls out over gRPC
    grpc: str = ""  # 127.0.0.1:PORT of its gRPC binding

    def entries(self) -> list[dict[str, Any]]:
        try:
            text = self.log_path.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def mark(self) -> int:
        return len(self.entries())

    def since(self, mark: int, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.entries()[mark:] if kind is None or e.get("kind") == kind]

    def sends_since(self, mark: int) -> list[dict[str, Any]]:
        return [
            e
            for e in self.since(mark, "rpc")
            if e.get("method") in ("SendMessage", "SendStreamingMessage", "message/send", "message/stream")
        ]

    def executions(self, context_id: str | None = None, since: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.since(since, "execute") if context_id is None or e.get("contextId") == context_id]

    def cancels(self, task_id: str) -> list[dict[str, Any]]:
        return [e for e in self.entries() if e.get("kind") == "cancel" and e.get("taskId") == task_id]


def start_agent(
    workdir: Path, name: str, script: str, args: list[str], key: Key | None = None, binding: str = "jsonrpc"
) -> AgentProc:
    """An agent; with binding grpc it serves the gRPC binding too (listed in
    its card) and its outbound client takes only the GRPC interface of a card."""
    log_path = workdir / f"{name}.agent.jsonl"
    AGENT_LOGS.append(log_path)
    extra = ["--grpc-port", "0", "--outbound-binding", "grpc"] if binding == "grpc" else []
    proc = spawn(
        f"agent-{name}",
        [PYTHON, str(AGENTS / script), "--port", "0", "--name", name, "--log", str(log_path), *extra, *args],
        workdir,
    )
    return AgentProc(name, proc, log_path, key, binding=binding)


def await_agent(agent: AgentProc) -> AgentProc:
    patterns = {"url": AGENT_LINE}
    if agent.binding == "grpc":
        patterns["grpc"] = AGENT_GRPC_LINE
    found = expect_lines(agent.proc, patterns, AGENT_START_S)
    agent.url = found["url"]
    agent.grpc = found.get("grpc", "")
    return agent


def toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


@dataclass
class Peer:
    name: str
    key: Key
    url: str  # the peer's gateway ingress


@dataclass
class Gateway:
    name: str
    proc: Proc
    config_path: Path
    binding: str = "jsonrpc"  # grpc: serves the gRPC binding on both sides and calls its agent over gRPC
    ingress: str = ""
    egress: str = ""
    grpc: str = ""  # 127.0.0.1:PORT, the ingress's gRPC binding
    egress_grpc: str = ""  # 127.0.0.1:PORT, the egress's gRPC binding

    def port(self, which: str) -> int:
        address = {"ingress": self.ingress, "egress": self.egress, "grpc": self.grpc, "egress_grpc": self.egress_grpc}
        return int(address[which].rsplit(":", 1)[1])


def gateway_config(
    path: Path,
    *,
    broker: str,
    key: Key,
    upstream: str,
    listen: str = "127.0.0.1:0",
    egress_listen: str = "127.0.0.1:0",
    peers: list[Peer] = (),  # type: ignore[assignment]
    routes: dict[str, dict[str, Any]] | None = None,
    poll_ms: int = 100,
    binding: str = "jsonrpc",
    grpc_listen: str = "127.0.0.1:0",
    egress_grpc_listen: str = "127.0.0.1:0",
) -> Path:
    """A gateway's TOML. With binding grpc it serves the gRPC binding on its
    ingress (`grpc_listen`) and egress (`egress_grpc_listen`) and calls its
    agent on the GRPC interface of the agent's card (`upstream_binding`);
    with jsonrpc none of these keys is written (the config as before gRPC)."""
    lines = [
        f"broker = {toml_str(broker)}",
        f"key_file = {toml_str(str(key.key_file))}",
        f"upstream = {toml_str(upstream)}",
        f"listen = {toml_str(listen)}",
        f"egress_listen = {toml_str(egress_listen)}",
        f"poll_ms = {poll_ms}",
    ]
    if binding == "grpc":
        lines += [
            f"grpc_listen = {toml_str(grpc_listen)}",
            f"egress_grpc_listen = {toml_str(egress_grpc_listen)}",
            'upstream_binding = "grpc"',
        ]
    lines.append("")
    for peer in peers:
        lines += [
            "[[peers]]",
            f"name = {toml_str(peer.name)}",
            f"public_key = {toml_str(peer.key.public_hex)}",
            f"url = {toml_str(peer.url)}",
            "",
        ]
    for name, route in (routes or {}).items():
        lines.append(f"[routes.{toml_str(name)}]")
        for k, v in route.items():
            lines.append(f"{k} = {toml_str(v) if isinstance(v, str) else json.dumps(v)}")
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def start_gateway(
    binary: str, workdir: Path, name: str, config_path: Path, tag: str = "", binding: str = "jsonrpc"
) -> Gateway:
    proc = spawn(
        f"gateway-{name}{tag}",
        [binary, "a2a-gateway", "--config", str(config_path)],
        workdir,
        env={"BROKER_LOG": os.environ.get("BROKER_LOG", "info,delegation_broker=debug"),
             "RUST_LOG": os.environ.get("RUST_LOG", "info")},
    )
    return Gateway(name, proc, config_path, binding)


def await_gateway(gateway: Gateway) -> Gateway:
    patterns = {"ingress": INGRESS_LINE, "egress": EGRESS_LINE}
    if gateway.binding == "grpc":
        patterns |= {"grpc": INGRESS_GRPC_LINE, "egress_grpc": EGRESS_GRPC_LINE}
    found = expect_lines(gateway.proc, patterns, GATEWAY_START_S)
    gateway.ingress, gateway.egress = found["ingress"], found["egress"]
    gateway.grpc, gateway.egress_grpc = found.get("grpc", ""), found.get("egress_grpc", "")
    return gateway


# --------------------------------------------------------------------------
# The world: broker, keys, agents, gateways
# --------------------------------------------------------------------------

WORKER_ROUTE = {"budget": 30, "ttl_ms": 60_000, "predicate": PREDICATE, "result_schema_json": SCHEMA}
PLAIN_ROUTE = {"budget": 30, "ttl_ms": 60_000, "predicate": PREDICATE}
SMALL_ROUTE = {"budget": 20, "ttl_ms": 120_000, "predicate": PREDICATE}
THIRD_ROUTE = {"budget": 10, "ttl_ms": 60_000, "predicate": PREDICATE, "result_schema_json": SCHEMA}

ORCHESTRATOR_PEERS = ["worker-a", "worker-b", "worker-c", "slow-1", "slow-2", "worker-i"]


@dataclass
class World:
    binary: str
    workdir: Path
    broker_proc: Proc
    broker_addr: str
    broker: BrokerSide
    keys: dict[str, Key]
    agents: dict[str, AgentProc]
    gateways: dict[str, Gateway]
    binding: str = "jsonrpc"
    first_proc: int = 0  # PROCS[first_proc:] and AGENT_LOGS[first_log:] are this world's
    first_log: int = 0

    @property
    def sdk_binding(self) -> str:
        """The binding's name in a card and in an outcome's `binding`."""
        return self.binding.upper()

    def user(self, timeout: float = CALL_TIMEOUT_S) -> A2AUser:
        """The test's own A2A client, on this world's binding."""
        return A2AUser(binding=self.binding, timeout=timeout)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking `world` runs once per binding (a module-scoped world per
    binding: pytest runs all of one world's tests, tears it down, then starts
    the other); `@pytest.mark.bindings("jsonrpc")` narrows that. A test
    taking `binding` (and no world) gets it the same way."""
    marker = metafunc.definition.get_closest_marker("bindings")
    bindings = list(marker.args) if marker else list(BINDINGS)
    if "world" in metafunc.fixturenames:
        metafunc.parametrize("world", bindings, indirect=True, scope="module", ids=bindings)
    elif "binding" in metafunc.fixturenames:
        metafunc.parametrize("binding", bindings, ids=bindings)


def start_broker(binary: str, workdir: Path, reader: Key) -> tuple[Proc, str]:
    data_dir = workdir / "broker-data"
    data_dir.mkdir()
    config = workdir / "broker.toml"
    # No background expiry sweep: a contract past its deadline stays OPEN
    # until a lifecycle call expires it, so a test can hold one of each.
    config.write_text(
        f'[readers]\nkeys = ["{reader.public_hex}"]\n\n[limits]\nexpiry_sweep_interval_ms = 3600000\n'
    )
    proc = spawn(
        "broker",
        [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), "--config", str(config)],
        workdir,
    )
    addr = expect_lines(proc, {"addr": re.compile(r"listening on (127\.0\.0\.1:\d+)")}, BROKER_START_S)["addr"]
    return proc, f"http://{addr}"


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest) -> Any:
    binding = getattr(request, "param", "jsonrpc")
    binary = broker_bin()
    workdir = Path(tempfile.mkdtemp(prefix=f"a2a-gateway-test-{binding}-"))
    first_proc, first_log = len(PROCS), len(AGENT_LOGS)
    started: list[Proc] = []
    broker_side: BrokerSide | None = None
    try:
        names = ["auditor", "orchestrator", "worker-a", "worker-b", "worker-c", "third", "slow-1", "slow-2", "worker-i"]
        keys = {name: keygen(binary, name, workdir) for name in names}
        broker_proc, broker_addr = start_broker(binary, workdir, keys["auditor"])
        started.append(broker_proc)
        broker_side = BrokerSide(broker_addr, keys["auditor"].signer)

        # The agents that call out are told their gateway's egress before it
        # exists (the gateway needs the agent's URL first): a port picked now.
        orchestrator_egress = free_port()
        worker_c_egress = free_port()
        # (The outbound clients resolve the egress's card over HTTP; with
        # binding grpc they then take its GRPC interface.)
        agents = {
            "orchestrator": start_agent(
                workdir,
                "orchestrator",
                "orchestrator.py",
                ["--outbound-base", f"http://127.0.0.1:{orchestrator_egress}", "--peers", "worker-a,worker-b"],
                binding=binding,
            ),
            "worker-a": start_agent(workdir, "worker-a", "worker.py", ["--mode", "good"], binding=binding),
            "worker-b": start_agent(workdir, "worker-b", "worker.py", ["--mode", "bad"], binding=binding),
            "worker-c": start_agent(
                workdir,
                "worker-c",
                "worker.py",
                ["--mode", "call-peer", "--outbound", f"http://127.0.0.1:{worker_c_egress}/peers/third"],
                binding=binding,
            ),
            "third": start_agent(workdir, "third", "worker.py", ["--mode", "good"], binding=binding),
            "slow-1": start_agent(workdir, "slow-1", "worker.py", ["--mode", "slow"], binding=binding),
            "slow-2": start_agent(workdir, "slow-2", "worker.py", ["--mode", "slow"], binding=binding),
            "worker-i": start_agent(workdir, "worker-i", "worker.py", ["--mode", "input"], binding=binding),
        }
        for name, agent in agents.items():
            agent.key = keys[name]
            started.append(agent.proc)
        for agent in agents.values():
            await_agent(agent)

        def config(name: str, **kwargs: Any) -> Path:
            return gateway_config(
                workdir / f"{name}.gateway.toml",
                broker=broker_addr,
                key=keys[name],
                upstream=agents[name].url,
                binding=binding,
                **kwargs,
            )

        gateways: dict[str, Gateway] = {}
        leaves = ["worker-a", "worker-b", "third", "slow-1", "slow-2", "worker-i"]
        for name in leaves:
            gateways[name] = start_gateway(binary, workdir, name, config(name), binding=binding)
            started.append(gateways[name].proc)
        for name in leaves:
            await_gateway(gateways[name])

        gateways["worker-c"] = start_gateway(
            binary,
            workdir,
            "worker-c",
            config(
                "worker-c",
                egress_listen=f"127.0.0.1:{worker_c_egress}",
                peers=[Peer("third", keys["third"], gateways["third"].ingress)],
                routes={"third": THIRD_ROUTE},
            ),
            binding=binding,
        )
        started.append(gateways["worker-c"].proc)
        await_gateway(gateways["worker-c"])

        routes = {
            "worker-a": WORKER_ROUTE,
            "worker-b": WORKER_ROUTE,
            "worker-c": PLAIN_ROUTE,
            "slow-1": SMALL_ROUTE,
            "slow-2": SMALL_ROUTE,
            "worker-i": SMALL_ROUTE,
        }
        gateways["orchestrator"] = start_gateway(
            binary,
            workdir,
            "orchestrator",
            config(
                "orchestrator",
                egress_listen=f"127.0.0.1:{orchestrator_egress}",
                peers=[Peer(n, keys[n], gateways[n].ingress) for n in ORCHESTRATOR_PEERS],
                routes=routes,
            ),
            binding=binding,
        )
        started.append(gateways["orchestrator"].proc)
        await_gateway(gateways["orchestrator"])
        assert gateways["orchestrator"].port("egress") == orchestrator_egress
        assert gateways["worker-c"].port("egress") == worker_c_egress
    except BaseException as error:
        for proc in reversed(started):
            proc.stop()
        if broker_side is not None:
            broker_side.close()
        shutil.rmtree(workdir, ignore_errors=True)
        if isinstance(error, StartError):
            pytest.fail(str(error), pytrace=False)
        raise

    yield World(
        binary, workdir, broker_proc, broker_addr, broker_side, keys, agents, gateways, binding, first_proc, first_log
    )

    for proc in reversed(started):
        proc.stop()
    broker_side.close()
    if os.environ.get("A2A_TEST_KEEP"):
        print(f"kept {workdir} (A2A_TEST_KEEP)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(autouse=True)
def show_logs_on_failure(request: pytest.FixtureRequest) -> Any:
    """On a failure: the processes of the test's world (and those the test
    started itself), not those of a world torn down before."""
    first_proc, first_log = len(PROCS), len(AGENT_LOGS)
    yield
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed:
        return
    world = request.node.funcargs.get("world") if hasattr(request.node, "funcargs") else None
    if isinstance(world, World):
        first_proc, first_log = min(first_proc, world.first_proc), min(first_log, world.first_log)
    for proc in PROCS[first_proc:]:
        print(f"\n===== {proc.name} (exit {proc.popen.poll()}) stderr tail =====\n{proc.tail(2500)}")
    for path in AGENT_LOGS[first_log:]:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        print(f"\n===== {path.name} (last lines) =====\n" + "\n".join(text.splitlines()[-15:]))


# --------------------------------------------------------------------------
# The test as an A2A client
# --------------------------------------------------------------------------


class Refusal(Exception):
    """An A2A error answered by a gateway, as it was on the wire: a JSON-RPC
    error (`code`, its `data`'s ErrorInfo), or a gRPC status (`grpc_code`,
    the google.rpc.Status in its trailers and that Status's ErrorInfo)."""

    def __init__(self, raw: dict[str, Any], sdk_error: BaseException):
        self.binding = "jsonrpc"
        self.raw = raw
        self.sdk_error = sdk_error
        self.code = raw.get("code")
        self.grpc_code: str | None = None
        self.status: status_pb2.Status | None = None
        self.problems: list[str] = []  # what is wrong with the gRPC status itself
        self.message = str(raw.get("message", ""))
        info = next(
            (d for d in raw.get("data") or [] if isinstance(d, dict) and str(d.get("@type", "")).endswith("ErrorInfo")),
            {},
        )
        self.reason = info.get("reason")
        self.domain = info.get("domain")
        self.metadata = info.get("metadata") or {}
        super().__init__(f"JSON-RPC error {self.code} {self.reason}: {self.message}")

    @classmethod
    def from_grpc(cls, rpc_error: Any, sdk_error: BaseException) -> Refusal:
        """From a gRPC error (grpc.aio.AioRpcError or a sync call's RpcError):
        its status code and details, and the google.rpc.Status of its
        `grpc-status-details-bin` trailer, whose ErrorInfo of the extension's
        domain (else the first ErrorInfo) gives reason, domain and metadata."""
        refusal = cls.__new__(cls)
        refusal.binding = "grpc"
        refusal.sdk_error = sdk_error
        refusal.code = None
        refusal.grpc_code = rpc_error.code().name
        details = rpc_error.details() or ""
        refusal.problems = []
        refusal.status = grpc_status_of(rpc_error)
        infos = error_infos(refusal.status)
        info = next((i for i in infos if i.domain == DOMAIN), infos[0] if infos else None)
        refusal.message = refusal.status.message if refusal.status is not None else details
        refusal.reason = info.reason if info is not None else None
        refusal.domain = info.domain if info is not None else None
        refusal.metadata = dict(info.metadata) if info is not None else {}
        if refusal.status is None:
            refusal.problems.append("no google.rpc.Status in the trailers (grpc-status-details-bin)")
        else:
            if refusal.status.code != rpc_error.code().value[0]:
                refusal.problems.append(
                    f"the Status's code {refusal.status.code} is not the call's {refusal.grpc_code}"
                )
            if refusal.status.message != details:
                refusal.problems.append(
                    f"the Status's message {refusal.status.message!r} is not the call's {details!r}"
                )
        refusal.raw = {
            "grpcCode": refusal.grpc_code,
            "details": details,
            "status": json_format.MessageToDict(refusal.status) if refusal.status is not None else None,
        }
        Exception.__init__(refusal, f"gRPC error {refusal.grpc_code} {refusal.reason}: {refusal.message}")
        return refusal


def grpc_status_of(rpc_error: Any) -> status_pb2.Status | None:
    try:
        trailers = rpc_error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001
        return None
    for key, value in trailers:
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    return None


def error_infos(status: status_pb2.Status | None) -> list[error_details_pb2.ErrorInfo]:
    out = []
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            out.append(info)
    return out


def find_rpc_error(error: BaseException | None) -> Any:
    """The gRPC error an SDK error was raised from (its __cause__/__context__ chain)."""
    for _ in range(10):
        if error is None:
            return None
        if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
            return error
        error = error.__cause__ or error.__context__
    return None


def client_binding(client: Any) -> tuple[str, str | None]:
    """The binding an SDK client took (its transport) and the tenant it sends."""
    transport = getattr(client, "_transport", None)
    tenant = None
    if isinstance(transport, TenantTransportDecorator):
        tenant, transport = transport._tenant, transport._base
    if isinstance(transport, GrpcTransport):
        return "GRPC", tenant
    name = type(transport).__name__
    return ("JSONRPC" if "JsonRpc" in name else name), tenant


class A2AUser:
    """The SDK's client. With binding jsonrpc (the SDK's default, JSON-RPC
    only) it keeps every raw JSON-RPC answer (an httpx response hook), since
    the SDK keeps an error's message and ErrorInfo metadata but not its
    reason. With binding grpc the client supports GRPC only (the card is
    still read over HTTP from the URL given, then its GRPC interface is
    called on a grpc.aio channel), and an error is read from the gRPC status
    itself: the SDK maps only ErrorInfo of domain a2a-protocol.org."""

    def __init__(self, *, binding: str = "jsonrpc", timeout: float = CALL_TIMEOUT_S):
        assert binding in BINDINGS, binding
        self.binding = binding
        self.timeout = timeout
        self.raw: list[Any] = []
        self.http: httpx.AsyncClient | None = None
        self.clients: dict[str, Any] = {}
        self.channels: list[grpc.aio.Channel] = []

    async def __aenter__(self) -> A2AUser:
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout), event_hooks={"response": [self._hook]})
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.http is not None
        await self.http.aclose()
        for channel in self.channels:
            await channel.close()

    async def _hook(self, response: httpx.Response) -> None:
        if response.request.method != "POST":
            return
        if "text/event-stream" in response.headers.get("content-type", ""):
            # A stream (SSE) is read by the SDK as it comes: reading it here
            # would hold every event until the stream ends. A refusal before
            # the stream is a JSON body, kept below.
            return
        await response.aread()
        try:
            self.raw.append(response.json())
        except ValueError:
            self.raw.append({"status": response.status_code, "body": response.text[:500]})

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(target)
        self.channels.append(channel)
        return channel

    def _context(self) -> ClientCallContext | None:
        # A gRPC call has no deadline unless given one; JSON-RPC has the httpx timeout.
        return ClientCallContext(timeout=self.timeout) if self.binding == "grpc" else None

    async def client(self, base_url: str, *, streaming: bool = False) -> Any:
        """The SDK's client for the agent at `base_url` (its card read
        there). With `streaming` the client streams (ClientConfig.streaming):
        its send_message is SendStreamingMessage when the card says the agent
        streams, and it can subscribe; else it sends SendMessage."""
        key = (base_url, streaming)
        if key not in self.clients:
            if self.binding == "grpc":
                config = ClientConfig(
                    httpx_client=self.http,
                    streaming=streaming,
                    supported_protocol_bindings=["GRPC"],
                    use_client_preference=True,
                    grpc_channel_factory=self._channel,
                )
            else:
                config = ClientConfig(httpx_client=self.http, streaming=streaming)
            client = await ClientFactory(config).create_from_url(base_url)
            taken, _ = client_binding(client)
            assert taken == self.binding.upper(), f"the SDK's client for {base_url} took {taken}, not {self.binding}"
            self.clients[key] = client
        return self.clients[key]

    def _refusal(self, error: BaseException, first: int) -> Refusal:
        if self.binding == "grpc":
            rpc_error = find_rpc_error(error)
            if rpc_error is None:
                raise AssertionError(f"the SDK raised {error!r}, not from a gRPC error") from error
            return Refusal.from_grpc(rpc_error, error)
        errors = [r["error"] for r in self.raw[first:] if isinstance(r, dict) and isinstance(r.get("error"), dict)]
        if not errors:
            raise AssertionError(f"the SDK raised {error!r}, but no JSON-RPC error came back: {self.raw[first:]!r}")
        return Refusal(errors[-1], error)

    def _caught(self) -> tuple[type[BaseException], ...]:
        # Over gRPC the SDK may raise other than A2AError on a malformed status
        # (its status_from_call raises ValueError): caught and read here too.
        return (A2AError,) if self.binding == "jsonrpc" else (A2AError, ValueError, grpc.RpcError)

    async def send(self, base_url: str, message: Message, *, return_immediately: bool = False) -> Task:
        client = await self.client(base_url)
        first = len(self.raw)
        request = SendMessageRequest(message=message)
        if return_immediately:
            request.configuration.CopyFrom(SendMessageConfiguration(return_immediately=True))
        try:
            async for response in client.send_message(request, context=self._context()):
                if response.HasField("task"):
                    return response.task
                raise AssertionError(f"{base_url} answered a message, not a task: {response}")
        except self._caught() as error:
            raise self._refusal(error, first) from error
        raise AssertionError(f"{base_url} answered nothing")

    async def get_task(self, base_url: str, task_id: str) -> Task:
        client = await self.client(base_url)
        first = len(self.raw)
        try:
            return await client.get_task(GetTaskRequest(id=task_id), context=self._context())
        except self._caught() as error:
            raise self._refusal(error, first) from error

    async def cancel_task(self, base_url: str, task_id: str) -> Task:
        client = await self.client(base_url)
        first = len(self.raw)
        try:
            return await client.cancel_task(CancelTaskRequest(id=task_id), context=self._context())
        except self._caught() as error:
            raise self._refusal(error, first) from error

    async def stream(
        self,
        base_url: str,
        message: Message,
        on_event: Callable[[StreamResponse], None] | None = None,
    ) -> list[StreamResponse]:
        """SendStreamingMessage with the SDK's streaming client (the card
        must say the agent streams: else the SDK sends SendMessage and yields
        its one answer): every event, in the order they came. `on_event` is
        called as each one comes, before the next is read. A refusal, before
        or during the stream, raises a Refusal."""
        client = await self.client(base_url, streaming=True)
        return await self._consume(
            lambda: client.send_message(SendMessageRequest(message=message), context=self._context()), on_event
        )

    async def subscribe(
        self, base_url: str, task_id: str, on_event: Callable[[StreamResponse], None] | None = None
    ) -> list[StreamResponse]:
        """SubscribeToTask with the SDK's streaming client: every event, in order."""
        client = await self.client(base_url, streaming=True)
        return await self._consume(
            lambda: client.subscribe(SubscribeToTaskRequest(id=task_id), context=self._context()), on_event
        )

    async def _consume(
        self, open_stream: Callable[[], Any], on_event: Callable[[StreamResponse], None] | None
    ) -> list[StreamResponse]:
        """Every event of the stream `open_stream` opens, `on_event` called
        as each comes; a refusal, before or during it, raises a Refusal."""
        first = len(self.raw)
        events: list[StreamResponse] = []
        try:
            async for event in open_stream():
                events.append(event)
                if on_event is not None:
                    on_event(event)
        except self._caught() as error:
            raise self._stream_refusal(error, first, events) from error
        return events

    def _stream_refusal(self, error: BaseException, first: int, events: list[StreamResponse]) -> BaseException:
        """A stream's error: a Refusal when the gateway answered one (a JSON
        body over JSON-RPC, a status over gRPC), else an AssertionError
        saying how far the stream got."""
        try:
            return self._refusal(error, first)
        except AssertionError:
            return AssertionError(
                f"the stream failed after {len(events)} events ({[event_kind(e) for e in events]}): {error!r}"
            )

    async def follow(
        self, base_url: str, task_id: str, done: Callable[[Task], bool], timeout: float = CALL_TIMEOUT_S
    ) -> Task:
        deadline = time.monotonic() + timeout
        while True:
            task = await self.get_task(base_url, task_id)
            if done(task):
                return task
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"task {task_id} still {TaskState.Name(task.status.state)} after {timeout:.0f} s: "
                    f"{json_format.MessageToJson(task)}"
                )
            await asyncio.sleep(0.1)


def task_message(
    text: str,
    *,
    context_id: str | None = None,
    chain: str | None = None,
    data: Any = None,
    task_id: str | None = None,
    ext: dict[str, Any] | None = None,
) -> Message:
    message = Message(
        role=Role.ROLE_USER,
        message_id=str(uuid.uuid4()),
        context_id=context_id or str(uuid.uuid4()),
        parts=[new_text_part(text)] + ([new_data_part(data)] if data is not None else []),
    )
    if task_id:
        message.task_id = task_id
    metadata = dict(ext or {})
    if chain is not None:
        metadata["chain"] = chain
    if metadata:
        message.metadata.update({URI: metadata})
        message.extensions.append(URI)
    return message


def ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [ints(v) for v in value]
    return value


def ext_of(task: Task) -> dict[str, Any]:
    metadata = json_format.MessageToDict(task.metadata) if task.HasField("metadata") else {}
    ext = metadata.get(URI)
    return ints(ext) if isinstance(ext, dict) else {}


def output_of(task: Task) -> Any:
    assert len(task.artifacts) == 1 and len(task.artifacts[0].parts) == 1, (
        f"expected one artifact of one part: {json_format.MessageToJson(task)}"
    )
    part = task.artifacts[0].parts[0]
    assert part.HasField("data"), f"expected a data part: {part}"
    return ints(json_format.MessageToDict(part.data))


def state_of(task: Task) -> str:
    return TaskState.Name(task.status.state)


def show(task: Task) -> str:
    return json_format.MessageToJson(task)


# --------------------------------------------------------------------------
# Stream events (StreamResponse: task, message, statusUpdate, artifactUpdate)
# --------------------------------------------------------------------------


def event_kind(event: StreamResponse) -> str:
    return event.WhichOneof("payload") or "nothing"


def event_state(event: StreamResponse) -> str | None:
    """The task state a Task or status-update event carries (None for others)."""
    if event.HasField("task"):
        return TaskState.Name(event.task.status.state)
    if event.HasField("status_update"):
        return TaskState.Name(event.status_update.status.state)
    return None


def event_ext(event: StreamResponse) -> dict[str, Any]:
    """The extension's object in an event's metadata: a Task's
    `metadata[URI]`, or a status or artifact update's own `metadata[URI]`."""
    if event.HasField("task"):
        return ext_of(event.task)
    for field_name in ("status_update", "artifact_update", "message"):
        if event.HasField(field_name):
            inner = getattr(event, field_name)
            metadata = json_format.MessageToDict(inner.metadata) if inner.HasField("metadata") else {}
            ext = metadata.get(URI)
            return ints(ext) if isinstance(ext, dict) else {}
    return {}


def event_text(event: StreamResponse) -> str:
    """The text of a status update's (or a Task's status) message."""
    status = None
    if event.HasField("status_update"):
        status = event.status_update.status
    elif event.HasField("task"):
        status = event.task.status
    if status is None or not status.HasField("message"):
        return ""
    return "\n".join(part.text for part in status.message.parts if part.HasField("text"))


def event_data(event: StreamResponse) -> Any:
    """An artifact update's first data part (None for other events)."""
    if not event.HasField("artifact_update"):
        return None
    for part in event.artifact_update.artifact.parts:
        if part.HasField("data"):
            return ints(json_format.MessageToDict(part.data))
    return None


def event_task_id(event: StreamResponse) -> str:
    if event.HasField("task"):
        return event.task.id
    for field_name in ("status_update", "artifact_update"):
        if event.HasField(field_name):
            return getattr(event, field_name).task_id
    return event.message.task_id if event.HasField("message") else ""


STEP_TEXT = re.compile(r"step (\d+) of (\d+)")


def step_of(event: StreamResponse) -> int | None:
    """The step a streaming worker's WORKING status update announces."""
    if not event.HasField("status_update"):
        return None
    match = STEP_TEXT.fullmatch(event_text(event))
    return int(match.group(1)) if match else None


def show_events(events: list[StreamResponse]) -> str:
    return "\n".join(json.dumps(json_format.MessageToDict(e), sort_keys=True)[:400] for e in events)


STREAMING_METHODS = ("SendStreamingMessage", "SubscribeToTask")


@dataclass
class Seen:
    """One stream event as the test's client got it, with how far the
    streaming worker was when it came (its log, read at that moment): the
    steps it had logged for the task's context, and whether it had logged
    the end of its task. The order of these, not a clock, says whether the
    event came while the task ran."""

    event: StreamResponse
    steps_logged: int
    finished: bool


def recorder(agent: AgentProc, context_id: str, seen: list[Seen]) -> Callable[[StreamResponse], None]:
    """An `on_event` for A2AUser.stream/subscribe: keeps each event with the
    worker's progress on context `context_id` when it came."""

    def on_event(event: StreamResponse) -> None:
        entries = [e for e in agent.entries() if e.get("contextId") == context_id]
        seen.append(
            Seen(
                event,
                sum(1 for e in entries if e.get("kind") == "step"),
                any(e.get("kind") == "finished" for e in entries),
            )
        )

    return on_event


def assert_streamed_as_sent(seen: list[Seen], steps: int, final: Any, why: str) -> None:
    """The worker's events came one by one as it sent them: its N step
    status updates (WORKING, "step I of N") in order, each followed by its
    partial artifact ({"partial": I, "of": N}) before the next step, then the
    final artifact (`final`) and a terminal event last; the first step came
    before the worker had logged all its steps, and at least two before it
    logged its end (arrival order against the worker's own log, no clock).
    Other events (a Task snapshot, WORKING without a step) may come between."""
    events = [s.event for s in seen]
    shown = f"{why}:\n{show_events(events)}"
    step_at = [(i, step_of(e)) for i, e in enumerate(events) if step_of(e) is not None]
    assert [step for _, step in step_at] == list(range(1, steps + 1)), f"step updates, in order: {shown}"
    artifacts = [(i, event_data(e)) for i, e in enumerate(events) if e.HasField("artifact_update")]
    expected = [{"partial": step, "of": steps} for step in range(1, steps + 1)] + [final]
    assert [data for _, data in artifacts] == expected, f"artifact updates, in order: {shown}"
    for n, (at, _) in enumerate(step_at):
        partial_at = artifacts[n][0]
        next_at = step_at[n + 1][0] if n + 1 < len(step_at) else len(events)
        assert at < partial_at < next_at, f"step {n + 1}'s artifact between its update and the next: {shown}"
    assert artifacts[-1][0] < len(events) - 1, f"the final artifact before the final event: {shown}"
    last = events[-1]
    assert event_state(last) in {TaskState.Name(s) for s in TERMINAL}, f"a terminal event last: {shown}"
    assert all(event_state(e) not in {TaskState.Name(s) for s in TERMINAL} for e in events[:-1]), (
        f"nothing after the terminal event: {shown}"
    )
    first_step = seen[step_at[0][0]]
    assert first_step.steps_logged < steps and not first_step.finished, (
        f"{why}: the first step came only when the worker had logged {first_step.steps_logged} of {steps} "
        f"steps (finished: {first_step.finished}): not as it was sent"
    )
    early = [seen[at] for at, _ in step_at if not seen[at].finished]
    assert len(early) >= 2, f"{why}: only {len(early)} step updates came before the worker logged its end"


async def settle(pending: asyncio.Task[Any], timeout: float = STATE_TIMEOUT_S) -> None:
    """Lets a background call end (bounded), else cancels it; its outcome is dropped."""
    if not pending.done():
        try:
            await asyncio.wait_for(asyncio.shield(pending), timeout)
        except BaseException:  # noqa: BLE001
            pending.cancel()
    try:
        await pending
    except BaseException:  # noqa: BLE001 -- whatever the call ended with
        pass


async def expect_refused(
    user: A2AUser, base_url: str, message: Message, *, code: int, reason: str, why: str
) -> Refusal:
    """The message is refused with the JSON-RPC `code` and ErrorInfo `reason`
    of the extension's domain; over gRPC, with the gRPC code the gateway maps
    `code` to (grpc_code_for), the reason and domain in the Status's ErrorInfo,
    the Status's message the call's."""
    try:
        task = await user.send(base_url, message)
    except Refusal as refusal:
        if refusal.binding == "grpc":
            want = grpc_code_for(code, reason)
            if (refusal.grpc_code, refusal.reason) != (want, reason):
                raise AssertionError(
                    f"{why}: expected gRPC {want} {reason} (JSON-RPC {code}), got {refusal.grpc_code} "
                    f"{refusal.reason}: {refusal.raw}"
                ) from None
            if refusal.problems:
                raise AssertionError(f"{why}: {'; '.join(refusal.problems)}: {refusal.raw}") from None
            if refusal.domain != DOMAIN:
                raise AssertionError(f"{why}: ErrorInfo domain {refusal.domain!r}: {refusal.raw}") from None
            if not refusal.message:
                raise AssertionError(f"{why}: an error without a message: {refusal.raw}") from None
            # The SDK maps only domain a2a-protocol.org: a generic client
            # error, whose text carries the status's message.
            if not isinstance(refusal.sdk_error, A2AError) or refusal.message not in str(refusal.sdk_error):
                raise AssertionError(
                    f"{why}: the SDK raised {refusal.sdk_error!r}, not an A2AError carrying {refusal.message!r}"
                ) from None
            return refusal
        if (refusal.code, refusal.reason) != (code, reason):
            raise AssertionError(
                f"{why}: expected JSON-RPC {code} {reason}, got {refusal.code} {refusal.reason}: {refusal.raw}"
            ) from None
        if refusal.domain != DOMAIN:
            raise AssertionError(f"{why}: ErrorInfo domain {refusal.domain!r}: {refusal.raw}") from None
        if not refusal.message:
            raise AssertionError(f"{why}: an error without a message: {refusal.raw}") from None
        sdk_type = next((t for t, c in JSON_RPC_ERROR_CODE_MAP.items() if c == code), None)
        if sdk_type is not None and not isinstance(refusal.sdk_error, sdk_type):
            raise AssertionError(
                f"{why}: the SDK raised {type(refusal.sdk_error).__name__}, not {sdk_type.__name__}"
            ) from None
        return refusal
    raise AssertionError(f"{why}: expected a refusal ({code} {reason}), got a task: {show(task)}")


def assert_no_chain_forwarded(sent: dict[str, Any], contract_hex: str | None, why: str) -> None:
    """What reached an agent carries no chain: the extension's metadata is
    gone, or names the task's contract and nothing else (a gateway's own mark)."""
    forwarded = (sent.get("metadata") or {}).get(URI)
    assert forwarded is None or (set(forwarded) == {"contractId"} and forwarded["contractId"] == contract_hex), (
        f"{why}: the agent was handed the extension's metadata {forwarded!r}"
    )
    assert URI not in sent.get("extensions", []), f"{why}: the message still lists the extension: {sent}"


def assert_nothing_reached(agent: AgentProc, mark: int, why: str) -> None:
    """Nothing new reached the agent since `mark`: no request on either
    binding (a gateway's GetTask/CancelTask/SubscribeToTask about a task
    started before is tolerated: it follows that task), no execution. Card reads are not requests to the agent's work
    (HTTP GETs; over gRPC, GetExtendedAgentCard)."""
    before = agent.entries()[:mark]
    known = {e.get("taskId") for e in before if e.get("kind") == "execute"}
    new = [
        e
        for e in agent.since(mark)
        if e.get("kind") in ("rpc", "execute", "cancel")
        and not (
            e.get("kind") == "rpc"
            and e.get("method") in ("GetTask", "CancelTask", "SubscribeToTask")
            and e.get("taskId") in known
        )
        and not (e.get("binding") == "grpc" and e.get("method") == "GetExtendedAgentCard")
    ]
    assert not new, f"{why}: {agent.name} received {new}"


def assert_sent_over(sent: list[dict[str, Any]], binding: str, why: str) -> None:
    """Each request logged by an agent came over `binding` (its gateway's upstream hop)."""
    wrong = [e for e in sent if e.get("binding") != binding]
    assert not wrong, f"{why}: expected requests over {binding}, got {wrong}"


# --------------------------------------------------------------------------
# The agents alone (no gateway, no broker)
# --------------------------------------------------------------------------


class DirectPeers:
    """A stand-in for a gateway's egress with no gateway: serves
    /peers/NAME/.well-known/agent-card.json as NAME's own card, so the SDK's
    client then talks to NAME directly."""

    def __init__(self, peers: dict[str, str]):
        upstream = dict(peers)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                match = re.fullmatch(r"/peers/([^/]+)/\.well-known/agent-card\.json", self.path)
                if not match or match.group(1) not in upstream:
                    self.send_error(404)
                    return
                with urllib.request.urlopen(upstream[match.group(1)] + "/.well-known/agent-card.json", timeout=10) as r:
                    body = r.read()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_agents_work_directly(binding: str) -> None:
    """Each agent mode against the SDK's client, with no gateway and no broker;
    with binding grpc the agents serve the gRPC binding too, and the test's
    client and the agents' outbound clients take it (every request each
    agent logged came over it)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"a2a-agents-test-{binding}-"))
    procs: list[AgentProc] = []
    direct: DirectPeers | None = None
    try:
        good = start_agent(workdir, "d-good", "worker.py", ["--mode", "good"], binding=binding)
        bad = start_agent(workdir, "d-bad", "worker.py", ["--mode", "bad"], binding=binding)
        ask = start_agent(workdir, "d-input", "worker.py", ["--mode", "input"], binding=binding)
        slow = start_agent(workdir, "d-slow", "worker.py", ["--mode", "slow"], binding=binding)
        procs += [good, bad, ask, slow]
        for agent in procs:
            await_agent(agent)
        direct = DirectPeers({"good": good.url, "bad": bad.url, "slow": slow.url})
        caller = start_agent(
            workdir,
            "d-call",
            "worker.py",
            ["--mode", "call-peer", "--outbound", f"{direct.url}/peers/good", "--verdict-wait-s", "0"],
            binding=binding,
        )
        orchestrator = start_agent(
            workdir,
            "d-orchestrator",
            "orchestrator.py",
            ["--outbound-base", direct.url, "--peers", "good,bad", "--verdict-wait-s", "0"],
            binding=binding,
        )
        procs += [caller, orchestrator]
        await_agent(caller)
        await_agent(orchestrator)
        sdk_binding = binding.upper()

        async def body() -> None:
            async with A2AUser(binding=binding, timeout=60) as user:
                card = (await user.client(good.url))._card
                assert card.capabilities.streaming, "the stock agents stream (a gateway serves them as not streaming)"
                assert card.supported_interfaces[0].url.startswith(good.url)
                assert card.supported_interfaces[0].protocol_binding == "JSONRPC", card.supported_interfaces
                grpc_interfaces = [i for i in card.supported_interfaces if i.protocol_binding == "GRPC"]
                if binding == "grpc":
                    assert [i.url for i in grpc_interfaces] == [good.grpc], card.supported_interfaces
                else:
                    assert not grpc_interfaces and not good.grpc, card.supported_interfaces

                task = await user.send(good.url, task_message("six times seven?"))
                assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
                assert output_of(task) == {"answer": 42}
                task = await user.send(bad.url, task_message("six times seven?"))
                assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
                assert output_of(task) == {"answer": "forty-two"}

                task = await user.send(ask.url, task_message("a report"))
                assert state_of(task) == "TASK_STATE_INPUT_REQUIRED", show(task)
                assert task.status.message.parts[0].text == "need the date range"
                follow_up = task_message("2024", context_id=task.context_id, task_id=task.id)
                task = await user.send(ask.url, follow_up)
                assert state_of(task) == "TASK_STATE_COMPLETED" and output_of(task) == {"answer": 42}, show(task)

                task = await user.send(slow.url, task_message("take your time"), return_immediately=True)
                assert task.status.state in (TaskState.TASK_STATE_SUBMITTED, TaskState.TASK_STATE_WORKING), show(task)
                await asyncio.sleep(0.2)
                assert state_of(await user.get_task(slow.url, task.id)) == "TASK_STATE_WORKING"
                canceled = await user.cancel_task(slow.url, task.id)
                assert state_of(canceled) == "TASK_STATE_CANCELED", show(canceled)
                await await_for("the slow agent to log its cancel", lambda: slow.cancels(task.id), 10)
                assert f"cancel {task.id}" in slow.proc.tail()

                mark = good.mark()
                task = await user.send(caller.url, task_message("ask your peer"))
                assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
                call = output_of(task)["call"]
                assert call["state"] == "TASK_STATE_COMPLETED" and call["output"] == {"answer": 42}, call
                assert call["error"] is None and call["verdict"] is None, call
                assert call["binding"] == sdk_binding, call
                sent = good.sends_since(mark)
                assert [e["contextId"] for e in sent] == [task.context_id], "call-peer keeps its own contextId"
                assert_sent_over(sent, binding, "call-peer's call")

                marks = {a.name: a.mark() for a in (good, bad)}
                task = await user.send(orchestrator.url, task_message("six times seven?"))
                assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
                results = output_of(task)["results"]
                assert set(results) == {"good", "bad"}
                for name, want in (("good", {"answer": 42}), ("bad", {"answer": "forty-two"})):
                    assert results[name]["state"] == "TASK_STATE_COMPLETED", results
                    assert results[name]["verdict"] is None and results[name]["error"] is None, results
                    assert results[name]["output"] == want, results
                    assert results[name]["binding"] == sdk_binding, results
                for agent in (good, bad):
                    sent = agent.sends_since(marks[agent.name])
                    assert [e["contextId"] for e in sent] == [task.context_id], f"{agent.name}: {sent}"

                # A call that does not wait, then cancels.
                task = await user.send(
                    orchestrator.url,
                    task_message("x", data={"peers": ["slow"], "returnImmediately": True, "cancelAfterMs": {"slow": 300}}),
                )
                slow_result = output_of(task)["results"]["slow"]
                assert slow_result["canceled"] == "TASK_STATE_CANCELED", slow_result
                assert slow_result["state"] == "TASK_STATE_CANCELED" and slow_result["error"] is None, slow_result
                assert slow.cancels(slow_result["taskId"]), "the slow agent's cancel() ran"
                cancel_calls = [e for e in slow.since(0, "rpc") if e.get("method") == "CancelTask"
                                and e.get("taskId") == slow_result["taskId"]]
                assert cancel_calls, "the orchestrator's CancelTask reached the slow agent"
                assert_sent_over(cancel_calls, binding, "the orchestrator's CancelTask")

                # An unknown peer is an outcome, not a crash.
                task = await user.send(orchestrator.url, task_message("x", data={"peers": ["nobody"]}))
                assert state_of(task) == "TASK_STATE_COMPLETED"
                nobody = output_of(task)["results"]["nobody"]
                assert nobody["state"] is None and "404" in nobody["error"], nobody

        run(body(), 180)
        for agent in procs:
            entries = agent.entries()
            assert any(e.get("kind") == "rpc" for e in entries), f"{agent.name} logged no request"
            assert_sent_over([e for e in entries if e.get("kind") == "rpc"], binding, agent.name)
    finally:
        if direct is not None:
            direct.close()
        for agent in procs:
            agent.proc.stop()
        if not os.environ.get("A2A_TEST_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)


def test_agents_work_directly_streaming(binding: str) -> None:
    """The streaming worker (worker.py --stream-steps) and a worker whose card
    says it does not stream (--no-streaming), against the SDK's streaming
    client, with no gateway and no broker: SendStreamingMessage gets each
    step's status update and artifact as the worker sends them, the final
    artifact and COMPLETED last (GetTask then shows one artifact, the final
    one); SubscribeToTask on a running task starts with the task and follows
    it to its end; CancelTask mid-stream ends the stream CANCELED; the
    non-streaming worker's card makes the same client send SendMessage."""
    workdir = Path(tempfile.mkdtemp(prefix=f"a2a-agents-stream-test-{binding}-"))
    procs: list[AgentProc] = []
    steps = 4
    try:
        streamer = start_agent(
            workdir, "d-stream", "worker.py", ["--mode", "good", "--stream-steps", str(steps), "--step-ms", "300"],
            binding=binding,
        )
        plain = start_agent(workdir, "d-nostream", "worker.py", ["--mode", "good", "--no-streaming"], binding=binding)
        procs += [streamer, plain]
        for agent in procs:
            await_agent(agent)

        async def body() -> None:
            async with A2AUser(binding=binding, timeout=60) as user:
                assert (await user.client(streamer.url, streaming=True))._card.capabilities.streaming
                assert not (await user.client(plain.url, streaming=True))._card.capabilities.streaming

                # SendStreamingMessage: each event as the worker sends it.
                message = task_message("six times seven, step by step")
                seen: list[Seen] = []
                events = await user.stream(streamer.url, message, recorder(streamer, message.context_id, seen))
                assert_streamed_as_sent(seen, steps, {"answer": 42}, "streamed directly")
                assert event_state(events[-1]) == "TASK_STATE_COMPLETED", show_events(events)
                task_id = event_task_id(events[-1])
                task = await user.get_task(streamer.url, task_id)
                assert state_of(task) == "TASK_STATE_COMPLETED" and output_of(task) == {"answer": 42}, show(task)
                sent = [e for e in streamer.sends_since(0) if e.get("contextId") == message.context_id]
                assert [e["method"] for e in sent] == ["SendStreamingMessage"], sent

                # SubscribeToTask on a task started without waiting.
                message = task_message("again, slower", data={"steps": 6, "stepMs": 300})
                started = await user.send(streamer.url, message, return_immediately=True)
                assert started.status.state not in TERMINAL, show(started)
                seen = []
                events = await user.subscribe(streamer.url, started.id, recorder(streamer, message.context_id, seen))
                assert events and events[0].HasField("task") and events[0].task.id == started.id, show_events(events)
                assert event_state(events[-1]) == "TASK_STATE_COMPLETED", show_events(events)
                early = [s for s in seen if step_of(s.event) is not None and not s.finished]
                assert early, f"no step update came before the task ended:\n{show_events(events)}"

                # CancelTask mid-stream: the stream ends CANCELED.
                message = task_message("a long one", data={"steps": 200, "stepMs": 100})
                canceling: list[asyncio.Task[Task]] = []

                def cancel_at_step_two(event: StreamResponse) -> None:
                    if step_of(event) == 2 and not canceling:
                        canceling.append(asyncio.create_task(user.cancel_task(streamer.url, event_task_id(event))))

                events = await asyncio.wait_for(
                    user.stream(streamer.url, message, cancel_at_step_two), STATE_TIMEOUT_S
                )
                assert canceling, f"the stream never reached step 2:\n{show_events(events)}"
                canceled = await canceling[0]
                assert state_of(canceled) == "TASK_STATE_CANCELED", show(canceled)
                assert event_state(events[-1]) == "TASK_STATE_CANCELED", show_events(events)
                reached = max(step_of(e) or 0 for e in events)
                assert reached < 200, f"the stream ran to its end ({reached} steps) after the cancel"
                assert streamer.cancels(canceled.id), "the worker's cancel() ran"

                # A card without streaming: the same client sends SendMessage.
                message = task_message("six times seven?")
                events = await user.stream(plain.url, message)
                assert [event_kind(e) for e in events] == ["task"], show_events(events)
                assert state_of(events[0].task) == "TASK_STATE_COMPLETED", show_events(events)
                sent = [e for e in plain.sends_since(0) if e.get("contextId") == message.context_id]
                assert [e["method"] for e in sent] == ["SendMessage"], sent

        run(body(), 180)
        for agent in procs:
            assert_sent_over([e for e in agent.entries() if e.get("kind") == "rpc"], binding, agent.name)
    finally:
        for agent in procs:
            agent.proc.stop()
        if not os.environ.get("A2A_TEST_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------
# Cards and the address book
# --------------------------------------------------------------------------


def test_cards(world: World) -> None:
    """The gateway's card and an egress peer card. With binding grpc both list
    a GRPC interface besides the JSON-RPC one: the ingress's gRPC address,
    and the egress's with the peer's name as its tenant."""
    gateway = world.gateways["worker-a"]
    agent = world.agents["worker-a"]
    with httpx.Client(timeout=30) as http:
        own = http.get(f"{agent.url}/.well-known/agent-card.json").json()
        assert own["capabilities"].get("streaming") is True
        card = http.get(f"{gateway.ingress}/.well-known/agent-card.json").json()
        interfaces = card.get("supportedInterfaces") or []
        assert interfaces, card
        if world.binding == "jsonrpc":
            for interface in interfaces:
                assert interface["url"].startswith(gateway.ingress), f"not the gateway's URL: {interface}"
                assert not interface["url"].startswith(agent.url), f"the agent's own URL leaked: {interface}"
        else:
            assert any(i.get("protocolBinding") == "GRPC" for i in own["supportedInterfaces"]), own
            for interface in interfaces:
                if interface.get("protocolBinding") == "GRPC":
                    assert interface["url"] == gateway.grpc, f"not the gateway's gRPC address: {interface}"
                else:
                    assert interface["url"].startswith(gateway.ingress), f"not the gateway's URL: {interface}"
                assert not interface["url"].startswith(agent.url), f"the agent's own URL leaked: {interface}"
                assert agent.grpc not in interface["url"], f"the agent's own gRPC address leaked: {interface}"
            grpc_interfaces = [i for i in interfaces if i.get("protocolBinding") == "GRPC"]
            assert len(grpc_interfaces) == 1, interfaces
        assert any(i.get("protocolBinding") == "JSONRPC" for i in interfaces), interfaces
        capabilities = card.get("capabilities") or {}
        # It streams as its agent does (followed by its stream); no push.
        assert capabilities.get("streaming") is own["capabilities"].get("streaming"), capabilities
        assert capabilities.get("pushNotifications", False) is False, capabilities
        extensions = [e for e in capabilities.get("extensions") or [] if e.get("uri") == URI]
        assert len(extensions) == 1, capabilities
        assert extensions[0].get("required") is True, extensions
        assert extensions[0].get("params", {}).get("agentPublicKey") == world.keys["worker-a"].public_hex, extensions
        assert card.get("name") == own.get("name"), "the card describes the agent"

        # The orchestrator's egress serves each peer's card under /peers/NAME.
        egress = world.gateways["orchestrator"].egress
        peer_card = http.get(f"{egress}/peers/worker-a/.well-known/agent-card.json")
        assert peer_card.status_code == 200, peer_card.text
        peer_card = peer_card.json()
        peer_interfaces = peer_card.get("supportedInterfaces") or []
        if world.binding == "jsonrpc":
            assert peer_interfaces and all(
                i["url"].startswith(f"{egress}/peers/worker-a") for i in peer_interfaces
            ), peer_card
        else:
            egress_grpc = world.gateways["orchestrator"].egress_grpc
            grpc_interfaces = [i for i in peer_interfaces if i.get("protocolBinding") == "GRPC"]
            assert len(grpc_interfaces) == 1, peer_card
            assert grpc_interfaces[0]["url"] == egress_grpc, f"not the egress's gRPC address: {grpc_interfaces}"
            assert grpc_interfaces[0].get("tenant") == "worker-a", (
                f"the peer is picked by the tenant: {grpc_interfaces}"
            )
            others = [i for i in peer_interfaces if i.get("protocolBinding") != "GRPC"]
            assert others and all(i["url"].startswith(f"{egress}/peers/worker-a") for i in others), peer_card
        assert peer_card.get("name") == own.get("name"), peer_card

    async def body() -> None:
        async with world.user(timeout=60) as user:
            client = await user.client(gateway.ingress)  # asserts the client took the world's binding
            card = client._card
            assert card.capabilities.streaming, "the worker streams, so its gateway does"
            if world.binding == "jsonrpc":
                assert card.supported_interfaces[0].url.startswith(gateway.ingress)
            else:
                jsonrpc = [i.url for i in card.supported_interfaces if i.protocol_binding == "JSONRPC"]
                assert jsonrpc and all(url.startswith(gateway.ingress) for url in jsonrpc), card.supported_interfaces
                # The test's client calls the gateway's gRPC address.
                assert [i.url for i in card.supported_interfaces if i.protocol_binding == "GRPC"] == [gateway.grpc]

    run(body(), 60)


def test_egress_unknown_peer(world: World) -> None:
    """A peer missing from the address book: -32001 NOT_FOUND, as JSON-RPC;
    over gRPC (the peer named by the request's tenant) status NOT_FOUND with
    the same ErrorInfo."""
    if world.binding == "grpc":
        request = SendMessageRequest(
            tenant="nobody",
            message=Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, parts=[new_text_part("hi")]),
        )
        with grpc.insecure_channel(world.gateways["orchestrator"].egress_grpc) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                stub.SendMessage(request, timeout=30, metadata=[("a2a-version", "1.0")])
        refusal = Refusal.from_grpc(raised.value, raised.value)
        assert not refusal.problems, (refusal.problems, refusal.raw)
        assert (refusal.grpc_code, refusal.reason, refusal.domain) == ("NOT_FOUND", "NOT_FOUND", DOMAIN), refusal.raw
        assert "nobody" in refusal.message, refusal.raw
        return
    egress = world.gateways["orchestrator"].egress
    request = {
        "jsonrpc": "2.0",
        "id": "1",
        "method": "SendMessage",
        "params": {"message": {"messageId": str(uuid.uuid4()), "role": "ROLE_USER", "parts": [{"text": "hi"}]}},
    }
    with httpx.Client(timeout=30) as http:
        answer = http.post(f"{egress}/peers/nobody/", json=request, headers={"A2A-Version": "1.0"})
    body = answer.json()
    error = body.get("error")
    assert isinstance(error, dict), f"HTTP {answer.status_code}: {body}"
    refusal = Refusal(error, Exception())
    assert (refusal.code, refusal.reason, refusal.domain) == (-32001, "NOT_FOUND", DOMAIN), error
    assert "nobody" in refusal.message, error


@pytest.mark.bindings("grpc")
def test_grpc_unserved_methods(world: World) -> None:
    """The gRPC ingress serves SendMessage, GetTask, CancelTask and the
    streams; ListTasks is UNIMPLEMENTED, a SendStreamingMessage with a chain
    that does not verify is refused before any stream, and the agent
    receives nothing."""
    agent = world.agents["worker-a"]
    mark = agent.mark()
    message = task_message("six times seven?", chain="not checked")
    with grpc.insecure_channel(world.gateways["worker-a"].grpc) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        metadata = [("a2a-version", "1.0")]
        with pytest.raises(grpc.RpcError) as raised:
            stub.ListTasks(ListTasksRequest(), timeout=30, metadata=metadata)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED, raised.value
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.SendStreamingMessage(SendMessageRequest(message=message), timeout=30, metadata=metadata))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    assert_nothing_reached(agent, mark, "unserved gRPC methods")


# --------------------------------------------------------------------------
# a. A fan-out judged by the broker
# --------------------------------------------------------------------------


def test_fanout_judged_by_broker(world: World) -> None:
    broker = world.broker
    orchestrator = world.keys["orchestrator"]
    root = broker.open_root(orchestrator, budget=100, max_depth=2)
    chain = broker.chain_b64(root.id)
    a, b = world.agents["worker-a"], world.agents["worker-b"]
    marks = {"worker-a": a.mark(), "worker-b": b.mark()}
    context_id = str(uuid.uuid4())

    async def body() -> Task:
        async with world.user() as user:
            message = task_message(
                "What is six times seven?",
                context_id=context_id,
                chain=chain,
                data={"peers": ["worker-a", "worker-b"]},
            )
            task = await user.send(world.gateways["orchestrator"].ingress, message)
            if task.status.state not in TERMINAL:
                task = await user.follow(world.gateways["orchestrator"].ingress, task.id, lambda t: t.status.state in TERMINAL)
            return task

    task = run(body())
    assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
    assert task.context_id == context_id
    ext = ext_of(task)
    assert ext.get("contractId") == root.id.hex(), ext
    assert ext.get("verdict") == "ACCEPTED", ext
    results = output_of(task)["results"]
    assert set(results) == {"worker-a", "worker-b"}, results
    ra, rb = results["worker-a"], results["worker-b"]
    assert ra["state"] == "TASK_STATE_COMPLETED" and ra["verdict"] == "ACCEPTED" and ra["error"] is None, ra
    assert rb["state"] == "TASK_STATE_FAILED" and rb["verdict"] == "REJECTED" and rb["error"] is None, rb
    assert any("schema_valid" in check for check in rb["failedChecks"] or []), rb
    assert ra["output"] == {"answer": 42} and rb["output"] == {"answer": "forty-two"}, results
    # The orchestrator's client took the world's binding to its egress (over
    # gRPC the peer is the interface's tenant).
    for name, result in (("worker-a", ra), ("worker-b", rb)):
        assert result["binding"] == world.sdk_binding, (name, result)
        if world.binding == "grpc":
            assert result["tenant"] == name, (name, result)

    # Each worker got the task once, with the orchestrator's contextId and
    # without the caller's extension metadata (the chain is taken out; the
    # gateway may mark the message with the contract's id alone), over the
    # world's binding (the gateway->agent hop).
    for agent, result in ((a, ra), (b, rb)):
        sent = agent.sends_since(marks[agent.name])
        assert len(sent) == 1, f"{agent.name}: {sent}"
        assert sent[0]["contextId"] == context_id, sent
        assert_no_chain_forwarded(sent[0], result["contractId"], agent.name)
        assert_sent_over(agent.since(marks[agent.name], "rpc"), world.binding, agent.name)
        assert len(agent.executions(context_id)) == 1

    # At the broker: two children of the root, depth 1, carved from it.
    children = broker.children(root.id)
    assert len(children) == 2, [status_name(c) for c in children]
    by_delegate = {terms_of(c).delegate_public_key.hex(): c for c in children}
    assert set(by_delegate) == {world.keys["worker-a"].public_hex, world.keys["worker-b"].public_hex}
    consumed = {}
    for name, result, verdict in (("worker-a", ra, pb.VERDICT_ACCEPTED), ("worker-b", rb, pb.VERDICT_REJECTED)):
        state = by_delegate[world.keys[name].public_hex]
        child_id = bytes(state.contract_id)
        terms = broker.contract(child_id)  # the chain root -> child verifies offline
        assert result["contractId"] == child_id.hex(), (name, result)
        assert terms.depth == 1 and bytes(terms.parent_id) == root.id, (name, terms.depth)
        assert bytes(terms.intent_lineage_hash) == root.lineage, name
        assert terms.budget == WORKER_ROUTE["budget"], (name, terms.budget)
        assert json.loads(terms.result_schema_json) == json.loads(SCHEMA), (name, terms.result_schema_json)
        assert 0 < terms.deadline_ms <= root.deadline_ms, name
        assert status_name(state) == "CONTRACT_STATUS_COMPLETED", (name, status_name(state))
        assert "result.schema_valid" in state.effective_predicate, state.effective_predicate
        assert_ledger_balances(state, name)
        assert result.get("receiptId"), (name, result)
        receipt = broker.receipt(result["receiptId"])
        assert receipt.kind == pb.RECEIPT_KIND_COMPLETED and bytes(receipt.contract_id) == child_id, (name, receipt)
        assert bytes(receipt.requester_public_key) == world.keys[name].public, "completed with the worker's key"
        assert receipt.completion.verdict == verdict, (name, receipt.completion)
        assert receipt.completion.schema_valid is (name == "worker-a"), (name, receipt.completion)
        consumed[name] = receipt.completion.consumed
    refused = broker.receipt(rb["receiptId"]).completion.refused_criteria
    assert any("schema_valid" in c.criterion for c in refused), refused

    # The root's ledger: both children settled into it.
    root_state = broker.state(root.id)
    assert status_name(root_state) == "CONTRACT_STATUS_COMPLETED", status_name(root_state)
    assert_ledger_balances(root_state, "root")
    assert root_state.ledger.reserved == 0 and root_state.ledger.open_children == 0, root_state.ledger
    root_receipt = broker.receipt(ext["receiptId"])
    assert root_receipt.kind == pb.RECEIPT_KIND_COMPLETED and bytes(root_receipt.contract_id) == root.id
    assert bytes(root_receipt.requester_public_key) == orchestrator.public
    assert root_state.ledger.spent == root_receipt.completion.consumed + sum(consumed.values()), (
        root_state.ledger,
        root_receipt.completion.consumed,
        consumed,
    )


# --------------------------------------------------------------------------
# b. Refusals at the egress
# --------------------------------------------------------------------------


def test_overspending_fanout_refused_at_egress(world: World) -> None:
    broker = world.broker
    orchestrator = world.keys["orchestrator"]
    root = broker.open_root(orchestrator, budget=100, max_depth=2)
    # A sibling already holds 60 of the root's 100: 40 are left.
    sibling = broker.delegate(orchestrator, root, world.keys["slow-2"], budget=60, task="an earlier sub-task")
    assert broker.state(root.id).ledger.residual == 40
    a, b = world.agents["worker-a"], world.agents["worker-b"]
    marks = {"worker-a": a.mark(), "worker-b": b.mark()}

    async def body() -> Task:
        async with world.user() as user:
            message = task_message(
                "What is six times seven?",
                chain=broker.chain_b64(root.id),
                data={"peers": ["worker-a", "worker-b"], "terms": {"worker-a": {"budget": 60}, "worker-b": {"budget": 60}}},
            )
            return await user.send(world.gateways["orchestrator"].ingress, message)

    task = run(body())
    assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
    results = output_of(task)["results"]
    for name in ("worker-a", "worker-b"):
        result = results[name]
        assert result["state"] is None and result["error"], (name, result)
        assert "BUDGET_EXCEEDS_PARENT (requested 60, allowed 40)" in result["error"], (name, result["error"])
        assert_outbound_refusal(world, result, "BUDGET_EXCEEDS_PARENT", name)
        data = result["errorData"] or {}
        assert "BUDGET_EXCEEDS_PARENT (requested 60, allowed 40)" in data.get("violations", ""), (name, data)
        receipt = broker.receipt(data["receiptId"])
        assert receipt.kind == pb.RECEIPT_KIND_REFUSED and bytes(receipt.contract_id) == root.id, receipt
        assert receipt.primary == pb.INVARIANT_CODE_BUDGET_EXCEEDS_PARENT, receipt
        violation = next(v for v in receipt.violations if v.code == pb.INVARIANT_CODE_BUDGET_EXCEEDS_PARENT)
        assert (violation.requested, violation.allowed) == ("60", "40"), violation
        assert bytes(receipt.requester_public_key) == orchestrator.public, "the Delegate was the orchestrator's"
        assert_nothing_reached(world.agents[name], marks[name], f"{name} after a refused Delegate")
    # Nothing was issued for them: the root's only child is the sibling.
    assert [bytes(c.contract_id) for c in broker.children(root.id)] == [sibling]


def assert_outbound_refusal(world: World, result: dict[str, Any], reason: str, why: str) -> None:
    """An agent's outbound call refused at its egress with -32602 and
    `reason`: over JSON-RPC the SDK's InvalidParamsError (the SDK keeps no
    reason); over gRPC (the agent's client on gRPC) status INVALID_ARGUMENT
    with the reason and domain in the Status's ErrorInfo, read by the agent."""
    assert result["binding"] == world.sdk_binding, (why, result)
    if world.binding == "jsonrpc":
        assert result["errorType"] == "InvalidParamsError", (why, result)  # -32602
        return
    assert result["errorCode"] == "INVALID_ARGUMENT", (why, result)
    assert (result["errorReason"], result["errorDomain"]) == (reason, DOMAIN), (why, result)


def test_depth_limit_refused_at_egress(world: World) -> None:
    broker = world.broker
    orchestrator = world.keys["orchestrator"]
    root = broker.open_root(orchestrator, budget=100, max_depth=1)
    third = world.agents["third"]
    mark = third.mark()
    context_id = str(uuid.uuid4())

    async def body() -> Task:
        async with world.user() as user:
            message = task_message(
                "Ask around", context_id=context_id, chain=broker.chain_b64(root.id), data={"peers": ["worker-c"]}
            )
            return await user.send(world.gateways["orchestrator"].ingress, message)

    task = run(body())
    assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
    result = output_of(task)["results"]["worker-c"]
    # worker-c itself ran at depth 1 and was judged; its own call was refused.
    assert result["state"] == "TASK_STATE_COMPLETED" and result["verdict"] == "ACCEPTED", result
    call = result["output"]["call"]
    assert call["state"] is None and call["error"], call
    assert "DEPTH_EXCEEDED (requested 2, allowed 1)" in call["error"], call["error"]
    assert_outbound_refusal(world, call, "DEPTH_EXCEEDED", "worker-c's call to third")
    assert result["binding"] == world.sdk_binding, result
    if world.binding == "grpc":
        assert call["tenant"] == "third" and result["tenant"] == "worker-c", (call, result)
    assert [e["contextId"] for e in world.agents["worker-c"].executions(context_id)] == [context_id]
    assert_nothing_reached(third, mark, "the third agent past max_depth")

    worker_c = bytes.fromhex(result["contractId"])
    assert broker.contract(worker_c).depth == 1
    assert broker.children(worker_c) == []
    receipt = broker.receipt(call["errorData"]["receiptId"])
    assert receipt.kind == pb.RECEIPT_KIND_REFUSED and bytes(receipt.contract_id) == worker_c, receipt
    assert receipt.primary == pb.INVARIANT_CODE_DEPTH_EXCEEDED, receipt
    assert bytes(receipt.requester_public_key) == world.keys["worker-c"].public, "the Delegate was worker-c's"
    violation = next(v for v in receipt.violations if v.code == pb.INVARIANT_CODE_DEPTH_EXCEEDED)
    assert (violation.requested, violation.allowed) == ("2", "1"), violation


# --------------------------------------------------------------------------
# c. Bypass attempts at a worker's gateway
# --------------------------------------------------------------------------


def flip_signature(chain_b64: str) -> str:
    chain = pb.GetChainResponse.FromString(base64.b64decode(chain_b64))
    signature = bytearray(chain.chain[-1].contract.signature)
    signature[7] ^= 0x01
    chain.chain[-1].contract.signature = bytes(signature)
    return base64.b64encode(chain.SerializeToString()).decode()


def flip_payload(chain_b64: str, marker: bytes) -> str:
    """Flips one letter of the leaf's task text inside its signed payload:
    the payload still decodes, its hash and signature no longer match."""
    chain = pb.GetChainResponse.FromString(base64.b64decode(chain_b64))
    payload = bytearray(chain.chain[-1].contract.payload)
    at = bytes(payload).find(marker)
    assert at >= 0, "the task text is in the payload"
    payload[at] ^= 0x20  # 'b' <-> 'B'
    chain.chain[-1].contract.payload = bytes(payload)
    pb.Contract.FromString(bytes(payload))  # still a Contract
    return base64.b64encode(chain.SerializeToString()).decode()


def test_bypass_refused(world: World) -> None:
    broker = world.broker
    orchestrator = world.keys["orchestrator"]
    worker = world.agents["worker-a"]
    ingress = world.gateways["worker-a"].ingress
    root = broker.open_root(orchestrator, budget=200, max_depth=2)

    def child(delegate: str = "worker-a", **kwargs: Any) -> bytes:
        return broker.delegate(orchestrator, root, world.keys[delegate], **kwargs)

    open_child = child(task="bypass probe: answer the question")
    other_agents = child("worker-b")
    revoked = child()
    broker.revoke(orchestrator, revoked)
    assert status_name(broker.state(revoked)) == "CONTRACT_STATUS_REVOKED"
    # Two leaves past their deadline: one expired (its delegate's Accept is
    # refused LATE and expires it), one still OPEN (the broker runs no sweep).
    deadline = now_ms() + 1000
    expired = child(deadline_ms=deadline)
    late = child(deadline_ms=deadline)
    wait_for("the short deadline to pass", lambda: now_ms() > deadline + 20, 10)
    with pytest.raises(grpc.RpcError) as refused:
        broker.stub.Accept(world.keys["worker-a"].signer.accept(contract_id=expired), timeout=30)
    assert (info := error_info(refused.value)) is not None and info.reason == "LATE", refused.value
    assert status_name(broker.state(expired)) == "CONTRACT_STATUS_EXPIRED"
    assert status_name(broker.state(late)) == "CONTRACT_STATUS_OPEN"
    chains = {
        "open": broker.chain_b64(open_child),
        "other": broker.chain_b64(other_agents),
        "root": broker.chain_b64(root.id),
        "revoked": broker.chain_b64(revoked),
        "expired": broker.chain_b64(expired),
        "late": broker.chain_b64(late),
    }

    cases = [
        ("no extension metadata", None, {}, -32008, "INVALID_FIELD"),
        ("extension metadata without a chain", None, {"note": "no chain"}, -32008, "INVALID_FIELD"),
        ("a chain that is not base64", "not base64!!", {}, -32602, "UNDECODABLE_MESSAGE"),
        ("a chain that is not a GetChainResponse", base64.b64encode(b"\xff\xff\xff\xff").decode(), {}, -32602,
         "UNDECODABLE_MESSAGE"),
        ("a tampered signature", flip_signature(chains["open"]), {}, -32602, "BAD_SIGNATURE"),
        ("a tampered payload", flip_payload(chains["open"], b"bypass probe"), {}, -32602, "BAD_SIGNATURE"),
        ("another agent's chain", chains["other"], {}, -32602, "NOT_DELEGATE"),
        ("the root's chain (the orchestrator's contract)", chains["root"], {}, -32602, "NOT_DELEGATE"),
        ("a revoked leaf", chains["revoked"], {}, -32602, "ENDED"),
        # Its deadline has passed too, which the offline check sees first.
        ("an expired leaf (status EXPIRED)", chains["expired"], {}, -32602, "LATE"),
        ("a leaf past its deadline, not yet expired", chains["late"], {}, -32602, "LATE"),
    ]

    # Every case is tried; the failures are reported together.
    failures: list[str] = []

    async def body() -> None:
        async with world.user() as user:
            for why, chain, ext, code, reason in cases:
                mark = worker.mark()
                try:
                    await expect_refused(
                        user, ingress, task_message("six times seven?", chain=chain, ext=ext), code=code, reason=reason,
                        why=why,
                    )
                except AssertionError as error:
                    failures.append(str(error))
                try:
                    assert_nothing_reached(worker, mark, why)
                except AssertionError as error:
                    failures.append(str(error))

            # The open contract itself is admitted, once; a replay after its
            # completion (the same message, or a new one with its chain) is not.
            mark = worker.mark()
            message = task_message("six times seven?", chain=chains["open"])
            task = await user.send(ingress, message)
            if task.status.state not in TERMINAL:
                task = await user.follow(ingress, task.id, lambda t: t.status.state in TERMINAL and "verdict" in ext_of(t))
            assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
            assert ext_of(task).get("verdict") == "ACCEPTED" and ext_of(task).get("contractId") == open_child.hex(), show(task)
            sent = worker.sends_since(mark)
            assert len(sent) == 1, sent
            assert_no_chain_forwarded(sent[0], open_child.hex(), "the admitted message")
            assert_sent_over(sent, world.binding, "the admitted message")
            assert status_name(broker.state(open_child)) == "CONTRACT_STATUS_COMPLETED"
            for why, replay in (
                ("the same message replayed after completion", message),
                ("a new message with a completed contract's chain", task_message("again", chain=chains["open"])),
            ):
                mark = worker.mark()
                try:
                    await expect_refused(user, ingress, replay, code=-32602, reason="ENDED", why=why)
                    assert_nothing_reached(worker, mark, why)
                except AssertionError as error:
                    failures.append(str(error))

            # A contract already bound to a task still running (slow-2's):
            # a second message with its chain is not admitted.
            slow = world.agents["slow-2"]
            bound = child("slow-2", task="a long one")
            bound_chain = broker.chain_b64(bound)
            first = task_message("take your time", chain=bound_chain)
            sending = asyncio.create_task(user.send(world.gateways["slow-2"].ingress, first))
            try:
                await await_for("slow-2 to start the task", lambda: slow.executions(first.context_id))
                mark = slow.mark()
                why = "a second message with a contract bound to a running task"
                try:
                    await expect_refused(
                        user, world.gateways["slow-2"].ingress, task_message("me too", chain=bound_chain),
                        code=-32602, reason="ENDED", why=why,
                    )
                    assert_nothing_reached(slow, mark, why)
                except AssertionError as error:
                    failures.append(str(error))
            finally:
                broker.revoke(orchestrator, bound, reason="end of the probe")
                await settle(sending)

    run(body())
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------
# Later: escalation, revocation, cancellation, restart
# --------------------------------------------------------------------------


@pytest.mark.later
def test_input_required_escalates_at_once(world: World) -> None:
    broker = world.broker
    orchestrator = world.keys["orchestrator"]
    root = broker.open_root(orchestrator, budget=100, max_depth=2)
    contract = broker.delegate(orchestrator, root, world.keys["worker-i"], budget=20)
    ingress = world.gateways["worker-i"].ingress
    worker = world.agents["worker-i"]

    async def body() -> None:
        async with world.user() as user:
            task = await user.send(ingress, task_message("a report", chain=broker.chain_b64(contract)))
            # Visible at once: when the answer is back, the broker already has the escalation.
            state = broker.state(contract)
            assert state_of(task) == "TASK_STATE_INPUT_REQUIRED", show(task)
            assert "need the date range" in task.status.message.parts[0].text
            assert status_name(state) == "CONTRACT_STATUS_UNRESOLVABLE", status_name(state)
            ext = ext_of(task)
            assert ext.get("contractId") == contract.hex(), ext
            receipt = broker.receipt(ext["receiptId"])
            assert receipt.kind == pb.RECEIPT_KIND_ESCALATED and bytes(receipt.contract_id) == contract, receipt
            assert "need the date range" in receipt.escalation.reason, receipt.escalation
            assert bytes(receipt.requester_public_key) == world.keys["worker-i"].public
            root_state = broker.state(root.id)
            assert root_state.ledger.reserved == 0 and root_state.ledger.residual == 100, root_state.ledger

            # The contract has ended: a follow-up on the task is not forwarded.
            mark = worker.mark()
            follow_up = task_message("2024", context_id=task.context_id, task_id=task.id)
            await expect_refused(user, ingress, follow_up, code=-32602, reason="ENDED", why="a follow-up after escalation")
            assert_nothing_reached(worker, mark, "a follow-up after escalation")

    run(body())


@pytest.mark.later
def test_revoke_cancels_upstream_tasks(world: World) -> None:
    broker = world.broker
    orchestrator = world.keys["orchestrator"]
    root = broker.open_root(orchestrator, budget=100, max_depth=2)
    slows = [world.agents["slow-1"], world.agents["slow-2"]]
    context_id = str(uuid.uuid4())

    async def body() -> None:
        async with world.user() as user:
            message = task_message(
                "Take your time", context_id=context_id, chain=broker.chain_b64(root.id), data={"peers": ["slow-1", "slow-2"]}
            )
            sending = asyncio.create_task(user.send(world.gateways["orchestrator"].ingress, message))
            try:
                task_ids = {}
                for slow in slows:
                    started = await await_for(f"{slow.name} to start the task", lambda s=slow: s.executions(context_id))
                    task_ids[slow.name] = started[0]["taskId"]
                children = await await_for(
                    "both children to be accepted",
                    lambda: (lambda cs: cs if len(cs) == 2 and all(
                        c.status == pb.CONTRACT_STATUS_ACCEPTED for c in cs) else None)(broker.children(root.id)),
                )
                broker.revoke(orchestrator, root.id, reason="the principal changed its mind")
                for slow in slows:
                    await await_for(
                        f"{slow.name}'s task {task_ids[slow.name]} to be canceled",
                        lambda s=slow: s.cancels(task_ids[s.name]),
                    )
                    assert f"cancel {task_ids[slow.name]}" in slow.proc.tail()
                    # The gateway's CancelTask reached the agent over the world's binding.
                    cancel_calls = [e for e in slow.since(0, "rpc") if e.get("method") == "CancelTask"
                                    and e.get("taskId") == task_ids[slow.name]]
                    assert cancel_calls, f"{slow.name}: no CancelTask logged for {task_ids[slow.name]}"
                    assert_sent_over(cancel_calls, world.binding, f"the CancelTask to {slow.name}")
                for c in children:
                    assert status_name(broker.state(bytes(c.contract_id))) == "CONTRACT_STATUS_REVOKED"
                # The orchestrator's own task is canceled too (its contract was revoked).
                orchestrator_agent = world.agents["orchestrator"]
                started = orchestrator_agent.executions(context_id)
                assert len(started) == 1, started
                await await_for(
                    "the orchestrator's task to be canceled", lambda: orchestrator_agent.cancels(started[0]["taskId"])
                )
                # The caller is answered, not left waiting: the task CANCELED (or
                # an error saying the contract ended).
                try:
                    task = await asyncio.wait_for(asyncio.shield(sending), STATE_TIMEOUT_S)
                except TimeoutError:
                    raise AssertionError(
                        f"the caller's SendMessage was still unanswered {STATE_TIMEOUT_S:.0f} s after its "
                        "contract was revoked and the orchestrator's task canceled"
                    ) from None
                except Refusal as refusal:
                    assert refusal.reason == "ENDED", refusal.raw
                else:
                    assert state_of(task) == "TASK_STATE_CANCELED", show(task)
            finally:
                await settle(sending, timeout=0)

    run(body())


@pytest.mark.later
def test_cancel_through_principal_gateway(world: World) -> None:
    """CancelTask by the principal through its gateway: the orchestrator (a
    stock client: SendMessage asking not to wait, then CancelTask a second
    later, both to its egress) cancels its call to slow-1. The child contract
    is revoked at the broker (REVOKED, not declined), then the cancel reaches
    slow-1."""
    broker = world.broker
    orchestrator = world.keys["orchestrator"]
    root = broker.open_root(orchestrator, budget=100, max_depth=2)
    slow = world.agents["slow-1"]
    context_id = str(uuid.uuid4())

    async def body() -> Task:
        async with world.user() as user:
            message = task_message(
                "Take your time",
                context_id=context_id,
                chain=broker.chain_b64(root.id),
                data={"peers": ["slow-1"], "returnImmediately": True, "cancelAfterMs": {"slow-1": 1000}},
            )
            return await user.send(world.gateways["orchestrator"].ingress, message)

    task = run(body())
    assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
    result = output_of(task)["results"]["slow-1"]
    assert result["error"] is None, result
    assert result["canceled"] == "TASK_STATE_CANCELED" and result["state"] == "TASK_STATE_CANCELED", result
    assert result["binding"] == world.sdk_binding, result  # the CancelTask went to the egress on it
    executions = slow.executions(context_id)
    assert [e["taskId"] for e in executions] == [result["taskId"]], executions
    wait_for("slow-1 to log the cancel", lambda: slow.cancels(result["taskId"]), 10)
    children = broker.children(root.id)
    assert len(children) == 1 and terms_of(children[0]).delegate_public_key == world.keys["slow-1"].public
    assert status_name(children[0]) == "CONTRACT_STATUS_REVOKED", status_name(children[0])


@pytest.mark.later
def test_gateway_restart_mid_task(world: World) -> None:
    """The worker's gateway is killed (SIGKILL) while the worker runs a task
    and started again with the same config: the task's contract is still
    completed and judged, and the task is read through the new gateway."""
    broker = world.broker
    orchestrator = world.keys["orchestrator"]
    key = keygen(world.binary, "worker-d", world.workdir)
    agent = await_agent(
        start_agent(
            world.workdir, "worker-d", "worker.py", ["--mode", "good", "--delay-ms", "4000"], key, binding=world.binding
        )
    )
    gateway: Gateway | None = None
    try:
        config = gateway_config(
            world.workdir / "worker-d.gateway.toml",
            broker=world.broker_addr,
            key=key,
            upstream=agent.url,
            binding=world.binding,
        )
        gateway = await_gateway(start_gateway(world.binary, world.workdir, "worker-d", config, binding=world.binding))
        # The restart keeps the addresses.
        grpc_addresses = (
            {"grpc_listen": gateway.grpc, "egress_grpc_listen": gateway.egress_grpc} if world.binding == "grpc" else {}
        )
        config = gateway_config(
            world.workdir / "worker-d.gateway.toml",
            broker=world.broker_addr,
            key=key,
            upstream=agent.url,
            listen=f"127.0.0.1:{gateway.port('ingress')}",
            egress_listen=f"127.0.0.1:{gateway.port('egress')}",
            binding=world.binding,
            **grpc_addresses,
        )
        root = broker.open_root(orchestrator, budget=100, max_depth=2)
        contract = broker.delegate(orchestrator, root, key, budget=20)
        context_id = str(uuid.uuid4())

        async def body() -> None:
            nonlocal gateway
            assert gateway is not None
            async with world.user() as user:
                message = task_message("six times seven?", context_id=context_id, chain=broker.chain_b64(contract))
                sending = asyncio.create_task(user.send(gateway.ingress, message))
                try:
                    started = await await_for("worker-d to start the task", lambda: agent.executions(context_id))
                    task_id = started[0]["taskId"]
                    gateway.proc.stop(signal.SIGKILL)
                finally:
                    await settle(sending)  # the call dies with its gateway
                gateway = await_gateway(
                    start_gateway(
                        world.binary, world.workdir, "worker-d", config, tag="-restarted", binding=world.binding
                    )
                )
                async with world.user() as fresh:
                    task = await fresh.follow(
                        gateway.ingress,
                        task_id,
                        lambda t: t.status.state in TERMINAL and "verdict" in ext_of(t),
                        timeout=CALL_TIMEOUT_S,
                    )
                assert state_of(task) == "TASK_STATE_COMPLETED", show(task)
                assert ext_of(task).get("verdict") == "ACCEPTED" and ext_of(task).get("contractId") == contract.hex()
                state = broker.wait_status(contract, pb.CONTRACT_STATUS_COMPLETED)
                receipt = broker.receipt(ext_of(task)["receiptId"])
                assert receipt.kind == pb.RECEIPT_KIND_COMPLETED and receipt.completion.verdict == pb.VERDICT_ACCEPTED
                assert_ledger_balances(state, "worker-d")
                assert len(agent.executions(context_id)) == 1, "the task ran once"
                assert_sent_over(agent.since(0, "rpc"), world.binding, "worker-d, through both gateways")

        run(body())
    finally:
        if gateway is not None:
            gateway.proc.stop()
        agent.proc.stop()


# --------------------------------------------------------------------------
# Streaming: SendStreamingMessage and SubscribeToTask through both gateways
# --------------------------------------------------------------------------

# The streaming worker's steps (worker.py --stream-steps/--step-ms): long
# enough apart that its events come one by one through two gateways.
STREAM_STEPS = 4
STREAM_STEP_MS = 400
STREAM_PEERS = ("streamer", "poller")


@dataclass
class Streamers:
    """Beside a world, for the `streaming` tests: a streaming worker
    (`streamer`: good, --stream-steps) and a worker whose card says it does
    not stream (`poller`: good, --no-streaming, --delay-ms), each behind a
    gateway of its own, and the caller: an egress-only gateway holding the
    key `stream-caller`, with both in its address book (WORKER_ROUTE). The
    test plays the calling agent: its SDK client calls the caller's egress
    (`peer_url`, on the world's binding) and names the parent contract, a
    root the test opens with the caller's key. So every stream goes through
    both gateways: egress, then (JSON-RPC) the worker's ingress, then the
    agent on the world's binding."""

    caller: Key
    egress: str  # http://127.0.0.1:PORT: the caller's egress (JSON-RPC; its card names its gRPC one too)
    agents: dict[str, AgentProc]
    gateways: dict[str, Gateway]

    def peer_url(self, name: str) -> str:
        return f"{self.egress}/peers/{name}"


def egress_only_config(path: Path, *, binding: str, **kwargs: Any) -> Path:
    """gateway_config without an ingress: no `listen`, `upstream`,
    `grpc_listen` or `upstream_binding` (with binding grpc, the egress's
    `egress_grpc_listen` stays)."""
    gateway_config(path, upstream="http://127.0.0.1:1", binding=binding, **kwargs)
    dropped = ("listen = ", "upstream = ", "grpc_listen = ", "upstream_binding = ")
    lines = [line for line in path.read_text().splitlines() if not line.startswith(dropped)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def streamers(world: World) -> Any:
    started: list[Proc] = []
    try:
        names = ("stream-caller", *STREAM_PEERS)
        keys = {name: keygen(world.binary, name, world.workdir) for name in names}
        args = {
            "streamer": ["--mode", "good", "--stream-steps", str(STREAM_STEPS), "--step-ms", str(STREAM_STEP_MS)],
            "poller": ["--mode", "good", "--delay-ms", "1000", "--no-streaming"],
        }
        agents = {
            name: start_agent(world.workdir, name, "worker.py", args[name], keys[name], binding=world.binding)
            for name in STREAM_PEERS
        }
        started += [agent.proc for agent in agents.values()]
        for agent in agents.values():
            await_agent(agent)
        gateways: dict[str, Gateway] = {}
        for name in STREAM_PEERS:
            config = gateway_config(
                world.workdir / f"{name}.gateway.toml",
                broker=world.broker_addr,
                key=keys[name],
                upstream=agents[name].url,
                binding=world.binding,
            )
            gateways[name] = start_gateway(world.binary, world.workdir, name, config, binding=world.binding)
            started.append(gateways[name].proc)
        for name in STREAM_PEERS:
            await_gateway(gateways[name])
        config = egress_only_config(
            world.workdir / "stream-caller.gateway.toml",
            broker=world.broker_addr,
            key=keys["stream-caller"],
            binding=world.binding,
            peers=[Peer(name, keys[name], gateways[name].ingress) for name in STREAM_PEERS],
            routes={name: WORKER_ROUTE for name in STREAM_PEERS},
        )
        caller = start_gateway(world.binary, world.workdir, "stream-caller", config, binding=world.binding)
        started.append(caller.proc)
        patterns = {"egress": EGRESS_LINE}
        if world.binding == "grpc":
            patterns["egress_grpc"] = EGRESS_GRPC_LINE
        found = expect_lines(caller.proc, patterns, GATEWAY_START_S)
        caller.egress, caller.egress_grpc = found["egress"], found.get("egress_grpc", "")
        gateways["stream-caller"] = caller
    except BaseException as error:
        for proc in reversed(started):
            proc.stop()
        if isinstance(error, StartError):
            pytest.fail(str(error), pytrace=False)
        raise

    yield Streamers(keys["stream-caller"], caller.egress, agents, gateways)

    for proc in reversed(started):
        proc.stop()


def streamed_message(text: str, root: Root, *, data: Any = None) -> Message:
    """A task-starting message from the caller: its parent named (the
    caller's key holds a root per test, so the egress is told which)."""
    return task_message(text, data=data, ext={"contractId": root.id.hex()})


def only_child(broker: BrokerSide, root: Root, what: str) -> pb.ContractState:
    children = broker.children(root.id)
    assert len(children) == 1, f"{what}: {len(children)} children of the root"
    return children[0]


def streams_of(agent: AgentProc, context_id: str, task_id: str) -> list[dict[str, Any]]:
    """The streaming requests (SendStreamingMessage, SubscribeToTask) the
    agent logged for a task: by its context (a task-starting message) or id."""
    return [
        e
        for e in agent.since(0, "rpc")
        if e.get("method") in STREAMING_METHODS and (e.get("contextId") == context_id or e.get("taskId") == task_id)
    ]


def gets_of(agent: AgentProc, task_id: str, before_kind: str | None = None) -> list[dict[str, Any]]:
    """The GetTask requests the agent logged for a task; with `before_kind`,
    only those logged before its first line of that kind for the task."""
    out = []
    for entry in agent.entries():
        if before_kind and entry.get("kind") == before_kind and entry.get("taskId") == task_id:
            break
        if entry.get("kind") == "rpc" and entry.get("method") == "GetTask" and entry.get("taskId") == task_id:
            out.append(entry)
    return out


@pytest.mark.streaming
def test_stream_cards(world: World, streamers: Streamers) -> None:
    """A gateway's card says it streams when its agent's card does: the
    streaming worker's gateway and the caller's egress card for it say
    `streaming: true`, the non-streaming worker's say false (push stays off)."""
    with httpx.Client(timeout=30) as http:
        for name, streams in (("streamer", True), ("poller", False)):
            own = http.get(f"{streamers.agents[name].url}/.well-known/agent-card.json").json()
            assert own["capabilities"].get("streaming", False) is streams, own["capabilities"]
            ingress = http.get(f"{streamers.gateways[name].ingress}/.well-known/agent-card.json").json()
            egress = http.get(f"{streamers.peer_url(name)}/.well-known/agent-card.json").json()
            for where, card in (("ingress", ingress), ("egress", egress)):
                capabilities = card.get("capabilities") or {}
                assert capabilities.get("streaming", False) is streams, f"{name}'s {where} card: {capabilities}"
                assert capabilities.get("pushNotifications", False) is False, f"{name}'s {where} card: {capabilities}"
                assert any(e.get("uri") == URI and e.get("required") for e in capabilities.get("extensions") or []), card

    async def body() -> None:
        async with world.user(timeout=60) as user:
            for name, streams in (("streamer", True), ("poller", False)):
                client = await user.client(streamers.peer_url(name), streaming=True)
                assert bool(client._card.capabilities.streaming) is streams, (name, client._card.capabilities)

    run(body(), 60)


@pytest.mark.streaming
def test_stream_through_both_gateways(world: World, streamers: Streamers) -> None:
    """The SDK's streaming client sends SendStreamingMessage to the caller's
    egress (peer `streamer`): the egress delegates, the worker's gateway
    admits, and each of the worker's status updates and artifacts reaches
    the client as the worker sends it (their order against the worker's own
    log); the final event is COMPLETED with the broker's verdict in its
    metadata[URI] (ACCEPTED, the child contract's id and receipt); the child
    is COMPLETED at the broker, judged on the final artifact. The worker's
    gateway followed the task by its stream: the agent got the message as a
    streaming call on the world's binding and no GetTask while it ran. The
    task is then read through the egress like any other."""
    broker = world.broker
    root = broker.open_root(streamers.caller, budget=100, max_depth=2)
    agent = streamers.agents["streamer"]
    message = streamed_message("six times seven, step by step", root)
    seen: list[Seen] = []

    async def body() -> Task:
        async with world.user() as user:
            events = await user.stream(streamers.peer_url("streamer"), message, recorder(agent, message.context_id, seen))
            assert_streamed_as_sent(seen, STREAM_STEPS, {"answer": 42}, "through both gateways")
            last = events[-1]
            child = only_child(broker, root, "one delegation")
            assert event_state(last) == "TASK_STATE_COMPLETED", show_events(events)
            ext = event_ext(last)
            assert ext.get("verdict") == "ACCEPTED", f"the final event's metadata[{URI}]: {ext}\n{show_events(events)}"
            assert ext.get("contractId") == bytes(child.contract_id).hex(), ext
            assert HEX64.fullmatch(ext.get("receiptId") or ""), ext
            task_id = event_task_id(last)
            assert task_id and all(event_task_id(e) in ("", task_id) for e in events), show_events(events)
            # The task, read through the egress afterwards: the same word.
            task = await user.get_task(streamers.peer_url("streamer"), task_id)
            assert state_of(task) == "TASK_STATE_COMPLETED" and output_of(task) == {"answer": 42}, show(task)
            assert ext_of(task).get("verdict") == "ACCEPTED", show(task)
            return task

    task = run(body())
    child = only_child(broker, root, "one delegation")
    assert status_name(broker.state(bytes(child.contract_id))) == "CONTRACT_STATUS_COMPLETED"
    receipt = broker.receipt(ext_of(task)["receiptId"])
    assert receipt.kind == pb.RECEIPT_KIND_COMPLETED and receipt.completion.verdict == pb.VERDICT_ACCEPTED, receipt
    streams = streams_of(agent, message.context_id, task.id)
    assert streams, f"the worker's gateway did not follow the task by a stream: {agent.since(0, 'rpc')}"
    assert_sent_over(streams, world.binding, "the worker's gateway's stream")
    polled = gets_of(agent, task.id, before_kind="finished")
    assert not polled, f"the worker's gateway polled a streaming agent while its task ran: {polled}"
    assert_no_chain_forwarded(streams[0], bytes(child.contract_id).hex(), "the streamed message")


@pytest.mark.streaming
def test_stream_subscribe_through_both_gateways(world: World, streamers: Streamers) -> None:
    """A task started with SendMessage (not waiting) through the caller's
    egress, then followed with SubscribeToTask there: the stream starts with
    the task, brings the worker's step updates while it runs, and ends with
    COMPLETED and the broker's verdict."""
    broker = world.broker
    root = broker.open_root(streamers.caller, budget=100, max_depth=2)
    agent = streamers.agents["streamer"]
    message = streamed_message("six times seven, slowly", root, data={"steps": 6, "stepMs": 300})
    seen: list[Seen] = []

    async def body() -> list[StreamResponse]:
        async with world.user() as user:
            started = await user.send(streamers.peer_url("streamer"), message, return_immediately=True)
            assert started.status.state not in TERMINAL, show(started)
            return await user.subscribe(streamers.peer_url("streamer"), started.id, recorder(agent, message.context_id, seen))

    events = run(body())
    assert events and events[0].HasField("task"), f"SubscribeToTask starts with the task:\n{show_events(events)}"
    early = [s for s in seen if step_of(s.event) is not None and not s.finished]
    assert early, f"no step update came while the task ran:\n{show_events(events)}"
    steps = [step_of(s.event) for s in seen if step_of(s.event) is not None]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), f"steps in order, once:\n{show_events(events)}"
    last = events[-1]
    assert event_state(last) == "TASK_STATE_COMPLETED", show_events(events)
    child = only_child(broker, root, "one delegation")
    assert event_ext(last).get("verdict") == "ACCEPTED", show_events(events)
    assert event_ext(last).get("contractId") == bytes(child.contract_id).hex(), show_events(events)


@pytest.mark.streaming
def test_a_task_streamed_past_the_bound_fails_and_is_canceled(world: World, streamers: Streamers) -> None:
    """The worker appends 128 KiB to one artifact at every step, until its
    task is larger than a GetTask answer may be (the gateway's
    max_message_bytes, 4 MiB): the worker's gateway stops following it, ends
    it FAILED with the reason in its status (its artifacts dropped), moves
    the contract as for any failed task (COMPLETED, judged) and cancels the
    task at the agent. The caller's stream ends with that FAILED task."""
    broker = world.broker
    root = broker.open_root(streamers.caller, budget=100, max_depth=2)
    agent = streamers.agents["streamer"]
    message = streamed_message(
        "a very long answer", root, data={"steps": 48, "stepMs": 20, "appendBytes": 128 * 1024}
    )

    async def body() -> list[StreamResponse]:
        async with world.user() as user:
            return await user.stream(streamers.peer_url("streamer"), message)

    events = run(body())
    last = events[-1]
    assert event_state(last) == "TASK_STATE_FAILED", show_events(events[-3:])
    assert "max_message_bytes" in event_text(last), show_events(events[-3:])
    child = only_child(broker, root, "one delegation")
    assert status_name(broker.state(bytes(child.contract_id))) == "CONTRACT_STATUS_COMPLETED"
    task_id = event_task_id(last)
    wait_for(f"the agent's task {task_id} canceled", lambda: agent.cancels(task_id) or None)


@pytest.mark.streaming
def test_stream_revoked_mid_stream_ends_canceled(world: World, streamers: Streamers) -> None:
    """The principal revokes the root while the worker streams (at its second
    step update): the worker's gateway cancels the agent's task, and the
    caller's stream, through both gateways, ends with the task CANCELED
    (long before the worker's last step); the child contract is REVOKED."""
    broker = world.broker
    root = broker.open_root(streamers.caller, budget=100, max_depth=2)
    agent = streamers.agents["streamer"]
    steps = 200
    message = streamed_message("a long one", root, data={"steps": steps, "stepMs": 100})
    revoked: list[int] = []

    def revoke_at_step_two(event: StreamResponse) -> None:
        if step_of(event) == 2 and not revoked:
            broker.revoke(streamers.caller, root.id, reason="the principal changed its mind")
            revoked.append(step_of(event) or 0)

    async def body() -> list[StreamResponse]:
        async with world.user() as user:
            try:
                return await asyncio.wait_for(
                    user.stream(streamers.peer_url("streamer"), message, revoke_at_step_two), STATE_TIMEOUT_S
                )
            except TimeoutError:
                raise AssertionError(
                    f"the stream was still open {STATE_TIMEOUT_S:.0f} s after it began (revoked: {bool(revoked)})"
                ) from None

    events = run(body())
    assert revoked, f"the stream never reached step 2:\n{show_events(events)}"
    last = events[-1]
    assert event_state(last) == "TASK_STATE_CANCELED", f"the stream's last event:\n{show_events(events)}"
    reached = max(step_of(e) or 0 for e in events)
    assert reached < steps, f"the stream ran to the worker's last step ({reached}) after the revocation"
    task_id = event_task_id(last)
    child = only_child(broker, root, "one delegation")
    assert event_ext(last).get("contractId") == bytes(child.contract_id).hex(), show_events(events)
    assert status_name(broker.state(bytes(child.contract_id))) == "CONTRACT_STATUS_REVOKED"
    wait_for("the worker to log its cancel", lambda: agent.cancels(task_id), 10)
    cancel_calls = [e for e in agent.since(0, "rpc") if e.get("method") == "CancelTask" and e.get("taskId") == task_id]
    assert cancel_calls, f"no CancelTask reached the worker for {task_id}"
    assert_sent_over(cancel_calls, world.binding, "the gateway's CancelTask")
    assert not [e for e in agent.entries() if e.get("kind") == "finished" and e.get("taskId") == task_id]


@pytest.mark.streaming
def test_ingress_follows_streaming_agents_by_stream_and_polls_the_rest(world: World, streamers: Streamers) -> None:
    """Whatever the caller asks, the ingress follows a streaming agent by its
    stream and polls only an agent that does not stream: a SendMessage that
    waits, through the caller's egress, to the streaming worker reaches it
    as a streaming call (or is read once, then followed by SubscribeToTask)
    and is answered settled and judged with no GetTask but that first read
    while the task ran; the stock
    streaming client to the non-streaming worker sends SendMessage (its
    gateway's card says no streaming) and gets one settled, judged task,
    while that worker's gateway polled it (GetTask) and opened no stream."""
    broker = world.broker
    streamer, poller = streamers.agents["streamer"], streamers.agents["poller"]

    async def body() -> tuple[Task, Message, list[StreamResponse], Message]:
        async with world.user() as user:
            root = broker.open_root(streamers.caller, budget=100, max_depth=2)
            to_streamer = streamed_message("six times seven?", root, data={"steps": 3, "stepMs": 300})
            task = await user.send(streamers.peer_url("streamer"), to_streamer)
            root = broker.open_root(streamers.caller, budget=100, max_depth=2)
            to_poller = streamed_message("six times seven?", root)
            events = await user.stream(streamers.peer_url("poller"), to_poller)
            return task, to_streamer, events, to_poller

    task, to_streamer, events, to_poller = run(body())
    assert state_of(task) == "TASK_STATE_COMPLETED" and ext_of(task).get("verdict") == "ACCEPTED", show(task)
    assert output_of(task) == {"answer": 42}, show(task)
    streams = streams_of(streamer, to_streamer.context_id, task.id)
    assert streams, f"the streaming worker was not followed by a stream: {streamer.since(0, 'rpc')}"
    assert_sent_over(streams, world.binding, "the streaming worker's stream")
    polled = gets_of(streamer, task.id, before_kind="finished")
    # A unary start is read once (a quick agent has finished by then), then
    # followed by its stream only.
    assert len(polled) <= 1, f"the streaming worker was polled while its task ran: {polled}"

    assert [event_kind(e) for e in events] == ["task"], f"one answer, not a stream:\n{show_events(events)}"
    polled_task = events[0].task
    assert state_of(polled_task) == "TASK_STATE_COMPLETED", show(polled_task)
    assert ext_of(polled_task).get("verdict") == "ACCEPTED", show(polled_task)
    sent = [e for e in poller.sends_since(0) if e.get("contextId") == to_poller.context_id]
    assert [e["method"] for e in sent] == ["SendMessage"], sent
    assert not streams_of(poller, to_poller.context_id, polled_task.id), "a stream was opened to a non-streaming agent"
    gets = gets_of(poller, polled_task.id)
    assert gets, f"the non-streaming worker was never polled: {poller.since(0, 'rpc')}"
    assert_sent_over(sent + gets, world.binding, "the non-streaming worker's calls")
