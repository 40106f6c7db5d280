"""Step time while the sidecar persists (issue 21's target: <= 1.02x without), a part of
``python -m bench checkpoint``.

A trainer's loop in this process: each step a fixed amount of compute (single-threaded
``matmul``s, calibrated to :data:`STEP_SECONDS`) then ``CheckpointStore.save`` of the
state dict (staged in the slot; committed on the store's thread while the next step
computes): a memory checkpoint every step, as the digits example does. Two stores, each
in its own ``/dev/shm`` folder: one marks every ``every``-th step due for persistence, and
the sidecar's :class:`~kelastic_sidecar.persister.Persister` runs in another process
(:mod:`bench._persister`, as the sidecar's container does) writing those steps to the disk
in torch DCP's format; the other store marks none (no persistence). Blocks of steps
alternate between the two, so that the machine's drifting load falls on both alike; a
target is judged by the median of each pair of adjacent blocks' ratio of mean step times.

What it measures on a small machine is mostly contention: the persister's checksum pass,
copy and ``fsync`` of ``state`` bytes share the cores with the trainer's compute and its
store's commit thread. On a GPU node the trainer's step is on the GPU and the cores are
many; the ratio here is an upper bound of that. The full run measures two rates,
:data:`EVERY` and :data:`EVERY_SPARSE` (``spec.checkpoint.persist.everySteps``), each
judged against the target on its own: the rate is the operator's lever.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import CaseResult, Check, Row, log, median

#: simulated compute per step, seconds
STEP_SECONDS = 0.1
#: persist every this many steps (``spec.checkpoint.persist.everySteps``)
EVERY = 10
#: the sparser rate the full run also measures (a persisted step every ~5 s here)
EVERY_SPARSE = 50


def _compute(seconds: float) -> Callable[[], None]:
    """A function doing ``seconds`` of single-threaded matmuls (calibrated now)."""
    import torch

    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    warm = time.perf_counter()
    while time.perf_counter() - warm < 0.2:  # caches, frequency: as in the loop
        torch.mm(a, b)
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < 0.2:
        torch.mm(a, b)
        n += 1
    reps = max(1, round(n * seconds / (time.perf_counter() - started)))

    def work() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    return work


def _block(store: Any, state: Any, work: Callable[[], None], steps: int, first: int) -> list[float]:
    """``steps`` steps from step ``first``; each step's seconds (compute + save stall)."""
    times = []
    for step in range(first, first + steps):
        started = time.perf_counter()
        work()
        store.save(step, state)
        times.append(time.perf_counter() - started)
    return times


def measure_persist_overhead(
    result: CaseResult, label: str, state: Any, blocks: int, steps: int, every: int = EVERY
) -> None:
    """Append the rows and the check of the step-time overhead of persistence for
    ``state`` (``label``: its size), ``blocks`` pairs of ``steps`` steps each, persisting
    every ``every`` steps."""
    import torch

    from kelastic.checkpoint import CheckpointStore, slot_bytes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a trainer's CPU side: one thread, the rest is the GPU's
    shm = Path(tempfile.mkdtemp(prefix="kelastic-bench-persist-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="kelastic-bench-persist-"))
    (shm / "on").mkdir()
    (shm / "off").mkdir()
    stores: list[Any] = []
    off_times: list[list[float]] = []
    on_times: list[list[float]] = []
    persister = subprocess.Popen(
        [sys.executable, "-m", "bench._persister", str(shm / "on"), str(disk), str(every)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert persister.stdout is not None and persister.stdout.readline().strip() == "ready"
        capacity = slot_bytes(state)
        for folder, rate in (("on", every), ("off", 0)):
            stores.append(CheckpointStore(shm / folder, job="bench", round=0, world_size=1,
                                          capacity=capacity, persist_every=rate))  # fmt: skip
        on, off = stores
        work = _compute(STEP_SECONDS)
        _block(on, state, work, 2, 1)  # warm up both
        _block(off, state, work, 2, 1)
        for i in range(blocks):
            first = 3 + i * steps
            order = ((on, on_times), (off, off_times))
            for store, times in order if i % 2 == 0 else order[::-1]:
                gc.collect()
                times.append(_block(store, state, work, steps, first))
            log(f"checkpoint: {label} step time, every {every}, block {i + 1}: "
                f"without {sum(off_times[-1]) / steps:.4f} s, "
                f"with persistence {sum(on_times[-1]) / steps:.4f} s")  # fmt: skip
        for store in stores:
            store.close()
        stores.clear()
        out, _ = persister.communicate("", timeout=60)
    finally:
        for store in stores:
            store.close()
        if persister.poll() is None:
            persister.kill()
            persister.wait()
        torch.set_num_threads(threads)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    persisted = out.split()[1:] if out.startswith("persisted") else []
    due = sum(1 for s in range(3, 3 + blocks * steps) if s % every == 0)
    group = f"step time, {label} state, memory checkpoint every step, persist every {every}"
    result.rows += [
        Row("checkpoint", group, "kelastic, no persistence", "s",
            [t for b in off_times for t in b], ref=True,
            note=f"about {STEP_SECONDS:g} s of compute (calibrated) + the save's stall"),
        Row("checkpoint", group, f"kelastic, persisted every {every} steps (sidecar process)",
            "s", [t for b in on_times for t in b],
            note=f"{len(persisted)} of {due} due steps persisted during the run"),
    ]  # fmt: skip
    ratios = [sum(a) / sum(b) for a, b in zip(on_times, off_times, strict=True)]
    value = (f"block ratios median {median(ratios):.3f}x "
             f"(min {min(ratios):.3f}, max {max(ratios):.3f}); "
             f"{len(persisted)}/{due} due steps persisted")  # fmt: skip
    target = f"{label}: step time persisting every {every} steps <= 1.02x without"
    met = median(ratios) <= 1.02 and bool(persisted)
    result.checks.append(Check("checkpoint", target, value, met))
