"""kelastic.hang_where: the sidecar's ``hang_evidence`` status document, written by the
sidecar and read by ``kelastic run``: round trip, the line it says, and a reader that
takes any JSON and never raises."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kelastic.hang_where import MAX_RANKS, MAX_TEXT, HangWhere, RankWhere, decode_where
from tests.test_decoder_fuzz import json_values

WHERE = HangWhere(
    3,
    "digits-1",
    (
        RankWhere(2, 0, 811, "T", False, "main thread at /w/train.py:231 in _epochs"),
        RankWhere(3, 1, 812, "S", True, "main thread at /w/train.py:228 in _epochs"),
        RankWhere(4, 2, 813, "", False, "stacks not read"),
    ),
)


def test_the_document_round_trips_through_json_and_says_each_rank() -> None:
    doc = json.loads(json.dumps(WHERE.as_dict()))
    assert decode_where(doc) == WHERE
    assert WHERE.line() == (
        "rank 2 (stopped): main thread at /w/train.py:231 in _epochs; "
        "rank 3 (reaped): main thread at /w/train.py:228 in _epochs; "
        "rank 4 (gone): stacks not read"
    )
    assert HangWhere(0, "n", ()).line() == "no workers"


def test_the_writer_bounds_what_it_writes() -> None:
    long = HangWhere(1, "n" * 5000, tuple(
        RankWhere(i, i, 100 + i, "S" * 5000, False, "x" * 5000) for i in range(MAX_RANKS + 5)
    ))  # fmt: skip
    assert len(long.ranks) == MAX_RANKS and len(long.node) == MAX_TEXT
    assert all(len(r.where) == MAX_TEXT and len(r.state) == MAX_TEXT for r in long.ranks)
    assert decode_where(long.as_dict()) == long  # what is written is read back


def _with(**changes: Any) -> dict[str, Any]:
    doc = WHERE.as_dict()
    rank = {**doc["ranks"][0], **changes.pop("rank", {})}
    return {**doc, "ranks": [rank, *doc["ranks"][1:]], **changes}


def test_what_no_writer_produces_is_refused() -> None:
    assert decode_where(None) is None and decode_where([]) is None
    for bad in (
        _with(round=-1), _with(round=True), _with(round=2**31), _with(round=1.0),
        _with(node=None), _with(node="n" * (MAX_TEXT + 1)), _with(ranks={}),
        _with(ranks=[1]), _with(rank={"rank": "2"}), _with(rank={"pid": 10**30}),
        _with(rank={"reaped": 1}), _with(rank={"where": None}),
        _with(rank={"state": "S" * (MAX_TEXT + 1)}),
        {**WHERE.as_dict(), "ranks": [WHERE.as_dict()["ranks"][0]] * (MAX_RANKS + 1)},
    ):  # fmt: skip
        assert decode_where(bad) is None, bad


@given(json_values, st.sampled_from(["round", "node", "ranks", "rank", "pid", "where"]))
def test_fuzz_the_reader_never_raises(value: Any, field: str) -> None:
    for doc in (value, _with(**{field: value}) if field in ("round", "node", "ranks")
                else _with(rank={field: value})):  # fmt: skip
        got = decode_where(doc)
        assert got is None or isinstance(got, HangWhere)
