"""The slot files the replication reads and writes, by their headers only: a slot's
header and commit word, the committed slot of a (rank, step) a server holds, and which of
a rank's two replica slots a new replica replaces; and a node's own snapshot of one of
its committed slots among its replicas (:func:`snapshot`).

Headers only, never the payload's checksums (that costs a CPU of a training node per
transfer): whoever uses a replica verifies it in full first
(:func:`kelastic.checkpoint.scan.verified_step`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import BinaryIO, Final

from kelastic.checkpoint.slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    SlotFormatError,
    SlotHeader,
    decode_commit,
    decode_header,
)
from kelastic.checkpoint.store import SLOTS

__all__ = [
    "REPLICA_DIR_NAME",
    "REPLICA_SLOTS",
    "commit_unchanged",
    "find_committed",
    "read_header",
    "replica_target",
    "slot_name",
    "snapshot",
]

log = logging.getLogger("kelastic_sidecar.replica")

#: The folder of the replicas a server received, in its node's checkpoint folder.
REPLICA_DIR_NAME: Final = "replicas"
#: Replica slots kept per source rank (its newest two steps received).
REPLICA_SLOTS: Final = 2
_COMMIT_BYTES: Final = 16


def slot_name(rank: int, slot: int) -> str:
    """``rank-<rank>.slot<slot>``: the worker library's slot name
    (:data:`kelastic.checkpoint.store.SLOT_NAME`), replicas included."""
    return f"rank-{rank}.slot{slot}"


def read_header(fd: int) -> SlotHeader:
    """The header of the slot file open at ``fd`` (its ``seq`` 0 when not committed),
    checked against the file's size.

    Raises:
        SlotFormatError: not a slot's header, or one outside the file.
        OSError: the file cannot be read.
    """
    raw = os.pread(fd, HEADER_SIZE, 0)
    return decode_header(raw, file_size=os.fstat(fd).st_size)


def commit_unchanged(fd: int, header: SlotHeader) -> bool:
    """Whether the slot open at ``fd`` is still committed as ``header`` says (no writer
    began over it since ``header`` was read: its sequence only grows).

    Raises:
        OSError: the file cannot be read.
    """
    raw = os.pread(fd, _COMMIT_BYTES, COMMIT_OFFSET)
    return len(raw) == _COMMIT_BYTES and decode_commit(raw, header.header_crc) == header.seq != 0


def _committed(path: Path, job: str, rank: int) -> tuple[BinaryIO, SlotHeader] | None:
    """The slot at ``path`` open for reading with its header, when it is a committed slot
    of ``rank`` of ``job``; else None (missing, unreadable, undecodable: logged at debug)."""
    try:
        file = open(path, "rb")  # noqa: SIM115  (returned open)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            log.debug("replica: cannot open %s: %s", path, exc)
        return None
    try:
        header = read_header(file.fileno())
    except (OSError, SlotFormatError) as exc:
        log.debug("replica: %s is not counted: %s", path, exc)
        file.close()
        return None
    if not header.seq or header.job != job or header.rank != rank:
        file.close()
        return None
    return file, header


def find_committed(
    folders: tuple[Path, ...], job: str, rank: int, step: int
) -> tuple[BinaryIO, SlotHeader] | None:
    """A committed slot of (``rank``, ``step``) of ``job`` in the first of ``folders``
    that holds one (the highest sequence there), open for reading with its header;
    None when none holds it. The caller closes the file."""
    for folder in folders:
        best: tuple[BinaryIO, SlotHeader] | None = None
        for slot in range(SLOTS):
            found = _committed(folder / slot_name(rank, slot), job, rank)
            if found is None:
                continue
            if found[1].step != step or (best is not None and best[1].seq >= found[1].seq):
                found[0].close()
                continue
            if best is not None:
                best[0].close()
            best = found
        if best is not None:
            return best
    return None


def replica_target(folder: Path, job: str, rank: int, step: int) -> Path:
    """Which of ``rank``'s :data:`REPLICA_SLOTS` replica slots in ``folder`` a replica
    of ``step`` replaces: the first that holds no committed slot of this job and rank
    (missing, undecodable, dirty), else one that holds ``step`` already (the two keep
    distinct steps), else the one of the lower step (the newest other one is kept)."""
    held: list[tuple[int, int, int]] = []  # (step, seq, slot)
    for slot in range(REPLICA_SLOTS):
        found = _committed(folder / slot_name(rank, slot), job, rank)
        if found is None:
            return folder / slot_name(rank, slot)
        found[0].close()
        header = found[1]
        if header.step == step:
            return folder / slot_name(rank, slot)
        held.append((header.step, header.seq, slot))
    return folder / slot_name(rank, min(held)[2])


def _copy(src: int, dst: int, size: int) -> None:
    """``size`` bytes from ``src`` to ``dst`` in the kernel (``copy_file_range``; a file
    system that refuses it: ``sendfile``).

    Raises:
        OSError: a copy failed or ended early.
    """
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, size - done, done, done)
        except OSError:
            n = os.sendfile(dst, src, done, size - done)
        if n <= 0:
            raise OSError(f"the slot ended after {done} of {size} bytes")
        done += n


def snapshot(source: Path, folder: Path, job: str, rank: int, step: int) -> Path | None:
    """Copy the committed slot at ``source`` (``rank``'s ``step`` of ``job``) into the
    replica slots of ``folder`` (:func:`replica_target`; its used bytes only, copied in the
    kernel, under a hidden name renamed when whole): a copy the trainer's later saves
    cannot overwrite. Returns where it went, or None when the slot is no longer that
    committed step (a save began over it before or during the copy: the copy is dropped).

    Raises:
        OSError: ``folder`` cannot be written (no space, ...).
    """
    found = _committed(source, job, rank)
    if found is None:
        return None
    file, header = found
    with file:
        if header.step != step:
            return None
        tmp = folder / f".rank-{rank}.incoming-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        placed = False
        try:
            _copy(file.fileno(), fd, header.layout.file_size)
            if not commit_unchanged(file.fileno(), header):  # a writer began over it
                return None
            target = replica_target(folder, job, rank, step)
            os.replace(tmp, target)
            placed = True
            return target
        finally:
            os.close(fd)
            if not placed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
