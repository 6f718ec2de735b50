"""Workload identities (BindIdentity) against the real broker.

The issuer is made here, as SPIRE's JWT signer would be: an ES256 key
(``cryptography``), its SPIFFE bundle (a JWKS whose keys are for JWT-SVIDs)
written to a file the broker's ``[identity.issuers.spire]`` reads, and
JWT-SVIDs signed with PyJWT. The broker of this module admits orchestrators
only by SPIFFE ID pattern and lets ``spiffe://prod.test/auditors/*`` read
every tree; the agents bind with ``delegation_broker.bind_identity`` and every
chain is verified offline with the package's verifier.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import grpc
import jwt
import pytest
from _support import CLIENT_ROOT, Broker, assert_unknowable, child, refusal, rust_chain
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from delegation_broker import (
    ERROR_DOMAIN,
    IDENTITY_CHECKS,
    IDENTITY_NOT_CONFIGURED,
    IDENTITY_REFUSED,
    Agent,
    BrokerKeys,
    VerificationError,
    bind_identity,
    error_info,
    payload_type,
    pb,
    verify_chain,
    verify_signature,
)

TRUST_DOMAIN = "prod.test"
AUDIENCE = "delegation-broker"
KID = "k1"
ORCHESTRATORS = f"spiffe://{TRUST_DOMAIN}/orchestrators/*"
AUDITORS = f"spiffe://{TRUST_DOMAIN}/auditors/*"
ROOT_ALLOWANCE = 1_000


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def now_s() -> int:
    return int(time.time())


def svid_claims(path: str, trust_domain: str = TRUST_DOMAIN, **changes) -> dict:
    """A JWT-SVID's claims for ``spiffe://<trust_domain><path>``, valid for five
    minutes from now; ``changes`` replace claims."""
    now = now_s()
    claims = {"sub": f"spiffe://{trust_domain}{path}", "aud": [AUDIENCE], "exp": now + 300, "iat": now}
    claims.update(changes)
    return claims


class Spire:
    """A SPIFFE issuer's JWT signer: an ES256 (P-256) key named ``kid``."""

    def __init__(self, kid: str = KID):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.kid = kid

    def bundle(self) -> dict:
        """The SPIFFE bundle (a JWKS) the broker reads: the public key, for JWT-SVIDs."""
        numbers = self.key.public_key().public_numbers()
        return {
            "keys": [{
                "kty": "EC", "crv": "P-256", "use": "jwt-svid", "kid": self.kid,
                "x": b64url(numbers.x.to_bytes(32, "big")), "y": b64url(numbers.y.to_bytes(32, "big")),
            }],
            "spiffe_sequence": 1,
        }

    def sign(self, claims: dict) -> str:
        """``claims`` as a JWT-SVID: header ``{"alg":"ES256","kid":kid,"typ":"JWT"}``, signed with PyJWT."""
        return jwt.encode(claims, self.key, algorithm="ES256", headers={"kid": self.kid})

    def svid(self, path: str, **changes) -> str:
        return self.sign(svid_claims(path, **changes))

    def public_pem(self) -> bytes:
        return self.key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo)

    def public_point(self) -> bytes:
        return self.key.public_key().public_bytes(serialization.Encoding.X962,
                                                  serialization.PublicFormat.UncompressedPoint)


def hs256(claims: dict, secret: bytes, kid: str = KID) -> str:
    """``claims`` signed HS256 with ``secret``, by hand (PyJWT refuses a PEM key as an HMAC secret)."""
    header = {"alg": "HS256", "kid": kid, "typ": "JWT"}
    signing_input = ".".join(b64url(json.dumps(part, separators=(",", ":")).encode()) for part in (header, claims))
    tag = hmac.new(secret, signing_input.encode("ascii"), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(tag)}"


def issuer_config(bundle_path) -> str:
    return (
        "[identity.issuers.spire]\n"
        'kind = "spiffe"\n'
        f"trust_domain = {json.dumps(TRUST_DOMAIN)}\n"
        f"audiences = [{json.dumps(AUDIENCE)}]\n"
        f"jwks_file = {json.dumps(str(bundle_path))}\n"
        "\n[orchestrators]\n"
        f"{json.dumps(ORCHESTRATORS)} = {ROOT_ALLOWANCE}\n"
    )


@pytest.fixture(scope="module")
def spire() -> Spire:
    return Spire()


