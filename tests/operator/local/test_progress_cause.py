"""``kelastic run`` names each process restart's cause from what is known: the failing
nodes' ``last_failure`` first, else the budget record's last charge (every sidecar
reads it), and only with neither "see the sidecar logs"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kelastic_operator.local.progress import ProgressReporter, root_cause
from kelastic_operator.model import load_manifest

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "digits" / "elasticjob.yaml"

RAISED = ("worker_failure: rank 1 on digits-0 (round 0) exited with code 1: InjectedFault: "
          "fault injected by kelastic run --fault raise")  # fmt: skip


class _Pod:
    def __init__(self, index: int, status: dict[str, Any]) -> None:
        self.index, self.status, self.sidecar = index, status, None
        self.name = f"digits-{index}"


def _status(round_: int, spent: int, **more: Any) -> dict[str, Any]:
    return {"phase": "running", "round": round_, "restarts_spent": spent, "world_size": 4,
            "group_world_size": 2, **more}  # fmt: skip


def test_the_cause_comes_from_the_budget_record_when_no_running_sidecar_failed() -> None:
    """The node whose failure was charged is gone (its sidecar killed right after the
    fault): the survivors have no ``last_failure`` of that round, but their
    ``last_charge`` (the budget record's) names it."""
    charge = {"round": 0, "summary": RAISED, "time": 5.0}
    assert root_cause([], [charge]) == RAISED
    assert root_cause([], []) == "see the sidecar logs"
    # a node's own failure of the round, earlier than the charge's, still comes first
    own = {"round": 0, "summary": "hang: rank 2 ...", "time": 4.0}
    assert root_cause([own], [charge]) == "hang: rank 2 ..."
    # a charge of an older round says nothing of this one
    assert root_cause([{"round": 1, "summary": "x", "time": 9.0}], [charge]) == "x"

    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)
    pods = [_Pod(1, _status(0, 0))]
    reporter.poll(pods)  # type: ignore[arg-type]
    pods[0].status = _status(1, 1, last_charge=charge)
    reporter.poll(pods)  # type: ignore[arg-type]
    assert f"process restart 1/3: {RAISED}" in said, said
