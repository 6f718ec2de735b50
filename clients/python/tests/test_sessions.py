"""Read sessions against the real broker: reads need one (x-broker-session-bin),
are answered only to the tree's parties and configured readers, and the client
helpers open, attach and renew them."""

from __future__ import annotations

import os
import time

import grpc
import pytest
from _support import HOUR_MS, Broker, assert_unknowable, child, mutation, refusal

from delegation_broker import (
    ERROR_DOMAIN,
    SESSION_METADATA,
    Agent,
    ReadSession,
    RenewingSession,
    SessionInterceptor,
    VerificationError,
    current_key_id,
    error_info,
    now_ms,
    open_session,
    pb,
    payload_type,
    verify_receipt,
    verify_sealed,
    verify_signature,
    watch,
)


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    info = error_info(caught.value)
    assert info is not None and info.domain == ERROR_DOMAIN, caught.value
    return caught.value.code(), info.reason


class Tree:
    """orchestrator --root--> worker (hosted by host), accepted, with one observation
    and a GetReceipt-able receipt; the root carries a unique ``run`` label."""

    def __init__(self, broker: Broker):
        self.orchestrator, self.worker, self.host = Agent.generate(), Agent.generate(), Agent.generate()
        self.run = os.urandom(8).hex()
        issued = broker.stub.OpenRoot(self.orchestrator.open_root(
            intent="read me", budget=50, deadline_ms=now_ms() + HOUR_MS, labels={"run": self.run},
            policy=pb.Policy(max_depth=3, max_children=4), write_scope=["src"]), timeout=10).issued
        root = broker.check_issued(issued)
        self.root_id, self.lineage = root.contract_id, root.contract.intent_lineage_hash
        self.child_id = broker.delegate(
            self.orchestrator, child(self.root_id, self.lineage, self.worker, 20, host_public_key=self.host.public_key)
        ).contract().contract_id
        accepted = broker.stub.Accept(self.worker.accept(contract_id=self.child_id), timeout=10)
        broker.check_receipt(accepted)
        self.receipt_id = accepted.receipt_id
        broker.record(self.host, self.child_id, [mutation("src/a.rs", 3)])

    def reads(self, stub: pb.BrokerStub, metadata=None, *, root_id: bytes | None = None,
              child_id: bytes | None = None, receipt_id: bytes | None = None):
        """(name, call) for every read RPC but AggregateAudits, each about this tree
        (or about the ids given instead of its root's, its child's, its receipt's)."""
        kw = dict(timeout=10, metadata=metadata)
        root_id, child_id = root_id or self.root_id, child_id or self.child_id
        receipt_id = receipt_id or self.receipt_id

        def watch_first_event():
            stream = stub.Watch(pb.WatchRequest(contract_id=root_id), **kw)
            try:
                return next(stream)
            finally:
                stream.cancel()

        return [
            ("GetContract", lambda: stub.GetContract(pb.GetContractRequest(contract_id=child_id), **kw)),
            ("GetChain", lambda: stub.GetChain(pb.GetChainRequest(contract_id=child_id), **kw)),
            ("ListChildren", lambda: stub.ListChildren(pb.ListChildrenRequest(contract_id=root_id), **kw)),
            ("GetReceipt", lambda: stub.GetReceipt(pb.GetReceiptRequest(receipt_id=receipt_id), **kw)),
            ("GetAudit", lambda: stub.GetAudit(pb.GetAuditRequest(contract_id=child_id), **kw)),
            ("Watch", watch_first_event),
        ]

    def aggregate_runs(self, stub: pb.BrokerStub) -> int:
        response = stub.AggregateAudits(pb.AggregateAuditsRequest(selector={"run": self.run}), timeout=10)
        return sum(group.runs for group in response.groups)


@pytest.fixture(scope="module")
def tree(broker) -> Tree:
    return Tree(broker)


def test_open_session_is_a_signed_request_and_returns_a_broker_signed_session(broker):
    agent = Agent.generate()
    request = agent.open_session(broker_key_id="k")
    assert isinstance(request, pb.OpenSessionRequest)
    assert request.signed.payload_type == "application/vnd.delegation.broker.v1.OpenSessionBody+protobuf"
    assert request.signed.payload_type == payload_type(pb.OpenSessionBody)
    assert verify_signature(request.signed, agent.public_key)
    body = pb.OpenSessionBody.FromString(request.signed.payload)
    assert body.header.agent_public_key == agent.public_key and len(body.header.nonce) == 16
    assert body.broker_key_id == "k"
    # A request naming another broker opens nothing here.
    assert _status(lambda: broker.bare_stub.OpenSession(request, timeout=10)) == (
        grpc.StatusCode.UNAUTHENTICATED, "WRONG_BROKER")

    before = now_ms()
    session = open_session(broker.bare_stub, agent)
    verified = verify_sealed(session.sealed, broker.keys, pb.Session)
    # (Not kept for the session's Rust cross-check: `delegation-broker verify` checks chains and receipts only.)
    assert verified.message.agent_public_key == agent.public_key == session.agent_public_key
    assert session.expires_at_ms == verified.message.expires_at_ms
    assert session.lifetime_ms == HOUR_MS, "the broker's default session lifetime"
    assert abs(session.issued_at_ms - before) < 60_000
    assert session.metadata() == ((SESSION_METADATA, session.sealed.SerializeToString()),)
    assert pb.Sealed.FromString(session.metadata_value()) == session.sealed
    assert open_session(broker.bare_stub, agent).sealed != session.sealed, "every call opens a new session"
    # A session is a Session: signed under its own type, it passes as nothing else.
    with pytest.raises(VerificationError):
        verify_receipt(session.sealed, broker.keys)


