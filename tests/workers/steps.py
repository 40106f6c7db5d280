"""A tiny elastic worker without torch: takes timed steps until told to stop.

Prints ``rank=R world=W round=N restart=K`` once, then ``step S`` lines, each step inside
``expires(after=...)``. Behaviour by env (all optional):
  STEPS_STOP_FILE   exit 0 once this file exists
  STEPS_MAX         exit 0 after this many steps
  STEPS_FAIL_RANK   this global rank raises ValueError("bad batch at step N") at step STEPS_FAIL_AT
  STEPS_FAIL_AT     step at which to fail (default 3)
  STEPS_IGNORE_TERM ignore SIGTERM (to exercise SIGKILL after the grace period)
  STEPS_TIMEOUT     seconds each step's timer allows (default 5)
  STEPS_SLOW_RANK   this global rank's steps take STEPS_SLOW_SECONDS (a straggler)
  STEPS_SLOW_SECONDS  seconds a slow rank's step takes (default 0.2; others' take 0.05)
  STEPS_CHECKPOINT  a file: every worker starts at the step it holds (printing
                    ``from_step=N``), and rank 0 writes each step it finishes there
                    (write and rename), so STEPS_MAX counts steps of the whole job
  STEPS_LOCKSTEP    a directory: each step (under its timer) first waits until every rank
                    finished the previous one (files there hold each rank's last step),
                    as a collective would
  STEPS_STOP_RANK   this global rank SIGSTOPs itself after step STEPS_STOP_AT, outside any
                    timer, in the job's first attempt only (a hang no timer of its own sees)
  STEPS_STOP_AT     the step after which it stops (default 3)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from kelastic.errors import record
from kelastic.timer import expires


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    if os.environ.get("STEPS_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ckpt = Path(os.environ["STEPS_CHECKPOINT"]) if os.environ.get("STEPS_CHECKPOINT") else None
    step = int(ckpt.read_text()) if ckpt is not None and ckpt.exists() else 0
    print(
        f"rank={rank} world={os.environ['WORLD_SIZE']} round={os.environ['KELASTIC_ROUND']} "
        f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} from_step={step}",
        flush=True,
    )
    stop = os.environ.get("STEPS_STOP_FILE")
    limit = int(os.environ.get("STEPS_MAX", "0"))
    fail_rank = int(os.environ.get("STEPS_FAIL_RANK", "-1"))
    fail_at = int(os.environ.get("STEPS_FAIL_AT", "3"))
    timeout = float(os.environ.get("STEPS_TIMEOUT", "5"))
    slow = rank == int(os.environ.get("STEPS_SLOW_RANK", "-1"))
    step_seconds = float(os.environ.get("STEPS_SLOW_SECONDS", "0.2")) if slow else 0.05
    first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    stop_rank = int(os.environ.get("STEPS_STOP_RANK", "-1")) if first_attempt else -1
    stop_at = int(os.environ.get("STEPS_STOP_AT", "3"))
    lockstep = os.environ.get("STEPS_LOCKSTEP")
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    peers = Path(lockstep) / f"restart-{restart}" if lockstep else None
    if peers is not None:
        peers.mkdir(parents=True, exist_ok=True)
    while True:
        # The whole step under its timer (the checkpoint and the print too): a worker
        # stopped between two timers holds none, and without in-process restart nothing
        # reaps it (torch's timers alike), which made a SIGSTOP test flaky under load.
        with expires(after=timeout, scope="step"):
            if peers is not None:
                _wait_for_peers(peers, int(os.environ["WORLD_SIZE"]), step)
            time.sleep(step_seconds)
            step += 1
            if ckpt is not None and rank == 0:
                tmp = ckpt.with_name(ckpt.name + ".tmp")
                tmp.write_text(str(step))
                tmp.replace(ckpt)
            print(f"step {step}", flush=True)
            if peers is not None:
                tmp = peers / f"{rank}.tmp"
                tmp.write_text(str(step))
                tmp.replace(peers / str(rank))
        if rank == stop_rank and step == stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)  # between two timers: it holds none
        if rank == fail_rank and step == fail_at:
            raise ValueError(f"bad batch at step {step}")
        if (stop and Path(stop).exists()) or (limit and step >= limit):
            return


def _wait_for_peers(peers: Path, world: int, step: int) -> None:
    """Wait until every rank of ``world`` finished step ``step`` (its file in ``peers``)."""
    while True:
        done = [_read_step(peers / str(r)) for r in range(world)]
        if min(done) >= step:
            return
        time.sleep(0.01)


def _read_step(path: Path) -> int:
    """A rank's last finished step (0 before its first)."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return 0


if __name__ == "__main__":
    main()
