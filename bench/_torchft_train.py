"""The in-process benchmark's trainer under torchft (``bench.inprocess``, its torchft rows).

Same model, batch, step pause and faults as :mod:`bench._inprocess_train`, written the
way torchft's DDP example trains: one replica group per rank (``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``; a group of one worker, its unit of failure for DDP), each under
its own ``torchrun --standalone``; a :class:`torchft.Manager` on a
:class:`torchft.ProcessGroupGloo` asks the lighthouse (``TORCHFT_LIGHTHOUSE``) for a
quorum every step; torchft's ``DistributedDataParallel`` all-reduces the gradients
through it, and a step whose all-reduce failed is not committed. A rank that dies (a
raise ends its process, as in torchft's examples) is started again by its torchrun and
heals from a peer; the others go on without it meanwhile.

Appends ``{"rank", "pid", "iteration", "t"}`` (``rank``: the replica group, ``iteration``:
torchft's quorum id) to ``$BENCH_EVENTS`` at the first committed step of all
``NUM_REPLICA_GROUPS`` replicas after a start, a failed step or a quorum change: every
rank stepping with all the others.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch

torch.set_num_threads(1)
MODEL = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
OPT = torch.optim.SGD(MODEL.parameters(), lr=0.01)
#: torchft's timeouts, its best case as NVRx's 3 s process-group timeout is NVRx's
TIMEOUT = timedelta(seconds=float(os.environ.get("BENCH_TORCHFT_TIMEOUT", "3")))


class InjectedError(RuntimeError):
    """The benchmark's fault (SIGUSR1)."""


def _raise(signum: int, frame: object) -> None:
    raise InjectedError("fault injected by the benchmark (SIGUSR1)")


def _event(rank: int, quorum_id: int) -> None:
    event = {"rank": rank, "pid": os.getpid(), "iteration": quorum_id, "t": time.time()}
    fd = os.open(os.environ["BENCH_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (json.dumps(event) + "\n").encode())
    os.close(fd)


def main() -> None:
    tft = importlib.import_module("torchft")  # not a dependency of the typed code

    signal.signal(signal.SIGUSR1, _raise)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    world = int(os.environ["NUM_REPLICA_GROUPS"])

    def state_dict() -> dict[str, Any]:
        return {"model": MODEL.state_dict(), "optim": OPT.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        MODEL.load_state_dict(state["model"])
        OPT.load_state_dict(state["optim"])

    manager = tft.Manager(
        pg=tft.ProcessGroupGloo(timeout=TIMEOUT),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{replica}",
        timeout=TIMEOUT,
        hostname="127.0.0.1",
    )
    model = tft.DistributedDataParallel(manager, MODEL)
    changed, last_quorum = True, None
    while True:
        manager.start_quorum()
        OPT.zero_grad()
        loss = model(torch.randn(16, 64)).square().mean()
        loss.backward()
        committed = manager.should_commit()
        if committed:
            OPT.step()
        quorum = manager._quorum_id  # no public accessor in torchft 0.2.0
        changed = changed or not committed or quorum != last_quorum
        last_quorum = quorum
        if committed and changed and manager.num_participants() == world:
            _event(replica, quorum)
            changed = False
        time.sleep(0.05)


if __name__ == "__main__":
    main()
