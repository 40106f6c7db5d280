"""A committed slot written to a folder in torch DCP's format (the sidecar's persistence;
no torch): what ``torch.distributed.checkpoint`` loads without kelastic.

Layout under the job's persistence folder ``root``::

    step-<S>/rank-<R>/.metadata         one DCP checkpoint per rank: dcp.load(template,
    step-<S>/rank-<R>/__0_0.distcp      checkpoint_id=".../step-<S>/rank-<R>")
    step-<S>/rank-<R>/kelastic.json     the slot's job, step, round, rank, world size
    step-<S>/rank-<R>/kelastic-int-keys.json   int mapping keys DCP stores as text, if any
    step-<S>/COMPLETE                   JSON {job, step, world_size, ranks}, written last

Each rank folder also holds ``kelastic.json`` (job, step, round, rank, world size): a
step is complete only when every rank's folder is of one round, and a rank folder of an
older round (a history the job abandoned when it restored an older step and saved this
step number again) is replaced, its step's ``COMPLETE`` removed first: a step on disk is
never mixed from two histories. A temporary folder left by a killed writer of the rank is
removed by its next write (one writer per rank: the sidecar of the rank's node).

One checkpoint per rank, because a slot holds a rank's plain state dict: under DDP every
rank's is the whole model (``rank-0`` is the one to load), with sharded state each rank
holds its own part (no global shapes are known, so no single resharding checkpoint can be
made of them). Each rank folder is written under a temporary name, its files and folder
fsynced, then renamed into place: it is whole or absent. ``COMPLETE`` is written (a
temporary file, fsync, rename) by whichever writer finds every rank of the world there
after its own rename; a reader takes a step only with it (:func:`complete_steps`). A
*replicated* state (``spec.checkpoint.stateLayout: Replicated``: every rank's is the
same) is persisted once, as ``rank-0``, complete with it alone: the world's other ranks
would write N copies of one model to the shared volume (``ranks`` in ``COMPLETE`` says
which folders there are; a rank of any world loads ``rank-0``).

The slot is read from its map as the sidecar's scan reads it (header, table, manifest and
every chunk checked first), its tensors' bytes copied straight from the map into the
archive, and the commit word read again at the end: a save that began over the slot
meanwhile (it zeroes the commit word first) makes the write fail, never a torn
checkpoint. The semantics are DLRover's flash checkpoint (an agent persists the staged
shared memory in the background) and NVRx's local checkpoints (written dirty, then
renamed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kelastic._safejson import load_object

from ._slotfile import SlotFile
from .dcp_format import (
    DcpFormatError,
    RawTensor,
    StoredItem,
    flatten,
    int_key_paths,
    metadata_pickle,
    write_torch_save,
)
from .scan import committed_slots
from .slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    SlotFormatError,
    SlotHeader,
    decode_commit,
    decode_header,
    decode_table_and_manifest,
    verify_chunks,
)
from .store import SLOTS, slot_path
from .tree import build

__all__ = [
    "COMPLETE",
    "DATA_FILE",
    "INT_KEYS",
    "RANK_INFO",
    "PersistError",
    "Persisted",
    "complete_steps",
    "persist",
    "persisted_steps",
    "prune",
]

#: The step folder's marker, written once every rank's folder is in place.
COMPLETE: Final = "COMPLETE"
#: The one data file of a rank's checkpoint (DCP's name for rank 0's first file).
DATA_FILE: Final = "__0_0.distcp"
#: kelastic's record in each rank folder (DCP reads only its own files): the job, step,
#: round, rank, world size and creation time of the slot it was written from.
RANK_INFO: Final = "kelastic.json"
_MAX_INFO: Final = 4096
#: The rank folder's list of int mapping keys DCP stores as text
#: (:func:`~kelastic.checkpoint.dcp_format.int_key_paths`), when the state has any.
INT_KEYS: Final = "kelastic-int-keys.json"
_STEP_DIR: Final = re.compile(r"step-(0|[1-9][0-9]{0,18})")


class PersistError(RuntimeError):
    """The rank's slot of that step could not be persisted: no committed slot of that step
    passes its checks, the slot was rewritten while it was copied, its state is not one
    DCP can name, or the folder could not be written. Nothing is left half-written."""


@dataclass(frozen=True)
class Persisted:
    """One rank's step persisted: its folder, the bytes written, whether this writer
    completed the step (wrote ``COMPLETE``)."""

    path: Path
    nbytes: int
    completed_step: bool


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_of(f: SlotFile, rank: int, job: str, step: int) -> tuple[SlotHeader, Any]:
    """(header, state with :class:`RawTensor` views of the map) of a slot committed for
    ``rank`` of ``job`` at ``step`` whose every check passes."""
    if f.map is None:
        raise SlotFormatError("the slot is shorter than its header")
    h = decode_header(f.read(0, HEADER_SIZE), file_size=f.size)
    if h.rank != rank or h.job != job or not h.seq or h.step != step:
        raise SlotFormatError(f"it holds no committed step {step} of rank {rank}")
    lay = h.layout
    table, manifest = decode_table_and_manifest(f.read, h)
    payload = memoryview(f.map)[lay.payload_offset : lay.payload_offset + lay.payload_len]
    verify_chunks(payload, table, lay.chunk_size)
    tensors = [
        RawTensor(e.dtype, e.shape, payload[e.offset : e.offset + e.nbytes])
        for e in manifest.tensors
    ]
    return h, build(manifest.tree, tensors)


def _close(f: SlotFile) -> None:
    """Close the slot; a view of its map still alive (in a traceback's frame) keeps the
    map, which is unmapped when the view goes."""
    try:
        f.close()
    except BufferError:  # its descriptor is closed; the view keeps the map
        f.map = None


def _write_rank(state: Any, folder: Path, h: SlotHeader) -> int:
    """Write the DCP checkpoint of ``state`` (the slot of header ``h``) and its
    :data:`RANK_INFO` into the new folder ``folder``; the bytes written."""
    if not isinstance(state, dict):
        raise DcpFormatError(f"DCP stores a dict of state; the slot holds a {type(state).__name__}")
    stored: list[StoredItem] = []
    with open(folder / DATA_FILE, "xb") as fh:
        for item in flatten(state):
            offset = fh.tell()
            write_torch_save(item.value, fh)
            stored.append(StoredItem(item, DATA_FILE, offset, fh.tell() - offset))
        fh.flush()
        os.fsync(fh.fileno())
        nbytes = fh.tell()
    meta = metadata_pickle(stored, save_id=str(uuid.uuid4()))
    info = json.dumps({"job": h.job, "step": h.step, "round": h.round, "rank": h.rank,
                       "world_size": h.world_size, "created": h.created}).encode()  # fmt: skip
    files = [(".metadata", meta), (RANK_INFO, info)]
    if keys := int_key_paths(state):
        files.append((INT_KEYS, json.dumps(keys, separators=(",", ":")).encode()))
    for name, data in files:
        with open(folder / name, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    _fsync_dir(folder)
    return nbytes + sum(len(data) for _, data in files)


def _read_doc(path: Path) -> dict[str, Any] | None:
    """One of our small JSON files (:data:`RANK_INFO`, :data:`COMPLETE`), read within
    bounds (the volume is the user's too: a crafted file, e.g. thousands of nested
    brackets, must not raise); None when unreadable or not a bounded JSON object."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_INFO + 1)
        return load_object(raw, str(path), max_bytes=_MAX_INFO, error=ValueError)
    except (OSError, ValueError):
        return None


def _rank_round(folder: Path) -> int | None:
    """The round a persisted rank folder's step was saved in (its :data:`RANK_INFO`);
    None when the folder has none or it does not decode."""
    doc = _read_doc(folder / RANK_INFO)
    value = doc.get("round") if doc is not None else None
    return value if type(value) is int and -1 <= value < 2**63 else None


def _complete(step_dir: Path, job: str, step: int, world_size: int, needed: int) -> bool:
    """Write ``COMPLETE`` when the folders of ranks ``0..needed-1`` (every rank of the
    world; rank 0 alone for a replicated state) are in place, all of one round (one
    history), and it is not there yet."""
    marker = step_dir / COMPLETE
    if marker.exists():
        return False
    rounds = {_rank_round(step_dir / f"rank-{r}") for r in range(needed)}
    if len(rounds) != 1 or None in rounds:
        return False
    body = {"job": job, "step": step, "round": rounds.pop(), "world_size": world_size,
            "ranks": [f"rank-{r}" for r in range(needed)]}  # fmt: skip
    tmp = step_dir / f".{COMPLETE}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    with open(tmp, "x") as fh:
        json.dump(body, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, marker)
    _fsync_dir(step_dir)
    return True


def persist(slots: Path, rank: int, job: str, step: int, root: Path, *,
            replicated: bool = False) -> Persisted:  # fmt: skip
    """Write ``rank``'s committed slot of ``step`` (in the slot folder ``slots``; the
    newest commit of that step when two slots hold it) as a DCP checkpoint at
    ``root/step-<step>/rank-<rank>`` (see the module doc), and ``COMPLETE`` when that
    makes the step whole (with ``replicated``, rank 0's folder alone does). A rank
    folder already there of the same or a newer round is kept as it is; one of an older
    round is replaced.

    Raises:
        PersistError: see the class; its message names the rank, step and cause.
    """
    causes: list[str] = []
    try:  # the newest commit of that step first (an older round's may be there too)
        newest = sorted((c for c in committed_slots(slots, job) if c.rank == rank),
                        key=lambda c: -c.seq)  # fmt: skip
    except OSError:
        newest = []
    order = [c.slot for c in newest if c.step == step]
    for index in [*order, *(i for i in range(SLOTS) if i not in order)]:
        try:
            f = SlotFile(slot_path(slots, rank, index), writable=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise PersistError(f"rank {rank}: slot {index} cannot be read: {exc}") from exc
        try:
            try:
                header, state = _state_of(f, rank, job, step)
            except SlotFormatError as exc:
                causes.append(f"slot {index}: {exc}")
                continue
            needed = 1 if replicated else header.world_size
            return _persist_state(f, header, state, root, index, needed)
        finally:
            _close(f)
    why = "; ".join(causes) or "no slot file"
    raise PersistError(f"rank {rank} holds no committed step {step} that passes its checks ({why})")


def _persist_state(f: SlotFile, h: SlotHeader, state: Any, root: Path, index: int,
                   needed: int) -> Persisted:  # fmt: skip
    step_dir = root / f"step-{h.step}"
    final = step_dir / f"rank-{h.rank}"
    there = _rank_round(final) if final.is_dir() else None
    if there is not None and there >= h.round:  # this history's (or a newer one's) is there
        return Persisted(final, 0, _complete(step_dir, h.job, h.step, h.world_size, needed))
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = step_dir / f".rank-{h.rank}.tmp-{tag}", step_dir / f".rank-{h.rank}.old-{tag}"
    try:
        step_dir.mkdir(parents=True, exist_ok=True)
        for dead in [
            *step_dir.glob(f".rank-{h.rank}.tmp-*"),
            *step_dir.glob(f".rank-{h.rank}.old-*"),
        ]:
            shutil.rmtree(dead, ignore_errors=True)  # a killed writer's: one writer per rank
        tmp.mkdir()
        nbytes = _write_rank(state, tmp, h)
        if decode_commit(f.read(COMMIT_OFFSET, 16), h.header_crc) != h.seq:
            raise PersistError(
                f"rank {h.rank}: slot {index} was rewritten while step {h.step} was written: "
                "not persisted"
            )
        if final.exists():  # an abandoned history's step (an older round): replaced
            (step_dir / COMPLETE).unlink(missing_ok=True)  # never complete across histories
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(step_dir)
    except (OSError, DcpFormatError, SlotFormatError) as exc:
        raise PersistError(f"rank {h.rank}, step {h.step}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return Persisted(final, nbytes, _complete(step_dir, h.job, h.step, h.world_size, needed))


def complete_steps(root: Path) -> list[int]:
    """The steps under ``root`` whose ``COMPLETE`` marker is there, newest first."""
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and (p / COMPLETE).is_file()]  # fmt: skip
    return sorted(steps, reverse=True)


def persisted_steps(root: Path, job: str) -> list[tuple[int, int]]:
    """``(step, world size)`` of ``job``'s complete steps under ``root``, newest first:
    those whose :data:`COMPLETE` names ``job``, the folder's step and a world size in
    1..2^31 - 1. A marker of another job (a folder reused by a new job of that name),
    unreadable or malformed, is passed over.

    Raises:
        OSError: ``root`` cannot be listed.
    """
    out: list[tuple[int, int]] = []
    for step in complete_steps(root):
        doc = _read_doc(root / f"step-{step}" / COMPLETE) or {}
        world = doc.get("world_size")
        if doc.get("job") == job and doc.get("step") == step and type(world) is int \
                and 1 <= world < 2**31:  # fmt: skip
            out.append((step, world))
    return out


def prune(root: Path, keep: int) -> list[Path]:
    """Remove the step folders under ``root`` older than the ``keep``-th newest complete
    step (complete or not: an older incomplete step is never needed once ``keep`` newer
    ones are whole), and leftover temporary folders of those; return what was removed.
    ``keep`` < 1 removes nothing. Removal errors are ignored (another sidecar may prune
    the same folder at once)."""
    complete = complete_steps(root)
    if keep < 1 or len(complete) < keep:
        return []
    oldest_kept = complete[keep - 1]
    removed = []
    for path in sorted(root.iterdir()):
        m = _STEP_DIR.fullmatch(path.name)
        if m and int(m.group(1)) < oldest_kept and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
