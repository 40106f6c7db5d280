"""torch DCP's file-system format, written without torch: the persisted checkpoint's codec.

A DCP checkpoint (``torch.distributed.checkpoint``, ``FileSystemWriter``, torch 2.4+) is
a folder with ``.metadata`` (a pickled ``Metadata``) and data files (``__<rank>_<n>.distcp``)
in which each item of the flattened state dict is a ``torch.save`` archive at an offset:
a tensor as the tensor, any other value as the value. ``dcp.load(template,
checkpoint_id=folder)`` reads it back into a template of the same structure, without a
process group (``no_dist``).

The sidecar, which holds the slots and has no torch, writes this format itself:

- :func:`flatten` gives the state dict's items as DCP names them (``"model.weight"``,
  ``"optim.state.0.exp_avg"``): mappings are walked (keys by ``str``), a list only when it
  holds a tensor or a container that does (``traverse_state_dict``'s rules since torch
  2.4); every other value is one item. Two paths that name one item raise
  :class:`DcpFormatError` (DCP's "duplicated flatten key").
- :func:`write_torch_save` writes one item as ``torch.save`` does (a stored zip with
  ``data.pkl``, ``byteorder``, ``version`` and each tensor's bytes as ``data/<key>``);
  the pickle is protocol 2 made of the globals ``torch.load(weights_only=True)`` allows
  (``torch._utils._rebuild_tensor_v3``, ``torch.storage.UntypedStorage``, the dtype,
  ``collections.OrderedDict``).
- :func:`metadata_pickle` writes ``.metadata``: ``Metadata``, ``TensorStorageMetadata``
  (one chunk, at offset zero: the rank's whole tensor), ``BytesStorageMetadata``,
  ``MetadataIndex``, ``_StorageInfo``, ``StorageMeta``, by name, as torch 2.13 pickles
  them (``tests/worker_lib/test_dcp_persist.py`` loads every output with torch itself).

Tensors are :class:`RawTensor`: dtype name, shape, and a buffer of their bytes (a view of
the slot's map: nothing is copied before the file write). Stdlib only; no file is opened
here (the writers take a binary stream).

Over ~400 lines because it is one format: the names :func:`flatten` gives are the keys of
the metadata, the archives' pickles use the same writer and torch globals as the
metadata's, and a change to one (a torch version's field) is checked against the others
by the same test.
"""

from __future__ import annotations

import math
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Final, cast

from .slot_format import DTYPE_SIZES

__all__ = [
    "DCP_VERSION",
    "DcpFormatError",
    "DcpItem",
    "RawTensor",
    "flatten",
    "int_key_paths",
    "metadata_pickle",
    "write_torch_save",
]

#: The ``Metadata.version`` torch 2.13's writer stores.
DCP_VERSION: Final = "1.0.0"
_MD: Final = "torch.distributed.checkpoint.metadata"
_FS: Final = "torch.distributed.checkpoint.filesystem"
#: Bytes written per call when a tensor's bytes are copied into the archive.
_COPY_BLOCK: Final = 4 << 20


class DcpFormatError(ValueError):
    """A state that DCP's format cannot name (two paths flatten to one key, a dtype DCP
    does not store), or a value the pickle writer does not know."""


