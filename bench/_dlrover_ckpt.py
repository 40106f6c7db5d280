"""DLRover's flash checkpoint, timed in the trainer it runs: this script runs under
``dlrover-run --max-restarts=1`` (one node, one process), the agent holding the saver
and its shared memory. ``python bench/_dlrover_ckpt.py OUT TOTAL REPEATS CKPT_DIR``:

- first process (``TORCHELASTIC_RESTART_COUNT=0``): builds :func:`bench.checkpoint.
  state_dict` of ``TOTAL`` bytes, makes a ``DdpCheckpointer`` (gloo group initialized, as
  a DDP trainer has it) and calls ``save_checkpoint(step, state, storage_type=MEMORY)``
  ``REPEATS + 1`` times (the first one creates the shared memory), then fails (exit 3);
- second process, started by the agent: ``DdpCheckpointer`` again, ``load_checkpoint()``
  (from the agent's shared memory: no file is on disk yet), its tensors copied into the
  process's own (what ``load_state_dict`` does) and checked (crc32) against the state
  saved, then a ``StorageType.DISK`` save, waiting for the agent's saver to write DLRover's
  tracker file with the step.

Each process appends one JSON line of seconds to ``OUT`` (and prints it). Run by
:func:`bench.dlrover_side.measure_dlrover` with the interpreter that has ``dlrover``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from bench.checkpoint import _tensors, state_dict


def _report(out: Path, doc: dict[str, Any]) -> None:
    line = json.dumps(doc)
    with open(out, "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


def _crc(tensors: list[Any]) -> int:
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor.detach().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def _save_phase(ckpt: Any, memory: Any, state: dict[str, Any], repeats: int) -> dict[str, Any]:
    stalls = []
    for step in range(1, repeats + 2):
        state["step"] = step
        started = time.perf_counter()
        ckpt.save_checkpoint(step, state, storage_type=memory)
        stalls.append(time.perf_counter() - started)
        time.sleep(0.05)
    cached = ckpt._engine._cached_step
    if cached != repeats + 1:
        raise RuntimeError(f"a memory save was skipped: cached step {cached}")
    return {"phase": "save", "first_save_s": stalls[0], "save_s": stalls[1:], "step": cached,
            "crc": _crc(_tensors(state))}  # fmt: skip


def _load_phase(
    ckpt: Any, disk: Any, state: dict[str, Any], ckpt_dir: Path, saved: dict[str, Any]
) -> dict[str, Any]:
    if (ckpt_dir / "dlrover_latest.txt").exists():
        raise RuntimeError("a checkpoint is on disk already: the load would not be from memory")
    ours = _tensors(state)
    for tensor in ours:  # the new process's own tensors, not yet restored
        tensor.zero_()
    started = time.perf_counter()
    loaded = ckpt.load_checkpoint()
    load_s = time.perf_counter() - started
    if not loaded:
        raise RuntimeError("load_checkpoint() returned nothing from the agent's shared memory")
    theirs = _tensors(loaded)
    if len(ours) != len(theirs):
        raise RuntimeError(f"{len(theirs)} tensors loaded from shared memory, {len(ours)} saved")
    started = time.perf_counter()  # the shared pages are first touched here
    for mine, other in zip(ours, theirs, strict=True):
        mine.copy_(other)
    copy_s = time.perf_counter() - started
    step = int(loaded["step"])
    if step != saved["step"] or _crc(ours) != saved["crc"]:
        raise RuntimeError(f"the state loaded (step {step}) differs from the one saved")
    state["step"] = step + 1
    tracker = ckpt_dir / "dlrover_latest.txt"
    path = ckpt_dir / str(step + 1) / "rank_0.pt"
    started = time.perf_counter()
    ckpt.save_checkpoint(step + 1, state, str(path), storage_type=disk)
    disk_stall_s = time.perf_counter() - started
    deadline = started + 600
    while not (tracker.exists() and tracker.read_text().strip() == str(step + 1)):
        if time.perf_counter() > deadline:
            raise RuntimeError("the agent did not persist the step within 600 s")
        time.sleep(0.01)
    persist_s = time.perf_counter() - started
    return {"phase": "load", "step": step, "load_s": load_s, "copy_s": copy_s,
            "disk_save_stall_s": disk_stall_s, "persist_s": persist_s,
            "file_bytes": path.stat().st_size}  # fmt: skip


def main(argv: list[str]) -> int:
    out, total, repeats, ckpt_dir = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    flash = importlib.import_module("dlrover.trainer.torch.flash_checkpoint.ddp")
    storage_type = importlib.import_module(
        "dlrover.trainer.torch.flash_checkpoint.checkpointer"
    ).StorageType
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    state = state_dict(total)
    started = time.perf_counter()
    ckpt = flash.DdpCheckpointer(str(ckpt_dir))
    init_s = time.perf_counter() - started
    try:
        if restart == 0:
            doc = _save_phase(ckpt, storage_type.MEMORY, state, repeats)
        else:
            saved = next(d for d in map(json.loads, out.read_text().splitlines())
                         if d["phase"] == "save")  # fmt: skip
            doc = _load_phase(ckpt, storage_type.DISK, state, ckpt_dir, saved)
    except Exception as exc:
        _report(out, {"phase": "error", "restart": restart, "error": repr(exc)})
        raise
    _report(out, {**doc, "init_s": init_s, "restart": restart, "pid": os.getpid()})
    dist.destroy_process_group()
    return 3 if restart == 0 else 0  # the first process fails: the agent restarts it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
