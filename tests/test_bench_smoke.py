"""Smoke test of the benchmark suite: ``python -m bench all --quick`` keeps working.

Not a timed test: it checks that every case runs and that every comparison has both
torch's side and kelastic's measured, not how fast either is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

#: case -> comparison groups expected in quick mode (a prefix of the group name)
EXPECTED = {
    "timer_reap": ["expires() deadline -> hung child dead"],
    "timer_throughput": [
        "K=1 requests/s (acquire+release",
        "K=1 client errors",
        "K=1 server CPU",
        "K=4 requests/s (acquire+release",
    ],
    "rdzv_join": ["N=2 join"],
    "rdzv_rejoin": ["SIGKILL of a participant"],
}


@pytest.mark.timeout(150)
def test_bench_all_quick(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "all", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout
    doc = json.loads(out.read_text())
    cases = {c["name"]: c for c in doc["cases"]}
    assert set(cases) >= {*EXPECTED, "sidecar_footprint"}
    for name, case in cases.items():
        assert not case["error"], f"{name}: {case['error']}"
    for name, groups in EXPECTED.items():
        rows = cases[name]["rows"]
        for prefix in groups:
            mine = [r for r in rows if r["group"].startswith(prefix)]
            torch_rows = [r for r in mine if r["ref"]]
            ours = [r for r in mine if r["side"].startswith("kelastic")]
            assert torch_rows and torch_rows[0]["samples"], f"{name} {prefix}: torch not measured"
            assert ours and all(r["samples"] for r in ours), f"{name} {prefix}: ours not measured"
            for row in mine:
                line = f"| {name} | {row['group']} | {row['side']} | {len(row['samples'])} |"
                assert line in table, f"missing table row {line}"
    footprint = cases["sidecar_footprint"]["rows"]
    assert {r["group"] for r in footprint} == {"idle sidecar RSS", "idle sidecar CPU (1 s samples)"}
    assert all(r["samples"] for r in footprint)
    assert "| case | target | this run | met |" in table


@pytest.mark.timeout(200)
def test_a_hanging_or_failing_side_costs_only_its_rows(tmp_path: Path) -> None:
    """``rdzv_join`` with one side made to hang and one to raise (``BENCH_SIDE_FAULTS``),
    each side with a 3 s deadline: those two rows say so, the third side is measured,
    and the case itself has no error."""
    out = tmp_path / "results.json"
    hang, fail = "torch handler + c10d (TCPStore)", "torch handler + kelastic etcd backend"
    env = {
        **os.environ,
        "BENCH_SIDE_DEADLINE": "3",
        "BENCH_SIDE_FAULTS": json.dumps({hang: "hang", fail: "fail"}),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "rdzv_join", "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert not case["error"], case["error"]
    rows = {r["side"]: r for r in case["rows"]}
    assert set(rows) == {hang, fail, "kelastic handler + etcd"}
    assert rows[hang]["samples"] == []
    assert rows[hang]["status"] == "timed out after 3 s (0 of 1 runs)"
    assert rows[fail]["samples"] == []
    assert rows[fail]["status"] == "failed: RuntimeError: injected by BENCH_SIDE_FAULTS"
    ours = rows["kelastic handler + etcd"]
    assert len(ours["samples"]) == 2 and ours["status"] == "" and "etcd requests" in ours["note"]
    for side in (hang, fail):
        assert f"| {side} | 0 |" in proc.stdout and rows[side]["status"] in proc.stdout


@pytest.mark.timeout(200)
def test_a_case_ended_by_its_limit_keeps_the_rows_measured(tmp_path: Path) -> None:
    """The last side of ``rdzv_join`` hangs past the case's own time limit (its side
    deadline longer still): the suite kills the case, and the rows measured before the
    hang are in the table and the JSON, with the case's error saying so."""
    out = tmp_path / "results.json"
    hang = "torch handler + kelastic etcd backend"
    scratch = tmp_path / "tmp"  # the case's temporary folders: its etcd's data among them
    scratch.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(scratch),
        "BENCH_CASE_LIMIT": "60",
        "BENCH_SIDE_DEADLINE": "600",
        "BENCH_SIDE_FAULTS": json.dumps({hang: "hang"}),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "rdzv_join", "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the case's error
    (case,) = json.loads(out.read_text())["cases"]
    assert case["error"] == "time limit of 60 s exceeded (the 2 rows measured before it are kept)"
    rows = {r["side"]: r for r in case["rows"]}
    assert set(rows) == {"torch handler + c10d (TCPStore)", "kelastic handler + etcd"}
    assert all(r["samples"] and not r["status"] for r in rows.values())
    for side, row in rows.items():
        assert f"| {side} | {len(row['samples'])} |" in proc.stdout
    # the killed case's embedded etcd left no data folder (CI once found 123 MB of one)
    assert list(scratch.glob("kelastic-etcd-*")) == [], list(scratch.iterdir())


