"""``python -m kelastic.launch`` with spare workers (in-process restart's spare ranks):
the test plays the sidecar (``assign`` with ``spares``, ``promote``) against real
processes, cold and warm (forked from the zygote)."""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kelastic import contract
from tests.conftest import wait_for
from tests.worker_lib.test_launch import (
    Env,
    _gone,
    assign,
    contains,
    log_file,
    marker_procs,
    wait_ready,
)


@pytest.fixture(params=["cold", "warm"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    base = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    env = Env(base, tmp_path, warm=request.param == "warm")
    try:
        yield env
    finally:
        env.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def _assign_with_spare(attempt: int) -> dict[str, Any]:
    msg = assign(attempt, modes={0: "sleep", 1: "sleep"})
    msg["workers"][0]["env"]["KL_MODE_2"] = "sleep"  # the spare (slot 2) copies rank 0's env
    msg["workers"][0]["env"][contract.KELASTIC_TIMER_TOKEN] = "token-0"
    return {**msg, "spares": 1}


def _spares(marker: str) -> dict[int, dict[str, str]]:
    """The running spare processes of the test: pid -> env."""
    found = {}
    for pid in marker_procs(marker):
        try:
            env = psutil.Process(pid).environ()
        except psutil.Error:
            continue
        if env.get(contract.ENV_INPROCESS_SPARE) == "1":
            found[pid] = env
    return found


def _spare_log(run_dir: Path, attempt: int, generation: int) -> Path:
    return (
        contract.worker_log_dir(attempt, 2, run_dir).parent
        / f"spare0.{generation}"
        / (contract.STDOUT_LOG_NAME)
    )


def _one_new_spare(world: Env, old: set[int], generation: int) -> int:
    wait_for(lambda: contains(_spare_log(world.run_dir, 2, generation), "ready"), 30,
             what=f"spare generation {generation} ready")  # fmt: skip
    fresh = wait_for(lambda: set(_spares(world.marker)) - old, 30, what="a new spare process")
    assert len(fresh) == 1, fresh
    return fresh.pop()


def test_a_spare_waits_is_promoted_to_a_dead_rank_and_is_replaced(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(_assign_with_spare(2))
    pids = sup.expect("started")["pids"]
    assert set(pids) == {"0", "1"}  # spares are not the attempt's workers
    wait_ready(world.run_dir, 2, [0, 1])
    spare = _one_new_spare(world, set(), 0)
    env = _spares(world.marker)[spare]
    assert (env[contract.LOCAL_RANK], env[contract.RANK], env[contract.ROLE_RANK]) == (
        "2", "5", "5",
    )  # fmt: skip  # WORLD_SIZE 4 + GROUP_RANK 1 x 1 spare + 0
    assert contract.KELASTIC_TIMER_TOKEN not in env and env["KL_MODE_2"] == "sleep"
    assert env[contract.TORCHELASTIC_ERROR_FILE].endswith("attempt_2/spare0.0/error.json")
    # a worker dies; the sidecar sends the spare its go (not played here) and a promote
    psutil.Process(pids["1"]).kill()
    assert sup.expect("exited")["local_rank"] == 1
    sup.send({"type": "promote", "attempt": 2, "spare_slot": 2, "local_rank": 1, "pid": spare})
    took = sup.expect("started")
    assert took == {"type": "started", "attempt": 2, "pids": {"1": spare}, "warm": 1}
    new = _one_new_spare(world, {spare}, 1)  # the slot is refilled
    assert new != spare
    # the promoted spare is local rank 1 now: its exit is reported as rank 1's
    psutil.Process(spare).send_signal(signal.SIGKILL)
    died = sup.expect("exited")
    assert (died["local_rank"], died["pid"], died["signal"]) == (1, spare, signal.SIGKILL)
    # a waiting spare that dies is no exit of the attempt: it is replaced
    psutil.Process(new).kill()
    third = _one_new_spare(world, {spare, new}, 2)
    # promotes that do not fit are ignored: another attempt, no spare in the slot, a
    # local rank still running
    promote = {"type": "promote", "attempt": 2, "spare_slot": 2, "local_rank": 1, "pid": third}
    sup.send({**promote, "attempt": 9})
    sup.send({**promote, "spare_slot": 3})
    sup.send({**promote, "local_rank": 0})
    sup.send({**promote, "pid": pids["0"]})
    # a spare that dies after its go, before (or after) the launcher saw the promote: the
    # promote makes it rank 1 all the same, and its exit is rank 1's (a death the sidecar
    # takes as such)
    psutil.Process(third).kill()
    sup.send(promote)
    assert sup.expect("started")["pids"] == {"1": third}
    gone = sup.expect("exited")
    assert (gone["local_rank"], gone["pid"], gone["signal"]) == (1, third, signal.SIGKILL)
    waiting = _one_new_spare(world, {spare, new, third}, 3)  # the slot refilled once more
    sup.send({"type": "stop", "attempt": 2, "reason": "done"})
    assert sup.expect("stopped") == {"type": "stopped", "attempt": 2}  # nothing before it
    assert _gone(pids["0"]) and _gone(waiting)  # the spares stop with the attempt's workers
    err = launcher.stderr()
    starts = re.findall(r"spare 0 \(spare5\) started, pid (\d+)( \(warm\))?", err)
    assert len(starts) == 4, err  # the first, the refill, two replacements
    assert all(bool(warm) == world.warm for _, warm in starts), err  # forked by the zygote
    assert "killed by signal 9 while waiting (no failure of the attempt)" in err
    assert "promote of spare slot 2 for attempt 9 ignored" in err
    assert f"slot 3 to local_rank 1 ignored: pid {third} is no spare of slot 3" in err
    assert f"ignored: pid {pids['0']} is no spare of slot 2" in err
    assert "to local_rank 0 ignored: local_rank 0 has no exited, reported worker" in err
    # the promoted spare's output was prefixed by its new rank after the promote
    assert contains(log_file(world.run_dir, 2, 0, contract.STDOUT_LOG_NAME), "ready")
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})
    assert launcher.wait() == 0
    assert marker_procs(world.marker) == []


def test_a_promote_naming_another_slot_does_not_lose_a_dead_spare_for_the_right_one(
    world: Env,
) -> None:
    """A spare dies after its ``go`` and the launcher replaces it before the promote
    comes; a promote that names another slot (ignored) must not forget the dead spare,
    or the right promote that follows is ignored too and the rank's death never reported
    (found in CI: the misfit promote took the dead spare out of the launcher's record)."""
    sup, launcher = world.start()
    sup.send(_assign_with_spare(2))
    pids = sup.expect("started")["pids"]
    wait_ready(world.run_dir, 2, [0, 1])
    spare = _one_new_spare(world, set(), 0)
    psutil.Process(pids["1"]).kill()
    assert sup.expect("exited")["local_rank"] == 1
    psutil.Process(spare).kill()  # dead after its go, before the launcher saw the promote
    _one_new_spare(world, {spare}, 1)  # the launcher saw it die and replaced it
    promote = {"type": "promote", "attempt": 2, "spare_slot": 2, "local_rank": 1, "pid": spare}
    sup.send({**promote, "spare_slot": 3})
    sup.send(promote)
    assert sup.expect("started")["pids"] == {"1": spare}
    gone = sup.expect("exited")
    assert (gone["local_rank"], gone["pid"], gone["signal"]) == (1, spare, signal.SIGKILL)
    err = launcher.stderr()
    assert f"slot 3 to local_rank 1 ignored: pid {spare} is no spare of slot 3" in err, err
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})
    assert launcher.wait() == 0
    assert marker_procs(world.marker) == []


