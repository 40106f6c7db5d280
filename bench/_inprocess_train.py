"""A small gloo DDP trainer for the in-process restart benchmark (``bench.inprocess``).

``BENCH_WRAP`` picks how the training function is run: ``kelastic``
(:class:`kelastic.inprocess.Wrapper`; in-process restart when the job enables it),
``nvrx`` (NVIDIA's ``nvidia_resiliency_ext.inprocess.Wrapper``, under torchrun), or
``none`` (a plain call: a fault ends the process, the launcher restarts it).

Faults come from the benchmark as signals: SIGUSR1 raises an exception inside the
training function; SIGUSR2 makes the rank hang (no step, no ``ping``) until the iteration
is aborted. The model and optimizer live outside the function, so an in-process restart
keeps them. Appends ``{"rank", "pid", "iteration", "t"}`` to ``$BENCH_EVENTS`` after the
first DDP step of every iteration (an all-reduce with every rank: all ranks are up).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import signal
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WRAP = os.environ.get("BENCH_WRAP", "none")
torch.set_num_threads(1)
MODEL = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
OPT = torch.optim.SGD(MODEL.parameters(), lr=0.01)
_hang = False


class InjectedError(RuntimeError):
    """The benchmark's fault (SIGUSR1)."""


def _raise(signum: int, frame: object) -> None:
    raise InjectedError("fault injected by the benchmark (SIGUSR1)")


def _hang_on(signum: int, frame: object) -> None:
    global _hang
    _hang = True


def _event(iteration: int) -> None:
    event = {"rank": dist.get_rank(), "pid": os.getpid(), "iteration": iteration, "t": time.time()}
    fd = os.open(os.environ["BENCH_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (json.dumps(event) + "\n").encode())
    os.close(fd)


def _probe(what: str, iteration: int) -> None:
    """With ``$BENCH_PROBE`` (a file): append ``{"what", "rank", "iteration", "t"}``, the
    moments of an iteration (entered, group made, DDP made, left) for a breakdown."""
    path = os.environ.get("BENCH_PROBE")
    if path:
        line = {"what": what, "rank": int(os.environ.get("RANK", "-1")), "iteration": iteration,
                "t": time.time()}  # fmt: skip
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, (json.dumps(line) + "\n").encode())
        os.close(fd)


def train(call_wrapper: Any = None, base_store: Any = None) -> None:
    """Train until killed; ``call_wrapper`` comes from either wrapper (``.iteration``,
    ``.ping()``), ``base_store`` only under NVRx (its examples' PrefixStore pattern)."""
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    _probe("entered", iteration)
    try:
        _train(call_wrapper, base_store, iteration)
    finally:
        _probe("left", iteration)


def _train(call_wrapper: Any, base_store: Any, iteration: int) -> None:
    global _hang
    _hang = False
    if base_store is not None:
        store = dist.PrefixStore(str(iteration), base_store)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # NVRx releases ranks blocked in a collective only by its timeout: its best case,
        # 3 s, the timeout its anchor number was measured with (the default is 30 min)
        timeout = datetime.timedelta(seconds=float(os.environ.get("BENCH_NVRX_PG_TIMEOUT", "3")))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo")
    _probe("group", iteration)
    model = DDP(MODEL)
    _probe("ddp", iteration)
    step = 0
    while True:
        while _hang:  # a hung rank: no step, no ping, until its iteration is aborted
            time.sleep(0.01)
        loss = model(torch.randn(16, 64)).square().mean()
        OPT.zero_grad()
        loss.backward()
        OPT.step()
        if call_wrapper is not None:
            call_wrapper.ping()
        if step == 0:
            _event(iteration)
        step += 1
        time.sleep(0.05)


def _for_nvrx(nvrx: Any) -> Any:
    """``train`` as NVRx's Wrapper wants it: it finds the parameter to pass its
    ``CallWrapper`` in by an evaluated annotation (``issubclass``), which this module's
    postponed (string) annotations are not."""

    def fn(call_wrapper: Any = None, base_store: Any = None) -> None:
        train(call_wrapper, base_store)

    fn.__annotations__ = {"call_wrapper": Optional[nvrx.CallWrapper]}  # noqa: UP045
    return fn


def main() -> None:
    signal.signal(signal.SIGUSR1, _raise)
    signal.signal(signal.SIGUSR2, _hang_on)
    if WRAP == "kelastic":
        from kelastic.inprocess import Wrapper

        Wrapper()(train)()
    elif WRAP == "nvrx":
        nvrx = importlib.import_module("nvidia_resiliency_ext.inprocess")
        base_store = dist.TCPStore(
            host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]) + 1,
            world_size=int(os.environ["WORLD_SIZE"]), is_master=int(os.environ["RANK"]) == 0,
            multi_tenant=True, wait_for_workers=True, use_libuv=True,
            timeout=datetime.timedelta(seconds=120),
        )  # fmt: skip
        nvrx.Wrapper()(_for_nvrx(nvrx))(base_store=base_store)
    else:
        train()


if __name__ == "__main__":
    main()
