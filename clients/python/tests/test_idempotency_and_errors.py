"""Idempotent replays of signed requests, the retry helper, and ErrorInfo."""

from __future__ import annotations

import grpc
import pytest
from _support import assert_unknowable, child

from delegation_broker import ERROR_DOMAIN, Agent, call_idempotent, error_info, now_ms, pb, verify_contract


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def test_resending_the_same_signed_request_replays_the_original_answer(broker):
    orchestrator, delegate = Agent.generate(), Agent.generate()
    root_request = orchestrator.open_root(
        intent="replay me", budget=50, deadline_ms=now_ms() + 600_000,
        policy=pb.Policy(max_depth=2, max_children=4), write_scope=["src"],
    )
    first = broker.stub.OpenRoot(root_request)
    again = broker.stub.OpenRoot(root_request)
    assert (first.replayed, again.replayed) == (False, True)
    assert again.issued == first.issued, "the stored answer, byte for byte"
    root = broker.check_issued(first.issued)

    request = orchestrator.delegate(child(root.contract_id, root.contract.intent_lineage_hash, delegate, 20))
    first = broker.stub.Delegate(request)
    again = broker.stub.Delegate(request)
    assert (first.replayed, again.replayed) == (False, True)
    assert again.issued == first.issued
    broker.check_outcome(again)
    ledger = broker.ledger(root.contract_id)
    assert (ledger.reserved, ledger.residual, ledger.open_children) == (20, 30, 1), "reserved once"


def test_same_nonce_with_another_body_is_already_exists_with_error_info(broker):
    orchestrator, delegate = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator)
    header = orchestrator.header()
    body = child(root.id, root.lineage, delegate, 10)
    body.header.CopyFrom(header)
    broker.check_outcome(broker.stub.Delegate(orchestrator.delegate(body)))
    body.budget = 11  # same header (agent, nonce), different payload
    with pytest.raises(grpc.RpcError) as caught:
        broker.stub.Delegate(orchestrator.delegate(body))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    info = error_info(caught.value)
    assert info is not None
    assert (info.reason, info.domain, dict(info.metadata)) == ("NONCE_REUSED", ERROR_DOMAIN, {"field": "body.header.nonce"})


def test_call_idempotent_resends_the_same_request_after_a_lost_answer(broker):
    orchestrator, delegate = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator)
    request = orchestrator.delegate(child(root.id, root.lineage, delegate, 10))
    sent: list[bytes] = []

    def lossy(req, timeout=None):
        sent.append(req.SerializeToString())
        response = broker.stub.Delegate(req, timeout=timeout)
        if len(sent) == 1:  # the broker acted, but the answer never arrived
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED)
        return response

    response = call_idempotent(lossy, request, sleep=lambda _: None)
    assert response.replayed
    assert sent == [request.SerializeToString()] * 2, "the very same signed bytes were resent"
    verify_contract(response.issued.contract, broker.keys, response.issued.contract_id)
    assert broker.ledger(root.id).reserved == 10, "nothing reserved twice"


def test_call_idempotent_retries_only_transient_codes():
    calls = []

    def failing(code):
        def method(req, timeout=None):
            calls.append(code)
            raise FakeRpcError(code)
        return method

    with pytest.raises(grpc.RpcError):
        call_idempotent(failing(grpc.StatusCode.INVALID_ARGUMENT), object(), sleep=lambda _: None)
    assert calls == [grpc.StatusCode.INVALID_ARGUMENT]
    calls.clear()
    with pytest.raises(grpc.RpcError):
        call_idempotent(failing(grpc.StatusCode.UNAVAILABLE), object(), attempts=3, sleep=lambda _: None)
    assert calls == [grpc.StatusCode.UNAVAILABLE] * 3
    calls.clear()
    # A limit (RESOURCE_EXHAUSTED) is met again by the same request.
    with pytest.raises(grpc.RpcError):
        call_idempotent(failing(grpc.StatusCode.RESOURCE_EXHAUSTED), object(), attempts=3, sleep=lambda _: None)
    assert calls == [grpc.StatusCode.RESOURCE_EXHAUSTED]


def test_call_idempotent_against_an_unreachable_broker_gives_up_with_unavailable():
    channel = grpc.insecure_channel("127.0.0.1:1")  # nothing listens on port 1
    stub = pb.BrokerStub(channel)
    request = Agent.generate().open_root(intent="x", budget=1)
    with pytest.raises(grpc.RpcError) as caught:
        call_idempotent(stub.OpenRoot, request, attempts=2, timeout=2, sleep=lambda _: None)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def _status(broker, call):
    with pytest.raises(grpc.RpcError) as caught:
        call()
    info = error_info(caught.value)
    assert info is not None and info.domain == ERROR_DOMAIN
    return caught.value.code(), info.reason, dict(info.metadata)


def test_errors_carry_error_info(broker):
    orchestrator, delegate = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator)

    no_liability = child(root.id, root.lineage, delegate, 10, liability=pb.LIABILITY_UNSPECIFIED)
    assert _status(broker, lambda: broker.stub.Delegate(orchestrator.delegate(no_liability))) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD", {"field": "body.liability"})

    no_policy = orchestrator.open_root(intent="x", budget=1, deadline_ms=now_ms() + 60_000)
    assert _status(broker, lambda: broker.stub.OpenRoot(no_policy)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD", {"field": "body.policy"})

    tampered = orchestrator.delegate(child(root.id, root.lineage, delegate, 10))
    tampered.signed.payload = tampered.signed.payload.replace(delegate.public_key, Agent.generate().public_key)
    code, reason, _ = _status(broker, lambda: broker.stub.Delegate(tampered))
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "BAD_SIGNATURE")

    stale = child(root.id, root.lineage, delegate, 10)
    stale.header.CopyFrom(orchestrator.header())
    stale.header.timestamp_ms -= 600_000
    code, reason, _ = _status(broker, lambda: broker.stub.Delegate(orchestrator.delegate(stale)))
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "STALE_TIMESTAMP")

    missing = b"\x00" * 32
    code, reason, metadata = _status(broker, lambda: broker.stub.GetContract(pb.GetContractRequest(contract_id=missing)))
    assert (code, reason, metadata["what"]) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", "contract")

    # Someone else's contract: signed correctly, but not by the holder -> refused before the body is
    # looked at, and nothing is stored in the victim's tree. The delegate holds nothing in this tree
    # yet, so it is a stranger: told exactly what an unknown parent gets.
    grandchild = Agent.generate()
    _, _, metadata, _ = assert_unknowable(
        lambda parent: broker.stub.Delegate(delegate.delegate(child(parent, root.lineage, grandchild, 10))), root.id)
    assert metadata == {"what": "parent contract", "id": "<id>"}
    assert not broker.stub.ListChildren(pb.ListChildrenRequest(contract_id=root.id)).children
    # Once a party of the tree (a delegate in it), it is told why: it does not hold the root.
    broker.delegate(orchestrator, child(root.id, root.lineage, delegate, 10)).contract()
    code, reason, _ = _status(
        broker, lambda: broker.stub.Delegate(delegate.delegate(child(root.id, root.lineage, grandchild, 10)))
    )
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "NOT_HOLDER")


def test_error_info_is_none_without_details():
    assert error_info(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) is None
