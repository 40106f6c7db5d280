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


def _pool_map(fn: Any, count: int) -> None:
    """``fn(i)`` for ``i`` in ``range(count)`` on up to :data:`MAX_READ_THREADS` threads
    (the CPUs this process may use); the first error is raised."""
    workers = max(1, min(MAX_READ_THREADS, len(os.sched_getaffinity(0)), count))
    if workers == 1:
        for index in range(count):
            fn(index)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="kelastic-load") as pool:
            list(pool.map(fn, range(count)))


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

    try:
        _pool_map(one, len(expected))  # the first error is raised
    finally:
        sources.clear()  # no export of the slot's map outlives the read
    return whole if whole is not None else torch.empty(0, dtype=torch.uint8)


def targets_for(items: Sequence[TensorEntry], pairs: dict[int, int],
                tensors: Sequence[Any]) -> list[Any]:  # fmt: skip
    """For each of ``items``, the tensor of ``tensors`` that ``pairs`` places there
    (:func:`kelastic.checkpoint.tree.pair_tensors`) when its dtype and shape are the
    entry's, else None (a fresh tensor is read)."""
    out: list[Any] = []
    for index, entry in enumerate(items):
        tensor = tensors[pairs[index]] if index in pairs else None
        same = (tensor is not None and str(tensor.dtype).removeprefix("torch.") == entry.dtype
                and tuple(tensor.shape) == entry.shape)  # fmt: skip
        out.append(tensor if same else None)
    return out


def read_into(src: Any, offset: int, length: int, table: bytes, chunk_size: int,
              items: Sequence[TensorEntry], targets: Sequence[Any]) -> list[Any]:  # fmt: skip
    """The tensors of ``items`` read from ``src`` (a slot's map; the payload at ``offset``,
    ``length`` bytes), each into its ``targets`` entry where one is given (a tensor of the
    same dtype and shape: the trainer's own, on any device, contiguous or not; filled in
    place and returned as it is) or into a fresh CPU tensor (``None``).

    Every chunk is checked against ``table`` (crc32) on the slot's bytes **before** any
    byte is copied: a slot that fails leaves every target as it was. Then the copies, cut
    into pieces of at most ``chunk_size`` bytes. Both run on up to
    :data:`MAX_READ_THREADS` threads (``zlib.crc32`` and ``Tensor.copy_`` release the GIL):
    one pass of checks and one copy, into memory the trainer already has (DCP's in-place
    load), where :func:`read_verified` also faults in fresh memory that the trainer's
    ``load_state_dict`` then copies again. The caller re-reads the commit word afterwards
    (a writer that began over the slot meanwhile: the targets then hold its bytes, and
    must be loaded again; no writer runs beside a rank's own load).

    Raises:
        SlotFormatError: the table does not fit the length, or a chunk fails its crc32
            (named with its range); no target was written.
    """
    import torch

    expected = chunk_crcs(table, length, chunk_size)

    def check(index: int) -> None:
        start = index * chunk_size
        end = min(start + chunk_size, length)
        with memoryview(src) as view:
            piece = view[offset + start : offset + end]
            try:
                if zlib.crc32(piece) != expected[index]:
                    raise SlotFormatError(
                        f"payload chunk {index} (bytes {start}..{end}) fails its crc32"
                    )
            finally:
                piece.release()

    _pool_map(check, len(expected))
    out = [t if t is not None else torch.empty(e.shape, dtype=getattr(torch, e.dtype))
           for e, t in zip(items, targets, strict=True)]  # fmt: skip
    if not length:
        return out
    sources = []  # emptied at the end: no export of the slot's map outlives the read
    with warnings.catch_warnings():  # a read-only map: torch warns that it could write
        warnings.simplefilter("ignore", UserWarning)
        sources.append(torch.frombuffer(src, dtype=torch.uint8, count=length, offset=offset))
    pieces: list[tuple[int, int, int]] = []  # (tensor, first byte, end byte) in the tensor
    for index, (entry, dest) in enumerate(zip(items, out, strict=True)):
        if dest.device.type == "cpu" and dest.is_contiguous():
            pieces += [(index, a, min(a + chunk_size, entry.nbytes))
                       for a in range(0, entry.nbytes, chunk_size)]  # fmt: skip
        elif entry.nbytes:
            pieces.append((index, 0, -1))  # whole (another device, or strided): one copy

    def copy(number: int) -> None:
        index, start, end = pieces[number]
        entry, dest = items[index], out[index]
        base = entry.offset
        if end < 0:  # detached: a Parameter that requires grad is filled all the same
            raw = sources[0][base : base + entry.nbytes]
            dest.detach().copy_(raw.view(dest.dtype).view(dest.shape))
        else:
            flat = dest.detach().reshape(-1).view(torch.uint8)
            flat[start:end].copy_(sources[0][base + start : base + end])

    try:
        _pool_map(copy, len(pieces))
    finally:
        sources.clear()
    return out


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
