"""A wrapped gloo DDP trainer (torch) for the hybrid rung's DDP case: the DDP module and
its process group are made in every iteration, as most training scripts do, so an aborted
iteration leaves a live reducer with pending bucket all-reduces behind. Each step is timed
(``expires``: progress for the wrapper, and what ``kelastic run --fault`` waits for).

Prints ``pid P start iteration I`` when the process starts, ``pid P enter iteration I``
each time the function is entered and ``pid P stepped iteration I`` after its first DDP
step; returns once ``STEPS_STOP_FILE`` exists. ``STEPS_TIMER_AFTER``: the step timer's
seconds (default 30).
"""

from __future__ import annotations

import os
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


@Wrapper()
def train(call_wrapper: Any = None) -> None:
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    print(f"pid {os.getpid()} enter iteration {iteration}", flush=True)
    dist.init_process_group("gloo")
    model = DDP(MODEL)
    stop = os.environ.get("STEPS_STOP_FILE")
    step = 0
    while not (stop and Path(stop).exists()):
        with expires(after=AFTER, scope="step"):  # a timed step: kelastic run's fault clock
            loss = model(torch.randn(16, 64)).square().mean()
            OPT.zero_grad()
            loss.backward()
            OPT.step()
        if step == 0:
            print(f"pid {os.getpid()} stepped iteration {iteration}", flush=True)
        step += 1
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    first = os.environ.get("KELASTIC_INPROCESS_ITERATION") or "0"
    print(f"pid {os.getpid()} start iteration {first}", flush=True)
    train()
