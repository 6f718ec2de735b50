"""Read sessions: the identity every read carries.

Reads (``GetContract``, ``GetChain``, ``ListChildren``, ``GetReceipt``,
``Watch``, ``GetAudit``, ``AggregateAudits``) are answered only to a tree's
parties (the key that opened its root, its delegates and hosts) and to the
reader keys in the broker's ``[readers]`` config. A caller proves its key once
with a signed ``OpenSession`` request (:meth:`Agent.open_session
<delegation_broker.Agent.open_session>`) and gets a broker-signed ``Session``
(a ``pb.Sealed``: the Session payload and the broker's signature), which it
then sends, protobuf-encoded, as the binary metadata ``x-broker-session-bin``
of every read until it expires (one hour by default).

The simplest way, a stub whose every call carries a session that is opened now
and renewed on the first call after 90% of its lifetime::

    stub = session_stub(grpc.insecure_channel(target), agent)
    stub.GetContract(pb.GetContractRequest(contract_id=cid))
    for event in watch(stub, cid): ...

Or by hand, one session for a few calls::

    session = open_session(pb.BrokerStub(channel), agent)
    stub.GetContract(request, metadata=session.metadata())

A read without a session fails with ``UNAUTHENTICATED`` (``ErrorInfo.reason``
``NO_SESSION``; ``BAD_SESSION`` when it does not verify, ``SESSION_EXPIRED``
after it expired); a key that is neither a party of the tree nor a configured
reader gets ``NOT_FOUND`` (``NOT_FOUND``), exactly the answer for an id that
does not exist, so it cannot tell which ids exist.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import grpc

from . import pb
from ._calls import with_metadata
from .signing import Agent, now_ms
from .tracing import traced_channel

__all__ = [
    "SESSION_METADATA",
    "ReadSession",
    "RenewingSession",
    "SessionInterceptor",
    "SessionSource",
    "open_session",
    "session_channel",
    "session_stub",
]

#: The binary gRPC metadata key a read's session travels in.
SESSION_METADATA = "x-broker-session-bin"
#: Default fraction of a session's lifetime after which :class:`RenewingSession` opens a new one.
RENEW_AT = 0.9

Metadata = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True)
class ReadSession:
    """A session the broker issued (``OpenSessionResponse``): the Sealed to
    send with reads, and what it says.

    ``issued_at_ms`` and ``expires_at_ms`` are the broker's clock; the session
    is not verified here (the broker verifies it at every read), only decoded;
    ``verify_sealed(session.sealed, keys, pb.Session)`` verifies it offline.
    """

    #: The broker-signed ``Session`` (a ``pb.Sealed``), exactly as received.
    sealed: pb.Sealed
    #: The key the session reads as.
    agent_public_key: bytes
    #: Unix ms at which the broker issued it.
    issued_at_ms: int
    #: Unix ms from which the broker refuses it (``SESSION_EXPIRED``).
    expires_at_ms: int

    @classmethod
    def from_response(cls, response: pb.OpenSessionResponse) -> ReadSession:
        """Decodes an ``OpenSessionResponse``."""
        session = pb.Session.FromString(response.session.payload)
        sealed = pb.Sealed()
        sealed.CopyFrom(response.session)
        return cls(
            sealed=sealed,
            agent_public_key=bytes(session.agent_public_key),
            issued_at_ms=session.issued_at_ms,
            expires_at_ms=response.expires_at_ms or session.expires_at_ms,
        )

    @property
    def lifetime_ms(self) -> int:
        """How long the broker accepts it, in ms (``expires_at_ms - issued_at_ms``)."""
        return max(0, self.expires_at_ms - self.issued_at_ms)

    def metadata_value(self) -> bytes:
        """The value of ``x-broker-session-bin``: the Sealed session, protobuf-encoded."""
        return self.sealed.SerializeToString()

    def metadata(self) -> Metadata:
        """Call metadata carrying this session: ``stub.GetContract(request, metadata=session.metadata())``."""
        return ((SESSION_METADATA, self.metadata_value()),)


def current_key_id(stub: pb.BrokerStub, *, timeout: float | None = 10.0) -> str:
    """The key id of the broker's current signing key (``GetBrokerKeys``, a
    public call): what an ``OpenSession`` request must name."""
    keys = stub.GetBrokerKeys(pb.GetBrokerKeysRequest(), timeout=timeout).keys
    for key in keys:
        if key.current:
            return key.key_id
    raise ValueError("the broker published no current key")


def open_session(stub: pb.BrokerStub, agent: Agent, *, timeout: float | None = 10.0) -> ReadSession:
    """Asks the broker behind ``stub`` for its current key id, then calls
    ``OpenSession`` with a request freshly signed by ``agent`` naming it, and
    returns the session. Every call opens a new one (the request is not
    idempotent, nor need it be: opening changes nothing on the broker)."""
    request = agent.open_session(broker_key_id=current_key_id(stub, timeout=timeout))
    return ReadSession.from_response(stub.OpenSession(request, timeout=timeout))


class SessionSource(Protocol):
    """Anything that yields the session metadata of a call:
    :class:`ReadSession` (fixed) or :class:`RenewingSession` (kept fresh)."""

    def metadata(self) -> Metadata: ...


class RenewingSession:
    """``agent``'s read session on the broker behind ``stub``, opened when
    first needed and opened again on the first call after ``renew_at`` (0.9)
    of its lifetime has passed.

    The lifetime is the broker's (``expires_at_ms - issued_at_ms``), counted
    by this client's ``clock`` from when the session was requested, so a
    skew between the two clocks does not matter. Renewal is lazy: nothing runs in
    the background; :meth:`current` (and :meth:`metadata`, which the
    :class:`SessionInterceptor` calls before each call) opens the new session
    in the calling thread. Thread-safe: concurrent callers share one renewal.

    ``stub`` is used only for ``OpenSession``; it must not itself be an
    intercepted stub using this session. ``clock`` (unix ms) is for tests.
    """

    def __init__(
        self,
        agent: Agent,
        stub: pb.BrokerStub,
        *,
        renew_at: float = RENEW_AT,
        timeout: float | None = 10.0,
        clock: Callable[[], int] = now_ms,
    ):
        if not 0.0 < renew_at <= 1.0:
            raise ValueError("renew_at must be in (0, 1]")
        self.agent = agent
        self.renew_at = renew_at
        self._stub = stub
        self._timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._session: ReadSession | None = None
        self._renew_after_ms = 0

    def needs_renewal(self, now: int | None = None) -> bool:
        """True when there is no session yet, or ``now`` (default: the clock)
        is past ``renew_at`` of the current one's lifetime."""
        if self._session is None:
            return True
        return (self._clock() if now is None else now) >= self._renew_after_ms

    def current(self) -> ReadSession:
        """The session to send now, opening a new one first if
        :meth:`needs_renewal`. Raises ``grpc.RpcError`` when that fails."""
        with self._lock:
            if self.needs_renewal():
                self._open()
            assert self._session is not None
            return self._session

    def renew(self) -> ReadSession:
        """Opens a new session now, whatever the age of the current one (for
        instance after a read failed with ``SESSION_EXPIRED``)."""
        with self._lock:
            self._open()
            assert self._session is not None
            return self._session

    def metadata(self) -> Metadata:
        """The metadata of :meth:`current`."""
        return self.current().metadata()

    def _open(self) -> None:
        requested_ms = self._clock()  # before the call: errs on the early side
        session = open_session(self._stub, self.agent, timeout=self._timeout)
        self._session = session
        self._renew_after_ms = requested_ms + int(session.lifetime_ms * self.renew_at)

    def __repr__(self) -> str:
        return f"RenewingSession({self.agent.key_id})"


class SessionInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """A client interceptor adding ``source``'s session
    (``x-broker-session-bin``) to every unary and server-streaming call, except
    ``OpenSession`` and calls whose metadata already carries a session.

    >>> stub = pb.BrokerStub(grpc.intercept_channel(channel, SessionInterceptor(session)))  # doctest: +SKIP

    Mutating calls ignore the session; reads need it. With a
    :class:`RenewingSession`, a call may first open a new session.
    """

    def __init__(self, source: SessionSource):
        self.source = source

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = list(details.metadata or ())
        if method.endswith("/OpenSession") or any(key == SESSION_METADATA for key, _ in metadata):
            return details
        metadata.extend(self.source.metadata())
        return with_metadata(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def session_channel(
    channel: grpc.Channel,
    agent: Agent,
    *,
    renew_at: float = RENEW_AT,
    timeout: float | None = 10.0,
) -> grpc.Channel:
    """``channel`` with every call carrying ``agent``'s read session: opens
    one now (so a broker that refuses it fails here, with ``grpc.RpcError``)
    and renews it lazily, on the first call after ``renew_at`` of its
    lifetime (see :class:`RenewingSession`). Every call, the renewals'
    ``OpenSession`` included, also carries the caller's OpenTelemetry trace
    context (:func:`delegation_broker.traced_channel`). Closing the returned
    channel closes ``channel``."""
    traced = traced_channel(channel)
    session = RenewingSession(agent, pb.BrokerStub(traced), renew_at=renew_at, timeout=timeout)
    session.current()
    return grpc.intercept_channel(traced, SessionInterceptor(session))


def session_stub(
    channel: grpc.Channel,
    agent: Agent,
    *,
    renew_at: float = RENEW_AT,
    timeout: float | None = 10.0,
) -> pb.BrokerStub:
    """``pb.BrokerStub(session_channel(channel, agent, ...))``: a stub whose
    reads are ``agent``'s, session opened now and renewed as needed, and
    whose every call carries the caller's trace context."""
    return pb.BrokerStub(session_channel(channel, agent, renew_at=renew_at, timeout=timeout))
