"""Reading the broker's structured errors.

Every error status carries a ``google.rpc.Status`` in the
``grpc-status-details-bin`` trailer with a ``google.rpc.ErrorInfo``: a stable
``reason`` (``INVALID_FIELD``, ``BAD_SIGNATURE``, ``STALE_TIMESTAMP``,
``NOT_FOUND``, ``NONCE_REUSED``, ``OVERLOADED``, ``NO_SESSION``,
``NOT_HOLDER``, ...), ``domain`` ``"delegation.broker.v1"`` and metadata
naming the offending ``field`` or ``limit`` (``check`` for a workload token
``BindIdentity`` refuses: reason ``IDENTITY_REFUSED``, see
:mod:`delegation_broker.identity`). A key that is not a party of a
tree (nor a configured reader) gets ``NOT_FOUND`` for each of its ids, exactly
as for an id that does not exist. Invariant refusals are not errors: they come
back as signed receipts in ``DelegateResponse.refused``.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

__all__ = ["ERROR_DOMAIN", "ErrorInfo", "error_info"]

#: ``ErrorInfo.domain`` of every error the broker returns.
ERROR_DOMAIN = "delegation.broker.v1"

ErrorInfo = error_details_pb2.ErrorInfo


def error_info(error: grpc.RpcError) -> ErrorInfo | None:
    """The ``ErrorInfo`` of a failed call, or None when the status carries none.

    >>> try:
    ...     stub.Delegate(request)
    ... except grpc.RpcError as e:
    ...     info = error_info(e)  # info.reason, info.metadata["field"]
    """
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except (ValueError, AttributeError):
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(ErrorInfo.DESCRIPTOR):
            info = ErrorInfo()
            detail.Unpack(info)
            return info
    return None
