"""``kelastic run`` says every process restart, each with its own root cause, even one
no poll saw happen (two rounds failing between two polls, the second exhausting the
budget: CI saw ``restart 1/1`` never said), and a crafted status says nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kelastic_operator.local.progress import ProgressReporter
from kelastic_operator.local.restart_lines import MAX_SAID, ProcessRestarts
from kelastic_operator.model import load_manifest

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "digits" / "elasticjob.yaml"

BAD = "worker_failure: rank 3 on steps-1 (round {r}) exited with code 1: ValueError: bad batch"
PEER = "worker_failure: rank 1 on steps-0 (round {r}) exited with code 1: RuntimeError: gloo"


def _failure(r: int, node: str = "steps-1", t: float = 0.0, text: str = BAD) -> dict[str, Any]:
    return {"round": r, "node": node, "summary": text.format(r=r), "time": t or 10.0 + r}


def _charge(count: int, failure: dict[str, Any]) -> dict[str, Any]:
    return {**failure, "count": count}


def _status(phase: str, r: int, spent: int, **more: Any) -> dict[str, Any]:
    return {"phase": phase, "round": r, "restarts_spent": spent, "world_size": 4,
            "group_world_size": 2, **more}  # fmt: skip


class _Pod:
    def __init__(self, index: int, status: dict[str, Any]) -> None:
        self.index, self.status, self.sidecar = index, status, None
        self.name, self.http_port = f"steps-{index}", 0
        self.sidecar_run_dir: Path | None = None


def _reporter(max_restarts: int = 1) -> tuple[ProgressReporter, list[str]]:
    said: list[str] = []
    job = load_manifest(DIGITS)
    job.spec.max_restarts = max_restarts
    return ProgressReporter(job, said.append), said


def test_a_restart_between_two_polls_is_said_with_its_own_cause() -> None:
    # The CI case: round 0 fails (restart 1/1 charged), the poll sees it before the
    # other node said anything and waits for it; round 1 (a warm start) fails at once,
    # before the next poll, and exhausts the budget. Only the last was said before.
    reporter, said = _reporter()
    pods = [_Pod(0, _status("running", 0, 0)), _Pod(1, _status("running", 0, 0))]
    reporter.poll(pods)  # type: ignore[arg-type]
    first = _failure(0)
    pods[0].status = _status("stopping", 0, 1)
    pods[1].status = _status("stopping", 0, 1, last_failure=first, charges=[_charge(1, first)])
    reporter.poll(pods)  # type: ignore[arg-type]
    assert not [s for s in said if "process restart" in s], said  # waits for node 0
    second = _failure(1)
    charges = [_charge(1, first), _charge(2, second)]
    pods[0].status = _status("failed", 1, 2, last_failure=second, charges=charges)
    pods[1].status = _status("failed", 1, 2, last_failure=second, charges=charges)
    reporter.poll(pods)  # type: ignore[arg-type]
    lines = [s for s in said if "process restart" in s]
    assert lines == [f"process restart 1/1: {BAD.format(r=0)}",
                     f"process restart budget (1) spent: {BAD.format(r=1)}"], said  # fmt: skip


def test_a_restart_no_poll_saw_is_named_by_its_charge_or_a_failure_seen_earlier() -> None:
    # No poll saw the count at 1. Round 0's charge was written by the peer's node
    # (its gloo error, later than the fault); the fault was seen at an earlier poll,
    # before any charge: it names the restart.
    reporter, said = _reporter(max_restarts=3)
    fault = _failure(0, t=10.0)
    pods = [
        _Pod(0, _status("running", 0, 0)),
        _Pod(1, _status("running", 0, 0, last_failure=fault)),
    ]
    reporter.poll(pods)  # type: ignore[arg-type]
    peer = _failure(0, node="steps-0", t=10.4, text=PEER)
    charges = [_charge(1, peer), _charge(2, _failure(1))]
    pods[0].status = _status("running", 2, 2, last_failure=_failure(1, "steps-0"), charges=charges)
    pods[1].status = _status("running", 2, 2, last_failure=_failure(1), charges=charges)
    reporter.poll(pods)  # type: ignore[arg-type]
    lines = [s for s in said if s.startswith("process restart")]
    assert lines == [f"process restart 1/3: {BAD.format(r=0)}",
                     f"process restart 2/3: {BAD.format(r=1)}"], said  # fmt: skip
    assert "round 2: world size 4 (2 nodes x 2), restarts 2/3" in said
    # and without the earlier sighting, the charge names it
    restarts = ProcessRestarts(3)
    statuses = [_status("running", 2, 2, charges=charges)]
    assert restarts.observe(statuses, True, 0.0) == [
        f"process restart 1/3: {PEER.format(r=0)}",
        "process restart 2/3: " + BAD.format(r=1),
    ]
    assert restarts.said == 2 and restarts.observe(statuses, True, 5.0) == []


def test_a_restart_without_any_charge_said_names_the_newest_failure_or_the_logs() -> None:
    restarts = ProcessRestarts(3)
    lines = restarts.observe([_status("running", 3, 2, last_failure=_failure(2))], True, 0.0)
    assert lines == ["process restart 1/3: see the sidecar logs",
                     f"process restart 2/3: {BAD.format(r=2)}"]  # fmt: skip


def test_the_line_waits_for_every_node_a_new_round_or_the_cause_wait() -> None:
    restarts = ProcessRestarts(3)
    one = [_status("stopping", 0, 1, last_failure=_failure(0)), _status("stopping", 0, 1)]
    assert restarts.observe(one, False, 100.0) == []
    assert restarts.observe(one, False, 100.5) == []
    assert restarts.observe(one, False, 101.0) == [f"process restart 1/3: {BAD.format(r=0)}"]
    both = [_status("stopping", 1, 2, last_failure=_failure(1)),
            _status("stopping", 1, 2, last_failure=_failure(1, "steps-0", text=PEER))]  # fmt: skip
    assert restarts.observe(both, False, 200.0) == [f"process restart 2/3: {BAD.format(r=1)}"]


def test_crafted_counts_and_charges_say_a_bounded_number_of_lines() -> None:
    restarts = ProcessRestarts(3)
    crafted: list[Any] = [
        _status("running", 0, True),
        _status("running", 0, "9" * 30),
        _status("running", 0, -5, charges="x"),
        _status("running", 0, 2**80, charges=[None, 7, {"count": True, "round": 0}]),
        _status("running", 0, 0, last_failure={"round": "0", "summary": "x"},
                charges=[{"count": 2**60, "round": 1, "summary": "s", "time": float("nan")}]),
    ]  # fmt: skip
    assert restarts.observe(crafted, True, 0.0) == []  # none of them is a count
    huge = [_status("running", 0, 10**9, charges=[_charge(10**9, _failure(4))] * 1000)]
    lines = restarts.observe(huge, True, 0.0)
    assert len(lines) == MAX_SAID + 1, lines
    assert lines[0] == (f"process restarts 1..{10**9 - MAX_SAID}: no running sidecar "
                        "describes them any more; see the sidecar logs")  # fmt: skip
    assert lines[-1] == f"process restart budget (3) spent: {BAD.format(r=4)}"
    assert restarts.said == 10**9


def test_a_restart_still_waiting_for_its_cause_is_said_by_the_jobs_last_word(
    tmp_path: Path,
) -> None:
    # One node reported its failure, the other never will (the job ended): the end
    # says the restart with what is known instead of leaving it out.
    reporter, said = _reporter(max_restarts=3)
    pods = [_Pod(0, _status("running", 0, 0)), _Pod(1, _status("running", 0, 0))]
    reporter.poll(pods)  # type: ignore[arg-type]
    pods[1].status = _status("stopping", 0, 1, last_failure=_failure(0))
    reporter.poll(pods)  # type: ignore[arg-type]
    assert not [s for s in said if s.startswith("process restart")], said
    assert reporter.finish(0, 2.0, pods, "", tmp_path) == 0  # type: ignore[arg-type]
    assert said[-2:] == [
        f"process restart 1/3: {BAD.format(r=0)}",
        f"job succeeded in 2.0s: round 0; restarts: 1 process, 0 Pod replacements; "
        f"logs in {tmp_path}",
    ], said


def test_a_charge_read_amended_by_one_sidecar_names_the_stopped_worker() -> None:
    # The node that charged the hang keeps its own reading (a peer that waited, whose
    # timer expired first) until its next round; another read the record amended to
    # name the stopped worker. Whichever status comes last, the stopped one is named.
    waited = {**_failure(2, "steps-0", t=10.0, text="hang: rank 3 on steps-0 (round {r})"),
              "count": 1}  # fmt: skip
    stopped = {**_failure(2, "steps-1", t=10.5, text="hang: rank 2 on steps-1 (round {r})"),
               "stopped": True, "count": 1}  # fmt: skip
    for order in ([waited, stopped], [stopped, waited]):
        restarts = ProcessRestarts(3)
        statuses = [_status("running", 3, 1, charges=[c]) for c in order]
        assert restarts.observe(statuses, True, 0.0) == [
            "process restart 1/3: hang: rank 2 on steps-1 (round 2)"
        ], order
