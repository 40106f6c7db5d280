"""A gloo DDP trainer that checkpoints, for ``python -m bench goodput_checkpoint``.

The same model and step as :mod:`bench._step_train` (a small forward/backward/all-reduce
plus 50 ms of simulated compute), ``BENCH_CKPT_MB`` MiB of state standing for a larger
model's (saved and loaded with the rest), and a step counter that is the job's progress: a
restart resumes from the checkpoint it loads, and the steps after it are done again.
``BENCH_CKPT`` picks the checkpoint:

- ``memory`` (or ``memory:N``): ``kelastic.checkpoint.save(step, state)`` every step (every
  ``N`` steps; staged, not waited for), ``kelastic.checkpoint.load()`` at the start (the
  step the job agreed on);
- ``torch:N``: rank 0 ``torch.save``s the state every ``N`` steps to ``$BENCH_CKPT_PATH``
  (a temporary file, then a rename: never torn), every rank ``torch.load``s it at the
  start (the usual pattern: the other ranks wait for rank 0 at the next all-reduce).

Appends ``{"ev": "step", "rank", "pid", "step", "t0", "t1"}`` for each step of every rank
to ``$BENCH_EVENTS`` (``t1`` once the step's save returned), and ``{"ev": "resumed",
"pid", "step"}`` once per rank 0 process (the step its checkpoint held; -1 when it
started from nothing).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _write(fd: int, event: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(event) + "\n").encode())


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    # state standing for a larger model's (saved and loaded like the rest)
    pad = torch.zeros(int(os.environ.get("BENCH_CKPT_MB", "0")) * (1 << 20) // 4)
    mode = os.environ.get("BENCH_CKPT", "memory")
    path = os.environ.get("BENCH_CKPT_PATH", "")
    every = int(mode.split(":", 1)[1]) if ":" in mode else 1
    resumed = -1
    memory = mode.startswith("memory")
    if memory:
        from kelastic import checkpoint

        restored = checkpoint.load()
        if restored is not None:
            resumed, state = restored
            net.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            pad.copy_(state["pad"])
    elif path and os.path.exists(path):
        state = torch.load(path, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        pad.copy_(state["pad"])
        resumed = int(state["step"])
    model = DDP(net)
    fd = os.open(os.environ["BENCH_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    pid = os.getpid()
    if rank == 0:
        _write(fd, {"ev": "resumed", "pid": pid, "step": resumed})
    step = resumed + 1
    while True:
        t0 = time.time()
        loss = model(torch.randn(16, 64)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)  # the rest of a real step's compute
        if memory and step % every == 0:
            checkpoint.save(step, {"model": net.state_dict(), "opt": opt.state_dict(), "pad": pad})
        elif not memory and rank == 0 and path and step % every == 0:
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "pad": pad, "step": step}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
        t1 = time.time()
        _write(fd, {"ev": "step", "rank": rank, "pid": pid, "step": step, "t0": t0, "t1": t1})
        step += 1


if __name__ == "__main__":
    main()
