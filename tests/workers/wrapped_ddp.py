"""A wrapped gloo DDP trainer (torch) for the hybrid rung's DDP case: the DDP module and
its process group are made in every iteration, as most training scripts do, so an aborted
iteration leaves a live reducer with pending bucket all-reduces behind. Each step is timed
(``expires``: progress for the wrapper, and what ``kelastic run --fault`` waits for).

Prints ``pid P start iteration I`` when the process starts, ``pid P enter iteration I``
each time the function is entered and ``pid P stepped iteration I`` after its first DDP
step; returns once ``STEPS_STOP_FILE`` exists (every rank after the same step: see
``_last_step``). ``STEPS_TIMER_AFTER``: the step timer's
seconds (default 30). ``STEPS_HANG_RANK`` / ``STEPS_HANG_STEP``: that global rank stops
itself (SIGSTOP) inside its step timer at that step of iteration 0 (a hang held under
``expires()``: it holds its timer, its peers block on it in DDP's all-reduce);
``STEPS_HANG_BETWEEN=1``: after that step instead, holding no timer (only the in-process
hard timeout kills it).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from kelastic.inprocess import Wrapper
from kelastic.timer import expires

torch.set_num_threads(1)
MODEL = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
OPT = torch.optim.SGD(MODEL.parameters(), lr=0.01)
AFTER = float(os.environ.get("STEPS_TIMER_AFTER") or 30.0)
HANG_RANK = int(os.environ.get("STEPS_HANG_RANK") or -1)
HANG_STEP = int(os.environ.get("STEPS_HANG_STEP") or 20)
HANG_BETWEEN = os.environ.get("STEPS_HANG_BETWEEN") == "1"


def _hang_here(iteration: int, step: int, between: bool) -> None:
    """Stop this process (SIGSTOP) where ``STEPS_HANG_*`` say."""
    if (iteration, step, dist.get_rank(), between) == (0, HANG_STEP, HANG_RANK, HANG_BETWEEN):
        where = "between steps" if between else "in step"
        print(f"pid {os.getpid()} hangs {where} {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def _last_step(stop: str | None, iteration: int, step: int) -> int | None:
    """The step every rank of this iteration stops before, once ``stop`` exists; None
    until then. The first rank to see the file names one 5 steps ahead (a file of the
    iteration, created atomically), the others read it: DDP keeps the ranks within a step
    of each other, so all stop at the same step. Each rank stopping when it saw the file,
    one saw it a step late under load and entered DDP's next collective alone
    ("Connection closed by peer": an in-process restart as the job ended)."""
    if not (stop and Path(stop).exists()):
        return None
    target = Path(f"{stop}.iteration-{iteration}")
    if not target.exists():
        mine = target.with_name(f"{target.name}.{os.getpid()}")
        mine.write_text(str(step + 5))
        try:
            os.link(mine, target)  # the first rank's number stands
        except FileExistsError:
            pass
        finally:
            mine.unlink()
    return int(target.read_text())


@Wrapper()
def train(call_wrapper: Any = None) -> None:
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    print(f"pid {os.getpid()} enter iteration {iteration}", flush=True)
    dist.init_process_group("gloo")
    model = DDP(MODEL)
    stop = os.environ.get("STEPS_STOP_FILE")
    step = 0
    while True:
        last = _last_step(stop, iteration, step)
        if last is not None and step >= last:
            break
        with expires(after=AFTER, scope="step"):  # a timed step: kelastic run's fault clock
            _hang_here(iteration, step, between=False)  # stopped holding its timer
            loss = model(torch.randn(16, 64)).square().mean()
            OPT.zero_grad()
            loss.backward()
            OPT.step()
        _hang_here(iteration, step, between=True)  # stopped holding no timer
        if step == 0:
            print(f"pid {os.getpid()} stepped iteration {iteration}", flush=True)
        step += 1
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    first = os.environ.get("KELASTIC_INPROCESS_ITERATION") or "0"
    print(f"pid {os.getpid()} start iteration {first}", flush=True)
    train()
