"""The job-wide checkpoint step: each node's record of its verified committed steps (the
codec of ``checkpoints/<node>``), the restorable step every rank can load, the scan of a
slot folder with real torch slots (a corrupt slot drops its step), and ``load()`` taking
the agreed step from ``$KELASTIC_CHECKPOINT_STEP``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kelastic import checkpoint, contract
from kelastic.checkpoint import CheckpointError, CheckpointRestoreError, CheckpointStore
from kelastic.checkpoint.discard import discard_newer
from kelastic.checkpoint.scan import verified_steps
from kelastic.checkpoint.slot_format import HEADER_SIZE, decode_header
from kelastic.checkpoint.store import SLOTS, slot_path
from kelastic.etcd_values import CorruptValueError, ForeignValueError
from kelastic.etcd_values.checkpoints import (
    MAX_LOCAL_RANKS,
    CheckpointsDoc,
    Restore,
    RestoreTier,
    decode_checkpoints,
    encode_checkpoints,
    parse_endpoint,
    peer_sources,
    peer_step,
    persisted_step,
    restorable_step,
    restore_of,
    unfetchable,
)
from tests.conftest import strict_umask

# ------------------------------------------------------------------ the codec

DEEP = b"[" * 500 + b"]" * 500  # nesting past the bounded reader's depth
TOKEN = "0123456789abcdef0123456789abcdef"
V3 = b'{"version":3,"job":"j","ranks":{},"persisted":[],"time":1,'
V4 = b'{"version":4,"job":"j","ranks":{},"replicas":{},"endpoint":"","token":"","persisted":[],'


def _v3(replicas: bytes = b"{}", endpoint: bytes = b'""', token: bytes = b'""') -> bytes:
    return V3 + b'"replicas":' + replicas + b',"endpoint":' + endpoint + b',"token":' + token + b"}"


def _v4(unfetchable: bytes = b"[]", domain: bytes = b'""') -> bytes:
    return V4 + b'"time":1,"unfetchable":' + unfetchable + b',"domain":' + domain + b"}"


def test_a_record_round_trips() -> None:
    doc = CheckpointsDoc("uid-1", {0: (12, 11), 3: (7,), 1: ()}, 1764190000.5, ((10, 4), (5, 2)))
    raw = encode_checkpoints(doc)
    assert raw == (b'{"version":4,"job":"uid-1","ranks":{"0":[12,11],"1":[],"3":[7]},'
                   b'"replicas":{},"endpoint":"","token":"","unfetchable":[],"domain":"",'
                   b'"persisted":[[10,4],[5,2]],"time":1764190000.5}')  # fmt: skip
    assert decode_checkpoints(raw, "k") == doc
    served = CheckpointsDoc("uid-1", {0: (12,)}, 1.5, (), {5: (12, 10)}, "10.0.3.7:29610", TOKEN)
    assert decode_checkpoints(encode_checkpoints(served), "k") == served
    v6 = CheckpointsDoc("uid-1", {}, 1.5, (), {}, "[fd00::7]:29610", TOKEN)
    assert decode_checkpoints(encode_checkpoints(v6), "k") == v6
    assert parse_endpoint("[fd00::7]:29610") == ("fd00::7", 29610)
    assert parse_endpoint("pod-1.job.ns.svc:1") == ("pod-1.job.ns.svc", 1)


def test_a_version_3_record_is_read_as_one_that_failed_no_fetch() -> None:
    raw = _v3(b'{"1":[4]}', b'"h:80"', f'"{TOKEN}"'.encode())
    doc = decode_checkpoints(raw, "k")
    assert doc.unfetchable == () and doc.replicas == {1: (4,)} and doc.endpoint == "h:80"
    with pytest.raises(CorruptValueError, match="fields"):  # version 3 knew no unfetchable
        decode_checkpoints(raw[:-1] + b',"unfetchable":[]}', "k")
    failed = CheckpointsDoc("j", {}, 1.0, unfetchable=(9, 4))
    assert decode_checkpoints(encode_checkpoints(failed), "k") == failed
    zoned = CheckpointsDoc("j", {}, 1.0, domain="eu-west-1a")
    assert decode_checkpoints(encode_checkpoints(zoned), "k") == zoned
    assert decode_checkpoints(_v4(domain=b'"' + b"z" * 63 + b'"'), "k").domain == "z" * 63
    assert decode_checkpoints(_v4(domain=b'"us_east.1"'), "k").domain == "us_east.1"


def test_a_version_2_record_is_read_as_one_that_holds_no_replica_and_serves_nothing() -> None:
    raw = b'{"version":2,"job":"j","ranks":{"0":[3]},"persisted":[[2,1]],"time":1.5}'
    assert decode_checkpoints(raw, "k") == CheckpointsDoc("j", {0: (3,)}, 1.5, ((2, 1),))
    with pytest.raises(CorruptValueError, match="fields"):  # version 2 knew no replicas
        decode_checkpoints(b'{"version":2,"job":"j","ranks":{},"persisted":[],"replicas":{},'
                           b'"time":1}', "k")  # fmt: skip


def test_a_version_1_record_is_read_as_one_that_sees_no_persisted_step() -> None:
    raw = b'{"version":1,"job":"j","ranks":{"0":[3]},"time":1.5}'
    assert decode_checkpoints(raw, "k") == CheckpointsDoc("j", {0: (3,)}, 1.5, ())
    with pytest.raises(CorruptValueError, match="fields"):  # version 1 knew no persisted
        decode_checkpoints(b'{"version":1,"job":"j","ranks":{},"persisted":[],"time":1}', "k")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "corrupt checkpoint record at k"),
        (b"[]", "corrupt checkpoint record at k"),
        (b'{"version":1,"job":"j","ranks":{},"time":1,"x":2}', "fields"),
        (b'{"version":1,"job":"","ranks":{},"time":1}', "bad job"),
        (b'{"version":1,"job":"j","ranks":{},"time":-1}', "bad time"),
        (b'{"version":1,"job":"j","ranks":[],"time":1}', "ranks is not an object"),
        (b'{"version":1,"job":"j","ranks":{"01":[1]},"time":1}', "out of range"),
        (b'{"version":1,"job":"j","ranks":{"-1":[1]},"time":1}', "not a decimal rank"),
        (b'{"version":1,"job":"j","ranks":{"9999999999":[1]},"time":1}', "out of range"),
        (b'{"version":1,"job":"j","ranks":{"0":[4,3,2,1]},"time":1}', "at most 3"),
        (b'{"version":1,"job":"j","ranks":{"0":[1,2]},"time":1}', "newest first"),
        (b'{"version":1,"job":"j","ranks":{"0":[3,1,2]},"time":1}', "newest first"),
        (b'{"version":1,"job":"j","ranks":{"0":[2,2]},"time":1}', "newest first"),
        (b'{"version":1,"job":"j","ranks":{"0":[true]},"time":1}', "a step outside"),
        (b'{"version":1,"job":"j","ranks":{"0":[1.5]},"time":1}', "a step outside"),
        (b'{"version":1,"job":"j","ranks":{"0":[9007199254740993]},"time":1}', "a step outside"),
        (b'{"version":true,"job":"j","ranks":{},"time":1}', "bad version"),
        (b'{"version":2,"job":"j","ranks":{},"time":1}', "fields"),
        (b'{"version":2,"job":"j","ranks":{},"persisted":{},"time":1}', "not a list"),
        (b'{"version":3,"job":"j","ranks":{},"persisted":[],"time":1}', "fields"),
        (_v3(b"[]"), "replicas is not an object"),
        (_v3(b'{"x":[1]}'), "replicas: rank 'x' is not a decimal rank"),
        (_v3(b'{"0":[1,2]}'), "replicas: rank 0: steps .* newest first"),
        (_v3(b'{"0":[1,1,1,1]}'), "replicas: rank 0: steps is not a list of at most 3"),
        (_v3(b'{"0":[NaN]}'), "corrupt checkpoint record"),
        (_v3(endpoint=b'"10.0.0.1"', token=f'"{TOKEN}"'.encode()), "endpoint .* host:port"),
        (_v3(endpoint=b'"10.0.0.1:0"', token=f'"{TOKEN}"'.encode()), "not host:port"),
        (_v3(endpoint=b'"10.0.0.1:65536"', token=f'"{TOKEN}"'.encode()), "not host:port"),
        (_v3(endpoint=b'"10.0.0.1:080"', token=f'"{TOKEN}"'.encode()), "not host:port"),
        (_v3(endpoint=b'":80"', token=f'"{TOKEN}"'.encode()), "not host:port"),
        (_v3(endpoint=b'"a b:80"', token=f'"{TOKEN}"'.encode()), "not host:port"),
        (_v3(endpoint=b'"a\\nb:80"', token=f'"{TOKEN}"'.encode()), "not host:port"),
        (_v3(endpoint=b'"' + b"h" * 300 + b':80"', token=f'"{TOKEN}"'.encode()), "host:port"),
        (_v3(endpoint=b"80", token=f'"{TOKEN}"'.encode()), "not host:port"),
        (_v3(endpoint=b'"h:80"', token=b'"0123"'), "token is not"),
        (_v3(endpoint=b'"h:80"', token=f'"{TOKEN.upper()}"'.encode()), "token is not"),
        (_v3(endpoint=b'"h:80"', token=b"7"), "token is not"),
        (_v3(endpoint=b'"h:80"'), "an endpoint needs a token"),
        (_v3(token=f'"{TOKEN}"'.encode()), "an endpoint needs a token"),
        (_v4(domain=b"7"), "domain 7 is not a label value"),
        (_v4(domain=b'"-a"'), "is not a label value"),
        (_v4(domain=b'"a-"'), "is not a label value"),
        (_v4(domain=b'"a b"'), "is not a label value"),
        (_v4(domain=b'"a/b"'), "is not a label value"),
        (_v4(domain=b'"' + b"z" * 64 + b'"'), "is not a label value"),
        (_v4(domain=rb'"eu-west-1\u00e9"'), "is not a label value"),
        (_v4(b"{}"), "unfetchable is not a list"),
        (_v4(b"[" + b"1," * 16 + b"0]"), "unfetchable is not a list of at most 16"),
        (_v4(b"[1,2]"), "unfetchable steps are not distinct, newest first"),
        (_v4(b"[2,2]"), "unfetchable steps are not distinct"),
        (_v4(b"[-1]"), "unfetchable is not a list"),
        (_v4(b"[9007199254740993]"), "unfetchable is not a list"),
        (_v4(b"[1.0]"), "unfetchable is not a list"),
        (_v4(b"[true]"), "unfetchable is not a list"),
        (_v4(b"[NaN]"), "corrupt checkpoint record"),
        (_v4(b"[" * 400 + b"]" * 400), "corrupt checkpoint record"),
        (
            b'{"version":2,"job":"j","ranks":{},"persisted":[[1,1]' + b",[0,1]" * 16 + b"],"
            b'"time":1}',
            "at most 16",
        ),
        (b'{"version":2,"job":"j","ranks":{},"persisted":[[1]],"time":1}', "is not \\[step"),
        (b'{"version":2,"job":"j","ranks":{},"persisted":[[1,0]],"time":1}', "is not \\[step"),
        (b'{"version":2,"job":"j","ranks":{},"persisted":[[-1,1]],"time":1}', "is not \\[step"),
        (
            b'{"version":2,"job":"j","ranks":{},"persisted":[[1,2147483648]],"time":1}',
            "is not \\[step",
        ),
        (b'{"version":2,"job":"j","ranks":{},"persisted":[[1,true]],"time":1}', "is not \\[step"),
        (b'{"version":2,"job":"j","ranks":{},"persisted":[[1,1.0]],"time":1}', "is not \\[step"),
        (
            b'{"version":2,"job":"j","ranks":{},"persisted":[[9007199254740993,1]],"time":1}',
            "is not \\[step",
        ),
        (b'{"version":2,"job":"j","ranks":{},"persisted":[[1,1],[2,1]],"time":1}', "newest first"),
        (b'{"version":2,"job":"j","ranks":{},"persisted":[[2,1],[2,4]],"time":1}', "newest first"),
        (
            b'{"version":2,"job":"j","ranks":{},"persisted":'
            + b"[" * 500
            + b"]" * 500
            + b',"time":1}',
            "corrupt checkpoint record",
        ),
    ],
)
def test_a_corrupt_record_is_refused_with_its_key(raw: bytes, message: str) -> None:
    with pytest.raises(CorruptValueError, match=message) as info:
        decode_checkpoints(raw, "k")
    assert " at k" in str(info.value)


def test_another_version_is_foreign_and_bad_docs_are_not_written() -> None:
    with pytest.raises(ForeignValueError, match="version 5, this kelastic reads 1, 2, 3, 4"):
        decode_checkpoints(b'{"version":5,"job":"j","ranks":{},"time":1}', "k")
    for doc in (
        CheckpointsDoc("j", {}, 1.0, ((1, 1), (2, 1))),
        CheckpointsDoc("j", {}, 1.0, ((1, 0),)),
        CheckpointsDoc("j", {}, 1.0, tuple((s, 1) for s in range(17, 0, -1))),
        CheckpointsDoc("", {}, 1.0),
        CheckpointsDoc("j", {0: (1, 2)}, 1.0),
        CheckpointsDoc("j", {-1: (1,)}, 1.0),
        CheckpointsDoc("j", {r: (1,) for r in range(MAX_LOCAL_RANKS + 1)}, 1.0),
        CheckpointsDoc("j", {0: (1,)}, float("nan")),
        CheckpointsDoc("j", {}, 1.0, (), {0: (1, 2)}),
        CheckpointsDoc("j", {}, 1.0, (), {}, "h:80"),
        CheckpointsDoc("j", {}, 1.0, (), {}, "", TOKEN),
        CheckpointsDoc("j", {}, 1.0, (), {}, "h:99999", TOKEN),
        CheckpointsDoc("j", {}, 1.0, unfetchable=(1, 2)),
        CheckpointsDoc("j", {}, 1.0, unfetchable=tuple(range(17, 0, -1))),
        CheckpointsDoc("j", {}, 1.0, unfetchable=(2**53 + 1,)),
        CheckpointsDoc("j", {}, 1.0, domain="-zone"),
        CheckpointsDoc("j", {}, 1.0, domain="z" * 64),
    ):
        with pytest.raises(CorruptValueError):
            encode_checkpoints(doc)


# ------------------------------------------------------------------ the agreed step


def _doc(ranks: dict[int, tuple[int, ...]], job: str = "j") -> CheckpointsDoc:
    return CheckpointsDoc(job, ranks, 1.0)


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ({"a": _doc({0: (8, 7), 1: (8, 7)}), "b": _doc({2: (8, 7), 3: (8, 7)})}, 8),
        # rank 3 was killed before it committed 8: the step all four hold is 7
        ({"a": _doc({0: (8, 7), 1: (8, 7)}), "b": _doc({2: (8, 7), 3: (7, 6)})}, 7),
        # two steps apart: nothing in common, every rank gets None (never a mixed step)
        ({"a": _doc({0: (9, 8), 1: (9, 8)}), "b": _doc({2: (9, 8), 3: (7, 6)})}, None),
        # a corrupt slot left rank 1 with its older step only
        ({"a": _doc({0: (8, 7), 1: (7,)}), "b": _doc({2: (8, 7), 3: (8, 7)})}, 7),
        # node b's record is missing or corrupt (None), or of another run, or lacks a rank
        ({"a": _doc({0: (8, 7), 1: (8, 7)}), "b": None}, None),
        ({"a": _doc({0: (8, 7), 1: (8, 7)})}, None),
        ({"a": _doc({0: (8, 7), 1: (8, 7)}), "b": _doc({2: (8, 7), 3: (8, 7)}, "old")}, None),
        ({"a": _doc({0: (8, 7), 1: (8, 7)}), "b": _doc({2: (8, 7)})}, None),
        # the ranks of a node count only from the node that runs them now: b's slots of
        # ranks 0, 1 do not help a, whose own are gone (a Pod replaced)
        ({"a": _doc({}), "b": _doc({0: (8, 7), 1: (8, 7), 2: (8, 7), 3: (8, 7)})}, None),
        ({"a": _doc({0: (0,), 1: (0,)}), "b": _doc({2: (0,), 3: (0,)})}, 0),
    ],
)
def test_the_restorable_step_is_the_highest_every_rank_holds(
    records: dict[str, CheckpointsDoc | None], expected: int | None
) -> None:
    assert restorable_step(records, ("a", "b"), 2, "j") == expected


def test_the_restorable_step_follows_the_group_ranks_of_the_round() -> None:
    records = {"a": _doc({0: (5, 4)}), "b": _doc({1: (4, 3)})}
    assert restorable_step(records, ("a", "b"), 1, "j") == 4
    assert restorable_step(records, ("b", "a"), 1, "j") is None  # swapped group ranks
    assert restorable_step(records, (), 1, "j") is None
    with pytest.raises(ValueError, match="nproc"):
        restorable_step(records, ("a",), 0, "j")


def test_a_rounds_restore_says_where_from_whether_anything_was_held_and_when() -> None:
    a = CheckpointsDoc("j", {0: (8, 7), 1: (8, 7)}, 100.0)
    b = CheckpointsDoc("j", {2: (8,), 3: (8,)}, 105.5)
    assert restore_of(3, {"a": a, "b": b}, ("a", "b"), 2, "j") == Restore(
        round=3, step=8, tier=RestoreTier.MEMORY, ranks=4, held=True, time=105.5
    )
    # b's Pod was replaced: its new slots are empty; a held steps, so something was lost
    lost = restore_of(4, {"a": a, "b": CheckpointsDoc("j", {}, 200.0)}, ("a", "b"), 2, "j")
    assert (lost.step, lost.tier, lost.held, lost.time) == (None, RestoreTier.NONE, True, 200.0)
    # a fresh start: every node recorded, none held a step
    fresh = restore_of(0, {"a": CheckpointsDoc("j", {}, 1.0)}, ("a",), 2, "j")
    assert (fresh.step, fresh.tier, fresh.held) == (None, RestoreTier.NONE, False)
    # another run's records (a rerun of a same-named job) hold nothing of this one
    other = restore_of(1, {"a": CheckpointsDoc("old", {0: (9,), 1: (9,)}, 50.0)}, ("a",), 2, "j")
    assert (other.step, other.held, other.time) == (None, False, 0.0)
    assert restore_of(1, {"a": None}, ("a",), 2, "j").held is False  # missing or corrupt


A12, B12, A87 = {0: (12,), 1: (12,)}, {2: (12,), 3: (12,)}, {0: (8, 7), 1: (8, 7)}


def _disk(persisted: tuple[tuple[int, int], ...], ranks: dict[int, tuple[int, ...]] | None = None,
          job: str = "j") -> CheckpointsDoc:  # fmt: skip
    return CheckpointsDoc(job, ranks or {}, 1.0, persisted)


@pytest.mark.parametrize(
    ("records", "step", "tier"),
    [
        # b's Pod was replaced (its slots empty): both saw step 10 complete on disk
        (
            {"a": _disk(((10, 4), (5, 4)), {0: (12, 11), 1: (12, 11)}), "b": _disk(((10, 4),))},
            10,
            RestoreTier.DISK,
        ),
        # every rank holds 12 in memory: newer than the disk's 10, and faster
        (
            {
                "a": _disk(((10, 4),), {0: (12,), 1: (12,)}),
                "b": _disk(((10, 4),), {2: (12,), 3: (12,)}),
            },
            12,
            RestoreTier.MEMORY,
        ),
        # the same step in memory and on disk: memory
        (
            {
                "a": _disk(((12, 4),), {0: (12,), 1: (12,)}),
                "b": _disk(((12, 4),), {2: (12,), 3: (12,)}),
            },
            12,
            RestoreTier.MEMORY,
        ),
        # memory agrees on 7 only (rank 3 lost 8), the disk has 8 complete: the disk's
        (
            {
                "a": _disk(((8, 4),), {0: (8, 7), 1: (8, 7)}),
                "b": _disk(((8, 4),), {2: (8, 7), 3: (7,)}),
            },
            8,
            RestoreTier.DISK,
        ),
        # a saw 15 complete, b read the folder before it was: the newest both saw
        ({"a": _disk(((15, 4), (10, 4))), "b": _disk(((10, 4),))}, 10, RestoreTier.DISK),
        # b sees no persistence (or its record is missing, or of another run): none
        ({"a": _disk(((10, 4),)), "b": _disk(())}, None, RestoreTier.NONE),
        ({"a": _disk(((10, 4),)), "b": None}, None, RestoreTier.NONE),
        ({"a": _disk(((10, 4),)), "b": _disk(((10, 4),), job="old")}, None, RestoreTier.NONE),
        # saved by a world of 2: ranks 2 and 3 have no folder; a world of 8 covers all 4
        ({"a": _disk(((10, 2),)), "b": _disk(((10, 2),))}, None, RestoreTier.NONE),
        ({"a": _disk(((10, 8), (9, 2))), "b": _disk(((10, 8), (9, 2)))}, 10, RestoreTier.DISK),
        ({"a": _disk(((0, 4),)), "b": _disk(((0, 4),))}, 0, RestoreTier.DISK),
    ],
)
def test_a_round_restores_the_newer_of_memory_and_disk_and_never_mixes_them(
    records: dict[str, CheckpointsDoc | None], step: int | None, tier: RestoreTier
) -> None:
    got = restore_of(5, records, ("a", "b"), 2, "j")
    assert (got.step, got.tier) == (step, tier)
    if tier is RestoreTier.DISK:
        assert persisted_step(records, ("a", "b"), 2, "j") == step
    assert got.held is any(d is not None and d.job == "j" and (d.ranks or d.persisted)
                           for d in records.values())  # fmt: skip


def _held(ranks: dict[int, tuple[int, ...]], replicas: dict[int, tuple[int, ...]] | None = None,
          serves: bool = True, persisted: tuple[tuple[int, int], ...] = (),
          job: str = "j") -> CheckpointsDoc:  # fmt: skip
    endpoint, token = ("10.0.0.9:29610", TOKEN) if serves else ("", "")
    return CheckpointsDoc(job, ranks, 1.0, persisted, replicas or {}, endpoint, token)


@pytest.mark.parametrize(
    ("records", "step", "tier"),
    [
        # b's Pod was replaced (its slots empty); a holds b's ranks as replicas: the peer
        (
            {"a": _held({0: (12, 11), 1: (12, 11)}, {2: (12, 11), 3: (12,)}), "b": _held({})},
            12,
            RestoreTier.PEER,
        ),
        # the replica of rank 3 lags (11): the newest step every rank can get is 11
        (
            {"a": _held({0: (12, 11), 1: (12, 11)}, {2: (12, 11), 3: (11,)}), "b": _held({})},
            11,
            RestoreTier.PEER,
        ),
        # every rank holds 12 itself: memory, whatever the replicas hold
        ({"a": _held(A12, B12), "b": _held(B12, A12)}, 12, RestoreTier.MEMORY),
        # a holds replicas but serves nothing (no endpoint): b cannot fetch them
        ({"a": _held(A12, B12, serves=False), "b": _held({})}, None, RestoreTier.NONE),
        # ... while a replica the rank's own node holds needs no endpoint (copied there)
        ({"a": _held(A12, serves=False), "b": _held({}, B12, serves=False)}, 12, RestoreTier.PEER),
        # ranks renumbered: b ran ranks 0, 1 before and serves its slots to a
        ({"a": _held({2: (9,), 3: (9,)}), "b": _held({0: (9,), 1: (9,)})}, 9, RestoreTier.PEER),
        # the disk is newer than what the peers hold: the disk
        (
            {
                "a": _held(A87, {2: (8,), 3: (8,)}, persisted=((10, 4),)),
                "b": _held({}, persisted=((10, 4),)),
            },
            10,
            RestoreTier.DISK,
        ),
        # the peer and the disk hold the same step: the peer (faster)
        (
            {"a": _held(A12, B12, persisted=((12, 4),)), "b": _held({}, persisted=((12, 4),))},
            12,
            RestoreTier.PEER,
        ),
        # a replica of another run counts for nothing
        ({"a": _held(A12), "b": _held({}, B12, job="old")}, None, RestoreTier.NONE),
    ],
)
def test_a_round_restores_from_a_peer_what_no_node_of_a_rank_holds_itself(
    records: dict[str, CheckpointsDoc | None], step: int | None, tier: RestoreTier
) -> None:
    got = restore_of(2, records, ("a", "b"), 2, "j")
    assert (got.step, got.tier) == (step, tier)
    if tier is RestoreTier.PEER:  # memory alone would restore an older step or none
        assert peer_step(records, ("a", "b"), 2, "j") == step
        assert restorable_step(records, ("a", "b"), 2, "j") != step
    assert got.held


def test_a_step_a_participant_could_not_fetch_is_never_the_peers_again() -> None:
    held = {"a": _held({0: (12, 11), 1: (12, 11)}, {2: (12, 11), 3: (12, 11)})}
    failed = CheckpointsDoc("j", {}, 1.0, unfetchable=(12,))
    got = restore_of(2, {**held, "b": failed}, ("a", "b"), 2, "j")
    assert (got.step, got.tier) == (11, RestoreTier.PEER)  # the next step both can get
    assert restore_of(2, {**held, "b": _held({})}, ("a", "b"), 2, "j").step == 12
    both = CheckpointsDoc("j", {}, 1.0, unfetchable=(12, 11))
    assert restore_of(2, {**held, "b": both}, ("a", "b"), 2, "j").tier is RestoreTier.NONE
    # memory needs no fetch: a step every rank's node holds is restored all the same
    mem = {"a": _held({0: (12,), 1: (12,)}), "b": _held({2: (12,), 3: (12,)})}
    mem["b"] = CheckpointsDoc("j", {2: (12,), 3: (12,)}, 1.0, unfetchable=(12,))
    assert restore_of(2, mem, ("a", "b"), 2, "j").tier is RestoreTier.MEMORY
    # another run's marks count for nothing
    other = CheckpointsDoc("old", {}, 1.0, unfetchable=(12,))
    assert unfetchable({**held, "b": other}, ("a", "b"), "j") == set()


def test_the_sources_of_a_rank_are_its_writers_nodes_first_and_only_those_that_serve() -> None:
    records = {
        "a": _held({}, {2: (12,)}),
        "b": _held({2: (12, 11)}),
        "c": _held({2: (12,)}, serves=False),
        "d": _held({}, {2: (12,)}, job="old"),
        "e": None,
    }
    names = ["a", "b", "c", "d", "e"]
    assert [n for n, _ in peer_sources(records, names, "j", 2, 12)] == ["b", "a"]
    assert [n for n, _ in peer_sources(records, names, "j", 2, 11)] == ["b"]
    assert peer_sources(records, names, "j", 2, 10) == []
    assert peer_sources(records, names, "j", 3, 12) == []
    with pytest.raises(ValueError, match="nproc"):
        peer_step(records, names, 0, "j")


def test_the_persisted_step_needs_participants_and_workers() -> None:
    records = {"a": _disk(((3, 1),))}
    assert persisted_step(records, (), 1, "j") is None
    assert persisted_step(records, ("a",), 1, "j") == 3
    with pytest.raises(ValueError, match="nproc"):
        persisted_step(records, ("a",), 0, "j")


# ------------------------------------------------------------------ the scan


def _save(directory: Path, rank: int, steps: range, job: str = "j") -> None:
    with CheckpointStore(directory, rank=rank, job=job) as ckpt:
        for step in steps:
            ckpt.save(step, {"w": torch.full((300_000,), float(step)), "s": step}, blocking=True)


def _flip_payload(path: Path) -> None:
    raw = path.read_bytes()
    offset = decode_header(raw[:HEADER_SIZE], file_size=len(raw)).layout.payload_offset + 4096
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([raw[offset] ^ 0x01]))


def _slot_of(directory: Path, rank: int, step: int) -> Path:
    for slot in range(SLOTS):
        raw = slot_path(directory, rank, slot).read_bytes()
        if decode_header(raw[:HEADER_SIZE], file_size=len(raw)).step == step:
            return slot_path(directory, rank, slot)
    raise AssertionError(f"no slot of rank {rank} holds step {step}")


def test_the_scan_counts_committed_slots_that_pass_their_checksums(tmp_path: Path) -> None:
    _save(tmp_path, 0, range(1, 5))  # slots hold 4 (newest), 3 and 2
    _save(tmp_path, 1, range(1, 5))
    _save(tmp_path, 2, range(1, 2))  # one slot committed, the other never written
    _save(tmp_path, 7, range(1, 3), job="another")
    (tmp_path / "rank-x.slot0").write_bytes(b"junk")
    (tmp_path / "rank-5.slot0").write_bytes(b"too short for a header")
    assert verified_steps(tmp_path, "j") == {0: (4, 3, 2), 1: (4, 3, 2), 2: (1,)}
    _flip_payload(_slot_of(tmp_path, 1, 3))  # one bit of rank 1's step 3
    assert verified_steps(tmp_path, "j") == {0: (4, 3, 2), 1: (4, 2), 2: (1,)}
    assert verified_steps(tmp_path / "missing", "j") == {}
    assert verified_steps(tmp_path, "another") == {7: (2, 1)}


def test_the_steps_newer_than_the_agreed_one_are_dropped_and_saved_again(tmp_path: Path) -> None:
    # The job agreed on 2: the slots of 3 and 4 are an abandoned run's; the training goes
    # on from 2 and saves 3 again, which must be the only 3 left.
    _save(tmp_path, 0, range(1, 5))  # 4, 3, 2
    _save(tmp_path, 1, range(1, 4))  # 3, 2, 1
    _save(tmp_path, 7, range(1, 3), job="another")
    (tmp_path / "rank-x.slot0").write_bytes(b"junk")
    (tmp_path / "rank-5.slot0").write_bytes(b"too short for a header")
    assert sorted(discard_newer(tmp_path, "j", 2)) == [(0, 3), (0, 4), (1, 3)]
    assert verified_steps(tmp_path, "j") == {0: (2,), 1: (2, 1)}
    assert discard_newer(tmp_path, "j", 2) == []  # done once
    with CheckpointStore(tmp_path, rank=0, job="j") as ckpt:
        ckpt.save(3, {"w": torch.full((300_000,), -3.0), "s": 3}, blocking=True)
        loaded = ckpt.load(3)
        assert loaded is not None and loaded[1]["s"] == 3 and bool((loaded[1]["w"] == -3).all())
        assert sorted(i.step for i in ckpt.slots()) == [2, 3]  # the old 3 and 4 are gone
    # the job agreed on none: every step of the job is dropped, another job's kept
    assert sorted(discard_newer(tmp_path, "j", None)) == [(0, 2), (0, 3), (1, 1), (1, 2)]
    assert verified_steps(tmp_path, "j") == {}
    assert verified_steps(tmp_path, "another") == {7: (2, 1)}
    assert discard_newer(tmp_path / "missing", "j", None) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another user")
def test_another_user_can_check_the_slots_whatever_the_umask(pod_run_dir: Path) -> None:
    """The sidecar may run as another user than the trainer (as root with only CAP_KILL
    when the operator does not know the trainer's user): the slots are readable."""
    with strict_umask():
        _save(pod_run_dir, 0, range(1, 3))
    assert {slot_path(pod_run_dir, 0, s).stat().st_mode & 0o777 for s in (0, 1)} == {0o644}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, no capabilities
        try:
            os.setgid(65534)
            os.setuid(65534)
            out = repr(verified_steps(pod_run_dir, "j"))
        except BaseException as exc:
            out = repr(exc)
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    got = os.read(read, 4096).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert got == "{0: (2, 1)}"


# ------------------------------------------------------------------ load() under the sidecar


@pytest.fixture
def rank_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(tmp_path))
    monkeypatch.setenv(contract.RANK, "0")
    monkeypatch.setenv(contract.TORCHELASTIC_RUN_ID, "j")
    monkeypatch.setattr(checkpoint, "_default", None)
    monkeypatch.setattr(checkpoint, "_sized", False)
    _save(tmp_path, 0, range(1, 5))
    return tmp_path


