"""The token endpoint (``serve --tokens``) against the real broker.

The agent side is this package (``TokenEndpoint``, ``assertion``); the
resource server (:class:`ResourceServer`) is written with stock libraries only
— PyJWT and urllib — as anyone's would be: it discovers the endpoints from the
RFC 8414 metadata, fetches the JWKS, verifies tokens (EdDSA, its audience, the
metadata's issuer) and introspects them (RFC 7662, HTTP Basic).
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from email.message import Message

import jwt
import pytest
from _support import CLIENT_ROOT, Broker, Root, Tokens, child
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from delegation_broker import (
    JWT_TOKEN_TYPE,
    TOKEN_EXCHANGE_GRANT,
    Agent,
    MetadataError,
    MintedToken,
    TokenEndpoint,
    TokenError,
    assertion,
    key_id,
    lineage_hash,
    pb,
)
from delegation_broker.tokens import metadata_url

RESOURCE = "https://api.test"
#: Also allowed: a token minted for it must not pass at RESOURCE.
OTHER_RESOURCE = "https://other.test"
RS_ID, RS_SECRET = "rs", "secret"
INTENT = "Fix the token refresh bug in src/auth/ and document it"


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Broker:
    """A broker of its own serving the token endpoint, with ``[tokens]``:
    two resources, five-minute tokens and one introspecting resource server.
    It must shut down gracefully on SIGTERM."""
    b = Broker(tmp_path_factory.mktemp("token-broker"),
               tokens=Tokens(resources=[RESOURCE, OTHER_RESOURCE], introspectors={RS_ID: RS_SECRET},
                             lifetime_minutes=5))
    yield b
    code = b.close()
    assert code == 0, f"broker exited with {code} on SIGTERM; log:\n{b.process.log_path.read_text()}"


@pytest.fixture(scope="module")
def tokens(broker) -> TokenEndpoint:
    return TokenEndpoint(broker.tokens_url)


# --- the resource server: PyJWT and urllib, nothing of delegation_broker -------------------


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200, url
        return json.load(response)


class ResourceServer:
    """Discovers the broker's endpoints from its metadata, verifies tokens with
    the JWKS and introspects them with its client credentials."""

    def __init__(self, issuer: str, resource: str = RESOURCE, client_id: str = RS_ID, secret: str = RS_SECRET):
        self.metadata = _get_json(issuer + "/.well-known/oauth-authorization-server")
        self.resource, self.client_id, self.secret = resource, client_id, secret
        self.jwks = jwt.PyJWKClient(self.metadata["jwks_uri"], cache_keys=False, timeout=10)

    def verify(self, token: str) -> dict:
        key = self.jwks.get_signing_key_from_jwt(token)
        return jwt.decode(token, key.key, algorithms=["EdDSA"], audience=self.resource,
                          issuer=self.metadata["issuer"],
                          options={"require": ["iss", "sub", "aud", "iat", "exp", "jti"]})

    def introspect(self, token: str, credentials: tuple[str, str] | None = ...) -> tuple[int, dict, Message]:
        """(HTTP status, JSON body, headers); ``credentials`` default to its
        own, None sends none."""
        if credentials is ...:
            credentials = (self.client_id, self.secret)
        request = urllib.request.Request(self.metadata["introspection_endpoint"],
                                         data=urllib.parse.urlencode({"token": token}).encode(), method="POST")
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
        if credentials is not None:
            basic = base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode()).decode()
            request.add_header("Authorization", f"Basic {basic}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.load(response), response.headers
        except urllib.error.HTTPError as error:
            with error:
                return error.code, json.load(error), error.headers


# --- trees ------------------------------------------------------------------------------------


@dataclass
class Chain:
    """root -> child -> grandchild -> great-grandchild (depth 3), each hop
    attested; the great-grandchild has delegated 3 of its 8 onward (so its
    residual is 5). ``holders[i]`` is the delegate of ``ids[i]``."""

    root: Root
    holders: list[Agent]
    ids: list[bytes]
    worker_id: bytes

    @property
    def leaf(self) -> bytes:
        return self.ids[3]


def depth_3_chain(broker: Broker) -> Chain:
    holders = [Agent.generate() for _ in range(4)]
    root = broker.open_root(holders[0], budget=100, max_depth=4, intent=INTENT)
    ids = [root.id]
    for holder, delegate, budget, factor in zip(holders, holders[1:], (50, 20, 8), (0.9, 0.8, 0.75)):
        ids.append(broker.delegate(holder, child(ids[-1], root.lineage, delegate, budget,
                                                 delegate_attestation=broker.attest(delegate, factor)))
                   .contract().contract_id)
    worker_id = broker.delegate(holders[3], child(ids[3], root.lineage, Agent.generate(), 3)).contract().contract_id
    return Chain(root, holders, ids, worker_id)


def inflated(token: str) -> str:
    """``token`` with its residual raised and its signature kept."""
    head, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["tctx"]["residual"] += 1_000_000
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{head}.{forged}.{signature}"


def refused(call) -> TokenError:
    with pytest.raises(TokenError) as caught:
        call()
    return caught.value


# --- discovery ------------------------------------------------------------------------------


def test_the_metadata_names_the_endpoints_under_the_issuer_and_the_jwks_holds_the_brokers_keys(broker, tokens):
    metadata = tokens.metadata()
    issuer = broker.tokens_url
    assert metadata["issuer"] == issuer
    assert metadata["token_endpoint"] == tokens.token_endpoint == issuer + "/token"
    assert metadata["jwks_uri"] == issuer + "/jwks"
    assert metadata["introspection_endpoint"] == issuer + "/introspect"
    assert metadata["grant_types_supported"] == [TOKEN_EXCHANGE_GRANT]
    assert "client_secret_basic" in metadata["introspection_endpoint_auth_methods_supported"]
    # The JWKS: the keys GetBrokerKeys publishes, as RFC 8037 OKP JWKs under the same key ids.
    keys = tokens.jwks()["keys"]
    published = {kid: broker.keys[kid] for kid in broker.keys}
    assert {k["kid"]: base64.urlsafe_b64decode(k["x"] + "=") for k in keys} == published
    assert broker.keys.current in published
    for k in keys:
        assert (k["kty"], k["crv"], k["alg"], k["use"]) == ("OKP", "Ed25519", "EdDSA", "sig")
        assert k["kid"] == key_id(base64.urlsafe_b64decode(k["x"] + "="))
    # RFC 8414 section 3.3: the metadata's issuer must be the one asked for.
    port = issuer.rsplit(":", 1)[1]
    with pytest.raises(MetadataError, match="names issuer"):
        TokenEndpoint(f"http://localhost:{port}").metadata()
    assert metadata_url("https://broker.example/tenant-a/") == \
        "https://broker.example/.well-known/oauth-authorization-server/tenant-a"


def test_an_assertion_is_a_jws_a_stock_library_verifies_under_the_agents_key():
    agent, contract_id = Agent.generate(), os.urandom(32)
    audience = "http://broker.test/token"
    signed = assertion(agent, contract_id, audience)
    public = Ed25519PublicKey.from_public_bytes(agent.public_key)
    assert jwt.get_unverified_header(signed) == {"alg": "EdDSA", "typ": "JWT"}
    claims = jwt.decode(signed, public, algorithms=["EdDSA"], audience=audience, issuer=agent.public_key.hex())
    assert claims["sub"] == claims["iss"] == agent.public_key.hex()
    assert claims["contract_id"] == contract_id.hex()
    assert claims["exp"] - claims["iat"] == 60 and abs(claims["iat"] - time.time()) < 5
    assert 16 <= len(claims["jti"]) <= 128
    assert assertion(agent, contract_id, audience) != signed, "a fresh jti each time"
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(signed, Ed25519PublicKey.from_public_bytes(Agent.generate().public_key), algorithms=["EdDSA"],
                   audience=audience)
    # A contract object names its id; anything but 32 bytes is refused.
    state = pb.ContractState(contract_id=contract_id)
    assert jwt.decode(assertion(agent, state, audience), options={"verify_signature": False})["contract_id"] == \
        contract_id.hex()
    with pytest.raises(ValueError):
        assertion(agent, contract_id[:31], audience)
    with pytest.raises(TypeError):
        assertion(agent, contract_id.hex(), audience)


# --- minting and verifying ----------------------------------------------------------------------


def test_a_depth_3_token_verifies_with_pyjwt_and_carries_the_chain_the_broker_serves(broker, tokens):
    chain = depth_3_chain(broker)
    minted = tokens.mint(chain.holders[3], chain.leaf, RESOURCE)
    assert isinstance(minted, MintedToken) and minted.token_type == "Bearer"
    assert minted.issued_token_type == JWT_TOKEN_TYPE
    assert minted.access_token not in repr(minted)

    rs = ResourceServer(broker.tokens_url)
    claims = rs.verify(minted.access_token)
    header = jwt.get_unverified_header(minted.access_token)
    assert (header["alg"], header["typ"], header["kid"]) == ("EdDSA", "at+jwt", broker.keys.current)

    served = broker.chain(chain.leaf)  # GetChain, verified offline: root first
    leaf = served[-1].contract
    assert [v.contract_id for v in served] == chain.ids
    assert claims["sub"] == claims["client_id"] == chain.holders[3].key_id == key_id(leaf.delegate_public_key)
    assert claims["aud"] == RESOURCE and claims["iss"] == broker.tokens_url
    assert claims["txn"] == chain.root.id.hex()
    assert claims["exp"] - claims["iat"] == minted.expires_in == 300
    assert claims["exp"] <= leaf.deadline_ms // 1000

    tctx = claims["tctx"]
    assert tctx["depth"] == 3 == leaf.depth
    assert tctx["lineage_hash"] == lineage_hash(INTENT).hex() == leaf.intent_lineage_hash.hex()
    assert tctx["residual"] == 5 == broker.ledger(chain.leaf).residual  # 8 - 3 reserved by the worker
    assert tctx["contract_id"] == chain.leaf.hex() and tctx["root_id"] == chain.root.id.hex()
    assert tctx["trust_ppm"] == leaf.cumulative_trust_ppm == 540_000
    assert tctx["deadline_ms"] == leaf.deadline_ms
    assert tctx["write_scope"] == list(leaf.write_scope)

    # act: the delegators, nearest first, each its delegate's key id and contract, the root's holder innermost.
    actors, act = [], claims.get("act")
    while act is not None:
        actors.append((act["sub"], act["contract_id"]))
        assert set(act) <= {"sub", "contract_id", "act"}, act
        act = act.get("act")
    assert actors == [(key_id(v.contract.delegate_public_key), v.contract_id.hex()) for v in reversed(served[:-1])]
    assert [sub for sub, _ in actors] == [h.key_id for h in reversed(chain.holders[:3])]

    # The resource server's checks are not vacuous: another audience, another
    # issuer, a changed payload or an unknown key do not pass.
    other = tokens.mint(chain.holders[3], chain.leaf, OTHER_RESOURCE)
    with pytest.raises(jwt.InvalidAudienceError):
        rs.verify(other.access_token)
    assert ResourceServer(broker.tokens_url, resource=OTHER_RESOURCE).verify(other.access_token)["aud"] == \
        OTHER_RESOURCE
    key = rs.jwks.get_signing_key_from_jwt(minted.access_token).key
    with pytest.raises(jwt.InvalidIssuerError):
        jwt.decode(minted.access_token, key, algorithms=["EdDSA"], audience=RESOURCE, issuer="https://elsewhere")
    with pytest.raises(jwt.InvalidSignatureError):
        rs.verify(inflated(minted.access_token))
    stranger_key = jwt.PyJWK({"kty": "OKP", "crv": "Ed25519", "x": base64.urlsafe_b64encode(
        Agent.generate().public_key).rstrip(b"=").decode()}, algorithm="EdDSA")
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(minted.access_token, stranger_key.key, algorithms=["EdDSA"], audience=RESOURCE)


def test_a_roots_token_has_no_act(broker, tokens):
    holder = Agent.generate()
    root = broker.open_root(holder, budget=40, intent=INTENT)
    claims = ResourceServer(broker.tokens_url).verify(tokens.mint(holder, root.id, RESOURCE).access_token)
    assert "act" not in claims
    assert claims["sub"] == holder.key_id and claims["txn"] == root.id.hex()
    assert (claims["tctx"]["depth"], claims["tctx"]["residual"], claims["tctx"]["trust_ppm"]) == (0, 40, 1_000_000)


# --- refusals ----------------------------------------------------------------------------------


def test_only_the_contracts_delegate_gets_a_token(broker, tokens):
    chain = depth_3_chain(broker)
    for who in (Agent.generate(), chain.holders[2], chain.holders[0]):  # a stranger, the parent's and root's holders
        error = refused(lambda: tokens.mint(who, chain.leaf, RESOURCE))
        assert (error.status, error.error) == (400, "invalid_grant"), error
        assert "contract" in error.error_description, error
    # A stranger learns nothing of whether the contract exists.
    stranger = Agent.generate()
    real = refused(lambda: tokens.mint(stranger, chain.leaf, RESOURCE))
    unknown = refused(lambda: tokens.mint(stranger, os.urandom(32), RESOURCE))
    assert (unknown.status, unknown.error, unknown.error_description) == \
        (real.status, real.error, real.error_description)
    # The holder does get one (the refusals above are about who signed).
    assert tokens.mint(chain.holders[3], chain.leaf, RESOURCE).access_token


def test_a_resource_outside_the_allow_list_is_an_invalid_target(broker, tokens):
    holder = Agent.generate()
    root = broker.open_root(holder, budget=10, intent=INTENT)
    error = refused(lambda: tokens.mint(holder, root.id, "https://evil.test"))
    assert (error.status, error.error) == (400, "invalid_target"), error
    assert "https://evil.test" in error.error_description, error
    assert tokens.mint(holder, root.id, RESOURCE).access_token


def test_an_expired_assertion_is_an_invalid_grant(broker, tokens):
    holder = Agent.generate()
    root = broker.open_root(holder, budget=10, intent=INTENT)
    expired = tokens.assertion(holder, root.id, issued_at=int(time.time()) - 200, lifetime_s=100)
    error = refused(lambda: tokens.exchange(expired, RESOURCE))
    assert (error.status, error.error) == (400, "invalid_grant"), error
    assert "expired" in error.error_description, error
    assert tokens.exchange(tokens.assertion(holder, root.id), RESOURCE).access_token


def test_a_replayed_assertion_is_an_invalid_grant(broker, tokens):
    holder = Agent.generate()
    root = broker.open_root(holder, budget=10, intent=INTENT)
    signed = tokens.assertion(holder, root.id)
    assert tokens.exchange(signed, RESOURCE).access_token
    jti = jwt.decode(signed, options={"verify_signature": False})["jti"]
    resigned = tokens.assertion(holder, root.id, issued_at=int(time.time()) - 1, jti=jti)
    assert resigned != signed
    for replay in (signed, resigned):  # the same assertion again; a new one under the same jti
        error = refused(lambda: tokens.exchange(replay, RESOURCE))
        assert (error.status, error.error) == (400, "invalid_grant"), error
        assert "jti" in error.error_description, error


@pytest.mark.parametrize("ending", ["declined", "revoked"])
def test_an_ended_contract_gets_no_token(broker, tokens, ending):
    orchestrator, worker = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator, budget=30, intent=INTENT)
    contract = broker.delegate(orchestrator, child(root.id, root.lineage, worker, 10)).contract().contract_id
    assert tokens.mint(worker, contract, RESOURCE).access_token
    if ending == "declined":
        broker.decline(worker, contract, "not my area")
    else:
        broker.revoke(orchestrator, contract)
    error = refused(lambda: tokens.mint(worker, contract, RESOURCE))
    assert (error.status, error.error) == (400, "invalid_grant"), error
    assert ending in error.error_description.lower(), error


# --- introspection -------------------------------------------------------------------------------


def test_introspection_is_active_until_the_root_is_revoked(broker, tokens):
    chain = depth_3_chain(broker)
    token = tokens.mint(chain.holders[3], chain.leaf, RESOURCE).access_token
    rs = ResourceServer(broker.tokens_url)
    claims = rs.verify(token)
    status, body, _ = rs.introspect(token)
    assert status == 200 and body.pop("active") is True and body.pop("token_type") == "Bearer", body
    assert body == claims

    # Changed, or not the broker's: inactive, nothing else said.
    for foreign in (inflated(token), "not-a-token",
                    assertion(chain.holders[3], chain.leaf, tokens.token_endpoint)):
        assert rs.introspect(foreign)[:2] == (200, {"active": False}), foreign

    broker.revoke(chain.holders[0], chain.root.id, "the run is cancelled")
    revoked_at = time.monotonic()
    while True:
        status, body, _ = rs.introspect(token)
        assert status == 200, body
        if body == {"active": False}:
            break
        assert body["active"] is True, body
        assert time.monotonic() - revoked_at < 1.0, "the token still introspects active 1 s after the root's revocation"
        time.sleep(0.05)
    error = refused(lambda: tokens.mint(chain.holders[3], chain.leaf, RESOURCE))
    assert (error.status, error.error) == (400, "invalid_grant"), error


def test_introspection_needs_a_configured_resource_servers_credentials(broker, tokens):
    holder = Agent.generate()
    root = broker.open_root(holder, budget=10, intent=INTENT)
    token = tokens.mint(holder, root.id, RESOURCE).access_token
    rs = ResourceServer(broker.tokens_url)
    for credentials in ((RS_ID, "wrong"), ("someone", RS_SECRET), None):
        status, body, headers = rs.introspect(token, credentials)
        assert (status, body["error"]) == (401, "invalid_client"), (credentials, body)
        assert headers.get("WWW-Authenticate", "").startswith("Basic"), headers
    assert rs.introspect(token)[1]["active"] is True


# --- the README ------------------------------------------------------------------------------------


def test_readme_tokens_snippet(broker, capsys):
    readme = (CLIENT_ROOT / "README.md").read_text()
    snippets = [s.split("```", 1)[0] for s in readme.split("```python\n")[1:]]
    (snippet,) = [s for s in snippets if "TokenEndpoint(" in s]
    assert "127.0.0.1:50051" in snippet and "http://127.0.0.1:8443" in snippet
    snippet = snippet.replace("http://127.0.0.1:8443", broker.tokens_url).replace("127.0.0.1:50051", broker.address)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["claims"]["sub"] == namespace["agent"].key_id
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["True 0 10"]
    assert "\n".join(printed) in readme
    namespace["channel"].close()
