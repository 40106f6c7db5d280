"""The job's ``status.lastHang`` and ``HangEvidence`` Event (rule 7 of reconcile): every
node's hang evidence of the newest hung round, put together by
:func:`kelastic.hang_where.summarize`; the ``WorkersRestarted`` Event names the restart's
root cause. On the real node with real sidecars:
``tests/operator/test_e2e_node_faults.py::test_a_hung_worker_is_reaped_by_the_sidecar_across_the_container_boundary``."""

from __future__ import annotations

from datetime import timedelta

from kelastic.hang_where import HangWhere, RankWhere, summarize
from kelastic_operator.model import LastRestart
from kelastic_operator.reconcile import RendezvousView, format_time, reconcile

from .test_reconcile import T0, job, pod

WAIT = "main thread at /w/train.py:94 in _wait_for_peers"
NODE0 = HangWhere(3, "j-0", (RankWhere(0, 0, 10, "S", True, WAIT), RankWhere(1, 1, 11, "S", False,
                                                                          WAIT)))  # fmt: skip
NODE1 = HangWhere(3, "j-1", (RankWhere(2, 0, 12, "T", True, "main thread at /w/train.py:231 in f"),
                             RankWhere(3, 1, 13, "S", True, WAIT)))  # fmt: skip
PODS = [pod(0), pod(1)]


def test_the_first_nodes_evidence_then_all_of_them_each_once() -> None:
    first = reconcile(job(phase="Running"), PODS, T0, RendezvousView(hangs=(NODE1,)))
    hang = first.status.last_hang
    assert hang is not None and (hang.round, hang.nodes, hang.time) == (3, 1, format_time(T0))
    assert hang.message == summarize([NODE1])
    assert [(e.type, e.reason, e.message) for e in first.events] == [
        ("Warning", "HangEvidence", hang.message)
    ]
    # nothing new: no Event, the status unchanged
    same = reconcile(job(**first.status.as_patch()), PODS, T0 + timedelta(seconds=5),
                     RendezvousView(hangs=(NODE1,)))  # fmt: skip
    assert not same.events and not same.status_changed
    # the other node's arrives: the summary names the culprit among both nodes' ranks
    both = reconcile(job(**first.status.as_patch()), PODS, T0 + timedelta(seconds=6),
                     RendezvousView(hangs=(NODE0, NODE1)))  # fmt: skip
    hang = both.status.last_hang
    assert hang is not None and (hang.round, hang.nodes) == (3, 2)
    assert hang.message.startswith("hang in round 3 (2 nodes reported): culprit: rank 2 on j-1")
    assert "ranks 0, 1 on j-0 and rank 3 on j-1" in hang.message
    assert [e.reason for e in both.events] == ["HangEvidence"]
    # a node's evidence of an older round does not replace the newest
    older = HangWhere(2, "j-0", NODE0.ranks)
    stale = reconcile(job(**both.status.as_patch()), PODS, T0 + timedelta(seconds=7),
                      RendezvousView(hangs=(older, NODE1)))  # fmt: skip
    assert not stale.events and stale.status.last_hang == both.status.last_hang
    # a newer hung round replaces it, even with fewer nodes so far
    newer = HangWhere(5, "j-0", NODE0.ranks)
    later = reconcile(job(**both.status.as_patch()), PODS, T0 + timedelta(seconds=8),
                      RendezvousView(hangs=(newer, NODE1)))  # fmt: skip
    assert later.status.last_hang is not None and later.status.last_hang.round == 5


def test_the_restart_event_and_status_name_its_root_cause_and_follow_an_amend() -> None:
    waited = LastRestart(round=3, cause="hang", node="j-0", message="hang: rank 0 on j-0 "
                         "(round 3) killed by SIGKILL: timer 'step' expired")  # fmt: skip
    plan = reconcile(job(phase="Running", restartsSpent=0), PODS, T0,
                     RendezvousView(restarts_spent=1, round=4, last_restart=waited))  # fmt: skip
    (restarted,) = [e for e in plan.events if e.reason == "WorkersRestarted"]
    assert restarted.message == (
        f"worker group restarted: 1/3 restarts spent (round 4): {waited.message}"
    )
    assert plan.status.last_restart == waited
    # the stopped worker's node amended the charge: the status follows, no second Event
    culprit = LastRestart(round=3, cause="hang", node="j-1", message="hang: rank 2 on j-1 "
                          "(round 3): stopped (process state T) outside any timer")  # fmt: skip
    view = RendezvousView(restarts_spent=1, round=4, last_restart=culprit)
    amended = reconcile(job(**plan.status.as_patch()), PODS, T0, view)
    assert amended.status.last_restart == culprit and amended.status_changed
    assert not [e for e in amended.events if e.reason == "WorkersRestarted"]
    plain = reconcile(job(phase="Running", restartsSpent=0), PODS, T0,
                      RendezvousView(restarts_spent=1, round=4))  # fmt: skip
    (restarted,) = [e for e in plain.events if e.reason == "WorkersRestarted"]
    assert restarted.message == "worker group restarted: 1/3 restarts spent (round 4)"
