"""The slot format's decoders against crafted and fuzzed input (no torch needed).

Each decoder returns a value within the format's bounds or raises ``SlotFormatError``,
nothing else, whatever the bytes (``tests/test_decoder_fuzz.py``'s rule; the manifest
is also in its registry)."""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kelastic.checkpoint import slot_format as sf
from kelastic.checkpoint.slot_format import (
    COMMIT_OFFSET,
    HEADER_SIZE,
    Layout,
    SlotFormatError,
    SlotHeader,
    TensorEntry,
    decode_commit,
    decode_header,
    decode_header_as_staged,
    decode_manifest,
    encode_commit,
    encode_header,
    encode_manifest,
    layout,
    staged_header_crc,
)
from kelastic.checkpoint.tree import TreeError, build, check_tree, flatten

FUZZ = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
HUGE = "9" * 5000
FILE = 1 << 30

LAYOUT = layout(payload_len=1 << 20, manifest_len=300)
HEADER = SlotHeader(step=42, round=3, rank=1, world_size=4, job="job-uid", created=1.7e9,
                    layout=LAYOUT, table_crc=123, manifest_crc=456)  # fmt: skip
FIELDS = dict(step=42, round=3, rank=1, world=4, created=1.7e9, table_offset=HEADER_SIZE,
              chunk_size=LAYOUT.chunk_size, chunk_count=LAYOUT.chunk_count, table_crc=123,
              manifest_offset=LAYOUT.manifest_offset, manifest_len=300, manifest_crc=456,
              payload_offset=LAYOUT.payload_offset, payload_len=1 << 20, job_len=7,
              job=b"job-uid")  # fmt: skip


def forge(seq: int = 5, magic: bytes = sf.MAGIC, version: int = sf.FORMAT_VERSION,
          **changes: Any) -> bytes:  # fmt: skip
    """A header with any field values and a correct crc (the bounds are what is tested)."""
    f = {**FIELDS, **changes}
    fields = sf._FIELDS.pack(*f.values(), 0)
    head = sf._HEAD.pack(magic, version, sf.CHECKSUM_CRC32, HEADER_SIZE)
    crc = zlib.crc32(fields[:-4], zlib.crc32(head))
    body = fields[:-4] + struct.pack("<I", crc)
    return head + encode_commit(seq, crc) + body + bytes(HEADER_SIZE - 16 - 16 - len(body))


def test_the_writers_header_reads_back_and_commits_only_with_its_word() -> None:
    raw, crc = encode_header(HEADER)
    assert decode_header(raw, file_size=FILE) == HEADER.__class__(
        **{**HEADER.__dict__, "header_crc": crc}
    )
    committed = raw[:COMMIT_OFFSET] + encode_commit(7, crc) + raw[COMMIT_OFFSET + 16 :]
    assert decode_header(committed, file_size=FILE).seq == 7
    assert decode_commit(encode_commit(7, crc ^ 1), crc) == 0  # another header's word
    assert decode_commit(bytes(16), crc) == 0
    torn = bytearray(encode_commit(7, crc))
    torn[3] ^= 1
    assert decode_commit(bytes(torn), crc) == 0
    assert decode_header(forge(), file_size=FILE).seq == 5  # forge() is what the writer makes


def test_the_staged_word_binds_its_header_as_staged_its_step_and_its_boot() -> None:
    staged = sf.staged_header_crc(HEADER)
    assert staged == encode_header(replace(HEADER, table_crc=0))[1]
    word = sf.encode_staged(42, staged, b"boot-a")
    assert sf.decode_staged(word, HEADER, b"boot-a")
    # the commit's rewrite of the header (the table's crc filled in) still matches
    assert sf.decode_staged(word, replace(HEADER, table_crc=999, seq=3), b"boot-a")
    assert not sf.decode_staged(word, HEADER, b"boot-b")  # after a machine's restart
    assert not sf.decode_staged(word, replace(HEADER, step=43), b"boot-a")
    assert not sf.decode_staged(word, replace(HEADER, manifest_crc=1), b"boot-a")
    assert not sf.decode_staged(bytes(16), HEADER, b"boot-a")  # dirty
    torn = bytearray(word)
    torn[9] ^= 1
    assert not sf.decode_staged(bytes(torn), HEADER, b"boot-a")
    assert not sf.decode_staged(word[:12] + b"\x01\0\0\0", HEADER, b"boot-a")  # zero field
    with pytest.raises(SlotFormatError, match="staged word of 3 bytes"):
        sf.decode_staged(b"abc", HEADER, b"")
    with pytest.raises(SlotFormatError, match="step"):
        sf.encode_staged(2**60, staged, b"")
    # the word lies in the header's zeros, outside every field and the header's crc
    assert sf._HEADER_END <= sf.STAGED_OFFSET and sf.STAGED_OFFSET + 16 <= HEADER_SIZE


