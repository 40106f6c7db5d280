"""torch's side of a slot: which leaves are tensors, staging them, and reading them back.

torch is never imported here at module level: :func:`is_tensor` looks for it in
``sys.modules`` (a state dict with tensors in it means torch is imported), and the
functions that need it import it when called.
"""

from __future__ import annotations

import mmap
import os
import sys
import warnings
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._cuda import is_cuda
from .slot_format import DTYPE_SIZES, TENSOR_ALIGN, SlotFormatError, TensorEntry, chunk_crcs
from .tree import TreeError

#: Most threads copying and checking a payload at once (:func:`read_verified`).
MAX_READ_THREADS = 8


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor kelastic stores (a plain or ``Parameter`` tensor,
    strided, not quantized). Other tensors raise :class:`TreeError` (a sparse or
    quantized tensor, a ``DTensor``: pass its ``to_local()`` shard)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return False
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise TreeError(
            f"a {type(value).__qualname__} is not a plain tensor: store the rank's local "
            "part (DTensor.to_local()) or a plain tensor"
        )
    if value.layout != torch.strided or value.is_quantized:
        raise TreeError(f"a {value.layout} tensor: only strided, unquantized tensors")
    if value.device.type == "meta":
        raise TreeError("a tensor on the meta device has no bytes to store")
    return True


def entries(tensors: Sequence[Any]) -> tuple[list[TensorEntry], int]:
    """The payload entries of ``tensors`` (each at a :data:`TENSOR_ALIGN`-aligned offset)
    and the payload's length, bytes.

    Raises:
        TreeError: a dtype the format does not know.
    """
    out: list[TensorEntry] = []
    offset = 0
    for tensor in tensors:
        name = str(tensor.dtype).removeprefix("torch.")
        size = DTYPE_SIZES.get(name)
        if size is None or size != tensor.element_size():
            raise TreeError(f"a tensor of dtype {tensor.dtype}, which slots do not hold")
        nbytes = tensor.numel() * size
        out.append(TensorEntry(name, tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
    return out, (out[-1].offset + out[-1].nbytes) if out else 0


def stage(buffer: Any, payload_offset: int, items: Sequence[TensorEntry],
          tensors: Sequence[Any]) -> None:  # fmt: skip
    """Copy ``tensors`` into ``buffer`` (a writable buffer: the slot's map) at their
    entries' offsets after ``payload_offset``: one ``Tensor.copy_`` each into a view of
    the buffer (no intermediate copy, non-contiguous sources included; torch's copy may
    use its intra-op threads). A CUDA tensor's copy is queued (``non_blocking``): the
    caller waits for it before reading the bytes (:mod:`._cuda`)."""
    import torch

    if sys.byteorder != "little":
        raise TreeError("slots hold little-endian bytes; this host is big-endian")
    length = (items[-1].offset + items[-1].nbytes) if items else 0
    if length == 0:
        return
    whole = torch.frombuffer(buffer, dtype=torch.uint8, count=length, offset=payload_offset)
    try:
        for entry, tensor in zip(items, tensors, strict=True):
            if entry.nbytes:  # no name holds a view: a raised error keeps no export alive
                whole[entry.offset : entry.offset + entry.nbytes].view(tensor.dtype).view(
                    tensor.shape
                ).copy_(tensor.detach(), non_blocking=is_cuda(tensor))
    finally:
        del whole


def read_verified(src: Any, offset: int, length: int, table: bytes, chunk_size: int) -> Any:
    """``length`` bytes of ``src`` (a slot's map) from ``offset``, copied into fresh memory
    chunk by chunk, each chunk checked against ``table`` (its crc32s) once copied, while it
    is still in the CPU's caches: what the caller gets is what was checked. Returns the
    copy as a ``uint8`` tensor over an anonymous map (its pages are first touched by
    the copy, not zeroed beforehand).

    Chunks are copied and checked by up to :data:`MAX_READ_THREADS` threads (the CPUs
    this process may use): ``Tensor.copy_`` and ``zlib.crc32`` both release the GIL, so
    the copy, its page faults and the checksums run in parallel (a restart's load is
    bounded by the memory's bandwidth, not one core's).

    Raises:
        SlotFormatError: the table does not fit the length, or a chunk fails its crc32
            (named with its range).
    """
    import torch

    expected = chunk_crcs(table, length, chunk_size)
    buffer = mmap.mmap(-1, max(length, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buffer, dtype=torch.uint8, count=length) if length else None
    # Held in a list that is emptied at the end: a tensor over the slot's map exports its
    # buffer, and a map with an export alive (in a traceback's frame) cannot be closed.
    sources = []
    if length:
        with warnings.catch_warnings():  # a read-only map: torch warns that it could write
            warnings.simplefilter("ignore", UserWarning)
            sources.append(torch.frombuffer(src, dtype=torch.uint8, count=length, offset=offset))

    def one(index: int) -> None:
        start = index * chunk_size
        end = min(start + chunk_size, length)
        assert whole is not None
        whole[start:end].copy_(sources[0][start:end])
        with memoryview(buffer) as view:
            if zlib.crc32(view[start:end]) != expected[index]:
                raise SlotFormatError(
                    f"payload chunk {index} (bytes {start}..{end}) fails its crc32"
                )

    workers = max(1, min(MAX_READ_THREADS, len(os.sched_getaffinity(0)), len(expected)))
    try:
        if workers == 1:
            for index in range(len(expected)):
                one(index)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="kelastic-load") as pool:
                list(pool.map(one, range(len(expected))))  # the first error is raised
    finally:
        sources.clear()  # no export of the slot's map outlives the read
    return whole if whole is not None else torch.empty(0, dtype=torch.uint8)


def tensors_from(whole: Any, items: Sequence[TensorEntry]) -> list[Any]:
    """The tensors of ``items`` as views of ``whole`` (the payload read back, a ``uint8``
    tensor: :func:`read_verified`; the tensors keep it alive, so nothing is copied again)."""
    import torch

    out = []
    for entry in items:
        dtype = getattr(torch, entry.dtype)
        if entry.nbytes == 0:
            out.append(torch.empty(entry.shape, dtype=dtype))
            continue
        flat = whole[entry.offset : entry.offset + entry.nbytes].view(dtype)
        out.append(flat.view(entry.shape))
    return out
