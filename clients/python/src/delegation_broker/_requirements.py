"""Why the generated modules did not import: what this client needs and what is installed.

The generated modules (``_gen``) check their runtimes at import: protobuf's
gencode raises ``VersionError`` on a protobuf runtime older than the one it
was generated for (a protobuf 6 runtime, say, because another package pins
``protobuf<7``), the gRPC stubs raise ``RuntimeError`` on an older grpcio.
``delegation_broker`` turns that into one ``ImportError`` naming the ranges
this distribution declares and the versions installed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re

DISTRIBUTION = "delegation-broker-client"
RUNTIMES = ("protobuf", "grpcio")


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _required(name: str) -> str | None:
    """The requirement this distribution declares for ``name`` (e.g. ``protobuf<8,>=7.35.1``), if installed."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:  # imported from a source tree, not installed
        return None
    for requirement in requires:
        if ";" in requirement:  # an extra's
            continue
        project = re.split(r"[\s<>=!~\[(]", requirement, maxsplit=1)[0]
        if project.lower().replace("_", "-") == name:
            return requirement.replace(" ", "")
    return None


def explain(error: BaseException) -> str:
    required = {name: _required(name) for name in RUNTIMES}
    wanted = " and ".join(f"{required[name] or name} (installed: {_installed(name)})" for name in RUNTIMES)
    if all(required.values()):
        upgrade = "pip install " + " ".join(f"'{required[name]}'" for name in RUNTIMES)
    else:  # imported from a source tree: the ranges are in clients/python/pyproject.toml
        upgrade = "see the dependencies of clients/python/pyproject.toml"
    floor = re.search(r">=\s*(\d+)", required["protobuf"] or "")
    below = f"protobuf below {floor.group(1)}" if floor else "an older protobuf"
    return (
        f"delegation_broker cannot import its generated modules: {type(error).__name__}: {error}\n"
        f"It needs {wanted}: the generated modules refuse, at import, a runtime older than the one they were "
        f"generated for. Upgrade them ({upgrade}). A package that pins {below} cannot share an environment "
        "with this client: give one of them a virtualenv of its own."
    )
