"""Fault injection for local mode: ``--fault KIND:rank=R,after=S``, KIND one of
``kill``, ``hang``, ``raise``.

``kill`` sends SIGKILL to the worker with global rank R; ``hang`` sends SIGSTOP, so the
worker stops inside its ``expires(...)`` block and the sidecar's timer server must reap it;
``raise`` sends SIGUSR1, which ``kelastic.inprocess.Wrapper`` turns into an exception
raised inside the wrapped training function when ``KELASTIC_INJECT_RAISE=1`` is in the
worker's env (local mode sets it on the trainer when a ``raise`` fault is given, see
:func:`arm_raise`): with in-process restart on, the function restarts in the same
processes; without, the worker fails and the group restarts. A worker that installed no
such handler dies of the signal.

Faults fire once each, one after another in the order given. A fault's clock starts when
its target is *training*: the worker with rank R runs and its node has seen a timed step
(an ``expires`` acquire) in an attempt (or an in-process iteration of one) started after
the previous fault fired. So ``after=S`` means "S seconds into training", whatever
start-up costs on this machine.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import psutil

from kelastic import contract

from ..model import ElasticJob, trainer_container

#: Fault kind -> the signal sent to the target worker.
FAULT_KINDS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "raise": signal.SIGUSR1}
_USAGE = ", ".join(f"{k}:rank=R,after=S" for k in list(FAULT_KINDS)[:-1]) + (
    f" or {list(FAULT_KINDS)[-1]}:rank=R,after=S"
)


@dataclass(frozen=True)
class Fault:
    """One fault to inject.

    Attributes:
        kind: ``kill`` (SIGKILL), ``hang`` (SIGSTOP) or ``raise`` (SIGUSR1: an exception
            in the wrapped function, see the module doc).
        rank: global rank (``RANK``) of the target worker.
        after: seconds after the target started training (see the module doc).
    """

    kind: str
    rank: int
    after: float

    @classmethod
    def parse(cls, text: str) -> Fault:
        """Parse ``kind:rank=R,after=S`` (``after`` in seconds, default 0).

        Raises:
            ValueError: with the accepted syntax, every kind, in the message.
        """
        usage = f"bad --fault {text!r}: expected {_USAGE}"
        kind, sep, rest = text.partition(":")
        if kind not in FAULT_KINDS or not sep:
            raise ValueError(usage)
        fields: dict[str, str] = {}
        for part in rest.split(","):
            key, eq, value = part.partition("=")
            if not eq or key.strip() not in ("rank", "after") or key.strip() in fields:
                raise ValueError(usage)
            fields[key.strip()] = value.strip()
        try:
            rank = int(fields.get("rank", ""))
            after = float(fields.get("after", "0"))
        except ValueError:
            raise ValueError(usage) from None
        if rank < 0 or not 0 <= after < 1e6:
            raise ValueError(f"{usage} (rank >= 0, after >= 0 seconds)")
        return cls(kind, rank, after)

    def describe(self) -> str:
        """``SIGKILL rank 1 after 8s``."""
        return f"{FAULT_KINDS[self.kind].name} rank {self.rank} after {self.after:g}s"


def arm_raise(job: ElasticJob, faults: Iterable[Fault]) -> ElasticJob:
    """The job with ``KELASTIC_INJECT_RAISE=1`` in its trainer's env when a ``raise`` fault
    is among ``faults`` (the launcher's workers inherit it), else ``job`` itself.

    Args:
        job: the validated manifest (not modified).
        faults: the faults to inject.

    Returns:
        An ElasticJob whose template's trainer container has the variable set (an entry
        of that name already there is replaced).
    """
    if not any(f.kind == "raise" for f in faults):
        return job
    template = copy.deepcopy(job.spec.template)
    trainer = trainer_container(template)
    env = [
        e
        for e in trainer.get("env") or []
        if not isinstance(e, dict) or e.get("name") != contract.ENV_INJECT_RAISE
    ]
    trainer["env"] = [*env, {"name": contract.ENV_INJECT_RAISE, "value": "1"}]
    spec = job.spec.model_copy(update={"template": template})
    return job.model_copy(update={"spec": spec})


def find_worker(roots: Iterable[int], rank: int, hint: int | None = None) -> psutil.Process | None:
    """Return the running worker process with env ``RANK=rank`` among the children of
    ``roots`` (launcher pids), or None. A spare worker (``KELASTIC_INPROCESS_SPARE=1`` in
    its env) is never taken by its env: a waiting one is no rank, and a promoted one's
    process env still says its spare identity; it is taken when it is ``hint``, the pid
    its sidecar names for ``rank`` (``/status`` ``inprocess.spares.pids``)."""
    for root in roots:
        try:
            children = psutil.Process(root).children()
        except psutil.Error:
            continue
        for child in children:
            try:
                env = child.environ()
                spare = env.get(contract.ENV_INPROCESS_SPARE) == "1"
                if (child.pid == hint if spare else env.get("RANK") == str(rank)) and (
                    child.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)
                ):
                    return child
            except psutil.Error:
                continue
    return None


#: Where a node is in its course: its attempt (process restarts), or ``(attempt,
#: in-process iteration)``; a later one compares greater (a bare attempt is ``(attempt, 0)``).
Progress = int | tuple[int, int]
#: ``training(rank)`` answers ``(node, progress)`` once the node running ``rank`` has seen
#: a timed step in its current attempt, else None.
TrainingProbe = Callable[[int], "tuple[str, Progress] | None"]


def _mark(progress: Progress) -> tuple[int, int]:
    return (progress, 0) if isinstance(progress, int) else progress


class FaultInjector:
    """Fires the faults in order from one daemon thread.

    Args:
        faults: what to inject, in order.
        launcher_pids: callable returning the current launcher pids.
        training: see :data:`TrainingProbe`.
        attempts: callable returning each node's current :data:`Progress`.
        announce: called with a one-line description when a fault fires.
        spare_pids: callable returning global rank -> pid of the spare workers promoted
            to a rank (see :func:`find_worker`).
    """

    def __init__(
        self,
        faults: Iterable[Fault],
        launcher_pids: Callable[[], list[int]],
        training: TrainingProbe,
        attempts: Callable[[], Mapping[str, Progress]],
        announce: Callable[[str], None],
        spare_pids: Callable[[], Mapping[int, int]] = dict,
    ) -> None:
        self._faults = list(faults)
        self._spare_pids = spare_pids
        self._pids = launcher_pids
        self._training = training
        self._attempts = attempts
        self._announce = announce
        self._stop = threading.Event()
        self.fired: list[tuple[Fault, int]] = []

    def start(self) -> None:
        """Start firing."""
        if self._faults:
            threading.Thread(target=self._run, name="faults", daemon=True).start()

    def stop(self) -> None:
        """Cancel faults that have not fired."""
        self._stop.set()

    def _run(self) -> None:
        floor: dict[str, tuple[int, int]] = {}  # node -> where a previous fault saw it
        for fault in self._faults:
            while True:
                seen = self._training(fault.rank)
                if seen is not None and _mark(seen[1]) > floor.get(seen[0], (0, 0)):
                    break
                if self._stop.wait(0.1):
                    return
            if self._stop.wait(fault.after):
                return
            if not self._fire(fault):
                return
            floor = {node: _mark(p) for node, p in self._attempts().items()}

    def _fire(self, fault: Fault) -> bool:
        deadline = time.monotonic() + 60.0
        while not self._stop.is_set() and time.monotonic() < deadline:
            proc = find_worker(self._pids(), fault.rank, self._spare_pids().get(fault.rank))
            if proc is not None:
                try:
                    os.kill(proc.pid, FAULT_KINDS[fault.kind])
                except ProcessLookupError:
                    continue
                self.fired.append((fault, proc.pid))
                self._announce(f"fault: {fault.describe()} (pid {proc.pid})")
                return True
            self._stop.wait(0.1)
        return False
