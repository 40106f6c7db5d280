"""A gloo DDP trainer with timed steps, for the hang-recovery and goodput benchmarks.

Run by torchrun or ``kelastic run``. Every step runs inside ``expires(after=2)``: torch's
``torch.distributed.elastic.timer`` with its ``FileTimerClient`` when ``BENCH_TIMER=torch``
(torchrun with ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` gives ``TORCHELASTIC_TIMER_FILE``),
else ``kelastic.timer``; without a timer file the step is not timed. A step is a small
forward/backward/all-reduce plus 50 ms of simulated compute.

Appends JSON lines to ``$BENCH_EVENTS`` (``t``: ``time.time()``):

- ``{"ev": "start", "rank", "pid", "t"}`` once per worker, after its first step (an
  all-reduce with every rank, so all ranks are up);
- ``{"ev": "step", "rank": 0, "pid", "t0", "t1"}`` for every later step of rank 0 (the
  productive time of the job: rank 0 steps only when the whole group does).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEP_TIMEOUT = 2.0


def _timer() -> Callable[[], Any]:
    path = os.environ.get("TORCHELASTIC_TIMER_FILE")
    if not path:
        return contextlib.nullcontext
    if os.environ.get("BENCH_TIMER") == "torch":
        import torch.distributed.elastic.timer as ttimer

        ttimer.configure(ttimer.FileTimerClient(path))
        return lambda: ttimer.expires(after=STEP_TIMEOUT, scope="train_step")
    from kelastic.timer import expires

    return lambda: expires(after=STEP_TIMEOUT, scope="train_step")


def main() -> None:
    from kelastic import flight_recorder

    flight_recorder.arm()  # only with TORCH_FR_BUFFER_SIZE (the hang_evidence case's)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    timed = _timer()
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fd = os.open(os.environ["BENCH_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    pid = os.getpid()
    step = 0
    while True:
        t0 = time.time()
        with timed():
            loss = model(torch.randn(16, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.05)  # the rest of a real step's compute
        t1 = time.time()
        if step == 0:
            event = {"ev": "start", "rank": rank, "pid": pid, "t": t1}
            os.write(fd, (json.dumps(event) + "\n").encode())
        elif rank == 0:
            event = {"ev": "step", "rank": 0, "pid": pid, "t0": t0, "t1": t1}
            os.write(fd, (json.dumps(event) + "\n").encode())
        step += 1


if __name__ == "__main__":
    main()