@pytest.fixture(scope="module")
def ibroker(tmp_path_factory, spire) -> Broker:
    """A broker of its own trusting ``spire`` (its bundle in a file), whose
    orchestrators are named only by a SPIFFE ID pattern and whose readers
    include ``spiffe://prod.test/auditors/*``. It must shut down gracefully."""
    workdir = tmp_path_factory.mktemp("identity-broker")
    bundle = workdir / "bundle.json"
    bundle.write_text(json.dumps(spire.bundle()))
    b = Broker(workdir, reader_identities=[AUDITORS], config=issuer_config(bundle))
    yield b
    code = b.close()
    assert code == 0, f"broker exited with {code} on SIGTERM; log:\n{b.process.log_path.read_text()}"


def identity_refusal(call) -> tuple[grpc.StatusCode, str, str]:
    """Runs ``call``, which must fail with the broker's ErrorInfo: (code, reason, metadata ``check``)."""
    with pytest.raises(grpc.RpcError) as raised:
        call()
    info = error_info(raised.value)
    assert info is not None and info.domain == ERROR_DOMAIN, raised.value
    return raised.value.code(), info.reason, info.metadata.get("check", "")


def not_an_orchestrator(broker: Broker, agent: Agent) -> None:
    code, reason, _, _ = refusal(lambda: broker.open_root(agent))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "NOT_AN_ORCHESTRATOR")


def all_roots(stub: pb.BrokerStub) -> list[bytes]:
    """Every root ListRoots shows the stub's session key, page by page."""
    ids, token = [], b""
    while True:
        page = stub.ListRoots(pb.ListRootsRequest(page_size=50, page_token=token), timeout=10)
        ids.extend(state.contract_id for state in page.roots)
        token = page.next_page_token
        if not token:
            return ids


# --- the request -------------------------------------------------------------------------


def test_bind_identity_is_a_request_signed_by_the_key_to_bind():
    agent = Agent.generate()
    request = agent.bind_identity("header.claims.signature")
    assert isinstance(request, pb.BindIdentityRequest)
    assert request.signed.payload_type == "application/vnd.delegation.broker.v1.BindIdentityBody+protobuf"
    assert request.signed.payload_type == payload_type(pb.BindIdentityBody)
    assert verify_signature(request.signed, agent.public_key, payload_type(pb.BindIdentityBody))
    assert not verify_signature(request.signed, Agent.generate().public_key)
    body = pb.BindIdentityBody.FromString(request.signed.payload)
    assert body.token == "header.claims.signature"
    assert body.header.agent_public_key == agent.public_key and len(body.header.nonce) == 16
    # The other forms of the package's signed requests build the same body.
    for same in (agent.bind_identity(token="header.claims.signature"),
                 agent.bind_identity(pb.BindIdentityBody(header=body.header, token=body.token)),
                 agent.sign_request(pb.BindIdentityBody(header=body.header, token=body.token))):
        assert pb.BindIdentityBody.FromString(same.signed.payload).token == body.token
    assert agent.bind_identity(pb.BindIdentityBody(header=body.header, token=body.token)) == request
    with pytest.raises(TypeError):
        agent.bind_identity("a.b.c", token="a.b.c")


class FlakyStub:
    """``BindIdentity`` failing with ``code`` ``failures`` times, then answering; keeps what it was sent."""

    def __init__(self, code: grpc.StatusCode, failures: int):
        self.code, self.failures, self.sent = code, failures, []

    def BindIdentity(self, request, timeout=None):  # noqa: N802 - the stub's method name
        self.sent.append(request)
        if len(self.sent) <= self.failures:
            error = grpc.RpcError()
            error.code = lambda: self.code
            raise error
        return pb.BindIdentityResponse(identity="spiffe://prod.test/w", issuer="spire", expires_at_ms=1)


def test_bind_identity_resends_the_same_request_on_transient_errors_only():
    agent = Agent.generate()
    flaky = FlakyStub(grpc.StatusCode.UNAVAILABLE, failures=2)
    assert bind_identity(flaky, agent, "a.b.c").identity == "spiffe://prod.test/w"
    assert len(flaky.sent) == 3 and flaky.sent[0] == flaky.sent[1] == flaky.sent[2]
    refused = FlakyStub(grpc.StatusCode.UNAUTHENTICATED, failures=1)
    with pytest.raises(grpc.RpcError):
        bind_identity(refused, agent, "a.b.c")
    assert len(refused.sent) == 1


# --- against the broker --------------------------------------------------------------------


