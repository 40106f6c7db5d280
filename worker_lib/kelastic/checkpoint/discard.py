"""Dropping the steps a restore abandoned: after the job agreed to restore step ``S``,
the slots of steps newer than ``S`` hold a future the job will never have, and the
training that goes on from ``S`` saves steps with the same numbers. Kept, a later
agreement could pick step ``S + 1`` from the abandoned run on one rank and from the
new one on another: a mixed restore. :func:`discard_newer` marks them uncommitted
(their commit word and staged word zeroed, as a save does before it stages; a staged
slot of such a step too, which :func:`kelastic.checkpoint.commit.finish_staged` could
otherwise commit later), so every slot left committed belongs to one history. When the
job agreed on no step, every slot is dropped: the training starts from elsewhere (the
user's own checkpoint, or anew).

The sidecar calls it for its node's slot folder before it starts a round's workers (no
writer runs then: the previous workers are stopped), whether or not the training
script calls ``load()``. Stdlib only; the slot's header decoded by its one codec.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    STAGED_OFFSET,
    SlotFormatError,
    decode_header,
    encode_commit,
)
from .store import SLOT_NAME

__all__ = ["discard_newer"]

log = logging.getLogger(__name__)


def discard_newer(directory: str | os.PathLike[str], job: str,
                  step: int | None) -> list[tuple[int, int]]:  # fmt: skip
    """Mark every committed slot of ``job`` in ``directory`` whose step is newer than
    ``step`` (every committed slot of ``job`` when ``step`` is None) uncommitted. Call it
    while no worker writes the slots.

    Returns:
        ``(rank, step)`` of each committed slot dropped (a staged one is cleared too,
        not listed). Slots of another job, uncommitted and unstaged, or not slots at all
        (a header that does not decode) are left as they are.

    Raises:
        OSError: a slot file cannot be opened or written (a missing folder holds none).
    """
    folder = Path(directory)
    if not folder.is_dir():
        return []
    dropped: list[tuple[int, int]] = []
    for name in sorted(os.listdir(folder)):
        if not SLOT_NAME.fullmatch(name):
            continue
        fd = os.open(folder / name, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            try:
                header = decode_header(os.pread(fd, HEADER_SIZE, 0), file_size=size)
            except SlotFormatError:
                continue
            newer = step is None or header.step > step
            staged = os.pread(fd, 16, STAGED_OFFSET) != bytes(16)
            if header.job != job or not (header.seq or staged) or not newer:
                continue
            os.pwrite(fd, encode_commit(0, 0), COMMIT_OFFSET)
            os.pwrite(fd, bytes(16), STAGED_OFFSET)
            os.fdatasync(fd)  # a disk-backed folder: on disk before the workers start
            if header.seq:
                dropped.append((header.rank, header.step))
        finally:
            os.close(fd)
    if dropped:
        log.info("checkpoint: dropped steps newer than %s: %s", step, dropped)
    return dropped
