"""Offline verification of what the broker signs, from its published keys alone.

The broker signs three messages -- ``Contract``, ``Receipt`` and ``Session`` --
and hands each out as a ``pb.Sealed``: the serialized message (``payload``)
and one ed25519 signature over ``PAE(type, payload)``. The type is not carried:
it is fixed by the field the Sealed travels in (a contract field holds a
Contract, a receipt field a Receipt, ``OpenSessionResponse.session`` a Session)
and still goes into PAE, so a signature made for one type never passes as
another. The signing key's id is the payload's ``broker_key_id``: it is signed,
so it is read from the payload (decoded first, trusted only once the signature
under that key verifies). An object's id is SHA-256 of its payload.

Everything here needs only ed25519, SHA-256 and the generated message types:
fetch the keys once with ``GetBrokerKeys`` (:meth:`BrokerKeys.fetch`, or load
them from wherever you keep them), then

* :func:`verify_chain` -- a ``GetChain`` answer, root first: the procedure
  "Verifying a chain" of ``types.proto``, exactly. One signature is checked,
  the leaf's; the hash links (each ``parent_id`` is SHA-256 of the parent's
  payload) make it cover every ancestor's terms, which are then checked hop by
  hop. Returns every contract's terms and its derived effective predicate;
* :func:`verify_contract` -- one contract alone (signature and id; a root's
  terms too, as the one-element chain it is);
* :func:`verify_receipt` -- a receipt (refusal or lifecycle);
* :func:`verify_sealed` -- any broker-signed Sealed, given its message type;
* :func:`verify_every_signature` -- every contract's own signature, for an
  auditor keeping contracts one by one (the chain does not need them).

Everything raises :class:`VerificationError` when something does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterable, TypeVar, Union

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from . import pb
from .signing import key_id, lineage_hash, payload_type, sha256, verify_pae_signature

__all__ = [
    "CONTRACT_TYPE",
    "MAX_CHAIN_CONTRACTS",
    "RECEIPT_TYPE",
    "SESSION_TYPE",
    "BrokerKeys",
    "VerificationError",
    "Verified",
    "VerifiedContract",
    "conjoin_predicates",
    "message_class",
    "verify_chain",
    "verify_contract",
    "verify_every_signature",
    "verify_receipt",
    "verify_sealed",
]

_M = TypeVar("_M", bound=Message)
_PREFIX = "application/vnd."
_SUFFIX = "+protobuf"

#: The type a Sealed Contract is signed under (``IssuedContract.contract``,
#: ``ContractState.contract``, ``WatchResponse.contract``).
CONTRACT_TYPE = "application/vnd.delegation.broker.v1.Contract+protobuf"
#: The type a Sealed Receipt is signed under (``Refusal.receipt``, every
#: ``...Response.receipt``, ``GetReceiptResponse.receipt``, ``WatchResponse.receipt``).
RECEIPT_TYPE = "application/vnd.delegation.broker.v1.Receipt+protobuf"
#: The type a Sealed Session is signed under (``OpenSessionResponse.session``).
SESSION_TYPE = "application/vnd.delegation.broker.v1.Session+protobuf"

#: Most contracts :func:`verify_chain` accepts: the deepest policy the broker
#: allows is 64, so a chain has at most 65 contracts (this bounds the work a
#: hostile input can cause).
MAX_CHAIN_CONTRACTS = 65
#: Trust of 1.0, in parts per million.
PPM_ONE = 1_000_000
#: Longest effective predicate the broker issues, in UTF-8 bytes.
MAX_EFFECTIVE_PREDICATE_BYTES = 65_536

ChainItem = Union[pb.ContractState, pb.Sealed]


class VerificationError(Exception):
    """Something the broker signed, or a chain of contracts, does not verify.

    ``index`` is the position in the chain (root = 0) of the contract at fault,
    when the error is about one contract of a chain; None otherwise.
    """

    def __init__(self, message: str, *, index: int | None = None):
        super().__init__(message if index is None else f"contract {index}: {message}")
        self.index = index


def message_class(payload_type_: str) -> type[Message]:
    """The generated message class named by a payload type such as
    ``application/vnd.delegation.broker.v1.DelegateBody+protobuf`` (the type
    a DSSE envelope names)."""
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
    :meth:`fetch`). Each published key must be 32 bytes and its id must be
    ``"ed25519:" + hex(SHA-256(key)[:16])`` (:func:`delegation_broker.key_id`);
    otherwise construction fails with :class:`VerificationError` (a key under
    a wrong id must not vouch for anything). Retired keys keep verifying what
    they signed: keep them all.
    """

    def __init__(self, keys: Iterable[pb.BrokerKey]):
        self._keys: dict[str, bytes] = {}
        self.current: str | None = None
        for key in keys:
            if len(key.public_key) != 32:
                raise VerificationError(f"published key {key.key_id[:80]!r} is {len(key.public_key)} bytes, not 32")
            if key.key_id != key_id(key.public_key):
                raise VerificationError(f"published key id {key.key_id[:80]!r} does not match its public key")
            self._keys[key.key_id] = bytes(key.public_key)
            if key.current:
                self.current = key.key_id
        if not self._keys:
            raise VerificationError("no broker keys")

    @classmethod
    def fetch(cls, stub: pb.BrokerStub, timeout: float | None = 10.0) -> BrokerKeys:
        """Calls ``GetBrokerKeys`` on ``stub``."""
        return cls(stub.GetBrokerKeys(pb.GetBrokerKeysRequest(), timeout=timeout).keys)

    def __contains__(self, key_id_: object) -> bool:
        return key_id_ in self._keys

    def __getitem__(self, key_id_: str) -> bytes:
        return self._keys[key_id_]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"BrokerKeys({list(self._keys)}, current={self.current!r})"


