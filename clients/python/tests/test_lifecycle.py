"""The contract lifecycle from Python (mirrors tests/e2e/lifecycle.rs): seed
001's failure replayed on host-observed facts, attribution, revocation
cascades, expiry, resumable watches and refusals that change nothing.

Every request is signed in Python; every receipt received (by a call or on a
watch) is verified offline in Python, and again by the Rust verifier at the
end of the session (conftest.py)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import grpc
import pytest
from _support import Broker, Root, assert_unknowable, child, liable_child, mutation, read, tool_call

from delegation_broker import (
    Agent,
    VerificationError,
    WatchEvent,
    call_idempotent,
    error_info,
    now_ms,
    pb,
    sha256,
    verify_receipt,
    watch,
)

SEED_001_PREDICATE = "result.schema_valid && result.within_scope"
PATCH_SCHEMA = '{"type":"object","required":["patch"],"properties":{"patch":{"type":"string"}}}'
OUTPUT = '{"patch":"--- a/src/auth/token.rs"}'


@dataclass
class Chain:
    orchestrator: Agent
    planner: Agent
    executor: Agent
    host: Agent
    root: Root
    planner_id: bytes
    executor_id: bytes


def seed_001_chain(broker: Broker, *, executor_deadline_ms: int = 0) -> Chain:
    """orchestrator (root 28) → planner (25, liable, seed 001's predicate,
    accepted) → executor (20, liable, no predicate of its own, a host, a
    schema, accepted). Retry headroom is off so seed 001's original chain can
    be issued at all."""
    orchestrator, planner, executor, host = (Agent.generate() for _ in range(4))
    root = broker.open_root(orchestrator, budget=28, retry_headroom=False)
    assert root.contract.policy.disable_retry_headroom
    planner_id = broker.delegate(orchestrator, liable_child(
        root.id, root.lineage, planner, 25, SEED_001_PREDICATE, min_retry_cost=12)).contract().contract_id
    broker.accept(planner, planner_id)
    issued = broker.delegate(planner, liable_child(
        planner_id, root.lineage, executor, 20, "", min_retry_cost=12, write_scope=["src/auth"],
        host_public_key=host.public_key, result_schema_json=PATCH_SCHEMA, deadline_ms=executor_deadline_ms)).contract()
    assert broker.chain(issued.contract_id)[-1].effective_predicate == f"({SEED_001_PREDICATE}\n)"
    assert issued.contract.host_public_key == host.public_key
    accepted = broker.accept(executor, issued.contract_id)
    assert accepted.kind == pb.RECEIPT_KIND_ACCEPTED and accepted.root_id == root.id
    assert broker.state(issued.contract_id).status == pb.CONTRACT_STATUS_ACCEPTED
    return Chain(orchestrator, planner, executor, host, root, planner_id, issued.contract_id)


def completion(contract: bytes, **fields) -> pb.CompleteBody:
    values = dict(contract_id=contract, output_json=OUTPUT,
                  report=pb.TypedReport(status="done", summary="fixed the refresh"), claim="success", consumed=18)
    values.update(fields)
    return pb.CompleteBody(**values)


def refused(call, code: grpc.StatusCode, reason: str | None = None, field: str | None = None):
    """Runs ``call``; it must fail with ``code`` and (when given) ErrorInfo ``reason`` / ``field``."""
    with pytest.raises(grpc.RpcError) as raised:
        call()
    error = raised.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    info = error_info(error)
    assert info is not None and info.domain == "delegation.broker.v1"
    if reason is not None:
        assert info.reason == reason, f"{info.reason}: {error.details()}"
    if field is not None:
        assert info.metadata["field"] == field
    return info


def ledger(broker: Broker, contract: bytes) -> tuple[int, int, int]:
    value = broker.ledger(contract)
    return value.reserved, value.spent, value.residual


class Watcher:
    """Consumes a watch on a thread, so the test can wait for live events."""

    def __init__(self, broker: Broker, contract_id: bytes):
        self.broker = broker
        self.watch = watch(broker.stub, contract_id, keys=broker.keys, timeout=60)
        self.events: list[WatchEvent] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self.watch:
                self._queue.put(event)
        except Exception as error:  # noqa: BLE001 - handed to the test thread
            self._queue.put(error)
        self._queue.put(None)

    def until(self, kind: int) -> WatchEvent:
        """Events up to and including the next receipt of ``kind``."""
        while True:
            event = self._queue.get(timeout=15)
            if isinstance(event, Exception):
                raise event
            assert event is not None, "the watch ended early"
            self.events.append(event)
            if event.receipt is not None and event.receipt.kind == kind:
                return event

    def stop(self) -> None:
        self.watch.cancel()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()
        rest = []
        while (item := self._queue.get(timeout=1)) is not None:
            if isinstance(item, Exception):
                raise item
            rest.append(item)
        self.events.extend(rest)
        self.broker.watched(self.events)


def shape(events: list[WatchEvent]) -> list[str]:
    return [e.kind if e.contract else pb.ReceiptKind.Name(e.receipt.kind) for e in events]


def test_seed_001_failure_is_rejected_on_observed_facts_and_escalation_reaches_the_orchestrator(broker):
    c = seed_001_chain(broker)
    root_watch = Watcher(broker, c.root.id)  # opened from Python on the root: history, then live

    observed = broker.record(c.host, c.executor_id, [
        tool_call("edit", 6), mutation("src/auth/token.rs", 6), mutation("docs/auth.md", 6)])
    assert observed.kind == pb.RECEIPT_KIND_OBSERVED and observed.observations == 3

    receipt = broker.complete(c.executor, completion(c.executor_id))
    done = receipt.completion
    assert done.verdict == pb.VERDICT_REJECTED
    assert [r.criterion for r in done.refused_criteria] == ["result.within_scope"]
    assert done.refused_criteria[0].reason
    assert done.claim == "success", "the claim is stored beside the verdict"
    assert done.has_report and done.schema_valid and not done.within_scope
    assert list(done.out_of_scope_paths) == ["docs/auth.md"]
    assert done.out_of_scope_path_count == 1
    assert (done.consumed, done.returned, done.overspend) == (18, 2, 0)
    assert ledger(broker, c.planner_id) == (0, 18, 7)
    assert broker.state(c.executor_id).status == pb.CONTRACT_STATUS_COMPLETED

    # The watch has caught up with the completion; the escalation arrives live.
    root_watch.until(pb.RECEIPT_KIND_COMPLETED)
    request = c.planner.escalate(contract_id=c.planner_id, reason="executor out of scope; cannot retry")
    response = broker.stub.Escalate(request, timeout=10)
    escalation = broker.check_receipt(response, request, pb.RECEIPT_KIND_ESCALATED)
    seen = root_watch.until(pb.RECEIPT_KIND_ESCALATED)
    assert seen.receipt == escalation and seen.sealed == response.receipt and seen.id == response.receipt_id
    notice = seen.receipt.escalation
    assert not notice.retry_feasible, notice
    assert notice.principal_residual == 10, "28 - 18 spent by the planner's subtree"
    assert notice.reason == "executor out of scope; cannot retry"
    assert broker.state(c.planner_id).status == pb.CONTRACT_STATUS_UNRESOLVABLE
    assert ledger(broker, c.root.id) == (0, 18, 10)
    broker.assert_ledgers_balance(c.root.id)

    root_watch.stop()
    assert shape(root_watch.events) == [
        "contract", "contract", "RECEIPT_KIND_ACCEPTED", "contract", "RECEIPT_KIND_ACCEPTED",
        "RECEIPT_KIND_OBSERVED", "RECEIPT_KIND_COMPLETED", "RECEIPT_KIND_ESCALATED"]
    assert [e.id for e in root_watch.events if e.contract] == [c.root.id, c.planner_id, c.executor_id]
    cursors = [e.cursor for e in root_watch.events]
    assert cursors == sorted(set(cursors)), "commit order, nothing twice"
    assert root_watch.events[-2].receipt == receipt


def test_in_scope_work_is_accepted_and_attributed_to_the_producing_hop(broker):
    c = seed_001_chain(broker)
    broker.record(c.host, c.executor_id, [read("src/auth/token.rs"), mutation("src/auth/token.rs", 18)])
    done = broker.complete(c.executor, completion(c.executor_id)).completion
    assert done.verdict == pb.VERDICT_ACCEPTED
    assert list(done.refused_criteria) == [] and done.within_scope and done.schema_valid
    assert done.attribution.agent_public_key == c.executor.public_key
    assert done.attribution.depth == 2
    assert list(done.attribution.chain) == [c.root.id, c.planner_id, c.executor_id]
    assert done.result_digest == sha256(OUTPUT.encode())
    assert (done.consumed, done.returned) == (18, 2)
    broker.assert_ledgers_balance(c.root.id)


def test_output_violating_the_result_schema_is_rejected_on_schema_valid(broker):
    c = seed_001_chain(broker)
    broker.record(c.host, c.executor_id, [mutation("src/auth/token.rs", 5)])
    done = broker.complete(c.executor, completion(c.executor_id, output_json='{"patch": 7}', report=None)).completion
    assert done.verdict == pb.VERDICT_REJECTED
    assert [r.criterion for r in done.refused_criteria] == ["result.schema_valid"]
    assert not done.schema_valid and done.within_scope and not done.has_report
    assert (done.consumed, done.returned) == (5, 15), "host-observed units win over the reported 18"


def test_revocation_cascades_and_returns_every_reservation(broker):
    c = seed_001_chain(broker)
    receipt = broker.revoke(c.orchestrator, c.planner_id)
    assert list(receipt.revoked_ids) == [c.planner_id, c.executor_id]
    assert receipt.reason == "no longer needed"
    for contract in (c.planner_id, c.executor_id):
        assert broker.state(contract).status == pb.CONTRACT_STATUS_REVOKED
    root = broker.ledger(c.root.id)
    assert (root.reserved, root.residual, root.open_children) == (0, 28, 0)
    refused(lambda: broker.complete(c.executor, completion(c.executor_id)), grpc.StatusCode.FAILED_PRECONDITION)
    # Only an ancestor's holder may revoke: the executor cannot revoke its parent.
    refused(lambda: broker.revoke(c.executor, c.planner_id), grpc.StatusCode.PERMISSION_DENIED, "NOT_ANCESTOR")
    broker.assert_ledgers_balance(c.root.id)


def test_any_ancestor_may_revoke_and_only_open_descendants_are_ended(broker):
    c = seed_001_chain(broker)
    # The orchestrator holds the grandparent of the executor's contract.
    receipt = broker.revoke(c.orchestrator, c.executor_id, "over budget elsewhere")
    assert list(receipt.revoked_ids) == [c.executor_id]
    assert broker.state(c.planner_id).status == pb.CONTRACT_STATUS_ACCEPTED
    assert ledger(broker, c.planner_id) == (0, 0, 25)
    # Revoking the planner now ends it alone: the executor had already ended.
    assert list(broker.revoke(c.orchestrator, c.planner_id).revoked_ids) == [c.planner_id]
    broker.assert_ledgers_balance(c.root.id)


def test_a_resumed_watch_misses_nothing_and_repeats_nothing(broker):
    c = seed_001_chain(broker)
    everything = broker.collect(c.root.id, 0, 5)  # root, planner, accepted, executor, accepted
    assert shape(everything) == ["contract", "contract", "RECEIPT_KIND_ACCEPTED", "contract", "RECEIPT_KIND_ACCEPTED"]
    first = broker.collect(c.root.id, 0, 3)
    assert first == everything[:3]
    # More happens while the client is away.
    broker.record(c.host, c.executor_id, [mutation("src/auth/a.rs", 1)])
    resumed = broker.collect(c.root.id, first[-1].cursor, 3)
    assert resumed[:2] == everything[3:]
    assert resumed[2].receipt.kind == pb.RECEIPT_KIND_OBSERVED
    assert resumed[2].cursor > everything[4].cursor, "the new event comes after everything seen"
    cursors = [e.cursor for e in first + resumed]
    assert all(a < b for a, b in zip(cursors, cursors[1:])), "no event twice, in commit order"


def test_watch_resume_continues_after_the_last_event_yielded(broker):
    c = seed_001_chain(broker)
    w = watch(broker.stub, c.root.id, keys=broker.keys, timeout=30)
    seen = [next(w), next(w)]
    assert w.cursor == seen[-1].cursor
    broker.revoke(c.orchestrator, c.planner_id)
    w = w.resume(timeout=30)  # cancels the first stream, opens one after seen[-1]
    with w:
        # The cascade ends the executor first (its own REVOKED receipt),
        # then the planner, whose receipt lists both.
        while not (seen[-1].receipt and seen[-1].receipt.kind == pb.RECEIPT_KIND_REVOKED
                   and seen[-1].receipt.contract_id == c.planner_id):
            seen.append(next(w))
    assert next(w, None) is None, "a cancelled watch just stops"
    broker.watched(seen)
    assert shape(seen) == ["contract", "contract", "RECEIPT_KIND_ACCEPTED", "contract", "RECEIPT_KIND_ACCEPTED",
                           "RECEIPT_KIND_REVOKED", "RECEIPT_KIND_REVOKED"]
    assert seen[-2].receipt.contract_id == c.executor_id
    assert list(seen[-2].receipt.revoked_ids) == [c.executor_id]
    assert list(seen[-1].receipt.revoked_ids) == [c.planner_id, c.executor_id]


def test_a_subtree_watch_sees_only_its_subtree(broker):
    c = seed_001_chain(broker)
    broker.record(c.host, c.executor_id, [mutation("src/auth/token.rs", 3)])
    events = broker.collect(c.executor_id, 0, 3)
    assert shape(events) == ["contract", "RECEIPT_KIND_ACCEPTED", "RECEIPT_KIND_OBSERVED"]
    assert events[0].id == c.executor_id
    assert {e.receipt.contract_id for e in events[1:]} == {c.executor_id}
    # A watch from a later cursor does not know the subtree's start; it still verifies every event.
    assert broker.collect(c.executor_id, events[0].cursor, 2) == events[1:]
    # A refused delegation is an event of the parent it was asked from.
    refusal = broker.delegate(c.executor, child(c.executor_id, c.root.lineage, Agent.generate(), 21,
                                                write_scope=["src/auth"]))
    assert refusal.receipt().primary == pb.INVARIANT_CODE_BUDGET_EXCEEDS_PARENT
    (event,) = broker.collect(c.executor_id, events[-1].cursor, 1)
    assert event.receipt.kind == pb.RECEIPT_KIND_REFUSED and event.id == refusal.receipt_id


def test_the_watch_helper_refuses_what_does_not_verify(broker):
    c = seed_001_chain(broker)

    class Tampering:
        """A stub whose Watch flips one payload bit of the third event, or repeats a cursor."""

        def __init__(self, mode):
            self.mode = mode

        def Watch(self, request, timeout=None):  # noqa: N802 - the gRPC method name
            inner = broker.stub.Watch(request, timeout=timeout)
            mode = self.mode

            class Call:
                def __init__(self):
                    self.n = 0

                def __iter__(self):
                    return self

                def __next__(self):
                    response = next(inner)
                    self.n += 1
                    if self.n == 3:
                        out = pb.WatchResponse()
                        out.CopyFrom(response)
                        if mode == "payload":
                            sealed = getattr(out, out.WhichOneof("event"))
                            sealed.payload = sealed.payload[:-1] + bytes([sealed.payload[-1] ^ 1])
                        else:
                            out.cursor = 1
                        return out
                    return response

                def cancel(self):
                    inner.cancel()

            return Call()

        def GetBrokerKeys(self, request, timeout=None):  # noqa: N802
            return broker.stub.GetBrokerKeys(request, timeout=timeout)

    for mode, message in (("payload", "signature does not verify|payload is not a"), ("cursor", "does not advance")):
        w = watch(Tampering(mode), c.root.id, keys=broker.keys, timeout=30)
        next(w), next(w)
        with pytest.raises(VerificationError, match=message):
            next(w)
        assert next(w, None) is None, "the stream was cancelled"


def test_watching_an_unknown_contract_is_not_found(broker):
    w = watch(broker.stub, b"\x07" * 32, keys=broker.keys, timeout=10)
    refused(lambda: next(w), grpc.StatusCode.NOT_FOUND)


def test_expired_contracts_return_their_budget_and_late_completions_are_refused(broker):
    c = seed_001_chain(broker, executor_deadline_ms=now_ms() + 1_500)
    with watch(broker.stub, c.executor_id, keys=broker.keys, timeout=30) as w:
        events = []
        while not (events and events[-1].receipt and events[-1].receipt.kind == pb.RECEIPT_KIND_EXPIRED):
            events.append(next(w))  # the broker's sweeper expires it within about a second of its deadline
    broker.watched(events)
    assert list(events[-1].receipt.revoked_ids) == [c.executor_id]
    assert broker.state(c.executor_id).status == pb.CONTRACT_STATUS_EXPIRED
    planner = broker.ledger(c.planner_id)
    assert (planner.reserved, planner.open_children) == (0, 0)
    info = refused(lambda: broker.complete(c.executor, completion(c.executor_id)), grpc.StatusCode.FAILED_PRECONDITION)
    assert info.reason in ("LATE", "WRONG_STATE")
    broker.assert_ledgers_balance(c.root.id)


def test_bad_lifecycle_requests_are_refused_and_change_nothing(broker):
    c = seed_001_chain(broker)
    before = broker.ledger(c.planner_id)

    # Observations from a key that is not the contract's host, but a party of the tree (its delegate).
    refused(lambda: broker.record(c.executor, c.executor_id, [mutation("src/auth/x", 1)]),
            grpc.StatusCode.PERMISSION_DENIED, "NOT_HOST")
    # A stranger to the tree, whatever it asks, is answered as for a contract that does not exist.
    stranger = Agent.generate()
    for call in (lambda cid: broker.accept(stranger, cid),
                 lambda cid: broker.decline(stranger, cid, "no"),
                 lambda cid: broker.complete(stranger, completion(cid)),
                 lambda cid: broker.escalate(stranger, cid, "stuck"),
                 lambda cid: broker.revoke(stranger, cid),
                 lambda cid: broker.record(stranger, cid, [mutation("src/auth/x", 1)]),
                 lambda cid: broker.adjudicate(stranger, cid, pb.VERDICT_ACCEPTED, "fine")):
        for contract in (c.executor_id, c.root.id):
            _, _, metadata, _ = assert_unknowable(call, contract)
            assert metadata == {"what": "contract", "id": "<id>"}
    # An output over the size limit.
    big = completion(c.executor_id, output_json='{"patch":"%s"}' % ("x" * 300 * 1024))
    refused(lambda: broker.complete(c.executor, big), grpc.StatusCode.INVALID_ARGUMENT, field="body.output_json")
    # A JSON Schema that does not compile, at delegation.
    bad_schema = child(c.executor_id, c.root.lineage, Agent.generate(), 1, write_scope=[], result_schema_json='{"type": 12}')
    refused(lambda: broker.delegate(c.executor, bad_schema), grpc.StatusCode.INVALID_ARGUMENT,
            field="body.result_schema_json")
    # Someone else completing, escalating or accepting the executor's contract.
    for call in (lambda: broker.complete(c.planner, completion(c.executor_id)),
                 lambda: broker.escalate(c.host, c.executor_id, "not mine"),
                 lambda: broker.accept(c.orchestrator, c.executor_id)):
        refused(call, grpc.StatusCode.PERMISSION_DENIED, "NOT_DELEGATE")
    assert broker.ledger(c.planner_id) == before, "nothing changed"
    assert broker.state(c.executor_id).status == pb.CONTRACT_STATUS_ACCEPTED

    # Receipts after completion.
    broker.complete(c.executor, completion(c.executor_id))
    after = broker.ledger(c.planner_id)
    refused(lambda: broker.record(c.host, c.executor_id, [mutation("src/auth/y", 1)]),
            grpc.StatusCode.FAILED_PRECONDITION, "ENDED")
    # A new request on a completed contract.
    refused(lambda: broker.complete(c.executor, completion(c.executor_id)), grpc.StatusCode.FAILED_PRECONDITION,
            "WRONG_STATE")
    # Adjudication is for PENDING_PRINCIPAL verdicts, by the principal only.
    refused(lambda: broker.adjudicate(c.executor, c.executor_id, pb.VERDICT_ACCEPTED, "mine"),
            grpc.StatusCode.PERMISSION_DENIED, "NOT_PRINCIPAL")
    refused(lambda: broker.adjudicate(c.planner, c.executor_id, pb.VERDICT_ACCEPTED, "looks fine"),
            grpc.StatusCode.FAILED_PRECONDITION)
    assert broker.ledger(c.planner_id) == after


def test_a_retried_completion_settles_once(broker):
    c = seed_001_chain(broker)
    request = c.executor.complete(completion(c.executor_id))  # signed once
    first = call_idempotent(broker.stub.Complete, request)
    again = call_idempotent(broker.stub.Complete, request)
    assert (first.replayed, again.replayed) == (False, True)
    assert (again.receipt_id, again.receipt) == (first.receipt_id, first.receipt)
    broker.check_receipt(again, request, pb.RECEIPT_KIND_COMPLETED)
    assert ledger(broker, c.planner_id)[:2] == (0, 18), "settled once"


def test_a_declined_contract_returns_its_reservation(broker):
    orchestrator, worker = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator, budget=50)
    contract = broker.delegate(orchestrator, child(root.id, root.lineage, worker, 20)).contract().contract_id
    assert ledger(broker, root.id) == (20, 0, 30)
    receipt = broker.decline(worker, contract, "not my area")
    assert receipt.reason == "not my area"
    assert broker.state(contract).status == pb.CONTRACT_STATUS_DECLINED
    assert ledger(broker, root.id) == (0, 0, 50)
    refused(lambda: broker.accept(worker, contract), grpc.StatusCode.FAILED_PRECONDITION)
    refused(lambda: broker.decline(worker, root.id, "x"), grpc.StatusCode.PERMISSION_DENIED, "NOT_DELEGATE")


def test_a_host_named_at_accept_records_and_a_liability_retaining_result_awaits_its_principal(broker):
    orchestrator, worker, host, other_host = (Agent.generate() for _ in range(4))
    root = broker.open_root(orchestrator, budget=50)
    contract = broker.delegate(orchestrator, child(root.id, root.lineage, worker, 20)).contract().contract_id
    broker.accept(worker, contract, host=host)
    # Not the host: a party of the tree is told so, another host (a stranger to it) learns nothing.
    refused(lambda: broker.record(orchestrator, contract, [tool_call("ls", 1)]), grpc.StatusCode.PERMISSION_DENIED,
            "NOT_HOST")
    assert_unknowable(lambda cid: broker.record(other_host, cid, [tool_call("ls", 1)]), contract)
    broker.record(host, contract, [tool_call("ls", 1), mutation("src/x.rs", 2)])
    done = broker.complete(worker, pb.CompleteBody(contract_id=contract, output_json="{}", claim="done")).completion
    assert done.verdict == pb.VERDICT_PENDING_PRINCIPAL, "PRINCIPAL liability without a predicate"
    assert done.consumed == 3 and done.returned == 17
    refused(lambda: broker.adjudicate(worker, contract, pb.VERDICT_ACCEPTED, "me"), grpc.StatusCode.PERMISSION_DENIED,
            "NOT_PRINCIPAL")
    adjudicated = broker.adjudicate(orchestrator, contract, pb.VERDICT_REJECTED, "tests missing")
    assert adjudicated.completion.verdict == pb.VERDICT_REJECTED and adjudicated.reason == "tests missing"
    refused(lambda: broker.adjudicate(orchestrator, contract, pb.VERDICT_ACCEPTED, "again"),
            grpc.StatusCode.FAILED_PRECONDITION)


def test_a_host_named_twice_must_match(broker):
    orchestrator, worker, host = (Agent.generate() for _ in range(3))
    root = broker.open_root(orchestrator)
    contract = broker.delegate(orchestrator, child(root.id, root.lineage, worker, 5,
                                                   host_public_key=host.public_key)).contract().contract_id
    refused(lambda: broker.accept(worker, contract, host=Agent.generate()), grpc.StatusCode.FAILED_PRECONDITION,
            "HOST_MISMATCH")
    broker.accept(worker, contract, host=host)


def test_rust_verifies_the_completion_receipt_python_verified(tmp_path, broker):
    from test_cross_language import receipt_verdict, sealed_tamperings

    c = seed_001_chain(broker)
    broker.record(c.host, c.executor_id, [mutation("docs/auth.md", 4)])
    response = broker.stub.Complete(c.executor.complete(completion(c.executor_id)), timeout=10)
    verified = verify_receipt(response.receipt, broker.keys, response.receipt_id)
    assert verified.message.completion.verdict == pb.VERDICT_REJECTED
    assert verified.message.contract_id == c.executor_id
    key = broker.keys[verified.key_id]
    for name, variant in sealed_tamperings(response.receipt):
        assert receipt_verdict(tmp_path, variant, [key]) == (name == "genuine"), name
    # The receipt binds to the contract by id: with the verified chain to
    # contract_id it proves the completion happened to exactly those terms.
    chain = broker.chain(verified.message.contract_id)
    assert chain[-1].contract.delegate_public_key == c.executor.public_key
    assert [v.contract_id for v in chain] == list(verified.message.completion.attribution.chain)


def test_every_lifecycle_body_has_a_signing_method():
    agent = Agent.generate()
    bodies = [n for n in dir(pb) if n.endswith("Body") and hasattr(getattr(pb, n), "DESCRIPTOR")]
    assert set(bodies) >= {"AcceptBody", "DeclineBody", "CompleteBody", "AdjudicateBody", "EscalateBody",
                           "RevokeBody", "RecordReceiptsBody"}
    for name in bodies:
        body_class = getattr(pb, name)
        method = "".join("_" + ch.lower() if ch.isupper() else ch for ch in name[: -len("Body")]).lstrip("_")
        via_method = getattr(agent, method)(contract_id=b"\x01" * 32) if "contract_id" in \
            body_class.DESCRIPTOR.fields_by_name else getattr(agent, method)()
        via_generic = agent.sign_request(body_class())
        for request in (via_method, via_generic):
            assert type(request).__name__ == name[: -len("Body")] + "Request"
            assert request.signed.payload_type == f"application/vnd.delegation.broker.v1.{name}+protobuf"
            assert body_class.FromString(request.signed.payload).header.agent_public_key == agent.public_key
    with pytest.raises(TypeError):
        agent.sign_request(pb.Contract())
    with pytest.raises(TypeError):
        agent.complete(pb.AcceptBody())


def test_lifecycle_requests_take_an_explicit_header_and_leave_the_body_alone():
    agent = Agent.generate()
    header = agent.header()
    body = pb.CompleteBody(header=header, contract_id=b"\x02" * 32, output_json="{}")
    assert pb.CompleteBody.FromString(agent.complete(body).signed.payload).header == header
    bare = pb.RevokeBody(contract_id=b"\x02" * 32)
    first, second = agent.revoke(bare), agent.revoke(bare)
    assert not bare.HasField("header")
    nonce = lambda r: pb.RevokeBody.FromString(r.signed.payload).header.nonce  # noqa: E731
    assert nonce(first) != nonce(second), "each call signs a new request"
