"""Fault specs for local mode, and failure records (summaries, JSON round trip)."""

from __future__ import annotations

import signal

import pytest

from kelastic_operator.local.faults import Fault
from kelastic_sidecar.failure import CAUSE_HANG, Failure, signal_name


def test_fault_specs_parse() -> None:
    assert Fault.parse("kill:rank=1,after=8") == Fault("kill", 1, 8.0)
    assert Fault.parse("hang:after=2.5,rank=3") == Fault("hang", 3, 2.5)
    assert Fault.parse("kill:rank=0").after == 0.0
    assert Fault.parse("hang:rank=2,after=1").describe() == "SIGSTOP rank 2 after 1s"


@pytest.mark.parametrize(
    "text",
    ["kill", "boom:rank=1", "kill:rank=x", "kill:rank=-1", "kill:rank=1,after=-2",
     "kill:rank=1,rank=2", "kill:rank=1,speed=3", "kill:after=1"],
)  # fmt: skip
def test_bad_fault_specs_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="expected kill:rank=R,after=S"):
        Fault.parse(text)


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
