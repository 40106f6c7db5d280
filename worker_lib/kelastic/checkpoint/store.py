"""A rank's :data:`SLOTS` checkpoint slots: save into the oldest, load the newest.

Why three and not two: a save returns once staged and commits on a thread, and the next
save waits for that commit. In lockstep (DDP: a rank stages step ``n + 1`` only after
every rank staged ``n``), a kill can find one rank with ``n + 1`` committed and a slower
one with ``n - 1`` only (killed while it staged ``n``). With two slots the faster rank
has overwritten ``n - 1`` by then and the ranks share no step (a whole restore lost);
with three, every rank still holds ``n - 1`` (tests/faults/test_checkpoint_kills.py:
hundreds of random kills, the ranks always share the step the rules allow).

**Save** (:meth:`CheckpointStore.save`), in this order:

1. pick the *target*: the slot with the lowest commit sequence (the oldest; never the
   last committed one; never one due for persistence, :mod:`.due`); grow it if the
   state no longer fits (allocated and touched, see ``_slotfile``);
2. mark it dirty: zero its commit word and staged word, ``msync`` the header page
   (:func:`.commit.mark_dirty`);
3. stage: copy every tensor's bytes into the slot's map (``Tensor.copy_`` into a view of
   it), write the manifest, then the header as staged and the staged word
   (:func:`.commit.mark_staged`; for CUDA tensors the commit's thread does it once their
   copies are done); **save returns here** (unless ``blocking``);
4. commit, on a thread of the store (``zlib.crc32`` releases the GIL on each 4 MiB
   chunk, so the trainer's thread keeps running: DLRover's agent does this part in
   another process; :func:`.commit.commit_slot`): the chunk checksums into the table,
   the header (its crc over every field, the commit word still zero), ``msync`` of the
   whole slot (on a disk-backed folder the bytes reach the disk before the commit; on
   tmpfs it returns at once), then the commit word (sequence = the highest slot's + 1,
   checked by a crc that binds it to this header), ``msync`` of the header page.

A crash anywhere before the staged word leaves the target dirty or failing its
checksums, and the other slots, the last two committed steps, untouched: a crash never
tears them (NVRx's dirty-then-rename, with a commit word instead of a rename: the slot's
pages stay where they are, allocated). A crash after the staged word (the save returned,
its commit had not ended) loses nothing: the next holder of the rank's lock commits it
(:func:`.commit.finish_staged`: the sidecar before it records the node's steps; this
store at its open). The next save waits for the previous commit (the slot it would
write is the one being committed). The writes are to a ``MAP_SHARED`` map: they are in
the file the moment they are made, so a SIGKILLed process loses nothing it wrote.

**Load** (:meth:`CheckpointStore.load`): the rank's committed slots, newest first (or
the one of the agreed step); each is checked (header crc and bounds, table and manifest
crc, every payload chunk's crc while it is copied out, the commit word unchanged after
the copy: a writer that started over the slot meanwhile is caught) and the first that
passes is returned; a corrupted slot falls back to an older one, else ``None``.

One writer per rank (a POSIX lock on the rank's lock file); readers take no lock. A slot
is per rank whatever the parallelism: with DDP every rank saves its copy of the
replicated state, with sharded state each rank its own part (torch DCP's per-rank
files); resharding for another world size is not done here.

Over ~400 lines because this doc is the save and load protocol step by step and the one
class implements exactly it; the format, the tensors' copies, the files and the due
markers are modules of their own.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ._cuda import Pinning, copies_done, is_cuda, wait_copies
from ._handle import Committer, SaveHandle
from ._slotfile import SLOT_NAME as SLOT_NAME
from ._slotfile import SLOTS as SLOTS
from ._slotfile import CheckpointError, SlotFile, free_bytes, lock_rank, space_error
from ._slotfile import slot_path as slot_path
from ._tensors import (
    entries,
    is_tensor,
    read_into,
    read_verified,
    stage,
    targets_for,
    tensors_from,
)
from .commit import commit_slot, finish_slots, mark_dirty, mark_staged
from .due import clear, due_slots, every_from_env, mark_due, pick_target
from .slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    SlotFormatError,
    SlotHeader,
    chunk_crcs,
    decode_commit,
    decode_header,
    decode_table_and_manifest,
    encode_header,
    encode_manifest,
    layout,
)
from .tree import build, flatten, pair_tensors

_log = logging.getLogger(__name__)

#: Spare room a slot gets when a save grows it (of the save's size), so that a state
#: that grows a little (an optimizer's first step) does not grow the slot every save.
_GROW_HEADROOM: Final = 8
_MIB: Final = 1 << 20


def slot_bytes(state_dict: Any) -> int:
    """Bytes one slot needs for ``state_dict`` (header, table, payload, manifest): pass
    it as :class:`CheckpointStore`'s ``capacity`` to allocate the slots at open.

    Raises:
        kelastic.checkpoint.tree.TreeError: the state holds something no slot holds.
    """
    tree, tensors = flatten(state_dict, is_tensor)
    items, payload_len = entries(tensors)
    return layout(payload_len, len(encode_manifest(items, tree))).file_size


@dataclass(frozen=True)
class SlotInfo:
    """A committed slot as its header says (checksums not verified: :meth:`load` does)."""

    slot: int
    seq: int
    step: int
    round: int
    rank: int
    world_size: int
    job: str
    created: float
    payload_bytes: int


class CheckpointStore:
    """The :data:`SLOTS` slots of one rank in ``directory``.

    Args:
        directory: a memory-backed folder (:func:`kelastic.contract.checkpoint_dir`;
            anywhere locally); it must exist.
        rank: the global rank whose slots these are (torch's ``RANK``).
        job: the job's id (torch's ``TORCHELASTIC_RUN_ID``): a slot of another job is
            never loaded. At most 256 UTF-8 bytes.
        round: the rendezvous round saves are made in (``KELASTIC_ROUND``; -1 unknown).
        world_size: ``WORLD_SIZE`` (0 unknown), recorded in each save.
        capacity: bytes per slot (:func:`slot_bytes`) to allocate and touch now, every
            slot; 0 allocates at the first save. A save that outgrows a slot grows it.
        writable: False opens the slots read only, for :meth:`load` and :meth:`slots`
            (no lock, nothing created).
        persist_every: mark each committed step that is a multiple of it due for the
            sidecar's persistence (:mod:`kelastic.checkpoint.due`: the writer keeps off
            that slot until it is persisted); None reads
            ``$KELASTIC_CHECKPOINT_PERSIST_EVERY``, 0 marks none.

    Raises:
        CheckpointSpaceError: the folder cannot hold the slots of ``capacity`` bytes
            (the message names the bytes needed and free).
        CheckpointError: another live process writes this rank's slots.
        FileNotFoundError: ``directory`` does not exist.
    """

    def __init__(self, directory: str | os.PathLike[str], *, rank: int = 0, job: str = "",
                 round: int = -1, world_size: int = 0, capacity: int = 0,
                 writable: bool = True, persist_every: int | None = None) -> None:  # fmt: skip
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint folder {self.directory} does not exist")
        self.rank, self.job, self.round, self.world_size = rank, job, round, world_size
        self.writable = writable
        self.persist_every = every_from_env() if persist_every is None else persist_every
        #: why each slot passed over by the last load was (slot, reason), for logs
        self.skipped: list[tuple[int, str]] = []
        self._pending: SaveHandle | None = None
        self._committer = Committer()
        self._lock_fd = lock_rank(self.directory / f"rank-{rank}.lock") if writable else -1
        # a store dropped unclosed releases its lock when collected (its slots: SlotFile)
        self._unlock = weakref.finalize(self, os.close, self._lock_fd) if writable else None
        self._files: list[SlotFile] = []
        self._pinning = Pinning()  # slot maps locked for CUDA copies (none until one)
        try:
            for slot in range(SLOTS):
                path = slot_path(self.directory, rank, slot)
                if writable or path.exists():
                    self._files.append(SlotFile(path, writable))
            if len(self._files) < SLOTS:  # a reader of slots never written
                for f in self._files:
                    f.close()
                self._files = []
            if writable:  # a save its dead writer returned from (the module doc)
                finish_slots(self._files, rank, job, directory=self.directory,
                             persist_every=self.persist_every)  # fmt: skip
            self._seqs = []
            for slot in range(len(self._files)):
                header = self._header(slot)[0]
                self._seqs.append(header.seq if header is not None else 0)
            for slot, seq in enumerate(self._seqs):  # a marker on no committed step is stale
                if writable and not seq:
                    clear(self.directory, rank, slot)
            if capacity > 0 and writable:
                self.reserve(capacity)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state_dict: Any, *, blocking: bool = False) -> SaveHandle:
        """Stage ``state_dict`` as step ``step`` and return once its bytes are staged.

        Args:
            step: the training step, 0..2**53.
            state_dict: tensors (CPU or CUDA) in dicts, lists and tuples with plain
                values, as torch's ``state_dict()`` and ``optimizer.state_dict()``;
                non-contiguous, empty and 0-dim tensors are stored contiguous. CPU
                tensors are copied before this returns: the trainer may change them at
                once. CUDA tensors' copies are queued on each device's current stream
                into the slot (page-locked for the device when the driver allows:
                :mod:`._cuda`) and the commit waits for them: a later kernel on that
                stream may change them at once; one on another stream must wait for the
                handle. (The GPU path is unmeasured: no GPU machine has run it yet.)
            blocking: commit before returning (else on the store's thread).

        Returns:
            The save's handle: :meth:`SaveHandle.wait` returns once it is committed.

        Raises:
            kelastic.checkpoint.tree.TreeError: a value no slot holds (the path named).
            SlotFormatError: ``step`` outside 0..2**53, a manifest over 64 MiB.
            CheckpointSpaceError: the slot had to grow and the folder cannot give it.
            CheckpointError: the previous save's commit failed (raised once; that step
                is not committed), or the store is read only or closed.
        """
        if not self.writable or not self._files:
            raise CheckpointError("this store is read only or closed")
        self.wait()
        tree, tensors = flatten(state_dict, is_tensor)
        items, payload_len = entries(tensors)
        manifest = encode_manifest(items, tree)
        lay = layout(payload_len, len(manifest))
        header = SlotHeader(step, self.round, self.rank, self.world_size, self.job, time.time(),
                            lay, 0, zlib.crc32(manifest))  # fmt: skip
        encode_header(header)  # its bounds, before the slot is touched
        target = self._target()
        f = self._files[target]
        if f.size < lay.file_size:
            size = -(-(lay.file_size + lay.file_size // _GROW_HEADROOM) // _MIB) * _MIB
            self._reserve([size - f.size], f"{f.path.name} of {size} bytes")
            f.grow(size)
        mark_dirty(f)
        self._seqs[target] = 0
        assert f.map is not None
        if any(is_cuda(t) for t in tensors):  # one DMA into the slot where it can be locked
            f.before_unmap = self._pinning.unpin
            self._pinning.pin(f.map)
        stage(f.map, lay.payload_offset, items, tensors)
        copies = copies_done(tensors)
        f.write(lay.manifest_offset, manifest)
        if not copies:  # every byte is in the slot (CUDA copies: once they are done)
            mark_staged(f, header)
        handle = SaveHandle(step, target)
        if blocking:
            self._commit(target, header, copies)
        else:
            # pending before its thread starts: an exception raised into this thread
            # meanwhile (an in-process abort) must not hide a commit that runs
            self._pending = handle
            handle._start(lambda: self._commit(target, header, copies), self._committer)
        return handle

    def _target(self) -> int:
        """The oldest slot, off those due for persistence (:func:`pick_target`); its
        marker, if any, is removed before it is written."""
        if not self.persist_every:
            return min(range(SLOTS), key=lambda slot: self._seqs[slot])  # the oldest
        target, dropped = pick_target(self._seqs, due_slots(self.directory, self.rank, SLOTS))
        if dropped is not None:
            _log.warning("checkpoint rank %d: slot %d is still due for persistence and is "
                         "needed: its step will not be persisted", self.rank, dropped)  # fmt: skip
        clear(self.directory, self.rank, target)
        return target

    def _commit(self, target: int, header: SlotHeader, copies: list[Any]) -> None:
        f = self._files[target]
        if copies:
            wait_copies(copies)  # the CUDA copies queued by the save are in the slot
            mark_staged(f, header)
        seq = max(self._seqs) + 1
        commit_slot(f, header, seq)
        self._seqs[target] = seq
        if self.persist_every and header.step % self.persist_every == 0:
            try:
                mark_due(self.directory, self.rank, target, header.step)
            except OSError as exc:  # the save stands; only its persistence is lost
                _log.error("checkpoint rank %d: cannot mark step %d due for persistence: %s",
                           self.rank, header.step, exc)  # fmt: skip

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the pending save's commit (see :meth:`SaveHandle.wait`). A failed
        commit is raised once (:class:`CheckpointError`); the next save goes on. Anything
        else raised while waiting (the timeout, an in-process abort or a
        ``KeyboardInterrupt`` raised into this thread) leaves the commit pending: the
        next save or load waits for it (else it could stage into the slot still being
        committed)."""
        pending = self._pending
        if pending is not None:
            try:
                pending.wait(timeout)
            except CheckpointError:
                self._pending = None  # the commit failed: said once
                raise
            self._pending = None

    def reserve(self, capacity: int) -> None:
        """Grow every slot to ``capacity`` bytes (no-op where they are larger):
        allocated and touched now, so a folder too small fails here.

        Raises:
            CheckpointSpaceError: the folder cannot give the bytes (named in the message).
        """
        if not self.writable or not self._files:
            raise CheckpointError("this store is read only or closed")
        self.wait()
        self._reserve([max(0, capacity - f.size) for f in self._files], f"{SLOTS} slots")
        for f in self._files:
            f.grow(capacity)

    def _reserve(self, growth: list[int], what: str) -> None:
        needed = sum(growth)
        free = free_bytes(self.directory)
        if needed > 0 and 0 <= free < needed:
            raise space_error(self.directory, needed, what)

    # ------------------------------------------------------------------ loading

    def _header(self, slot: int) -> tuple[SlotHeader | None, str]:
        f = self._files[slot]
        if not self.writable:
            f.refresh()
        if f.map is None:
            return None, "empty"
        try:
            header = decode_header(f.read(0, HEADER_SIZE), file_size=f.size)
        except SlotFormatError as exc:
            return None, str(exc)
        if header.rank != self.rank or header.job != self.job:
            return None, f"holds rank {header.rank} of job {header.job!r}"
        return header, "" if header.seq else "not committed"

    def slots(self) -> list[SlotInfo]:
        """The committed slots, newest first, as their headers say (a later part records
        them in etcd so that the job agrees on a step every rank committed)."""
        self.wait()
        out = []
        for slot in range(len(self._files)):
            h, _ = self._header(slot)
            if h is not None and h.seq:
                out.append(SlotInfo(slot, h.seq, h.step, h.round, h.rank, h.world_size, h.job,
                                    h.created, h.layout.payload_len))  # fmt: skip
        return sorted(out, key=lambda info: -info.seq)

    def load(self, step: int | None = None, *, into: Any = None) -> tuple[int, Any] | None:
        """The newest committed step of this rank's slots that passes its checksums.

        Args:
            step: load this step (the job-wide agreed one: the newest step every rank
                committed, which the sidecar will agree on through etcd), or None for
                this rank's newest.
            into: a state dict whose tensors receive the loaded ones in place (torch
                DCP's ``load``): each tensor saved at the same place (same keys and
                positions) with the same dtype and shape is read straight into it (on
                any device) and returned as it is; the others are fresh CPU tensors. One
                check of the slot and one copy into memory the trainer has, instead of
                fresh memory faulted in and copied again by ``load_state_dict``. Every
                chunk is checked before any target is written: a slot that fails leaves
                them as they were (an older slot may then fill them).

        Returns:
            ``(step, state_dict)`` (tensors on the CPU, views of one buffer read from the
            slot; dicts, OrderedDicts with torch's ``_metadata``, lists, tuples as saved),
            or None: no committed slot (of that step) passes. :attr:`skipped` says why
            each slot was passed over. An in-process restart needs no load: the
            process keeps its state.

        Raises:
            CheckpointError: the pending save's commit failed (see :meth:`wait`).
            kelastic.checkpoint.tree.TreeError: ``into`` holds a value no slot holds.
        """
        self.wait()
        self.skipped = []
        into_tree, into_tensors = flatten(into, is_tensor) if into is not None else (None, [])
        found: list[tuple[int, SlotHeader]] = []
        for slot in range(len(self._files)):
            header, why = self._header(slot)
            if header is None or not header.seq:
                self.skipped.append((slot, why))
            elif step is not None and header.step != step:
                self.skipped.append((slot, f"holds step {header.step}, not {step}"))
            else:
                found.append((slot, header))
        for slot, header in sorted(found, key=lambda item: -item[1].seq):
            try:
                return header.step, self._read(slot, header, into_tree, into_tensors)
            except SlotFormatError as exc:
                self.skipped.append((slot, str(exc)))
        return None

    def _read(self, slot: int, h: SlotHeader, into_tree: Any, into_tensors: list[Any]) -> Any:
        f, lay = self._files[slot], h.layout
        table, manifest = decode_table_and_manifest(f.read, h)
        assert f.map is not None
        tensors: list[Any] = []
        if manifest.tensors and into_tree is not None:  # into the trainer's tensors
            pairs = pair_tensors(manifest.tree, into_tree)
            targets = targets_for(manifest.tensors, pairs, into_tensors)
            tensors = read_into(f.map, lay.payload_offset, lay.payload_len, table,
                                lay.chunk_size, manifest.tensors, targets)  # fmt: skip
        elif manifest.tensors:  # torch is imported: the state has tensors
            whole = read_verified(f.map, lay.payload_offset, lay.payload_len, table, lay.chunk_size)
            tensors = tensors_from(whole, manifest.tensors)
        else:  # nothing to copy: the (empty) payload's table is checked all the same
            chunk_crcs(table, lay.payload_len, lay.chunk_size)
        if decode_commit(f.read(COMMIT_OFFSET, 16), h.header_crc) != h.seq:
            raise SlotFormatError("the slot was rewritten while it was read")
        return build(manifest.tree, tensors)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Wait for the pending commit, end the commit thread, unmap the slots, release
        the rank's lock.

        Raises:
            CheckpointError: the pending commit failed (the store is closed anyway).
        """
        try:
            self.wait()
        finally:
            self._committer.close()  # after the commit, however the wait ended
            self._pending = None
            for f in self._files:
                f.close()
            self._files = []
            if self._unlock is not None:
                self._unlock()  # closes the lock's descriptor once
            self._lock_fd = -1

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
