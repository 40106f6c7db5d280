"""The network check with real processes and real torch gloo on 127.0.0.1: each rank a
``python -m kelastic.netcheck`` fed its params line on stdin, its verdict read from its
stdout. A healthy group passes alike everywhere; a rank made slow (its ``send``, ``recv``
and ``all_reduce`` wrapped with a sleep, product code untouched) is named by every rank;
a peer that never comes makes every started rank inconclusive within its timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kelastic.netcheck import Floors, Params, Verdict, decode_verdict, encode_params
from kelastic.sockaddr import free_port
from tests.prereq import require_module

require_module("torch")

pytestmark = pytest.mark.slow  # ~45 s: each rank's process imports torch

ROOT = Path(__file__).resolve().parents[2]
#: Floors healthy loopback meets easily, even on a loaded 2-core machine.
EASY = Floors(max_latency_s=0.1, min_bandwidth_bps=10e6, size_bytes=4 * 2**20, iterations=3)
#: Seconds a rank's process may take, its torch import included (the tests' deadline).
DEADLINE = 120.0
#: Run as a rank's process: send, recv and all_reduce sleep 0.2 s first (so its latency
#: misses a 0.1 s floor), then the module's own main.
SLOW_RANK = """
import functools, sys, time
import torch.distributed as dist

def slow(op):
    @functools.wraps(op)
    def wrapper(*args, **kwargs):
        time.sleep(0.2)
        return op(*args, **kwargs)
    return wrapper

for name in ("send", "recv", "all_reduce"):
    setattr(dist, name, slow(getattr(dist, name)))
