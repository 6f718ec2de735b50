"""Offline verification of broker-signed envelopes from the published keys.

Everything here uses only ed25519, SHA-256 and the generated message types:
fetch the keys once with ``GetBrokerKeys`` (or load them from wherever you
keep them) and verify contracts, hop proofs and receipts without trusting the
transport.

The key is chosen by the ``broker_key_id`` field *inside* the signed payload
(DSSE's ``keyid`` is an unauthenticated hint): the signature is checked
first against the published keys (hint first), the verified payload is then
decoded, and its ``broker_key_id`` must name the key that verified it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterable, TypeVar

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from . import pb
from .signing import MAX_SIGNATURES, key_id, lineage_hash, payload_type, sha256, verify_signature

__all__ = [
    "BrokerKeys",
    "VerificationError",
    "Verified",
    "VerifiedContract",
    "message_class",
    "verify_chain",
    "verify_contract",
    "verify_envelope",
    "verify_receipt",
]

_M = TypeVar("_M", bound=Message)
_PREFIX = "application/vnd."
_SUFFIX = "+protobuf"


class VerificationError(Exception):
    """An envelope, or a chain of them, does not verify."""


def message_class(payload_type_: str) -> type[Message]:
    """The generated message class named by a payload type such as
    ``application/vnd.delegation.broker.v1.Receipt+protobuf``."""
    if not (payload_type_.startswith(_PREFIX) and payload_type_.endswith(_SUFFIX)):
        raise VerificationError(f"payload type {payload_type_[:128]!r} is not application/vnd.<message>+protobuf")
    full_name = payload_type_[len(_PREFIX) : -len(_SUFFIX)]
    if not full_name.startswith("delegation.broker."):
        raise VerificationError(f"payload type {payload_type_[:128]!r} is not a broker message")
    try:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(full_name)
    except KeyError:
        raise VerificationError(f"unknown payload type {payload_type_[:128]!r}") from None
    return message_factory.GetMessageClass(descriptor)


class BrokerKeys:
    """The broker's published verifying keys, by key id.

    Build it from ``stub.GetBrokerKeys(pb.GetBrokerKeysRequest()).keys`` (or
    :meth:`fetch`). Each published key id must match its key.
    """

    def __init__(self, keys: Iterable[pb.BrokerKey]):
        self._keys: dict[str, bytes] = {}
        self.current: str | None = None
        for key in keys:
            if len(key.public_key) != 32:
                raise VerificationError(f"published key {key.key_id!r} is {len(key.public_key)} bytes, not 32")
            if key.key_id != key_id(key.public_key):
                raise VerificationError(f"published key id {key.key_id!r} does not match its public key")
            self._keys[key.key_id] = bytes(key.public_key)
            if key.current:
                self.current = key.key_id
        if not self._keys:
            raise VerificationError("no broker keys")

    @classmethod
    def fetch(cls, stub: pb.BrokerStub, timeout: float | None = 10.0) -> BrokerKeys:
        """Calls ``GetBrokerKeys`` on ``stub``."""
        return cls(stub.GetBrokerKeys(pb.GetBrokerKeysRequest(), timeout=timeout).keys)

    def __contains__(self, key_id_: str) -> bool:
        return key_id_ in self._keys

    def __getitem__(self, key_id_: str) -> bytes:
        return self._keys[key_id_]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(frozen=True)
class Verified(Generic[_M]):
    """A verified envelope: its decoded message and the broker key that signed it."""

    message: _M
    key_id: str
    envelope: pb.Envelope


@dataclass(frozen=True)
class VerifiedContract:
    """A verified contract envelope and its verified hop proofs (root first)."""

    contract_id: bytes
    contract: pb.Contract
    hop_proofs: list[pb.HopProof]
    key_id: str
    envelope: pb.Envelope


def verify_envelope(envelope: pb.Envelope, keys: BrokerKeys, expected: type[_M] | None = None) -> Verified[_M]:
    """Verifies any broker-signed envelope (Contract, HopProof, Receipt, and any
    later message carrying ``broker_key_id``) and returns its decoded payload.

    ``expected`` (e.g. ``pb.Receipt``) additionally pins the payload type.
    Raises :class:`VerificationError` when anything does not hold.
    """
    if expected is not None and envelope.payload_type != payload_type(expected):
        raise VerificationError(
            f"payload type is {envelope.payload_type[:128]!r}, expected {payload_type(expected)!r}"
        )
    cls = message_class(envelope.payload_type)
    if "broker_key_id" not in cls.DESCRIPTOR.fields_by_name:
        raise VerificationError(f"{cls.DESCRIPTOR.full_name} is not signed by the broker (no broker_key_id)")
    if len(envelope.signatures) > MAX_SIGNATURES:
        raise VerificationError(f"{len(envelope.signatures)} signatures, at most {MAX_SIGNATURES} allowed")
    # Signature first (over the exact bytes), hinted key first; decode after.
    hints = [s.keyid for s in envelope.signatures if s.keyid in keys]
    candidates = list(dict.fromkeys([*hints, *keys]))
    signer = next((k for k in candidates if verify_signature(envelope, keys[k])), None)
    if signer is None:
        raise VerificationError("no signature verifies under a published broker key")
    try:
        message = cls.FromString(envelope.payload)
    except DecodeError as e:
        raise VerificationError(f"signed payload is not a valid {cls.DESCRIPTOR.full_name}: {e}") from None
    if message.broker_key_id != signer:
        raise VerificationError(
            f"payload names broker key {message.broker_key_id!r} but was signed by {signer!r}"
        )
    return Verified(message=message, key_id=signer, envelope=envelope)


def verify_contract(envelope: pb.Envelope, keys: BrokerKeys, contract_id: bytes | None = None) -> VerifiedContract:
    """Verifies a contract envelope and every hop proof it carries.

    Also checks what a holder can check from the contract alone: its id
    (SHA-256 of the payload) when ``contract_id`` is given, the intent lineage
    hash (SHA-256 of the intent), one hop proof per hop (root first, depths
    0..depth, all with the same lineage hash), and that the last hop proof is
    this contract's own (same parent, depth and delegate key).
    """
    verified = verify_envelope(envelope, keys, pb.Contract)
    contract: pb.Contract = verified.message
    own_id = sha256(envelope.payload)
    if contract_id is not None and bytes(contract_id) != own_id:
        raise VerificationError(f"contract id {bytes(contract_id).hex()} is not SHA-256(payload) {own_id.hex()}")
    if contract.intent_lineage_hash != lineage_hash(contract.intent):
        raise VerificationError("intent_lineage_hash is not SHA-256(intent)")
    if len(contract.hop_proofs) != contract.depth + 1:
        raise VerificationError(f"{len(contract.hop_proofs)} hop proofs for depth {contract.depth}")
    proofs: list[pb.HopProof] = []
    for index, proof_envelope in enumerate(contract.hop_proofs):
        try:
            proof: pb.HopProof = verify_envelope(proof_envelope, keys, pb.HopProof).message
        except VerificationError as e:
            raise VerificationError(f"hop proof {index}: {e}") from None
        if proof.depth != index:
            raise VerificationError(f"hop proof {index} has depth {proof.depth}")
        if proof.intent_lineage_hash != contract.intent_lineage_hash:
            raise VerificationError(f"hop proof {index} carries another intent lineage hash")
        proofs.append(proof)
    own = proofs[-1]
    if (own.parent_id, own.depth, own.agent_public_key) != (
        contract.parent_id,
        contract.depth,
        contract.delegate_public_key,
    ):
        raise VerificationError("the last hop proof is not this contract's own hop")
    return VerifiedContract(
        contract_id=own_id, contract=contract, hop_proofs=proofs, key_id=verified.key_id, envelope=envelope
    )


def verify_receipt(envelope: pb.Envelope, keys: BrokerKeys, receipt_id: bytes | None = None) -> Verified[pb.Receipt]:
    """Verifies a broker-signed Receipt envelope (refusals and every lifecycle
    receipt: ACCEPTED, OBSERVED, COMPLETED, ESCALATED, REVOKED, ...) and, when
    ``receipt_id`` is given, that it is SHA-256 of the payload.

    Every lifecycle response carries ``receipt_id`` and ``receipt``:

    >>> response = stub.Complete(agent.complete(contract_id=cid, output_json="{}"))
    >>> receipt = verify_receipt(response.receipt, keys, response.receipt_id).message
    >>> receipt.completion.verdict
    """
    verified = verify_envelope(envelope, keys, pb.Receipt)
    if receipt_id is not None and bytes(receipt_id) != sha256(envelope.payload):
        raise VerificationError(
            f"receipt id {bytes(receipt_id).hex()} is not SHA-256(payload) {sha256(envelope.payload).hex()}"
        )
    return verified


def verify_chain(chain: Iterable[pb.ContractState], keys: BrokerKeys) -> list[VerifiedContract]:
    """Verifies a ``GetChain`` answer: every contract (see :func:`verify_contract`),
    each one's ``parent_id`` naming the previous contract and ``root_id`` the
    first, depths 0, 1, 2, ... and one intent lineage throughout."""
    out: list[VerifiedContract] = []
    for depth, state in enumerate(chain):
        verified = verify_contract(state.contract, keys, state.contract_id)
        contract = verified.contract
        if contract.depth != depth:
            raise VerificationError(f"contract {depth} of the chain has depth {contract.depth}")
        if depth == 0:
            if contract.parent_id or contract.root_id:
                raise VerificationError("the chain does not start at a root")
        else:
            if contract.parent_id != out[-1].contract_id:
                raise VerificationError(f"contract {depth}'s parent_id is not the previous contract")
            if contract.root_id != out[0].contract_id:
                raise VerificationError(f"contract {depth}'s root_id is not the chain's root")
            if contract.intent_lineage_hash != out[0].contract.intent_lineage_hash:
                raise VerificationError(f"contract {depth} carries another intent lineage hash")
            # Each contract's hop proofs extend its parent's, byte for byte.
            if list(contract.hop_proofs)[:depth] != list(out[-1].contract.hop_proofs):
                raise VerificationError(f"contract {depth}'s hop proofs do not extend its parent's")
        out.append(verified)
    if not out:
        raise VerificationError("empty chain")
    return out
