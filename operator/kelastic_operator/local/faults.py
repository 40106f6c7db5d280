"""Fault injection for local mode: ``--fault kill:rank=R,after=S`` / ``hang:rank=R,after=S``.

``kill`` sends SIGKILL to the worker with global rank R, S seconds after that rank was
first seen running; ``hang`` sends SIGSTOP instead, so the worker stops inside its
``expires(...)`` block and the sidecar's timer server must reap it. Each fault fires once.
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
        after: seconds after the target was first seen running.
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


class FaultInjector:
    """Fires each fault once from a daemon thread.

    Args:
        faults: what to inject.
        launcher_pids: callable returning the current launcher pids.
        announce: called with a one-line description when a fault fires.
    """

    def __init__(
        self,
        faults: Iterable[Fault],
        launcher_pids: Callable[[], list[int]],
        announce: Callable[[str], None],
    ) -> None:
        self._faults = list(faults)
        self._pids = launcher_pids
        self._announce = announce
        self._stop = threading.Event()
        self.fired: list[tuple[Fault, int]] = []

    def start(self) -> None:
        """Start one thread per fault."""
        for fault in self._faults:
            threading.Thread(target=self._run, args=(fault,), daemon=True).start()

    def stop(self) -> None:
        """Cancel faults that have not fired."""
        self._stop.set()

    def _run(self, fault: Fault) -> None:
        while find_worker(self._pids(), fault.rank) is None:
            if self._stop.wait(0.1):
                return
        if self._stop.wait(fault.after):
            return
        deadline = time.monotonic() + 30.0
        while not self._stop.is_set() and time.monotonic() < deadline:
            proc = find_worker(self._pids(), fault.rank)
            if proc is not None:
                try:
                    os.kill(proc.pid, FAULT_KINDS[fault.kind])
                except ProcessLookupError:
                    continue
                self.fired.append((fault, proc.pid))
                self._announce(f"fault: {fault.describe()} (pid {proc.pid})")
                return
            self._stop.wait(0.1)