@FUZZ
@given(raw=st.binary(min_size=16, max_size=16), boot=st.binary(max_size=40))
def test_fuzz_staged_words(raw: bytes, boot: bytes) -> None:
    """Any 16 bytes: a bool, never an error; True only for the writer's own word."""
    assert sf.decode_staged(raw, HEADER, boot) is (
        raw == sf.encode_staged(HEADER.step, sf.staged_header_crc(HEADER), boot)
    )


@pytest.mark.parametrize("changes,message", [
    ({"step": 2**62}, "step"),
    ({"step": -1}, "step"),
    ({"round": -2}, "round"),
    ({"rank": 4}, "world size 4 does not hold rank 4"),
    ({"created": math.nan}, "creation time"),
    ({"created": math.inf}, "creation time"),
    ({"manifest_len": -1}, "negative"),
    ({"payload_len": -(2**63)}, "negative"),
    ({"manifest_len": 2**40}, "manifest length"),
    ({"manifest_offset": FILE}, "past the end"),
    ({"payload_len": 1 << 31}, "chunks"),
    ({"chunk_count": 2**31}, "chunk count"),
    ({"chunk_size": 0}, "chunk size"),
    ({"payload_offset": HEADER_SIZE}, "overlaps the header or table"),
    ({"payload_offset": LAYOUT.payload_offset + 1}, "overlaps the header or table"),
    ({"manifest_offset": LAYOUT.payload_offset + 5}, "inside the payload"),
    ({"table_offset": 0}, "checksum table at 0"),
    ({"job_len": 300}, "job id of 300 bytes"),
    ({"job": b"\xff\xfe", "job_len": 2}, "not UTF-8"),
], ids=lambda v: str(v)[:40])  # fmt: skip
def test_crafted_headers_are_refused_with_their_field(changes: dict[str, Any],
                                                      message: str) -> None:  # fmt: skip
    with pytest.raises(SlotFormatError, match=message):
        decode_header(forge(**changes), file_size=FILE)


def test_headers_that_are_not_this_format_are_refused() -> None:
    with pytest.raises(SlotFormatError, match="magic"):
        decode_header(forge(magic=b"PK\3\4xxxx"), file_size=FILE)
    with pytest.raises(SlotFormatError, match="format 2"):
        decode_header(forge(version=2), file_size=FILE)
    with pytest.raises(SlotFormatError, match="crc32"):
        raw = bytearray(forge())
        raw[40] ^= 1
        decode_header(bytes(raw), file_size=FILE)
    with pytest.raises(SlotFormatError, match="under"):
        decode_header(forge()[:100], file_size=FILE)
    with pytest.raises(SlotFormatError, match="past the end"):
        decode_header(forge(), file_size=LAYOUT.file_size - 1)


def test_the_writer_refuses_what_a_reader_would() -> None:
    for bad in ({"step": -1}, {"step": 2**53 + 1}, {"rank": 9}, {"created": math.nan},
                {"job": "x" * 257}):  # fmt: skip
        with pytest.raises(SlotFormatError):
            encode_header(SlotHeader(**{**HEADER.__dict__, **bad}))


# ------------------------------------------------------------------ manifests

TENSORS = (TensorEntry("float32", (2, 3), 0, 24), TensorEntry("bfloat16", (), 64, 2),
           TensorEntry("int64", (0, 5), 128, 0))  # fmt: skip
TREE = [
    "d",
    "model",
    ["o", ["o", None, "", ["d", "version", 1]], "w", ["T", 0]],
    "s",
    ["T", 1],
    "e",
    ["T", 2],
    "lr",
    0.5,
    "nan",
    ["f", "nan"],
    3,
    ["t", 1, None],
]
MANIFEST = json.loads(encode_manifest(TENSORS, TREE))


def _manifest(**changes: Any) -> bytes:
    return json.dumps({**MANIFEST, **changes}).encode()


def _with_tensor(index: int, position: int, value: Any) -> bytes:
    tensors = json.loads(json.dumps(MANIFEST["tensors"]))
    tensors[index][position] = value
    return _manifest(tensors=tensors)


def test_the_writers_manifest_reads_back() -> None:
    manifest = decode_manifest(encode_manifest(TENSORS, TREE), payload_len=200)
    assert manifest.tensors == TENSORS
    state = build(manifest.tree, ["W", "S", "E"])
    assert state["model"]["w"] == "W" and state["model"]._metadata == {"": {"version": 1}}
    assert math.isnan(state["nan"]) and state[3] == (1, None)


