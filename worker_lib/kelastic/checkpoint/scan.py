"""What a slot folder holds: each rank's committed steps that pass every checksum (the
sidecar's view of its node's slots, recorded in etcd; no torch, nothing written).

A slot counts when its header decodes, belongs to the job and rank its name says, its
commit word is set, and its checksum table, manifest and every payload chunk match,
with the commit word unchanged after the check (a writer that began over it meanwhile
is caught). So the step a job agrees on is one every rank can read back: a corrupt slot
drops its step from the record here, before any rank loads, and the job agrees on an
older step or on none (never on a step some rank cannot load).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ._slotfile import SlotFile
from .slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    SlotFormatError,
    decode_commit,
    decode_header,
    decode_table_and_manifest,
    verify_chunks,
)
from .store import SLOT_NAME, SLOTS

__all__ = ["CommittedSlot", "committed_slots", "verified_step", "verified_steps"]

log = logging.getLogger(__name__)

#: Most threads checking slots at once (``zlib.crc32`` releases the GIL per call).
_MAX_THREADS: Final = 8


def verified_step(path: Path, rank: int, job: str) -> tuple[int, int] | None:
    """``(commit sequence, step)`` of the slot file at ``path`` when it is committed for
    ``rank`` of ``job`` and passes every checksum, else None (logged at debug level).

    Raises:
        OSError: the file cannot be opened or mapped (other than missing).
    """
    try:
        f = SlotFile(path, writable=False)
    except FileNotFoundError:
        return None
    try:
        if f.map is None:
            return None
        h = decode_header(f.read(0, HEADER_SIZE), file_size=f.size)
        if h.rank != rank or h.job != job or not h.seq:
            return None
        lay = h.layout
        table, _manifest = decode_table_and_manifest(f.read, h)
        with memoryview(f.map) as view:
            payload = view[lay.payload_offset : lay.payload_offset + lay.payload_len]
            try:
                verify_chunks(payload, table, lay.chunk_size)
            finally:
                payload.release()
        if decode_commit(f.read(COMMIT_OFFSET, 16), h.header_crc) != h.seq:
            raise SlotFormatError("the slot was rewritten while it was checked")
        return h.seq, h.step
    except SlotFormatError as exc:
        log.debug("%s: not counted: %s", path, exc)
        return None
    finally:
        f.close()


def verified_steps(directory: str | os.PathLike[str], job: str) -> dict[int, tuple[int, ...]]:
    """Global rank -> its verified committed steps, highest first (at most :data:`SLOTS`,
    distinct), for every rank with a slot file of ``job`` in ``directory``; a rank with
    none is left out. A missing folder holds nothing. The slots are checked on up to
    :data:`_MAX_THREADS` threads (one per CPU).

    Raises:
        OSError: a slot file cannot be read (other than missing).
    """
    folder = Path(directory)
    if not folder.is_dir():
        return {}
    ranks = sorted({int(m.group(1)) for name in os.listdir(folder)
                    if (m := SLOT_NAME.fullmatch(name))})  # fmt: skip
    pairs = [(rank, slot) for rank in ranks for slot in range(SLOTS)]
    workers = max(1, min(len(pairs), os.cpu_count() or 1, _MAX_THREADS))
    with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-scan") as pool:  # crc32 frees the GIL
        checked = list(pool.map(lambda p: verified_step(folder / f"rank-{p[0]}.slot{p[1]}",
                                                        p[0], job), pairs))  # fmt: skip
    out: dict[int, tuple[int, ...]] = {}
    for index, rank in enumerate(ranks):
        found = checked[SLOTS * index : SLOTS * (index + 1)]
        steps: list[int] = []
        for _seq, step in sorted((x for x in found if x is not None), reverse=True):
            if step not in steps:
                steps.append(step)
        if steps:
            out[rank] = tuple(sorted(steps, reverse=True))
    return out


@dataclass(frozen=True)
class CommittedSlot:
    """A slot whose header decodes and whose commit word is set (nothing else checked):
    the cheap view of what a folder holds, for deciding what to persist. ``slot`` is the
    slot's index (0..:data:`SLOTS` - 1)."""

    rank: int
    slot: int
    step: int
    round: int
    world_size: int
    seq: int


def committed_slots(directory: str | os.PathLike[str], job: str) -> list[CommittedSlot]:
    """Every committed slot of ``job`` in ``directory`` by its header and commit word only
    (one 4 KiB read each: cheap enough to poll every second); a slot that does not decode,
    of another job, or uncommitted is left out, as is a missing folder. Whoever acts on a
    slot checks it in full then (:func:`kelastic.checkpoint.persist.persist` does).

    Raises:
        OSError: the folder or a slot file cannot be read (other than missing).
    """
    folder = Path(directory)
    if not folder.is_dir():
        return []
    out: list[CommittedSlot] = []
    for name in sorted(os.listdir(folder)):
        m = SLOT_NAME.fullmatch(name)
        if m is None or int(m.group(2)) >= SLOTS:
            continue
        try:
            with open(folder / name, "rb") as fh:
                raw = fh.read(HEADER_SIZE)
                size = os.fstat(fh.fileno()).st_size
        except FileNotFoundError:
            continue
        if len(raw) < HEADER_SIZE:
            continue
        try:
            h = decode_header(raw, file_size=size)
            seq = decode_commit(raw[COMMIT_OFFSET : COMMIT_OFFSET + 16], h.header_crc)
        except SlotFormatError:
            continue
        if seq and h.job == job and h.rank == int(m.group(1)):
            out.append(CommittedSlot(h.rank, int(m.group(2)), h.step, h.round, h.world_size, seq))
    return out
