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
                "kelastic load into the trainer's tensors (crc32 checked)",
                "kelastic persist (sidecar, no torch) -> disk",
                "torch DCP save -> disk (no_dist)"}  # fmt: skip
    assert expected <= set(sides)
    assert all(len(row.samples) == 2 and min(row.samples) > 0 for row in result.rows)
    assert [row.side for row in result.rows if row.ref] == [
        "torch.save -> disk", "torch DCP save -> disk (no_dist)",
        "torch.load <- disk (page cache)"]  # fmt: skip
    assert [c.target for c in result.checks] == [
        "1 MiB: load after a process restart <= 0.3 s per GiB",
        "1 MiB: save stall <= 1.25x memory copy", "1 MiB: save stall <= 0.1x torch.save",
        "1 MiB: save stall <= 0.1x torch.save + fsync"]  # fmt: skip
