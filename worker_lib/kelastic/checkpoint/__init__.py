"""In-memory checkpoints: ``save(step, state_dict)`` stages a rank's state as raw bytes
in a memory-backed folder and returns; ``load()`` brings back the newest committed step.

Usage in a training script (the same script runs without kelastic: the folder is then
``$KELASTIC_CHECKPOINT_DIR``, e.g. ``/dev/shm/ckpt``)::

    from kelastic import checkpoint

    start = -1
    restored = checkpoint.load(into={"model": model.state_dict(),   # None on a fresh start
                                     "optim": optimizer.state_dict()})
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

What exists now (the worker library's part): per rank three *slots*, files on
the memory-backed folder :func:`kelastic.contract.checkpoint_dir` (a volume of its own,
``emptyDir`` with ``medium: Memory``); the format (:mod:`.slot_format`: a fixed header
with job, round, rank, step, commit sequence and the chunks' crc32, a bounded JSON
manifest, raw tensor bytes, no pickle); the save (stage, then commit on a thread: the
commit word written last, so a crash never tears the last committed step); the load of
this rank's newest committed step that passes its checksums; under the sidecar, the
job-wide step (the sidecars record each node's verified committed steps, and the steps
complete on the job's persistence volume, in etcd before a round and agree on the
highest every rank holds: ``$KELASTIC_CHECKPOINT_STEP`` and ``$KELASTIC_CHECKPOINT_TIER``,
which :func:`load` takes, from memory or from disk), and with replicas a node that lost
its slots gets its ranks' agreed step from a peer node before its workers start (they
load it as their own).

The semantics come from DLRover's flash checkpoint (a rank's tensors copied as raw bytes
into shared memory, the save returning once they are staged), NVRx's local checkpointing
(a per-rank file that is dirty until complete, so the previous one is never torn) and
torch DCP (raw tensor bytes described by a metadata record; a per-rank part of sharded
state). An in-process restart (``kelastic.inprocess``) needs no load: the process keeps
its state; a process restart, Pod replacement or new round loads.

Stdlib only at import; torch is imported when a state holds tensors.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from kelastic import contract

from ._handle import SaveHandle
from ._slotfile import CheckpointError, CheckpointRestoreError, CheckpointSpaceError
from .from_disk import load_persisted, persist_root
from .restored import Restored, write_restored
from .slot_format import FORMAT_VERSION, SlotFormatError
from .store import CheckpointStore, SlotInfo, slot_bytes
from .tree import TreeError

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointRestoreError",
    "CheckpointSpaceError",
    "CheckpointStore",
    "SaveHandle",
    "SlotFormatError",
    "SlotInfo",
    "TreeError",
    "agreed_step",
    "agreed_tier",
    "default_store",
    "load",
    "open_store",
    "save",
    "slot_bytes",
]

log = logging.getLogger(__name__)

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
    first call allocates every slot for this state, plus 1/8 (a folder too small raises
    :class:`CheckpointSpaceError` naming the bytes needed). See
    :meth:`CheckpointStore.save` for the arguments and errors."""
    global _sized
    store = default_store()
    if not _sized:
        capacity = slot_bytes(state_dict)
        store.reserve(capacity + capacity // 8)
        _sized = True
    return store.save(step, state_dict, blocking=blocking)


def agreed_step() -> int | bool | None:
    """The step the job agreed to restore, from ``$KELASTIC_CHECKPOINT_STEP`` (set by the
    sidecar at each start of the workers): an int, None when the job agreed on none
    (``"none"``), False when the variable is unset (no sidecar: each rank its newest).

    Raises:
        CheckpointError: the variable holds something else.
    """
    value = os.environ.get(contract.ENV_CHECKPOINT_STEP)
    if value is None:
        return False
    if value == contract.CHECKPOINT_STEP_NONE:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 16):
        raise CheckpointError(f"${contract.ENV_CHECKPOINT_STEP}={value!r:.40} is not a step")
    return int(value)


