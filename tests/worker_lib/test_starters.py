"""kelastic._starters: which worker-start strategy the launcher gets (no processes)."""

from __future__ import annotations

import sys

from kelastic._starters import ColdStart, WarmStart, make_starter


def test_cold_unless_warm_start_is_asked_for_and_possible() -> None:
    cmd = [sys.executable, "-c", "pass"]
    assert isinstance(make_starter(False, True, cmd, (), {}, 1.0), ColdStart)
    # Warm start needs the launcher to be a child subreaper.
    assert isinstance(make_starter(True, False, cmd, (), {}, 1.0), ColdStart)
    # A command that is not a Python program starts cold.
    assert isinstance(make_starter(True, True, ["/bin/true"], (), {}, 1.0), ColdStart)


def test_cold_start_spawns_nothing_itself() -> None:
    cold = ColdStart()
    cold.prepare(-1, lambda: None)
    assert cold.spawner() is None and cold.keep() == frozenset()
    assert cold.on_reaped(1234, 0) is False
    cold.close()


def test_both_strategies_have_the_interface() -> None:
    for name in ("prepare", "spawner", "keep", "on_reaped", "close"):
        assert callable(getattr(ColdStart, name)) and callable(getattr(WarmStart, name))
