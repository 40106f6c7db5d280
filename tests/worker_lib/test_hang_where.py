"""kelastic.hang_where: the sidecar's ``hang_evidence`` status document, written by the
sidecar and read by ``kelastic run``: round trip, the line it says, and a reader that
takes any JSON and never raises; every node's evidence in one line (:func:`summarize`,
the job's ``status.lastHang``); the etcd value's codec (:mod:`kelastic.etcd_values.hangs`)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kelastic.etcd_values import MAX_HANG_BYTES, CorruptValueError, decode_hang, encode_hang
from kelastic.flight_recorder import Collective
from kelastic.hang_where import (
    MAX_RANK_GROUPS,
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


def _in(group: str, seq: int, name: str = "gloo:all_reduce", done: bool = False) -> Collective:
    return Collective(group, seq, name, done)


def _recorded(rank: int, where: str, *collectives: Collective, state: str = "S") -> RankWhere:
    return RankWhere(rank, rank % 2, 100 + rank, state, False, where, collectives)


def test_the_flight_records_name_the_rank_that_never_entered_the_collective() -> None:
    """No rank stopped, every rank at a different line: the stacks alone are
    inconclusive; the records say rank 3 never entered all-reduce #9 of default_pg that
    the others are in, and name the collective each group waits in."""
    ranks = (
        _recorded(0, WAIT, _in("default_pg", 9)),
        _recorded(1, "main thread at /w/a.py:1 in f", _in("default_pg", 9)),
        _recorded(2, "main thread at /w/b.py:2 in g", _in("default_pg", 9)),
        _recorded(3, STUCK, _in("default_pg", 8, "gloo:barrier", done=True)),
    )
    line = summarize([HangWhere(4, "job-0", ranks[:2]), HangWhere(4, "job-1", ranks[2:])])
    assert line.startswith(
        f"hang in round 4 (2 nodes reported): culprit: rank 3 on job-1 (state S): {STUCK} "
        "(flight records: not in gloo:all_reduce #9 of default_pg, which the others entered); "
        "waiting: "
    ), line
    assert f"rank 0 on job-0 (state S): {WAIT} [in gloo:all_reduce #9 of default_pg]" in line
    # without the records the same stacks name nobody
    bare = [HangWhere(4, "job-0", tuple(RankWhere(r.rank, r.local_rank, r.pid, r.state,
                                                  r.reaped, r.where) for r in ranks))]  # fmt: skip
    assert "inconclusive" in summarize(bare)


def test_a_stopped_rank_wins_over_the_records_and_records_that_agree_name_nobody() -> None:
    stopped = (_recorded(0, WAIT, _in("default_pg", 9)), _rank(1, "T", STUCK))
    line = summarize([HangWhere(2, "job-0", stopped)])
    assert line.startswith(f"hang in round 2 (1 node reported): culprit: rank 1 on job-0 "
                           f"(stopped): {STUCK}; waiting: rank 0")  # fmt: skip
    assert "flight records" not in line and "[in gloo:all_reduce #9 of default_pg]" in line
    # every rank with a record in the group's newest collective: the records name nobody;
    # a group one rank alone reports (a subgroup) is no evidence either
    agree = tuple(_recorded(r, WAIT if r < 3 else STUCK, _in("default_pg", 9)) for r in range(4))
    lone = (*agree[:3], _recorded(3, STUCK, _in("default_pg", 9), _in("tp", 7)))
    for ranks in (agree, lone):
        line = summarize([HangWhere(2, "job-0", ranks)])
        assert "culprit: rank 3 on job-0 (state S)" in line and "flight records" not in line


def test_a_rank_reports_few_collectives_those_it_is_in_first() -> None:
    many = tuple(_in(f"g{i}", 3, done=i % 2 == 0) for i in range(9))
    where = HangWhere(1, "n", (_recorded(0, WAIT, *many),))
    kept = where.ranks[0].collectives
    assert len(kept) == MAX_RANK_GROUPS and not any(c.done for c in kept)
    assert decode_hang(encode_hang(where)) == where
    doc = where.as_dict()
    doc["ranks"][0]["collectives"] = [asdict(c) for c in many]  # more than a writer writes
    assert decode_where(doc) is None
    doc["ranks"][0]["collectives"] = [asdict(many[1]), asdict(many[1])]  # a group twice
    assert decode_where(doc) is None
    del doc["ranks"][0]["collectives"]  # an older writer's: none
    assert decode_where(doc) == HangWhere(1, "n", (_rank(0, "S", WAIT),))


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
