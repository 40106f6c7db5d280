"""A rank adopts another rank's slot of a replicated state (``spec.checkpoint.stateLayout:
Replicated``: every rank saves the same state, as under DDP).

When the world grows or its ranks are renumbered, a rank may hold no slot of the step the
job agreed on, while another rank's copy of that step, the same state, is on its node or
a peer's (:func:`kelastic.etcd_values.checkpoints.replicated_step`). :func:`adopt_slot`
copies that slot into the rank's own slot file and stamps its header with the rank, so
the rank's ``load()`` reads it as its own: the payload, the chunk table and the manifest
are the copy's bytes unchanged (the load checks every chunk's crc32 as for any slot),
the header gets the new rank and a commit sequence above the rank's other slots (the
adopted step is its newest), its crc and commit word written by the format's one codec
(:mod:`.slot_format`). The copy goes to a hidden file renamed into place last: a crash
leaves the destination as it was. ``source`` may be ``dest`` itself (a slot fetched
from a peer into the rank's slot file and then stamped).

Stdlib only, no torch.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from ._slotfile import CheckpointError
from .scan import committed_slots
from .slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    SlotFormatError,
    decode_commit,
    decode_header,
    encode_commit,
    encode_header,
)

__all__ = ["adopt_slot"]


def adopt_slot(source: Path, dest: Path, rank: int, job: str, step: int) -> int:
    """Copy the committed slot at ``source`` (some rank's ``step`` of ``job``) to ``dest``
    as ``rank``'s (see the module doc); ``source`` is left as it was.

    Args:
        source: a slot file (any rank's, a slot or a replica).
        dest: the rank's slot file to replace (``<folder>/rank-<rank>.slot<N>``); its
            folder must exist.
        rank: the global rank that adopts it.
        job: the run id ``source`` must be of.
        step: the step ``source`` must hold.

    Returns:
        The bytes copied (the source file's size).

    Raises:
        CheckpointError: ``source`` is not a committed slot of ``job`` holding ``step``
            (the message says which field). The payload is not checked here: the
            rank's load checks every chunk, as for any slot.
        OSError: a file cannot be read or written; the hidden copy is removed.
    """
    # named as a peer fetch's temporary file: the sidecar's sweep at its start removes
    # one a crash left (kelastic_sidecar.replica.sweep_fetches)
    tmp = dest.with_name(f".{dest.name}.fetch-{os.urandom(8).hex()}")
    try:
        shutil.copyfile(source, tmp)
        with open(tmp, "r+b") as fh:
            raw = fh.read(HEADER_SIZE)
            size = os.fstat(fh.fileno()).st_size
            try:
                if len(raw) < HEADER_SIZE:
                    raise SlotFormatError(f"{size} bytes: no whole header")
                h = decode_header(raw, file_size=size)
                seq = decode_commit(raw[COMMIT_OFFSET : COMMIT_OFFSET + 16], h.header_crc)
            except SlotFormatError as exc:
                raise CheckpointError(f"{source} is not a slot: {exc}") from None
            if not seq or h.job != job or h.step != step:
                raise CheckpointError(
                    f"{source} holds step {h.step} of job {h.job!r} (committed: {bool(seq)}), "
                    f"not step {step} of {job!r}"
                )
            newer = max((s.seq for s in committed_slots(dest.parent, job) if s.rank == rank),
                        default=0)  # fmt: skip
            head, crc = encode_header(replace(h, rank=rank, seq=0, header_crc=0))
            fh.seek(0)
            fh.write(head)  # its commit word is zero: not committed until the next write
            fh.seek(COMMIT_OFFSET)
            fh.write(encode_commit(max(seq, newer + 1), crc))
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size