def test_a_read_without_a_session_is_unauthenticated_no_session(broker, tree):
    for name, call in tree.reads(broker.bare_stub):
        assert _status(call) == (grpc.StatusCode.UNAUTHENTICATED, "NO_SESSION"), name
    assert _status(lambda: tree.aggregate_runs(broker.bare_stub)) == (grpc.StatusCode.UNAUTHENTICATED, "NO_SESSION")
    # GetBrokerKeys and OpenSession stay public.
    assert broker.bare_stub.GetBrokerKeys(pb.GetBrokerKeysRequest(), timeout=10).keys


def test_a_session_that_does_not_verify_is_unauthenticated_bad_session(broker, tree):
    session = open_session(broker.bare_stub, tree.orchestrator)
    forged = pb.Sealed()
    forged.CopyFrom(session.sealed)
    claims = pb.Session.FromString(forged.payload)
    claims.agent_public_key = broker.reader.public_key  # claim to be the configured reader
    forged.payload = claims.SerializeToString()
    # An agent-signed envelope over the same Session: not what the broker signed.
    envelope = tree.orchestrator.sign_bytes(payload_type(pb.Session), session.sealed.payload)
    for metadata in ([(SESSION_METADATA, forged.SerializeToString())], [(SESSION_METADATA, b"\x01garbage")],
                     [(SESSION_METADATA, envelope.SerializeToString())]):
        for name, call in tree.reads(broker.bare_stub, metadata=metadata):
            assert _status(call) == (grpc.StatusCode.UNAUTHENTICATED, "BAD_SESSION"), name


def test_a_stranger_cannot_tell_the_trees_ids_from_random_ones(broker, tree):
    stranger = broker.stub_for(Agent.generate())
    # Every read of the tree is answered as the same read of random ids: NOT_FOUND, message and all.
    real = dict(root_id=tree.root_id, child_id=tree.child_id, receipt_id=tree.receipt_id)
    fake = {name: os.urandom(32) for name in real}
    for (name, real_call), (_, fake_call) in zip(tree.reads(stranger), tree.reads(stranger, **fake), strict=True):
        answer = refusal(real_call, *real.values())
        assert answer == refusal(fake_call, *fake.values()), name
        assert answer[:3] == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", {
            "what": "receipt" if name == "GetReceipt" else "contract", "id": "<id>"}), name
    # The watch helper, too.
    assert_unknowable(lambda cid: next(iter(watch(stranger, cid, keys=broker.keys, timeout=10))), tree.root_id)
    # AggregateAudits answers, but covers only the runs whose root the caller opened.
    assert tree.aggregate_runs(stranger) == 0


def test_the_trees_parties_read_it_through_the_session_helpers(broker, tree):
    for who, agent in (("orchestrator", tree.orchestrator), ("delegate", tree.worker), ("host", tree.host)):
        stub = broker.stub_for(agent)
        for contract_id in (tree.root_id, tree.child_id):
            state = stub.GetContract(pb.GetContractRequest(contract_id=contract_id), timeout=10).contract
            assert state.contract_id == contract_id and state == broker.state(contract_id), who
        for name, call in tree.reads(stub):
            call()  # every read is answered
        with watch(stub, tree.root_id, keys=broker.keys, timeout=30) as w:
            events = broker.watched([next(w) for _ in range(4)])
        assert [e.kind for e in events] == ["contract", "contract", "receipt", "receipt"], who
        assert [e.receipt.kind for e in events[2:]] == [pb.RECEIPT_KIND_ACCEPTED, pb.RECEIPT_KIND_OBSERVED], who
        assert events[0].id == tree.root_id and events[1].id == tree.child_id
    # Only the opener's AggregateAudits covers the run; the configured reader's covers every run.
    assert tree.aggregate_runs(broker.stub_for(tree.orchestrator)) == 1
    assert tree.aggregate_runs(broker.stub_for(tree.worker)) == 0
    assert tree.aggregate_runs(broker.stub) == 1


def test_a_new_delegate_becomes_a_party(broker, tree):
    newcomer = Agent.generate()
    stub = broker.stub_for(newcomer)
    call = lambda cid: stub.GetContract(pb.GetContractRequest(contract_id=cid), timeout=10)  # noqa: E731
    assert_unknowable(call, tree.root_id)
    broker.delegate(tree.worker, child(tree.child_id, tree.lineage, newcomer, 5)).contract()
    assert call(tree.root_id).contract.contract_id == tree.root_id, "the same session reads once the key is a party"


