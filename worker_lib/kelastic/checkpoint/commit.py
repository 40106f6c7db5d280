"""A slot's writes in the order that keeps it whole: dirty, staged, committed; and the
commit of a slot whose writer died after its save returned (:func:`finish_staged`).

A save (:meth:`kelastic.checkpoint.store.CheckpointStore.save`) marks its target slot
dirty (:func:`mark_dirty`: commit word and staged word zeroed), copies the payload and
the manifest into it, then marks it staged (:func:`mark_staged`: the header as staged,
then the staged word; for CUDA tensors once their copies are done) and returns; the
commit (:func:`commit_slot`: chunk checksums, header, commit word last) follows on a
thread. So a SIGKILL, an OOM kill or a SIGTERM between the save's return and the end of
its commit would lose a step the trainer was told was saved: the bytes are all in the
slot (a ``MAP_SHARED`` map of a memory-backed file keeps every write a dead process
made), only their checksums and commit word are missing.

:func:`finish_staged` gives them: whoever next holds the rank's writer lock (the sidecar
before it records the node's steps for a round, while no worker runs; a rank's store at
its open without a sidecar) commits a staged slot when

- its staged word matches its header as staged and this boot (never after a machine's
  restart: a disk-backed folder may hold the word without the payload). A header that
  fails its crc is read as staged (:func:`.slot_format.decode_header_as_staged`): a
  SIGKILL within the dead commit's header copy tears the table crc and the header crc,
  the only fields a commit changes, and the staged word binds every other one (a window
  of a few hundred bytes' copy, found by reading the commit while a fault test failed);
- its step is newer than every step the rank committed: it was the rank's newest save.
  A staged slot of an older step is left over from a history a restore abandoned, and
  its staged word is cleared instead.

The checksums are computed over the bytes as they are then (the writer is dead: nothing
changes them); the commit sequence is the rank's highest + 1, as the writer's own commit
would have made it. Semantics: DLRover's flash checkpoint, where the agent, not the
trainer, makes a staged buffer durable; NVRx's dirty-until-complete files. Stdlib only.
"""

from __future__ import annotations

import functools
import logging
import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from ._slotfile import SLOT_NAME, SLOTS, CheckpointError, SlotFile, lock_rank, slot_path
from .due import mark_due
from .slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    PAGE,
    STAGED_OFFSET,
    SlotFormatError,
    SlotHeader,
    chunk_checksums,
    decode_header,
    decode_header_as_staged,
    decode_staged,
    encode_commit,
    encode_header,
    encode_staged,
    encode_table,
)

__all__ = [
    "Finished",
    "boot_id",
    "commit_slot",
    "finish_slots",
    "finish_staged",
    "mark_dirty",
    "mark_staged",
]

log = logging.getLogger(__name__)

_BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"
_ZEROS: Final = bytes(16)


@functools.cache
def boot_id() -> bytes:
    """The kernel's boot id (``/proc/sys/kernel/random/boot_id``, new at each boot), or
    ``b""`` where it cannot be read (a staged word then binds no boot)."""
    try:
        with open(_BOOT_ID, "rb") as fh:
            return fh.read(64).strip()
    except OSError:
        return b""


def mark_dirty(f: SlotFile) -> None:
    """Zero ``f``'s commit word and staged word (before its payload is rewritten)."""
    f.write(COMMIT_OFFSET, encode_commit(0, 0))
    f.write(STAGED_OFFSET, _ZEROS)
    f.flush(0, PAGE)


def mark_staged(f: SlotFile, header: SlotHeader) -> None:
    """Write ``header`` as staged (chunk table crc 0, commit word zero), then the staged
    word: call it once every payload and manifest byte of the save is in ``f``.

    Raises:
        SlotFormatError: a header field outside the format's bounds.
    """
    raw, crc = encode_header(replace(header, table_crc=0, seq=0, header_crc=0))
    f.write(0, raw)
    f.write(STAGED_OFFSET, encode_staged(header.step, crc, boot_id()))


def commit_slot(f: SlotFile, header: SlotHeader, seq: int) -> None:
    """Commit ``f`` as ``header`` with sequence ``seq``: the payload's chunk checksums
    into the table, the header with the table's crc (commit word still zero), ``msync``,
    then the commit word alone, ``msync`` of its page (the order of
    :mod:`kelastic.checkpoint.store`).

    Raises:
        SlotFormatError: a header field outside the format's bounds.
    """
    lay = header.layout
    assert f.map is not None
    with memoryview(f.map) as view:
        payload = view[lay.payload_offset : lay.payload_offset + lay.payload_len]
        try:
            table = encode_table(chunk_checksums(payload, lay.chunk_size))
        finally:
            payload.release()  # else the map stays exported: it could not be closed
    raw, crc = encode_header(replace(header, table_crc=zlib.crc32(table), seq=0, header_crc=0))
    f.write(HEADER_SIZE, table)
    f.write(0, raw)  # its commit word is zero: still dirty
    f.flush()
    f.write(COMMIT_OFFSET, encode_commit(seq, crc))
    f.flush(0, PAGE)


@dataclass(frozen=True)
class Finished:
    """A staged slot committed by :func:`finish_slots`: its rank, slot index, step and
    the commit sequence it got."""

    rank: int
    slot: int
    step: int
    seq: int


