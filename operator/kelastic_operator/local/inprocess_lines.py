"""What ``kelastic run`` says of in-process restarts, read from the sidecars' ``/status``
documents (their ``inprocess`` part): one line per restart, named by its rung, with the
fault, the workers it started again and how long until every rank stepped again
(:func:`inprocess_line`), the follow-up of a line said before that
(:func:`inprocess_followup`), and the corrupt records the sidecars refused
(:func:`corrupt_lines`). Pure: :class:`~kelastic_operator.local.progress.ProgressReporter`
polls and says them.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kelastic.inprocess_record import MAX_ITERATION, RecordError, RestartCause, record_from_mapping

__all__ = ["NOT_YET", "corrupt_lines", "inprocess_docs", "inprocess_followup", "inprocess_line"]

#: Longest fault message shown in an in-process restart line (characters, first line).
MESSAGE_MAX = 200
#: Most ``earlier`` restarts read of a sidecar's status.
EARLIER_READ = 8
#: How a restart's line ends when said before every rank stepped again.
NOT_YET = "not every rank is stepping again yet"


def _iteration(value: object) -> int | None:
    """An iteration within the shared codec's bounds (:mod:`kelastic.inprocess_record`),
    else None."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ITERATION
    return value if ok else None  # type: ignore[return-value]


def inprocess_docs(statuses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sidecars' ``inprocess`` sections that are there and enabled (an older sidecar
    has none; a disabled one reports None) and whose ``iteration`` is within the shared
    codec's bounds (a sidecar reports nothing else: the record's readers all refuse more)."""
    docs = (s.get("inprocess") for s in statuses)
    return [
        d
        for d in docs
        if isinstance(d, dict) and d.get("enabled") and _iteration(d.get("iteration")) is not None
    ]


def _described(value: object, iteration: int) -> bool:
    """``value`` is a sidecar's description of the restart into ``iteration``, valid as
    the record's fields are (:func:`kelastic.inprocess_record.record_from_mapping`)."""
    if not isinstance(value, dict) or value.get("iteration") != iteration:
        return False
    try:
        record_from_mapping(value, "in-process restart", complete=False)
    except RecordError:
        return False
    return True


def restart_records(docs: list[dict[str, Any]], iteration: int) -> list[dict[str, Any]]:
    """Each node's description of the restart into ``iteration``: its ``last``, or one
    of the ``earlier`` ones (a later restart came before this poll)."""
    found: list[dict[str, Any]] = []
    for d in docs:
        earlier = d.get("earlier")
        pool = [d.get("last"), *(earlier[-EARLIER_READ:] if isinstance(earlier, list) else [])]
        found.extend(x for x in pool[: 1 + EARLIER_READ] if _described(x, iteration))
    return found


def _fault_time(last: dict[str, Any]) -> float:
    """A restart record's fault time (seconds; ``inf`` when a sidecar did not say)."""
    t = last.get("time")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else math.inf


def inprocess_line(docs: list[dict[str, Any]], iteration: int, waited_out: bool) -> str | None:
    """The line for the in-process restart into ``iteration``, or None to wait for more.

    ``in-process restart 1/10 (iteration 1): rank 1 exception: InjectedFault: ...;
    stepping again after 0.21s``: the budget as the nodes count it, the fault from the
    ``last`` record (or an ``earlier`` one), and the slowest node's seconds from the abort
    until each of its ranks stepped again. It waits until every node that took part
    reports that figure, unless ``waited_out`` (the line then says the ranks are not
    stepping yet). Dead ranks a spare replaced are named before that (``local rank 1
    replaced by the spare of slot 2 (pid 77, no process start)``). No running sidecar
    describes it (its node died, or a corrupt record was replaced by it,
    :func:`corrupt_lines`): None once ``waited_out``, as nothing true can be said of it.

    Args:
        docs: see :func:`inprocess_docs`.
        iteration: the iteration the restart went into.
        waited_out: say it now, whatever is missing.
    """
    lasts = restart_records(docs, iteration)
    if not lasts:
        return None
    resumed = [last.get("resumed_s") for last in lasts]
    # Every node reached the iteration; those that took part (not a node that joined with
    # fresh workers in it: the node-change rung) say when their ranks stepped again.
    behind = [d for d in docs if int(d["iteration"]) < iteration]
    done = not behind and all(isinstance(r, (int, float)) for r in resumed)
    if not done and not waited_out:
        return None
    # the earliest fault names it: a node's view may be a later one, renamed since
    last = min(lasts, key=_fault_time)
    restarts = max((int(d.get("restarts") or 0) for d in docs), default=0)
    top = max(int(d.get("max_restarts") or 0) for d in docs)
    message = str(last.get("message") or "").strip().splitlines()
    text = message[0] if message else ""
    text = text if len(text) <= MESSAGE_MAX else text[: MESSAGE_MAX - 3] + "..."
    rank = last.get("rank")
    who = f"rank {rank} " if isinstance(rank, int) and rank >= 0 else ""
    cause = f"{who}{last.get('cause') or 'fault'}" + (f": {text}" if text else "")
    if done:
        took = max(float(r) for r in resumed if isinstance(r, (int, float)))
        after = f"stepping again after {took:.2f}s"
    else:
        after = NOT_YET
    spared = [str(p) for x in lasts for p in x.get("promoted") or [] if isinstance(p, str)]
    if spared:  # spare ranks: "local rank 1 replaced by the spare of slot 2 (pid .., no ...)"
        after = "; ".join([*spared, after])
    if done:  # deaths that joined it (a hung rank killed meanwhile); else the follow-up's
        after = "; ".join([*_started_again(lasts, skip=message[0] if message else ""), after])
    if last.get("cause") == RestartCause.MEMBERSHIP:  # no restart spent
        return f"in-process round change (iteration {iteration}): {text}; {after}"
    count = last.get("restarts") if isinstance(last.get("restarts"), int) else restarts
    return f"in-process restart {count}/{top} (iteration {iteration}): {cause}; {after}"