from kelastic.netcheck.__main__ import main
sys.exit(main())
"""


@dataclass
class Rank:
    """One started rank: its process and the files its stdout and stderr go to."""

    rank: int
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def verdict(self, deadline: float) -> tuple[Verdict, float]:
        """Its verdict once it exited 0 (by ``deadline``, monotonic), and when it did."""
        try:
            code = self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {self.rank} hangs; stderr: {self.err.read_text()[-2000:]}")
        exited = time.monotonic()
        stderr = self.err.read_text()
        assert code == 0, f"rank {self.rank} exited {code}: {stderr[-2000:]}"
        lines = self.out.read_bytes().splitlines()
        assert len(lines) == 1, f"rank {self.rank} wrote {lines!r}; stderr: {stderr[-2000:]}"
        return decode_verdict(lines[0]), exited


@pytest.fixture
def start(tmp_path: Path) -> Iterator[object]:
    """``start(world, ranks, floors=, timeout_s=, slow=)``: the processes of ``ranks`` of a
    group of ``world`` (``slow``: a rank run with :data:`SLOW_RANK`), each given its params
    line once all are started; killed at the end if still running."""
    started: list[Rank] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "worker_lib"), str(ROOT)]),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip

    def run(world: int, ranks: list[int], floors: Floors = EASY, timeout_s: float = 30.0,
            slow: int | None = None, round_: int = 4) -> list[Rank]:  # fmt: skip
        port = free_port()
        mine: list[Rank] = []
        for rank in ranks:
            out, err = tmp_path / f"out-{rank}", tmp_path / f"err-{rank}"
            cmd = ["-c", SLOW_RANK] if rank == slow else ["-m", "kelastic.netcheck"]
            with out.open("wb") as o, err.open("wb") as e:
                proc = subprocess.Popen([sys.executable, *cmd], stdin=subprocess.PIPE, stdout=o,
                                        stderr=e, env=env, cwd=tmp_path)  # fmt: skip
            mine.append(Rank(rank, proc, out, err))
        started.extend(mine)
        for r in mine:
            params = Params(round_, r.rank, world, "127.0.0.1", port, timeout_s, floors)
            assert r.proc.stdin is not None
            r.proc.stdin.write(encode_params(params).encode() + b"\n")
            r.proc.stdin.close()
        return mine

    yield run
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


def test_a_healthy_group_of_4_passes_alike_everywhere(start: object) -> None:
    began = time.monotonic()
    ranks = start(4, [0, 1, 2, 3], Floors())  # type: ignore[operator]  # the default floors
    deadline = began + DEADLINE
    verdicts = [r.verdict(deadline)[0] for r in ranks]
    print(f"\n4 ranks: {time.monotonic() - began:.1f} s with the import, check "
          f"{max(v.seconds for v in verdicts):.2f} s, {verdicts[0]}")  # fmt: skip
    first = verdicts[0]
    assert first.round == 4 and first.failed == {} and first.inconclusive == ""
    assert first.latency_s > 0 and first.bandwidth_bps > 0
    if not first.passed:  # the default floors missed on a loaded machine: pairs cleared all
        pytest.fail(f"a healthy loopback group did not pass: {first}")
    assert all(replace(v, seconds=0.0) == replace(first, seconds=0.0) for v in verdicts)


def test_a_slow_rank_is_named_by_every_rank(start: object) -> None:
    began = time.monotonic()
    # one timed repetition: each of the slow rank's round trips costs 0.4 s
    ranks = start(4, [0, 1, 2, 3], replace(EASY, iterations=1), slow=2)  # type: ignore[operator]
    verdicts = [r.verdict(began + DEADLINE)[0] for r in ranks]
    print(f"\nslow rank 2: {time.monotonic() - began:.1f} s, {verdicts[0]}")
    for v in verdicts:
        assert not v.passed and v.inconclusive == ""
        assert set(v.failed) == {2}, v
        assert v.failed[2].startswith("failed every pair test it was in (with rank 1: latency")
        assert v.latency_s >= 0.2  # the group's, the slow rank's
    assert all(replace(v, seconds=0.0) == replace(verdicts[0], seconds=0.0) for v in verdicts)
    err = ranks[2].err.read_text()
    assert "WARNING kelastic.netcheck: netcheck round 4 rank 2/4" in err
    assert "failed ranks [2]" in err


@pytest.mark.parametrize("missing", [2, 0], ids=["a-peer", "the-store-server"])
def test_a_peer_that_never_comes_is_inconclusive_not_a_hang(start: object, missing: int) -> None:
    timeout = 2.0
    began = time.monotonic()
    ranks = start(3, [r for r in range(3) if r != missing], timeout_s=timeout)  # type: ignore[operator]
    for r in ranks:
        verdict, _ = r.verdict(began + DEADLINE)
        assert not verdict.passed and verdict.failed == {}
        assert verdict.inconclusive.startswith(f"rank {r.rank}: forming the group failed: ")
        # its timeout bounds it (torch's connect retries overshoot by up to ~2 s), no hang
        assert verdict.seconds < timeout + 8, verdict
        assert verdict.latency_s == verdict.bandwidth_bps == 0.0


def test_a_params_line_that_does_not_decode_is_exit_2_with_an_inconclusive_verdict(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "worker_lib")}
    cmd = [sys.executable, "-m", "kelastic.netcheck"]
    done = subprocess.run(cmd, input=b'{"round": NaN}\n', capture_output=True, env=env,
                          timeout=DEADLINE, check=False)  # fmt: skip
    assert done.returncode == 2
    verdict = decode_verdict(done.stdout)
    assert verdict.round == 0 and not verdict.passed and verdict.failed == {}
    assert verdict.inconclusive.startswith("the params line does not decode: netcheck params")
    assert "NaN" in verdict.inconclusive
    quiet = subprocess.run(cmd, input=b"", capture_output=True, env=env, timeout=DEADLINE,
                           check=False)  # fmt: skip
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, b"", b"")
    helped = subprocess.run([*cmd, "--help"], capture_output=True, env=env, timeout=DEADLINE,
                            check=False)  # fmt: skip
    assert helped.returncode == 0 and b"verdict" in helped.stdout


def test_a_world_of_1_passes_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "worker_lib")}
    params = Params(9, 0, 1, "127.0.0.1", 1, 1.0)  # no store: nothing listens on port 1
    done = subprocess.run([sys.executable, "-m", "kelastic.netcheck"],
                          input=encode_params(params).encode() + b"\n", capture_output=True,
                          env=env, timeout=DEADLINE, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    verdict = decode_verdict(done.stdout)
    assert verdict.passed and verdict.round == 9 and verdict.seconds < 1
    assert verdict.latency_s == verdict.bandwidth_bps == 0.0
