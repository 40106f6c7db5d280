"""``kelastic run`` names each process restart's cause from what is known: the failing
nodes' ``last_failure`` first, else the budget record's charge (every sidecar reads
it), and only with neither "see the sidecar logs"."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kelastic.last_status import LAST_STATUS_NAME, write_last_status
from kelastic_operator.local.progress import ProgressReporter, loaded_line
from kelastic_operator.local.restart_lines import root_cause
from kelastic_operator.model import load_manifest
from kelastic_sidecar.http import SidecarHttpServer

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "digits" / "elasticjob.yaml"

RAISED = ("worker_failure: rank 1 on digits-0 (round 0) exited with code 1: InjectedFault: "
          "fault injected by kelastic run --fault raise")  # fmt: skip


class _Pod:
    def __init__(self, index: int, status: dict[str, Any]) -> None:
        self.index, self.status, self.sidecar = index, status, None
        self.name, self.http_port = f"digits-{index}", 0
        self.sidecar_run_dir: Path | None = None
        self.launcher = types.SimpleNamespace(returncode=1)

    def job_failed(self) -> bool:
        return True

    def termination_message(self) -> str:
        return f"{self.name}: job failed"


def _status(round_: int, spent: int, **more: Any) -> dict[str, Any]:
    return {"phase": "running", "round": round_, "restarts_spent": spent, "world_size": 4,
            "group_world_size": 2, **more}  # fmt: skip


def test_the_cause_comes_from_the_budget_record_when_no_running_sidecar_failed() -> None:
    """The node whose failure was charged is gone (its sidecar killed right after the
    fault): the survivors have no ``last_failure`` of that round, but their
    ``charges`` (the budget record's) name it."""
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
    pods[0].status = _status(1, 1, charges=[{**charge, "count": 1}])
    reporter.poll(pods)  # type: ignore[arg-type]
    assert f"process restart 1/3: {RAISED}" in said, said


def _where(node: str, *ranks: tuple[int, str, bool, str]) -> dict[str, Any]:
    return {"round": 2, "node": node, "ranks": [
        {"rank": r, "local_rank": r % 2, "pid": 100 + r, "state": st, "reaped": reaped,
         "where": f"main thread at /w/train.py:{line} in f (stacks in /x)"}
        for r, st, reaped, line in ranks]}  # fmt: skip


def test_once_every_node_said_where_its_workers_were_the_culprit_is_named_across_nodes() -> None:
    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)
    evidence = _where("digits-0", (0, "S", True, "94"), (1, "T", False, "71"))
    first = _status(2, 1, node="digits-0", hang_evidence=evidence)
    pods = [_Pod(0, first), _Pod(1, _status(2, 1, node="digits-1"))]
    reporter.poll(pods)  # type: ignore[arg-type]
    assert [s for s in said if s.startswith("hang in round 2 (")] == []  # one node so far
    pods[1].status = _status(2, 1, node="digits-1",
                             hang_evidence=_where("digits-1", (2, "S", True, "94"),
                                                  (3, "S", False, "94")))  # fmt: skip
    reporter.poll(pods)  # type: ignore[arg-type]
    reporter.poll(pods)  # type: ignore[arg-type]
    (verdict,) = [s for s in said if s.startswith("hang in round 2 (")]
    assert verdict.startswith(
        "hang in round 2 (2 nodes reported): culprit: rank 1 on digits-0 (stopped): main "
        "thread at /w/train.py:71 in f; waiting: "
    )


