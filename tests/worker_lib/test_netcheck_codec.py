"""The network check's pure half: its params and verdict lines (round trips, every bound
refused with a message naming it, crafted values), the pair passes' plan, and the
judging of the pair tests (the decoder fuzzers are in ``tests/test_decoder_fuzz.py``; the
check with real gloo processes in ``test_netcheck_gloo.py``)."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from typing import Any

import pytest

from kelastic.netcheck import (
    MAX_FAILED,
    MAX_INCONCLUSIVE,
    MAX_PARAMS_BYTES,
    MAX_REASON,
    MAX_VERDICT_BYTES,
    Floors,
    NetcheckError,
    Pair,
    PairResult,
    Params,
    Verdict,
    clip,
    combine,
    decode_params,
    decode_verdict,
    encode_params,
    encode_verdict,
    judge,
    pair_steps,
    pairs,
    retest_steps,
)

PARAMS = Params(round=7, rank=2, world_size=4, master_addr="10.0.3.7", master_port=29500,
                timeout_s=30.0)  # fmt: skip
FAILED = Verdict(round=7, passed=False, failed={5: "slow", 1: "slower"}, inconclusive="",
                 latency_s=0.2, bandwidth_bps=1e6, seconds=3.5)  # fmt: skip
HUGE = "9" * 5000


def _params_doc(**change: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(encode_params(PARAMS))
    return {**doc, **change}


def _verdict_doc(**change: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(encode_verdict(FAILED))
    return {**doc, **change}


# ------------------------------------------------------------------ round trips


def test_params_round_trip_as_one_line() -> None:
    floors = Floors(max_latency_s=0.1, min_bandwidth_bps=10e6, size_bytes=1024, iterations=3)
    for p in (PARAMS, replace(PARAMS, floors=floors, rank=0, round=0, master_addr="fe80::1")):
        line = encode_params(p)
        assert "\n" not in line and len(line) <= MAX_PARAMS_BYTES
        assert decode_params(line) == p
        assert decode_params((line + "\n").encode()) == p  # as read from stdin


def test_default_floors() -> None:
    f = Floors()
    assert (f.max_latency_s, f.min_bandwidth_bps, f.size_bytes, f.iterations) == (
        0.05, 50e6, 4 * 2**20, 5)  # fmt: skip
    assert f.met(0.05, 50e6) and not f.met(0.0501, 1e9) and not f.met(0.001, 49e6)


def test_integers_are_numbers_and_become_floats() -> None:
    p = replace(PARAMS, timeout_s=2, floors=Floors(max_latency_s=1, min_bandwidth_bps=10))
    assert isinstance(p.timeout_s, float) and isinstance(p.floors.max_latency_s, float)
    assert p == replace(PARAMS, timeout_s=2.0, floors=Floors(1.0, 10.0))
    assert decode_params(json.dumps(_params_doc(timeout_s=2))).timeout_s == 2.0


@pytest.mark.parametrize(
    "verdict",
    [
        FAILED,
        Verdict(0, True, {}, "", 0.001, 2.5e9, 0.3),
        Verdict(3, False, {}, "rank 1: forming the group failed: timeout", 0.0, 0.0, 2.0),
        Verdict(3, False, {0: 'lent Ünïcødé ☃ 𝄞 "quotes" \\ back'}, "", 0.0, 0.0, 2.0),
    ],
)
def test_verdict_round_trip_as_one_line(verdict: Verdict) -> None:
    line = encode_verdict(verdict)
    assert "\n" not in line
    assert decode_verdict(line) == verdict
    assert decode_verdict((line + "\n").encode()) == verdict


def test_failed_ranks_are_decimal_keys_in_order() -> None:
    doc = json.loads(encode_verdict(FAILED))
    assert list(doc["failed"]) == ["1", "5"]
    assert set(doc) == {"round", "passed", "failed", "inconclusive", "latency_s",
                        "bandwidth_bps", "seconds"}  # fmt: skip


def test_the_largest_verdict_fits_its_bound() -> None:
    """Every bound at its maximum, with the widest UTF-8 characters: still decodable."""
    widest = "𝄞" * MAX_REASON
    v = Verdict(2**63 - 1, False, {r: widest for r in range(60000, 60000 + MAX_FAILED)}, "",
                1e300, 1e300, 1e300)  # fmt: skip
    raw = encode_verdict(v).encode()
    assert len(raw) <= MAX_VERDICT_BYTES
    assert decode_verdict(raw) == v
    v = Verdict(1, False, {}, "𝄞" * MAX_INCONCLUSIVE, 0.0, 0.0, 0.0)
    assert decode_verdict(encode_verdict(v).encode()) == v


# ------------------------------------------------------------------ bounds


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_latency_s": 0.0}, "max_latency_s"),
        ({"max_latency_s": 61.0}, "max_latency_s"),
        ({"max_latency_s": float("nan")}, "max_latency_s"),
        ({"max_latency_s": float("inf")}, "max_latency_s"),
        ({"max_latency_s": True}, "max_latency_s"),
        ({"max_latency_s": "0.05"}, "max_latency_s"),
        ({"min_bandwidth_bps": 0.5}, "min_bandwidth_bps"),
        ({"min_bandwidth_bps": 2e13}, "min_bandwidth_bps"),
        ({"min_bandwidth_bps": -1.0}, "min_bandwidth_bps"),
        ({"size_bytes": 0}, "size_bytes"),
        ({"size_bytes": 256 * 2**20 + 4}, "size_bytes"),
        ({"size_bytes": 1026}, "multiple of 4"),
        ({"size_bytes": 1024.0}, "size_bytes"),
        ({"iterations": 0}, "iterations"),
        ({"iterations": 101}, "iterations"),
        ({"iterations": False}, "iterations"),
    ],
)
def test_floors_out_of_bounds_are_refused(change: dict[str, Any], named: str) -> None:
    with pytest.raises(NetcheckError, match=named):
        Floors(**change)
    doc = _params_doc()
    doc["floors"] = {**doc["floors"], **change}
    if all(isinstance(v, str | bool | int) or abs(v) < 1e308 for v in change.values()):
        with pytest.raises(NetcheckError, match=f"netcheck params: .*{named}"):
            decode_params(json.dumps(doc))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"round": -1}, "round"),
        ({"round": 2**63}, "round"),
        ({"round": True}, "round"),
        ({"rank": 4}, "rank"),
        ({"rank": -1}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"world_size": 65537}, "world_size"),
        ({"master_addr": ""}, "master_addr"),
        ({"master_addr": "a" * 254}, "master_addr"),
        ({"master_addr": "10.0.0.1 x"}, "master_addr"),
        ({"master_addr": "host\n"}, "master_addr"),
        ({"master_addr": "hôst"}, "master_addr"),
        ({"master_addr": 10}, "master_addr"),
        ({"master_port": 0}, "master_port"),
        ({"master_port": 65536}, "master_port"),
        ({"master_port": "29500"}, "master_port"),
        ({"timeout_s": 0.5}, "timeout_s"),
        ({"timeout_s": 601}, "timeout_s"),
        ({"timeout_s": None}, "timeout_s"),
        ({"floors": None}, "floors"),
    ],
)
def test_params_out_of_bounds_are_refused(change: dict[str, Any], named: str) -> None:
    with pytest.raises(NetcheckError, match=named):
        replace(PARAMS, **change)
    if "floors" not in change:
        with pytest.raises(NetcheckError, match=f"netcheck params: .*{named}"):
            decode_params(json.dumps(_params_doc(**change)))


def test_a_huge_integer_is_refused_with_a_short_message() -> None:
    with pytest.raises(NetcheckError, match="integer of 16610 bits") as info:
        replace(PARAMS, round=10**5000)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"round": -1}, "round"),
        ({"passed": 1}, "passed"),
        ({"failed": {r: "x" for r in range(MAX_FAILED + 1)}}, "failed"),
        ({"failed": {65536: "x"}}, "failed rank"),
        ({"failed": {1: "x" * (MAX_REASON + 1)}}, r"failed\[1\]"),
        ({"failed": {1: "two\nlines"}}, r"failed\[1\]"),
        ({"failed": {1: 3}}, r"failed\[1\]"),
        ({"inconclusive": "x" * (MAX_INCONCLUSIVE + 1), "failed": {}}, "inconclusive"),
        ({"inconclusive": "nul\0", "failed": {}}, "inconclusive"),
        ({"latency_s": -0.1}, "latency_s"),
        ({"bandwidth_bps": float("nan")}, "bandwidth_bps"),
        ({"seconds": float("inf")}, "seconds"),
        ({"passed": True}, "exactly one"),  # passed, yet failed ranks
        ({"inconclusive": "why"}, "exactly one"),  # failed ranks and a reason
        ({"failed": {}}, "exactly one"),  # not passed, no one failed, no reason
        ({"failed": {}, "passed": True, "inconclusive": "why"}, "exactly one"),
    ],
)
def test_verdicts_out_of_bounds_are_refused(change: dict[str, Any], named: str) -> None:
    with pytest.raises(NetcheckError, match=named):
        replace(FAILED, **change)


@pytest.mark.parametrize(
    ("doc", "named"),
    [
        (_verdict_doc(failed={"01": "x"}), "not a rank"),
        (_verdict_doc(failed={"-1": "x"}), "not a rank"),
        (_verdict_doc(failed={" 1": "x"}), "not a rank"),
        (_verdict_doc(failed={"\u0661": "x"}), "not a rank"),  # an Arabic-Indic digit one
        (_verdict_doc(failed={"123456": "x"}), "not a rank"),
        (_verdict_doc(failed={"65536": "x"}), "failed rank"),
        (_verdict_doc(failed=["x"]), "failed must be an object"),
        (_verdict_doc(passed="false"), "passed"),
        (_verdict_doc(seconds="1"), "seconds"),
        (_verdict_doc(extra=1), r"unknown keys \['extra'\]"),
        (
            {k: v for k, v in _verdict_doc().items() if k != "seconds"},
            r"missing keys \['seconds'\]",
        ),
        ([1, 2], "not a JSON object"),
    ],
)
def test_verdict_lines_no_writer_makes_are_refused(doc: object, named: str) -> None:
    with pytest.raises(NetcheckError, match=f"netcheck verdict: .*{named}"):
        decode_verdict(json.dumps(doc))


def _with(doc: dict[str, Any], field: str, literal: str) -> str:
    """``doc`` with ``field`` set to a raw JSON literal (which json.dumps cannot write)."""
    return json.dumps({**doc, field: "@@"}).replace('"@@"', literal)


CRAFTED = ("NaN", "Infinity", "-Infinity", "1e999", HUGE, "-" + HUGE, "[" * 5000 + "]" * 5000,
           "true", "null", '{"a": 1}')  # fmt: skip


@pytest.mark.parametrize("literal", CRAFTED)
def test_crafted_values_in_every_field_are_refused(literal: str) -> None:
    params, verdict = _params_doc(), _verdict_doc()
    for field in params:
        with pytest.raises(NetcheckError, match="netcheck params"):
            decode_params(_with(params, field, literal))
    for field in params["floors"]:
        with pytest.raises(NetcheckError, match="netcheck params"):
            decode_params(_with(params, "floors", _with(params["floors"], field, literal)))
    for field in verdict:
        with pytest.raises(NetcheckError, match="netcheck verdict"):
            decode_verdict(_with(verdict, field, literal))


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b"", "not JSON"),
        (b"\xff\xfe", "not UTF-8|not JSON"),
        (b"{" * 100, "nested deeper|not JSON"),
        (b"x" * (MAX_PARAMS_BYTES + 1), "over the 4096-byte limit"),
        (json.dumps(_params_doc(extra=1)).encode(), r"unknown keys \['extra'\]"),
        (json.dumps({k: 1 for k in ("round", "rank")}).encode(), "missing keys"),
        (json.dumps(_params_doc(floors={"iterations": 3})).encode(), "floors: missing keys"),
        (json.dumps(_params_doc(floors=[])).encode(), "floors: not a JSON object"),
        (b"[]", "not a JSON object"),
    ],
)
def test_params_lines_no_writer_makes_are_refused(raw: bytes, named: str) -> None:
    with pytest.raises(NetcheckError, match=f"netcheck params.*({named})"):
        decode_params(raw)


def test_clip_makes_a_valid_reason() -> None:
    assert clip("a\n\tb\x00  c", 100) == "a b c"
    cut = clip("x" * 600, MAX_REASON)
    assert len(cut) == MAX_REASON and cut.endswith("...")
    Verdict(0, False, {0: clip("line\r\nbreak" * 100, MAX_REASON)}, "", 0.0, 0.0, 0.0)


# ------------------------------------------------------------------ the plan

WORLDS = range(1, 10)


@pytest.mark.parametrize("world", WORLDS)
def test_steps_hold_disjoint_pairs_of_the_world(world: int) -> None:
    for shift in (0, 1):
        for step in pair_steps(world, shift):
            ranks = [r for pair in step for r in pair]
            assert step and len(ranks) == len(set(ranks))  # disjoint, no empty step
            assert all(0 <= a < b < world for a, b in step)  # lower rank first
        assert pairs(world, shift) == [p for s in pair_steps(world, shift) for p in s]


@pytest.mark.parametrize("world", WORLDS)
def test_pass_2_gives_every_rank_a_peer_it_did_not_meet_in_pass_1(world: int) -> None:
    first, second = pairs(world, 0), pairs(world, 1)
    assert not set(first) & set(second)  # no pair tested twice
    met = {r: {b if a == r else a for a, b in first if r in (a, b)} for r in range(world)}
    tested_again = {r for pair in second for r in pair}
    if world >= 2:
        assert set().union(*first) == set(range(world))  # pass 1 tests everyone
    # in pass 2 everyone but a rank that met every other rank already (world 2; rank 0 of 3)
    assert tested_again == {r for r in range(world) if len(met[r]) < world - 1}
    for a, b in second:
        assert b not in met[a] and a not in met[b]


def test_the_plan_of_small_worlds() -> None:
    assert pair_steps(1, 0) == pair_steps(1, 1) == []
    assert pair_steps(2, 0) == [[(0, 1)]] and pair_steps(2, 1) == []
    assert pair_steps(3, 0) == [[(0, 1)], [(0, 2)]] and pair_steps(3, 1) == [[(1, 2)]]
    assert pair_steps(4, 0) == [[(0, 1), (2, 3)]] and pair_steps(4, 1) == [[(0, 3), (1, 2)]]
    assert pair_steps(5, 0) == [[(0, 1), (2, 3)], [(0, 4)]]
    assert pair_steps(5, 1) == [[(1, 2), (3, 4)], [(0, 2)]]
    assert pairs(8, 1) == [(0, 7), (1, 2), (3, 4), (5, 6)]


@pytest.mark.parametrize(("world", "shift"), [(0, 0), (65537, 0), (4, 2), (4, -1), (4, True)])
def test_a_plan_out_of_bounds_is_refused(world: int, shift: int) -> None:
    with pytest.raises(NetcheckError):
        pair_steps(world, shift)


# ------------------------------------------------------------------ judging

OK = PairResult(0.001, 1e9, True)
SLOW = PairResult(0.4, 2e7, False)


def _simulate(world: int, bad: set[int]) -> tuple[dict[int, str], str, dict[Pair, PairResult]]:
    """Both passes as the check runs them, a pair failing when it holds a bad rank."""
    results: dict[Pair, PairResult] = {}
    for steps in (pair_steps(world, 0), None):
        for step in steps if steps is not None else retest_steps(world, results):
            for a, b in step:
                results[(a, b)] = SLOW if {a, b} & bad else OK
    failed, why = judge(world, results)
    return failed, why, results


def test_all_fine() -> None:
    for world in WORLDS:
        failed, why, results = _simulate(world, set())
        assert (failed, why) == ({}, "")
        assert set(results) == set(pairs(world, 0))  # pass 2 was not needed


@pytest.mark.parametrize("bad", range(8))
def test_one_bad_rank_of_8_is_found(bad: int) -> None:
    failed, why, results = _simulate(8, {bad})
    assert set(failed) == {bad} and why == ""
    assert len(results) == 4 + 2  # pass 2 re-tested only the two unresolved ranks' pairs
    assert failed[bad].startswith("failed every pair test it was in (with rank ")
    assert "latency 400 ms, bandwidth 20 MB/s" in failed[bad]


@pytest.mark.parametrize("world", range(3, 10))
def test_one_bad_rank_is_found_in_every_world_of_3_or_more(world: int) -> None:
    for bad in range(world):
        failed, why, _ = _simulate(world, {bad})
        assert set(failed) == {bad} and why == ""


def test_two_bad_ranks() -> None:
    for bad in ({1, 2}, {2, 3}, {0, 5}, {0, 7}, {3, 6}):
        failed, why, _ = _simulate(8, bad)
        assert set(failed) == bad and why == ""
    for world in range(5, 10):  # every two of 5 and more
        for two in itertools.combinations(range(world), 2):
            assert set(_simulate(world, set(two))[0]) == set(two)


def test_world_3_odd() -> None:
    # rank 0 is in two pass-1 pairs; when it is bad, pass 2's (1, 2) clears the others
    failed, _, results = _simulate(3, {0})
    assert set(failed) == {0} and set(results) == {(0, 1), (0, 2), (1, 2)}
    failed, _, results = _simulate(3, {2})
    assert set(failed) == {2} and results[(0, 1)].ok and not results[(1, 2)].ok


def test_world_2_with_a_slow_link_is_inconclusive() -> None:
    failed, why, results = _simulate(2, {1})
    assert failed == {} and list(results) == [(0, 1)]
    assert why.startswith("world size 2: the one link, between ranks 0 and 1, missed the floors")
    assert "either end may be the slow one" in why


def test_every_test_failing_is_inconclusive_not_everyone_bad() -> None:
    for world in range(3, 10):
        failed, why, _ = _simulate(world, set(range(world)))
        assert failed == {}
        assert why.startswith("every pair test") and "no node is to blame" in why
        assert len(why) <= MAX_INCONCLUSIVE


def test_no_healthy_rank_is_ever_blamed() -> None:
    """Every set of bad ranks of every world up to 9: the judged are bad; a failure with
    no one judged is inconclusive; no failure is a pass."""
    for world in WORLDS:
        for k in range(world + 1):
            for bad in itertools.combinations(range(world), k):
                failed, why, results = _simulate(world, set(bad))
                assert set(failed) <= set(bad), (world, bad, failed)
                assert bool(why) == (not failed and any(not r.ok for r in results.values()))
                assert all(len(reason) <= MAX_REASON for reason in failed.values())


def test_a_slow_link_between_healthy_ranks_blames_no_one() -> None:
    results = {(0, 1): OK, (2, 3): SLOW, (0, 3): OK, (1, 2): OK}
    failed, why = judge(4, results)  # 2 and 3 each passed another test: a link, not a node
    assert failed == {}
    assert why.startswith("pair tests (2, 3) missed the floors") and "a link" in why


def test_a_rank_is_bad_only_with_a_peer_that_passed_elsewhere() -> None:
    results = {(0, 1): SLOW, (2, 3): SLOW, (0, 3): OK, (1, 2): SLOW}
    failed, why = judge(4, results)  # 1 and 2 failed all; 0 and 3 passed with each other
    assert set(failed) == {1, 2} and why == ""
    assert "with rank 0:" in failed[1] and "with rank 2:" in failed[1]
    results = {(0, 1): SLOW, (2, 3): OK, (1, 2): SLOW}
    failed, why = judge(4, results)  # 0's only peer 1 passed nothing: 0 is not judged
    assert set(failed) == {1} and why == ""


def test_judging_is_deterministic() -> None:
    _, _, results = _simulate(9, {4, 7})
    expected = judge(9, results)
    items = list(results.items())
    for seed in range(5):
        random.Random(seed).shuffle(items)
        assert judge(9, dict(items)) == expected


def test_a_long_reason_is_clipped() -> None:
    results = {(r, 100): SLOW for r in range(99)} | {(0, 1): OK}
    failed, _ = judge(101, results)
    assert set(failed) == {100} and len(failed[100]) == MAX_REASON
    Verdict(0, False, failed, "", 0.0, 0.0, 0.0)  # a valid verdict


@pytest.mark.parametrize("pair", [(1, 0), (0, 4), (-1, 2), (2, 2)])
def test_judge_refuses_a_pair_out_of_the_world(pair: Pair) -> None:
    with pytest.raises(NetcheckError, match="not two ranks"):
        judge(4, {pair: OK})


def test_retest_steps_keep_only_pairs_of_unresolved_ranks() -> None:
    first = {(0, 1): OK, (2, 3): SLOW, (4, 5): OK, (6, 7): OK}
    assert retest_steps(8, first) == [[(1, 2), (3, 4)]]
    assert retest_steps(8, dict.fromkeys(first, OK)) == []
    assert retest_steps(8, dict.fromkeys(first, SLOW)) == pair_steps(8, 1)
    assert retest_steps(2, {(0, 1): SLOW}) == []


def test_combine_keeps_the_worse_end_of_each_pair() -> None:
    floors = Floors(max_latency_s=0.1, min_bandwidth_bps=10e6)
    steps = [[(0, 1), (2, 3)], [(0, 4)]]
    none = (-1.0, -1.0)
    measured = [
        [(0.01, 5e8), (0.02, 4e8)],
        [(0.03, 6e8), none],
        [(0.01, 5e8), none],
        [(0.2, 5e8), none],
        [none, (0.01, 5e6)],
    ]
    got = combine(steps, measured, floors)
    assert got == {
        (0, 1): PairResult(0.03, 5e8, True),
        (2, 3): PairResult(0.2, 5e8, False),
        (0, 4): PairResult(0.02, 5e6, False),
    }
    with pytest.raises(NetcheckError, match="reported no measurement"):
        combine(steps, [*measured[:4], [none, none]], floors)
    with pytest.raises(NetcheckError, match="no measurement of pair"):
        combine(steps, measured[:4], floors)