def agreed_tier() -> str:
    """Where the job agreed to restore from (``$KELASTIC_CHECKPOINT_TIER``, set by the
    sidecar with the step): :data:`kelastic.contract.CHECKPOINT_TIER_MEMORY` (also when
    unset) or :data:`kelastic.contract.CHECKPOINT_TIER_DISK`.

    Raises:
        CheckpointError: the variable holds something else.
    """
    value = os.environ.get(contract.ENV_CHECKPOINT_TIER) or contract.CHECKPOINT_TIER_MEMORY
    if value not in (contract.CHECKPOINT_TIER_MEMORY, contract.CHECKPOINT_TIER_DISK):
        raise CheckpointError(f"${contract.ENV_CHECKPOINT_TIER}={value!r:.40} is not a tier")
    return value


def load(step: int | None = None, *, into: Any = None) -> tuple[int, Any] | None:
    """``(step, state_dict)`` of the step the job agreed on, else None.

    With ``into`` (say ``{"model": model.state_dict(), "optim": optimizer.state_dict()}``),
    a tensor saved at the same place with the same dtype and shape is read from memory
    straight into the trainer's tensor, checked before it is written (torch DCP's
    in-place load; :meth:`CheckpointStore.load`): one copy instead of a fresh tensor that
    ``load_state_dict`` copies again. The returned state holds those tensors, so calling
    ``load_state_dict`` with it is right either way (a step read from disk returns fresh
    tensors).

    Under kelastic's sidecar the step is the agreed one (:func:`agreed_step`: the highest
    step every rank of the round committed on its node, each slot's checksums verified
    by the sidecar before the workers started, or the newest step every node saw
    complete on the job's persistence volume: :func:`agreed_tier` ``disk``, read with
    torch DCP, :func:`.from_disk.load_persisted`), so the ranks load the same step, or
    all get None (the job agreed on none: the user's own fallback, start or read from
    disk). A rank that cannot load the agreed step raises :class:`CheckpointRestoreError`
    rather than go on without it while its peers load it: its worker fails and the next
    round agrees without that step. Without the sidecar (the variable unset), this rank's
    newest committed step that passes its checksums. ``step`` overrides both (None when
    this rank does not hold it). See :meth:`CheckpointStore.load`.

    Raises:
        CheckpointRestoreError: the agreed step cannot be loaded (the message says why).
        CheckpointError: ``$KELASTIC_CHECKPOINT_STEP`` or ``$KELASTIC_CHECKPOINT_TIER``
            is malformed; the pending commit failed.
        kelastic.checkpoint.tree.TreeError: ``into`` holds a value no slot holds.
    """
    if step is None:
        agreed = agreed_step()
        if agreed is None:
            return None
        if agreed is not False:
            return _load_agreed(agreed, into)
    store = default_store()
    out = store.load(step, into=into)
    if out is None and step is not None:
        log.warning("checkpoint: rank %d does not hold step %d: %s", store.rank, step,
                    _skipped(store))  # fmt: skip
    return out


def _skipped(store: CheckpointStore) -> str:
    """Why each slot was passed over by ``store``'s last load, one line."""
    return "; ".join(f"slot {s}: {why}" for s, why in store.skipped)


def _load_agreed(step: int, into: Any) -> tuple[int, Any]:
    """The agreed ``step`` from the agreed tier, or :class:`CheckpointRestoreError`;
    the load recorded for the sidecar (:mod:`.restored`)."""
    rank, tier = _env_int(contract.RANK, 0), agreed_tier()
    started = time.monotonic()
    if tier == contract.CHECKPOINT_TIER_DISK:
        layout = os.environ.get(contract.ENV_CHECKPOINT_LAYOUT)
        replicated = layout == contract.StateLayout.REPLICATED
        out = load_persisted(step, rank, persist_root(), replicated=replicated)
    else:
        store = default_store()
        got = store.load(step, into=into)
        if got is None:
            raise CheckpointRestoreError(
                f"rank {rank} cannot load the agreed checkpoint step {step} from memory "
                f"({_skipped(store) or 'no slot holds it'}); the next round agrees on a step "
                "without it"
            )
        out = got
    took = time.monotonic() - started
    round_ = _env_int(contract.KELASTIC_ROUND, -1)
    if round_ >= 0:
        try:
            write_restored(contract.checkpoint_dir(), Restored(rank, round_, step, tier, took))
        except (OSError, ValueError) as exc:  # the report only: the load stands
            log.warning("checkpoint: rank %d cannot record its load for the sidecar: %s",
                        rank, exc)  # fmt: skip
    return out
