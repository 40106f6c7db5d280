"""The checkpoint store with CUDA tensors, on a machine with a GPU (marked ``gpu``: where
``torch.cuda.is_available()`` is false they are deselected at collection, and the run says
so; nothing is skipped). Each prints its numbers (the README's GPU row comes from them).
The bookkeeping runs everywhere: tests/worker_lib/test_checkpoint_cuda.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kelastic.checkpoint import CheckpointStore

pytestmark = pytest.mark.gpu
MIB = 1 << 20


def _state(mib: int) -> dict[str, torch.Tensor]:
    n = mib * MIB // 4 // 4
    return {f"t{i}": torch.rand(n, device="cuda") for i in range(4)}


def test_cuda_tensors_round_trip_through_a_pinned_slot(tmp_path: Path) -> None:
    state = _state(64)
    with CheckpointStore(tmp_path, rank=0, job="j") as store:
        store.save(1, state).wait()
        assert store._pinning.pinned_bytes > 0 or store._pinning.refused
        got = store.load()
    assert got is not None and got[0] == 1
    for name, tensor in state.items():
        assert torch.equal(got[1][name], tensor.cpu()), name


def test_a_load_into_cuda_tensors_fills_them_on_the_device(tmp_path: Path) -> None:
    state = _state(16)
    into = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    with CheckpointStore(tmp_path, rank=0, job="j") as store:
        store.save(1, state).wait()
        got = store.load(into=into)
    assert got is not None and got[0] == 1
    for name, tensor in state.items():
        assert got[1][name] is into[name] and into[name].is_cuda
        assert torch.equal(into[name], tensor), name


def test_a_kernel_queued_after_save_on_the_same_stream_does_not_reach_the_slot(
    tmp_path: Path,
) -> None:
    state = _state(256)
    before = {k: v.cpu() for k, v in state.items()}
    with CheckpointStore(tmp_path, rank=0, job="j") as store:
        handle = store.save(1, state)
        for tensor in state.values():  # queued behind the copies on the current stream
            tensor.mul_(-1.0)
        handle.wait()
        got = store.load()
    assert got is not None
    for name in state:
        assert torch.equal(got[1][name], before[name]), name


@pytest.mark.parametrize("mib", [100, 1024])
def test_print_the_save_stall_against_torch_save(tmp_path: Path, mib: int) -> None:
    state = _state(mib)
    torch.cuda.synchronize()
    with CheckpointStore(tmp_path / "slots", rank=0, job="j") as store:
        store.save(0, state).wait()  # the slot grown and pinned
        stalls, commits = [], []
        for step in range(1, 6):
            t0 = time.perf_counter()
            handle = store.save(step, state)
            stalls.append(time.perf_counter() - t0)
            handle.wait()
            commits.append(time.perf_counter() - t0)
        pinned = store._pinning.pinned_bytes
    t0 = time.perf_counter()
    torch.save(state, tmp_path / "state.pt")
    saved = time.perf_counter() - t0
    stall, commit = sorted(stalls)[2], sorted(commits)[2]
    print(f"\nGPU {torch.cuda.get_device_name()}: {mib} MiB of CUDA tensors: save stall "
          f"{stall:.4f} s (committed after {commit:.4f} s; pinned {pinned} bytes), "
          f"torch.save {saved:.3f} s: {stall / saved:.3f}x")  # fmt: skip
    assert commit > 0 and stall > 0