def test_a_spare_told_it_is_not_needed_is_not_replaced_and_shutdown_stops_spares(
    world: Env,
) -> None:
    sup, launcher = world.start()
    msg = _assign_with_spare(3)
    msg["spares"] = 2
    msg["workers"][0]["env"]["KL_MODE_3"] = "ok"  # the second spare exits 0 at once
    sup.send(msg)
    sup.expect("started")
    wait_for(lambda: contains(_spare_log(world.run_dir, 3, 0), "ready"), 30, what="spare 0")
    wait_for(lambda: "spare 1 (pid" in launcher.stderr(), 30, what="spare 1 started")
    wait_for(lambda: "exited: not needed" in launcher.stderr(), 30,
             what="the second spare's exit 0 logged")  # fmt: skip
    assert "spare 1" not in launcher.stderr().split("exited: not needed")[1]  # not replaced
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})  # a spare still waits
    assert launcher.wait() == 0
    assert marker_procs(world.marker) == []


def test_a_spare_loads_no_agreed_checkpoint_step() -> None:
    """A spare's rank is a placeholder: no slot of it exists, and loading the round's
    agreed step would fail (``CheckpointRestoreError``); it loads none."""
    from kelastic import contract
    from kelastic._spares import spare_env

    template = {contract.WORLD_SIZE: "4", contract.GROUP_RANK: "1", contract.RANK: "2",
                contract.ENV_CHECKPOINT_STEP: "12",
                contract.ENV_CHECKPOINT_TIER: contract.CHECKPOINT_TIER_MEMORY}  # fmt: skip
    env = spare_env(template, nproc=2, spares=1, index=0)
    assert env[contract.ENV_CHECKPOINT_STEP] == contract.CHECKPOINT_STEP_NONE
    assert contract.ENV_CHECKPOINT_TIER not in env and env[contract.RANK] == "5"
    assert template[contract.ENV_CHECKPOINT_STEP] == "12"  # the ranks' own is untouched
    assert contract.ENV_CHECKPOINT_STEP not in spare_env({}, 2, 1, 0)  # no checkpoints