@pytest.mark.parametrize("raw,message", [
    (_manifest().replace(b"24", HUGE.encode()), "characters"),
    (_manifest().replace(b"0.5", b"NaN"), "NaN is not a JSON number"),
    (_manifest().replace(b"0.5", b"1e999"), "out of range"),
    (_manifest(tree=json.loads("[" * 40 + "]" * 40)), "nested deeper"),
    (_with_tensor(0, 2, -64), "offset -64"),
    (_with_tensor(0, 3, -24), "length -24"),
    (_with_tensor(0, 3, 2**62), "length"),
    (_with_tensor(2, 2, 256), r"offset 256 is outside 0\.\.200"),
    (_with_tensor(1, 2, 0), "overlaps"),
    (_with_tensor(1, 2, 65), "misaligned"),
    (_with_tensor(0, 1, [2, 4]), r"float32\[2, 4\] is not 24 bytes"),
    (_with_tensor(0, 1, [2**53, 2**53, 2**53]), "is not 24 bytes"),
    (_with_tensor(0, 1, [-2, -3]), "dim -2"),
    (_with_tensor(0, 1, [True, 3]), "must be an integer"),
    (_with_tensor(0, 0, "object"), "unknown dtype"),
    (_with_tensor(0, 1, [1] * 65), "at most 64 dims"),
    (_manifest(format=2), "format 2"),
    (_manifest(extra=1), "an object of format"),
    (_manifest(tree=["d", "a", ["T", 0], "b", ["T", 0], "c", ["T", 2]]), "used twice"),
    (_manifest(tree=["T", 3]), "not one of 3"),
    (_manifest(tree=["l", ["T", 0], ["T", 1]]), "tensor 2 is never used"),
    (_manifest(tree=["x", 1]), "unknown or misplaced tag"),
    (_manifest(tree=["d", ["l", 1], ["T", 0]]), "in a key"),
    (_manifest(tree=["d", ["T", 0], 1]), "bad tensor node"),
    (_manifest(tree=["d", "k"]), "key without a value"),
    (_manifest(tree=["f", "NaN"]), "bad float"),
    (_manifest(tree=["o", ["l"], "k", 1]), "metadata"),
    (_manifest(tree=[]), "tagged list"),
    (b"\xff" * 10, "not JSON"),
], ids=lambda v: str(v)[:30] if isinstance(v, str) else None)  # fmt: skip
def test_crafted_manifests_are_refused_with_their_reason(raw: bytes, message: str) -> None:
    with pytest.raises(SlotFormatError, match=message):
        decode_manifest(raw, payload_len=200)


def test_a_manifest_past_its_bound_is_refused_before_parsing() -> None:
    with pytest.raises(SlotFormatError, match="over the"):
        decode_manifest(b" " * (sf.MAX_MANIFEST_BYTES + 1), payload_len=0)


# ------------------------------------------------------------------ hypothesis


def _decode_header_or_refuse(raw: bytes) -> None:
    try:
        header = decode_header(raw, file_size=FILE)
    except SlotFormatError:
        return
    lay = header.layout
    assert 0 <= header.step <= sf.MAX_STEP and 0 <= header.rank <= sf.MAX_RANK
    assert math.isfinite(header.created) and 0 <= header.seq < 2**63
    assert HEADER_SIZE + 4 * lay.chunk_count <= lay.payload_offset
    assert lay.payload_offset + lay.payload_len <= lay.manifest_offset <= lay.file_size <= FILE
    assert encode_header(header)[1] == header.header_crc  # the writer writes it back


@FUZZ
@given(raw=st.binary(min_size=0, max_size=600))
def test_fuzz_header_bytes(raw: bytes) -> None:
    _decode_header_or_refuse(sf.MAGIC + raw)
    _decode_header_or_refuse(raw)


@FUZZ
@given(raw=st.binary(min_size=0, max_size=600), flips=st.lists(st.integers(0, 599), max_size=6))
def test_fuzz_header_bytes_as_staged(raw: bytes, flips: list[int]) -> None:
    """The finisher's reading of a header without its crc check: a header within its
    bounds (seq 0, table crc 0, the crc as staged) or SlotFormatError, nothing else."""
    good, _ = encode_header(HEADER)
    for data in (raw, sf.MAGIC + raw, _flipped(good, flips)):
        try:
            h = decode_header_as_staged(data, file_size=FILE)
        except SlotFormatError:
            continue
        assert h.seq == 0 and h.table_crc == 0 and h.header_crc == staged_header_crc(h)
        assert 0 <= h.step <= sf.MAX_STEP and h.layout.manifest_offset <= FILE


