"""steps.py's in-process sibling (no torch): a training function wrapped by
:class:`kelastic.inprocess.Wrapper` that takes timed steps (each inside ``expires``,
which is also the wrapper's progress ``ping``) until told to stop.

Prints ``pid P start iteration I`` when the process starts, ``pid P enter iteration I``
each time the function is entered, then ``step S`` lines. Env (all optional):
  STEPS_STOP_FILE     the function returns once this file exists (the worker exits 0)
  STEPS_DIE_FILE      with STEPS_DIE_RANK: that global rank, when started in an
                      iteration > 0 (started again by the hybrid rung, or after it), exits
                      3 before its hello once (the file records that it did)
  STEPS_SPARE_ONCE    a spare (KELASTIC_INPROCESS_SPARE=1) exits 3 before its hello when
                      it is not the first of its node (``<path>.<GROUP_RANK>`` exists;
                      the first creates it): the node's spares run out after one
  STEPS_PROMOTED_DIES a process started as a spare exits 3 as it enters the function, once
                      in the job (the file at this path records that one did): a spare
                      dying right after its go made it a rank
  STEPS_HANG_RANK     that global rank stops itself (SIGSTOP) at step STEPS_HANG_STEP
  STEPS_HANG_STEP     (default 20) of iteration 0: inside its step's timer (it holds it),
  STEPS_HANG_BETWEEN  or, when this is 1, after the step (holding no timer: only its
                      silence tells)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from kelastic.inprocess import Wrapper
from kelastic.timer import expires


def main() -> None:
    rank = int(os.environ["RANK"])
    first = int(os.environ.get("KELASTIC_INPROCESS_ITERATION") or 0)
    print(f"pid {os.getpid()} start iteration {first}", flush=True)
    die = os.environ.get("STEPS_DIE_FILE")
    die_rank = int(os.environ.get("STEPS_DIE_RANK", "-1"))
    if die and rank == die_rank and first > 0 and not Path(die).exists():
        Path(die).touch()
        print("dying before the hello", flush=True)
        os._exit(3)
    once = os.environ.get("STEPS_SPARE_ONCE")
    if once and os.environ.get("KELASTIC_INPROCESS_SPARE") == "1":
        mine = Path(f"{once}.{os.environ.get('GROUP_RANK', '0')}")
        if mine.exists():
            print("spare dying before the hello", flush=True)
            os._exit(3)
        mine.touch()
    was_spare = os.environ.get("KELASTIC_INPROCESS_SPARE") == "1"
    promoted_dies = os.environ.get("STEPS_PROMOTED_DIES")
    stop = os.environ.get("STEPS_STOP_FILE")
    hang = (int(os.environ.get("STEPS_HANG_RANK") or -1), int(os.environ.get("STEPS_HANG_STEP")
            or 20), os.environ.get("STEPS_HANG_BETWEEN") == "1")  # fmt: skip

    def hang_here(iteration: int, step: int, between: bool) -> None:
        if (rank, step, between) == hang and iteration == 0:
            print(f"pid {os.getpid()} hangs {'between steps' if between else 'in step'} {step}",
                  flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGSTOP)

    @Wrapper()
    def train(call_wrapper: Any = None) -> None:
        iteration = call_wrapper.iteration if call_wrapper is not None else 0
        print(f"pid {os.getpid()} enter iteration {iteration}", flush=True)
        if was_spare and promoted_dies and not Path(promoted_dies).exists():
            Path(promoted_dies).touch()
            print(f"pid {os.getpid()} promoted spare dying at once", flush=True)
            os._exit(3)
        step = 0
        while not (stop and Path(stop).exists()):
            with expires(after=5.0, scope="step"):
                time.sleep(0.05)
                hang_here(iteration, step + 1, between=False)
            step += 1
            print(f"step {step}", flush=True)
            hang_here(iteration, step, between=True)

    train()


if __name__ == "__main__":
    main()
