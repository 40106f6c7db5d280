"""A fault the sidecar does not restart in process (it gave up: etcd failing, budget
spent) is re-raised when the rank's function call ends, later than it was raised; its
error file says when it was raised (``fault_time``), so that the sidecar orders it
before the errors it caused in peers that exited first."""

from __future__ import annotations

import json
from pathlib import Path

from kelastic.inprocess_messages import Fault, GiveUp
from tests.worker_lib.test_inprocess_harness import ev, job, msg


def test_a_fault_given_up_is_recorded_with_the_time_it_was_raised(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    env = {"KL_STEPS": "3", "KL_FAULT": "0:1", "KL_DO": "raise",
           "TORCHELASTIC_ERROR_FILE": str(error_file)}  # fmt: skip
    with job(tmp_path, 1, env=env) as j:
        assert j.coord is not None
        j.coord.give_up_on_fault = True
        raised = j.log.wait(ev("raising", rank=0), what="the raise")["t"]
        j.log.wait(msg(Fault, iteration=0), what="the fault")
        given_up = j.log.wait(lambda e: isinstance(e.get("sent"), GiveUp), what="give_up")["t"]
        assert j.wait_exit() == [1]
    extra = json.loads(error_file.read_text())["message"]["extraInfo"]
    assert "ValueError: boom in rank 0" in extra["py_callstack"]
    assert "fault_time" in extra, extra
    # stamped as the exception left the function: after the raise, before the give-up
    assert raised <= extra["fault_time"] <= given_up, (raised, extra["fault_time"], given_up)
    assert extra["timestamp"] == str(int(extra["fault_time"]))
