"""Shared by the client interceptors: a call's details with other metadata."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import grpc


class _CallDetails(NamedTuple):
    method: str
    timeout: Optional[float]
    metadata: Optional[Sequence[tuple[str, Any]]]
    credentials: Optional[grpc.CallCredentials]
    wait_for_ready: Optional[bool]
    compression: Optional[grpc.Compression]


class ClientCallDetails(_CallDetails, grpc.ClientCallDetails):
    pass


def with_metadata(details: grpc.ClientCallDetails, metadata: Sequence[tuple[str, Any]]) -> grpc.ClientCallDetails:
    """``details`` with ``metadata`` in place of its own, everything else kept."""
    return ClientCallDetails(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )
