"""Steps due for persistence: a marker beside a committed slot that keeps the writer off it
until the sidecar has written it to disk (``spec.checkpoint.persist.everySteps``).

A rank's save of a step that is a multiple of ``everySteps`` leaves, once committed, the
marker ``rank-<R>.slot<I>.due`` (its text: the step). While it is there the writer picks
its target among the other slots; the sidecar persists the marked slot
(:mod:`kelastic.checkpoint.persist`) at its pace and removes the marker. So a due step is
never overwritten before it is persisted, however fast the steps are, and every rank of
the job marks the same steps (a schedule by step number): each due step becomes complete
on disk. The trainer never waits for the disk: if a save finds no slot to write but the
one holding its newest committed step (two due steps pending: the disk is that slow), the
oldest due marker is dropped, logged, and that step is not persisted (DLRover's flash
checkpoint skips a memory save while its buffer persists; here the persistence yields).

Plain functions over the folder: the writer (:class:`~kelastic.checkpoint.store.CheckpointStore`)
and the sidecar (``kelastic_sidecar.persister``) share them. A marker is a tiny file
written under a temporary name and renamed: a reader never sees half of one; a
malformed marker reads as no step and is removed by the sidecar.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kelastic import contract

__all__ = [
    "DueMarker",
    "clear",
    "due_markers",
    "due_slots",
    "every_from_env",
    "mark_due",
    "pick_target",
]

log = logging.getLogger(__name__)

_MARKER: Final = re.compile(r"rank-(0|[1-9][0-9]{0,9})\.slot([0-9])\.due")
#: Longest marker text read (a step is at most 16 digits).
_MAX_TEXT: Final = 32


@dataclass(frozen=True)
class DueMarker:
    """A marker: the rank and slot it names, and the step it says (None: malformed)."""

    path: Path
    rank: int
    slot: int
    step: int | None


def every_from_env() -> int:
    """``$KELASTIC_CHECKPOINT_PERSIST_EVERY`` (set by the operator in the trainer too):
    mark every step that is a multiple of it; 0 when unset or not a step count in
    1..:data:`~kelastic.contract.MAX_PERSIST_EVERY` (logged)."""
    raw = os.environ.get(contract.ENV_CHECKPOINT_PERSIST_EVERY, "").strip()
    if not raw:
        return 0
    if raw.isdigit() and len(raw) <= 10 and 0 <= int(raw) <= contract.MAX_PERSIST_EVERY:
        return int(raw)
    log.warning("$%s=%r is not a step count: no step is marked for persistence",
                contract.ENV_CHECKPOINT_PERSIST_EVERY, raw[:40])  # fmt: skip
    return 0


def marker_path(directory: Path, rank: int, slot: int) -> Path:
    """``<directory>/rank-<rank>.slot<slot>.due``."""
    return directory / f"rank-{rank}.slot{slot}.due"


def mark_due(directory: Path, rank: int, slot: int, step: int) -> None:
    """Mark ``rank``'s ``slot`` (just committed with ``step``) due for persistence.

    Raises:
        OSError: the folder cannot be written.
    """
    final = marker_path(directory, rank, slot)
    tmp = final.with_name(f".{final.name}.{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(str(step))
    os.replace(tmp, final)


def due_slots(directory: Path, rank: int, slots: int) -> list[bool]:
    """For each of ``rank``'s ``slots``, whether a marker is on it."""
    return [marker_path(directory, rank, slot).exists() for slot in range(slots)]


def clear(directory: Path, rank: int, slot: int) -> None:
    """Remove ``rank``'s marker on ``slot`` (none there: nothing happens)."""
    with contextlib.suppress(FileNotFoundError):
        marker_path(directory, rank, slot).unlink()


def due_markers(directory: Path) -> list[DueMarker]:
    """Every marker in ``directory``, by rank and slot; a marker whose text is not a step
    (empty, junk, too long) has ``step`` None. A missing folder holds none.

    Raises:
        OSError: the folder cannot be listed.
    """
    if not directory.is_dir():
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        m = _MARKER.fullmatch(name)
        if m is None:
            continue
        path = directory / name
        try:
            with open(path, "rb") as fh:
                text = fh.read(_MAX_TEXT + 1)
        except FileNotFoundError:  # persisted and cleared meanwhile
            continue
        step = int(text) if text.isdigit() and len(text) <= 16 else None
        out.append(DueMarker(path, int(m.group(1)), int(m.group(2)), step))
    return out


def pick_target(seqs: Sequence[int], due: Sequence[bool]) -> tuple[int, int | None]:
    """The slot a save writes, and the slot whose due marker it must drop (or None).

    ``seqs`` are the slots' commit sequences (0: uncommitted), ``due`` their markers. The
    target is the oldest slot without a marker that does not hold the newest committed
    step; when every such slot is marked, the oldest marked slot that does not hold the
    newest step is dropped from persistence and written (see the module doc).
    """
    newest = max(range(len(seqs)), key=lambda s: seqs[s]) if any(seqs) else None
    order = sorted(range(len(seqs)), key=lambda s: seqs[s])  # oldest first
    for slot in order:
        if not due[slot] and slot != newest:
            return slot, None
    for slot in order:
        if slot != newest:
            return slot, slot
    return order[0], (order[0] if due[order[0]] else None)
