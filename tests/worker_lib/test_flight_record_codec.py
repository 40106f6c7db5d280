"""The flight record file's codec: what is read of torch's dump (the newest collective
entered per process group), the file bounded by dropping the oldest entries, and what no
writer produces refused (the decoder fuzzers are in ``tests/test_decoder_fuzz.py``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kelastic.flight_recorder import (
    MAX_GROUPS,
    Collective,
    FlightRecordError,
    decode_record,
    encode_record,
    last_collectives,
    record_name,
)


def _entry(seq: int, name: str = "gloo:all_reduce", pg: tuple[str, str] = ("0", "default_pg"),
           retired: bool = True, **more: Any) -> dict[str, Any]:  # fmt: skip
    """One entry as torch 2.13's ``_dump_fr_trace_json`` writes it (its fields seen here
    with gloo: the state stays ``scheduled``, ``retired`` says it finished)."""
    return {"collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "op_id": seq,
            "process_group": list(pg), "profiling_name": name, "retired": retired,
            "state": "scheduled", "input_sizes": [[1000]], "output_sizes": [[1000]],
            "timeout_ms": 1800000, **more}  # fmt: skip


def test_the_newest_collective_per_group_is_read_from_torchs_dump() -> None:
    trace = {"entries": [
        _entry(1), _entry(2), _entry(3, "gloo:barrier"),
        _entry(1, "gloo:broadcast", ("1", "undefined")),  # a subgroup with no description
        _entry(0, "gloo:send", is_p2p=True, p2p_seq_id=4),  # point-to-point: not counted
        _entry(4, retired=False),
        {"collective_seq_id": "5"}, "junk", _entry(-1),
        _entry(9, pg=("0",)) | {"profiling_name": 3},
    ]}  # fmt: skip
    assert last_collectives(trace) == (
        Collective("default_pg", 4, "gloo:all_reduce", done=False),
        Collective("1", 1, "gloo:broadcast", done=True),
    )
    assert last_collectives({"entries": [_entry(2, state="completed", retired=False)]}) == (
        Collective("default_pg", 2, "gloo:all_reduce", done=True),  # NCCL's finished state
    )
    for junk in (None, [], {"entries": None}, {"entries": {"a": 1}}, "x"):
        assert last_collectives(junk) == ()


def test_a_record_round_trips_and_is_cut_to_its_bound_oldest_entries_first() -> None:
    trace = {"entries": [_entry(i, input_sizes=[[7] * 200]) for i in range(1, 501)]}
    raw = encode_record(812, 3, trace, max_bytes=64 * 1024)
    assert len(raw) <= 64 * 1024
    record = decode_record(raw)
    assert record.pid == 812 and record.rank == 3
    assert record.last == (Collective("default_pg", 500, "gloo:all_reduce", done=True),)
    kept = json.loads(raw)["trace"]
    assert 0 < record.entries == len(kept) < 500 and kept[-1]["collective_seq_id"] == 500
    assert record_name(812, 3) == "rank-3-pid-812.json" and record_name(812, None) == "pid-812.json"
    # groups past the bound are not named; a writer never names more
    many = {"entries": [_entry(1, pg=(str(g), f"g{g}")) for g in range(MAX_GROUPS + 10)]}
    assert len(decode_record(encode_record(1, None, many)).last) == MAX_GROUPS


@pytest.mark.parametrize(
    ("pid", "rank", "max_bytes"), [(0, 0, 4096), (2**31, 0, 4096), (1, -1, 4096), (1, 0, 100)]
)
def test_the_writer_refuses_what_it_cannot_write(pid: int, rank: int, max_bytes: int) -> None:
    with pytest.raises(ValueError):
        encode_record(pid, rank, {"entries": []}, max_bytes)


GOOD: dict[str, Any] = {
    "version": 1, "pid": 9, "rank": 0, "trace": [],
    "last": [{"group": "default_pg", "seq": 5, "name": "gloo:all_reduce", "done": False}],
}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"version": 2}, {"version": True}, {"pid": 0}, {"pid": 2**31}, {"rank": -1},
        {"rank": "0"}, {"last": {}}, {"trace": {}},
        {"last": [{**GOOD["last"][0], "seq": 0}]},
        {"last": [{**GOOD["last"][0], "seq": 2**63}]},
        {"last": [{**GOOD["last"][0], "done": 1}]},
        {"last": [{**GOOD["last"][0], "group": ""}]},
        {"last": [{**GOOD["last"][0], "name": "x" * 257}]},
        {"last": [GOOD["last"][0], GOOD["last"][0]]},  # a group twice
        {"last": [GOOD["last"][0]] * (MAX_GROUPS + 1)},
    ],
)  # fmt: skip
def test_the_reader_refuses_what_no_writer_produces(change: dict[str, Any]) -> None:
    assert decode_record(json.dumps(GOOD).encode()).last[0].seq == 5
    with pytest.raises(FlightRecordError):
        decode_record(json.dumps({**GOOD, **change}).encode())
    for raw in (b"", b"[]", b"{", b'{"pid": NaN}', b"[" * 100_000, b" " * (2 * 1024 * 1024)):
        with pytest.raises(FlightRecordError):
            decode_record(raw)
