"""The CI hook (``tests/ci_skips.py``): a skip fails under ``CI=true``, and only there;
an xfail stays one. Run on a small test file of its own in a pytest subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import pytest

@pytest.mark.skipif(True, reason="a prerequisite is missing")
def test_marked():
    pass

def test_skipped_inside():
    pytest.skip("not here")

@pytest.fixture
def needs():
    pytest.skip("the fixture cannot")

def test_fixture_skip(needs):
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

def test_passes():
    pass
"""


def _run(tmp_path: Path, ci: bool) -> str:
    (tmp_path / "conftest.py").write_text("from tests.ci_skips import pytest_runtest_makereport\n")
    (tmp_path / "test_sample.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if ci:
        env["CI"] = "true"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.stdout


def test_a_skip_fails_under_ci_and_only_there(tmp_path: Path) -> None:
    out = _run(tmp_path, ci=True)
    # a skip in a test fails it; one in its setup (a marker, a fixture) is an error
    assert "1 failed, 1 passed, 1 xfailed, 2 errors" in out, out
    assert (
        "skipped under CI=true, where every test must run: Skipped: a prerequisite is missing"
        in out
    )
    assert "not here" in out and "the fixture cannot" in out
    out = _run(tmp_path, ci=False)
    assert "1 passed, 3 skipped, 1 xfailed" in out, out
