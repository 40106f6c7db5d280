"""A gloo trainer (torch) that checkpoints every step with ``kelastic.checkpoint``.

At start it loads (``kelastic.checkpoint.load()``: the step its sidecar agreed on) and
prints ``restored R`` (``restored none`` on a fresh start), after checking the loaded
state is that step's, of this rank, whole: every tensor element equals the step and
``rank`` is its own (else it raises). Then each step: an all-reduce (the ranks go in
lockstep, as a DDP job), the state updated, ``save(step, state, blocking=True)`` (it
returns once committed), ``saved N`` printed, each step inside ``expires()`` (what
``kelastic run --fault`` waits for). Exits 0 after ``STEPS_MAX`` steps (default 60).
``CKPT_ELEMENTS``: float32 elements per tensor (default 4096, two tensors).
``CKPT_FLIP_RANK``: that rank, in its first round after a restart (``KELASTIC_ROUND`` 1),
flips a byte of the slot holding the agreed step before it loads: a slot that goes bad
after the sidecars agreed on it (its load must fail, never load something else).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from kelastic import checkpoint
from kelastic.errors import record
from kelastic.timer import expires

torch.set_num_threads(1)


def _state(step: int, rank: int, elements: int) -> dict[str, Any]:
    w = torch.full((elements,), float(step))
    return {"model": {"w": w, "b": w[:16].clone()}, "step": step, "rank": rank}


def _check(step: int, state: Any, rank: int) -> None:
    tensors = (state["model"]["w"], state["model"]["b"])
    if state["step"] != step or state["rank"] != rank:
        raise RuntimeError(f"loaded step {step} holds step {state['step']} of {state['rank']}")
    if not all(bool((t == float(step)).all()) for t in tensors):
        raise RuntimeError(f"loaded step {step} holds tensors of another step")


def _flip_agreed_slot(rank: int) -> None:
    """Flip one payload byte of this rank's slot holding the agreed step."""
    from kelastic import contract
    from kelastic.checkpoint.slot_format import HEADER_SIZE, decode_header
    from kelastic.checkpoint.store import SLOTS, slot_path

    agreed = int(os.environ[contract.ENV_CHECKPOINT_STEP])
    for slot in range(SLOTS):
        path = slot_path(contract.checkpoint_dir(), rank, slot)
        raw = path.read_bytes()
        header = decode_header(raw[:HEADER_SIZE], file_size=len(raw))
        if header.step == agreed:
            offset = header.layout.payload_offset + 64
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(bytes([raw[offset] ^ 0x01]))
            print(f"flipped a byte of step {agreed}", flush=True)
            return


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    limit = int(os.environ.get("STEPS_MAX") or 60)
    elements = int(os.environ.get("CKPT_ELEMENTS") or 4096)
    if os.environ.get("CKPT_FLIP_RANK") == str(rank) and os.environ.get("KELASTIC_ROUND") == "1":
        _flip_agreed_slot(rank)
    started = time.monotonic()
    restored = checkpoint.load()
    took = time.monotonic() - started
    step = 0
    if restored is not None:
        step, state = restored
        _check(step, state, rank)
    name = "none" if restored is None else step
    print(f"restored {name} in {took:.4f}s", flush=True)
    dist.init_process_group("gloo")
    total = torch.zeros(1)
    while step < limit:
        with expires(after=30, scope="step"):
            total += 1
            dist.all_reduce(total)
            step += 1
            checkpoint.save(step, _state(step, rank, elements), blocking=True)
        print(f"saved {step}", flush=True)
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
