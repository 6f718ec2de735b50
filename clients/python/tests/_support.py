"""Test support: runs the real broker binary and drives it through the client.

Everything the broker signs and hands back (a ``pb.Sealed`` contract or
receipt) goes through the helper layer's offline verification here (and is
kept in ``Broker.received`` for the cross-language check at the end of the
session), so each test verifies everything it receives. Also: the Rust
``delegation-broker verify`` CLI as a function, and chains forged under a
test key, to check each term of "Verifying a chain" on its own.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from delegation_broker import (
    ERROR_DOMAIN,
    Agent,
    BrokerKeys,
    Verified,
    VerifiedContract,
    WatchEvent,
    error_info,
    key_id,
    lineage_hash,
    message_class,
    now_ms,
    pae,
    payload_type,
    pb,
    session_stub,
    sha256,
    verify_chain,
    verify_contract,
    verify_every_signature,
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


@dataclass
class Tokens:
    """The ``[tokens]`` table: the resources tokens are minted for, their
    lifetime, and the resource servers that may introspect (client id →
    secret; the config keeps SHA-256 of each secret, in hex)."""

    resources: list[str]
    introspectors: dict[str, str]
    lifetime_minutes: int | None = None

    def toml(self) -> str:
        text = f"\n[tokens]\nresources = [{', '.join(json.dumps(r) for r in self.resources)}]\n"
        if self.lifetime_minutes is not None:
            text += f"lifetime_minutes = {self.lifetime_minutes}\n"
        text += "\n[tokens.introspectors]\n" + "".join(
            f"{json.dumps(client)} = \"{sha256(secret.encode()).hex()}\"\n" for client, secret in self.introspectors.items())
        return text


class BrokerProcess:
    """`delegation-broker serve` on 127.0.0.1:0 with a fresh data directory and
    a config trusting ``attestors`` and letting ``readers`` read every tree;
    ``limits`` adds lines to its ``[limits]`` table, ``env`` variables to its
    environment (e.g. ``BROKER_LOG_FORMAT``); with ``tokens`` it also serves the
    token endpoint (``--tokens 127.0.0.1:0``, ``[tokens]`` from it) at
    ``tokens_url``; ``reader_identities`` become ``[readers] identities`` and
    ``config`` (TOML tables: ``[identity.issuers.NAME]``, ``[orchestrators]``,
    ...) is appended as it is; its stderr goes to ``log_path``."""

    def __init__(self, workdir: Path, attestors: list[Agent], readers: list[Agent] | None = None,
                 limits: dict[str, int] | None = None, env: dict[str, str] | None = None,
                 tokens: Tokens | None = None, reader_identities: list[str] | None = None, config: str = ""):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config_text, config_path = config, workdir / "broker.toml"
        text = f"[trust]\nattestors = [{_hex_keys(attestors)}]\n\n[readers]\nkeys = [{_hex_keys(readers or [])}]\n"
        if reader_identities:
            text += f"identities = [{', '.join(json.dumps(i) for i in reader_identities)}]\n"
        if limits:
            text += "\n[limits]\n" + "".join(f"{name} = {value}\n" for name, value in limits.items())
        if tokens is not None:
            text += tokens.toml()
        if config_text:
            text += "\n" + config_text
        config_path.write_text(text)
        self.log_path = workdir / "broker.log"
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "BROKER_LOG": os.environ.get("BROKER_LOG", "warn"), **(env or {})}
        self.proc = subprocess.Popen(
            [str(broker_bin()), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(workdir / "data"),
             "--config", str(config_path), *(["--tokens", "127.0.0.1:0"] if tokens is not None else [])],
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
        #: With ``tokens``: the token endpoint's URL (``tokens on http://ADDR``), its default issuer.
        self.tokens_url: str | None = None
        if tokens is not None:
            # The broker prints its listeners' lines together, once it serves.
            for _ in range(8):
                try:
                    line = lines.get(timeout=30).decode().strip()
                except queue.Empty:
                    line = ""
                if line.startswith("tokens on "):
                    self.tokens_url = line[len("tokens on "):]
                    break
                if not line:
                    break
            if self.tokens_url is None:
                self.stop()
                raise RuntimeError(f"the broker printed no 'tokens on' line; log:\n{self.log_path.read_text()}")

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

    def __init__(self, workdir: Path, attestor: Agent | None = None, *, limits: dict[str, int] | None = None,
                 env: dict[str, str] | None = None, tokens: Tokens | None = None,
                 reader_identities: list[str] | None = None, config: str = ""):
        self.attestor = attestor or Agent.generate()
        #: Listed under ``[readers]``: may read every tree.
        self.reader = Agent.generate()
        self.process = BrokerProcess(workdir, [self.attestor], [self.reader], limits, env, tokens,
                                     reader_identities, config)
        self.address = self.process.address
        #: The token endpoint's URL when started with ``tokens``, else None.
        self.tokens_url = self.process.tokens_url
        self.channel = grpc.insecure_channel(self.address)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.bare_stub = pb.BrokerStub(self.channel)
        self.stub = session_stub(self.channel, self.reader)
        self.keys = BrokerKeys.fetch(self.stub)
        #: Everything broker-signed received, as (Sealed, "contract" | "receipt").
        self.received: list[tuple[pb.Sealed, str]] = []

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
        return verified

    def check_refusal(self, refusal: pb.Refusal) -> Verified[pb.Receipt]:
        verified = verify_receipt(refusal.receipt, self.keys, refusal.receipt_id)
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
        """Keeps the Sealed of watch events (already verified by the watch)
        for the session's cross-language check."""
        for event in events:
            self.received.append((event.sealed, event.kind))
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

    def chain(self, contract_id: bytes) -> list[VerifiedContract]:
        """GetChain, verified as types.proto says (:func:`verify_chain`), every
        contract's own signature too; the broker's copy of each effective
        predicate must be the derived one."""
        states = list(self.stub.GetChain(pb.GetChainRequest(contract_id=contract_id), timeout=10).chain)
        verified = verify_chain(states, self.keys, contract_id)
        verify_every_signature(states, self.keys)
        for hop, state in zip(verified, states, strict=True):
            assert hop.contract_id == state.contract_id
            assert hop.effective_predicate == state.effective_predicate, hop.contract.depth
        return verified

    def ledger(self, contract_id: bytes) -> pb.Ledger:
        ledger = self.state(contract_id).ledger
        assert ledger.budget == ledger.residual + ledger.reserved + ledger.spent
        return ledger

    def attest(self, agent: Agent, factor: float) -> pb.Envelope:
        return self.attestor.attest(agent.public_key, factor, now_ms() + HOUR_MS, "test")


