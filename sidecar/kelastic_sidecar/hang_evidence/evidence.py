"""What a hung rank's stack collection found (plain data), read by the timer server's
reaps and the in-process hard timeout's kill, written by
:class:`~kelastic_sidecar.hang_evidence.collector.StackCollector`; and
:func:`collect_all`, which runs a collector on several pids at once."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kelastic.flight_recorder import Collective

__all__ = ["Collect", "Evidence", "Outcome", "collect_all"]


class Outcome(enum.Enum):
    """How a collection went (the ``outcome`` label of ``kelastic_hang_evidence_total``
    for the stacks, of ``kelastic_flight_records_total`` for an armed worker's record)."""

    #: py-spy read the process's stacks; the worker wrote its flight record.
    COLLECTED = "collected"
    #: no stacks: py-spy missing, failed or too slow, the process gone, collection off;
    #: no record: not written within the budget, or not a record.
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Evidence:
    """The stacks of a hung worker, taken from outside it just before it is killed.

    Attributes:
        pid: the worker's pid.
        outcome: whether stacks were read.
        summary: one line for the reap's reason: ``main thread at <file>:<line> in
            <function>`` (the innermost user frame), or ``stacks unavailable: <why>``.
        path: the file holding the whole dump (or the reason none was taken); None when
            none was written (an earlier dump of the pid is not overwritten by a later
            failure).
        collectives: from the worker's flight record, the newest collective it entered
            per process group (empty: no record; see ``flight``).
        flight: the flight record's path, or why there is none (``""``: not asked, the
            collector has no records directory).
    """

    pid: int
    outcome: Outcome
    summary: str
    path: Path | None = None
    collectives: tuple[Collective, ...] = ()
    flight: str = ""

    def line(self) -> str:
        """The summary with where the dump is, e.g. ``main thread at /w/train.py:42 in
        step (stacks in /run/hang-evidence/rank-3-pid-812.txt)``; the summary alone when
        no stacks were written."""
        if self.path is None or self.outcome is not Outcome.COLLECTED:
            return self.summary
        return f"{self.summary} (stacks in {self.path})"


#: Collects a pid's evidence before it is killed; bounded in time, never raises.
Collect = Callable[[int], Evidence]


def collect_all(collect: Collect, pids: Sequence[int]) -> dict[int, Evidence]:
    """Each of ``pids``' evidence, collected in parallel (threads), so that killing
    several hung workers at once waits one collector's budget, not one per pid."""
    if len(pids) <= 1:
        return {pid: collect(pid) for pid in pids}
    with ThreadPoolExecutor(len(pids), thread_name_prefix="kelastic-evidence") as pool:
        return dict(zip(pids, pool.map(collect, pids), strict=True))
