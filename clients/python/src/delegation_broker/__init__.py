"""Python client of the delegation broker.

* :mod:`delegation_broker.pb` — every generated message and the ``BrokerStub``;
* :class:`Agent` — an ed25519 agent (or attestor) key that signs OpenRoot and
  Delegate requests and attestations;
* :meth:`Agent.sign_request` and the per-RPC methods (``accept``, ``complete``,
  ``record_receipts``, ...) — signed lifecycle requests;
* :meth:`Agent.open_session`, :func:`session_stub`, :class:`RenewingSession`,
  :class:`SessionInterceptor` — the read session every read carries
  (``x-broker-session-bin``), opened and renewed for an agent;
* :meth:`Agent.bind_identity`, :func:`bind_identity` — bind the agent's key to
  the workload identity a JWT-SVID or OIDC token proves (``BindIdentity``):
  contracts issued to it then name it (``Contract.delegate_identity``);
  refusals are ``IDENTITY_REFUSED`` errors whose ``check`` says why;
* :func:`call_idempotent` — resend the same signed request on transient errors;
* :class:`BrokerKeys`, :func:`verify_chain`, :func:`verify_contract`,
  :func:`verify_receipt`, :func:`verify_sealed`, :func:`verify_every_signature`
  — offline verification of what the broker signs (a ``pb.Sealed``: payload and
  signature, its type implied by the field carrying it), whole chains
  included: the leaf's signature, the hash links and every hop's terms;
* :func:`verify_signature`, :func:`verify_pae_signature` — the strict ed25519
  check of agent-signed DSSE envelopes (requests, attestations) and of any
  (type, payload, signature);
* :func:`watch` — a contract subtree's events, each verified, resumable by cursor;
* :class:`TraceContextInterceptor`, :func:`traced_channel` — every call carries
  the caller's OpenTelemetry trace context (``traceparent``, ...), when
  ``opentelemetry`` is installed; :func:`session_stub` installs it;
* :class:`TokenEndpoint`, :func:`assertion` — tokens for resource servers
  from the broker's token endpoint (``serve --tokens``): the holder's signed
  assertion exchanged for a broker-signed EdDSA JWT (:class:`MintedToken`),
  refusals as :class:`TokenError`;
* :func:`error_info` — the ``google.rpc.ErrorInfo`` of a failed call.
"""

# The generated modules refuse, at import, a protobuf or grpcio older than the
# one they were generated for: say so plainly (what is needed, what is installed).
try:
    from . import pb
except Exception as _error:  # VersionError (protobuf), RuntimeError (grpcio), ImportError (missing or too old)
    from ._requirements import explain as _explain

    raise ImportError(_explain(_error)) from _error
from .errors import ERROR_DOMAIN, ErrorInfo, error_info
from .identity import IDENTITY_CHECKS, IDENTITY_NOT_CONFIGURED, IDENTITY_REFUSED, bind_identity
from .retry import RETRYABLE, call_idempotent
from .session import (
    SESSION_METADATA,
    ReadSession,
    RenewingSession,
    SessionInterceptor,
    SessionSource,
    current_key_id,
    open_session,
    session_channel,
    session_stub,
)
from .signing import (
    MAX_SIGNATURES,
    Agent,
    key_id,
    lineage_hash,
    now_ms,
    pae,
    payload_type,
    request_class_for,
    sha256,
    verify_pae_signature,
    verify_signature,
)
from .verify import (
    CONTRACT_TYPE,
    MAX_CHAIN_CONTRACTS,
    RECEIPT_TYPE,
    SESSION_TYPE,
    BrokerKeys,
    VerificationError,
    Verified,
    VerifiedContract,
    conjoin_predicates,
    message_class,
    verify_chain,
    verify_contract,
    verify_every_signature,
    verify_receipt,
    verify_sealed,
)
from .tokens import (
    JWT_TOKEN_TYPE,
    TOKEN_EXCHANGE_GRANT,
    MetadataError,
    MintedToken,
    TokenEndpoint,
    TokenError,
    assertion,
)
from .tracing import TraceContextInterceptor, traced_channel
from .watch import Watch, WatchEvent, watch

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "BrokerKeys",
    "CONTRACT_TYPE",
    "ERROR_DOMAIN",
    "ErrorInfo",
    "IDENTITY_CHECKS",
    "IDENTITY_NOT_CONFIGURED",
    "IDENTITY_REFUSED",
    "JWT_TOKEN_TYPE",
    "MAX_CHAIN_CONTRACTS",
    "MAX_SIGNATURES",
    "MetadataError",
    "MintedToken",
    "RECEIPT_TYPE",
    "RETRYABLE",
    "ReadSession",
    "RenewingSession",
    "SESSION_METADATA",
    "SESSION_TYPE",
    "SessionInterceptor",
    "SessionSource",
    "TOKEN_EXCHANGE_GRANT",
    "TokenEndpoint",
    "TokenError",
    "TraceContextInterceptor",
    "VerificationError",
    "Verified",
    "VerifiedContract",
    "Watch",
    "WatchEvent",
    "assertion",
    "bind_identity",
    "call_idempotent",
    "conjoin_predicates",
    "error_info",
    "key_id",
    "lineage_hash",
    "message_class",
    "now_ms",
    "open_session",
    "current_key_id",
    "pae",
    "payload_type",
    "pb",
    "request_class_for",
    "session_channel",
    "session_stub",
    "sha256",
    "traced_channel",
    "verify_chain",
    "verify_contract",
    "verify_every_signature",
    "verify_pae_signature",
    "verify_receipt",
    "verify_sealed",
    "verify_signature",
    "watch",
]