def test_a_straggler_is_said_as_its_episode_begins_and_ends() -> None:
    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)
    slow = {"local_rank": 1, "scope": "step", "median_s": 0.2, "others_median_s": 0.05,
            "ratio": 4.0}  # fmt: skip
    hostile = [None, "x", {"local_rank": "1", "median_s": 1, "ratio": 2},
               {"local_rank": 1, "median_s": float("nan"), "ratio": 2},
               {"local_rank": 10**400 // 10**399, "median_s": 1e308 * 10, "ratio": 2}]  # fmt: skip
    pods = [_Pod(0, _status(0, 0, node="steps-0",
                            step_times={"stragglers": [slow, *hostile]}))]  # fmt: skip
    reporter.poll(pods)  # type: ignore[arg-type]
    reporter.poll(pods)  # type: ignore[arg-type]
    assert [s for s in said if "straggler" in s] == [
        "straggler on steps-0: local rank 1's median step 0.200 s (scope 'step') is 4.00x its "
        "node's other ranks'"
    ]
    pods[0].status = _status(0, 0, node="steps-0", step_times={"stragglers": "garbage"})
    reporter.poll(pods)  # type: ignore[arg-type]
    pods[0].status = _status(0, 0, node="steps-0", step_times={"stragglers": []})
    reporter.poll(pods)  # type: ignore[arg-type]
    assert said[-1] == ("straggler on steps-0: local rank 1 (scope 'step') is no longer slower "
                        "than its node's other ranks")  # fmt: skip


def _restored(round_: int, step: int | None, tier: str, held: bool = True, **more: Any
              ) -> dict[str, Any]:  # fmt: skip
    return {"round": round_, "step": step, "tier": tier, "ranks": 4, "held": held,
            "time": 1.0, "checked_s": 0.0123, **more}  # fmt: skip


def test_each_rounds_checkpoint_restore_is_said_once() -> None:
    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)
    pods = [_Pod(i, _status(0, 0, checkpoint=_restored(0, None, "none", held=False)))
            for i in range(2)]  # fmt: skip
    reporter.poll(pods)  # type: ignore[arg-type]
    assert not [s for s in said if "checkpoint" in s]  # a fresh start: nothing lost
    for pod in pods:  # both sidecars agreed on the same step: said once
        pod.status = _status(1, 1, checkpoint=_restored(1, 12, "memory"))
    reporter.poll(pods)  # type: ignore[arg-type]
    reporter.poll(pods)  # type: ignore[arg-type]
    for pod in pods:
        pod.status = _status(2, 2, checkpoint=_restored(2, None, "none"))
    reporter.poll(pods)  # type: ignore[arg-type]
    assert [s for s in said if "checkpoint" in s] == [
        "round 1: the workers restore checkpoint step 12 from memory (4 ranks; slots checked "
        "in 0.012 s)",
        "round 2: no checkpoint step every one of the 4 ranks holds: the workers start "
        "without one; slots checked in 0.012 s",
    ]


def test_the_ranks_loads_are_said_once_all_of_them_loaded() -> None:
    """Each sidecar counts its own workers' loads of the round's step (their records);
    once the counts add up to the round's ranks, the slowest load is said, once."""
    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)

    def poll(*loaded: dict[str, Any] | None) -> list[str]:
        pods = [_Pod(i, _status(2, 1, checkpoint=_restored(2, 17, "disk", loaded=got)))
                for i, got in enumerate(loaded)]  # fmt: skip
        reporter.poll(pods)  # type: ignore[arg-type]
        return [s for s in said if "loaded step" in s]

    assert poll(None, None) == []
    assert poll({"ranks": 2, "slowest_s": 0.5}, None) == []  # two of four so far
    assert poll({"ranks": 2, "slowest_s": 0.5}, {"ranks": 1, "slowest_s": 2.0}) == []
    done = poll({"ranks": 2, "slowest_s": 0.5}, {"ranks": 2, "slowest_s": 1.25})
    assert done == ["round 2: all 4 ranks loaded step 17 from disk, the slowest in 1.250 s"]
    assert poll({"ranks": 2, "slowest_s": 0.5}, {"ranks": 2, "slowest_s": 1.25}) == done
    # crafted counts and times say nothing
    for bad in ({"ranks": True, "slowest_s": 1.0}, {"ranks": 4, "slowest_s": float("nan")},
                {"ranks": 4, "slowest_s": -1.0}, {"ranks": 0, "slowest_s": 1.0},
                [4], "4"):  # fmt: skip
        assert loaded_line([_restored(3, 5, "memory", loaded=bad)]) is None
    assert loaded_line([_restored(3, None, "none", loaded={"ranks": 4, "slowest_s": 1.0})]) is None


