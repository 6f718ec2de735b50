"""Test support: runs the real broker binary and drives it through the client.

Every envelope the broker hands back goes through the helper layer's offline
verification here (and is kept in ``Broker.received`` for the cross-language
check), so each test verifies everything it receives.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from delegation_broker import (
    Agent,
    BrokerKeys,
    Verified,
    VerifiedContract,
    WatchEvent,
    lineage_hash,
    now_ms,
    pae,
    pb,
    sha256,
    verify_contract,
    verify_envelope,
    message_class,
    session_stub,
    verify_receipt,
    watch,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
CLIENT_ROOT = Path(__file__).resolve().parents[1]
HOUR_MS = 3_600_000
INTENT = "Fix the token refresh bug in src/auth/ and document it"
ESCALATION = "broker://escalate"


def broker_bin() -> Path:
    """$BROKER_BIN (relative paths are taken from the repo root), else the debug build."""
    path = Path(os.environ.get("BROKER_BIN") or "target/debug/delegation-broker")
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise RuntimeError(
            f"broker binary not found at {path}: build it (cargo build --bin delegation-broker) or set BROKER_BIN"
        )
    return path


def _hex_keys(agents: list[Agent]) -> str:
    return ", ".join(f'"{a.public_key.hex()}"' for a in agents)


class BrokerProcess:
    """`delegation-broker serve` on 127.0.0.1:0 with a fresh data directory and
    a config trusting ``attestors`` and letting ``readers`` read every tree;
    ``limits`` adds lines to its ``[limits]`` table."""

    def __init__(self, workdir: Path, attestors: list[Agent], readers: list[Agent] | None = None,
                 limits: dict[str, int] | None = None):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "broker.toml"
        text = f"[trust]\nattestors = [{_hex_keys(attestors)}]\n\n[readers]\nkeys = [{_hex_keys(readers or [])}]\n"
        if limits:
            text += "\n[limits]\n" + "".join(f"{name} = {value}\n" for name, value in limits.items())
        config.write_text(text)
        self.log_path = workdir / "broker.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, BROKER_LOG=os.environ.get("BROKER_LOG", "warn"))
        self.proc = subprocess.Popen(
            [str(broker_bin()), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(workdir / "data"),
             "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        lines: queue.Queue[bytes] = queue.Queue()

        def drain() -> None:  # keep reading so the broker never blocks on (or dies of) a closed stdout
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(b"")

        threading.Thread(target=drain, daemon=True).start()
        try:
            first = lines.get(timeout=30).decode().strip()
        except queue.Empty:
            first = ""
        prefix = "listening on "
        if not first.startswith(prefix):
            self.stop()
            raise RuntimeError(f"broker did not start (first line {first!r}); log:\n{self.log_path.read_text()}")
        self.address = first[len(prefix):]

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it lingers; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@dataclass
class Root:
    id: bytes
    lineage: bytes
    contract: pb.Contract


@dataclass
class Outcome:
    response: pb.DelegateResponse
    issued: VerifiedContract | None = None
    refused: Verified[pb.Receipt] | None = None
    receipt_id: bytes = b""

    def contract(self) -> VerifiedContract:
        refusal = self.refused.message if self.refused else None
        assert self.issued is not None, f"expected an issued contract, got refusal {refusal}"
        return self.issued

    def receipt(self) -> pb.Receipt:
        assert self.refused is not None, "expected a refusal, the child was issued"
        return self.refused.message


class Broker:
    """A running broker plus a stub, its published keys, a trusted attestor and
    a configured reader.

    ``stub`` carries the reader's session (``session_stub``), so it reads every
    tree, as the tests did before reads needed an identity; ``bare_stub``
    carries none. Tests of who may read use :meth:`stub_for`."""

    def __init__(self, workdir: Path, attestor: Agent | None = None, *, limits: dict[str, int] | None = None):
        self.attestor = attestor or Agent.generate()
        #: Listed under ``[readers]``: may read every tree.
        self.reader = Agent.generate()
        self.process = BrokerProcess(workdir, [self.attestor], [self.reader], limits)
        self.address = self.process.address
        self.channel = grpc.insecure_channel(self.address)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.bare_stub = pb.BrokerStub(self.channel)
        self.stub = session_stub(self.channel, self.reader)
        self.keys = BrokerKeys.fetch(self.stub)
        #: Every broker-signed envelope received, as (envelope, kind).
        self.received: list[tuple[pb.Envelope, str]] = []

    def close(self) -> int:
        self.channel.close()
        return self.process.stop()

    def stub_for(self, agent: Agent) -> pb.BrokerStub:
        """A stub on the same channel whose reads are ``agent``'s (session opened now)."""
        return session_stub(self.channel, agent)

    # --- requests -----------------------------------------------------------------

    def open_root(self, orchestrator: Agent, *, budget: int = 100, max_depth: int = 4, min_trust: int = 0,
                  max_children: int = 64, predicate: str = "", deadline_ms: int | None = None,
                  scope: tuple[str, ...] = ("src", "docs"), intent: str = INTENT,
                  retry_headroom: bool = True) -> Root:
        request = orchestrator.open_root(
            intent=intent,
            budget=budget,
            deadline_ms=deadline_ms or now_ms() + HOUR_MS,
            policy=pb.Policy(max_depth=max_depth, min_cumulative_trust_ppm=min_trust, max_children=max_children,
                             disable_retry_headroom=not retry_headroom),
            predicate=predicate,
            write_scope=list(scope),
        )
        response = self.stub.OpenRoot(request, timeout=10)
        issued = self.check_issued(response.issued)
        assert issued.contract.depth == 0 and issued.contract.delegate_public_key == orchestrator.public_key
        assert issued.contract.intent_lineage_hash == lineage_hash(intent)
        return Root(id=issued.contract_id, lineage=issued.contract.intent_lineage_hash, contract=issued.contract)

    def delegate(self, holder: Agent, body: pb.DelegateBody) -> Outcome:
        return self.check_outcome(self.stub.Delegate(holder.delegate(body), timeout=10))

    # --- verification of everything received --------------------------------------

    def check_issued(self, issued: pb.IssuedContract) -> VerifiedContract:
        verified = verify_contract(issued.contract, self.keys, issued.contract_id)
        self.received.append((issued.contract, "contract"))
        self.received.extend((proof, "hop proof") for proof in verified.contract.hop_proofs)
        return verified

    def check_refusal(self, refusal: pb.Refusal) -> Verified[pb.Receipt]:
        verified = verify_envelope(refusal.receipt, self.keys, pb.Receipt)
        assert sha256(refusal.receipt.payload) == refusal.receipt_id, "receipt id = SHA-256(payload)"
        assert verified.message.kind == pb.RECEIPT_KIND_REFUSED
        again = self.stub.GetReceipt(pb.GetReceiptRequest(receipt_id=refusal.receipt_id), timeout=10).receipt
        assert again == refusal.receipt, "GetReceipt returns the receipt exactly as issued"
        self.received.append((refusal.receipt, "receipt"))
        return verified

    def check_outcome(self, response: pb.DelegateResponse) -> Outcome:
        which = response.WhichOneof("outcome")
        if which == "issued":
            return Outcome(response, issued=self.check_issued(response.issued))
        assert which == "refused", f"no outcome in {response}"
        return Outcome(response, refused=self.check_refusal(response.refused), receipt_id=response.refused.receipt_id)

    # --- lifecycle (mirrors the helpers at the bottom of tests/e2e/harness.rs) -----

    def lifecycle(self, rpc: str, signer: Agent, body=None, **fields) -> pb.Receipt:
        """Signs a ``<rpc>Body`` as ``signer`` (``Agent.accept`` / ``.complete`` / ...),
        calls ``stub.<rpc>`` and returns the verified receipt (see :meth:`check_receipt`)."""
        request = getattr(signer, RPC_METHODS[rpc])(body, **fields)
        response = getattr(self.stub, rpc)(request, timeout=10)
        return self.check_receipt(response, request, RECEIPT_KINDS[rpc])

    def accept(self, delegate: Agent, contract: bytes, host: Agent | None = None) -> pb.Receipt:
        return self.lifecycle("Accept", delegate, contract_id=contract,
                              host_public_key=host.public_key if host else b"")

    def record(self, host: Agent, contract: bytes, observations: list[pb.Observation]) -> pb.Receipt:
        return self.lifecycle("RecordReceipts", host, contract_id=contract, observations=observations)

    def complete(self, delegate: Agent, body: pb.CompleteBody) -> pb.Receipt:
        return self.lifecycle("Complete", delegate, body)

    def escalate(self, delegate: Agent, contract: bytes, reason: str) -> pb.Receipt:
        return self.lifecycle("Escalate", delegate, contract_id=contract, reason=reason)

    def revoke(self, signer: Agent, contract: bytes, reason: str = "no longer needed") -> pb.Receipt:
        return self.lifecycle("Revoke", signer, contract_id=contract, reason=reason)

    def decline(self, delegate: Agent, contract: bytes, reason: str) -> pb.Receipt:
        return self.lifecycle("Decline", delegate, contract_id=contract, reason=reason)

    def adjudicate(self, principal: Agent, contract: bytes, verdict: int, reason: str) -> pb.Receipt:
        return self.lifecycle("Adjudicate", principal, contract_id=contract, verdict=verdict, reason=reason)

    def check_receipt(self, response, request=None, kind: int | None = None) -> pb.Receipt:
        """Any lifecycle response: the receipt verifies under the published keys,
        its id is SHA-256(payload), GetReceipt returns the same bytes, and it
        names the request (digest and signer) that caused it."""
        receipt = verify_receipt(response.receipt, self.keys, response.receipt_id).message
        again = self.stub.GetReceipt(pb.GetReceiptRequest(receipt_id=response.receipt_id), timeout=10).receipt
        assert again == response.receipt, "GetReceipt returns the receipt exactly as issued"
        if request is not None:
            assert receipt.request_digest == request_digest(request)
            body = message_of(request)
            assert receipt.requester_public_key == body.header.agent_public_key
            assert receipt.contract_id == body.contract_id
        if kind is not None:
            assert receipt.kind == kind, f"{pb.ReceiptKind.Name(receipt.kind)}, expected {pb.ReceiptKind.Name(kind)}"
        self.received.append((response.receipt, "receipt"))
        return receipt

    def watched(self, events: list[WatchEvent]) -> list[WatchEvent]:
        """Keeps the envelopes of watch events (already verified by the watch)
        for the session's cross-language check."""
        for event in events:
            self.received.append((event.envelope, event.kind))
            if event.contract is not None:
                self.received.extend((proof, "hop proof") for proof in event.contract.hop_proofs)
        return events

    def collect(self, contract_id: bytes, cursor: int, n: int) -> list[WatchEvent]:
        """The first ``n`` events of a watch from ``cursor``, then the stream is cancelled."""
        with watch(self.stub, contract_id, cursor, keys=self.keys, timeout=30) as w:
            events = [next(w) for _ in range(n)]
        return self.watched(events)

    def tree(self, root: bytes) -> list[pb.ContractState]:
        """Every contract under ``root`` (paged ListChildren), then the root."""
        out, queue = [], [root]
        while queue:
            parent, token = queue.pop(), b""
            while True:
                page = self.stub.ListChildren(
                    pb.ListChildrenRequest(contract_id=parent, page_size=7, page_token=token), timeout=10)
                queue.extend(c.contract_id for c in page.children)
                out.extend(page.children)
                token = page.next_page_token
                if not token:
                    break
        return out + [self.state(root)]

    def assert_ledgers_balance(self, root: bytes) -> None:
        """budget = residual + reserved + spent everywhere, and reserved = the
        budgets of the open children."""
        tree = self.tree(root)
        parents = {s.contract_id: pb.Contract.FromString(s.contract.payload).parent_id for s in tree}
        for state in tree:
            ledger = state.ledger
            assert ledger.budget == ledger.residual + ledger.reserved + ledger.spent, state.contract_id.hex()
            assert ledger.reserved >= 0 and ledger.spent >= 0
            open_children = [c for c in tree if parents[c.contract_id] == state.contract_id
                             and c.status in (pb.CONTRACT_STATUS_OPEN, pb.CONTRACT_STATUS_ACCEPTED)]
            assert ledger.reserved == sum(c.ledger.budget for c in open_children), state.contract_id.hex()
            assert ledger.open_children == len(open_children)

    # --- reads ------------------------------------------------------------------------

    def state(self, contract_id: bytes) -> pb.ContractState:
        state = self.stub.GetContract(pb.GetContractRequest(contract_id=contract_id), timeout=10).contract
        verify_contract(state.contract, self.keys, state.contract_id)
        assert state.contract_id == contract_id
        return state

    def ledger(self, contract_id: bytes) -> pb.Ledger:
        ledger = self.state(contract_id).ledger
        assert ledger.budget == ledger.residual + ledger.reserved + ledger.spent
        return ledger

    def attest(self, agent: Agent, factor: float) -> pb.Envelope:
        return self.attestor.attest(agent.public_key, factor, now_ms() + HOUR_MS, "test")