# --- refusals ----------------------------------------------------------------------


def refusal(call, *ids: bytes) -> tuple[grpc.StatusCode, str, dict[str, str], str]:
    """Runs ``call``, which must fail with the broker's ErrorInfo: (code, reason,
    metadata, message), each of ``ids`` (lowercase hex) written ``<id>`` in the
    metadata and the message, so answers about different ids compare."""

    def masked(text: str) -> str:
        for named in ids:
            text = text.replace(named.hex(), "<id>")
        return text

    try:
        call()
    except grpc.RpcError as error:
        info = error_info(error)
        assert info is not None and info.domain == ERROR_DOMAIN, error
        return (error.code(), info.reason, {k: masked(v) for k, v in info.metadata.items()},
                masked(error.details() or ""))
    raise AssertionError("expected a refusal, the call was answered")


def assert_unknowable(call, real_id: bytes) -> tuple[grpc.StatusCode, str, dict[str, str], str]:
    """``call(id)`` is made by a stranger to ``real_id``'s tree (no party of it,
    nor a configured reader): its answer for ``real_id`` must be its answer for
    a random 32-byte id (code, reason, metadata and message, the id aside), and
    that is NOT_FOUND, so the stranger cannot tell that ``real_id`` exists.
    Returns the answer, as :func:`refusal` does."""
    random_id = os.urandom(32)
    real = refusal(lambda: call(real_id), real_id)
    assert real == refusal(lambda: call(random_id), random_id), "a real id answered unlike a random one"
    assert real[:2] == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND"), real
    return real


