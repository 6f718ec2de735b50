from __future__ import annotations

import subprocess

import pytest
from _support import Broker, broker_bin


@pytest.fixture(scope="session")
def broker(tmp_path_factory) -> Broker:
    """One real broker for the session (tests use fresh agents and trees, so
    they do not interfere). At the end, every broker-signed envelope received
    during the session (each already verified in Python on arrival) must also
    verify with the Rust `verify` subcommand, and the broker must shut down
    gracefully on SIGTERM."""
    workdir = tmp_path_factory.mktemp("broker")
    b = Broker(workdir)
    yield b
    unique = {envelope.SerializeToString(): kind for envelope, kind in b.received}
    envelope_file = workdir / "received.bin"
    failures = []
    for index, (raw, kind) in enumerate(unique.items()):
        envelope_file.write_bytes(raw)
        for key_id in b.keys:
            result = subprocess.run(
                [str(broker_bin()), "verify", "--public-key", b.keys[key_id].hex(), "--envelope", str(envelope_file)],
                capture_output=True, timeout=30, env={"BROKER_LOG": "error"},
            )
            if result.returncode == 0:
                break
        else:
            failures.append(f"{kind} #{index}")
    code = b.close()
    assert not failures, f"envelopes the Rust verifier rejects: {failures}"
    assert code == 0, f"broker exited with {code} on SIGTERM; log:\n{b.process.log_path.read_text()}"