def test_slow_cases_selectable_by_name() -> None:
    """The DDP-job cases (a minute or more each, far from the 20 s a smoke case may take
    on a loaded 2-core machine) run in ``all`` and by name, not in ``--quick``."""
    from bench.__main__ import CASES, NOT_QUICK

    for name in ("recovery_mttr", "hang_recovery", "hang_evidence", "goodput",
                 "goodput_checkpoint"):  # fmt: skip
        assert name in CASES and name in NOT_QUICK


def test_goodput_checkpoint_work_lost_per_kill() -> None:
    """Per kill: the last step every rank completed before it minus the step the next
    rank 0 process resumed from (its first step after the kill tells which process is
    next); a step only some ranks finished was not done by the job."""
    from bench.goodput_ckpt import _lost

    def steps(pid: int, steps: range, t: float, ranks: tuple[int, ...] = (0, 1)) -> list[Any]:
        return [{"ev": "step", "rank": r, "pid": pid + r, "step": s, "t1": t + s}
                for s in steps for r in ranks]  # fmt: skip

    events = [
        {"ev": "resumed", "pid": 10, "step": -1},
        *steps(10, range(10), 1.0),  # both ranks to step 9, t=10
        {"ev": "step", "rank": 0, "pid": 10, "step": 10, "t1": 10.4},  # rank 1 never did 10
        {"ev": "resumed", "pid": 20, "step": 9},  # a memory checkpoint: nothing done again
        *steps(20, range(10, 20), 2.0),
        {"ev": "resumed", "pid": 30, "step": 10},  # a file of step 10: 9 steps done again
        *steps(30, range(11, 15), 12.0),
    ]
    assert _lost(events, [10.5, 21.5]) == [0.0, 9.0]
    assert _lost(events, [40.0]) == []  # no restart after it: nothing to say
    assert _lost([], [1.0]) == []
    one_rank = [e for e in events if e.get("rank") != 1]
    assert _lost(one_rank, [10.5]) == [1.0]  # rank 0's step 10 counted once it is the job's


def test_goodput_productive_time() -> None:
    from bench.goodput import productive_time

    steps = [{"t0": 0.0, "t1": 1.0}, {"t0": 1.5, "t1": 3.0}, {"t0": 5.0, "t1": 6.0}]
    assert productive_time(steps, 0.5, 2.0) == 1.0  # 0.5 of the first, 0.5 of the second
    assert productive_time(steps, 0.0, 10.0) == 3.5
    assert productive_time([], 0.0, 10.0) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_preflight_quick_measures_both_sides(tmp_path: Path) -> None:
    """``python -m bench preflight --quick``: both sides measured, every kelastic round's
    verdict passed (a failed or inconclusive one would be the row's status)."""
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "preflight", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert not case["error"], case["error"]
    sides = {r["side"].split(":")[0]: r for r in case["rows"]}
    assert set(sides) == {"torch", "kelastic"}, sides
    assert all(len(r["samples"]) == 3 and not r["status"] for r in sides.values()), sides


def test_the_dlrover_side_names_why_it_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without DLRover's interpreter the side says how to install it, starts nothing."""
    from bench.dlrover_side import measure_dlrover

    monkeypatch.setenv("BENCH_DLROVER_PYTHON", str(tmp_path / "missing" / "python"))
    got = measure_dlrover(1 << 20, 1, tmp_path / "work", 30.0)
    assert isinstance(got, str) and "no interpreter at" in got and "dlrover==0.6.1" in got
    monkeypatch.setenv("BENCH_DLROVER_PYTHON", sys.executable)  # torch, but no dlrover
    got = measure_dlrover(1 << 20, 1, tmp_path / "work", 60.0)
    assert isinstance(got, str) and "dlrover not importable" in got, got