def finish_slots(files: list[SlotFile], rank: int, job: str, *, directory: Path,
                 persist_every: int = 0) -> list[Finished]:  # fmt: skip
    """Commit the staged slot among ``rank``'s slot ``files`` (index = slot) when the
    module doc's rules allow, and clear the staged word of any other uncommitted slot.
    The caller holds the rank's writer lock. A step that is a multiple of
    ``persist_every`` is marked due for persistence (:mod:`.due`) in ``directory``.

    Returns:
        The slot committed (none, or one). A due marker that cannot be written is
        logged (the commit stands, as the writer's own commit does).
    """
    headers: list[SlotHeader | None] = []
    for f in files:
        h = _header(f.read(0, HEADER_SIZE), f.size) if f.map is not None else None
        headers.append(h if h is not None and h.rank == rank and h.job == job else None)
    committed = [h for h in headers if h is not None and h.seq]
    newest_step = max((h.step for h in committed), default=-1)
    top_seq = max((h.seq for h in committed), default=0)
    staged = [(slot, h) for slot, h in enumerate(headers) if h is not None and not h.seq
              and files[slot].read(STAGED_OFFSET, 16) != _ZEROS]  # fmt: skip
    out: list[Finished] = []
    for slot, h in sorted(staged, key=lambda item: -item[1].step):  # the newest first
        f = files[slot]
        if not decode_staged(f.read(STAGED_OFFSET, 16), h, boot_id()):
            continue  # torn, of another header or of another boot: not a staged slot
        if out or h.step <= newest_step:  # a history a restore abandoned
            f.write(STAGED_OFFSET, _ZEROS)
            f.flush(0, PAGE)
            log.info("checkpoint rank %d: slot %d's staged step %d is not newer than its "
                     "committed steps: left uncommitted", rank, slot, h.step)  # fmt: skip
            continue
        commit_slot(f, h, top_seq + 1)
        out.append(Finished(rank, slot, h.step, top_seq + 1))
        log.warning("checkpoint rank %d: step %d was staged by a writer that died before its "
                    "commit: committed now (slot %d)", rank, h.step, slot)  # fmt: skip
        if persist_every and h.step % persist_every == 0:
            try:
                mark_due(directory, rank, slot, h.step)
            except OSError as exc:  # the commit stands; only its persistence is lost
                log.error("checkpoint rank %d: cannot mark step %d due for persistence: %s",
                          rank, h.step, exc)  # fmt: skip
    return out


def _has_staged(folder: Path, rank: int, slots: int, job: str) -> bool:
    """Whether one of ``rank``'s slot files holds an uncommitted slot of ``job`` with a
    staged word (one header read each: the common case takes no lock and maps nothing)."""
    for slot in range(slots):
        try:
            with open(slot_path(folder, rank, slot), "rb") as fh:
                raw = fh.read(HEADER_SIZE)
                size = os.fstat(fh.fileno()).st_size
        except FileNotFoundError:
            continue
        if len(raw) < HEADER_SIZE or raw[STAGED_OFFSET : STAGED_OFFSET + 16] == _ZEROS:
            continue
        h = _header(raw, size)
        if h is not None and not h.seq and h.job == job:
            return True
    return False


def _header(raw: bytes, size: int) -> SlotHeader | None:
    """The slot's header, or as staged when it fails its crc (a commit cut within the
    header's rewrite: :func:`decode_header_as_staged`, never committed; only its staged
    word can vouch for it), or None when it is no header."""
    try:
        return decode_header(raw, file_size=size)
    except SlotFormatError:
        pass
    try:
        return decode_header_as_staged(raw, file_size=size)
    except SlotFormatError:
        return None


def finish_staged(directory: str | os.PathLike[str], job: str, *,
                  persist_every: int = 0) -> list[Finished]:  # fmt: skip
    """:func:`finish_slots` for every rank with slot files of ``job`` in ``directory``
    whose writer lock is free (a rank whose lock a live process holds is left to that
    process; one whose lock file cannot be opened is left as it is, logged). Call it
    before reading the folder's committed steps (the sidecar: while no worker runs), and
    not in a process that holds a writable store of the folder (closing the lock file
    would drop that store's POSIX lock).

    Returns:
        Every slot committed. A missing folder holds none.

    Raises:
        OSError: the folder cannot be listed.
    """
    folder = Path(directory)
    if not folder.is_dir():
        return []
    ranks = sorted({int(m.group(1)) for name in os.listdir(folder)
                    if (m := SLOT_NAME.fullmatch(name)) and int(m.group(2)) < SLOTS})  # fmt: skip
    out: list[Finished] = []
    for rank in ranks:
        if not _has_staged(folder, rank, SLOTS, job):
            continue
        try:
            lock = lock_rank(folder / f"rank-{rank}.lock")
        except CheckpointError:
            continue  # a live writer: its own thread commits
        except OSError as exc:
            log.error("checkpoint rank %d: cannot take its writer lock to commit a staged "
                      "step (%s): left as it is", rank, exc)  # fmt: skip
            continue
        files: list[SlotFile] = []
        try:
            for slot in range(SLOTS):
                path = slot_path(folder, rank, slot)
                if path.exists():
                    files.append(SlotFile(path, writable=True))
            if len(files) == SLOTS:
                out += finish_slots(files, rank, job, directory=folder,
                                    persist_every=persist_every)  # fmt: skip
        except (OSError, SlotFormatError) as exc:
            log.error("checkpoint rank %d: cannot commit its staged step: %s", rank, exc)
        finally:
            for f in files:
                f.close()
            os.close(lock)
    return out
