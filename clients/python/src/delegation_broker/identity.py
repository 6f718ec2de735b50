"""Workload identities: binding an agent's key to the identity a JWT proves.

A broker whose configuration trusts identity issuers (``[identity.issuers.NAME]``:
a SPIFFE trust domain and its bundle, or an OIDC issuer and its JWKS) binds an
agent's key to a workload identity when the agent presents a fresh JWT from one
of them in a ``BindIdentity`` request signed by that very key
(:meth:`Agent.bind_identity <delegation_broker.Agent.bind_identity>`). The
identity is the SPIFFE ID (``spiffe://trust-domain/path``) of a JWT-SVID, or
``"<iss>#<sub>"`` for an OIDC issuer; the binding lasts until the token's
``exp`` (bind again with a fresh token to renew it; the later binding replaces
the earlier).

While a key is bound, every contract the broker issues to it carries the
identity in ``Contract.delegate_identity`` (a root carries its opener's),
inside the signed payload, so a chain verified offline names the workloads
that held it; and the broker's ``[orchestrators]`` and ``[readers]
identities`` may admit it by identity pattern (``spiffe://td/path/*``).

>>> response = bind_identity(stub, agent, svid)  # doctest: +SKIP
>>> response.identity, response.issuer, response.expires_at_ms  # doctest: +SKIP

Refusals are the broker's usual errors, a ``grpc.RpcError`` whose
:func:`delegation_broker.error_info` says why: ``UNAUTHENTICATED`` with reason
:data:`IDENTITY_REFUSED` and ``metadata["check"]`` one of
:data:`IDENTITY_CHECKS` (the message names the claim); ``FAILED_PRECONDITION``
with :data:`IDENTITY_NOT_CONFIGURED` when the broker trusts no issuer.
"""

from __future__ import annotations

import grpc

from . import pb
from .retry import RETRYABLE, call_idempotent
from .signing import Agent

__all__ = [
    "IDENTITY_CHECKS",
    "IDENTITY_NOT_CONFIGURED",
    "IDENTITY_REFUSED",
    "bind_identity",
]

#: ``ErrorInfo.reason`` of a token that proves no identity (``UNAUTHENTICATED``).
IDENTITY_REFUSED = "IDENTITY_REFUSED"
#: ``ErrorInfo.reason`` when the broker trusts no identity issuer (``FAILED_PRECONDITION``).
IDENTITY_NOT_CONFIGURED = "IDENTITY_NOT_CONFIGURED"
#: The values of ``ErrorInfo.metadata["check"]`` of an :data:`IDENTITY_REFUSED`
#: error: which rule the token broke (errors.proto).
IDENTITY_CHECKS = frozenset({
    "IDENTITY_FORMAT",          # not a compact JWS with JSON header and claims
    "IDENTITY_ISSUER",          # an `iss` no configured issuer has (or none)
    "IDENTITY_ALGORITHM",       # `none`, HMAC, anything but EdDSA, ES256/384, RS256/384/512, PS256/384/512
    "IDENTITY_SIGNATURE",       # does not verify under the issuer's keys
    "IDENTITY_AUDIENCE",        # no `aud` value the issuer's entry accepts
    "IDENTITY_EXPIRED",         # `exp` passed
    "IDENTITY_NOT_YET_VALID",   # `nbf` or `iat` in the future
    "IDENTITY_LIFETIME",        # no `exp`, or one more than 24 h ahead
    "IDENTITY_SUBJECT",         # a `sub` that is no valid identity (not a SPIFFE ID, too long)
    "IDENTITY_TRUST_DOMAIN",    # a SPIFFE ID of a trust domain no issuer has
    "IDENTITY_KEY_BINDING",     # a `cnf` (RFC 7800) naming another key than the signer's
})


def bind_identity(
    stub: pb.BrokerStub,
    agent: Agent,
    token: str,
    *,
    attempts: int = 5,
    timeout: float | None = 10.0,
    retry_on: frozenset[grpc.StatusCode] = RETRYABLE,
) -> pb.BindIdentityResponse:
    """Binds ``agent``'s key to the workload identity ``token`` (a JWT-SVID
    or OIDC token, compact JWS) proves, on the broker behind ``stub``, and
    returns the broker's answer: ``identity``, ``issuer`` (the
    ``[identity.issuers.NAME]`` that vouched for it) and ``expires_at_ms``
    (the token's ``exp``, when the binding ends).

    The request is signed once by ``agent`` and resent unchanged on
    ``UNAVAILABLE`` and ``DEADLINE_EXCEEDED`` (up to ``attempts`` calls,
    :func:`delegation_broker.call_idempotent`): BindIdentity is not recorded
    in the broker's request log, so a resent request simply binds again,
    which is harmless. Anything else raises the ``grpc.RpcError``: read it
    with :func:`delegation_broker.error_info` (``reason``
    :data:`IDENTITY_REFUSED`, ``metadata["check"]``; or
    :data:`IDENTITY_NOT_CONFIGURED`). A refused token fails again: present a
    fresh one.
    """
    request = agent.bind_identity(token)
    return call_idempotent(stub.BindIdentity, request, attempts=attempts, timeout=timeout, retry_on=retry_on)
