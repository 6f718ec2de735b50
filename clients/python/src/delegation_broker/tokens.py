"""Tokens for resource servers: the broker's token endpoint (``serve --tokens ADDR``).

The holder of an open contract (its delegate) proves possession of its agent
key with an assertion it signs itself — a compact JWS, EdDSA, see
:func:`assertion` — and exchanges it (RFC 8693 token exchange) for a
broker-signed EdDSA JWT naming one resource as its audience and carrying the
delegation: ``act`` (the delegators, nearest first), ``txn`` (the root) and
``tctx`` (the contract's terms). Resource servers check that token with any
stock JWT library against the keys at the metadata's ``jwks_uri``, and may ask
the ``introspection_endpoint`` (RFC 7662) whether the delegation still stands.

>>> tokens = TokenEndpoint("http://127.0.0.1:8443")  # doctest: +SKIP
>>> minted = tokens.mint(agent, contract_id, "https://api.example")  # doctest: +SKIP
>>> headers = {"Authorization": f"Bearer {minted.access_token}"}  # doctest: +SKIP

Only the standard library speaks HTTP here (``urllib.request``), every request
with a timeout.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from .signing import Agent

__all__ = [
    "ASSERTION_LIFETIME_S",
    "JWT_TOKEN_TYPE",
    "METADATA_PATH",
    "MetadataError",
    "MintedToken",
    "TOKEN_EXCHANGE_GRANT",
    "TokenEndpoint",
    "TokenError",
    "assertion",
    "metadata_url",
]

#: RFC 8693's grant type: the only one the token endpoint serves.
TOKEN_EXCHANGE_GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
#: RFC 8693's token type of a JWT: the subject token (the assertion) and the issued token.
JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt"
#: RFC 8414's well-known path of the authorization server metadata.
METADATA_PATH = "/.well-known/oauth-authorization-server"
#: How long a fresh assertion lives (the broker accepts at most 300 s).
ASSERTION_LIFETIME_S = 60
#: Default timeout of every HTTP request, in seconds.
DEFAULT_TIMEOUT_S = 10.0
#: Largest answer read from the endpoint, in bytes.
_MAX_ANSWER_BYTES = 1 << 20


class TokenError(Exception):
    """An error answer of the token endpoint (RFC 6749 section 5.2): ``error``
    (``invalid_request``, ``invalid_grant``, ``invalid_target``,
    ``unsupported_grant_type``, ``invalid_client``, ``temporarily_unavailable``,
    ...), ``error_description`` (what was wrong) and the HTTP ``status``
    (400; 401 for ``invalid_client``; 503 for ``temporarily_unavailable``, worth
    retrying with a new assertion)."""

    def __init__(self, status: int, error: str, error_description: str = ""):
        self.status = status
        self.error = error
        self.error_description = error_description
        super().__init__(f"{status} {error}: {error_description}" if error_description else f"{status} {error}")


class MetadataError(ValueError):
    """The endpoint's metadata is malformed, or names another issuer than the
    URL it was fetched for (RFC 8414 section 3.3), or an answer is not what
    the endpoint documents."""


@dataclass(frozen=True)
class MintedToken:
    """A token minted for one resource: send ``access_token`` as
    ``Authorization: Bearer <access_token>``; it lives ``expires_in`` seconds
    (never past the contract's deadline)."""

    access_token: str
    expires_in: int
    token_type: str = "Bearer"
    issued_token_type: str = JWT_TOKEN_TYPE

    def __repr__(self) -> str:  # the token is a credential: keep it out of logs
        return f"MintedToken(access_token=<{len(self.access_token)} chars>, expires_in={self.expires_in})"


def _contract_hex(contract_id: Any) -> str:
    """Lowercase hex of a 32-byte contract id: ``bytes`` as the package's
    contracts carry it, or anything with a ``contract_id`` (``VerifiedContract``,
    ``pb.ContractState``, ``pb.IssuedContract``)."""
    if not isinstance(contract_id, (bytes, bytearray, memoryview)):
        contract_id = getattr(contract_id, "contract_id", contract_id)
    if not isinstance(contract_id, (bytes, bytearray, memoryview)):
        raise TypeError(f"a contract id is 32 bytes, got {type(contract_id).__name__}")
    raw = bytes(contract_id)
    if len(raw) != 32:
        raise ValueError(f"a contract id is 32 bytes, got {len(raw)}")
    return raw.hex()


def assertion(
    agent: Agent,
    contract_id: Any,
    audience: str,
    *,
    lifetime_s: int = ASSERTION_LIFETIME_S,
    issued_at: int | None = None,
    jti: str | None = None,
) -> str:
    """The holder's assertion for ``contract_id`` (bytes, or an object with a
    ``contract_id``): a compact JWS, header ``{"alg":"EdDSA","typ":"JWT"}``,
    claims ``iss`` = ``sub`` = hex of the agent's public key, ``aud`` =
    ``audience`` (the metadata's ``token_endpoint``, exactly), ``iat``,
    ``exp`` = ``iat + lifetime_s``, a random ``jti`` and ``contract_id``
    (lowercase hex), signed with the agent's ed25519 key.

    Each assertion is good for one exchange: the broker refuses a ``jti`` it
    has seen. ``issued_at`` (seconds since the epoch; default now) and ``jti``
    are for tests.
    """
    now = int(time.time()) if issued_at is None else int(issued_at)
    key = agent.public_key.hex()
    claims = {
        "iss": key,
        "sub": key,
        "aud": audience,
        "iat": now,
        "exp": now + int(lifetime_s),
        "jti": jti if jti is not None else secrets.token_hex(16),
        "contract_id": _contract_hex(contract_id),
    }
    return agent.sign_jws(claims)


def metadata_url(issuer: str) -> str:
    """Where the metadata of ``issuer`` is (RFC 8414 section 3.1): the
    well-known path inserted between the host and any path of the issuer."""
    parts = urllib.parse.urlsplit(issuer)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"the issuer must be an http(s) URL without query or fragment, got {issuer!r}")
    path = parts.path.rstrip("/")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, METADATA_PATH + path, "", ""))