@dataclass(frozen=True)
class Verified(Generic[_M]):
    """A verified Sealed: its decoded message, the broker key that signed it,
    the Sealed exactly as received and its id (SHA-256 of the payload)."""

    message: _M
    key_id: str
    sealed: pb.Sealed
    id: bytes


@dataclass(frozen=True)
class VerifiedContract:
    """A verified contract: its id, its terms and what follows from its chain.

    From :func:`verify_chain`, every field is proven (the leaf's signature
    covers each ancestor through the hash links). From :func:`verify_contract`
    (a contract alone), ``effective_predicate`` and ``principal_public_key``
    are known for a root only and None for a child: they need its ancestors.
    """

    #: SHA-256 of the payload.
    contract_id: bytes
    #: The decoded Contract.
    contract: pb.Contract
    #: The broker key that signed it (its ``broker_key_id``).
    key_id: str
    #: The Sealed exactly as received.
    sealed: pb.Sealed
    #: What the broker judges a completion on, derived root -> leaf (see
    #: ``Contract.predicate`` in types.proto); "" when there is none.
    effective_predicate: str | None
    #: Who issued it: the parent's delegate (a root's own delegate).
    principal_public_key: bytes | None


# --- one Sealed ---------------------------------------------------------------------


def _sealed_type(message_type: type[Message]) -> str:
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    if descriptor is None or "broker_key_id" not in descriptor.fields_by_name:
        name = descriptor.full_name if descriptor is not None else repr(message_type)
        raise VerificationError(f"{name} is not signed by the broker (no broker_key_id)")
    return payload_type(message_type)


def _decode(message_type: type[_M], payload: bytes, index: int | None = None) -> _M:
    try:
        return message_type.FromString(payload)
    except DecodeError:
        raise VerificationError(f"the payload is not a {message_type.DESCRIPTOR.full_name}", index=index) from None


def _as_sealed(sealed: object) -> pb.Sealed:
    if not isinstance(sealed, pb.Sealed):
        raise TypeError(
            f"expected a pb.Sealed (what the broker signs), got {type(sealed).__name__}"
            + (": agent-signed envelopes are checked with verify_signature" if isinstance(sealed, pb.Envelope) else "")
        )
    return sealed


def _check_signature(sealed: pb.Sealed, type_: str, key_id_: str, keys: BrokerKeys, index: int | None = None) -> None:
    if key_id_ not in keys:
        raise VerificationError(f"signed by {key_id_[:80]!r}, which is not a published broker key", index=index)
    if not verify_pae_signature(type_, sealed.payload, sealed.signature, keys[key_id_]):
        raise VerificationError(f"the signature does not verify under broker key {key_id_}", index=index)


def verify_sealed(sealed: pb.Sealed, keys: BrokerKeys, message_type: type[_M]) -> Verified[_M]:
    """Verifies any broker-signed Sealed whose message type is ``message_type``
    (``pb.Contract``, ``pb.Receipt`` or ``pb.Session``: the type the field
    carrying it implies) and returns the decoded message.

    The payload is decoded to read ``broker_key_id``, which must name a
    published key; the signature must then verify, strictly, under that key
    over ``PAE("application/vnd.delegation.broker.v1.<Type>+protobuf", payload)``.
    Only then are the message's fields to be trusted. Raises
    :class:`VerificationError` otherwise (and ``TypeError`` for something that
    is not a ``pb.Sealed``).
    """
    sealed = _as_sealed(sealed)
    type_ = _sealed_type(message_type)
    message = _decode(message_type, sealed.payload)
    _check_signature(sealed, type_, message.broker_key_id, keys)
    return Verified(message=message, key_id=message.broker_key_id, sealed=sealed, id=sha256(sealed.payload))


