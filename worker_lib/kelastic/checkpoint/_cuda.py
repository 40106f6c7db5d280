"""CUDA tensors saved into a slot: the slot's memory page-locked for the device, the copies
queued without blocking the trainer, the commit waiting for them.

- **Pinned slots** (:class:`Pinning`): the first save of a CUDA tensor registers the
  target slot's whole map with the CUDA driver (``cudaHostRegister``: its pages locked and
  known to the device), once per map; each tensor's device-to-host copy is then one DMA
  straight into the slot, with no bounce through a staging buffer (torch DCP's
  ``async_save`` stages into pinned buffers of its own and copies again; the slot *is* the
  pinned buffer here). A map is unregistered before it is unmapped (a slot that grows is
  mapped again and registered again at its next CUDA save).
- **Queued copies** (:func:`copies_done`): ``Tensor.copy_(non_blocking=True)`` on the
  saving thread's current stream of each device, and one CUDA event recorded on each
  after them; ``save()`` returns once they are queued. The save's commit (the store's
  thread) waits on the events (:func:`wait_copies`) before it checksums the bytes, so a
  commit never covers bytes still in flight. Stream order keeps the trainer's promise
  ("it may change the tensors at once"): a later kernel on the same stream that writes a
  tensor runs after its copy; a write from *another* stream must wait for the save's
  commit (``handle.wait()``), as with any asynchronous copy in torch.
- **Where the driver refuses** (no CUDA, a container's locked-memory limit, memory it
  cannot lock): the copies go to the slot's pageable memory, which is correct and
  synchronous (the driver copies through its own staging buffer, and ``cudaMemcpyAsync``
  to pageable memory returns once the copy is done); said once in the log.

Unmeasured: no machine with a GPU has run this path yet (the tests marked ``gpu`` run it
wherever one is present; the README says so). torch is imported only when called.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["Pinning", "copies_done", "is_cuda", "wait_copies"]

_log = logging.getLogger("kelastic.checkpoint")


def is_cuda(tensor: Any) -> bool:
    """Whether ``tensor`` (a torch tensor) lives on a CUDA device."""
    return bool(tensor.device.type == "cuda")


def _address(buffer: mmap.mmap) -> int:
    """The address of a writable map's first byte (the ctypes view is dropped at once: a
    map with a buffer exported cannot be closed)."""
    view = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def _ok(err: Any) -> bool:
    """Whether a CUDA runtime call's result (a ``cudaError``, an int, or the exception it
    raised) is ``cudaSuccess``."""
    try:
        return int(err) == 0
    except (TypeError, ValueError):
        return False


class Pinning:
    """The slot maps registered with the CUDA driver by one store (see the module doc).

    Args:
        cudart: the CUDA runtime's ``cudaHostRegister``/``cudaHostUnregister`` (torch's
            ``torch.cuda.cudart()``, which is what is used when None); each returns a
            ``cudaError`` (0: success).

    Attributes:
        refused: the driver refused a registration; no other is tried (the copies go to
            pageable memory).
    """

    def __init__(self, cudart: Any = None) -> None:
        self._cudart = cudart
        self._pinned: dict[int, tuple[mmap.mmap, int, int]] = {}  # id(map) -> map, addr, size
        self.refused = False

    def _runtime(self) -> Any:
        if self._cudart is None:
            import torch

            self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        return self._cudart

    @property
    def pinned_bytes(self) -> int:
        """Bytes registered now."""
        return sum(size for _, _, size in self._pinned.values())

    def pin(self, buffer: mmap.mmap) -> bool:
        """Register ``buffer`` (a writable slot map) once; True when it is registered.
        A refusal is logged once and makes every later call False (no retry per save)."""
        if id(buffer) in self._pinned:
            return True
        if self.refused:
            return False
        address, size = _address(buffer), len(buffer)
        try:
            err: Any = self._runtime().cudaHostRegister(address, size, 0)
        except Exception as exc:  # no CUDA runtime at all
            err = exc
        if not _ok(err):
            self.refused = True
            _log.warning("checkpoint: the CUDA driver would not lock the slot's %d bytes "
                         "(%s): CUDA tensors are copied to pageable memory, synchronously",
                         size, err)  # fmt: skip
            return False
        self._pinned[id(buffer)] = (buffer, address, size)
        return True

    def unpin(self, buffer: mmap.mmap) -> None:
        """Unregister ``buffer`` if it is registered (before it is unmapped)."""
        found = self._pinned.pop(id(buffer), None)
        if found is None:
            return
        try:
            err: Any = self._runtime().cudaHostUnregister(found[1])
        except Exception as exc:
            err = exc
        if not _ok(err):
            _log.warning("checkpoint: cudaHostUnregister of a slot failed (%s)", err)


def copies_done(tensors: Sequence[Any]) -> list[Any]:
    """One CUDA event recorded on the current stream of each device that ``tensors``
    (torch tensors, just queued for copying) live on, after their copies; ``[]`` when
    none is a CUDA tensor (nothing to wait for)."""
    devices = sorted({t.device.index or 0 for t in tensors if is_cuda(t)})
    if not devices:
        return []
    torch = sys.modules["torch"]
    events = []
    for index in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        events.append(event)
    return events


def wait_copies(events: Sequence[Any]) -> None:
    """Block until each of ``events`` (:func:`copies_done`) has happened: the copies it
    follows are in the slot."""
    for event in events:
        event.synchronize()
