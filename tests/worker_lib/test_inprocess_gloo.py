"""In-process restart of real torch gloo ranks (CPU) in an ``all_reduce`` loop, against the
test coordinator (``test_inprocess_harness``): a fault in one rank aborts all of them,
ranks blocked in a collective are released, and every rank re-enters the function with
the next iteration's ``MASTER_PORT`` and finishes.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kelastic.inprocess_messages import Abort, Done, Fault, Ready
from tests.conftest import wait_for
from tests.prereq import require_module
from tests.worker_lib.test_inprocess_harness import ev, job, msg

require_module("torch")

#: Seconds a rank blocked in a collective may take to leave it after the abort (measured
#: in milliseconds; the bound leaves room for a loaded machine).
RELEASE_BOUND = 10.0


def _store_client(pid: int, port: int) -> bool:
    """Whether process ``pid`` has an established connection to ``port``."""
    return any(
        c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
        for c in psutil.Process(pid).net_connections(kind="tcp")
    )


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kl-ipg-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_raise_in_one_rank_restarts_every_rank(run_dir: Path) -> None:
    world = 3
    env = {"KL_GLOO": "1", "KL_STEPS": "8", "KL_FAULT_1": "0:3", "KL_DO_1": "raise"}
    with job(run_dir, world, env=env) as j:
        raised = j.log.wait(ev("raising", rank=1), what="rank 1 raising")
        first = j.log.wait(msg(Fault, iteration=0), what="a fault")["msg"]
        assert first.local_rank == 1 and first.message == "ValueError: boom in rank 1"
        for rank in range(world):
            j.log.wait(ev("aborted", rank=rank, iteration=0), what=f"rank {rank} aborted")
        entered = [
            j.log.wait(ev("enter", rank=rank, iteration=1), what=f"rank {rank} in iteration 1")
            for rank in range(world)
        ]
        for rank in range(world):
            j.log.wait(msg(Done, iteration=1, local_rank=rank), what=f"done from rank {rank}")
            result = j.log.wait(ev("result", rank=rank))
            assert result["value"] == {"iteration": 1, "rank": rank}
            assert result["threads"] == ["MainThread"]
        j.expect_exit([0] * world)
        steps = {e["rank"] for e in j.log.find(ev("step", iteration=1, step=7))}
        assert steps == set(range(world))  # all steps of iteration 1 done, together
        restart = max(e["t"] for e in entered) - raised["t"]
        print(f"\nraise -> all {world} ranks in iteration 1: {restart * 1000:.0f} ms")


def test_abort_releases_ranks_blocked_in_all_reduce(run_dir: Path) -> None:
    world = 3
    env = {"KL_GLOO": "1", "KL_STEPS": "6", "KL_FAULT_1": "0:2", "KL_DO_1": "blocked"}
    with job(run_dir, world, env=env, auto=False) as j:
        assert j.coord is not None
        j.log.wait(ev("blocking", rank=1), what="rank 1 stops stepping")
        for rank in (0, 2):  # they finished step 2; the next all_reduce waits for rank 1
            j.log.wait(ev("step", rank=rank, iteration=0, step=2), what=f"rank {rank} step 2")
        j.coord.broadcast(Abort(iteration=1, reason="test"))
        sent_at = j.log.wait(lambda e: isinstance(e.get("sent"), Abort))["t"]
        released = {}
        for rank in range(world):
            aborted = j.log.wait(ev("aborted", rank=rank, iteration=0), what=f"rank {rank} out")
            released[rank] = aborted["t"] - sent_at
            assert released[rank] < RELEASE_BOUND, released
        # None faulted before the abort; a rank whose collective a peer's teardown broke
        # before its own abort arrived reports that (the sidecar ignores it as stale).
        assert all(f["t"] >= sent_at for f in j.log.find(msg(Fault)))
        for rank in range(world):
            j.log.wait(msg(Ready, iteration=1, local_rank=rank), what=f"ready from {rank}")
        j.coord.go(1)
        for rank in range(world):
            j.log.wait(msg(Done, iteration=1, local_rank=rank), what=f"done from rank {rank}")
        j.expect_exit([0] * world)
        hows = {rank: j.log.wait(ev("aborted", rank=rank))["how"] for rank in range(world)}
        took = {r: f"{s * 1000:.0f} ms ({hows[r]})" for r, s in released.items()}
        print(f"\nabort -> out of the function, per rank: {took}")


def test_abort_releases_ranks_waiting_in_init_process_group(run_dir: Path) -> None:
    """Rank 1 faults before joining the process group; ranks 0 (the TCPStore's host) and
    2 wait for it in ``init_process_group``: shutting down their store connections
    releases them (else they would wait for the store's 120 s timeout), and all three
    agree on the next default group's name (c10d's group counter reset)."""
    world = 3
    env = {"KL_GLOO": "1", "KL_STEPS": "3", "KL_FAULT_1": "0:0", "KL_DO_1": "early"}
    with job(run_dir, world, env=env) as j:
        for rank in (0, 2):
            j.log.wait(ev("init", rank=rank, iteration=0), what=f"rank {rank} in init")
        port = int(j.log.wait(ev("enter", rank=0, iteration=0))["port"])
        # connected to the store (a rank still connecting has nothing to shut down)
        wait_for(lambda: all(_store_client(j.workers[r].proc.pid, port) for r in (0, 2)),
                 timeout=60, what="ranks 0 and 2 connected to the TCPStore")  # fmt: skip
        j.flag("fault_now")
        j.log.wait(ev("raising", rank=1), what="rank 1 raising")
        sent_at = j.log.wait(lambda e: isinstance(e.get("sent"), Abort))["t"]
        took = {}
        for rank in (0, 2):
            aborted = j.log.wait(ev("aborted", rank=rank, iteration=0), what=f"rank {rank} out")
            took[rank] = f"{(aborted['t'] - sent_at) * 1000:.0f} ms ({aborted['how']})"
            assert aborted["t"] - sent_at < RELEASE_BOUND
        for rank in range(world):
            j.log.wait(msg(Done, iteration=1, local_rank=rank), what=f"done from rank {rank}")
        j.expect_exit([0] * world)
        print(f"\nabort -> out of init_process_group: {took}")


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def test_a_rank_connecting_after_the_store_host_left_is_released(run_dir: Path) -> None:
    """The store's host (rank 0) is aborted and leaves the iteration before rank 1 joins
    its store (a round change right after the go, a slow rank). torch's ``TCPStore``
    constructor retries a refused connect until the store's timeout, so without a store
    at that address rank 1 would wait there for minutes, its abort undeliverable (the
    main thread in C++, no connection to shut down): reaped by the hard timeout in the
    node-change e2e test. The host keeps a store listening until the next ``go``: rank 1
    connects, waits for keys on a connection the teardown shuts down, and leaves."""
    world = 2
    env = {"KL_GLOO": "1", "KL_STEPS": "3", "KL_JOIN_FLAG_1": "join"}
    with job(run_dir, world, env=env, auto=False) as j:
        assert j.coord is not None
        port = int(j.log.wait(ev("enter", rank=0, iteration=0))["port"])
        j.log.wait(ev("init", rank=0, iteration=0), what="rank 0 in init")
        wait_for(lambda: _listening(port), timeout=60, what="rank 0's store listening")
        j.coord.send(0, Abort(iteration=1, reason="test"))
        j.log.wait(msg(Ready, iteration=1, local_rank=0), what="rank 0 out of iteration 0")
        j.flag("join")  # rank 1 joins the store of an iteration its host has left
        j.log.wait(ev("init", rank=1, iteration=0), what="rank 1 in init")
        pid = j.workers[1].proc.pid
        # The precondition: the host keeps a store listening at the address, so rank 1's
        # constructor connects (without it, it retried a refused connect for minutes).
        wait_for(lambda: _store_client(pid, port), timeout=60,
                 what="rank 1 connected to the store its host keeps")  # fmt: skip
        j.coord.send(1, Abort(iteration=1, reason="test"))
        sent_at = j.log.wait(lambda e: isinstance(e.get("sent"), Abort) and e["to"] == 1)["t"]
        try:
            aborted = j.log.wait(ev("aborted", rank=1, iteration=0), timeout=RELEASE_BOUND,
                                 what="rank 1 out of init_process_group")  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{j.stacks(j.workers[1])[-4000:]}") from None
        j.log.wait(msg(Ready, iteration=1, local_rank=1), what="ready from rank 1")
        j.coord.go(1)
        for rank in range(world):
            j.log.wait(msg(Done, iteration=1, local_rank=rank), what=f"done from rank {rank}")
        j.expect_exit([0] * world)
        took = aborted["t"] - sent_at
        print(f"\nabort -> rank 1 out of init_process_group: {took * 1000:.0f} ms "
              f"({aborted['how']})")  # fmt: skip


def test_repeated_restarts_leak_no_connections(run_dir: Path) -> None:
    """Three faults in a row (iterations 0, 1, 2): every rank enters iteration 3 with the
    sockets it had in iteration 1 (the aborted groups' connections are closed)."""
    world = 2
    env = {"KL_GLOO": "1", "KL_STEPS": "4", "KL_FAULT_1": "0:2,1:2,2:2", "KL_DO_1": "raise"}
    with job(run_dir, world, env=env) as j:
        for rank in range(world):
            j.log.wait(msg(Done, iteration=3, local_rank=rank), what=f"done(3) from {rank}")
        j.expect_exit([0] * world)
        for rank in range(world):
            sockets = {e["iteration"]: e["sockets"] for e in j.log.find(ev("enter", rank=rank))}
            assert sorted(sockets) == [0, 1, 2, 3]
            assert sockets[3] <= sockets[1], sockets
            print(f"\nrank {rank}: sockets open at each iteration's entry: {sockets}")


def test_torchs_rank_prefix_is_not_piled_up_per_iteration(run_dir: Path) -> None:
    """Each iteration's ``init_process_group`` wraps ``sys.excepthook`` in
    torch's rank prefix again, so the traceback of a rank that finally failed read
    ``[rank0]: [rank0]: [rank0]: ...``, one prefix per iteration. The Wrapper gives each
    iteration the hook it found: one prefix."""
    env = {"KL_GLOO": "1", "KL_STEPS": "3", "KL_FAULT": "0:1,1:1,2:1", "KL_DO": "raise"}
    with job(run_dir, 1, env=env) as j:
        j.log.wait(ev("enter", rank=0, iteration=2), what="iteration 2")
        assert j.coord is not None
        j.coord.give_up_on_fault = True  # the third raise is given up: the rank exits
        assert j.wait_exit() == [1]
        err = j.stderr(0)
    assert "[rank0]: Traceback" in err, err[-3000:]
    assert "[rank0]: [rank0]:" not in err, err[-3000:]
