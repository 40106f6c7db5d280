"""What ``kelastic run`` tells its user while the job runs and when it ends.

The sidecars' ``/status`` documents are polled, and what changed is said once: a new
round (its world size), a restart, named by its rung (``in-process restart 1/10
(iteration 1): ...`` with the fault and how long until every rank stepped again;
``process restart 1/3: ...`` with the root cause the nodes reported), etcd lost and back;
where each worker was as a round hung, on each node and then, once every node said it,
the culprit across nodes (:func:`kelastic.hang_where.summarize`, the line the operator
puts in the job's status); a straggler as its episode begins and ends; the checkpoint
step each round's workers restore, and from where (:func:`restore_line`); a status line
every ``status_interval``; the job's end with its cause and the restarts per rung.
Nothing here decides anything about the job (:mod:`~kelastic_operator.local.runner` and
:mod:`~kelastic_operator.local.replacement` do).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any, TypeGuard

from kelastic._safejson import is_int
from kelastic.etcd_values.checkpoints import MAX_STEP, RestoreTier
from kelastic.hang_where import decode_where, summarize

from ..model import ElasticJob
from .inprocess_lines import (
    NOT_YET,
    corrupt_lines,
    inprocess_docs,
    inprocess_followup,
    inprocess_line,
)
from .replicas import Replica
from .restart_lines import ProcessRestarts
from .statuses import LAST_WORD_TIMEOUT, POLL_TIMEOUT, sidecar_statuses

#: Seconds an in-process restart is waited for to report every rank stepping again
#: before it is said without that figure.
INPROCESS_REPORT_WAIT = 10.0
#: Most in-process iterations looked at per poll (a bigger jump is said in one line).
MAX_SAID_PER_POLL = 16


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and math.isfinite(value)


def restore_line(doc: object) -> tuple[int, str] | None:
    """``(round, line)`` for a sidecar's ``/status`` ``checkpoint`` document
    (:meth:`kelastic_sidecar.checkpoints.RoundCheckpoints.status`): the step the round's
    workers restore and from where, or that no step every rank holds was found. None
    when there is nothing to say (a fresh start) or the document is not one a sidecar
    writes (crafted values say nothing)."""
    if not isinstance(doc, dict):
        return None
    rnd, step, tier, ranks = doc.get("round"), doc.get("step"), doc.get("tier"), doc.get("ranks")
    checked = doc.get("checked_s")
    if not (is_int(rnd, 0, MAX_STEP) and is_int(ranks, 1, MAX_STEP)
            and (step is None or is_int(step, 0, MAX_STEP))):  # fmt: skip
        return None
    if tier not in {t.value for t in RestoreTier} or (step is None) != (tier == RestoreTier.NONE):
        return None
    took = f"; slots checked in {checked:.3f} s" if _finite(checked) and checked >= 0 else ""
    if step is not None:
        return (
            rnd,
            f"round {rnd}: the workers restore checkpoint step {step} from {tier} "
            f"({ranks} ranks{took})",
        )
    if doc.get("held") is not True:
        return None
    return rnd, (f"round {rnd}: no checkpoint step every one of the {ranks} ranks holds: "
                 f"the workers start without one{took}")  # fmt: skip


def loaded_line(docs: list[object]) -> tuple[int, str] | None:
    """``(round, line)`` once every rank of the newest restore among the sidecars'
    ``/status`` ``checkpoint`` documents has loaded its step (their ``loaded`` counts add
    up to the round's ranks): ``round 2: all 4 ranks loaded step 17 from memory, the
    slowest in 0.012 s``. None before, for a round that restores none, or for documents
    no sidecar writes."""
    rounds: dict[tuple[int, int, str, int], list[tuple[int, float]]] = {}
    for doc in docs:
        if restore_line(doc) is None or not isinstance(doc, dict) or doc.get("step") is None:
            continue
        loaded = doc.get("loaded")
        if not isinstance(loaded, dict):
            continue
        count, slowest = loaded.get("ranks"), loaded.get("slowest_s")
        if not (is_int(count, 1, MAX_STEP) and _finite(slowest) and slowest >= 0):
            continue
        key = (doc["round"], doc["step"], doc["tier"], doc["ranks"])
        rounds.setdefault(key, []).append((count, slowest))
    if not rounds:
        return None
    (rnd, step, tier, ranks), got = max(rounds.items())
    if sum(count for count, _ in got) < ranks:
        return None
    slowest = max(s for _, s in got)
    return rnd, (f"round {rnd}: all {ranks} ranks loaded step {step} from {tier}, the slowest "
                 f"in {slowest:.3f} s")  # fmt: skip


def _dead(pod: Replica) -> bool:
    """Whether the replica's sidecar process is known to have exited."""
    return pod.sidecar is not None and pod.sidecar.proc.poll() is not None


class ProgressReporter:
    """Polls the replicas' sidecars and says what changed (round, restarts, etcd).

    Args:
        job: the validated manifest.
        say: prints one line of runner output.
    """

    def __init__(self, job: ElasticJob, say: Callable[[str], None]) -> None:
        self.spec = job.spec
        self.say = say
        self._restarts = ProcessRestarts(job.spec.max_restarts)
        self._seen: dict[str, Any] = {"round": None, "phases": {}, "hung": {},
                                      "summarized": -1, "slow": set(),
                                      "restored": -1, "loaded": -1}  # fmt: skip
        #: In-process restarts: the last iteration said, the count, when the next was seen.
        self._inproc: dict[str, Any] = {"said": 0, "restarts": 0, "seen_at": None,
                                        "open": None, "corrupt": set()}  # fmt: skip

    def poll(
        self, pods: list[Replica], timeout: float = POLL_TIMEOUT, last_word: bool = False
    ) -> None:
        """Fetch each live sidecar's status (into ``pod.status``; ``timeout`` seconds,
        all asked at once: :func:`~.statuses.sidecar_statuses`) and say what changed.
        With ``last_word``, an exited sidecar's status is the one it kept as it exited
        (:mod:`kelastic.last_status`), when it kept one."""
        for pod, (doc, problem) in zip(pods, sidecar_statuses(pods, timeout, last_word),
                                       strict=True):  # fmt: skip
            if problem:
                self.say(f"{pod.name}: {problem}")
            if doc:
                pod.status = doc
        statuses = [p.status for p in pods if p.status]
        if not statuses:
            return
        outage = next((s["etcd_unreachable"] for s in statuses if s.get("etcd_unreachable")), None)
        if outage and not self._seen.get("etcd"):
            self.say(f"etcd unreachable: {outage}; the sidecars keep retrying")
        elif not outage and self._seen.get("etcd"):
            self.say("etcd reachable again")
        self._seen["etcd"] = outage
        # a dead sidecar's last status stays behind the restart its node will never join
        self._poll_inprocess([p.status for p in pods if p.status and not _dead(p)])
        running = [
            s
            for s in statuses
            if s.get("phase") == "running" and is_int(s.get("round"), 0, MAX_STEP)
        ]
        rnd = max(int(s["round"]) for s in running) if running else None
        moved_on = rnd is not None and rnd != self._seen["round"]
        # the last word waits for nothing more: what is known names the restart
        for line in self._restarts.observe(statuses, moved_on or last_word, time.monotonic()):
            self.say(line)
        self._say_hangs(statuses)
        self._say_stragglers(statuses)
        if moved_on:
            ws = next(s.get("world_size") for s in running if s["round"] == rnd)
            nodes = next(s.get("group_world_size") for s in running if s["round"] == rnd)
            self._seen["round"] = rnd
            self.say(
                f"round {rnd}: world size {ws} ({nodes} nodes x {self.spec.nproc_per_node}),"
                f" restarts {self._restarts.said}/{self.spec.max_restarts}"
            )
        self._say_restore(statuses)

    def _say_restore(self, statuses: list[dict[str, Any]]) -> None:
        """Say once per round what its workers restore (every sidecar agreed on the same
        step: the first to say it speaks for all)."""
        lines = [got for s in statuses if (got := restore_line(s.get("checkpoint")))]
        if not lines:
            return
        rnd, line = max(lines)
        if rnd > self._seen["restored"]:
            self._seen["restored"] = rnd
            self.say(line)
        docs = [s.get("checkpoint") for s in statuses]
        if (got := loaded_line(docs)) is not None and got[0] > self._seen["loaded"]:
            self._seen["loaded"] = got[0]
            self.say(got[1])

    def _say_hangs(self, statuses: list[dict[str, Any]]) -> None:
        """Say, once per node and hung round, where each of its workers was as the round
        ended (the sidecar's ``hang_evidence``, :mod:`kelastic.hang_where`): the stopped
        rank and those waiting for it, on every node."""
        said: dict[str, int] = self._seen["hung"]
        wheres = []
        for status in statuses:
            where = decode_where(status.get("hang_evidence"))
            if where is None:
                continue
            wheres.append(where)
            if said.get(where.node, -1) < where.round:
                said[where.node] = where.round
                self.say(f"hang in round {where.round} on {where.node}: {where.line()}")
        newest = max((w.round for w in wheres), default=-1)
        reported = sum(1 for w in wheres if w.round == newest)
        if (
            len(statuses) > 1
            and reported == len(statuses) > 0
            and newest > self._seen["summarized"]
        ):
            self._seen["summarized"] = newest  # every node said it: the verdict across nodes
            self.say(summarize(wheres))

    def _say_stragglers(self, statuses: list[dict[str, Any]]) -> None:
        """Say each straggler episode as it begins and as it ends (the sidecars'
        ``step_times``, :mod:`kelastic_sidecar.steptime`'s verdict)."""
        said: set[tuple[str, int, str]] = self._seen["slow"]
        for status in statuses:
            node, steps = str(status.get("node") or "?"), status.get("step_times")
            if not isinstance(steps, dict) or not isinstance(steps.get("stragglers"), list):
                continue
            now = set()
            for s in steps["stragglers"]:
                if not isinstance(s, dict):
                    continue
                rank, median, ratio = s.get("local_rank"), s.get("median_s"), s.get("ratio")
                if not (_finite(rank) and _finite(median) and _finite(ratio)):
                    continue  # not what a sidecar writes: nothing to say
                key = (node, int(rank), str(s.get("scope", ""))[:256])
                now.add(key)
                if key not in said:
                    self.say(
                        f"straggler on {node}: local rank {key[1]}'s median step "
                        f"{median:.3f} s (scope {key[2]!r}) is {ratio:.2f}x its "
                        "node's other ranks'"
                    )
            for key in sorted(k for k in said if k[0] == node and k not in now):
                self.say(f"straggler on {node}: local rank {key[1]} (scope {key[2]!r}) "
                         "is no longer slower than its node's other ranks")  # fmt: skip
            said -= {k for k in said if k[0] == node}
            said |= now

    def _poll_inprocess(self, statuses: list[dict[str, Any]]) -> None:
        """Say each in-process restart once (see :func:`inprocess_line`), each corrupt
        record once (:func:`corrupt_lines`). Bounded whatever the sidecars report: at
        most :data:`MAX_SAID_PER_POLL` iterations are looked at per poll."""
        docs = inprocess_docs(statuses)
        if not docs:
            return
        seen = self._inproc
        for note in corrupt_lines(docs, seen["corrupt"]):
            self.say(note)
        seen["restarts"] = max(seen["restarts"], *(int(d.get("restarts") or 0) for d in docs))
        newest = max(int(d["iteration"]) for d in docs)
        if newest - seen["said"] > MAX_SAID_PER_POLL:  # a jump no poll could follow
            jumped = newest - MAX_SAID_PER_POLL
            self.say(f"in-process iteration {seen['said']} -> {jumped}: no running sidecar "
                     f"describes the iterations between")  # fmt: skip
            seen["said"], seen["seen_at"], seen["open"] = jumped, None, None
        while seen["said"] < newest:
            iteration = seen["said"] + 1
            since = seen["seen_at"] = seen["seen_at"] or time.monotonic()
            # a later iteration, or a long wait: say this one as it is
            waited_out = newest > iteration or time.monotonic() - since >= INPROCESS_REPORT_WAIT
            line = inprocess_line(docs, iteration, waited_out)
            if line is None and not waited_out:
                return
            if line is not None:
                self.say(line)
            seen["said"], seen["seen_at"] = iteration, None
            # said before every rank stepped again: say so when they do (unless a later
            # restart came first)
            seen["open"] = iteration if line and line.endswith(NOT_YET) else None
        if seen.get("open") is not None:
            if seen["open"] < newest:
                seen["open"] = None
            elif (follow := inprocess_followup(docs, seen["open"])) is not None:
                self.say(follow)
                seen["open"] = None

    def _restarts_text(self, replacements: int) -> str:
        """``restarts: 1 in-process, 0 process, 0 Pod replacements`` (in-process only
        when the job enables it)."""
        inproc = f"{self._inproc['restarts']} in-process, " if self.spec.in_process.enabled else ""
        return f"restarts: {inproc}{self._restarts.said} process, {replacements} Pod replacements"

    def status_line(self, pods: list[Replica], replacing: Container[int]) -> str:
        """The periodic one-line summary (``replacing``: indexes awaiting a replacement)."""
        statuses = [p.status for p in pods if p.status]
        phases = ",".join(
            "replacing" if p.index in replacing else str(p.status.get("phase", "starting"))
            for p in pods
        )
        ages = [
            s["last_progress_age_s"] for s in statuses if s.get("last_progress_age_s") is not None
        ]
        steps = sum(int(s.get("progress_count") or 0) for s in statuses)
        prog = f", {steps} timed steps, last {min(ages):.1f}s ago" if ages else ""
        warm = ""
        if self.spec.warm_start.enabled:
            forked = sum(int(s.get("workers_warm") or 0) for s in statuses)
            warm = f", {forked} warm-started workers"
        etcd = ", etcd unreachable" if self._seen.get("etcd") else ""
        inproc = ""
        if self.spec.in_process.enabled:
            top = self.spec.in_process.max_restarts
            inproc = f", in-process restarts {self._inproc['restarts']}/{top}"
        return (
            f"status: {len(pods)} replicas [{phases}], round {self._seen['round']}, "
            f"restarts {self._restarts.said}/{self.spec.max_restarts}{inproc}{warm}{prog}{etcd}"
        )

    def finish(
        self,
        code: int,
        elapsed: float,
        pods: list[Replica],
        job_failure: str,
        workdir: Path,
        replacements: int = 0,
    ) -> int:
        """Say the sidecars' last word (one more :meth:`poll`, patient, that reads an
        exited sidecar's kept status: what they reported between the loop's last poll
        and the end, e.g. a straggler episode begun in the last steps, is said too),
        then how the job ended (the first cause when it failed) and the restarts per
        rung (``replacements``: Pods replaced); returns ``code``'s exit status (0, 130
        or 1)."""
        self.poll(pods, LAST_WORD_TIMEOUT, last_word=True)
        restarts = self._restarts_text(replacements)
        if code == 0:
            self.say(
                f"job succeeded in {elapsed:.1f}s: round {self._seen['round']}; {restarts}; "
                f"logs in {workdir}"
            )
            return 0
        if code == 130:
            self.say(f"job interrupted after {elapsed:.1f}s; {restarts}; logs in {workdir}")
            return 130
        causes = [f"{p.name}: {p.termination_message()}" for p in pods if p.job_failed()]
        if job_failure:
            causes.insert(0, job_failure)
        for pod in pods:
            text = pod.termination_message()
            if text and pod.launcher.returncode not in (None, 0):
                causes.append(f"{pod.name}: {text}")
        self.say(f"job FAILED after {elapsed:.1f}s; {restarts}; logs in {workdir}")
        for cause in causes[:1] or ["(no termination message; see the sidecar logs)"]:
            self.say(cause)
        return 1