def test_load_takes_the_agreed_step(rank_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        loaded = checkpoint.load()  # no sidecar: the rank's own newest
        assert loaded is not None and loaded[0] == 4
        monkeypatch.setenv(contract.ENV_CHECKPOINT_STEP, "2")  # a peer lacks steps 4 and 3
        loaded = checkpoint.load()
        assert loaded is not None and loaded[0] == 2 and loaded[1]["s"] == 2
        assert bool((loaded[1]["w"] == 2.0).all())
        monkeypatch.setenv(contract.ENV_CHECKPOINT_STEP, contract.CHECKPOINT_STEP_NONE)
        assert checkpoint.load() is None  # the job agreed on none: every rank starts over
        monkeypatch.setenv(contract.ENV_CHECKPOINT_STEP, "1")  # overwritten since the agreement
        with pytest.raises(CheckpointRestoreError, match="slot 0: holds step 4, not 1"):
            checkpoint.load()  # never another step, never None while the peers load it
        loaded = checkpoint.load(step=4)  # an explicit step wins
        assert loaded is not None and loaded[0] == 4
        for bad in ("", "-1", "2.0", "x", "1" * 17):
            monkeypatch.setenv(contract.ENV_CHECKPOINT_STEP, bad)
            with pytest.raises(CheckpointError, match="KELASTIC_CHECKPOINT_STEP"):
                checkpoint.load()
    finally:
        checkpoint.default_store().close()


def test_a_slot_corrupted_after_the_agreement_fails_the_load_never_a_mixed_restore(
    rank_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not step 3 (another rank may not hold it), not None while the other ranks load
    step 4: the worker fails, and the next round's records no longer list step 4 here."""
    _flip_payload(_slot_of(rank_env, 0, 4))
    monkeypatch.setenv(contract.ENV_CHECKPOINT_STEP, "4")
    try:
        with pytest.raises(CheckpointRestoreError, match=r"rank 0 cannot load the agreed "
                           r"checkpoint step 4 from memory \(slot \d: .*crc32"):  # fmt: skip
            checkpoint.load()
        assert checkpoint.load(step=3) is not None  # asked by the user: this rank's own
        assert checkpoint.load(step=4) is None
    finally:
        checkpoint.default_store().close()
    assert 4 not in verified_steps(rank_env, "j").get(0, ())
