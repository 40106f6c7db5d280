"""The hybrid rung of in-process restart, decided (pure: no etcd, no sockets, no threads).

The restart ladder: a worker *process* dies (SIGKILL, segfault, OOM, a timer-server
reap, the coordinator's own hard-timeout kill) while in-process restart is on -> the
survivors restart in process, and only the dead local rank is started again as a process
(forked from the warm-start zygote when that is on) in the same iteration. NVIDIA's
in-process restart (``nvidia_resiliency_ext.inprocess``) has no such rung: there a
dead rank ends the wrapper's job (its monitor process reports it) and the launcher restarts
everything.

:func:`absorb_verdict` says whether one node's coordinator can take such an exit in its
round (:class:`Absorb`); :func:`death_cause` and :func:`death_message` describe it for the
iteration record, ``/status`` and the log (``kelastic run`` prints the log).
:class:`~kelastic_sidecar.inprocess.hybrid.RespawnRung` acts on them. Table-tested in
``tests/sidecar/test_inprocess_hybrid.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import replace
from typing import Final

from kelastic.inprocess_record import RestartCause

from ..failure import CAUSE_HANG, CAUSE_START_FAILURE, CAUSE_WORKER_FAILURE, Failure, signal_name
from .verdict import Verdict

__all__ = [
    "CAUSE_WORKER_DIED",
    "RESPAWN_NOTE",
    "Absorb",
    "AbsorbVerdict",
    "absorb_verdict",
    "death_cause",
    "death_message",
    "respawn_failure",
]

#: The iteration record's ``cause`` for a worker process that died (a reap or the
#: coordinator's hard-timeout kill is ``hang``). ``kelastic_restarts_total{level=
#: "inprocess"}`` counts it as ``worker_failure``
#: (:func:`~kelastic_sidecar.inprocess.round.cause_label`): the dashboards' cause set
#: stays the process restarts' one.
CAUSE_WORKER_DIED: Final = RestartCause.WORKER_DIED


#: What the iteration record's ``message`` adds to a death taken by this rung (the
#: restart's description: ``kelastic run`` and the job's status show it).
RESPAWN_NOTE: Final = "it alone starts again as a process"


class Absorb(enum.Enum):
    """What a node's coordinator does with a worker's non-zero exit."""

    #: The round runs in process: move the record ``n -> n + 1`` (compare-and-set, within
    #: the in-process budget), abort every rank, start the dead rank again at the ``go``.
    ADVANCE = "advance"
    #: An in-process restart is in flight (abort or termination barrier): the dead rank
    #: joins it (no restart more is spent) and starts again at its ``go``.
    JOIN = "join"
    #: Not this rung: the round ends on the process path, as without in-process restart.
    REFUSE = "refuse"


#: The outcome of :func:`absorb_verdict`.
AbsorbVerdict = Verdict[Absorb]


def absorb_verdict(
    *,
    phase: str,
    nproc: int,
    local_rank: int,
    connected: Collection[int],
    pending: Collection[int],
    starting: Collection[int],
) -> AbsorbVerdict:
    """Whether a node can take the death of its worker ``local_rank`` in process.

    Args:
        phase: the coordinator's phase (``idle``, ``running``, ``aborting``, ``barrier``,
            ``failed``: :mod:`~kelastic_sidecar.inprocess.machine`).
        nproc: local ranks of the round (0 when there is no round).
        local_rank: the worker that exited non-zero.
        connected: local ranks with a session (said ``hello``) now, the dead one's
            included when its connection has not been seen to end yet.
        pending: local ranks already dead and waiting for the ``go`` to start again.
        starting: local ranks started again that have not said ``hello`` yet.

    Refused (the process path): no round or in-process restarts failed in it; a local
    rank outside the round; a rank that died again before its ``hello`` (its respawn
    failed: starting it once more would likely fail the same way); another local rank
    that never said ``hello`` (not wrapped by :class:`kelastic.inprocess.Wrapper`: it would
    never pass the termination barrier). ``running``: :attr:`Absorb.ADVANCE`;
    ``aborting``/``barrier``: :attr:`Absorb.JOIN`.
    """
    if phase in ("idle", "failed") or nproc <= 0:
        why = "no round" if phase == "idle" or nproc <= 0 else "in-process restarts failed"
        return AbsorbVerdict(Absorb.REFUSE, why)
    if not 0 <= local_rank < nproc:
        return AbsorbVerdict(Absorb.REFUSE, f"local rank {local_rank} not in 0..{nproc - 1}")
    if local_rank in starting:
        return AbsorbVerdict(Absorb.REFUSE, "it died again before its hello (respawn failed)")
    others = set(range(nproc)) - {local_rank} - set(pending) - set(starting)
    silent = sorted(others - set(connected))
    if silent:
        return AbsorbVerdict(
            Absorb.REFUSE,
            f"local rank(s) {', '.join(map(str, silent))} never said hello (not wrapped?)",
        )
    if phase == "running":
        return AbsorbVerdict(Absorb.ADVANCE)
    if phase in ("aborting", "barrier"):
        return AbsorbVerdict(Absorb.JOIN)
    return AbsorbVerdict(Absorb.REFUSE, f"unknown phase {phase!r}")


def death_cause(failure: Failure) -> RestartCause:
    """The iteration record's ``cause`` for a dead worker: ``hang`` when it was reaped
    (``failure.cause`` is :data:`~kelastic_sidecar.failure.CAUSE_HANG`: the supervisor's
    monitor held a reap of its pid, by the timer server or by the coordinator's hard
    timeout); else :data:`CAUSE_WORKER_DIED`."""
    return RestartCause.HANG if failure.cause == CAUSE_HANG else CAUSE_WORKER_DIED


def death_message(failure: Failure, pid: int | None) -> str:
    """One line naming the dead worker and how it died, e.g. ``local rank 1 (pid 4242)
    killed by SIGKILL``, ``local rank 0 (pid 77) exited with code 1: ValueError: x`` or,
    reaped, ``local rank 1 (pid 9) killed by SIGKILL: timer 'step' expired; reaped by the
    timer server`` (the reap's words, from the failure's message)."""
    who = f"local rank {failure.local_rank} (pid {pid if pid is not None else '?'})"
    if failure.signal is not None:
        how = f"killed by {signal_name(failure.signal)}"
    else:
        how = f"exited with code {failure.exitcode}"
    return f"{who} {how}" + (f": {failure.message}" if failure.message else "")


def respawn_failure(failure: Failure) -> Failure:
    """How the process path sees the exit of a worker *started again* by this rung:
    one that could not even be started (``start_failure``, which fails the job at once:
    :func:`~kelastic_sidecar.round_end.classify_exit`) is a ``worker_failure`` here, since
    the same command started in this attempt: a process restart of the group follows
    (a failed respawn takes the process path). Other failures are unchanged."""
    if failure.cause != CAUSE_START_FAILURE:
        return failure
    text = f"could not be started again after its death: {failure.message}".rstrip(": ")
    return replace(failure, cause=CAUSE_WORKER_FAILURE, message=text)