def corrupt_lines(docs: list[dict[str, Any]], said: set[int]) -> list[str]:
    """One line per corrupt in-process record the sidecars refused (``inprocess.corrupt``:
    its etcd revision, the codec's error, the iteration that replaced it), each revision
    once: ``said`` holds those said already and is updated."""
    lines = []
    for d in docs:
        bad = d.get("corrupt")
        rev = bad.get("revision") if isinstance(bad, dict) else None
        if not isinstance(rev, int) or rev in said:
            continue
        said.add(rev)
        error = str(bad.get("error") or "")[:MESSAGE_MAX]  # type: ignore[union-attr]
        fix = bad.get("replaced_by")  # type: ignore[union-attr]
        then = (f"replaced by iteration {fix}" if _iteration(fix) is not None
                else "refused; the next fault replaces it")  # fmt: skip
        lines.append(f"corrupt in-process record in etcd ({error}): {then}")
    return lines


def _started_again(lasts: list[dict[str, Any]], skip: str = "") -> list[str]:
    """The workers whose death a restart took (each node's ``died``, 16 at most per
    node), e.g. ``local rank 1 (pid 77) killed by SIGKILL: ... (started again as a
    process)``; one a spare replaced (named in its node's ``promoted``) says no more than
    its death; one named in ``skip`` (the death that made the restart) is left out."""
    said = []
    for last in lasts:
        spared = " ".join(str(p) for p in last.get("promoted") or [])
        for death in (last.get("died") or [])[:16]:
            text = str(death)[:MESSAGE_MAX]
            if skip and text in skip:
                continue
            local = re.match(r"local rank \d+ ", text)
            by_spare = local is not None and f"{local[0]}replaced by" in spared
            said.append(text if by_spare else f"{text} (started again as a process)")
    return said


def inprocess_followup(docs: list[dict[str, Any]], iteration: int) -> str | None:
    """The line that ends a restart said before every rank stepped again (see
    :func:`inprocess_line`'s ``waited_out``), once they all do: the workers that died
    meanwhile and were started again (a hung rank reaped after the timer server's grace,
    or killed at the hard timeout: the hybrid rung) and the seconds from the abort, e.g.
    ``in-process restart (iteration 3): local rank 1 (pid 77) killed by SIGKILL: ...
    (started again as a process); every rank stepping again after 31.20s``. None while
    not every rank steps again."""
    lasts = restart_records(docs, iteration)
    resumed = [last.get("resumed_s") for last in lasts]
    behind = [d for d in docs if int(d["iteration"]) < iteration]
    if not lasts or behind or not all(isinstance(r, (int, float)) for r in resumed):
        return None
    took = max(float(r) for r in resumed if isinstance(r, (int, float)))
    died = _started_again(lasts)
    head = "; ".join(died) + "; " if died else ""
    return (
        f"in-process restart (iteration {iteration}): {head}every rank stepping again "
        f"after {took:.2f}s"
    )
