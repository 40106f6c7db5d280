"""Failure records: what went wrong in a round, in a form that survives JSON and reads well.

A :class:`Failure` is built from the launcher's ``exited`` message (plus the timer
server's reap, which turns a signal death into a hang), or from a lost peer node. It is
charged to the restart budget, stored as a node's report in etcd, shown by local mode, and
its :meth:`Failure.summary` is the root cause written to the trainer's termination message.
:class:`FailureCause` is :mod:`kelastic.failure_policy`'s (the failure rules name it).
"""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from kelastic.failure_policy import FailureCause

__all__ = [
    "CAUSE_HANG",
    "CAUSE_NODE_LOST",
    "CAUSE_OOM",
    "CAUSE_PEER",
    "CAUSE_SCALE",
    "CAUSE_START_FAILURE",
    "CAUSE_WORKER_FAILURE",
    "NOT_STARTED_EXIT_CODES",
    "Failure",
    "FailureCause",
    "signal_name",
]


CAUSE_WORKER_FAILURE: Final = FailureCause.WORKER_FAILURE
CAUSE_HANG: Final = FailureCause.HANG
CAUSE_NODE_LOST: Final = FailureCause.NODE_LOST
CAUSE_START_FAILURE: Final = FailureCause.START_FAILURE
CAUSE_OOM: Final = FailureCause.OOM
CAUSE_SCALE: Final = FailureCause.SCALE
CAUSE_PEER: Final = FailureCause.PEER
#: Worker exit codes that mean "the program could not be run" (POSIX shells, execvp).
NOT_STARTED_EXIT_CODES = frozenset({126, 127})


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for numbers without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class Failure:
    """One failure of a round.

    Attributes:
        cause: a :class:`FailureCause` (its string value is turned into one).
        node: the node (Pod) where it happened.
        round: the rendezvous round that failed.
        rank, local_rank: the worker's global and local rank, None for a node loss.
        exitcode: the worker's exit code, None when killed by a signal.
        signal: the signal number that killed it, None otherwise.
        message: the exception message from the worker's error file, or a description.
        tail: last lines of the worker's stderr (most recent last).
        time: Unix time (seconds) it was observed.
        stopped: a hung worker that was stopped (SIGSTOP, a debugger) when it was
            reaped: it held its peers up, whose timers expire too while they wait for
            it in a collective; the better root cause of a round's hangs.
    """

    cause: FailureCause
    node: str
    round: int
    rank: int | None = None
    local_rank: int | None = None
    exitcode: int | None = None
    signal: int | None = None
    message: str = ""
    tail: tuple[str, ...] = field(default_factory=tuple)
    time: float = field(default_factory=time.time)
    stopped: bool = False

    def __post_init__(self) -> None:
        """Raises ValueError: ``cause`` is no :class:`FailureCause` value."""
        object.__setattr__(self, "cause", FailureCause(self.cause))

    def summary(self) -> str:
        """One line naming the cause, e.g.
        ``hang: rank 1 on digits-0 (round 2) killed by SIGKILL: timer 'train_step' expired``.
        """
        who = f"rank {self.rank}" if self.rank is not None else "node"
        how = ""
        if self.signal is not None:
            how = f" killed by {signal_name(self.signal)}"
        elif self.exitcode is not None:
            how = f" exited with code {self.exitcode}"
        text = f"{self.cause}: {who} on {self.node} (round {self.round}){how}"
        return f"{text}: {self.message}" if self.message else text

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the inverse of :meth:`from_dict`)."""
        d = asdict(self)
        d["tail"] = list(self.tail)
        d["summary"] = self.summary()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Failure:
        """Rebuild from :meth:`as_dict` output; unknown keys are ignored.

        Raises:
            KeyError, TypeError: required fields (cause, node, round) are missing.
            ValueError: ``cause`` is no :class:`FailureCause` value.
        """
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        known["tail"] = tuple(str(x) for x in known.get("tail") or ())
        return cls(**known)

    def details(self) -> str:
        """Multi-line text for the termination message: summary plus the stderr tail."""
        lines = [self.summary()]
        if self.tail:
            lines.append("last lines of stderr:")
            lines.extend(f"  {line}" for line in self.tail[-10:])
        return "\n".join(lines)