def test_a_crafted_checkpoint_document_says_nothing() -> None:
    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)
    for doc in (None, "x", [], _restored(True, 3, "memory"), _restored(1, 3, "tape"),  # type: ignore[arg-type]
                _restored(1, "3", "memory"), _restored(1, 3.5, "memory"),  # type: ignore[arg-type]
                _restored(1, None, "memory"), _restored(1, 3, "none"),
                _restored(10**400, 3, "memory"), _restored(1, 3, "memory", ranks=None),
                _restored(1, 3, "memory", checked_s=float("nan"))):  # fmt: skip
        reporter.poll([_Pod(0, _status(1, 0, checkpoint=doc))])  # type: ignore[list-item]
    lines = [s for s in said if "checkpoint" in s]
    # only the last: a valid restore whose check time is no number says it without it
    assert lines == ["round 1: the workers restore checkpoint step 3 from memory (4 ranks)"]


def test_what_a_sidecar_reports_after_the_loops_last_poll_is_said_before_the_jobs_end(
    tmp_path: Path,
) -> None:
    """The run's loop polls every quarter second and ends once the workers exited; a
    straggler episode begun in the last steps (found in CI: 0.3 s before the end, on a
    loaded machine) was in the sidecar's ``/status`` but never said. :meth:`finish`
    polls the live sidecars once more first."""
    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)
    doc = _status(0, 0, node="steps-0", step_times={"stragglers": []})
    server = SidecarHttpServer(
        "127.0.0.1", 0, CollectorRegistry(), lambda: True, lambda: True, lambda: doc
    )  # the sidecar's own HTTP face
    server.start()
    sidecar = subprocess.Popen(["sleep", "60"])  # the sidecar process, alive
    try:
        pod = _Pod(0, {})
        pod.sidecar = types.SimpleNamespace(proc=sidecar)  # type: ignore[assignment]
        pod.http_port = server.port
        reporter.poll([pod])  # type: ignore[list-item]
        assert pod.status["node"] == "steps-0" and not [s for s in said if "straggler" in s]
        slow = {"local_rank": 1, "scope": "step", "median_s": 0.2, "ratio": 4.0}
        doc = _status(0, 0, node="steps-0", step_times={"stragglers": [slow]})
        assert reporter.finish(0, 5.0, [pod], "", tmp_path) == 0  # type: ignore[list-item]
        heads = [s.split(":")[0] for s in said]
        assert heads == ["round 0", "straggler on steps-0", "job succeeded in 5.0s"], said
    finally:
        sidecar.kill()
        sidecar.wait()
        server.stop()


def test_an_exited_sidecars_kept_status_is_its_last_word(tmp_path: Path) -> None:
    """The sidecar exits as the job ends on its node, its HTTP server with it: what it
    said after the loop's last poll is read from the status it kept in the run volume
    (:mod:`kelastic.last_status`); a kept file that cannot be read is said, and the job's
    end is said all the same."""
    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)
    exited = subprocess.Popen(["true"])
    exited.wait()
    pods = [_Pod(0, _status(0, 0, node="steps-0")), _Pod(1, _status(0, 0, node="steps-1"))]
    for pod in pods:
        pod.sidecar = types.SimpleNamespace(proc=exited)  # type: ignore[assignment]
        pod.sidecar_run_dir = tmp_path / pod.name
        pod.sidecar_run_dir.mkdir()
    reporter.poll(pods)  # type: ignore[arg-type]
    slow = {"local_rank": 0, "scope": "step", "median_s": 0.3, "ratio": 3.0}
    write_last_status(tmp_path / "digits-0",
                      _status(0, 0, node="steps-0", step_times={"stragglers": [slow]}))  # fmt: skip
    (tmp_path / "digits-1" / LAST_STATUS_NAME).write_bytes(b'{"node": "steps-1", "round": 0')
    assert reporter.finish(0, 7.0, pods, "", tmp_path) == 0  # type: ignore[arg-type]
    assert said[1:] == [
        "digits-1: the sidecar's last status cannot be read "
        f"({tmp_path / 'digits-1' / LAST_STATUS_NAME}: not JSON: "
        "Expecting ',' delimiter: line 1 column 31 (char 30): "
        'b\'{"node": "steps-1", "round": 0\'); what it said after the last poll is '
        "not shown",
        "straggler on steps-0: local rank 0's median step 0.300 s (scope 'step') is 3.00x its "
        "node's other ranks'",
        f"job succeeded in 7.0s: round 0; restarts: 0 process, 0 Pod replacements; logs in "
        f"{tmp_path}",
    ], said
    assert pods[1].status["node"] == "steps-1"  # the last fetched status stays


