"""What a node tells of its in-process restarts: in ``/status`` the latest (``last``) and
the few before it (``earlier``), each with its cause, the deaths it took in and the
spares it promoted (:class:`RestartHistory`; the abort's reason names the latest
restart's fault); in the metrics the downtime and duration of each (:class:`Downtime`).
Parts of the :class:`~.machine.RestartMachine`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # annotations only
    from ..metrics import SidecarMetrics
    from .record import IterationRecord

__all__ = ["EARLIER_KEPT", "Downtime", "RestartHistory"]

log = logging.getLogger("kelastic_sidecar.inprocess")

#: Restarts described in ``/status`` before the latest (``earlier``), so that a reader
#: polling slower than restarts happen still learns each one's cause.
EARLIER_KEPT: Final = 8


class RestartHistory:
    """The latest in-process restart and the ones before it (loop thread only)."""

    def __init__(self) -> None:
        self._last: dict[str, Any] | None = None
        self._earlier: deque[dict[str, Any]] = deque(maxlen=EARLIER_KEPT)

    def began(self, record: IterationRecord) -> None:
        """A restart into ``record.iteration`` began (its abort was sent)."""
        if self._last is not None:
            self._earlier.append(self._last)
        self._last = {
            "iteration": record.iteration, "restarts": record.restarts, "cause": record.cause,
            "rank": record.rank,
            "node": record.node, "message": record.message, "time": record.time,
            "resumed_s": None,
        }  # fmt: skip

    def revised(self, record: IterationRecord) -> None:
        """The record of the latest restart now names an earlier fault of it (a node whose
        fault came first lost the compare-and-set, then renamed it: see
        :func:`.record.advance_iteration`): take the fault's fields from ``record``. A
        record of another iteration, or not earlier, changes nothing."""
        last = self._last
        if last is None or last["iteration"] != record.iteration or not record.time < last["time"]:
            return
        last.update(cause=record.cause, rank=record.rank, node=record.node,
                    message=record.message, time=record.time)  # fmt: skip

    def note(self, name: str, line: str) -> None:
        """Add ``line`` to the latest restart's list ``name`` (``died``, ``promoted``)."""
        if self._last is not None:
            self._last.setdefault(name, []).append(line)

    def set(self, name: str, value: Any) -> None:
        """Set the latest restart's ``name`` (``signal``, ``resumed_s``)."""
        if self._last is not None:
            self._last[name] = value

    def cause(self) -> str:
        """The latest restart's cause (``""`` before any)."""
        return str((self._last or {}).get("cause", ""))

    def abort_reason(self) -> str:
        """The ``reason`` of an ``abort``: the fault that caused it."""
        last = self._last or {}
        return (f"node {last.get('node')} rank {last.get('rank')}: {last.get('cause')}: "
                f"{last.get('message')}")  # fmt: skip

    def doc(self) -> dict[str, Any]:
        """``/status``'s ``last`` and ``earlier`` (copies)."""
        last = dict(self._last) if self._last else None
        for name in ("died", "promoted"):
            if last and name in last:
                last[name] = list(last[name])
        return {"last": last, "earlier": [dict(x) for x in self._earlier]}


class Downtime:
    """The clock of the restart in flight: from its first abort (no rank runs the
    function) to the ``go`` (``kelastic_downtime_seconds_total``, the goodput clock) and
    to every local rank's progress in the new iteration (the restart's duration,
    ``kelastic_inprocess_restart_seconds``; ``resumed_s`` in ``history``). A part of the
    :class:`~.machine.RestartMachine` (loop thread only).

    Args:
        metrics: the sidecar's metrics.
        clock: monotonic seconds.
        history: where the restart's ``resumed_s`` is told.
    """

    def __init__(
        self, metrics: SidecarMetrics, clock: Callable[[], float], history: RestartHistory
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._history = history
        self._since: float | None = None  # the first abort of the restart in flight
        self._progress: set[int] = set()  # local ranks that progressed since

    def aborted(self) -> None:
        """An abort was sent (the ranks progress again only after it); the first of a
        restart starts the clock."""
        self._progress.clear()
        if self._since is None:
            self._since = self._clock()
            self._metrics.goodput.set_running(False)  # productive again at the go

    def went(self, cause: str) -> None:
        """The ``go``: the time no rank ran the function is downtime, charged to ``cause``."""
        if self._since is not None:
            self._metrics.downtime.labels(cause=cause).inc(self._clock() - self._since)
            self._metrics.goodput.set_running(True)

    def progressed(self, local_rank: int, nproc: int, iteration: int) -> None:
        """``local_rank`` progressed in ``iteration``: when every one of the ``nproc`` did,
        the restart is over."""
        if self._since is None:
            return
        self._progress.add(local_rank)
        if self._progress >= set(range(nproc)):
            took = self._clock() - self._since
            self._since = None
            self._metrics.inprocess_restart.observe(took)
            self._history.set("resumed_s", round(took, 6))
            log.info("in-process restart to iteration %d: every local rank progressed "
                     "%.3fs after the abort", iteration, took)  # fmt: skip

    def forget(self, local_rank: int) -> None:
        """``local_rank`` is gone (dead): it progresses no more."""
        self._progress.discard(local_rank)

    def clear(self) -> None:
        """The round ended: no restart in flight."""
        self._progress.clear()
        self._since = None