def verify_receipt(sealed: pb.Sealed, keys: BrokerKeys, receipt_id: bytes | None = None) -> Verified[pb.Receipt]:
    """Verifies a broker-signed Receipt (refusals and every lifecycle receipt:
    ACCEPTED, OBSERVED, COMPLETED, ESCALATED, REVOKED, ...) and, when
    ``receipt_id`` is given, that it is SHA-256 of the payload.

    A receipt binds to its contract by ``contract_id``: together with a chain
    verified up to that id (:func:`verify_chain` with ``contract_id=``) it
    proves the event happened to exactly those terms. Every lifecycle response
    carries ``receipt_id`` and ``receipt``:

    >>> response = stub.Complete(agent.complete(contract_id=cid, output_json="{}"))  # doctest: +SKIP
    >>> receipt = verify_receipt(response.receipt, keys, response.receipt_id).message  # doctest: +SKIP
    >>> receipt.completion.verdict  # doctest: +SKIP
    """
    verified = verify_sealed(sealed, keys, pb.Receipt)
    if receipt_id is not None and bytes(receipt_id) != verified.id:
        raise VerificationError(f"receipt id {bytes(receipt_id).hex()} is not SHA-256(payload) {verified.id.hex()}")
    return verified


def verify_contract(sealed: pb.Sealed, keys: BrokerKeys, contract_id: bytes | None = None) -> VerifiedContract:
    """Verifies one contract on its own: its signature (:func:`verify_sealed`)
    and, when ``contract_id`` is given, that it is SHA-256 of the payload.

    A root is the one-element chain it is: its terms are checked as
    :func:`verify_chain` checks a root's (``intent_lineage_hash`` =
    SHA-256(``intent``), trust ROOT at 1_000_000 ppm, a policy) and its
    effective predicate is derived. A child is checked only as far as it can
    be alone (it names a parent, depth >= 1, no intent, policy or labels of
    its own); its terms against its ancestors need :func:`verify_chain`.
    """
    sealed = _as_sealed(sealed)
    contract = _decode(pb.Contract, sealed.payload)
    if not contract.parent_id and contract.depth == 0:
        return verify_chain([sealed], keys, contract_id)[0]
    verified = verify_sealed(sealed, keys, pb.Contract)
    if contract_id is not None and bytes(contract_id) != verified.id:
        raise VerificationError(f"contract id {bytes(contract_id).hex()} is not SHA-256(payload) {verified.id.hex()}")
    contract = verified.message
    if not contract.parent_id or contract.depth == 0:
        raise VerificationError("neither a root (no parent_id, depth 0) nor a child (a parent_id, depth >= 1)")
    if contract.intent or contract.HasField("policy") or contract.labels:
        raise VerificationError("a child carries intent, policy or labels (the root's apply)")
    return VerifiedContract(
        contract_id=verified.id,
        contract=contract,
        key_id=verified.key_id,
        sealed=sealed,
        effective_predicate=None,
        principal_public_key=None,
    )


# --- chains ---------------------------------------------------------------------------


def _chain_items(chain: pb.GetChainResponse | Iterable[ChainItem]) -> list[pb.Sealed]:
    """The Sealed contracts of a chain given as ContractStates (GetChain,
    GetContract, ListChildren), Sealed contracts or a GetChainResponse. A
    ContractState's (unsigned) ``contract_id`` must be its contract's id."""
    if isinstance(chain, pb.GetChainResponse):
        chain = chain.chain
    out: list[pb.Sealed] = []
    for index, item in enumerate(chain):
        if len(out) > MAX_CHAIN_CONTRACTS:
            break  # too long anyway; do not read on
        if isinstance(item, pb.ContractState):
            if not item.HasField("contract"):
                raise VerificationError("carries no contract", index=index)
            if item.contract_id and item.contract_id != sha256(item.contract.payload):
                raise VerificationError("its contract_id is not SHA-256 of its payload", index=index)
            out.append(item.contract)
        else:
            out.append(_as_sealed(item))
    return out


def _bounded(sealed: list[pb.Sealed]) -> None:
    if not sealed:
        raise VerificationError("the chain is empty")
    if len(sealed) > MAX_CHAIN_CONTRACTS:
        raise VerificationError(f"more than {MAX_CHAIN_CONTRACTS} contracts: not a chain (the deepest policy is 64)")


