"""Watching a contract's subtree, every event verified, resumable by cursor.

``Watch`` streams every signed event of a subtree (issued contracts and
receipts, each a broker-signed ``pb.Sealed``) in commit order: first what
already happened after ``cursor``, then live. Each event is verified against
the broker's published keys before it is yielded, and its cursor must be
greater than the last one seen, so a watch resumed from :attr:`Watch.cursor`
misses nothing and repeats nothing::

    w = watch(stub, root_id)
    for event in w:
        if event.receipt and event.receipt.kind == pb.RECEIPT_KIND_ESCALATED:
            ...
    # The stream ended (broker shutdown, deadline, network): carry on from w.cursor.
    w = w.resume()          # or watch(stub, root_id, cursor=saved_cursor)

``stub`` must carry a read session (``x-broker-session-bin``) of a party of
the tree or a configured reader, e.g. ``session_stub(channel, agent)``; see
:mod:`delegation_broker.session`. The broker checks the session when the
stream opens; with ``session_stub`` a resumed stream opens with a session
renewed if it is due.

The server never ends a healthy stream by itself; stop with :meth:`Watch.cancel`
(from any thread; iteration then simply stops), a ``timeout``, or ``with``.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from . import pb
from .verify import BrokerKeys, VerificationError, verify_contract, verify_receipt

__all__ = ["Watch", "WatchEvent", "watch"]


@dataclass(frozen=True)
class WatchEvent:
    """One verified event of a watched subtree: exactly one of ``contract`` /
    ``receipt`` is set."""

    #: Position in commit order; pass it back (``watch(..., cursor=)``) to resume after it.
    cursor: int
    #: The contract id or receipt id: SHA-256 of the Sealed payload.
    id: bytes
    #: The broker-signed Sealed (a Contract or a Receipt), exactly as received.
    sealed: pb.Sealed
    #: The broker key that signed it.
    key_id: str
    #: A contract issued in the subtree, its signature verified (see
    #: :func:`delegation_broker.verify_contract`: its terms against its
    #: ancestors need :func:`delegation_broker.verify_chain`).
    contract: pb.Contract | None = None
    #: A receipt signed for a contract of the subtree.
    receipt: pb.Receipt | None = None

    @property
    def kind(self) -> str:
        """``"contract"`` or ``"receipt"``."""
        return "contract" if self.contract is not None else "receipt"


class Watch:
    """An iterator over the verified events of ``contract_id``'s subtree after
    ``cursor``. Use :func:`watch` to open one.

    :attr:`cursor` is the cursor of the last event yielded (or the starting
    one): after the stream ends or fails, :meth:`resume` (or a new
    :func:`watch` from that cursor) continues exactly after it.

    Besides each event's signature (and, for a root contract, its terms), a
    watch that knows the subtree from its start (``cursor=0``, or resumed from
    one that did) checks that every contract hangs below the watched one (its
    ``parent_id`` is a contract seen before) and every receipt is about one of
    them. Anything that does not verify raises :class:`VerificationError` and
    cancels the stream. When an event names a broker key the watch does not
    know (a rotation during a long watch), the published keys are fetched once
    more before giving up.
    """

    def __init__(
        self,
        stub: pb.BrokerStub,
        contract_id: bytes,
        cursor: int = 0,
        *,
        keys: BrokerKeys | None = None,
        timeout: float | None = None,
        _subtree: set[bytes] | None = None,
    ):
        if cursor < 0:
            raise ValueError("cursor must be >= 0")
        self.contract_id = bytes(contract_id)
        #: The cursor of the last event yielded; resume after it.
        self.cursor = cursor
        self.keys = keys if keys is not None else BrokerKeys.fetch(stub)
        self._stub = stub
        if _subtree is not None:
            self._subtree: set[bytes] | None = set(_subtree)
        else:
            self._subtree = {self.contract_id} if cursor == 0 else None
        self._cancelled = False
        self._call = stub.Watch(pb.WatchRequest(contract_id=self.contract_id, cursor=cursor), timeout=timeout)

    def __iter__(self) -> Watch:
        return self

    def __next__(self) -> WatchEvent:
        try:
            response = next(self._call)
        except grpc.RpcError as error:
            if self._cancelled and error.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise
        try:
            event = self._verify(response)
        except BaseException:  # VerificationError, or the key refetch failing: the stream is done
            self.cancel()
            raise
        self.cursor = event.cursor
        return event

    def cancel(self) -> None:
        """Ends the stream; a pending or later ``next()`` stops the iteration.
        Safe to call from another thread, and more than once."""
        self._cancelled = True
        self._call.cancel()

    def resume(self, *, timeout: float | None = None) -> Watch:
        """Cancels this stream and opens a new one right after :attr:`cursor`,
        with the same keys and subtree knowledge."""
        self.cancel()
        return Watch(self._stub, self.contract_id, self.cursor, keys=self.keys, timeout=timeout,
                     _subtree=self._subtree)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    # --- verification ---------------------------------------------------------------

    def _verify(self, response: pb.WatchResponse) -> WatchEvent:
        if response.cursor <= self.cursor:
            raise VerificationError(f"cursor {response.cursor} does not advance past {self.cursor}")
        which = response.WhichOneof("event")
        if which is None:
            raise VerificationError(f"event at cursor {response.cursor} is empty")
        sealed = getattr(response, which)
        try:
            event = self._decode(response.cursor, which, sealed)
        except VerificationError:
            if _named_key(which, sealed) in (None, *self.keys):
                raise
            self.keys = BrokerKeys.fetch(self._stub)  # perhaps a key published since the watch began
            event = self._decode(response.cursor, which, sealed)
        self._check_subtree(event)
        return event

    def _decode(self, cursor: int, which: str, sealed: pb.Sealed) -> WatchEvent:
        if which == "contract":
            contract = verify_contract(sealed, self.keys)
            return WatchEvent(cursor, contract.contract_id, sealed, contract.key_id, contract=contract.contract)
        receipt = verify_receipt(sealed, self.keys)
        return WatchEvent(cursor, receipt.id, sealed, receipt.key_id, receipt=receipt.message)

    def _check_subtree(self, event: WatchEvent) -> None:
        if self._subtree is None:
            return
        if event.contract is not None:
            if event.id != self.contract_id and event.contract.parent_id not in self._subtree:
                raise VerificationError(f"contract {event.id.hex()} at cursor {event.cursor} is outside the subtree")
            self._subtree.add(event.id)
        elif event.receipt.contract_id not in self._subtree:
            raise VerificationError(
                f"receipt {event.id.hex()} at cursor {event.cursor} is about a contract outside the subtree"
            )


def _named_key(which: str, sealed: pb.Sealed) -> str | None:
    """The (not yet verified) broker_key_id a Sealed event's payload names."""
    try:
        return (pb.Contract if which == "contract" else pb.Receipt).FromString(sealed.payload).broker_key_id
    except DecodeError:
        return None


def watch(
    stub: pb.BrokerStub,
    contract_id: bytes,
    cursor: int = 0,
    *,
    keys: BrokerKeys | None = None,
    timeout: float | None = None,
) -> Watch:
    """Opens a Watch on ``contract_id``'s subtree, resuming after ``cursor``
    (0: from the beginning). ``stub`` must carry a read session (see
    :func:`delegation_broker.session_stub`). ``keys`` defaults to ``BrokerKeys.fetch(stub)``;
    ``timeout`` bounds the whole stream (``DEADLINE_EXCEEDED`` when it passes).
    Iterate it for verified :class:`WatchEvent` s."""
    return Watch(stub, contract_id, cursor, keys=keys, timeout=timeout)