# --- the Rust verifier ---------------------------------------------------------------


def rust_verify(args: list[str]) -> subprocess.CompletedProcess:
    """``delegation-broker verify <args>``."""
    return subprocess.run([str(broker_bin()), "verify", *args], capture_output=True, text=True, timeout=60,
                          env={"BROKER_LOG": "error", "PATH": "/usr/bin:/bin"})


def _key_args(public_keys) -> list[str]:
    return [arg for key in public_keys for arg in ("--public-key", bytes(key).hex())]


def rust_chain(path: Path, chain, public_keys, contract_id: bytes | None = None,
               all_signatures: bool = False) -> list[str] | None:
    """Writes ``chain`` (ContractStates or Sealed contracts) as a
    GetChainResponse to ``path`` and verifies it with the Rust CLI: its stdout
    lines when it verifies, None when it does not (stderr then starts with
    ``error:``)."""
    states = [c if isinstance(c, pb.ContractState) else pb.ContractState(contract_id=sha256(c.payload), contract=c)
              for c in chain]
    path.write_bytes(pb.GetChainResponse(chain=states).SerializeToString())
    args = [*_key_args(public_keys), "--chain", str(path)]
    if contract_id is not None:
        args += ["--contract-id", contract_id.hex()]
    if all_signatures:
        args.append("--all-signatures")
    result = rust_verify(args)
    if result.returncode == 0:
        return result.stdout.splitlines()
    assert result.stderr.startswith("error:"), result.stderr
    return None


def rust_receipt(path: Path, sealed: pb.Sealed, public_keys) -> str | None:
    """The Rust CLI's ``--receipt`` verdict: its ``ok receipt ...`` line, or None."""
    path.write_bytes(sealed.SerializeToString())
    result = rust_verify([*_key_args(public_keys), "--receipt", str(path)])
    if result.returncode == 0:
        return result.stdout.strip()
    assert result.stderr.startswith("error:"), result.stderr
    return None


def rust_envelope(path: Path, envelope: pb.Envelope, public_key: bytes) -> bool:
    """The Rust CLI's ``--envelope`` verdict on an agent-signed DSSE envelope."""
    path.write_bytes(envelope.SerializeToString())
    result = rust_verify([*_key_args([public_key]), "--envelope", str(path)])
    if result.returncode == 0:
        assert result.stdout.split() == ["ok", envelope.payload_type, key_id(public_key)]
        return True
    assert result.stderr.startswith("error:"), result.stderr
    return False


def rust_debug(text: str) -> str:
    """``format!("{:?}", text)`` in Rust, for the printable text predicates hold."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}
    return '"' + "".join(escapes.get(ch, ch if ch.isprintable() else f"\\u{{{ord(ch):x}}}") for ch in text) + '"'


def rust_chain_lines(verified: list[VerifiedContract]) -> list[str]:
    """What ``delegation-broker verify --chain`` prints for a chain Python verified."""
    lines = [
        f"depth={v.contract.depth} id={v.contract_id.hex()} delegate={key_id(v.contract.delegate_public_key)} "
        f"budget={v.contract.budget} deadline_ms={v.contract.deadline_ms} trust_ppm={v.contract.cumulative_trust_ppm} "
        f"liability={pb.Liability.Name(v.contract.liability)} effective_predicate={rust_debug(v.effective_predicate)}"
        for v in verified
    ]
    return [*lines, f"ok chain of {len(verified)} contracts"]


# --- chains forged under a test key ----------------------------------------------------


def seal(signer: Agent, message) -> pb.Sealed:
    """``message`` sealed as the broker seals it, but by ``signer``: the payload
    and one signature over PAE(its type, payload)."""
    payload = message.SerializeToString(deterministic=True)
    signature = signer.sign_bytes(payload_type(message), payload).signatures[0].sig
    return pb.Sealed(payload=payload, signature=signature)


def published(*agents: Agent) -> BrokerKeys:
    """``agents``' keys, published as broker keys."""
    return BrokerKeys(pb.BrokerKey(key_id=a.key_id, public_key=a.public_key, current=i == 0) for i, a in enumerate(agents))


def forge_chain(signer: Agent, contracts: list[pb.Contract], link: bool = True) -> list[pb.Sealed]:
    """Seals ``contracts`` by ``signer`` (each naming its key), root first, each
    child's ``parent_id`` set to the id of the contract before it (unless
    ``link`` is False: then they are sealed as given)."""
    out: list[pb.Sealed] = []
    for contract in contracts:
        c = pb.Contract()
        c.CopyFrom(contract)
        c.broker_key_id = signer.key_id
        if link and out:
            c.parent_id = sha256(out[-1].payload)
        out.append(seal(signer, c))
    return out


SYNTHETIC_INTENT = "a synthetic tree"
SYNTHETIC_DEADLINE = 4_000_000_000_000
#: The effective predicates of :func:`synthetic_chain`, root first.
SYNTHETIC_EFFECTIVE = ["(result.a\n)", "(result.a\n)", "(result.a\n) && (result.b\n)", "(result.c\n)"]


def synthetic_chain() -> list[pb.Contract]:
    """Four contracts that satisfy every term of "Verifying a chain" (to be
    linked and sealed by :func:`forge_chain`): a DELEGATE root with predicate
    ``result.a``, a DELEGATE child adding nothing, a DELEGATE grandchild adding
    ``result.b``, and a PRINCIPAL leaf with ``result.c`` alone."""
    lineage = lineage_hash(SYNTHETIC_INTENT)
    delegates = [Agent.from_seed(bytes([i + 1]) * 32).public_key for i in range(4)]
    root = pb.Contract(
        depth=0, intent=SYNTHETIC_INTENT, intent_lineage_hash=lineage, task="root", delegate_public_key=delegates[0],
        budget=100, deadline_ms=SYNTHETIC_DEADLINE, issued_at_ms=1, liability=pb.LIABILITY_DELEGATE,
        predicate="result.a", escalation_channel="e", write_scope=["docs", "src"], labels={"run": "1"},
        policy=pb.Policy(max_depth=4, min_cumulative_trust_ppm=300_000, max_children=8),
        factor_ppm=1_000_000, cumulative_trust_ppm=1_000_000, trust_source=pb.TRUST_SOURCE_ROOT,
    )
    hop = dict(intent_lineage_hash=lineage, issued_at_ms=2, escalation_channel="e")
    return [
        root,
        pb.Contract(depth=1, task="one", delegate_public_key=delegates[1], budget=50, deadline_ms=SYNTHETIC_DEADLINE,
                    liability=pb.LIABILITY_DELEGATE, write_scope=["src/auth"], factor_ppm=900_000,
                    cumulative_trust_ppm=900_000, trust_source=pb.TRUST_SOURCE_ATTESTATION,
                    attestation_digest=sha256(b"attestation"), risk_class="sandboxed", **hop),
        pb.Contract(depth=2, task="two", delegate_public_key=delegates[2], budget=50,
                    deadline_ms=SYNTHETIC_DEADLINE - 1, liability=pb.LIABILITY_DELEGATE, predicate="result.b",
                    write_scope=["src/auth/token.rs", "src/auth"], factor_ppm=500_001, cumulative_trust_ppm=450_000,
                    trust_source=pb.TRUST_SOURCE_STATIC_TABLE, **hop),
        pb.Contract(depth=3, task="three", delegate_public_key=delegates[3], budget=0,
                    deadline_ms=SYNTHETIC_DEADLINE - 1, liability=pb.LIABILITY_PRINCIPAL, predicate="result.c",
                    write_scope=[], factor_ppm=999_999, cumulative_trust_ppm=449_999,
                    trust_source=pb.TRUST_SOURCE_ATTESTATION, **hop),
    ]


def _edit(**changes):
    """A tampering of :func:`synthetic_chain`: ``changes`` maps an index to a
    function editing that contract in place."""
    def apply(contracts: list[pb.Contract]) -> list[pb.Contract]:
        for index, change in changes.items():
            change(contracts[int(index[1:])])
        return contracts
    return apply