def conjoin_predicates(inherited: str, predicate: str) -> str:
    """One step of the effective predicate's derivation (``Contract.predicate``
    in types.proto): ``inherited`` (the parent's effective predicate for a
    DELEGATE child, "" for a root or a PRINCIPAL child) conjoined with this
    contract's own ``predicate``, each part as ``"(" + p + "\\n)"``.
    Raises :class:`VerificationError` past 65_536 bytes (the broker's limit)."""
    if not predicate:
        text = inherited
    elif not inherited:
        text = f"({predicate}\n)"
    else:
        text = f"{inherited} && ({predicate}\n)"
    if len(text.encode("utf-8")) > MAX_EFFECTIVE_PREDICATE_BYTES:
        raise VerificationError(f"the effective predicate exceeds {MAX_EFFECTIVE_PREDICATE_BYTES} bytes")
    return text


def _under(path: str, prefix: str) -> bool:
    """A path is under a prefix when equal to it or when it continues with "/"
    after it; "/" alone covers every absolute path (the broker's scope rule)."""
    if prefix == "/":
        return path.startswith("/")
    return path == prefix or path.startswith(prefix + "/")


def _check_terms(sealed: list[pb.Sealed], ids: list[bytes], contracts: list[pb.Contract]) -> list[VerifiedContract]:
    """Steps 3-5 of "Verifying a chain": the hash links, the root's terms and
    each hop's terms against its parent, root -> leaf."""
    root = contracts[0]
    if root.parent_id or root.depth != 0:
        raise VerificationError(
            "the first contract is not a root (it names a parent or has depth > 0): the chain is cut", index=0
        )
    if root.intent_lineage_hash != lineage_hash(root.intent):
        raise VerificationError("intent_lineage_hash is not SHA-256(intent)", index=0)
    if (root.trust_source, root.factor_ppm, root.cumulative_trust_ppm) != (pb.TRUST_SOURCE_ROOT, PPM_ONE, PPM_ONE):
        raise VerificationError("a root's trust is ROOT, 1_000_000 ppm", index=0)
    if not root.HasField("policy"):
        raise VerificationError("the root carries no policy", index=0)
    policy = root.policy

    def step(index: int, inherited: str, own: str) -> str:
        try:
            return conjoin_predicates(inherited, own)
        except VerificationError as e:
            raise VerificationError(str(e), index=index) from None

    out = [
        VerifiedContract(
            contract_id=ids[0],
            contract=root,
            key_id=root.broker_key_id,
            sealed=sealed[0],
            effective_predicate=step(0, "", root.predicate),
            principal_public_key=bytes(root.delegate_public_key),
        )
    ]
    for index in range(1, len(contracts)):
        parent, p, c = out[-1], contracts[index - 1], contracts[index]
        fail = _Failure(index)
        if c.parent_id != ids[index - 1]:
            raise fail(f"parent_id is not the id of contract {index - 1}")
        if c.depth != p.depth + 1:
            raise fail("depth is not its parent's + 1")
        if c.depth > policy.max_depth:
            raise fail("depth exceeds the root policy's max_depth")
        if c.intent or c.HasField("policy") or c.labels:
            raise fail("a child carries intent, policy or labels (the root's apply)")
        if c.intent_lineage_hash != root.intent_lineage_hash:
            raise fail("intent_lineage_hash differs from the root's")
        if c.factor_ppm > PPM_ONE or c.cumulative_trust_ppm != p.cumulative_trust_ppm * c.factor_ppm // PPM_ONE:
            raise fail("cumulative_trust_ppm is not floor(parent x factor_ppm / 1_000_000)")
        if c.cumulative_trust_ppm < policy.min_cumulative_trust_ppm:
            raise fail("cumulative trust is below the root policy's minimum")
        if c.budget > p.budget or c.budget < 0:
            raise fail("budget exceeds the parent's")
        if c.deadline_ms > p.deadline_ms:
            raise fail("deadline is later than the parent's")
        if not all(any(_under(path, prefix) for prefix in p.write_scope) for path in c.write_scope):
            raise fail("write_scope reaches outside the parent's")
        if c.liability == pb.LIABILITY_DELEGATE and p.liability != pb.LIABILITY_DELEGATE:
            raise fail("a DELEGATE contract under a liability-retaining parent")
        inherited = parent.effective_predicate if c.liability == pb.LIABILITY_DELEGATE else ""
        out.append(
            VerifiedContract(
                contract_id=ids[index],
                contract=c,
                key_id=c.broker_key_id,
                sealed=sealed[index],
                effective_predicate=step(index, inherited or "", c.predicate),
                principal_public_key=bytes(p.delegate_public_key),
            )
        )
    return out


