"""In-memory checkpoints: ``save(step, state_dict)`` stages a rank's state as raw bytes
in a memory-backed folder and returns; ``load()`` brings back the newest committed step.

Usage in a training script (the same script runs without kelastic: the folder is then
``$KELASTIC_CHECKPOINT_DIR``, e.g. ``/dev/shm/ckpt``)::

    from kelastic import checkpoint

    start = -1
    restored = checkpoint.load()                 # None on a fresh start
    if restored is not None:
        start, state = restored
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    for step in range(start + 1, steps):
        train_step()
        checkpoint.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})

Every rank saves and loads its own slots: its replica of the state under DDP, its part of
sharded state. Loaded tensors are on the CPU (``load_state_dict`` copies them where the
parameters are).

What exists now (the worker library's part): per rank two *slots*, files on
the memory-backed folder :func:`kelastic.contract.checkpoint_dir` (a volume of its own,
``emptyDir`` with ``medium: Memory``); the format (:mod:`.slot_format`: a fixed header
with job, round, rank, step, commit sequence and the chunks' crc32, a bounded JSON
manifest, raw tensor bytes, no pickle); the save (stage, then commit on a thread: the
commit word written last, so a crash never tears the last committed step); the load of
this rank's newest committed step that passes its checksums. What the sidecar will add:
holding the slots (allocated at its start), the commit records in etcd and the job-wide
step (``load(step=...)`` takes the agreed one), replication to a peer, persistence in
torch DCP's format.

The semantics come from DLRover's flash checkpoint (a rank's tensors copied as raw bytes
into shared memory, the save returning once they are staged), NVRx's local checkpointing
(a per-rank file that is dirty until complete, so the previous one is never torn) and
torch DCP (raw tensor bytes described by a metadata record; a per-rank part of sharded
state). An in-process restart (``kelastic.inprocess``) needs no load: the process keeps
its state; a process restart, Pod replacement or new round loads.

Stdlib only at import; torch is imported when a state holds tensors.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from kelastic import contract

from ._handle import SaveHandle
from ._slotfile import CheckpointError, CheckpointSpaceError
from .slot_format import FORMAT_VERSION, SlotFormatError
from .store import CheckpointStore, SlotInfo, slot_bytes
from .tree import TreeError

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointSpaceError",
    "CheckpointStore",
    "SaveHandle",
    "SlotFormatError",
    "SlotInfo",
    "TreeError",
    "default_store",
    "load",
    "open_store",
    "save",
    "slot_bytes",
]

_default: CheckpointStore | None = None
_default_lock = threading.Lock()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise CheckpointError(f"${name}={value!r} is not an integer") from None


def open_store(directory: str | os.PathLike[str] | None = None, *, capacity: int = 0,
               writable: bool = True) -> CheckpointStore:  # fmt: skip
    """This worker's store: the folder (default :func:`kelastic.contract.checkpoint_dir`)
    and identity from torch's env (``RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``,
    ``KELASTIC_ROUND``; rank 0 of job ``""`` without them). See :class:`CheckpointStore`
    for ``capacity`` (bytes per slot, both allocated now) and the errors."""
    folder = Path(directory) if directory is not None else contract.checkpoint_dir()
    return CheckpointStore(
        folder,
        rank=_env_int(contract.RANK, 0),
        job=os.environ.get(contract.TORCHELASTIC_RUN_ID, ""),
        round=_env_int(contract.KELASTIC_ROUND, -1),
        world_size=_env_int(contract.WORLD_SIZE, 0),
        capacity=capacity,
        writable=writable,
    )


def default_store() -> CheckpointStore:
    """The process's store of :func:`save` and :func:`load`, opened on first use by
    :func:`open_store` (its slots sized by the first :func:`save`)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = open_store()
        return _default


_sized = False


def save(step: int, state_dict: Any, *, blocking: bool = False) -> SaveHandle:
    """Stage ``state_dict`` as ``step`` in this rank's slots; returns once the bytes are
    staged (the commit follows on a thread; the next save or load waits for it). The
    first call allocates both slots for this state, plus 1/8 (a folder too small raises
    :class:`CheckpointSpaceError` naming the bytes needed). See
    :meth:`CheckpointStore.save` for the arguments and errors."""
    global _sized
    store = default_store()
    if not _sized:
        capacity = slot_bytes(state_dict)
        store.reserve(capacity + capacity // 8)
        _sized = True
    return store.save(step, state_dict, blocking=blocking)


def load(step: int | None = None) -> tuple[int, Any] | None:
    """``(step, state_dict)`` of this rank's newest committed step that passes its
    checksums (or of ``step``: the job-wide agreed one, once the sidecar agrees on it),
    else None. See :meth:`CheckpointStore.load`."""
    return default_store().load(step)
