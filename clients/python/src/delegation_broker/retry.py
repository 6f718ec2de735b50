"""Idempotent retries of signed requests.

A signed request's nonce is its idempotency key: sending the *same* request
again (same nonce, same bytes) returns the broker's original answer with
``replayed=True`` and reserves nothing twice. So a retry must resend the
request object it already signed, never rebuild (and re-sign) it.
"""

from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

import grpc

__all__ = ["RETRYABLE", "call_idempotent"]

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

#: Codes after which resending the same signed request is safe and useful:
#: the transport failed, the answer was lost, or the broker shed load
#: (``UNAVAILABLE`` with reason ``OVERLOADED``, ``JUDGES_BUSY``, …: "retry
#: later with the same nonce"). ``RESOURCE_EXHAUSTED`` is not among them:
#: it names a limit (a message too large, a per-contract cap) that a resent
#: request meets again (see ``errors.proto``).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def call_idempotent(
    method: Callable[..., _Resp],
    request: _Req,
    *,
    attempts: int = 5,
    timeout: float | None = 10.0,
    initial_backoff: float = 0.1,
    max_backoff: float = 2.0,
    retry_on: frozenset[grpc.StatusCode] = RETRYABLE,
    sleep: Callable[[float], None] = time.sleep,
) -> _Resp:
    """Calls ``method(request, timeout=timeout)``, resending the very same
    ``request`` on a retryable status, up to ``attempts`` calls in all, with
    jittered exponential backoff.

    ``request`` must be a signed request built once (``agent.delegate(...)``,
    ``agent.open_root(...)``). A resent request the broker already answered
    gets that answer from its request log (kept for
    ``limits.request_log_retention_ms``, 30 days by default), however late;
    one it never saw is checked afresh, and refused as stale once its
    ``timestamp_ms`` is outside the broker's window (default 5 minutes).

    >>> request = agent.delegate(body)
    >>> response = call_idempotent(stub.Delegate, request)
    >>> response.replayed  # True when an earlier attempt had reached the broker
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    for attempt in range(attempts):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as error:
            code = error.code() if callable(getattr(error, "code", None)) else None
            if code not in retry_on or attempt == attempts - 1:
                raise
            backoff = min(max_backoff, initial_backoff * (2**attempt))
            sleep(backoff * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")
