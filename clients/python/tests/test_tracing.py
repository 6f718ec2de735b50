"""Trace context: a call made inside an OpenTelemetry span arrives at the
broker with that span's trace id.

The broker here writes JSON logs (``BROKER_LOG_FORMAT=json``) with a debug
``call answered`` line per call whose ``span`` carries the call's
``trace_id`` (the caller's, from ``traceparent``, or a fresh one) and its
``rpc.method``; the tests read those lines back. Interceptor details that need
no broker (no OpenTelemetry, failures, explicit metadata) are checked on the
interceptor alone.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import grpc
import pytest
from _support import CLIENT_ROOT, Broker, child
from opentelemetry import baggage, context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from delegation_broker import (
    Agent,
    TraceContextInterceptor,
    call_idempotent,
    now_ms,
    pb,
    session_stub,
    traced_channel,
    verify_contract,
    watch,
)
from delegation_broker._calls import ClientCallDetails

JSON_LOGS = {"BROKER_LOG_FORMAT": "json", "BROKER_LOG": "info,delegation_broker=debug"}
HEX32 = re.compile(r"[0-9a-f]{32}")
#: A traceparent sent explicitly by a call (the W3C spec's example ids).
EXPLICIT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
EXPLICIT_TRACEPARENT = f"00-{EXPLICIT_TRACE_ID}-00f067aa0ba902b7-01"

#: Spans are made by this provider, not a global one: propagation needs only
#: the current context (and OpenTelemetry's global propagator, W3C by default).
tracer = TracerProvider().get_tracer("delegation-broker-client tests")


def hex_trace_id(span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def traceparent(span) -> str:
    """The W3C ``traceparent`` of ``span`` (its flags: sampled, and the SDK's random-id flag)."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Innermost interceptor: keeps the metadata each call goes out with."""

    def __init__(self):
        self.sent: list[tuple[str, list[tuple[str, object]]]] = []

    def _keep(self, details):
        self.sent.append((details.method, list(details.metadata or ())))

    def intercept_unary_unary(self, continuation, details, request):
        self._keep(details)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation, details, request):
        self._keep(details)
        return continuation(details, request)

    def last(self, method: str) -> list[tuple[str, object]]:
        return [m for name, m in self.sent if name.endswith("/" + method)][-1]


@pytest.fixture(scope="module")
def traced_broker(tmp_path_factory):
    b = Broker(tmp_path_factory.mktemp("traced-broker"), env=JSON_LOGS)
    yield b
    b.channel.close()
    assert b.process.stop() == 0


def log_lines(b: Broker) -> list[dict]:
    """Every complete line the broker has written so far, each parsed as JSON
    (a line that is not JSON fails the test)."""
    text = b.process.log_path.read_text()
    complete = text[: text.rfind("\n") + 1]
    lines = []
    for line in complete.splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise AssertionError(f"not JSON ({error}): {line!r}") from None
    return lines


def answered(b: Broker, predicate, count: int = 1, wait: float = 10.0) -> list[dict]:
    """The ``call answered`` lines matching ``predicate`` (of their span),
    once at least ``count`` of them have been written (the broker writes each
    line as the call is answered: wait a little for it)."""
    deadline = time.monotonic() + wait
    while True:
        found = [line["span"] for line in log_lines(b)
                 if line.get("message") == "call answered" and predicate(line.get("span", {}))]
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) >= count, f"{len(found)} 'call answered' lines, expected {count}:\n{found}"
            return found
        time.sleep(0.05)


def of_trace(trace_id: str):
    return lambda span: span.get("trace_id") == trace_id


def root_request(agent: Agent) -> pb.OpenRootRequest:
    return agent.open_root(intent="trace the token refresh fix", budget=50, deadline_ms=now_ms() + 3_600_000,
                           policy=pb.Policy(max_depth=3, max_children=4), write_scope=["src"])


def open_root(stub, agent: Agent) -> pb.IssuedContract:
    return call_idempotent(stub.OpenRoot, root_request(agent)).issued


# --- against the broker ----------------------------------------------------------------