@dataclass(frozen=True)
class RawTensor:
    """A tensor as bytes: ``dtype`` (torch's name, a key of
    :data:`~kelastic.checkpoint.slot_format.DTYPE_SIZES`), ``shape``, and ``data``, a
    buffer of exactly ``numel * element size`` bytes, C-contiguous."""

    dtype: str
    shape: tuple[int, ...]
    data: Any

    @property
    def nbytes(self) -> int:
        """The tensor's bytes."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class DcpItem:
    """One item of the flattened state: DCP's name (``fqn``), the path that reached it
    (keys as ``str``, list positions as ``int``: ``Metadata.planner_data``), and the value
    (a :class:`RawTensor` is a tensor item; anything else is saved as bytes)."""

    fqn: str
    path: tuple[str | int, ...]
    value: Any


# ----------------------------------------------------------------------- flatten


def _holds_tensor(value: Any) -> bool:
    """DCP's ``_is_terminal`` negated for a list: it holds a tensor, a mapping, or a list
    that does (a walked list)."""
    for entry in value:
        if isinstance(entry, (RawTensor, Mapping)):
            return True
        if isinstance(entry, list) and _holds_tensor(entry):
            return True
    return False


def flatten(state: Mapping[Any, Any]) -> list[DcpItem]:
    """The items of ``state`` as DCP's default planner flattens them (see the module doc);
    an empty mapping or list contributes nothing, as in DCP.

    Raises:
        DcpFormatError: two paths give one name (``{"a.b": x, "a": {"b": y}}``).
    """
    items: list[DcpItem] = []
    seen: set[str] = set()

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                visit((*path, str(key)), inner)
            return
        if isinstance(value, list) and _holds_tensor(value):
            for index, inner in enumerate(value):
                visit((*path, index), inner)
            return
        fqn = ".".join(map(str, path))
        if fqn in seen:
            raise DcpFormatError(f"two paths of the state give the DCP key {fqn!r}")
        seen.add(fqn)
        items.append(DcpItem(fqn, path, value))

    for key, value in state.items():
        visit((str(key),), value)
    return items


def int_key_paths(state: Mapping[Any, Any]) -> list[list[str | int]]:
    """Where ``state`` has int mapping keys, which DCP's flattening turns into text (an
    optimizer's ``state``, ``{0: {...}}``, loads back from DCP as ``{"0": {...}}``, and
    ``Optimizer.load_state_dict`` then drops it without a word): each as the path DCP
    rebuilds (mapping keys as text, walked list indices as ints), the key last. kelastic's
    loader turns them back (:mod:`kelastic.checkpoint.from_disk`), so that a step loads
    from disk as it loads from memory. Other keys that are not text (bools, tuples) stay
    as DCP makes them."""
    found: list[list[str | int]] = []

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                if isinstance(key, int) and not isinstance(key, bool):
                    found.append([*path, str(key)])
                visit((*path, str(key)), inner)
        elif isinstance(value, list) and _holds_tensor(value):
            for index, inner in enumerate(value):
                visit((*path, index), inner)

    visit((), state)
    return found


# ------------------------------------------------------------------------ pickle


class _Pickle:
    """A protocol 2 pickle written opcode by opcode: only what the DCP format needs, no
    memo (a value written twice is two values), globals by name (no import)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.storages: list[RawTensor] = []

    def done(self) -> bytes:
        return bytes(self.out + b".")

    def global_(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def call(self, module: str, name: str, *args: Any) -> None:
        """``module.name(*args)``: REDUCE."""
        self.global_(module, name)
        self.value(tuple(args))
        self.out += b"R"

    def new(self, module: str, name: str, state: Any) -> None:
        """``cls.__new__(cls)`` then its state: NEWOBJ, BUILD (a dataclass's ``__dict__``
        or the argument of its ``__setstate__``)."""
        self.global_(module, name)
        self.out += b")\x81"
        self.value(state)
        self.out += b"b"

    def size(self, dims: Sequence[int]) -> None:
        self.call("torch", "Size", tuple(dims))

    def tensor(self, t: RawTensor) -> None:
        """``_rebuild_tensor_v3(storage, 0, size, stride, False, OrderedDict(), dtype)``,
        the storage a persistent id ``("storage", UntypedStorage, key, "cpu", nbytes)``."""
        key = str(len(self.storages))
        self.storages.append(t)
        stride, acc = [], 1
        for dim in reversed(t.shape):
            stride.append(acc)
            acc *= dim
        self.global_("torch._utils", "_rebuild_tensor_v3")
        self.out += b"(("
        self.value("storage")
        self.global_("torch.storage", "UntypedStorage")
        self.value(key)
        self.value("cpu")
        self.value(t.nbytes)
        self.out += b"tQ"
        self.value(0)
        self.value(tuple(t.shape))
        self.value(tuple(reversed(stride)))
        self.value(False)
        self.call("collections", "OrderedDict")
        self.global_("torch", t.dtype)
        self.out += b"tR"

    def value(self, v: Any) -> None:
        if v is None:
            self.out += b"N"
        elif v is True or v is False:
            self.out += b"\x88" if v else b"\x89"
        elif isinstance(v, int):
            self._int(v)
        elif isinstance(v, float):
            self.out += b"G" + struct.pack(">d", v)
        elif isinstance(v, str):
            raw = v.encode("utf-8", "surrogatepass")
            self.out += b"X" + struct.pack("<I", len(raw)) + raw
        elif isinstance(v, RawTensor):
            self.tensor(v)
        elif isinstance(v, _Call):
            v.write(self)
        elif isinstance(v, tuple):
            self.out += b"("
            for item in v:
                self.value(item)
            self.out += b"t"
        elif isinstance(v, list):
            self.out += b"]("
            for item in v:
                self.value(item)
            self.out += b"e"
        elif isinstance(v, OrderedDict):
            self.call("collections", "OrderedDict")
            self._items(v)
            meta = getattr(v, "_metadata", None)
            if meta is not None:  # torch's module versions: the instance's __dict__
                self.value({"_metadata": meta})
                self.out += b"b"
        elif isinstance(v, dict):
            self.out += b"}"
            self._items(v)
        else:
            raise DcpFormatError(f"a {type(v).__qualname__} has no pickle here")

    def _items(self, mapping: Mapping[Any, Any]) -> None:
        self.out += b"("
        for key, item in mapping.items():
            self.value(key)
            self.value(item)
        self.out += b"u"

    def _int(self, v: int) -> None:
        if 0 <= v < 0x100:
            self.out += b"K" + bytes([v])
        elif 0 <= v < 0x10000:
            self.out += b"M" + struct.pack("<H", v)
        elif -(2**31) <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            if len(raw) > 255:
                raise DcpFormatError(f"an int of {v.bit_length()} bits")
            self.out += b"\x8a" + bytes([len(raw)]) + raw


@dataclass(frozen=True)
class _Call:
    """A value written by a function of :class:`_Pickle` (a torch object by name)."""

    write: Callable[[_Pickle], None]


def _new(module: str, name: str, state: Any) -> _Call:
    return _Call(lambda p: p.new(module, name, state))


def _size(dims: Sequence[int]) -> _Call:
    return _Call(lambda p: p.size(dims))


def _properties(dtype: str) -> _Call:
    """``TensorProperties`` through its ``__setstate__``: (dtype, layout, requires_grad,
    memory-format code, pin_memory)."""

    def write(p: _Pickle) -> None:
        p.global_(_MD, "TensorProperties")
        p.out += b")\x81("
        p.global_("torch", dtype)
        p.call("torch.serialization", "_get_layout", "torch.strided")
        p.value(False)
        p.call(_MD, "_MEM_FORMAT_ENCODING", 0)  # contiguous
        p.value(False)
        p.out += b"tb"

    return _Call(write)


# ---------------------------------------------------------------------- torch.save


def _archive_records(pickled: bytes, storages: Sequence[RawTensor]) -> Iterator[tuple[str, Any]]:
    yield "data.pkl", pickled
    yield ".format_version", b"1"
    yield ".storage_alignment", b"64"
    yield "byteorder", b"little"
    for key, t in enumerate(storages):
        yield f"data/{key}", t
    yield "version", b"3\n"


class _FromHere:
    """``out`` seen from its current position: a zip's offsets are the archive's own, as
    DCP's reader hands ``torch.load`` a view of the data file from the item's offset
    (``zipfile`` stores positions of the whole file, which only readers that allow data
    before an archive accept; torch's does not)."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._base = out.tell()

    def write(self, data: Any) -> int:
        return self._out.write(data)

    def tell(self) -> int:
        return self._out.tell() - self._base

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            offset += self._base
        return self._out.seek(offset, whence) - self._base

    def seekable(self) -> bool:
        return True

    def flush(self) -> None:
        self._out.flush()


def write_torch_save(value: Any, out: IO[bytes], name: str = "archive") -> None:
    """Write ``value`` (plain values, tuples, lists, dicts, OrderedDicts, :class:`RawTensor`)
    to ``out`` as ``torch.save(value, out)`` would: ``torch.load(..., weights_only=True)``
    reads it back (a tensor's bytes are copied from its buffer in 4 MiB blocks).

    Raises:
        DcpFormatError: a value the writer does not know, or an int beyond 2040 bits.
        KeyError: a tensor dtype the format does not know.
    """
    pickle = _Pickle()
    pickle.value(value)
    pickled = pickle.done()
    here = cast(IO[bytes], _FromHere(out))
    with zipfile.ZipFile(here, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for record, data in _archive_records(pickled, pickle.storages):
            info = zipfile.ZipInfo(f"{name}/{record}", date_time=(1980, 1, 1, 0, 0, 0))
            if isinstance(data, RawTensor):
                info.file_size = data.nbytes
                with zf.open(info, "w", force_zip64=data.nbytes >= 1 << 31) as fh, \
                        memoryview(data.data).cast("B") as view:  # fmt: skip
                    if len(view) != data.nbytes:
                        raise DcpFormatError(
                            f"a {data.dtype} tensor of shape {data.shape} needs "
                            f"{data.nbytes} bytes, its buffer has {len(view)}"
                        )
                    for start in range(0, len(view), _COPY_BLOCK):
                        fh.write(view[start : start + _COPY_BLOCK])
            else:
                zf.writestr(info, data)


# ---------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class StoredItem:
    """Where an item went: its data file (relative to the checkpoint folder), offset and
    length in it, bytes."""

    item: DcpItem
    relative_path: str
    offset: int
    length: int


def metadata_pickle(stored: Sequence[StoredItem], save_id: str) -> bytes:
    """``.metadata`` for the items written (:class:`StoredItem`), as torch 2.13's
    ``FileSystemWriter`` pickles its ``Metadata`` (version :data:`DCP_VERSION`).
    ``save_id`` goes to ``StorageMeta.save_id``; ``checkpoint_id`` stays ``None`` (the
    folder may be moved)."""
    state_dict_metadata: dict[str, Any] = {}
    planner_data: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    for s in stored:
        item = s.item
        planner_data[item.fqn] = item.path
        info = _new(_FS, "_StorageInfo", {
            "relative_path": s.relative_path, "offset": s.offset, "length": s.length,
        })  # fmt: skip
        if isinstance(item.value, RawTensor):
            zeros = _size([0] * len(item.value.shape))
            chunk = _new(_MD, "ChunkStorageMetadata", {
                "offsets": zeros, "sizes": _size(item.value.shape),
            })  # fmt: skip
            state_dict_metadata[item.fqn] = _new(_MD, "TensorStorageMetadata", {
                "properties": _properties(item.value.dtype),
                "size": _size(item.value.shape),
                "chunks": [chunk],
            })  # fmt: skip
            index = _new(_MD, "MetadataIndex", {"fqn": item.fqn, "offset": zeros, "index": 0})
        else:
            state_dict_metadata[item.fqn] = _new(_MD, "BytesStorageMetadata", {})
            index = _new(_MD, "MetadataIndex", {"fqn": item.fqn, "offset": None, "index": None})
        storage_data[index] = info
    meta = _new(_MD, "StorageMeta", {
        "checkpoint_id": None, "save_id": save_id, "load_id": None, "modules": [],
    })  # fmt: skip
    p = _Pickle()
    p.value(_new(_MD, "Metadata", {
        "state_dict_metadata": state_dict_metadata,
        "planner_data": planner_data,
        "storage_data": storage_data,
        "storage_meta": meta,
        "version": DCP_VERSION,
    }))  # fmt: skip
    return p.done()
