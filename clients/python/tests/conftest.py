from __future__ import annotations

import pytest
from _support import Broker, rust_chain, rust_chain_lines, rust_receipt

from delegation_broker import pb, sha256, verify_chain, verify_every_signature


@pytest.fixture(scope="session")
def broker(tmp_path_factory) -> Broker:
    """One real broker for the session (tests use fresh agents and trees, so
    they do not interfere). At the end, everything broker-signed received
    during the session (each already verified in Python on arrival) must also
    verify with the Rust `verify` subcommand: every receipt with `--receipt`,
    every contract within its whole chain with `--chain --all-signatures`
    (the chain of each contract no other received contract names as its
    parent, read with GetChain, its contracts byte-identical to the ones
    received) — and the broker must shut down gracefully on SIGTERM."""
    workdir = tmp_path_factory.mktemp("broker")
    b = Broker(workdir)
    yield b
    failures = []
    try:
        failures = _cross_check(b, workdir)
    finally:
        code = b.close()
    assert not failures, f"what the Rust verifier rejects: {failures}"
    assert code == 0, f"broker exited with {code} on SIGTERM; log:\n{b.process.log_path.read_text()}"


def _cross_check(b: Broker, workdir) -> list[str]:
    public_keys = [b.keys[k] for k in b.keys]
    receipts = {sealed.SerializeToString(): sealed for sealed, kind in b.received if kind == "receipt"}
    contracts = {sha256(sealed.payload): sealed for sealed, kind in b.received if kind == "contract"}
    failures = []
    for index, sealed in enumerate(receipts.values()):
        if rust_receipt(workdir / "receipt.bin", sealed, public_keys) is None:
            failures.append(f"receipt #{index}")
    parents = {pb.Contract.FromString(sealed.payload).parent_id for sealed in contracts.values()}
    covered: set[bytes] = set()
    for leaf in [cid for cid in contracts if cid not in parents]:
        chain = list(b.stub.GetChain(pb.GetChainRequest(contract_id=leaf), timeout=10).chain)
        for state in chain:
            if state.contract_id in contracts:
                assert state.contract == contracts[state.contract_id], "GetChain returns contracts as issued"
        verified = verify_chain(chain, b.keys, leaf)
        verify_every_signature(chain, b.keys)
        lines = rust_chain(workdir / "chain.bin", chain, public_keys, leaf, all_signatures=True)
        if lines is None:
            failures.append(f"chain of {leaf.hex()}")
            continue
        expected = rust_chain_lines(verified)
        assert lines == [*expected[:-1], expected[-1] + ", every signature checked"], "Rust and Python agree"
        covered.update(v.contract_id for v in verified)
    assert set(contracts) <= covered or failures, "every contract received was in a chain checked"
    return failures
