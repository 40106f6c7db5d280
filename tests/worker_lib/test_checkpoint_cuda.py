"""The checkpoint store's CUDA path (kelastic/checkpoint/_cuda.py): on this machine, the
bookkeeping of the slot maps registered with the CUDA driver, with a recording stand-in
for the runtime's two calls (no GPU here to lock memory for), and the CPU path's
behaviour unchanged by it; on a machine with a GPU, tests/worker_lib/test_checkpoint_gpu.py
(marked ``gpu``) saves CUDA tensors for real."""

from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path
from typing import Any

import pytest
import torch

from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint._cuda import Pinning, copies_done, is_cuda, wait_copies
from kelastic.checkpoint._slotfile import SlotFile


class Runtime:
    """Records ``cudaHostRegister``/``cudaHostUnregister`` as torch's ``cudart()`` is
    called: address, size, flags; returns ``results`` in turn (0: success)."""

    def __init__(self, *results: Any) -> None:
        self.results = list(results)
        self.calls: list[tuple[Any, ...]] = []

    def _result(self) -> Any:
        result = self.results.pop(0) if self.results else 0
        if isinstance(result, Exception):
            raise result
        return result

    def cudaHostRegister(self, address: int, size: int, flags: int) -> Any:
        self.calls.append(("register", address, size, flags))
        return self._result()

    def cudaHostUnregister(self, address: int) -> Any:
        self.calls.append(("unregister", address))
        return self._result()


def _address(m: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def test_a_slot_map_is_registered_once_and_unregistered_before_it_is_unmapped(
    tmp_path: Path,
) -> None:
    runtime = Runtime()
    pinning = Pinning(runtime)
    f = SlotFile(tmp_path / "slot", writable=True)
    f.grow(1 << 20)
    f.before_unmap = pinning.unpin
    assert f.map is not None
    first, address = f.map, _address(f.map)
    assert pinning.pin(first) and pinning.pin(first)  # the second is not a call
    assert runtime.calls == [("register", address, 1 << 20, 0)]
    assert pinning.pinned_bytes == 1 << 20
    # growing maps the file again: the old map is unregistered first, the new one not yet
    f.grow(2 << 20)
    assert runtime.calls[1] == ("unregister", address) and pinning.pinned_bytes == 0
    assert f.map is not None and pinning.pin(f.map)
    assert runtime.calls[2] == ("register", _address(f.map), 2 << 20, 0)
    f.close()  # and closing unregisters too
    assert runtime.calls[3][0] == "unregister" and pinning.pinned_bytes == 0
    assert first.closed


@pytest.mark.parametrize("refusal", [2, RuntimeError("no CUDA driver")], ids=["error", "raised"])
def test_a_refused_registration_is_said_once_and_never_retried(
    tmp_path: Path, refusal: Any, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = Runtime(refusal)
    pinning = Pinning(runtime)
    f = SlotFile(tmp_path / "slot", writable=True)
    f.grow(1 << 20)
    assert f.map is not None
    with caplog.at_level(logging.WARNING, "kelastic.checkpoint"):
        assert not pinning.pin(f.map) and not pinning.pin(f.map)
    assert pinning.refused and len(runtime.calls) == 1 and pinning.pinned_bytes == 0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "pageable memory" in said[0] and "1048576 bytes" in said[0]
    pinning.unpin(f.map)  # never registered: no call
    assert len(runtime.calls) == 1
    f.close()


def test_a_failed_unregistration_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = Runtime(0, 1)  # registered; the unregistration fails
    pinning = Pinning(runtime)
    f = SlotFile(tmp_path / "slot", writable=True)
    f.grow(1 << 20)
    f.before_unmap = pinning.unpin
    assert f.map is not None and pinning.pin(f.map)
    with caplog.at_level(logging.WARNING, "kelastic.checkpoint"):
        f.close()
    assert f.map is None and "cudaHostUnregister" in caplog.text


def test_cpu_tensors_wait_for_nothing_and_the_store_registers_nothing(tmp_path: Path) -> None:
    state = {"w": torch.arange(1000, dtype=torch.float32), "n": 3}
    tensors = [state["w"]]
    assert not is_cuda(state["w"]) and copies_done(tensors) == []
    wait_copies([])  # nothing to wait for
    with CheckpointStore(tmp_path, rank=0, job="j") as store:
        store.save(5, state).wait()
        assert store._pinning.pinned_bytes == 0 and not store._pinning.refused
        got = store.load()
    assert got is not None and got[0] == 5 and torch.equal(got[1]["w"], state["w"])
