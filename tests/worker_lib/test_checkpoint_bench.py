"""Smoke test of ``python -m bench checkpoint``'s measuring code on a 1 MiB state dict
(not a timing: every side is measured and the targets are checked, whatever the values)."""

from __future__ import annotations

from bench.checkpoint import _measure_size
from bench.common import CaseResult


def test_the_checkpoint_bench_measures_every_side() -> None:
    result = CaseResult("checkpoint")
    _measure_size(result, "1 MiB", 1 << 20, reps=2)
    sides = {row.side: row for row in result.rows}
    expected = {"memory copy (floor)", "kelastic save (stall)", "kelastic save -> committed",
                "torch.save -> disk", "torch.save -> disk + fsync",
                "kelastic load (crc32 checked)", "torch.load <- disk (page cache)",
                "kelastic persist (sidecar, no torch) -> disk",
                "torch DCP save -> disk (no_dist)"}  # fmt: skip
    assert expected <= set(sides)
    assert all(len(row.samples) == 2 and min(row.samples) > 0 for row in result.rows)
    assert [row.side for row in result.rows if row.ref] == [
        "torch.save -> disk", "torch DCP save -> disk (no_dist)",
        "torch.load <- disk (page cache)"]  # fmt: skip
    assert len(result.checks) == 3
