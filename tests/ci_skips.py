"""Under ``CI=true`` no test is skipped: a skip becomes a failure (an error when it came
from a fixture) that says why (README,
Development: CI runs every test). ``tests/prereq.py`` fails a missing prerequisite at
once; this hook catches every other skip (a ``skipif`` marker, a ``pytest.skip`` in a
test or a fixture) so that one cannot pass CI silently. Expected failures (``xfail``) are
left alone."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """Turn a skipped test's report into a failure under ``CI=true``."""
    outcome = yield
    report = outcome.get_result()
    if not os.environ.get("CI") or not report.skipped or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, where every test must run: {reason}"