def child(parent: bytes, lineage: bytes, delegate: Agent, budget: int, **fields) -> pb.DelegateBody:
    """A Delegate body (no header: the signer adds one) with liability PRINCIPAL
    and nothing else asked of it."""
    values = dict(
        parent_id=parent,
        intent_lineage_hash=lineage,
        task="work on src/auth/token.rs",
        delegate_public_key=delegate.public_key,
        budget=budget,
        liability=pb.LIABILITY_PRINCIPAL,
        write_scope=["src"],
    )
    values.update(fields)
    return pb.DelegateBody(**values)


def liable_child(parent: bytes, lineage: bytes, delegate: Agent, budget: int, predicate: str, **fields) -> pb.DelegateBody:
    """The same with liability DELEGATE, an escalation channel and ``predicate``."""
    values = dict(liability=pb.LIABILITY_DELEGATE, predicate=predicate, escalation_channel=ESCALATION)
    values.update(fields)
    return child(parent, lineage, delegate, budget, **values)


#: Agent method signing each lifecycle RPC's body, and the receipt kind it answers with.
RPC_METHODS = {
    "Accept": "accept", "Decline": "decline", "Complete": "complete", "Adjudicate": "adjudicate",
    "Escalate": "escalate", "Revoke": "revoke", "RecordReceipts": "record_receipts",
}
RECEIPT_KINDS = {
    "Accept": pb.RECEIPT_KIND_ACCEPTED, "Decline": pb.RECEIPT_KIND_DECLINED, "Complete": pb.RECEIPT_KIND_COMPLETED,
    "Adjudicate": pb.RECEIPT_KIND_ADJUDICATED, "Escalate": pb.RECEIPT_KIND_ESCALATED,
    "Revoke": pb.RECEIPT_KIND_REVOKED, "RecordReceipts": pb.RECEIPT_KIND_OBSERVED,
}


def request_digest(request) -> bytes:
    """What the broker records as ``request_digest`` (receipts and contracts):
    SHA-256 of PAE(payload_type, payload) of the signed request (src/service/auth.rs).
    NB: types.proto documents it as "SHA-256 of the signed request payload"."""
    return sha256(pae(request.signed.payload_type, request.signed.payload))


def message_of(request):
    """The body a signed ``<Name>Request`` carries, decoded."""
    return message_class(request.signed.payload_type).FromString(request.signed.payload)


def mutation(path: str, units: int) -> pb.Observation:
    return pb.Observation(kind=pb.OBSERVATION_KIND_MUTATION, path=path, units=units, at_ms=now_ms())


def tool_call(tool: str, units: int) -> pb.Observation:
    return pb.Observation(kind=pb.OBSERVATION_KIND_TOOL_CALL, tool=tool, units=units, at_ms=now_ms())


def read(path: str, units: int = 0) -> pb.Observation:
    return pb.Observation(kind=pb.OBSERVATION_KIND_READ, path=path, units=units, at_ms=now_ms())


def codes(receipt: pb.Receipt) -> list[int]:
    return [v.code for v in receipt.violations]
