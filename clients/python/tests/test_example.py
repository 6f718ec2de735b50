"""examples/three_hops.py runs against a real broker (so the README example cannot rot)."""

from __future__ import annotations

import subprocess
import sys

from _support import CLIENT_ROOT


def test_three_hops_example(broker):
    result = subprocess.run(
        [sys.executable, str(CLIENT_ROOT / "examples" / "three_hops.py"),
         "--target", broker.address, "--attestor-seed", broker.attestor.seed.hex()],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verified 4 contracts and 10 hop proofs" in result.stdout, result.stdout
    assert "cumulative trust 540000 ppm" in result.stdout, result.stdout


def test_readme_python_snippet(broker):
    readme = (CLIENT_ROOT / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "127.0.0.1:50051" in snippet
    namespace: dict = {}
    exec(compile(snippet.replace("127.0.0.1:50051", broker.address), "README.md", "exec"), namespace)
    assert [v.contract.depth for v in namespace["chain"]] == [0, 1]