def _flipped(raw: bytes, positions: list[int]) -> bytes:
    out = bytearray(raw)
    for i in positions:
        out[i % len(out)] ^= 0xFF
    return bytes(out)


_FIELD_VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**32 - 1, 2**53, 2**53 + 1, 2**62, HEADER_SIZE, FILE]),
)


@FUZZ
@given(field=st.sampled_from(sorted(set(FIELDS) - {"job", "created"})), value=_FIELD_VALUES,
       seq=st.integers(0, 2**63 - 1))  # fmt: skip
@example(field="manifest_len", value=-1, seq=1)
def test_fuzz_one_header_field_with_a_correct_crc(field: str, value: int, seq: int) -> None:
    """Any value in one field, the crc made to match: only the bounds stand guard."""
    fmt = {"rank": "I", "world": "I", "chunk_count": "I", "table_crc": "I",
           "manifest_crc": "I", "job_len": "H"}.get(field, "q")  # fmt: skip
    try:
        struct.pack("<" + fmt, value)
    except struct.error:
        return  # not representable in the field
    _decode_header_or_refuse(forge(seq=seq, **{field: value}))


@FUZZ
@given(raw=st.binary(max_size=64), where=st.integers(0, HEADER_SIZE - 1))
def test_fuzz_bytes_over_a_valid_header(raw: bytes, where: int) -> None:
    data = bytearray(forge())
    data[where : where + len(raw)] = raw
    _decode_header_or_refuse(bytes(data[:HEADER_SIZE]))


def _decode_manifest_or_refuse(raw: bytes) -> None:
    try:
        manifest = decode_manifest(raw, payload_len=200)
    except SlotFormatError:
        return
    end = 0
    for t in manifest.tensors:
        assert t.offset >= end and t.offset + t.nbytes <= 200
        end = t.offset + t.nbytes
    build(manifest.tree, list(range(len(manifest.tensors))))  # builds, never raises


_scalars = (st.none() | st.booleans() | st.integers(-(10**30), 10**30)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=10))  # fmt: skip
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(data=st.data(), value=_json, depth=st.integers(0, 40))
def test_fuzz_one_manifest_field(data: st.DataObject, value: Any, depth: int) -> None:
    doc = json.loads(json.dumps(MANIFEST))
    path = data.draw(st.sampled_from(["format", "tensors", "tree", "t0", "t1", "tree1"]))
    for _ in range(depth):
        value = [value]
    if path in ("format", "tensors", "tree"):
        doc[path] = value
    elif path == "tree1":
        doc["tree"][data.draw(st.integers(0, len(doc["tree"]) - 1))] = value
    else:
        doc["tensors"][int(path[1])][data.draw(st.integers(0, 3))] = value
    _decode_manifest_or_refuse(json.dumps(doc, allow_nan=True).encode())


@FUZZ
@given(raw=st.binary(max_size=300))
def test_fuzz_manifest_bytes(raw: bytes) -> None:
    _decode_manifest_or_refuse(raw)


_keys = st.none() | st.booleans() | st.integers(-(2**63) + 1, 2**63 - 1) | st.text(max_size=6)
_plain = st.recursive(
    _scalars.filter(lambda v: not isinstance(v, int) or abs(v) < 2**63),
    lambda inner: (st.lists(inner, max_size=3) | st.tuples(inner, inner)
                   | st.dictionaries(_keys, inner, max_size=3)
                   | st.dictionaries(st.text(max_size=6), inner, max_size=3).map(OrderedDict)),
    max_leaves=15,
)  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@FUZZ
@given(state=_plain)
def test_fuzz_any_plain_state_round_trips_through_the_manifest(state: Any) -> None:
    try:
        tree, tensors = flatten(state, lambda v: False)
    except TreeError:
        return  # deeper than the bound
    manifest = decode_manifest(encode_manifest([], tree), payload_len=0)
    check_tree(manifest.tree, 0)
    assert _same(state, build(manifest.tree, tensors))


def test_layout_bounds_the_chunk_table() -> None:
    small, huge = layout(0, 10), layout(2**40, 10)
    assert small == Layout(sf.MIN_CHUNK_SIZE, 0, HEADER_SIZE, 0, HEADER_SIZE, 10)
    assert huge.chunk_count <= sf.MAX_CHUNKS and huge.chunk_size * huge.chunk_count >= 2**40