def test_calls_inside_a_span_arrive_with_its_trace_id(traced_broker):
    b = traced_broker
    orchestrator, worker = Agent.generate(), Agent.generate()
    recorder = Recorder()
    channel = grpc.intercept_channel(b.channel, recorder)  # what the client's own interceptors send
    with tracer.start_as_current_span("orchestrate") as span:
        trace_id = hex_trace_id(span)
        # The documented entry point: opens a session (GetBrokerKeys, OpenSession) now.
        stub = session_stub(channel, orchestrator)
        root = open_root(stub, orchestrator)
        lineage = verify_contract(root.contract, b.keys, root.contract_id).contract.intent_lineage_hash
        delegated = call_idempotent(stub.Delegate, orchestrator.delegate(child(root.contract_id, lineage, worker, 10)))
        child_id = delegated.issued.contract_id
        state = stub.GetContract(pb.GetContractRequest(contract_id=child_id), timeout=10)
        assert state.contract.contract_id == child_id
        with watch(stub, root.contract_id, keys=b.keys, timeout=10) as events:
            seen = [next(events).id, next(events).id]
        assert seen == [root.contract_id, child_id]
    assert HEX32.fullmatch(trace_id)

    # Each call went out with exactly one traceparent: this span's.
    for method in ("GetBrokerKeys", "OpenSession", "OpenRoot", "Delegate", "GetContract", "Watch"):
        sent = [value for key, value in recorder.last(method) if key == "traceparent"]
        assert sent == [traceparent(span)], (method, sent)

    # And the broker ran each of them under that trace id.
    lines = answered(b, of_trace(trace_id), count=6)
    by_method: dict[str, list[dict]] = {}
    for line in lines:
        by_method.setdefault(line["rpc.method"], []).append(line)
    assert sorted(by_method) == ["Delegate", "GetBrokerKeys", "GetContract", "OpenRoot", "OpenSession", "Watch"]
    assert all(len(calls) == 1 for calls in by_method.values()), by_method
    assert by_method["OpenRoot"][0]["broker.contract_id"] == root.contract_id.hex()
    assert by_method["Delegate"][0]["broker.contract_id"] == child_id.hex()
    assert by_method["Delegate"][0]["broker.parent_id"] == root.contract_id.hex()
    assert by_method["OpenRoot"][0]["broker.agent_key_id"] == orchestrator.key_id

    # A call made after the span ended carries none of it: the broker starts a trace.
    other = open_root(stub, orchestrator)
    (line,) = answered(b, lambda s: s.get("rpc.method") == "OpenRoot"
                       and s.get("broker.contract_id") == other.contract_id.hex())
    assert HEX32.fullmatch(line["trace_id"]) and line["trace_id"] != trace_id
    assert "traceparent" not in dict(recorder.last("OpenRoot"))
    # ... and a second span is a second trace.
    with tracer.start_as_current_span("again") as again:
        stub.GetContract(pb.GetContractRequest(contract_id=child_id), timeout=10)
    assert hex_trace_id(again) != trace_id
    (line,) = answered(b, of_trace(hex_trace_id(again)))
    assert line["rpc.method"] == "GetContract"


def test_an_explicit_traceparent_wins(traced_broker):
    b = traced_broker
    orchestrator = Agent.generate()
    recorder = Recorder()
    stub = session_stub(grpc.intercept_channel(b.channel, recorder), orchestrator)
    with tracer.start_as_current_span("ignored") as span:
        root = stub.OpenRoot(root_request(orchestrator), timeout=10,
                             metadata=(("traceparent", EXPLICIT_TRACEPARENT),)).issued
        read = stub.GetContract(pb.GetContractRequest(contract_id=root.contract_id), timeout=10)
    assert read.contract.contract_id == root.contract_id
    sent = recorder.last("OpenRoot")
    assert [v for k, v in sent if k == "traceparent"] == [EXPLICIT_TRACEPARENT], "not duplicated, not replaced"
    (line,) = answered(b, lambda s: s.get("rpc.method") == "OpenRoot"
                       and s.get("broker.contract_id") == root.contract_id.hex())
    assert line["trace_id"] == EXPLICIT_TRACE_ID
    # The next call, without one of its own, is the span's again.
    (line,) = answered(b, of_trace(hex_trace_id(span)))
    assert line["rpc.method"] == "GetContract"


def test_tracestate_and_baggage_travel_too(traced_broker):
    """What the default propagator writes besides ``traceparent``: the span's
    ``tracestate`` (inherited here from a remote parent) and the context's
    ``baggage``; and a plain stub on :func:`traced_channel` propagates too."""
    b = traced_broker
    recorder = Recorder()
    stub = pb.BrokerStub(traced_channel(grpc.intercept_channel(b.channel, recorder)))
    parent = SpanContext(int(EXPLICIT_TRACE_ID, 16), 0x00F067AA0BA902B7, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=TraceState([("vendor", "opaque")]))
    ctx = baggage.set_baggage("run", "seed-001", trace.set_span_in_context(NonRecordingSpan(parent)))
    token = context.attach(ctx)
    try:
        with tracer.start_as_current_span("with state") as span:
            assert hex_trace_id(span) == EXPLICIT_TRACE_ID
            stub.GetBrokerKeys(pb.GetBrokerKeysRequest(), timeout=10)
    finally:
        context.detach(token)
    sent = dict(recorder.last("GetBrokerKeys"))
    assert sent["traceparent"] == traceparent(span)
    assert sent["tracestate"] == "vendor=opaque"
    assert sent["baggage"] == "run=seed-001"
    answered(b, lambda s: s.get("rpc.method") == "GetBrokerKeys" and s.get("trace_id") == EXPLICIT_TRACE_ID)


