"""The examples and the README's snippets run against a real broker (so they cannot rot)."""

from __future__ import annotations

import subprocess
import sys

from _support import CLIENT_ROOT

from delegation_broker import pb


def test_three_hops_example(broker):
    result = subprocess.run(
        [sys.executable, str(CLIENT_ROOT / "examples" / "three_hops.py"),
         "--target", broker.address, "--attestor-seed", broker.attestor.seed.hex()],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verified a chain of 4 contracts: 3 hash links and the leaf's signature" in result.stdout, result.stdout
    assert "cumulative trust 540000 ppm" in result.stdout, result.stdout
    readme = (CLIENT_ROOT / "README.md").read_text()
    for line in result.stdout.splitlines()[:4]:  # the README shows these (the last line names a fresh key)
        assert line in readme, line


def test_readme_python_snippet(broker):
    readme = (CLIENT_ROOT / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "127.0.0.1:50051" in snippet
    namespace: dict = {}
    exec(compile(snippet.replace("127.0.0.1:50051", broker.address), "README.md", "exec"), namespace)
    assert [v.contract.depth for v in namespace["chain"]] == [0, 1]
    assert namespace["chain"][-1].effective_predicate == "(result.schema_valid\n)"


def test_seed_001_lifecycle_example(broker):
    result = subprocess.run(
        [sys.executable, str(CLIENT_ROOT / "examples" / "seed_001_lifecycle.py"), "--target", broker.address],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("executor: VERDICT_REJECTED on ['result.within_scope'] (claimed 'success'; "
                        "out of scope ['docs/auth.md']), consumed 18, returned 2"), result.stdout
    assert lines[1] == "planner: escalated, principal residual 10, retry feasible False", result.stdout
    assert lines[2].endswith(": contract, contract, ACCEPTED, contract, ACCEPTED, OBSERVED, COMPLETED, ESCALATED; "
                             "8 events, all verified"), result.stdout
    # The README shows this output.
    readme = (CLIENT_ROOT / "README.md").read_text()
    assert lines[0] in readme and lines[1] in readme


def test_readme_lifecycle_snippet(broker, capsys):
    readme = (CLIENT_ROOT / "README.md").read_text()
    snippets = [s.split("```", 1)[0] for s in readme.split("```python\n")[1:]]
    (snippet,) = [s for s in snippets if "stub.Complete" in s]
    namespace: dict = {}
    exec(compile(snippet.replace("127.0.0.1:50051", broker.address), "README.md", "exec"), namespace)
    assert namespace["done"].verdict == pb.VERDICT_ACCEPTED
    assert (namespace["done"].consumed, namespace["done"].returned) == (7, 13)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "VERDICT_ACCEPTED 7 13"
    assert [line.split(" ", 1)[1] for line in printed[1:]] == [
        "contract None", "contract None", "receipt RECEIPT_KIND_ACCEPTED", "receipt RECEIPT_KIND_OBSERVED",
        "receipt RECEIPT_KIND_COMPLETED"]
    assert namespace["events"].cursor == int(printed[-1].split()[0])


def test_readme_sessions_snippet(broker, capsys):
    readme = (CLIENT_ROOT / "README.md").read_text()
    snippets = [s.split("```", 1)[0] for s in readme.split("```python\n")[1:]]
    (snippet,) = [s for s in snippets if "open_session(" in s]
    namespace: dict = {}
    exec(compile(snippet.replace("127.0.0.1:50051", broker.address), "README.md", "exec"), namespace)
    root_id = namespace["root_id"]
    assert namespace["state"].contract_id == root_id
    assert [s.contract_id for s in namespace["chain"]] == [root_id]
    assert list(namespace["children"]) == []
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["no session: UNAUTHENTICATED NO_SESSION", "a stranger: NOT_FOUND NOT_FOUND"]
    # The README shows this output.
    assert "\n".join(printed) in readme
    namespace["channel"].close()
