"""``kelastic run --in-process`` and ``--fault raise:...``: options, help, bad input, and
(slow) the digits job recovering from an exception without restarting its processes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic import contract
from kelastic_operator.cli import with_run_options
from kelastic_operator.local import progress
from kelastic_operator.local.faults import Fault
from kelastic_operator.local.inprocess_lines import inprocess_line
from kelastic_operator.local.progress import ProgressReporter
from kelastic_operator.local.replicas import node_progress, restarting_in_process
from kelastic_operator.model import load_manifest, trainer_container
from tests.localrun import KelasticRun, run_cli, write_job

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "digits" / "elasticjob.yaml"


def _env(job_template: dict[str, object]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in trainer_container(job_template).get("env") or []}


def test_in_process_and_raise_change_only_what_they_name() -> None:
    job = load_manifest(DIGITS)
    plain = with_run_options(job, argparse.Namespace(warm_start=None, in_process=False), [])
    assert plain.spec == job.spec
    args = argparse.Namespace(warm_start=None, in_process=True)
    on = with_run_options(job, args, [Fault("raise", 1, 4.0)])
    assert on.spec.in_process.enabled is True
    assert on.spec.in_process.max_restarts == job.spec.in_process.max_restarts
    assert _env(on.spec.template)[contract.ENV_INJECT_RAISE] == "1"
    assert job.spec.in_process.enabled is False  # the manifest's model is left alone
    assert contract.ENV_INJECT_RAISE not in _env(job.spec.template)
    # a raise fault without --in-process still arms the Wrapper (the process rung recovers)
    off = with_run_options(job, argparse.Namespace(warm_start=True, in_process=False),
                           [Fault("raise", 0, 1.0)])  # fmt: skip
    assert (off.spec.in_process.enabled, off.spec.warm_start.enabled) == (False, True)
    assert _env(off.spec.template)[contract.ENV_INJECT_RAISE] == "1"


def test_help_explains_in_process_and_the_raise_fault() -> None:
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--in-process" in text and "spec.inProcess.enabled" in text
    assert "raise:rank=R,after=S SIGUSR1" in text and "kelastic.inprocess.Wrapper" in text
    assert "in-process restart" in text and "then process restart" in text


def test_a_bad_raise_fault_exits_2_listing_every_kind(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=2)
    out = run_cli(str(job), "--in-process", "--fault", "raise:rank=one")
    assert out.returncode == 2, out
    assert "expected kill:rank=R,after=S, hang:rank=R,after=S or raise:rank=R,after=S" in " ".join(
        out.stderr.split()
    )
    out = run_cli(str(job), "--fault", "raise:rank=7,after=1")
    assert out.returncode == 2 and "fault rank 7 >= world size 2" in out.stderr, out


@pytest.mark.slow
def test_digits_recovers_in_process_from_an_exception(tmp_path: Path) -> None:
    """rank 1 raises 4 s into training: every rank leaves the wrapped function and enters
    it again in the same processes (no process restart charged), continues from rank 0's
    state (equal parameter hashes on every rank), and the job reaches its accuracy."""
    run = KelasticRun(DIGITS, "--in-process", "--fault", "raise:rank=1,after=4",
                      "--status-interval", "2", workdir=tmp_path / "runs")  # fmt: skip
    assert run.wait(600) == 0, run.output
    out = run.output
    assert "fault: SIGUSR1 rank 1 after 4s" in out, out
    assert re.search(
        r"in-process restart 1/10 \(iteration 1\): rank 1 exception: .*InjectedFault", out
    ), out
    assert not re.search(r"process restart \d+/", out.replace("in-process restart", "")), out
    # every rank printed iteration 1 with the same parameter hash
    hashes = re.findall(r"\[(\d)\]:? ?.*iteration 1: params sha256 ([0-9a-f]{8})", out)
    assert {rank for rank, _ in hashes} == {"0", "1", "2", "3"}, out
    assert len({h for _, h in hashes}) == 1, hashes
    acc = [float(x) for x in re.findall(r"final test accuracy (\d\.\d+)", out)]
    assert acc and acc[-1] >= 0.90, out
    assert "job succeeded" in out
    assert run.strays() == []


# ------------------------------------------------------------------ what kelastic run says


class _Pod:
    """What the reporter reads of a replica: its last status (no sidecar to ask)."""

    def __init__(self, index: int, status: dict[str, Any]) -> None:
        self.index, self.status, self.sidecar = index, status, None
        self.name = f"digits-{index}"


def _status(
    round_: int = 0, spent: int = 0, inprocess: Any = "absent", **more: Any
) -> dict[str, Any]:
    doc = {"phase": "running", "round": round_, "restarts_spent": spent, "world_size": 4,
           "group_world_size": 2, **more}  # fmt: skip
    if inprocess != "absent":
        doc["inprocess"] = inprocess
    return doc


def _inproc(iteration: int, restarts: int, resumed: float | None, rank: int = 1) -> dict[str, Any]:
    last = {"iteration": iteration, "cause": "exception", "rank": rank, "node": "digits-0",
            "message": "InjectedFault: fault injected (SIGUSR1)\nTraceback ...",
            "resumed_s": resumed}  # fmt: skip
    return {"enabled": True, "iteration": iteration, "restarts": restarts, "max_restarts": 10,
            "phase": "running", "last": last if iteration else None}  # fmt: skip


def test_inprocess_line_waits_for_every_node_to_step_again() -> None:
    docs = [_inproc(1, 1, 0.21), _inproc(1, 1, None)]
    assert inprocess_line(docs, 1, waited_out=False) is None
    assert inprocess_line(docs, 1, waited_out=True) == (
        "in-process restart 1/10 (iteration 1): rank 1 exception: InjectedFault: fault "
        "injected (SIGUSR1); not every rank is stepping again yet"
    )
    docs[1] = _inproc(1, 1, 0.35)
    assert inprocess_line(docs, 1, waited_out=False) == (
        "in-process restart 1/10 (iteration 1): rank 1 exception: InjectedFault: fault "
        "injected (SIGUSR1); stepping again after 0.35s"
    )
    assert inprocess_line(docs, 2, waited_out=False) is None


def test_a_restart_said_complete_names_the_workers_it_started_again() -> None:
    """A peer's fault made the restart, and a hung rank killed meanwhile joined it (the
    hybrid rung started it again): said complete at once (every rank stepping), the line
    names that rank too, or nobody would learn a process was replaced. A death that made
    the restart (its record's message) is not named twice; a rank a spare replaced is
    not said to have started again as a process."""
    hung = "local rank 1 (pid 77) killed by SIGKILL: timer 'step' expired; reaped by the timer"
    docs = [_inproc(1, 1, 0.3, rank=3), _inproc(1, 1, 4.14, rank=3)]
    docs[1]["last"]["died"] = [hung]
    assert inprocess_line(docs, 1, waited_out=False) == (
        "in-process restart 1/10 (iteration 1): rank 3 exception: InjectedFault: fault "
        f"injected (SIGUSR1); {hung} (started again as a process); stepping again after 4.14s"
    )
    docs[1]["last"]["message"] = f"{hung}; it alone starts again as a process"
    line = inprocess_line(docs, 1, waited_out=False)
    assert line is not None and line.count(hung) == 1, line
    docs[1]["last"]["message"] = "InjectedFault: x"
    docs[1]["last"]["promoted"] = ["local rank 1 replaced by the spare of slot 2 (pid 80, no "
                                   "process start)"]  # fmt: skip
    line = inprocess_line(docs, 1, waited_out=False)
    assert line is not None and "started again as a process" not in line, line
    assert f"{hung}; local rank 1 replaced by the spare of slot 2" in line, line


def _reporter(enabled: bool) -> tuple[ProgressReporter, list[str]]:
    job = load_manifest(DIGITS)
    if enabled:
        job = with_run_options(job, argparse.Namespace(warm_start=None, in_process=True), [])
    said: list[str] = []
    return ProgressReporter(job, said.append), said


def test_each_restart_is_said_once_named_by_its_rung(tmp_path: Path) -> None:
    reporter, said = _reporter(enabled=True)
    pods = [_Pod(0, _status(inprocess=_inproc(0, 0, None))),
            _Pod(1, _status(inprocess=_inproc(0, 0, None)))]  # fmt: skip
    reporter.poll(pods)  # type: ignore[arg-type]
    assert said == ["round 0: world size 4 (2 nodes x 2), restarts 0/3"]
    # in-process restart into iteration 1: said once every node's ranks step again
    pods[0].status = _status(inprocess=_inproc(1, 1, 0.2))
    pods[1].status = _status(inprocess=_inproc(1, 1, None))
    reporter.poll(pods)  # type: ignore[arg-type]
    assert len(said) == 1
    pods[1].status = _status(inprocess=_inproc(1, 1, 0.25))
    reporter.poll(pods)  # type: ignore[arg-type]
    reporter.poll(pods)  # type: ignore[arg-type]
    assert said[1:] == ["in-process restart 1/10 (iteration 1): rank 1 exception: InjectedFault: "
                        "fault injected (SIGUSR1); stepping again after 0.25s"]  # fmt: skip
    # then a process restart (a new round)
    failure = {"round": 0, "summary": "worker_failure: rank 1 on digits-0 (round 0) killed by "
               "SIGKILL", "time": 1.0}  # fmt: skip
    for pod in pods:
        pod.status = _status(1, 1, _inproc(1, 1, 0.25), last_failure=failure)
    reporter.poll(pods)  # type: ignore[arg-type]
    assert said[2:] == [
        "process restart 1/3: worker_failure: rank 1 on digits-0 (round 0) killed by SIGKILL",
        "round 1: world size 4 (2 nodes x 2), restarts 1/3",
    ]
    assert "restarts 1/3, in-process restarts 1/10" in reporter.status_line(pods, ())  # type: ignore[arg-type]
    reporter.finish(0, 12.5, pods, "", tmp_path, replacements=2)  # type: ignore[arg-type]
    assert said[-1] == (f"job succeeded in 12.5s: round 1; restarts: 1 in-process, 1 process, "
                        f"2 Pod replacements; logs in {tmp_path}")  # fmt: skip


def test_an_older_sidecar_without_inprocess_is_fine(tmp_path: Path) -> None:
    for enabled in (False, True):
        reporter, said = _reporter(enabled)
        pods = [_Pod(0, _status()), _Pod(1, _status(inprocess=None))]
        reporter.poll(pods)  # type: ignore[arg-type]
        assert [x for x in said if "in-process" in x] == []
        reporter.finish(0, 1.0, pods, "", tmp_path)  # type: ignore[arg-type]
        counts = "0 in-process, 0 process" if enabled else "restarts: 0 process"
        assert counts in said[-1], said


def test_the_fault_clock_follows_in_process_iterations() -> None:
    """``raise`` then another fault: the second waits for the new iteration's steps."""
    st = _status(attempt=1, attempt_progress_count=5, group_rank=0,
                 inprocess=_inproc(1, 1, None))  # fmt: skip
    assert node_progress(st) == (1, 1)
    assert restarting_in_process(st)  # its ranks are not stepping again yet
    st["inprocess"] = _inproc(1, 1, 0.3)
    assert not restarting_in_process(st)
    st["inprocess"]["phase"] = "barrier"
    assert restarting_in_process(st)
    assert node_progress(_status(attempt=2)) == (2, 0)  # no in-process section: the attempt
    assert not restarting_in_process(_status(inprocess=None))


def test_a_restart_said_before_its_ranks_stepped_again_is_ended_when_they_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung rank cannot leave: its peers restart at once, it is reaped only after the
    timer server's grace and started again (the hybrid rung). The restart is said when
    the report wait is over, then again, with the death, once every rank steps again."""
    monkeypatch.setattr(progress, "INPROCESS_REPORT_WAIT", 0.0)
    reporter, said = _reporter(enabled=True)
    pods = [_Pod(0, _status(inprocess=_inproc(1, 1, 0.2))),
            _Pod(1, _status(inprocess=_inproc(1, 1, None)))]  # fmt: skip
    reporter.poll(pods)  # type: ignore[arg-type]
    inproc = lambda: [x for x in said if "in-process" in x]  # noqa: E731
    assert inproc()[-1].endswith("not every rank is stepping again yet"), said
    reporter.poll(pods)  # type: ignore[arg-type]
    assert sum("iteration 1" in x for x in said) == 1  # nothing new yet
    doc = _inproc(1, 1, 31.2)
    doc["last"]["died"] = ["local rank 1 (pid 77) killed by SIGKILL: hung: timer expired"]
    pods[1].status = _status(inprocess=doc)
    reporter.poll(pods)  # type: ignore[arg-type]
    assert inproc()[-1] == (
        "in-process restart (iteration 1): local rank 1 (pid 77) killed by SIGKILL: hung: "
        "timer expired (started again as a process); every rank stepping again after 31.20s"
    )
    reporter.poll(pods)  # type: ignore[arg-type]
    assert sum("iteration 1" in x for x in said) == 2  # said once
    # a restart said early and superseded by a later one gets no follow-up
    pods = [_Pod(0, _status(inprocess=_inproc(2, 2, None))),
            _Pod(1, _status(inprocess=_inproc(2, 2, None)))]  # fmt: skip
    reporter.poll(pods)  # type: ignore[arg-type]
    pods = [_Pod(0, _status(inprocess=_inproc(3, 3, 0.1))),
            _Pod(1, _status(inprocess=_inproc(3, 3, 0.1)))]  # fmt: skip
    reporter.poll(pods)  # type: ignore[arg-type]
    assert not [x for x in said if x.startswith("in-process restart (iteration 2)")], said


def test_a_dead_sidecars_last_status_does_not_hold_a_restart_back() -> None:
    """A lost node's sidecar is gone; its last status (iteration 0) must not keep the
    survivors' restart from being said until a later one overwrites it."""

    class _Exited:
        proc = SimpleNamespace(poll=lambda: -9)

    reporter, said = _reporter(enabled=True)
    lost = _Pod(1, _status(inprocess=_inproc(0, 0, None)))
    lost.sidecar = _Exited()
    doc = _inproc(1, 1, 1.03)
    doc["last"].update(cause="node_lost", rank=-1, message="node digits-1 lost: gone")
    reporter.poll([_Pod(0, _status(inprocess=doc)), lost])  # type: ignore[list-item]
    assert [x for x in said if "in-process" in x] == [
        "in-process restart 1/10 (iteration 1): node_lost: node digits-1 lost: gone; "
        "stepping again after 1.03s"
    ]


def test_a_jump_of_iterations_is_one_line_and_an_out_of_bounds_one_none() -> None:
    """A status naming a far iteration (a forged record let through, or a
    sidecar gone wrong) once drove ``kelastic run`` to say ``in-process restart
    (iteration N): see the sidecar logs`` for every N up to it (2**53: forever, Ctrl-C
    included). Now a poll looks at a bounded number of iterations, says a jump in one
    line, and ignores a status beyond the record's bounds."""
    reporter, said = _reporter(enabled=True)
    far = _inproc(100_000, 1, 0.1)
    pods = [_Pod(0, _status(inprocess=far)), _Pod(1, _status(inprocess=far))]
    reporter.poll(pods)  # type: ignore[arg-type]
    reporter.poll(pods)  # type: ignore[arg-type]
    inproc = [x for x in said if "in-process" in x]
    assert len(inproc) <= 2, inproc[:5]
    assert inproc[-1].startswith("in-process restart 1/10 (iteration 100000): rank 1"), inproc
    assert not any("see the sidecar logs" in x for x in said), said[:5]
    reporter, said = _reporter(enabled=True)
    forged = _inproc(2**53, 1, 0.1)
    reporter.poll([_Pod(0, _status(inprocess=forged))])  # type: ignore[list-item]
    assert [x for x in said if "in-process" in x] == []


def test_a_restart_overwritten_before_the_poll_is_still_named_and_a_corrupt_record_said_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``see the sidecar logs`` was said where the cause was known (a later
    restart overwrote ``last`` before the poll, e.g. a sidecar killed right after a
    raise); now the sidecars keep the ``earlier`` restarts. A corrupt record the
    sidecars refused is said, once per record, with what replaced it."""
    monkeypatch.setattr(progress, "INPROCESS_REPORT_WAIT", 0.0)
    reporter, said = _reporter(enabled=True)
    first = {**_inproc(1, 1, 0.4)["last"], "restarts": 1}
    doc = _inproc(2, 2, 1.03)
    doc["last"].update(cause="node_lost", rank=-1, message="node digits-1 lost: gone", restarts=2)
    doc["earlier"] = [first]
    doc["corrupt"] = {"revision": 41, "error": "in-process record: 'iteration' must be ..."}
    pods = [_Pod(0, _status(inprocess=doc))]
    reporter.poll(pods)  # type: ignore[arg-type]
    doc["corrupt"]["replaced_by"] = 1  # the same record, now replaced: said already
    reporter.poll(pods)  # type: ignore[arg-type]
    inproc = [x for x in said if "in-process" in x]
    assert inproc == [
        "corrupt in-process record in etcd (in-process record: 'iteration' must be ...): "
        "refused; the next fault replaces it",
        "in-process restart 1/10 (iteration 1): rank 1 exception: InjectedFault: fault "
        "injected (SIGUSR1); stepping again after 0.40s",
        "in-process restart 2/10 (iteration 2): node_lost: node digits-1 lost: gone; "
        "stepping again after 1.03s",
    ], inproc
