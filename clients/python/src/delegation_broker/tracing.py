"""Trace context: every call carries the caller's OpenTelemetry context.

The broker runs each call in a span that continues the W3C trace context the
call sends (``traceparent``, ``tracestate``, ``baggage`` metadata) and logs
and exports it under the caller's trace id. :class:`TraceContextInterceptor`
sends it: before each call it asks OpenTelemetry's globally configured
propagator (``opentelemetry.propagate.inject``; by default W3C TraceContext +
Baggage) to write the *current* context — the span active in the calling
thread — into the call's metadata.

:func:`session_stub <delegation_broker.session_stub>` and
:func:`session_channel <delegation_broker.session_channel>` install it, so::

    with tracer.start_as_current_span("plan"):
        stub.Delegate(request)          # arrives with this span's trace id

A channel of your own gets it with :func:`traced_channel` (or
``grpc.intercept_channel(channel, TraceContextInterceptor())``).

OpenTelemetry stays optional (``pip install 'delegation-broker-client[otel]'``
brings the API): without ``opentelemetry`` importable, or outside any span,
nothing is added. Metadata the call already carries wins: an explicit
``traceparent`` is never duplicated or replaced (nor is ``tracestate``, which
belongs to it), nor is any other key already present. Propagation never fails
a call: an error in it is logged at debug level and the call goes out as it was.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Optional

import grpc

from ._calls import with_metadata

__all__ = ["TraceContextInterceptor", "traced_channel"]

_log = logging.getLogger(__name__)

#: What a propagator may add to a call: a plain (not ``-bin``, not ``grpc-``)
#: gRPC metadata key and a printable ASCII value; anything else is dropped.
_KEY = re.compile(r"[0-9a-z_.-]+")
_VALUE = re.compile(r"[\x20-\x7e]*")

Inject = Callable[[dict], None]


def _otel_inject() -> Optional[Inject]:
    """``opentelemetry.propagate.inject``, or None when the API is not
    installed (or its propagators fail to load, e.g. a bad
    ``OTEL_PROPAGATORS``: that is logged by OpenTelemetry itself)."""
    try:
        from opentelemetry.propagate import inject
    except ImportError:
        return None
    except Exception:  # noqa: BLE001 - a broken OpenTelemetry setup must not break the client
        _log.debug("OpenTelemetry's propagators did not load: no trace context is sent", exc_info=True)
        return None
    return inject


class TraceContextInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """A client interceptor adding the caller's current OpenTelemetry context
    (``traceparent``, ``tracestate``, ``baggage`` with the default propagator)
    to the metadata of every call, of every kind.

    >>> stub = pb.BrokerStub(grpc.intercept_channel(channel, TraceContextInterceptor()))  # doctest: +SKIP

    A no-op when ``opentelemetry`` is not importable (looked up once, here) or
    when there is no active span. Keys the call's own metadata already carries
    are left alone; with an explicit ``traceparent``, so is ``tracestate``.
    ``inject`` (a function writing a context into a dict) replaces
    OpenTelemetry's ``propagate.inject``, e.g. in tests.
    """

    def __init__(self, inject: Optional[Inject] = None):
        self._inject = inject if inject is not None else _otel_inject()

    @property
    def active(self) -> bool:
        """Whether anything can be propagated (OpenTelemetry is importable)."""
        return self._inject is not None

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        if self._inject is None:
            return details
        try:
            carrier: dict = {}
            self._inject(carrier)
            if not carrier:
                return details
            metadata = list(details.metadata or ())
            present = {str(key).lower() for key, _ in metadata}
            if "traceparent" in present:
                present.add("tracestate")  # it qualifies the caller's traceparent, not ours
            added = [
                (key, value)
                for key, value in ((str(k).lower(), v) for k, v in carrier.items())
                if key not in present and _KEY.fullmatch(key) and not key.endswith("-bin")
                and not key.startswith("grpc-") and isinstance(value, str) and _VALUE.fullmatch(value)
            ]
            if not added:
                return details
            return with_metadata(details, metadata + added)
        except Exception:  # noqa: BLE001 - tracing must never fail the call
            _log.debug("trace context not propagated", exc_info=True)
            return details

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """``channel`` with every call carrying the caller's trace context
    (:class:`TraceContextInterceptor`); closing it closes ``channel``.
    ``pb.BrokerStub(traced_channel(channel))`` is a plain stub that propagates;
    :func:`delegation_broker.session_stub` already does."""
    return grpc.intercept_channel(channel, TraceContextInterceptor())
