"""Fault specs for local mode, and failure records (summaries, JSON round trip)."""

from __future__ import annotations

import signal
import time

import pytest

from kelastic import contract
from kelastic_operator.local.faults import Fault, FaultInjector, arm_raise
from kelastic_operator.model import ElasticJob, parse_job, trainer_container
from kelastic_sidecar.failure import CAUSE_HANG, Failure, signal_name
from tests.conftest import wait_for


def test_fault_specs_parse() -> None:
    assert Fault.parse("kill:rank=1,after=8") == Fault("kill", 1, 8.0)
    assert Fault.parse("hang:after=2.5,rank=3") == Fault("hang", 3, 2.5)
    assert Fault.parse("kill:rank=0").after == 0.0
    assert Fault.parse("hang:rank=2,after=1").describe() == "SIGSTOP rank 2 after 1s"
    assert Fault.parse("raise:rank=1,after=4") == Fault("raise", 1, 4.0)
    assert Fault.parse("raise:rank=1,after=4").describe() == "SIGUSR1 rank 1 after 4s"


@pytest.mark.parametrize(
    "text",
    ["kill", "boom:rank=1", "kill:rank=x", "kill:rank=-1", "kill:rank=1,after=-2",
     "kill:rank=1,rank=2", "kill:rank=1,speed=3", "kill:after=1", "raise", "raise:rank=1,after=x",
     "throw:rank=1"],
)  # fmt: skip
def test_bad_fault_specs_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError) as err:
        Fault.parse(text)
    assert "expected kill:rank=R,after=S, hang:rank=R,after=S or raise:rank=R,after=S" in str(
        err.value
    )


def _job(env: list[dict[str, str]]) -> ElasticJob:
    trainer = {"name": "trainer", "command": ["python", "t.py"], "env": env}
    return parse_job(
        {
            "apiVersion": "kelastic.dev/v1alpha1",
            "kind": "ElasticJob",
            "metadata": {"name": "j"},
            "spec": {"replicas": 1, "template": {"spec": {"containers": [trainer]}}},
        }
    )


def test_a_raise_fault_arms_the_trainers_env_and_nothing_else_does() -> None:
    job = _job([{"name": "A", "value": "1"}, {"name": contract.ENV_INJECT_RAISE, "value": "0"}])
    assert arm_raise(job, [Fault("kill", 0, 1.0)]) is job
    armed = arm_raise(job, [Fault("kill", 0, 1.0), Fault("raise", 0, 1.0)])
    assert trainer_container(armed.spec.template)["env"] == [
        {"name": "A", "value": "1"},
        {"name": contract.ENV_INJECT_RAISE, "value": "1"},
    ]
    # the job it came from is left as it was
    assert {"name": contract.ENV_INJECT_RAISE, "value": "0"} in trainer_container(
        job.spec.template
    )["env"]


def test_the_next_faults_clock_waits_for_a_new_iteration_or_attempt() -> None:
    """After a fault, the next one waits until the target's node is past where the first
    left it: a new attempt (process restart) or a new in-process iteration of one."""
    where: dict[str, tuple[int, int]] = {"n0": (1, 0)}
    announced: list[str] = []
    injector = FaultInjector(
        [Fault("raise", 0, 0.0), Fault("raise", 0, 0.0)],
        launcher_pids=lambda: [],
        training=lambda rank: ("n0", where["n0"]),
        attempts=lambda: dict(where),
        announce=announced.append,
    )
    fired: list[Fault] = []

    def fire(fault: Fault) -> bool:  # no process: record what would be signalled
        fired.append(fault)
        return True

    injector._fire = fire  # type: ignore[method-assign]
    injector.start()
    try:
        wait_for(lambda: len(fired) == 1, timeout=5)
        time.sleep(0.5)
        assert len(fired) == 1  # same attempt, same iteration: the second one waits
        where["n0"] = (1, 1)  # an in-process restart: iteration 1 of attempt 1
        wait_for(lambda: len(fired) == 2, timeout=5)
    finally:
        injector.stop()


def test_failure_summary_and_round_trip() -> None:
    f = Failure(
        cause=CAUSE_HANG, node="digits-0", round=2, rank=1, local_rank=1,
        signal=int(signal.SIGKILL), message="timer 'train_step' expired", tail=("a", "b"),
    )  # fmt: skip
    assert f.summary() == (
        "hang: rank 1 on digits-0 (round 2) killed by SIGKILL: timer 'train_step' expired"
    )
    again = Failure.from_dict(f.as_dict() | {"unknown": 1})
    assert again == f
    assert "last lines of stderr:\n  a\n  b" in f.details()
    assert Failure(cause="worker_failure", node="n", round=0, rank=3, exitcode=2).summary() == (
        "worker_failure: rank 3 on n (round 0) exited with code 2"
    )
    assert signal_name(77) == "signal 77"
    with pytest.raises(TypeError):
        Failure.from_dict({"cause": "x"})
