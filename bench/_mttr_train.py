"""A small gloo DDP trainer for the recovery benchmark (run by torchrun or ``kelastic run``).

Appends one JSON line per worker start to ``$BENCH_EVENTS`` when its first DDP step
completed (an all-reduce with every rank, so all ranks are up):
``{"rank", "pid", "restart", "t"}`` (``t``: ``time.time()``), then trains until killed.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        loss = model(torch.randn(16, 64)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0:
            event = {
                "rank": rank,
                "pid": os.getpid(),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "t": time.time(),
            }
            fd = os.open(os.environ["BENCH_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, (json.dumps(event) + "\n").encode())
            os.close(fd)
        step += 1
        time.sleep(0.05)


if __name__ == "__main__":
    main()
