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
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

from ._slotfile import SlotFile
from .slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    SlotFormatError,
    decode_commit,
    decode_header,
    decode_manifest,
    verify_chunks,
)

__all__ = ["verified_step", "verified_steps"]

log = logging.getLogger(__name__)

#: Most threads checking slots at once (``zlib.crc32`` releases the GIL per call).
_MAX_THREADS: Final = 8
_SLOT_NAME: Final = re.compile(r"rank-(0|[1-9][0-9]{0,9})\.slot([01])")


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
        table = f.read(HEADER_SIZE, 4 * lay.chunk_count)
        if zlib.crc32(table) != h.table_crc:
            raise SlotFormatError("the checksum table fails its crc32")
        manifest = f.read(lay.manifest_offset, lay.manifest_len)
        if zlib.crc32(manifest) != h.manifest_crc:
            raise SlotFormatError("the manifest fails its crc32")
        decode_manifest(manifest, payload_len=lay.payload_len)
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
    """Global rank -> its verified committed steps, highest first (at most two,
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
                    if (m := _SLOT_NAME.fullmatch(name))})  # fmt: skip
    pairs = [(rank, slot) for rank in ranks for slot in (0, 1)]
    workers = max(1, min(len(pairs), os.cpu_count() or 1, _MAX_THREADS))
    with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-scan") as pool:  # crc32 frees the GIL
        checked = list(pool.map(lambda p: verified_step(folder / f"rank-{p[0]}.slot{p[1]}",
                                                        p[0], job), pairs))  # fmt: skip
    out: dict[int, tuple[int, ...]] = {}
    for index, rank in enumerate(ranks):
        found = checked[2 * index : 2 * index + 2]
        steps: list[int] = []
        for _seq, step in sorted((x for x in found if x is not None), reverse=True):
            if step not in steps:
                steps.append(step)
        if steps:
            out[rank] = tuple(sorted(steps, reverse=True))
    return out
