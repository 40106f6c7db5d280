"""torch's side of a slot: which leaves are tensors, staging them, and reading them back.

torch is never imported here at module level: :func:`is_tensor` looks for it in
``sys.modules`` (a state dict with tensors in it means torch is imported), and the
functions that need it import it when called.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .slot_format import DTYPE_SIZES, TENSOR_ALIGN, TensorEntry
from .tree import TreeError


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
    use its intra-op threads)."""
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
                ).copy_(tensor.detach())
    finally:
        del whole


def tensors_from(buffer: bytearray, items: Sequence[TensorEntry]) -> list[Any]:
    """The tensors of ``items`` as views of ``buffer`` (the payload read back; the
    tensors keep it alive, so nothing is copied again)."""
    import torch

    out = []
    for entry in items:
        dtype = getattr(torch, entry.dtype)
        if entry.nbytes == 0:
            out.append(torch.empty(entry.shape, dtype=dtype))
            continue
        count = entry.nbytes // DTYPE_SIZES[entry.dtype]
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=entry.offset)
        out.append(flat.view(entry.shape))
    return out
