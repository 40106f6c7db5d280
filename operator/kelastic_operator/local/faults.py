"""Fault injection for local mode: ``--fault kill:rank=R,after=S`` / ``hang:rank=R,after=S``.

``kill`` sends SIGKILL to the worker with global rank R; ``hang`` sends SIGSTOP, so the
worker stops inside its ``expires(...)`` block and the sidecar's timer server must reap it.

Faults fire once each, one after another in the order given. A fault's clock starts when
its target is *training*: the worker with rank R runs and its node has seen a timed step
(an ``expires`` acquire) in an attempt started after the previous fault fired. So
``after=S`` means "S seconds into training", whatever start-up costs on this machine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

FAULT_KINDS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    """One fault to inject.

    Attributes:
        kind: ``kill`` (SIGKILL) or ``hang`` (SIGSTOP).
        rank: global rank (``RANK``) of the target worker.
        after: seconds after the target started training (see the module doc).
    """

    kind: str
    rank: int
    after: float

    @classmethod
    def parse(cls, text: str) -> Fault:
        """Parse ``kind:rank=R,after=S``.

        Raises:
            ValueError: with the accepted syntax in the message.
        """
        usage = f"bad --fault {text!r}: expected kill:rank=R,after=S or hang:rank=R,after=S"
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


def find_worker(roots: Iterable[int], rank: int) -> psutil.Process | None:
    """Return the running worker process with env ``RANK=rank`` among the children of
    ``roots`` (launcher pids), or None."""
    for root in roots:
        try:
            children = psutil.Process(root).children()
        except psutil.Error:
            continue
        for child in children:
            try:
                if child.environ().get("RANK") == str(rank) and child.status() not in (
                    psutil.STATUS_ZOMBIE,
                    psutil.STATUS_STOPPED,
                ):
                    return child
            except psutil.Error:
                continue
    return None


#: ``training(rank)`` answers ``(node, attempt)`` once the node running ``rank`` has seen a
#: timed step in its current attempt, else None.
TrainingProbe = Callable[[int], "tuple[str, int] | None"]


class FaultInjector:
    """Fires the faults in order from one daemon thread.

    Args:
        faults: what to inject, in order.
        launcher_pids: callable returning the current launcher pids.
        training: see :data:`TrainingProbe`.
        attempts: callable returning each node's current attempt number.
        announce: called with a one-line description when a fault fires.
    """

    def __init__(
        self,
        faults: Iterable[Fault],
        launcher_pids: Callable[[], list[int]],
        training: TrainingProbe,
        attempts: Callable[[], dict[str, int]],
        announce: Callable[[str], None],
    ) -> None:
        self._faults = list(faults)
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
        floor: dict[str, int] = {}  # node -> last attempt a previous fault saw
        for fault in self._faults:
            while True:
                seen = self._training(fault.rank)
                if seen is not None and seen[1] > floor.get(seen[0], 0):
                    break
                if self._stop.wait(0.1):
                    return
            if self._stop.wait(fault.after):
                return
            if not self._fire(fault):
                return
            floor = self._attempts()

    def _fire(self, fault: Fault) -> bool:
        deadline = time.monotonic() + 60.0
        while not self._stop.is_set() and time.monotonic() < deadline:
            proc = find_worker(self._pids(), fault.rank)
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
