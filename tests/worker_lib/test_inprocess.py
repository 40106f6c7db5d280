"""``kelastic.inprocess``: the worker's half of in-process restart, against a test
coordinator on the real unix socket (``test_inprocess_harness``) and real worker processes.
These workers do not use torch (the gloo cases are in ``test_inprocess_gloo.py``); the
process-group teardown is tested against real ``torch.distributed`` in this process.
"""

from __future__ import annotations

import datetime
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic import contract, timer
from kelastic.inprocess import CallWrapper, GiveUpError, InjectedFault, RestartAbort, Wrapper
from kelastic.inprocess import abort as ip_abort
from kelastic.inprocess.session import summary
from kelastic.inprocess_messages import (
    CAUSE_ABORT_FAILED,
    CAUSE_EXCEPTION,
    CAUSE_HEALTH_CHECK,
    CAUSE_SOFT_TIMEOUT,
    Abort,
    Done,
    Fault,
    GiveUp,
    Go,
    Hello,
    Progress,
    Ready,
)
from tests.conftest import wait_for
from tests.prereq import require_module
from tests.worker_lib.test_inprocess_harness import ev, job, msg


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short run dir (unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kl-ip-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ pass-through


def test_without_the_env_the_function_is_called_once(
    monkeypatch: pytest.MonkeyPatch, run_dir: Path
) -> None:
    monkeypatch.delenv(contract.ENV_INPROCESS, raising=False)
    monkeypatch.setenv(contract.ENV_RUN_DIR, str(run_dir))
    calls: list[int] = []
    threads = set(threading.enumerate())

    @Wrapper(health_check=lambda cw: calls.append(-1))
    def train(x: int, call_wrapper: CallWrapper | None = None) -> int:
        assert call_wrapper is not None
        calls.append(call_wrapper.iteration)
        call_wrapper.ping()
        with call_wrapper.atomic(), call_wrapper.atomic():
            pass
        return x * 2

    @Wrapper()
    def plain() -> str:
        return "ok"

    assert train(21) == 42
    assert plain() == "ok"
    assert calls == [0]  # no hooks, one call, iteration 0
    assert list(run_dir.iterdir()) == []  # no socket looked for
    assert not set(threading.enumerate()) - threads  # no monitor thread (others may end)


def test_pass_through_worker_process(run_dir: Path) -> None:
    with job(run_dir, 1, inprocess=False, env={"KL_STEPS": "2"}) as j:
        result = j.log.wait(ev("result"), what="result")
        assert result["value"] == {"iteration": 0, "rank": 0}
        assert j.wait_exit() == [0]
    assert not contract.inprocess_socket_path(run_dir).exists()


def test_injected_fault_without_inprocess_ends_the_process(run_dir: Path) -> None:
    env = {contract.ENV_INJECT_RAISE: "1", "KL_STEPS": "100000", "KL_PACE": "0.01"}
    with job(run_dir, 1, inprocess=False, env=env) as j:
        j.log.wait(ev("step"), what="a step")
        j.workers[0].proc.send_signal(signal.SIGUSR1)
        assert j.wait_exit() == [1]
        assert "InjectedFault: fault injected by kelastic run --fault raise" in j.stderr(0)


# ------------------------------------------------------------------ protocol


def test_raise_restarts_in_the_next_iteration(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:2", "KL_DO": "raise", "KL_STEPS": "4"}
    with job(run_dir, 1, env=env) as j:
        log = j.log
        hello = log.wait(msg(Hello), what="hello")["msg"]
        assert (hello.rank, hello.local_rank, hello.iteration) == (0, 0, 0)
        assert hello.pid == j.workers[0].proc.pid
        fault = log.wait(msg(Fault), what="fault")["msg"]
        assert (fault.iteration, fault.cause) == (0, CAUSE_EXCEPTION)
        assert fault.message == "ValueError: boom in rank 0"
        log.wait(msg(Ready, iteration=1), what="ready(1)")
        entered = log.wait(ev("enter", iteration=1), what="iteration 1")
        go = log.wait(lambda e: isinstance(e.get("sent"), Go))["sent"]
        assert entered["port"] == go.env[contract.MASTER_PORT]  # the go's env applied
        result = log.wait(ev("result"), what="result")
        assert result["value"] == {"iteration": 1, "rank": 0}
        assert result["threads"] == ["MainThread"]  # the monitor thread is gone
        log.wait(msg(Done, iteration=1), what="done(1)")
        assert j.wait_exit() == [0]
        # finalize and health check ran once, in the faulted iteration, before ready
        names = [e["event"] for e in log.find(lambda e: e.get("event") in ("finalize", "health"))]
        assert names == ["finalize", "health"]
        health = log.wait(ev("health"))
        assert health["iteration"] == 0 and "boom in rank 0" in health["fault"]
        # progress once per iteration
        assert [e["msg"].iteration for e in log.find(msg(Progress))] == [0, 1]


def test_abort_interrupts_a_busy_python_loop(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:1", "KL_DO": "spin", "KL_STEPS": "3"}
    with job(run_dir, 1, env=env, auto=False) as j:
        j.log.wait(ev("spinning"), what="spinning")
        assert j.coord is not None
        j.coord.send(0, Abort(iteration=1, reason="test"))
        aborted = j.log.wait(ev("aborted", iteration=0), what="aborted")
        assert aborted["how"] == "RestartAbort"
        j.log.wait(msg(Ready, iteration=1), what="ready(1)")
        assert not j.log.find(msg(Fault))  # aborted, not faulted
        j.coord.go(1)
        j.log.wait(msg(Done, iteration=1), what="done(1)")
        assert j.wait_exit() == [0]


def test_atomic_defers_the_abort_to_its_end(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:1", "KL_DO": "atomic", "KL_STEPS": "3"}
    with job(run_dir, 1, env=env) as j:
        j.log.wait(ev("atomic_in"), what="inside atomic")
        assert j.coord is not None
        j.coord.send(0, Abort(iteration=1, reason="test"))
        j.coord.iteration = 1  # the policy completes the barrier
        j.log.wait(ev("abort_held"), what="the abort seen inside the section")
        assert not j.log.find(ev("aborted"))  # the worker stays inside until the flag
        # not left 5 s after the abort: the rank says where it is (kelastic.inprocess.stuck)
        wait_for(lambda: "has not left iteration 0" in "".join(j.workers[0].stderr), 30,
                 what="the stuck rank's stacks on stderr")  # fmt: skip
        dump = "".join(j.workers[0].stderr)
        (main,) = [t for t in dump.split("--- thread ") if t.startswith("'MainThread':")]
        assert main.rstrip().endswith("in train"), dump  # innermost: the wrapped function
        assert "kelastic-inprocess" not in dump  # the monitor thread, writing it
        j.flag("leave_atomic")
        out = j.log.wait(ev("atomic_out"), what="atomic out")
        aborted = j.log.wait(ev("aborted", iteration=0), what="aborted")
        assert aborted["how"] == "RestartAbort" and aborted["t"] >= out["t"]
        assert not j.log.find(ev("step", iteration=0, step=1))  # raised from the with
        j.log.wait(msg(Done, iteration=1), what="done(1)")
        assert j.wait_exit() == [0]


def test_a_fault_inside_atomic_restarts_and_frees_the_section(run_dir: Path) -> None:
    # The exception leaves the atomic section on its way out: the section's lock is not
    # held by the aborted iteration, so the next one enters and leaves it, and steps.
    env = {"KL_FAULT": "0:1", "KL_DO": "atomic_raise", "KL_STEPS": "3"}
    with job(run_dir, 1, env=env) as j:
        fault = j.log.wait(msg(Fault), what="fault")["msg"]
        assert (fault.iteration, fault.cause) == (0, CAUSE_EXCEPTION)
        assert fault.message == "ValueError: boom in atomic in rank 0"
        assert not j.log.find(ev("atomic_out", iteration=0))
        j.log.wait(ev("atomic_out", iteration=1), what="atomic section of iteration 1")
        j.log.wait(ev("step", iteration=1, step=2), what="steps of iteration 1")
        j.log.wait(msg(Done, iteration=1), what="done(1)")
        assert j.wait_exit() == [0]


def test_soft_timeout_reports_a_fault(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:1", "KL_DO": "wait", "KL_STEPS": "3", "KL_SOFT": "0.5"}
    with job(run_dir, 1, env=env) as j:
        step = j.log.wait(ev("step", iteration=0, step=0), what="first step")
        fault = j.log.wait(msg(Fault), what="soft timeout")
        assert fault["msg"].cause == CAUSE_SOFT_TIMEOUT and fault["msg"].iteration == 0
        assert fault["t"] - step["t"] >= 0.5
        j.log.wait(ev("aborted", iteration=0, how="RestartAbort"), what="aborted")
        j.log.wait(msg(Done, iteration=1), what="done(1)")
        assert j.wait_exit() == [0]
        assert len(j.log.find(msg(Fault))) == 1


def test_an_expired_timer_is_a_soft_timeout_at_once(run_dir: Path) -> None:
    """A timer of the rank's ``expires()`` past its deadline: a ``soft_timeout`` fault
    naming it, long before the soft timeout (30 s here), so the rank leaves in process
    before the timer server's grace ends and it would be reaped."""
    env = {"KL_FAULT": "0:1", "KL_DO": "expired", "KL_STEPS": "3", "KL_SOFT": "30"}
    with job(run_dir, 1, env=env) as j:
        held = j.log.wait(ev("expiring", iteration=0, step=1), what="the long step")
        fault = j.log.wait(msg(Fault), what="the expired timer's fault")
        assert fault["msg"].cause == CAUSE_SOFT_TIMEOUT and fault["msg"].iteration == 0
        assert "timer 'held step' expired" in fault["msg"].message, fault
        assert 0.3 <= fault["t"] - held["t"] < 10, (held, fault)
        j.log.wait(ev("aborted", iteration=0, how="RestartAbort"), what="aborted")
        j.log.wait(msg(Done, iteration=1), what="done(1)")  # the timer went with the abort
        assert j.wait_exit() == [0]
        assert len(j.log.find(msg(Fault))) == 1


def test_timed_steps_count_as_progress(run_dir: Path) -> None:
    env = {"KL_TIMED": "1", "KL_STEPS": "20", "KL_PACE": "0.05", "KL_SOFT": "0.5"}
    with job(run_dir, 1, env=env) as j:
        step = j.log.wait(ev("step", step=0), what="first step")
        progress = j.log.wait(msg(Progress, iteration=0), what="progress")
        assert abs(progress["t"] - step["t"]) < 0.5  # sent at the step's expires()
        j.log.wait(msg(Done, iteration=0), what="done(0)")  # 1 s of steps, no soft timeout
        assert j.wait_exit() == [0]
        assert not j.log.find(msg(Fault)) and len(j.log.find(msg(Progress))) == 1


def test_failed_health_check_reports_and_exits(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:1", "KL_DO": "raise", "KL_UNHEALTHY": "1"}
    with job(run_dir, 1, env=env) as j:
        fault = j.log.wait(msg(Fault, cause=CAUSE_HEALTH_CHECK), what="health fault")["msg"]
        assert fault.iteration == 1 and fault.message == "RuntimeError: unhealthy device"
        assert j.wait_exit() == [1]
        assert "RuntimeError: unhealthy device" in j.stderr(0)
        assert not j.log.find(msg(Ready))


def test_failed_finalize_is_an_abort_failure(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:1", "KL_DO": "raise", "KL_BAD_FINALIZE": "1"}
    with job(run_dir, 1, env=env) as j:
        fault = j.log.wait(msg(Fault, cause=CAUSE_ABORT_FAILED), what="abort_failed")["msg"]
        assert fault.message == "OSError: cannot release the device"
        assert j.wait_exit() == [1]
        assert not j.log.find(ev("health")) and not j.log.find(msg(Ready))


def test_give_up_reraises_the_fault(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:1", "KL_DO": "raise", "KL_DO_1": "", "KL_STEPS_1": "100000",
           "KL_PACE_1": "0.01"}  # fmt: skip
    with job(run_dir, 2, env=env) as j:
        assert j.coord is not None
        j.coord.give_up_on_fault = True
        assert sorted(j.wait_exit()) == [1, 1]
        assert "ValueError: boom in rank 0" in j.stderr(0)  # its own fault
        assert "GiveUpError: in-process restart ended: the sidecar gave up" in j.stderr(1)
        assert not j.log.find(msg(Ready))


def test_lost_sidecar_ends_the_process(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:1", "KL_DO": "raise"}
    with job(run_dir, 1, env=env, auto=False) as j:
        j.log.wait(msg(Fault), what="fault")
        assert j.coord is not None
        j.coord.drop(0)
        assert j.wait_exit() == [1]
        assert "ValueError: boom in rank 0" in j.stderr(0)


def test_second_abort_during_the_barrier(run_dir: Path) -> None:
    env = {"KL_FAULT": "0:1", "KL_DO": "raise"}
    with job(run_dir, 1, env=env, auto=False) as j:
        assert j.coord is not None
        j.log.wait(msg(Fault), what="fault")
        j.coord.send(0, Abort(iteration=1))
        j.log.wait(msg(Ready, iteration=1), what="ready(1)")
        j.coord.send(0, Abort(iteration=3, reason="another fault"))
        j.log.wait(msg(Ready, iteration=3), what="ready(3)")
        j.coord.send(0, Go(iteration=1))  # stale: ignored
        j.coord.go(3)
        j.log.wait(ev("enter", iteration=3), what="iteration 3")
        j.log.wait(msg(Done, iteration=3), what="done(3)")
        assert j.wait_exit() == [0]
        assert not j.log.find(ev("enter", iteration=1))
        assert len(j.log.find(ev("health"))) == 1  # left once


def test_sigusr1_raises_injected_fault(run_dir: Path) -> None:
    env = {contract.ENV_INJECT_RAISE: "1", "KL_STEPS": "100000", "KL_PACE": "0.01"}
    with job(run_dir, 1, env=env) as j:
        j.log.wait(ev("step"), what="a step")
        j.workers[0].proc.send_signal(signal.SIGUSR1)
        fault = j.log.wait(msg(Fault), what="fault")["msg"]
        assert fault.message == "InjectedFault: fault injected by kelastic run --fault raise"
        j.log.wait(ev("enter", iteration=1), what="iteration 1")
        j.workers[0].proc.kill()


def test_started_into_a_running_job_says_its_iteration(run_dir: Path) -> None:
    env = {contract.ENV_INPROCESS_ITERATION: "7", "KL_STEPS": "1"}
    with job(run_dir, 1, env=env) as j:
        assert j.log.wait(msg(Hello))["msg"].iteration == 7
        j.log.wait(msg(Done, iteration=7), what="done(7)")
        assert j.wait_exit() == [0]


def test_started_again_at_its_death_it_waits_for_the_go_before_its_first_call(
    run_dir: Path,
) -> None:
    """The hybrid rung's early respawn: with ``KELASTIC_INPROCESS_AWAIT_GO=1`` the Wrapper
    says hello in the iteration being restarted into, passes the termination barrier
    (ready, a newer abort moving it on) and calls the function only at the go, with the
    go's env (its store); the flag is not left in the function's env."""
    env = {contract.ENV_INPROCESS_ITERATION: "4", contract.ENV_INPROCESS_AWAIT_GO: "1",
           "KL_STEPS": "1"}  # fmt: skip
    with job(run_dir, 1, env=env, auto=False) as j:
        assert j.coord is not None
        assert j.log.wait(msg(Hello), what="hello")["msg"].iteration == 4
        j.log.wait(msg(Ready, iteration=4), what="ready(4) before any call")
        j.coord.send(0, Abort(iteration=5, reason="another fault meanwhile"))
        j.log.wait(msg(Ready, iteration=5), what="ready(5)")
        assert not j.log.find(ev("enter"))  # not called before its go
        j.coord.go(5)
        entered = j.log.wait(ev("enter", iteration=5), what="iteration 5")
        go = j.log.wait(lambda e: isinstance(e.get("sent"), Go))["sent"]
        assert entered["port"] == go.env[contract.MASTER_PORT]
        assert entered["await_go"] is None  # a respawn of it later is not told to wait
        j.log.wait(msg(Done, iteration=5), what="done(5)")
        assert j.wait_exit() == [0]
        assert not j.log.find(ev("enter", iteration=4))


def test_started_again_at_its_death_and_given_up_it_exits_without_a_call(
    run_dir: Path,
) -> None:
    env = {contract.ENV_INPROCESS_ITERATION: "2", contract.ENV_INPROCESS_AWAIT_GO: "1"}
    with job(run_dir, 1, env=env, auto=False) as j:
        assert j.coord is not None
        j.log.wait(msg(Ready, iteration=2), what="ready(2)")
        j.coord.send(0, GiveUp(reason="budget spent"))
        assert j.wait_exit() != [0]
        assert not j.log.find(ev("enter"))
        assert any("before this rank's start" in line for line in j.workers[0].stderr)


# ------------------------------------------------------------------ in this process


def test_no_sidecar_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> None:
    monkeypatch.setenv(contract.ENV_INPROCESS, "1")
    monkeypatch.setenv(contract.ENV_RUN_DIR, str(run_dir))

    @Wrapper(connect_timeout=0.2)
    def train() -> None:
        raise AssertionError("not called")

    with pytest.raises(ConnectionError, match=r"inprocess\.sock within 0\.2 s"):
        train()


def test_timeouts_from_arguments_env_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contract.ENV_INPROCESS_SOFT_TIMEOUT, raising=False)
    monkeypatch.delenv(contract.ENV_INPROCESS_HARD_TIMEOUT, raising=False)
    assert Wrapper().timeouts() == (
        contract.DEFAULT_INPROCESS_SOFT_TIMEOUT,
        contract.DEFAULT_INPROCESS_HARD_TIMEOUT,
    )
    monkeypatch.setenv(contract.ENV_INPROCESS_SOFT_TIMEOUT, "5")
    monkeypatch.setenv(contract.ENV_INPROCESS_HARD_TIMEOUT, "7.5")
    assert Wrapper().timeouts() == (5.0, 7.5)
    assert Wrapper(soft_timeout=1, hard_timeout=2).timeouts() == (1, 2)
    with pytest.raises(ValueError, match="below hard_timeout"):
        Wrapper(soft_timeout=3, hard_timeout=2)
    with pytest.raises(ValueError, match="positive"):
        Wrapper(soft_timeout=float("nan"))
    monkeypatch.setenv(contract.ENV_INPROCESS_SOFT_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="KELASTIC_INPROCESS_SOFT_TIMEOUT"):
        Wrapper().timeouts()


def test_expires_acquire_calls_the_progress_hook() -> None:
    class Client:
        def acquire(self, scope_id: str, expiration_time: float) -> None:
            pass

        def release(self, scope_id: str) -> None:
            pass

    seen: list[int] = []
    previous = timer.set_progress_hook(lambda: seen.append(1))
    try:
        with timer.expires(after=5, client=Client()):
            pass
    finally:
        assert timer.set_progress_hook(previous) is not None
    assert seen == [1]


def test_exceptions_and_summary() -> None:
    assert not issubclass(RestartAbort, Exception)  # `except Exception` lets it pass
    assert issubclass(InjectedFault, Exception) and issubclass(GiveUpError, RuntimeError)
    assert summary(ValueError("a\nb")) == "ValueError: a"
    assert summary(KeyError()) == "KeyError"


def test_a_teardown_without_connections_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor repeats the teardown each tick while the function has not left,
    holding the lock the main thread's leaving takes: with nothing to shut down it must
    not sleep (it waited two 5 ms looks for sends on no connection)."""
    slept: list[float] = []
    monkeypatch.setattr(ip_abort.time, "sleep", slept.append)
    before = ip_abort.snapshot()
    assert ip_abort.shutdown_connections(before) == 0
    assert slept == []
    server = socket.create_server(("127.0.0.1", 0))
    conn = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:  # with one, the sends are awaited as before: two looks a few ms apart
        assert ip_abort.shutdown_connections(before, store_port=1) == 2
        assert slept and all(0 < s <= 0.02 for s in slept)
    finally:
        for sock in (server, conn, peer):
            sock.close()


def test_shutdown_connections_spares_listeners_the_store_and_older_sockets() -> None:
    old_server = socket.create_server(("127.0.0.1", 0))
    old = socket.create_connection(old_server.getsockname())
    old_peer, _ = old_server.accept()
    before = ip_abort.snapshot()
    server = socket.create_server(("127.0.0.1", 0))
    store_server = socket.create_server(("127.0.0.1", 0))
    store_port = store_server.getsockname()[1]
    conn = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    store = socket.create_connection(("127.0.0.1", store_port))
    store_peer, _ = store_server.accept()
    unix_a, unix_b = socket.socketpair()
    sockets: list[Any] = [old_server, old, old_peer, server, store_server, conn, peer, store,
                          store_peer, unix_a, unix_b]  # fmt: skip
    try:
        # conn and peer (both ends live in this process) are the only ones
        assert ip_abort.shutdown_connections(before, store_port, store_clients=False) == 2
        assert conn.recv(10) == b"" and peer.recv(10) == b""
        store.sendall(b"x")
        assert store_peer.recv(10) == b"x"
        unix_a.sendall(b"y")
        assert unix_b.recv(10) == b"y"
        server.settimeout(5)
        socket.create_connection(server.getsockname()).close()  # still listening
        server.accept()[0].close()
        # by default the store's clients go too (not its server side: the client's
        # shutdown is what its peer sees)
        assert ip_abort.shutdown_connections(before, store_port) >= 1
        assert store_peer.recv(10) == b""
        with pytest.raises(OSError):
            store.sendall(b"x")
        old.sendall(b"z")  # the connection older than the snapshot is untouched
        assert old_peer.recv(10) == b"z"
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture
def dist() -> Iterator[Any]:
    """The real ``torch.distributed``, with no default process group before and after."""
    real = require_module("torch.distributed")
    assert not real.is_initialized()
    try:
        yield real
    finally:
        if real.is_initialized():
            real.destroy_process_group()


def test_nccl_groups_are_aborted_with_torch_s_abort(
    dist: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against real torch: the worker library finds ``torch.distributed`` the training code
    imported, leaves a gloo group alone, and for NCCL calls torch's own
    ``distributed_c10d._abort_process_group``, which must exist under that name (looked up
    by ``getattr``: a rename would silently skip the abort). NCCL itself needs a GPU, so
    the one fake here is the backend's name: ``get_backend`` answers ``"nccl"`` for the
    gloo group, and the abort that runs is torch's real one."""
    import torch

    assert ip_abort._dist() is dist
    assert callable(dist.distributed_c10d._abort_process_group)
    assert not ip_abort.nccl_in_use() and ip_abort.abort_nccl() is False  # no group yet
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_backend() == "gloo"
    assert not ip_abort.nccl_in_use() and ip_abort.abort_nccl() is False
    ones = torch.ones(2)
    dist.all_reduce(ones)  # the gloo group was left as it was
    assert ones.tolist() == [1.0, 1.0]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert ip_abort.nccl_in_use()
    assert ip_abort.abort_nccl() is True
    assert not dist.is_initialized()  # torch's abort took the default group down
    with pytest.raises(ValueError, match="not been initialized"):
        dist.all_reduce(ones)


def test_a_failed_init_does_not_shift_the_next_group_name(dist: Any) -> None:
    """Against real torch: an ``init_process_group`` that fails (here: its peer never
    comes) has counted its group in c10d's ``_world.group_count``; without the reset the
    next default group is named ``1``, not ``0``, and ranks whose counters differ wait
    for each other's gloo keys for ever."""
    c10d = dist.distributed_c10d
    with pytest.raises(dist.DistStoreError):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=1))  # fmt: skip
    assert not dist.is_initialized() and c10d._world.group_count == 1  # the precondition
    assert ip_abort.destroy_process_groups() is None
    assert c10d._world.group_count == 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert c10d._get_default_group().group_name == "0"
