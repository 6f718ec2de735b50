"""pytest wiring for test_a2a.py: the `later`, `streaming` and `bindings` markers, and each
test's outcome kept on its item so fixtures can show the processes' logs when
it failed."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "later: needs a part of the extension that comes after the first cut "
        "(deselect with -m 'not later')",
    )
    config.addinivalue_line(
        "markers",
        "streaming: streams a task through the gateways (SendStreamingMessage, SubscribeToTask; "
        "deselect with -m 'not streaming')",
    )
    config.addinivalue_line(
        "markers",
        "bindings(*names): the A2A bindings (jsonrpc, grpc) a test taking `world` or `binding` runs "
        "over (default: both)",
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ARG001
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
