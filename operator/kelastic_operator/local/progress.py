"""What ``kelastic run`` tells its user while the job runs and when it ends.

The sidecars' ``/status`` documents are polled, and what changed is said once: a new
round (its world size), a restart charged (with the root cause the nodes reported), etcd
lost and back; a status line every ``status_interval``; the job's end with its cause.
Nothing here decides anything about the job (:mod:`~kelastic_operator.local.runner` and
:mod:`~kelastic_operator.local.replacement` do).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from ..model import ElasticJob
from .replicas import Replica


def root_cause(failures: list[dict[str, Any]]) -> str:
    """The summary that best explains a restart, from the sidecars' ``last_failure``.

    Among the failures of the latest round: a hung worker that was stopped (its peers'
    timers expire too, while they wait for it), then the earliest.
    """
    if not failures:
        return "see the sidecar logs"
    latest = max(int(f.get("round", -1)) for f in failures)
    pool = [f for f in failures if int(f.get("round", -1)) == latest]
    pool.sort(key=lambda f: (not f.get("stopped"), float(f.get("time") or 0)))
    return str(pool[0].get("summary") or "see the sidecar logs")


def fetch_status(pod: Replica) -> dict[str, Any]:
    """The sidecar's ``/status`` document ({} when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{pod.http_port}/status", timeout=1) as resp:
            doc = json.loads(resp.read())
            return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


class ProgressReporter:
    """Polls the replicas' sidecars and says what changed (round, restarts, etcd).

    Args:
        job: the validated manifest.
        say: prints one line of runner output.
    """

    def __init__(self, job: ElasticJob, say: Callable[[str], None]) -> None:
        self.spec = job.spec
        self.say = say
        self._seen: dict[str, Any] = {"round": None, "spent": 0, "phases": {}}

    def poll(self, pods: list[Replica]) -> None:
        """Fetch each live sidecar's status (into ``pod.status``) and say what changed."""
        for pod in pods:
            if pod.sidecar is not None and pod.sidecar.proc.poll() is None:
                doc = fetch_status(pod)
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
        spent = max(int(s.get("restarts_spent") or 0) for s in statuses)
        running = [
            s for s in statuses if s.get("phase") == "running" and s.get("round") is not None
        ]
        rnd = max(int(s["round"]) for s in running) if running else None
        if spent > self._seen["spent"]:
            # The nodes report their failures within moments of each other: wait until
            # each did (or a new round runs, or a second passed) to name the root cause.
            failures = [s["last_failure"] for s in statuses if s.get("last_failure")]
            latest = max((int(f.get("round", -1)) for f in failures), default=-1)
            each = all(int((s.get("last_failure") or {}).get("round", -2)) == latest
                       for s in statuses)  # fmt: skip
            since = self._seen.setdefault("spent_at", time.monotonic())
            moved_on = rnd is not None and rnd != self._seen["round"]
            if each or moved_on or time.monotonic() - since >= 1.0:
                top = self.spec.max_restarts
                # The failure past the budget is no restart: it fails the job.
                what = f"restart {spent}/{top}" if spent <= top else f"restart budget ({top}) spent"
                self.say(f"{what}: {root_cause(failures)}")
                self._seen["spent"] = spent
                del self._seen["spent_at"]
        if rnd is not None and rnd != self._seen["round"]:
            ws = next(s.get("world_size") for s in running if s["round"] == rnd)
            nodes = next(s.get("group_world_size") for s in running if s["round"] == rnd)
            self._seen["round"] = rnd
            self.say(
                f"round {rnd}: world size {ws} ({nodes} nodes x {self.spec.nproc_per_node}),"
                f" restarts {spent}/{self.spec.max_restarts}"
            )

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
        return (
            f"status: {len(pods)} replicas [{phases}], round {self._seen['round']}, "
            f"restarts {self._seen['spent']}/{self.spec.max_restarts}{warm}{prog}{etcd}"
        )

    def finish(
        self, code: int, elapsed: float, pods: list[Replica], job_failure: str, workdir: Path
    ) -> int:
        """Say how the job ended (the first cause when it failed); returns ``code``'s exit
        status (0, 130 or 1)."""
        if code == 0:
            self.say(
                f"job succeeded in {elapsed:.1f}s: round {self._seen['round']}, "
                f"{self._seen['spent']} restart(s); logs in {workdir}"
            )
            return 0
        if code == 130:
            self.say(f"job interrupted after {elapsed:.1f}s; logs in {workdir}")
            return 130
        causes = [f"{p.name}: {p.termination_message()}" for p in pods if p.job_failed()]
        if job_failure:
            causes.insert(0, job_failure)
        for pod in pods:
            text = pod.termination_message()
            if text and pod.launcher.returncode not in (None, 0):
                causes.append(f"{pod.name}: {text}")
        self.say(f"job FAILED after {elapsed:.1f}s; logs in {workdir}")
        for cause in causes[:1] or ["(no termination message; see the sidecar logs)"]:
            self.say(cause)
        return 1