class _Failure:
    """``raise fail("detail")``: a VerificationError about contract ``index``."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, detail: str) -> VerificationError:
        return VerificationError(detail, index=self.index)


def verify_chain(
    chain: pb.GetChainResponse | Iterable[ChainItem],
    keys: BrokerKeys,
    contract_id: bytes | None = None,
) -> list[VerifiedContract]:
    """Verifies a chain of contracts, root first -- ``GetChain``'s answer
    (``response.chain``, the response itself, or the Sealed contracts) -- and
    returns every contract's id, terms and derived effective predicate.

    This is types.proto's "Verifying a chain", step by step:

    1. keys: ``keys`` holds only keys whose id matches them (:class:`BrokerKeys`);
    2. the leaf's signature: the last contract's payload names its
       ``broker_key_id``, which must be published, and its signature must
       verify strictly over ``PAE(Contract type, payload)``. It is the only
       signature checked: the broker signs a child only after checking it
       against its stored parent, and the child's payload commits to the
       parent's exact bytes (step 3), so this one signature proves every
       ancestor's terms too;
    3. hash links: each contract's id is SHA-256 of its payload; each
       ``parent_id`` must be its parent's id and each ``depth`` the parent's +
       1, and the first contract must be a root (no ``parent_id``, depth 0).
       A changed byte anywhere, a swapped, missing or foreign contract breaks
       a link. ``contract_id``, when given, must be the leaf's id;
    4. the root's terms: ``intent_lineage_hash`` = SHA-256(``intent``), trust
       source ROOT with ``factor_ppm`` and ``cumulative_trust_ppm`` 1_000_000,
       and a ``policy`` (the tree's; ``intent`` and ``labels`` are the root's too);
    5. each hop against its parent, root -> leaf: no ``intent``, ``policy`` or
       ``labels`` of its own; the root's lineage hash; ``cumulative_trust_ppm``
       = floor(parent's x ``factor_ppm`` / 1_000_000) (``factor_ppm`` at most
       1_000_000) and at least the root policy's ``min_cumulative_trust_ppm``;
       depth at most the policy's ``max_depth``; budget at most the parent's
       (and not negative); deadline at most the parent's; every ``write_scope``
       prefix inside the parent's scope (equal to a parent prefix or continuing
       it with "/"; "/" covers every absolute path); a DELEGATE child only under
       a DELEGATE parent (the root is recorded as DELEGATE). The effective
       predicate is derived along the way (:func:`conjoin_predicates`): a
       DELEGATE child's starts from its parent's, a PRINCIPAL child's from "".

    More than :data:`MAX_CHAIN_CONTRACTS` contracts are refused. Raises
    :class:`VerificationError` (``.index`` names the contract at fault, root =
    0). The broker's copy of each effective predicate
    (``ContractState.effective_predicate``, unsigned) should equal the derived
    one; rely on the derived one.
    """
    sealed = _chain_items(chain)
    _bounded(sealed)
    contracts = [_decode(pb.Contract, s.payload, index) for index, s in enumerate(sealed)]
    ids = [sha256(s.payload) for s in sealed]
    last = len(sealed) - 1
    if contract_id is not None and bytes(contract_id) != ids[last]:
        raise VerificationError(
            f"the last contract's id is {ids[last].hex()}, not the one asked for ({bytes(contract_id).hex()})"
        )
    _check_signature(sealed[last], CONTRACT_TYPE, contracts[last].broker_key_id, keys, index=last)
    return _check_terms(sealed, ids, contracts)


def verify_every_signature(chain: pb.GetChainResponse | Iterable[ChainItem], keys: BrokerKeys) -> None:
    """Checks every contract's own signature (strictly, under the key its
    payload names), for an auditor who keeps each contract on its own.

    :func:`verify_chain` does not need this: the leaf's signature covers the
    chain. PyNaCl has no batch verification (the Rust verifier batches them),
    so this checks one signature after another. Raises
    :class:`VerificationError` naming the first contract (``.index``) whose
    signature does not verify. It does not check the chain's links or terms:
    call :func:`verify_chain` for those.
    """
    sealed = _chain_items(chain)
    _bounded(sealed)
    for index, item in enumerate(sealed):
        contract = _decode(pb.Contract, item.payload, index)
        _check_signature(item, CONTRACT_TYPE, contract.broker_key_id, keys, index=index)
