"""kelastic.hang_where: the sidecar's ``hang_evidence`` status document, written by the
sidecar and read by ``kelastic run``: round trip, the line it says, and a reader that
takes any JSON and never raises; every node's evidence in one line (:func:`summarize`,
the job's ``status.lastHang``); the etcd value's codec (:mod:`kelastic.etcd_values.hangs`)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kelastic.etcd_values import MAX_HANG_BYTES, CorruptValueError, decode_hang, encode_hang
from kelastic.hang_where import (
    MAX_RANKS,
    MAX_SUMMARY,
    MAX_TEXT,
    HangWhere,
    RankWhere,
    decode_where,
    summarize,
)
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


# ------------------------------------------------------------- every node's, in one line


def _rank(rank: int, state: str, where: str, reaped: bool = False) -> RankWhere:
    return RankWhere(rank, rank % 2, 100 + rank, state, reaped, where)


WAIT = "main thread at /w/train.py:94 in _wait_for_peers"
STUCK = "main thread at /w/train.py:231 in _epochs"


def test_the_stopped_rank_is_the_culprit_and_the_others_wait() -> None:
    nodes = [
        HangWhere(3, "job-0", (_rank(0, "S", WAIT + " (stacks in /a)", reaped=True),
                               _rank(1, "S", WAIT + " (stacks in /b)"))),
        HangWhere(3, "job-1", (_rank(2, "T", STUCK + " (stacks in /c)"),
                               _rank(3, "S", WAIT + " (stacks in /d)", reaped=True))),
    ]  # fmt: skip
    assert summarize(nodes) == (
        f"hang in round 3 (2 nodes reported): culprit: rank 2 on job-1 (stopped): {STUCK}; "
        f"waiting: ranks 0, 1 on job-0 and rank 3 on job-1 (reaped, state S): {WAIT}"
    )
    # only the newest round counts; node order does not matter
    old = HangWhere(1, "job-2", (_rank(4, "T", "main thread at /w/old.py:1 in f"),))
    assert summarize([old, *reversed(nodes)]) == summarize(nodes)


def test_without_a_stopped_rank_the_one_not_where_the_rest_wait_is_named() -> None:
    ranks = (*(_rank(r, "S", WAIT) for r in (0, 1, 3)), _rank(2, "R", STUCK))
    line = summarize([HangWhere(5, "job-0", ranks)])
    assert line.startswith(f"hang in round 5 (1 node reported): culprit: rank 2 on job-0 "
                           f"(state R): {STUCK}; waiting: ranks 0, 1, 3 on job-0")  # fmt: skip


def test_evidence_that_names_nobody_says_it_is_inconclusive() -> None:
    halves = tuple(_rank(r, "S", WAIT if r < 2 else STUCK) for r in range(4))
    line = summarize([HangWhere(2, "job-0", halves)])
    assert "inconclusive (no rank stopped, no lone place)" in line and "culprit" not in line
    same = tuple(_rank(r, "", "stacks unavailable: py-spy not found", reaped=True)
                 for r in range(2))  # fmt: skip
    assert "inconclusive" in summarize([HangWhere(2, "job-0", same)])
    assert summarize([HangWhere(2, "job-0", ())]).endswith(": no workers")
    assert summarize([]) == ""


def test_the_line_is_bounded() -> None:
    many = [HangWhere(1, f"node-{n:04d}", tuple(_rank(n * 8 + r, "S", f"main thread at "
                                                      f"/w/{n}-{r}.py:1 in f") for r in range(8)))
            for n in range(200)]  # fmt: skip
    line = summarize(many)
    assert len(line) == MAX_SUMMARY and line.endswith("...")
    assert line.startswith("hang in round 1 (200 nodes reported): inconclusive")


# ------------------------------------------------------------------ the etcd value's codec


def test_the_etcd_value_round_trips_and_a_huge_one_is_cut_to_fit() -> None:
    assert decode_hang(encode_hang(WHERE)) == WHERE
    huge = HangWhere(7, "n", tuple(_rank(i, "T", "é" * MAX_TEXT) for i in range(MAX_RANKS)))
    raw = encode_hang(huge)
    assert len(raw) <= MAX_HANG_BYTES
    back = decode_hang(raw)
    assert len(back.ranks) == MAX_RANKS and back.ranks[5].rank == 5
    assert 16 <= len(back.ranks[0].where) < MAX_TEXT


def test_the_etcd_reader_refuses_what_no_writer_produces() -> None:
    for raw in (b"", b"[]", b"{", b"null", b'{"round": 1}', b"\xff\xfe",
                json.dumps({**WHERE.as_dict(), "round": -1}).encode(),
                json.dumps({**WHERE.as_dict(), "round": float("nan")}).encode(),
                b"[" * 100000, b" " * (MAX_HANG_BYTES + 1)):  # fmt: skip
        with pytest.raises(CorruptValueError):
            decode_hang(raw)


@given(value=json_values)
def test_fuzz_the_etcd_reader_raises_only_its_error(value: Any) -> None:
    for doc in (value, {**WHERE.as_dict(), "ranks": value}, {**WHERE.as_dict(), "node": value}):
        try:
            raw = json.dumps(doc).encode()
        except (TypeError, ValueError):
            continue
        with contextlib.suppress(CorruptValueError):  # anything else fails the test
            decode_hang(raw)
