"""Signing rules: PAE, key ids, payload types, strict ed25519 verification,
and the agent key that signs requests.

Mirrors ``src/crypto/mod.rs`` and ``src/client.rs`` of the broker. Two signed
forms share one rule, an ed25519 signature over PAE(type, payload):

* agents and attestors sign a DSSE ``pb.Envelope``, which names its type.
  Every signed request is ``<Name>Request(signed=Envelope)`` over a
  ``<Name>Body`` starting with a ``RequestHeader``; :meth:`Agent.sign_request`
  builds any of them (``OpenSession``, which opens a read session, included);
* the broker signs a ``pb.Sealed`` (payload and signature only), whose type
  is fixed by the field carrying it (see :mod:`delegation_broker.verify`).

:func:`verify_pae_signature` is the one strict check both use. It relies on
PyNaCl (libsodium), whose ed25519 verification rejects non-canonical ``S``,
small-order ``R`` and non-canonical or small-order public keys, like
ed25519-dalek's ``verify_strict`` (RFC 8032 section 5.1.7).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import TypeVar

from google.protobuf.message import Message
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from . import pb

__all__ = [
    "Agent",
    "MAX_SIGNATURES",
    "NONCE_BYTES",
    "key_id",
    "lineage_hash",
    "now_ms",
    "pae",
    "payload_type",
    "request_class_for",
    "sha256",
    "verify_pae_signature",
    "verify_signature",
]

#: Most signatures the broker's verifier looks at in one envelope.
MAX_SIGNATURES = 4
#: Nonce length used for fresh request headers (the broker accepts 16..=64).
NONCE_BYTES = 16

_M = TypeVar("_M", bound=Message)


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding:
    ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body`` (lengths in bytes)."""
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(type_bytes), type_bytes, len(payload), payload)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def key_id(public_key: bytes) -> str:
    """``"ed25519:"`` + lowercase hex of the first 16 bytes of SHA-256(public key)."""
    if len(public_key) != 32:
        raise ValueError(f"an ed25519 public key is 32 bytes, got {len(public_key)}")
    return "ed25519:" + sha256(public_key)[:16].hex()


def lineage_hash(intent: str) -> bytes:
    """The intent lineage hash every contract of a tree carries: SHA-256 of the
    UTF-8 bytes of the root's intent."""
    return sha256(intent.encode("utf-8"))


def payload_type(message: Message | type[Message]) -> str:
    """``application/vnd.<full proto name>+protobuf``, e.g.
    ``application/vnd.delegation.broker.v1.Contract+protobuf``."""
    return f"application/vnd.{message.DESCRIPTOR.full_name}+protobuf"


def now_ms() -> int:
    """Unix time in milliseconds."""
    return time.time_ns() // 1_000_000


def verify_pae_signature(payload_type_: str, payload: bytes, signature: bytes, public_key: bytes) -> bool:
    """True when ``signature`` is a valid ed25519 signature by ``public_key`` over
    ``PAE(payload_type_, payload)``, under strict verification.

    Strict (libsodium, as ed25519-dalek's ``verify_strict``): a signature whose
    ``S`` is not reduced below the group order, whose ``R`` is of small order,
    or a public key that is non-canonical or of small order never verifies.
    Anything malformed (a key that is not 32 bytes, a signature that is not 64)
    is simply False. The bytes are used exactly as given: never re-encode a
    payload before verifying it.
    """
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        key = VerifyKey(bytes(public_key))
        key.verify(pae(payload_type_, bytes(payload)), bytes(signature))
        return True
    except BadSignatureError:
        return False
    except Exception:  # noqa: BLE001 - any malformed key or signature is simply "does not verify"
        return False


def verify_signature(envelope: pb.Envelope, public_key: bytes, expected_type: str | None = None) -> bool:
    """True when some signature of the DSSE ``envelope`` (at most
    :data:`MAX_SIGNATURES`) verifies over PAE(payload_type, payload) under
    ``public_key`` (:func:`verify_pae_signature`).

    For agent-signed envelopes (requests, attestations). Checks only the
    signature (and ``payload_type`` when ``expected_type`` is given); the DSSE
    ``keyid`` hint is ignored. What the broker signs is a ``pb.Sealed``, not an
    envelope: verify it with :func:`delegation_broker.verify_sealed` and friends.
    """
    if expected_type is not None and envelope.payload_type != expected_type:
        return False
    if len(public_key) != 32 or len(envelope.signatures) > MAX_SIGNATURES:
        return False
    return any(
        verify_pae_signature(envelope.payload_type, envelope.payload, signature.sig, public_key)
        for signature in envelope.signatures
    )


def request_class_for(body_class: type[Message]) -> type[Message]:
    """The request message carrying a signed ``body_class``: ``pb.<Name>Request``
    for ``pb.<Name>Body``. Raises TypeError for anything else."""
    name = body_class.DESCRIPTOR.name
    request_class = getattr(pb, name[: -len("Body")] + "Request", None) if name.endswith("Body") else None
    if (
        request_class is None
        or "header" not in body_class.DESCRIPTOR.fields_by_name
        or "signed" not in request_class.DESCRIPTOR.fields_by_name
    ):
        raise TypeError(f"{body_class.DESCRIPTOR.full_name} is not a signed request body")
    return request_class


