"""A wrapped gloo DDP trainer (torch) that proves its ranks agree: the ranks decide
together when to stop (an all-reduce of "the stop file exists", so every rank takes the
same number of steps), then each prints a hash of its parameters. A spare promoted into
the job (spare ranks) builds its own, differently initialised model before it waits: DDP's
broadcast from rank 0 at each iteration's start must make it agree with its peers.

Prints ``pid P start iteration I`` at the process start (a spare too), ``pid P enter
iteration I`` each time the function is entered, ``pid P stepped iteration I`` after its
first step, ``step S`` lines, and ``rank R params H`` at the end. Env: ``STEPS_STOP_FILE``.
"""

from __future__ import annotations

import hashlib
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
torch.manual_seed(os.getpid())  # every process, a spare included, starts from other weights
MODEL = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
OPT = torch.optim.SGD(MODEL.parameters(), lr=0.01)
print(f"pid {os.getpid()} start iteration {os.environ.get('KELASTIC_INPROCESS_ITERATION', 0)}",
      flush=True)  # fmt: skip


def _digest() -> str:
    h = hashlib.sha256()
    for p in MODEL.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


@Wrapper()
def train(call_wrapper: Any = None) -> None:
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    print(f"pid {os.getpid()} enter iteration {iteration}", flush=True)
    dist.init_process_group("gloo")
    model = DDP(MODEL)
    stop = Path(os.environ["STEPS_STOP_FILE"])
    step = 0
    while True:
        with expires(after=30.0, scope="step"):
            flag = torch.tensor([1.0 if stop.exists() else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
            loss = model(torch.randn(8, 32)).square().mean()
            OPT.zero_grad()
            loss.backward()
            OPT.step()
        if step == 0:
            print(f"pid {os.getpid()} stepped iteration {iteration}", flush=True)
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.05)
    print(f"rank {dist.get_rank()} params {_digest()}", flush=True)
    # No destroy_process_group(): it talks to the iteration's store, which rank 0 serves,
    # and rank 0 may be gone already (a rank slower to get here then blocked in it). The
    # process group goes with the process.


if __name__ == "__main__":
    train()
