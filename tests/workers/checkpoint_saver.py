"""A process that saves checkpoints until it is killed (tests/worker_lib/test_checkpoint.py).

``python checkpoint_saver.py DIR MODE ELEMENTS``: step 1 is saved and committed first
(prints ``committed 1``); then, by MODE:

- ``stage``: the next save stops halfway through staging its tensors (prints
  ``staging``) and sleeps: the parent kills it mid-write;
- ``commit``: the next save stops in its commit, after the header and before the commit
  word (prints ``committing``);
- ``staged``: the next save returns (prints ``staged 2``) and its commit stops before its
  checksums (the kill of a trainer that goes on training while its save commits);
- ``loop``: saves steps 2, 3, ... for ever, printing ``committed N`` after each commit.

Each step's state is ``{"w": [float(step)] * ELEMENTS (4 tensors), "step": step}``, so a
loaded state says whether it is one step's, whole.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from kelastic.checkpoint import CheckpointStore, _tensors, commit, slot_format, store


def state(step: int, elements: int) -> dict[str, Any]:
    return {"w": [torch.full((elements,), float(step)) for _ in range(4)], "step": step}


def hang(message: str) -> None:
    print(message, flush=True)
    while True:
        time.sleep(60)


def main() -> None:
    directory, mode, elements = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ckpt = CheckpointStore(directory, rank=0, job="crash", capacity=0)
    ckpt.save(1, state(1, elements), blocking=True)
    print("committed 1", flush=True)
    if mode == "stage":
        real_stage = _tensors.stage

        def half(buffer: Any, offset: int, items: Any, tensors: Any) -> None:
            real_stage(buffer, offset, items[:2], tensors[:2])
            hang("staging")

        store.stage = half  # type: ignore[assignment]
    elif mode == "commit":
        real_commit = slot_format.encode_commit

        def stop(seq: int, crc: int) -> bytes:
            if seq > 0:
                hang("committing")
            return real_commit(seq, crc)

        commit.encode_commit = stop  # type: ignore[assignment]
    elif mode == "staged":

        def never(payload: Any, chunk_size: int) -> list[int]:
            while True:
                time.sleep(60)

        commit.chunk_checksums = never  # type: ignore[assignment]
    step = 2
    while True:  # the commit on the store's thread, as in training
        handle = ckpt.save(step, state(step, elements), blocking=mode not in ("loop", "staged"))
        if mode == "staged":
            print(f"staged {step}", flush=True)
        handle.wait()
        print(f"committed {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