def _set(**fields):
    def change(contract: pb.Contract) -> None:
        for name, value in fields.items():
            if name == "policy":
                contract.policy.CopyFrom(value)
            elif name == "labels":
                contract.labels.update(value)
            elif name == "write_scope":
                contract.ClearField("write_scope")
                contract.write_scope.extend(value)
            else:
                setattr(contract, name, value)
    return change


#: (what is wrong, the error it must give, how to break :func:`synthetic_chain`).
#: Every broken chain is re-linked and re-signed, so only the term is wrong.
SYNTHETIC_VIOLATIONS = [
    ("root lineage is not SHA-256(intent)", "contract 0: intent_lineage_hash is not SHA-256",
     _edit(c0=_set(intent="another intent"))),
    ("root trust source", "contract 0: a root's trust", _edit(c0=_set(trust_source=pb.TRUST_SOURCE_STATIC_TABLE))),
    ("root factor", "contract 0: a root's trust", _edit(c0=_set(factor_ppm=999_999))),
    ("root cumulative trust", "contract 0: a root's trust", _edit(c0=_set(cumulative_trust_ppm=999_999))),
    ("root without a policy", "contract 0: the root carries no policy", _edit(c0=lambda c: c.ClearField("policy"))),
    ("first contract not a root", "contract 0: the first contract is not a root", _edit(c0=_set(depth=1))),
    ("child carries an intent", "contract 2: a child carries intent", _edit(c2=_set(intent=SYNTHETIC_INTENT))),
    ("child carries a policy", "contract 1: a child carries intent, policy",
     _edit(c1=_set(policy=pb.Policy(max_depth=64)))),
    ("child carries labels", "contract 3: a child carries intent, policy or labels", _edit(c3=_set(labels={"a": "b"}))),
    ("child lineage differs", "contract 1: intent_lineage_hash differs",
     _edit(c1=_set(intent_lineage_hash=sha256(b"another")))),
    ("depth skips one", "contract 2: depth is not its parent's + 1", _edit(c2=_set(depth=3), c3=_set(depth=4))),
    ("depth above max_depth", "contract 3: depth exceeds", _edit(c0=_set(policy=pb.Policy(max_depth=2)))),
    ("cumulative trust not floored", "contract 2: cumulative_trust_ppm is not floor",
     _edit(c2=_set(cumulative_trust_ppm=450_001))),
    ("cumulative trust rounded up", "contract 3: cumulative_trust_ppm is not floor",
     _edit(c3=_set(cumulative_trust_ppm=450_000))),
    ("factor above 1_000_000", "contract 1: cumulative_trust_ppm is not floor",
     _edit(c1=_set(factor_ppm=1_000_001, cumulative_trust_ppm=1_000_001))),
    ("trust below the minimum", "contract 3: cumulative trust is below",
     _edit(c0=_set(policy=pb.Policy(max_depth=4, min_cumulative_trust_ppm=450_000)))),
    ("budget above the parent's", "contract 2: budget exceeds the parent's", _edit(c2=_set(budget=51))),
    ("negative budget", "contract 3: budget exceeds the parent's", _edit(c3=_set(budget=-1))),
    ("deadline after the parent's", "contract 1: deadline is later", _edit(c1=_set(deadline_ms=SYNTHETIC_DEADLINE + 1))),
    ("scope widened", "contract 2: write_scope reaches outside", _edit(c2=_set(write_scope=["src"]))),
    ("scope widened by a shared name prefix", "contract 1: write_scope reaches outside",
     _edit(c1=_set(write_scope=["srcx"]))),
    ("scope widened into a sibling", "contract 3: write_scope reaches outside",
     _edit(c3=_set(write_scope=["src/auth", "docs"]))),
    ("DELEGATE under PRINCIPAL", "contract 3: a DELEGATE contract under a liability-retaining parent",
     _edit(c2=_set(liability=pb.LIABILITY_PRINCIPAL), c3=_set(liability=pb.LIABILITY_DELEGATE))),
    ("effective predicate too long", "contract 0: the effective predicate exceeds",
     _edit(c0=_set(predicate="x" * 65_536))),
]


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
    SHA-256 of PAE(payload_type, payload) of the signed request, as types.proto says."""
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