def test_a_sidecar_exiting_as_the_job_ends_is_waited_for_its_kept_status(tmp_path: Path) -> None:
    """The job ended on the sidecar's node: it stopped its HTTP server and is exiting,
    keeping its status as it goes. Its last word is that kept status (found in a run:
    the restart that exhausted the budget, charged after the loop's last poll, was
    never said: the sidecar was alive, its ``/status`` gone, its kept file not read)."""
    said: list[str] = []
    reporter = ProgressReporter(load_manifest(DIGITS), said.append)
    free = socket.create_server(("127.0.0.1", 0))  # a port nothing listens on
    port = free.getsockname()[1]
    free.close()
    pod = _Pod(0, _status(0, 0, node="digits-0"))
    pod.http_port, pod.sidecar_run_dir = port, tmp_path
    spent = _status(0, 4, node="digits-0", phase="failed",
                    last_failure={"round": 3, "summary": RAISED, "time": 9.0},
                    charges=[{"round": 3, "summary": RAISED, "time": 9.0, "count": 4}])  # fmt: skip
    keeps = ("import sys, json, time; from pathlib import Path; time.sleep(0.5); "
             "from kelastic.last_status import write_last_status; "
             "write_last_status(Path(sys.argv[1]), json.loads(sys.argv[2]))")  # fmt: skip
    exiting = subprocess.Popen([sys.executable, "-c", keeps, str(tmp_path), json.dumps(spent)])
    pod.sidecar = types.SimpleNamespace(proc=exiting)  # type: ignore[assignment]
    try:
        assert reporter.finish(1, 3.0, [pod], "", tmp_path) == 1  # type: ignore[list-item]
    finally:
        exiting.kill()
        exiting.wait()
    assert f"process restart budget (3) spent: {RAISED}" in said, said
    assert said.index(f"process restart budget (3) spent: {RAISED}") < len(said) - 2


def test_the_sidecars_are_asked_at_once_not_one_after_another(tmp_path: Path) -> None:
    """Three sidecars that answer only while all three are being asked: asked one after
    another, each would wait for the others until its timeout and say nothing (a hung
    sidecar made every poll, and the job's last word, wait once per Pod)."""
    import http.server
    import threading

    together = threading.Barrier(3, timeout=5.0)  # under the poll's 10 s: alone, no answer

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                together.wait()
            except threading.BrokenBarrierError:
                return  # asked alone: no answer
            body = json.dumps(_status(0, 0, node=f"asked-{self.server.server_port}")).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(3)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        pods = [_Pod(i, {}) for i in range(3)]
        for pod, server in zip(pods, servers, strict=True):
            pod.http_port = server.server_port
            pod.sidecar = types.SimpleNamespace(proc=alive)  # type: ignore[assignment]
        ProgressReporter(load_manifest(DIGITS), [].append).poll(pods, 10.0)  # type: ignore[arg-type]
        assert [p.status.get("node") for p in pods] == [f"asked-{s.server_port}" for s in servers]
    finally:
        together.abort()
        alive.kill()
        alive.wait()
        for server in servers:
            server.shutdown()
            server.server_close()