def test_an_orchestrator_named_by_a_spiffe_pattern_binds_opens_a_root_and_the_verified_chain_names_workloads(
        ibroker, spire, tmp_path):
    orchestrator, worker = Agent.generate(), Agent.generate()
    # Unbound, the key is nobody's orchestrator: [orchestrators] names only a pattern.
    not_an_orchestrator(ibroker, orchestrator)

    claims = svid_claims("/orchestrators/planner")
    bound = bind_identity(ibroker.bare_stub, orchestrator, spire.sign(claims))
    assert bound == pb.BindIdentityResponse(identity="spiffe://prod.test/orchestrators/planner", issuer="spire",
                                            expires_at_ms=claims["exp"] * 1000)
    # The pattern's allowance holds for the identity.
    code, reason, _, _ = refusal(lambda: ibroker.open_root(orchestrator, budget=ROOT_ALLOWANCE + 1))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ROOT_BUDGET_OVER_ALLOWANCE")
    root = ibroker.open_root(orchestrator, budget=100)
    assert root.contract.delegate_identity == bound.identity

    worker_bound = bind_identity(ibroker.bare_stub, worker, spire.svid("/workers/w1"))
    assert (worker_bound.identity, worker_bound.issuer) == ("spiffe://prod.test/workers/w1", "spire")
    issued = ibroker.delegate(orchestrator, child(root.id, root.lineage, worker, 40)).contract()
    assert issued.contract.delegate_identity == worker_bound.identity

    # The chain, read as the worker (a party of the tree), verified offline
    # from the published keys alone: each hop names its workload.
    keys = BrokerKeys.fetch(ibroker.bare_stub)
    response = ibroker.stub_for(worker).GetChain(pb.GetChainRequest(contract_id=issued.contract_id), timeout=10)
    chain = verify_chain(response, keys, issued.contract_id)
    assert [(hop.contract.depth, hop.contract.delegate_public_key, hop.contract.delegate_identity) for hop in chain] == [
        (0, orchestrator.public_key, "spiffe://prod.test/orchestrators/planner"),
        (1, worker.public_key, "spiffe://prod.test/workers/w1"),
    ]
    assert [hop.contract_id for hop in chain] == [root.id, issued.contract_id]
    # The identity is inside the signed payload: renaming the workload breaks the signature.
    sealed = [pb.Sealed(payload=state.contract.payload, signature=state.contract.signature) for state in response.chain]
    leaf = pb.Contract.FromString(sealed[-1].payload)
    leaf.delegate_identity = "spiffe://prod.test/workers/someone-else"
    sealed[-1].payload = leaf.SerializeToString(deterministic=True)
    with pytest.raises(VerificationError) as broken:
        verify_chain(sealed, keys)
    assert broken.value.index == 1, broken.value
    # The Rust verifier agrees on the genuine chain.
    lines = rust_chain(tmp_path / "chain.bin", response.chain, [keys[k] for k in keys], issued.contract_id,
                       all_signatures=True)
    assert lines is not None and lines[-1] == "ok chain of 2 contracts, every signature checked", lines


REFUSALS = [
    ("expired", lambda s: s.svid("/orchestrators/x", exp=now_s() - 120, iat=now_s() - 600), "IDENTITY_EXPIRED"),
    ("wrong audience", lambda s: s.svid("/orchestrators/x", aud=["someone-else"]), "IDENTITY_AUDIENCE"),
    ("alg none", lambda s: jwt.encode(svid_claims("/orchestrators/x"), None, algorithm="none"),
     "IDENTITY_ALGORITHM"),
    ("HS256 keyed with the issuer's PEM public key",
     lambda s: hs256(svid_claims("/orchestrators/x"), s.public_pem()), "IDENTITY_ALGORITHM"),
    ("HS256 keyed with the issuer's public point",
     lambda s: hs256(svid_claims("/orchestrators/x"), s.public_point()), "IDENTITY_ALGORITHM"),
    ("another trust domain", lambda s: s.sign(svid_claims("/orchestrators/x", trust_domain="staging.test")),
     "IDENTITY_TRUST_DOMAIN"),
    ("signed by another key under the issuer's kid", lambda s: Spire(kid=KID).svid("/orchestrators/x"),
     "IDENTITY_SIGNATURE"),
    ("lives more than a day", lambda s: s.svid("/orchestrators/x", exp=now_s() + 2 * 86_400), "IDENTITY_LIFETIME"),
    ("not a JWT", lambda s: "not.a.jwt", "IDENTITY_FORMAT"),
]


@pytest.mark.parametrize("make_token, check", [(make, check) for _, make, check in REFUSALS],
                         ids=[case for case, _, _ in REFUSALS])
