"""The slot format: the one codec of every writer and reader of a checkpoint slot.

A rank's checkpoint lives in three *slot* files on a memory-backed folder
(:func:`kelastic.contract.checkpoint_dir`); a save writes the slot that is not the last
committed one. One slot file::

    offset 0            header (HEADER_SIZE = 4096 bytes; the fields below, then zeros)
    offset 4096         chunk checksum table: chunk_count little-endian u32 (crc32 of each
                        chunk_size-byte chunk of the payload; the last one may be shorter)
    payload_offset      payload: the tensors' raw bytes, each at a TENSOR_ALIGN-aligned
                        offset (C order, the dtype's native little-endian layout; no pickle)
    manifest_offset     manifest: bounded JSON (UTF-8), see below
    (the rest of the file is spare capacity)

Header fields (little-endian, :data:`_HEADER`): magic ``KELCKPT\\0``, format version,
checksum algorithm (1: ``zlib.crc32``), header size, then the **commit word** at bytes
16..32 (commit sequence u64, commit check u32, zero u32), then step, round, rank, world
size, creation time (seconds since the epoch), the table's offset, chunk size, chunk
count and crc32, the manifest's offset, length and crc32, the payload's offset and
length, the job id (UTF-8, at most :data:`MAX_JOB_BYTES`), and last the header crc32 over
bytes 0..16 and 32..(end of the fields - 4): every field but the commit word.

The commit word is written last, alone (:func:`encode_commit`): its check is
``crc32(seq || header_crc)``, so a commit word from another header, a torn one, or zeros
(the slot was marked dirty before its payload was rewritten) commits nothing. A slot is
*committed* when the commit word is valid with ``seq > 0``; the newer of a rank's two
slots is the one with the higher sequence. The write order, the reason a crash never
tears the last committed step, is in :mod:`kelastic.checkpoint.store`.

The **staged word** at bytes 512..528 (step u64, check u32, zero u32; in the header's
zeros, outside its crc) says that every byte of the payload and the manifest was written
before it: :func:`encode_staged` binds it to the header as staged (its chunk table's
crc still 0: :func:`staged_header_crc`) and to the machine's boot (``boot``, the kernel's
boot id), so that a slot whose writer died between the end of its staging and its commit
can be committed by whoever next holds the rank's lock (:mod:`kelastic.checkpoint.finish`)
in the same boot, and never after a machine restart (a disk-backed folder may then hold
the word without the payload). A slot marked dirty has zeros there too.

The manifest (:func:`encode_manifest` / :func:`decode_manifest`)::

    {"format": 1,
     "tensors": [[dtype, [dim, ...], offset, nbytes], ...],   # offsets in the payload
     "tree": <the state dict with tensors as ["T", index]>}     # kelastic.checkpoint.tree

Decoding is bounded like every decoder of data that crosses a process boundary in
kelastic (``kelastic._safejson``): the manifest at most :data:`MAX_MANIFEST_BYTES`,
nested at most :data:`MAX_MANIFEST_DEPTH`, integers of at most 19 digits, finite numbers
(``NaN``/``Infinity`` literals refused: a non-finite float of the state is stored as
``["f", "nan"]``); every offset and length is checked against the file and the payload
before anything is read, and raises :class:`SlotFormatError` (a ``ValueError``) and
nothing else, whatever the bytes. The writer is strict (:func:`encode_header` refuses
what :func:`decode_header` would), so nothing written is refused by a reader.

Semantics come from DLRover flash checkpoint (a rank's tensors copied as raw bytes into
shared memory with a small metadata record beside them), NVRx local checkpointing (a
per-rank file, dirty until complete), and torch DCP (tensors as raw bytes described by a
metadata record: dtype, shape, offset, length). Stdlib only, no I/O.

Over ~400 lines because it is the format's one codec: header, commit word, layout,
checksums and manifest are written and read by these functions alone, and their bounds
must agree field by field (the writer refuses what the reader refuses).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from kelastic._safejson import UnsafeJSONError, loads_bounded

__all__ = [
    "COMMIT_OFFSET",
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_CHUNKS",
    "MAX_JOB_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_RANK",
    "MAX_ROUND",
    "MAX_STEP",
    "STAGED_OFFSET",
    "TENSOR_ALIGN",
    "Layout",
    "Manifest",
    "SlotFormatError",
    "SlotHeader",
    "TensorEntry",
    "chunk_checksums",
    "chunk_crcs",
    "decode_commit",
    "decode_header",
    "decode_header_as_staged",
    "decode_manifest",
    "decode_staged",
    "decode_table_and_manifest",
    "encode_commit",
    "encode_header",
    "encode_manifest",
    "encode_staged",
    "encode_table",
    "layout",
    "staged_header_crc",
    "verify_chunks",
]

MAGIC: Final = b"KELCKPT\0"
FORMAT_VERSION: Final = 1
#: ``zlib.crc32`` (the only algorithm of format 1).
CHECKSUM_CRC32: Final = 1
#: Bytes reserved for the header at the start of a slot file.
HEADER_SIZE: Final = 4096
#: Where the commit word (seq u64, check u32, zero u32) lies in the header.
COMMIT_OFFSET: Final = 16
_COMMIT: Final = struct.Struct("<QII")
#: Where the staged word (step u64, check u32, zero u32) lies in the header.
STAGED_OFFSET: Final = 512
_STAGED_TAG: Final = b"kelastic-staged\0"
_FIELDS: Final = struct.Struct("<qqIId" + "qqII" + "qqI" + "qq" + "H256s" + "I")
_HEAD: Final = struct.Struct("<8sHHI")
#: offset of the fields after the commit word
_FIELDS_OFFSET: Final = COMMIT_OFFSET + _COMMIT.size
_HEADER_END: Final = _FIELDS_OFFSET + _FIELDS.size
#: Highest step or round a writer stores (2**53: exact as a JSON number anywhere).
MAX_STEP: Final = 2**53
MAX_ROUND: Final = 2**53
#: Highest global rank (and world size - 1).
MAX_RANK: Final = 2**31 - 2
MAX_JOB_BYTES: Final = 256
#: Largest manifest, bytes; deepest nesting of its JSON (the tree gets 2 levels less).
MAX_MANIFEST_BYTES: Final = 64 * 1024 * 1024
MAX_MANIFEST_DEPTH: Final = 34
#: Most chunks (table entries) of a payload; chunks grow past 4 MiB beyond 256 GiB.
MAX_CHUNKS: Final = 65536
MIN_CHUNK_SIZE: Final = 4 * 1024 * 1024
MAX_CHUNK_SIZE: Final = 2**40
#: Alignment of every tensor in the payload (any dtype's view of it is aligned).
TENSOR_ALIGN: Final = 64
#: Alignment of the payload in the file (a page).
PAGE: Final = 4096
#: Longest tensor shape and largest dimension.
MAX_NDIM: Final = 64
MAX_DIM: Final = 2**53
#: Latest creation time accepted, seconds since the epoch.
MAX_TIME: Final = 1e11

#: The dtypes a slot holds (torch's names) and their element sizes in bytes.
DTYPE_SIZES: Final[dict[str, int]] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}  # fmt: skip


class SlotFormatError(ValueError):
    """A slot's header, commit word or manifest is corrupt, forged, or outside the
    format's bounds (from the encoders: a value no writer may store). The message says
    which field and why."""


@dataclass(frozen=True)
class Layout:
    """Where a save puts its parts in a slot file (offsets and lengths in bytes)."""

    chunk_size: int
    chunk_count: int
    payload_offset: int
    payload_len: int
    manifest_offset: int
    manifest_len: int

    @property
    def file_size(self) -> int:
        """The smallest slot file that holds this layout, bytes."""
        return self.manifest_offset + self.manifest_len


@dataclass(frozen=True)
class SlotHeader:
    """A slot's header (see the module doc). ``seq`` is the commit sequence (0: not
    committed); ``header_crc`` is filled by :func:`decode_header` (0 before encoding)."""

    step: int
    round: int
    rank: int
    world_size: int
    job: str
    created: float
    layout: Layout
    table_crc: int
    manifest_crc: int
    seq: int = 0
    header_crc: int = 0


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the payload: dtype name, shape, offset in the payload, bytes."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """A decoded manifest: the tensors and the encoded tree (checked, not yet built)."""

    tensors: tuple[TensorEntry, ...]
    tree: Any


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def layout(payload_len: int, manifest_len: int) -> Layout:
    """The layout of a save of ``payload_len`` payload bytes and a manifest of
    ``manifest_len`` bytes: chunks of at least 4 MiB (doubled until at most
    :data:`MAX_CHUNKS`), the table after the header, the payload page-aligned after it,
    the manifest 8-aligned after the payload."""
    chunk = MIN_CHUNK_SIZE
    while -(-payload_len // chunk) > MAX_CHUNKS:
        chunk *= 2
    count = -(-payload_len // chunk)
    payload_offset = _align(HEADER_SIZE + 4 * count, PAGE)
    manifest_offset = _align(payload_offset + payload_len, 8)
    return Layout(chunk, count, payload_offset, payload_len, manifest_offset, manifest_len)


# ------------------------------------------------------------------ checksums


def chunk_checksums(payload: memoryview, chunk_size: int) -> list[int]:
    """crc32 of each ``chunk_size``-byte chunk of ``payload`` (``zlib.crc32`` releases
    the GIL on each chunk, so a committing thread leaves the trainer's thread running)."""
    return [
        zlib.crc32(payload[start : start + chunk_size])
        for start in range(0, len(payload), chunk_size)
    ]


def encode_table(checksums: Sequence[int]) -> bytes:
    """The chunk table's bytes (little-endian u32 each)."""
    return struct.pack(f"<{len(checksums)}I", *checksums)


def chunk_crcs(table: bytes, length: int, chunk_size: int) -> tuple[int, ...]:
    """The crc32 of each ``chunk_size``-byte chunk of a ``length``-byte payload, read
    from its chunk ``table``.

    Raises:
        SlotFormatError: the table's size does not match the payload's chunks.
    """
    count = -(-length // chunk_size)
    if len(table) != 4 * count:
        raise SlotFormatError(f"checksum table of {len(table)} bytes for {count} chunks")
    return struct.unpack(f"<{count}I", table)


def verify_chunks(payload: memoryview, table: bytes, chunk_size: int) -> None:
    """Check ``payload`` against the chunk ``table`` (the sidecar's scan; a load copies
    and checks at once: ``kelastic.checkpoint._tensors.read_verified``).

    Raises:
        SlotFormatError: the table's size does not match, or a chunk's crc32 differs
            (the message names the chunk and its byte range).
    """
    expected = chunk_crcs(table, len(payload), chunk_size)
    for index, start in enumerate(range(0, len(payload), chunk_size)):
        if zlib.crc32(payload[start : start + chunk_size]) != expected[index]:
            end = min(start + chunk_size, len(payload))
            raise SlotFormatError(f"payload chunk {index} (bytes {start}..{end}) fails its crc32")


# ------------------------------------------------------------------ header


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise SlotFormatError(f"{name} {value} is outside {low}..{high}")


def _check_header(h: SlotHeader, file_size: int | None) -> None:
    """The bounds every header satisfies (writer and reader alike)."""
    _check_range("step", h.step, 0, MAX_STEP)
    _check_range("round", h.round, -1, MAX_ROUND)
    _check_range("rank", h.rank, 0, MAX_RANK)
    if h.world_size != 0 and not h.rank < h.world_size <= MAX_RANK + 1:
        raise SlotFormatError(f"world size {h.world_size} does not hold rank {h.rank}")
    if not (math.isfinite(h.created) and 0 <= h.created <= MAX_TIME):
        raise SlotFormatError(f"creation time {h.created} is outside 0..{MAX_TIME:g}")
    if len(h.job.encode("utf-8", "surrogatepass")) > MAX_JOB_BYTES:
        raise SlotFormatError(f"job id of over {MAX_JOB_BYTES} bytes")
    lay = h.layout
    for name, value in (("chunk size", lay.chunk_size), ("chunk count", lay.chunk_count),
                        ("payload offset", lay.payload_offset), ("payload length", lay.payload_len),
                        ("manifest offset", lay.manifest_offset),
                        ("manifest length", lay.manifest_len)):  # fmt: skip
        if value < 0:
            raise SlotFormatError(f"{name} {value} is negative")
    _check_range("manifest length", lay.manifest_len, 2, MAX_MANIFEST_BYTES)
    _check_range("chunk size", lay.chunk_size, MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
    _check_range("chunk count", lay.chunk_count, 0, MAX_CHUNKS)
    if lay.chunk_count != -(-lay.payload_len // lay.chunk_size):
        raise SlotFormatError(
            f"{lay.chunk_count} chunks of {lay.chunk_size} bytes for a payload of "
            f"{lay.payload_len} bytes"
        )
    if lay.payload_offset % PAGE or lay.payload_offset < HEADER_SIZE + 4 * lay.chunk_count:
        raise SlotFormatError(f"payload offset {lay.payload_offset} overlaps the header or table")
    if lay.manifest_offset < lay.payload_offset + lay.payload_len:
        raise SlotFormatError(
            f"manifest offset {lay.manifest_offset} is inside the payload "
            f"({lay.payload_offset}..{lay.payload_offset + lay.payload_len})"
        )
    if file_size is not None and lay.file_size > file_size:
        raise SlotFormatError(
            f"the manifest ends at byte {lay.file_size}, past the end of the "
            f"{file_size}-byte slot file"
        )


def encode_header(h: SlotHeader) -> tuple[bytes, int]:
    """The header's bytes (commit word zero: :func:`encode_commit` writes it) and its crc.

    Raises:
        SlotFormatError: a field outside the format's bounds (what a reader refuses).
    """
    _check_header(h, None)
    lay = h.layout
    job = h.job.encode("utf-8")
    fields = _FIELDS.pack(
        h.step, h.round, h.rank, h.world_size, h.created,
        HEADER_SIZE, lay.chunk_size, lay.chunk_count, h.table_crc,
        lay.manifest_offset, lay.manifest_len, h.manifest_crc,
        lay.payload_offset, lay.payload_len,
        len(job), job, 0,
    )  # fmt: skip
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, CHECKSUM_CRC32, HEADER_SIZE)
    crc = zlib.crc32(fields[:-4], zlib.crc32(head))
    return head + bytes(_COMMIT.size) + fields[:-4] + struct.pack("<I", crc), crc


def encode_commit(seq: int, header_crc: int) -> bytes:
    """The commit word of sequence ``seq`` (``seq == 0``: the slot is dirty) for the
    header whose crc is ``header_crc``: 16 bytes at :data:`COMMIT_OFFSET`."""
    if not 0 <= seq < 2**63:
        raise SlotFormatError(f"commit sequence {seq} is outside 0..2**63-1")
    if seq == 0:
        return bytes(_COMMIT.size)
    return _COMMIT.pack(seq, zlib.crc32(struct.pack("<QI", seq, header_crc)), 0)


def decode_commit(raw: bytes, header_crc: int) -> int:
    """The commit sequence in the 16-byte commit word ``raw`` for the header whose crc is
    ``header_crc``: 0 when the slot is not committed (zeros, torn, from another header,
    or a sequence past 2**63 - 1). Never raises on 16 bytes."""
    if len(raw) != _COMMIT.size:
        raise SlotFormatError(f"commit word of {len(raw)} bytes")
    seq, check, zero = _COMMIT.unpack(raw)
    if seq == 0 or zero != 0 or seq >= 2**63:
        return 0
    return seq if check == zlib.crc32(struct.pack("<QI", seq, header_crc)) else 0


def staged_header_crc(h: SlotHeader) -> int:
    """The crc of ``h`` as staged: its chunk table's crc 0 (the commit fills it in), so
    a header rewritten by a commit cut short still matches its staged word.

    Raises:
        SlotFormatError: a field outside the format's bounds.
    """
    return encode_header(replace(h, table_crc=0, seq=0, header_crc=0))[1]


def _staged_check(step: int, header_crc: int, boot: bytes) -> int:
    tagged = zlib.crc32(struct.pack("<QI", step, header_crc), zlib.crc32(_STAGED_TAG))
    return zlib.crc32(boot, tagged)


def encode_staged(step: int, header_crc: int, boot: bytes) -> bytes:
    """The staged word (16 bytes at :data:`STAGED_OFFSET`) of a slot holding ``step``
    whose header as staged has crc ``header_crc`` (:func:`staged_header_crc`), written in
    the boot whose id is ``boot`` (any bytes; ``b""`` when unknown).

    Raises:
        SlotFormatError: ``step`` outside 0..2**53.
    """
    _check_range("step", step, 0, MAX_STEP)
    return _COMMIT.pack(step, _staged_check(step, header_crc, boot), 0)


def decode_staged(raw: bytes, h: SlotHeader, boot: bytes) -> bool:
    """Whether the 16-byte staged word ``raw`` says that the slot whose header is ``h``
    was wholly staged in the boot ``boot`` (zeros, a torn word, one of another header,
    step or boot: False). Never raises on 16 bytes of a decoded header.

    Raises:
        SlotFormatError: ``raw`` is not 16 bytes.
    """
    if len(raw) != _COMMIT.size:
        raise SlotFormatError(f"staged word of {len(raw)} bytes")
    step, check, zero = _COMMIT.unpack(raw)
    if zero != 0 or step != h.step:
        return False
    expected: int = _staged_check(step, staged_header_crc(h), boot)
    return bool(check == expected)


def decode_header(raw: bytes, *, file_size: int) -> SlotHeader:
    """Decode and check a slot's header (the first :data:`HEADER_SIZE` bytes, or more).

    Args:
        raw: the header's bytes.
        file_size: the slot file's size, bytes: every offset and length must lie in it.

    Returns:
        The header; ``seq`` is its commit sequence (0: not committed).

    Raises:
        SlotFormatError: not a slot (magic), another format version or checksum
            algorithm, a crc mismatch, or a field outside its bounds (negative lengths,
            lengths past the file, a rank past the world size, ...).
    """
    return _decode_header(raw, file_size, check_crc=True)


def decode_header_as_staged(raw: bytes, *, file_size: int) -> SlotHeader:
    """A slot's header as it was staged, for a slot whose staged word then vouches for it
    (:func:`decode_staged`): its fields without the header's crc check, with chunk table
    crc 0 and ``seq`` 0. A commit cut within its header's rewrite (a SIGKILL during
    that copy) leaves the table crc and the header crc torn, the only fields the commit
    changes; the staged word binds every other one (:func:`staged_header_crc`), so a
    header it matches is the staged one whatever the tear left.

    Raises:
        SlotFormatError: as :func:`decode_header`, but for the crc.
    """
    h = _decode_header(raw, file_size, check_crc=False)
    return replace(h, table_crc=0, seq=0, header_crc=staged_header_crc(h))


def _decode_header(raw: bytes, file_size: int, *, check_crc: bool) -> SlotHeader:
    if len(raw) < _HEADER_END:
        raise SlotFormatError(f"header of {len(raw)} bytes, under {_HEADER_END}")
    magic, version, algorithm, header_size = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise SlotFormatError(f"not a kelastic checkpoint slot (magic {magic!r})")
    if version != FORMAT_VERSION or algorithm != CHECKSUM_CRC32 or header_size != HEADER_SIZE:
        raise SlotFormatError(
            f"slot format {version} (checksum {algorithm}, header {header_size} bytes); "
            f"this reader knows format {FORMAT_VERSION}"
        )
    fields = raw[_FIELDS_OFFSET:_HEADER_END]
    crc = zlib.crc32(fields[:-4], zlib.crc32(raw[:COMMIT_OFFSET]))
    (step, round_, rank, world, created, table_offset, chunk_size, chunk_count, table_crc,
     manifest_offset, manifest_len, manifest_crc, payload_offset, payload_len,
     job_len, job_raw, stored_crc) = _FIELDS.unpack(fields)  # fmt: skip
    if check_crc and crc != stored_crc:
        raise SlotFormatError("header fails its crc32")
    if table_offset != HEADER_SIZE:
        raise SlotFormatError(f"checksum table at {table_offset}, not {HEADER_SIZE}")
    if job_len > MAX_JOB_BYTES:
        raise SlotFormatError(f"job id of {job_len} bytes, over {MAX_JOB_BYTES}")
    if job_raw[job_len:].count(0) != MAX_JOB_BYTES - job_len:
        raise SlotFormatError(f"job id field has bytes past its {job_len}")
    try:
        job = job_raw[:job_len].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SlotFormatError(f"job id is not UTF-8: {exc.reason}") from None
    lay = Layout(chunk_size, chunk_count, payload_offset, payload_len, manifest_offset,
                 manifest_len)  # fmt: skip
    header = SlotHeader(step, round_, rank, world, job, created, lay, table_crc, manifest_crc,
                        header_crc=crc)  # fmt: skip
    _check_header(header, file_size)
    seq = decode_commit(raw[COMMIT_OFFSET:_FIELDS_OFFSET], crc)
    return SlotHeader(step, round_, rank, world, job, created, lay, table_crc, manifest_crc,
                      seq=seq, header_crc=crc)  # fmt: skip


# ------------------------------------------------------------------ manifest


def encode_manifest(tensors: Sequence[TensorEntry], tree: Any) -> bytes:
    """The manifest's bytes (compact JSON, ASCII, no NaN literal).

    Raises:
        SlotFormatError: it would be refused by :func:`decode_manifest` (too large).
    """
    doc = {
        "format": FORMAT_VERSION,
        "tensors": [[t.dtype, list(t.shape), t.offset, t.nbytes] for t in tensors],
        "tree": tree,
    }
    try:
        raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("ascii")
    except ValueError as exc:  # a non-finite float the tree failed to encode
        raise SlotFormatError(f"manifest is not JSON: {exc}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise SlotFormatError(f"manifest of {len(raw)} bytes, over {MAX_MANIFEST_BYTES}")
    return raw


def _int(value: Any, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SlotFormatError(f"{what} must be an integer, got {value!r:.40}")
    _check_range(what, value, low, high)
    return value


def _entry(raw: Any, index: int, payload_len: int, previous_end: int) -> TensorEntry:
    what = f"tensor {index}"
    if not isinstance(raw, list) or len(raw) != 4:
        raise SlotFormatError(f"{what} must be [dtype, shape, offset, nbytes]")
    dtype, shape, offset, nbytes = raw
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise SlotFormatError(f"{what} has an unknown dtype {dtype!r:.40}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise SlotFormatError(f"{what}'s shape must be a list of at most {MAX_NDIM} dims")
    dims = tuple(_int(d, f"{what}'s dim", 0, MAX_DIM) for d in shape)
    offset = _int(offset, f"{what}'s offset", 0, payload_len)
    nbytes = _int(nbytes, f"{what}'s length", 0, payload_len)
    elements = DTYPE_SIZES[dtype]
    for dim in dims:  # bounded: stops once past the payload
        elements *= dim
        if elements > payload_len:
            break
    if elements != nbytes:
        raise SlotFormatError(f"{what}: {dtype}{list(dims)} is not {nbytes} bytes")
    if offset % TENSOR_ALIGN or offset < previous_end or offset + nbytes > payload_len:
        raise SlotFormatError(
            f"{what} at bytes {offset}..{offset + nbytes} is misaligned, overlaps the one "
            f"before (ending at {previous_end}) or ends past the {payload_len}-byte payload"
        )
    return TensorEntry(dtype, dims, offset, nbytes)


def decode_manifest(raw: bytes, *, payload_len: int) -> Manifest:
    """Decode and check a manifest (its crc was checked by the caller).

    Args:
        raw: the manifest's bytes.
        payload_len: the payload's length from the header, bytes: every tensor lies in it.

    Returns:
        The tensors (in payload order, none overlapping) and the tree, checked by
        :func:`kelastic.checkpoint.tree.check_tree` (each tensor referenced once).

    Raises:
        SlotFormatError: not bounded JSON (size, depth, numbers, NaN), or a field outside
            its bounds.
    """
    from .tree import TreeError, check_tree

    try:
        doc = loads_bounded(raw, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_MANIFEST_DEPTH)
    except UnsafeJSONError as exc:
        raise SlotFormatError(f"manifest: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"format", "tensors", "tree"}:
        raise SlotFormatError("manifest must be an object of format, tensors and tree")
    if doc["format"] != FORMAT_VERSION or isinstance(doc["format"], bool):
        raise SlotFormatError(f"manifest format {doc['format']!r:.40}")
    if not isinstance(doc["tensors"], list):
        raise SlotFormatError("manifest tensors must be a list")
    entries: list[TensorEntry] = []
    end = 0
    for index, item in enumerate(doc["tensors"]):
        entry = _entry(item, index, payload_len, end)
        entries.append(entry)
        end = entry.offset + entry.nbytes
    try:
        check_tree(doc["tree"], len(entries))
    except TreeError as exc:
        raise SlotFormatError(f"manifest tree: {exc}") from None
    return Manifest(tuple(entries), doc["tree"])


def decode_table_and_manifest(
    read: Callable[[int, int], bytes], h: SlotHeader
) -> tuple[bytes, Manifest]:
    """The checksum table and the decoded manifest of the slot whose header is ``h``, each
    checked against the header's crc32; ``read(offset, length)`` reads the slot's bytes
    (every reader of a slot: the load, the sidecar's scan, the persistence).

    Raises:
        SlotFormatError: the table or the manifest fails its crc32, or the manifest does
            not decode (see :func:`decode_manifest`).
    """
    lay = h.layout
    table = read(HEADER_SIZE, 4 * lay.chunk_count)
    if zlib.crc32(table) != h.table_crc:
        raise SlotFormatError("the checksum table fails its crc32")
    raw = read(lay.manifest_offset, lay.manifest_len)
    if zlib.crc32(raw) != h.manifest_crc:
        raise SlotFormatError("the manifest fails its crc32")
    return table, decode_manifest(raw, payload_len=lay.payload_len)
