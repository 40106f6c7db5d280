"""The codec of ``checkpoint-loads/<node>`` (kelastic/etcd_values/loads.py): what a node's
workers loaded as a round began. Its fuzzing is in tests/test_decoder_fuzz.py."""

from __future__ import annotations

import json

import pytest

from kelastic.etcd_values import CorruptValueError
from kelastic.etcd_values.loads import MAX_LOAD_BYTES, LoadDoc, decode_load, encode_load

DOC = LoadDoc(3, 120, "disk", 2, 0.0123, 1764190000.5)


def test_a_value_round_trips() -> None:
    raw = encode_load(DOC)
    assert decode_load(raw) == DOC and len(raw) <= MAX_LOAD_BYTES
    assert json.loads(raw) == {"round": 3, "step": 120, "tier": "disk", "ranks": 2,
                               "seconds": 0.0123, "time": 1764190000.5}  # fmt: skip


@pytest.mark.parametrize("field, value", [
    ("round", -1), ("round", 2**53 + 1), ("step", True), ("step", 1.5), ("tier", "none"),
    ("tier", "tape"), ("ranks", 0), ("ranks", 4097), ("seconds", float("nan")),
    ("seconds", float("inf")), ("seconds", -0.1), ("seconds", 86401.0), ("time", -1.0),
])  # fmt: skip
def test_the_writer_refuses_what_no_reader_takes(field: str, value: object) -> None:
    bad = LoadDoc(**{**DOC.__dict__, field: value})
    with pytest.raises(CorruptValueError, match="checkpoint load"):
        encode_load(bad)


@pytest.mark.parametrize("raw", [
    b"", b"\xff\xfe", b"null", b"[]", b"{}", b'{"round": 3}',
    json.dumps({**DOC.__dict__, "round": 10**400}).encode()[:MAX_LOAD_BYTES],
    b'{"round":3,"step":120,"tier":"disk","ranks":2,"seconds":NaN,"time":1}',
    b'{"round":3,"step":120,"tier":"disk","ranks":2,"seconds":1e999,"time":1}',
    b" " * (MAX_LOAD_BYTES + 1),
    b"[" * 10_000,
    json.dumps({**DOC.__dict__, "extra": {"a": [1]}}).encode(),
])  # fmt: skip
def test_the_reader_refuses_crafted_values_with_its_own_error(raw: bytes) -> None:
    with pytest.raises(CorruptValueError, match="checkpoint-loads/n"):
        decode_load(raw, "checkpoint-loads/n")


def test_a_reader_that_only_reports_lets_unknown_fields_through_not_bad_ones() -> None:
    newer = json.dumps({**DOC.__dict__, "version": 2, "gpu": "h200"}).encode()
    assert decode_load(newer, partial=True) == DOC
    with pytest.raises(CorruptValueError):
        decode_load(newer)  # the strict reader: another writer's value
    missing = json.dumps({k: v for k, v in DOC.__dict__.items() if k != "step"}).encode()
    with pytest.raises(CorruptValueError):
        decode_load(missing, partial=True)
    out_of_bounds = json.dumps({**DOC.__dict__, "version": 2, "ranks": -3}).encode()
    with pytest.raises(CorruptValueError):
        decode_load(out_of_bounds, partial=True)