def test_the_readme_tracing_snippet(traced_broker):
    readme = (CLIENT_ROOT / "README.md").read_text()
    snippets = [s.split("```", 1)[0] for s in readme.split("```python\n")[1:]]
    (snippet,) = [s for s in snippets if "start_as_current_span" in s]
    namespace: dict = {}
    exec(compile(snippet.replace("127.0.0.1:50051", traced_broker.address), "README.md", "exec"), namespace)
    trace_id = format(namespace["span"].get_span_context().trace_id, "032x")
    lines = answered(traced_broker, of_trace(trace_id), count=2)
    assert sorted(line["rpc.method"] for line in lines) == ["GetContract", "OpenRoot"]
    namespace["channel"].close()


def test_the_client_works_without_opentelemetry(traced_broker):
    """With ``opentelemetry`` not importable, the client imports and calls as
    before, and nothing is propagated."""
    script = """
import sys
sys.modules["opentelemetry"] = None  # as if not installed
import grpc
from delegation_broker import Agent, TraceContextInterceptor, pb, session_stub
assert not TraceContextInterceptor().active
stub = session_stub(grpc.insecure_channel(sys.argv[1]), Agent.generate())
print(len(stub.GetBrokerKeys(pb.GetBrokerKeysRequest(), timeout=10).keys))
"""
    result = subprocess.run([sys.executable, "-c", script, traced_broker.address],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 1


# --- the interceptor alone ----------------------------------------------------------------


def intercepted(interceptor: TraceContextInterceptor, metadata=None, kind: str = "unary_unary") -> list:
    """The metadata a call with ``metadata`` goes out with through ``interceptor``."""
    out = []

    def continuation(details, request):
        out.append(details.metadata)
        return "response"

    details = ClientCallDetails("/delegation.broker.v1.Broker/GetContract", 10.0, metadata, None, None, None)
    assert getattr(interceptor, f"intercept_{kind}")(continuation, details, object()) == "response"
    (sent,) = out
    return list(sent or ())


@pytest.mark.parametrize("kind", ["unary_unary", "unary_stream", "stream_unary", "stream_stream"])
def test_every_call_kind_is_intercepted(kind):
    with tracer.start_as_current_span("kind") as span:
        sent = intercepted(TraceContextInterceptor(), [("x-other", "1")], kind)
    assert sent == [("x-other", "1"), ("traceparent", traceparent(span))]


def test_outside_a_span_nothing_is_added():
    assert intercepted(TraceContextInterceptor()) == []
    assert intercepted(TraceContextInterceptor(), (("x-other", "1"),)) == [("x-other", "1")]


def test_the_calls_own_trace_metadata_is_kept():
    def inject(carrier):
        carrier.update(traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01", tracestate="ours=1", baggage="k=v")

    interceptor = TraceContextInterceptor(inject)
    # An explicit traceparent: neither it nor its tracestate is sent twice; baggage is added.
    assert intercepted(interceptor, [("traceparent", EXPLICIT_TRACEPARENT)]) == [
        ("traceparent", EXPLICIT_TRACEPARENT), ("baggage", "k=v")]
    assert intercepted(interceptor, [("baggage", "mine=1")]) == [
        ("baggage", "mine=1"), ("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"), ("tracestate", "ours=1")]


def test_propagation_never_fails_a_call():
    def broken(carrier):
        raise RuntimeError("a propagator bug")

    assert intercepted(TraceContextInterceptor(broken), [("x-other", "1")]) == [("x-other", "1")]

    def odd(carrier):  # what gRPC would refuse is dropped, the rest kept
        carrier.update({"Traceparent": "00-" + "3" * 32 + "-" + "4" * 16 + "-01", "x-b3-bin": "AA==",
                        "bad key": "v", "baggage": "caf\u00e9=1", "tracestate": b"bytes", "grpc-x": "\n"})

    assert intercepted(TraceContextInterceptor(odd)) == [("traceparent", "00-" + "3" * 32 + "-" + "4" * 16 + "-01")]


def test_without_opentelemetry_the_interceptor_is_a_no_op(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.propagate", None)
    interceptor = TraceContextInterceptor()
    assert not interceptor.active
    monkeypatch.undo()  # a span is active, but the interceptor found no OpenTelemetry
    with tracer.start_as_current_span("unseen"):
        assert intercepted(interceptor, [("x-other", "1")]) == [("x-other", "1")]
    assert TraceContextInterceptor().active