class TokenEndpoint:
    """The broker's token endpoint at ``issuer`` (what ``serve --tokens``
    prints: ``http://ADDR``, or the configured ``[tokens] issuer``).

    :meth:`metadata` is fetched once and kept; its ``issuer`` must be
    ``issuer``. :meth:`mint` signs a fresh assertion and exchanges it;
    :meth:`exchange` presents one built by :func:`assertion`. Each HTTP
    request times out after ``timeout`` seconds; the endpoint's error answers
    raise :class:`TokenError`, network failures ``urllib.error.URLError``
    (an ``OSError``).
    """

    def __init__(self, issuer: str, *, timeout: float = DEFAULT_TIMEOUT_S):
        self.issuer = issuer.rstrip("/")
        self.timeout = timeout
        self._metadata_url = metadata_url(self.issuer)
        self._metadata: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"TokenEndpoint({self.issuer!r})"

    # --- discovery ---------------------------------------------------------------

    def metadata(self, refresh: bool = False) -> dict[str, Any]:
        """The authorization server metadata (RFC 8414): ``issuer``,
        ``token_endpoint``, ``jwks_uri``, ``introspection_endpoint``,
        ``grant_types_supported``, ...; fetched on first use (or with
        ``refresh``)."""
        if self._metadata is None or refresh:
            status, body = self._request(self._metadata_url)
            if status != 200:
                raise _error(status, body)
            for name in ("issuer", "token_endpoint", "jwks_uri"):
                if not isinstance(body.get(name), str) or not body[name]:
                    raise MetadataError(f"the metadata at {self._metadata_url} has no {name}")
            if body["issuer"].rstrip("/") != self.issuer:
                raise MetadataError(
                    f"the metadata at {self._metadata_url} names issuer {body['issuer']!r}, not {self.issuer!r}"
                )
            self._metadata = body
        return self._metadata

    @property
    def token_endpoint(self) -> str:
        """The token endpoint's URL: where tokens are minted and the ``aud`` of every assertion."""
        return self.metadata()["token_endpoint"]

    @property
    def jwks_uri(self) -> str:
        """Where the broker's verifying keys are (a JWK Set)."""
        return self.metadata()["jwks_uri"]

    def jwks(self) -> dict[str, Any]:
        """The JWK Set at ``jwks_uri``: ``{"keys": [{"kty": "OKP", "crv": "Ed25519", "x", "kid", ...}]}``,
        every key the broker signs or signed with."""
        status, body = self._request(self.jwks_uri)
        if status != 200:
            raise _error(status, body)
        if not isinstance(body.get("keys"), list):
            raise MetadataError(f"{self.jwks_uri} answered no key set")
        return body

    # --- minting -------------------------------------------------------------------

    def assertion(self, agent: Agent, contract_id: Any, **options) -> str:
        """:func:`assertion` for this endpoint (``aud`` = :attr:`token_endpoint`)."""
        return assertion(agent, contract_id, self.token_endpoint, **options)

    def mint(self, agent: Agent, contract_id: Any, resource: str) -> MintedToken:
        """A token for ``resource`` (one of the broker's ``[tokens] resources``)
        standing for ``contract_id`` (bytes, or an object with a
        ``contract_id``), which ``agent`` must hold (be its delegate): signs a
        fresh assertion and exchanges it. Refusals raise :class:`TokenError`:
        ``invalid_grant`` (not the holder, the contract or an ancestor ended or
        past its deadline), ``invalid_target`` (a resource not allowed), ..."""
        return self.exchange(self.assertion(agent, contract_id), resource)

    def exchange(self, subject_token: str, resource: str) -> MintedToken:
        """RFC 8693 token exchange of a signed assertion (``subject_token``)
        for a token for ``resource``."""
        form = {
            "grant_type": TOKEN_EXCHANGE_GRANT,
            "subject_token": subject_token,
            "subject_token_type": JWT_TOKEN_TYPE,
            "resource": resource,
        }
        status, body = self._request(self.token_endpoint, form)
        if status != 200:
            raise _error(status, body)
        token, expires_in = body.get("access_token"), body.get("expires_in")
        if not isinstance(token, str) or not token or not isinstance(expires_in, int) or isinstance(expires_in, bool):
            raise MetadataError(f"{self.token_endpoint} answered 200 without access_token and expires_in")
        if str(body.get("token_type", "")).lower() != "bearer":
            raise MetadataError(f"{self.token_endpoint} answered token_type {body.get('token_type')!r}, not Bearer")
        return MintedToken(
            access_token=token,
            expires_in=expires_in,
            token_type=body["token_type"],
            issued_token_type=body.get("issued_token_type", JWT_TOKEN_TYPE),
        )

    # --- HTTP -------------------------------------------------------------------------

    def _request(self, url: str, form: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """GET (or POST ``form``, url-encoded) ``url``; the status and the JSON
        object answered (an empty one when the answer is not JSON)."""
        data = urllib.parse.urlencode(form).encode("ascii") if form is not None else None
        request = urllib.request.Request(url, data=data, method="POST" if form is not None else "GET")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/x-www-form-urlencoded")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                status, raw = response.status, response.read(_MAX_ANSWER_BYTES)
        except urllib.error.HTTPError as error:
            status = error.code
            try:
                raw = error.read(_MAX_ANSWER_BYTES)
            except Exception:  # noqa: BLE001 - an error without a readable body is still that error
                raw = b""
            finally:
                error.close()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            if status == 200:
                raise MetadataError(f"{url} answered 200 without a JSON object")
            body = {"error_description": raw[:200].decode("utf-8", "replace")}
        return status, body


def _error(status: int, body: dict[str, Any]) -> TokenError:
    error = body.get("error")
    description = body.get("error_description")
    return TokenError(
        status,
        error if isinstance(error, str) and error else f"http_{status}",
        description if isinstance(description, str) else "",
    )