class Agent:
    """An agent's (or an attestor's) ed25519 key pair.

    >>> agent = Agent.generate()
    >>> request = agent.delegate(pb.DelegateBody(parent_id=..., ...))  # doctest: +SKIP
    >>> stub.Delegate(request)  # doctest: +SKIP
    """

    def __init__(self, signing_key: SigningKey):
        self._key = signing_key

    @classmethod
    def generate(cls) -> Agent:
        """A fresh key from the operating system's CSPRNG."""
        return cls(SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Agent:
        """The key whose 32-byte secret seed is ``seed`` (what ``delegation-broker
        keygen`` writes, hex-encoded)."""
        if len(seed) != 32:
            raise ValueError(f"an ed25519 seed is 32 bytes, got {len(seed)}")
        return cls(SigningKey(seed))

    @property
    def seed(self) -> bytes:
        """The 32-byte secret seed. Keep it secret."""
        return bytes(self._key)

    @property
    def public_key(self) -> bytes:
        """The 32-byte ed25519 public key."""
        return bytes(self._key.verify_key)

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)

    def __repr__(self) -> str:
        return f"Agent({self.key_id})"

    def header(self) -> pb.RequestHeader:
        """A request header with the current time and a fresh random nonce.

        The nonce is the idempotency key: to retry, resend the request built
        from this header unchanged (see :func:`delegation_broker.call_idempotent`),
        never a rebuilt one.
        """
        return pb.RequestHeader(agent_public_key=self.public_key, timestamp_ms=now_ms(), nonce=os.urandom(NONCE_BYTES))

    def sign(self, message: Message, payload_type_: str | None = None) -> pb.Envelope:
        """A single-signature DSSE envelope over ``message``'s serialized bytes;
        the payload type defaults to :func:`payload_type` of the message."""
        payload = message.SerializeToString(deterministic=True)
        return self.sign_bytes(payload_type_ or payload_type(message), payload)

    def sign_bytes(self, payload_type_: str, payload: bytes) -> pb.Envelope:
        """A single-signature DSSE envelope over ``payload`` as given."""
        signature = self._key.sign(pae(payload_type_, payload)).signature
        return pb.Envelope(
            payload_type=payload_type_,
            payload=payload,
            signatures=[pb.Signature(keyid=self.key_id, sig=signature)],
        )

    def sign_jws(self, claims: dict, typ: str = "JWT") -> str:
        """A compact JWS (RFC 7515) of ``claims`` signed with this key: header
        ``{"alg":"EdDSA","typ":typ}``, and an ed25519 signature (RFC 8037) over
        ``base64url(header) "." base64url(claims)`` (no padding). What the
        token endpoint takes as a holder's assertion
        (:func:`delegation_broker.tokens.assertion` builds the claims).

        The signed bytes always start with the base64url of ``{"alg"``, so
        they are never the PAE of a DSSE envelope (``DSSEv1 ...``).
        """
        header = {"alg": "EdDSA", "typ": typ}
        signing_input = ".".join(
            base64.urlsafe_b64encode(json.dumps(part, separators=(",", ":")).encode("utf-8")).rstrip(b"=").decode("ascii")
            for part in (header, claims)
        )
        signature = self._key.sign(signing_input.encode("ascii")).signature
        return signing_input + "." + base64.urlsafe_b64encode(signature).rstrip(b"=").decode("ascii")

    def _with_header(self, body: _M | None, template: type[_M], fields: dict) -> _M:
        if body is None:
            body = template(**fields)
        elif fields:
            raise TypeError("pass either a body message or keyword fields, not both")
        elif not isinstance(body, template):
            raise TypeError(f"expected a {template.DESCRIPTOR.name}, got {type(body).__name__}")
        else:
            copy = template()
            copy.CopyFrom(body)
            body = copy
        if not body.HasField("header"):
            body.header.CopyFrom(self.header())
        return body

    def sign_request(self, body: Message) -> Message:
        """The signed request for any request body: ``pb.<Name>Body`` in,
        ``pb.<Name>Request(signed=<envelope over the body>)`` out, with payload
        type ``application/vnd.delegation.broker.v1.<Name>Body+protobuf``.

        A body without a ``header`` gets a fresh one (current time, new nonce);
        ``body`` itself is not modified. Every per-RPC method below
        (:meth:`open_root`, :meth:`delegate`, :meth:`accept`, ...) is this with
        the body type fixed.
        """
        request_class = request_class_for(type(body))
        return request_class(signed=self.sign(self._with_header(body, type(body), {})))

    def _request(self, template: type[_M], body: _M | None, fields: dict) -> Message:
        return request_class_for(template)(signed=self.sign(self._with_header(body, template, fields)))

    def open_root(self, body: pb.OpenRootBody | None = None, **fields) -> pb.OpenRootRequest:
        """A signed OpenRoot request. Takes an ``OpenRootBody`` or its fields as
        keywords; fills in a fresh header when the body has none."""
        return self._request(pb.OpenRootBody, body, fields)

    def delegate(self, body: pb.DelegateBody | None = None, **fields) -> pb.DelegateRequest:
        """A signed Delegate request. Takes a ``DelegateBody`` or its fields as
        keywords; fills in a fresh header when the body has none."""
        return self._request(pb.DelegateBody, body, fields)

    def open_session(self, body: pb.OpenSessionBody | None = None, **fields) -> pb.OpenSessionRequest:
        """A signed OpenSession request: the broker answers with a read session
        for this key (``OpenSessionResponse.session``), to send as the
        ``x-broker-session-bin`` metadata of every read (see
        :mod:`delegation_broker.session`, whose ``open_session`` fills in the
        broker for you). Takes an ``OpenSessionBody`` or its fields as keywords:
        ``broker_key_id`` (required) is the broker's current key id from
        ``GetBrokerKeys``, so the request opens a session on that broker only.
        Fills in a fresh header when the body has none; the timestamp must be
        within the broker's window."""
        return self._request(pb.OpenSessionBody, body, fields)

    def bind_identity(self, body: pb.BindIdentityBody | str | None = None, **fields) -> pb.BindIdentityRequest:
        """A signed BindIdentity request: binds this key to the workload
        identity a JWT from an issuer the broker trusts proves (a SPIFFE
        JWT-SVID, an OIDC token). Takes the token itself
        (``agent.bind_identity(token)``), a ``BindIdentityBody`` or its fields
        as keywords (``token=...``); fills in a fresh header when the body has
        none. :func:`delegation_broker.bind_identity` sends it."""
        if isinstance(body, str):
            if fields:
                raise TypeError("pass either the token or keyword fields, not both")
            body, fields = None, {"token": body}
        return self._request(pb.BindIdentityBody, body, fields)

    # Lifecycle requests. Each takes its ``...Body`` or the body's fields as
    # keywords, like open_root/delegate; the signer each RPC expects is noted.

    def accept(self, body: pb.AcceptBody | None = None, **fields) -> pb.AcceptRequest:
        """As the contract's delegate: accept it (``contract_id``; optionally
        ``host_public_key`` when the Delegate request named no host)."""
        return self._request(pb.AcceptBody, body, fields)

    def decline(self, body: pb.DeclineBody | None = None, **fields) -> pb.DeclineRequest:
        """As the contract's delegate: decline it (``contract_id``, ``reason``)."""
        return self._request(pb.DeclineBody, body, fields)

    def complete(self, body: pb.CompleteBody | None = None, **fields) -> pb.CompleteRequest:
        """As the contract's delegate: report the result (``contract_id``,
        ``output_json``, optional ``report``, ``claim``, ``consumed``)."""
        return self._request(pb.CompleteBody, body, fields)

    def adjudicate(self, body: pb.AdjudicateBody | None = None, **fields) -> pb.AdjudicateRequest:
        """As the principal (the parent contract's delegate): record the verdict
        on a completed contract pending it (``contract_id``, ``verdict``, ``reason``)."""
        return self._request(pb.AdjudicateBody, body, fields)

    def escalate(self, body: pb.EscalateBody | None = None, **fields) -> pb.EscalateRequest:
        """As the contract's delegate: return it as unresolvable (``contract_id``, ``reason``)."""
        return self._request(pb.EscalateBody, body, fields)

    def revoke(self, body: pb.RevokeBody | None = None, **fields) -> pb.RevokeRequest:
        """As the holder of any ancestor: revoke a contract and its open
        descendants (``contract_id``, ``reason``)."""
        return self._request(pb.RevokeBody, body, fields)

    def record_receipts(self, body: pb.RecordReceiptsBody | None = None, **fields) -> pb.RecordReceiptsRequest:
        """As the contract's host: record observations (``contract_id``,
        ``observations``: 1..=256 ``pb.Observation``)."""
        return self._request(pb.RecordReceiptsBody, body, fields)

    def attest(
        self,
        agent_public_key: bytes,
        factor: float,
        expires_at_ms: int,
        risk_class: str = "",
        not_before_ms: int = 0,
    ) -> pb.Envelope:
        """As an attestor: an Attestation envelope vouching for ``agent_public_key``
        with trust ``factor`` in (0, 1] (floored to ppm) from ``not_before_ms``
        (0: at once) until ``expires_at_ms``. The broker must trust this key
        (``[trust] attestors = ["<hex public key>"]``)."""
        return self.sign(
            pb.Attestation(
                agent_public_key=agent_public_key,
                factor=factor,
                risk_class=risk_class,
                expires_at_ms=expires_at_ms,
                not_before_ms=not_before_ms,
            )
        )