def test_explicit_metadata_and_the_interceptor(broker, tree):
    session = open_session(broker.bare_stub, tree.orchestrator)
    request = pb.GetChainRequest(contract_id=tree.child_id)
    chain = broker.bare_stub.GetChain(request, timeout=10, metadata=session.metadata()).chain
    assert [s.contract_id for s in chain] == [tree.root_id, tree.child_id]

    # A fixed ReadSession as the interceptor's source.
    stub = pb.BrokerStub(grpc.intercept_channel(broker.channel, SessionInterceptor(session)))
    assert stub.GetChain(request, timeout=10).chain == chain
    # The call's own session wins over the interceptor's (here the reader's stub sends a stranger's).
    stranger = open_session(broker.bare_stub, Agent.generate())
    assert _status(lambda: broker.stub.GetChain(request, timeout=10, metadata=stranger.metadata())) == (
        grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
    # Other metadata is kept beside the session.
    assert stub.GetChain(request, timeout=10, metadata=[("x-trace", "1")]).chain == chain
    # OpenSession through an intercepted stub is sent as is.
    request = tree.worker.open_session(broker_key_id=current_key_id(stub))
    assert ReadSession.from_response(stub.OpenSession(request, timeout=10)).agent_public_key \
        == tree.worker.public_key


class FakeClock:
    def __init__(self, now: int):
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_renewal_happens_on_the_first_call_after_90_percent_of_the_lifetime(broker, tree):
    # The client clock starts far from the broker's: the lifetime is counted
    # from the session's arrival by the local clock, so skew does not matter.
    clock = FakeClock(1_000)
    keeper = RenewingSession(tree.orchestrator, broker.bare_stub, clock=clock)
    assert keeper.needs_renewal(), "nothing opened yet"
    first = keeper.current()
    assert first.lifetime_ms == HOUR_MS
    renew_after = 1_000 + int(HOUR_MS * 0.9)
    assert not keeper.needs_renewal() and not keeper.needs_renewal(renew_after - 1)
    assert keeper.needs_renewal(renew_after)

    clock.now = renew_after - 1
    assert keeper.current() is first
    stub = pb.BrokerStub(grpc.intercept_channel(broker.channel, SessionInterceptor(keeper)))
    read = lambda: stub.GetContract(pb.GetContractRequest(contract_id=tree.root_id), timeout=10)  # noqa: E731
    read()
    assert keeper.current() is first, "a read before the renewal point keeps the session"

    clock.now = renew_after
    read()  # this call opens a new session first
    second = keeper.current()
    assert second is not first and second.sealed != first.sealed
    assert second.issued_at_ms >= first.issued_at_ms
    assert not keeper.needs_renewal()
    assert keeper.needs_renewal(renew_after + int(HOUR_MS * 0.9))

    third = keeper.renew()  # forced
    assert third.sealed != second.sealed and keeper.current() is third
    read()

    with pytest.raises(ValueError):
        RenewingSession(tree.orchestrator, broker.bare_stub, renew_at=0)
    with pytest.raises(ValueError):
        RenewingSession(tree.orchestrator, broker.bare_stub, renew_at=1.5)


def test_expired_sessions_are_refused_and_renewed_ones_read(tmp_path):
    """A broker whose sessions last two seconds: a kept session expires
    (SESSION_EXPIRED); a session_stub renews its own before that."""
    short = Broker(tmp_path / "short-sessions", limits={"session_ttl_ms": 2_000})
    try:
        orchestrator = Agent.generate()
        stub = short.stub_for(orchestrator)  # renews after 1.8 s
        root_id = stub.OpenRoot(orchestrator.open_root(
            intent="short sessions", budget=5, deadline_ms=now_ms() + HOUR_MS,
            policy=pb.Policy(max_depth=2, max_children=2), write_scope=["src"]), timeout=10).issued.contract_id
        kept = open_session(short.bare_stub, orchestrator)
        assert kept.lifetime_ms == 2_000
        request = pb.GetContractRequest(contract_id=root_id)
        short.bare_stub.GetContract(request, timeout=10, metadata=kept.metadata())
        stub.GetContract(request, timeout=10)

        time.sleep(max(0.0, (kept.expires_at_ms - now_ms()) / 1000) + 0.2)
        assert _status(lambda: short.bare_stub.GetContract(request, timeout=10, metadata=kept.metadata())) == (
            grpc.StatusCode.UNAUTHENTICATED, "SESSION_EXPIRED")
        assert stub.GetContract(request, timeout=10).contract.contract_id == root_id, "renewed on this call"
        with watch(stub, root_id, keys=short.keys, timeout=10) as w:
            assert next(w).id == root_id
    finally:
        assert short.close() == 0