def test_a_bad_workload_token_is_refused_naming_the_check_and_binds_nothing(ibroker, spire, make_token, check):
    agent = Agent.generate()
    token = make_token(spire)
    assert identity_refusal(lambda: bind_identity(ibroker.bare_stub, agent, token)) == (
        grpc.StatusCode.UNAUTHENTICATED, IDENTITY_REFUSED, check)
    assert check in IDENTITY_CHECKS
    # Nothing was bound: the key is still nobody's orchestrator, and the same token fails again.
    not_an_orchestrator(ibroker, agent)
    assert identity_refusal(lambda: bind_identity(ibroker.bare_stub, agent, token))[2] == check


def test_a_reader_named_by_identity_lists_every_root_and_an_unbound_key_sees_none(ibroker, spire):
    orchestrator, worker = Agent.generate(), Agent.generate()
    bind_identity(ibroker.bare_stub, orchestrator, spire.svid("/orchestrators/lister"))
    root = ibroker.open_root(orchestrator)
    leaf = ibroker.delegate(orchestrator, child(root.id, root.lineage, worker, 10)).contract().contract_id

    auditor, stranger, other_workload = Agent.generate(), Agent.generate(), Agent.generate()
    auditor_stub = ibroker.stub_for(auditor)
    # Before binding, the auditor's key is a stranger to the tree.
    assert root.id not in all_roots(auditor_stub)
    bound = bind_identity(ibroker.bare_stub, auditor, spire.svid("/auditors/a"))
    assert bound.identity == "spiffe://prod.test/auditors/a"
    # Bound to spiffe://prod.test/auditors/*: it reads every tree (the same session).
    assert root.id in all_roots(auditor_stub)
    keys = BrokerKeys.fetch(ibroker.bare_stub)
    chain = verify_chain(auditor_stub.GetChain(pb.GetChainRequest(contract_id=leaf), timeout=10), keys, leaf)
    assert [hop.contract.delegate_identity for hop in chain] == ["spiffe://prod.test/orchestrators/lister", ""]

    # An unbound key, and a key bound to an identity no reader pattern names, see none of it.
    bind_identity(ibroker.bare_stub, other_workload, spire.svid("/workers/w2"))
    for outsider in (stranger, other_workload):
        stub = ibroker.stub_for(outsider)
        assert all_roots(stub) == []
        assert_unknowable(lambda cid: stub.GetContract(pb.GetContractRequest(contract_id=cid), timeout=10), root.id)
        assert_unknowable(lambda cid: stub.GetChain(pb.GetChainRequest(contract_id=cid), timeout=10), leaf)


def test_resending_a_bind_request_binds_again_and_a_later_binding_replaces_the_earlier(ibroker, spire):
    agent = Agent.generate()
    request = agent.bind_identity(spire.svid("/workers/w3"))
    first = ibroker.bare_stub.BindIdentity(request, timeout=10)
    again = ibroker.bare_stub.BindIdentity(request, timeout=10)  # same nonce: not in the request log
    assert first == again and first.identity == "spiffe://prod.test/workers/w3"
    not_an_orchestrator(ibroker, agent)  # a worker's identity is no orchestrator's
    promoted = bind_identity(ibroker.bare_stub, agent, spire.svid("/orchestrators/promoted"))
    assert promoted.identity == "spiffe://prod.test/orchestrators/promoted"
    assert ibroker.open_root(agent).contract.delegate_identity == promoted.identity


def test_without_issuers_binding_is_not_configured(broker, spire):
    # The session's broker trusts no identity issuer, and its contracts name no workload.
    code, reason, _ = identity_refusal(lambda: bind_identity(broker.bare_stub, Agent.generate(), spire.svid("/w")))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, IDENTITY_NOT_CONFIGURED)
    assert broker.open_root(Agent.generate()).contract.delegate_identity == ""


def test_readme_identity_snippet(ibroker, spire, tmp_path, capsys):
    readme = (CLIENT_ROOT / "README.md").read_text()
    snippets = [s.split("```", 1)[0] for s in readme.split("```python\n")[1:]]
    (snippet,) = [s for s in snippets if "bind_identity(" in s]
    svid = tmp_path / "svid.jwt"
    svid.write_text(spire.svid("/orchestrators/planner") + "\n")
    assert "127.0.0.1:50051" in snippet and "/run/spire/svid.jwt" in snippet
    code = snippet.replace("127.0.0.1:50051", ibroker.address).replace("/run/spire/svid.jwt", str(svid))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "spiffe://prod.test/orchestrators/planner spire",
        "spiffe://prod.test/orchestrators/planner",
        "UNAUTHENTICATED IDENTITY_REFUSED IDENTITY_FORMAT",
    ]
    assert "\n".join(printed) in readme  # the README shows this output
    namespace["channel"].close()
