"""Hostile input to every decoder of data that crosses a trust boundary.

Each decoder must either return a value within its documented bounds or raise its own
corrupt-input error, never anything else (``ValueError`` from Python's int-digit limit,
``RecursionError``, ``TypeError``, ...), whatever the bytes. First the probes' crafted
inputs, then property-based fuzzing with hypothesis: arbitrary bytes, arbitrary JSON
values, and valid documents with one field replaced by an arbitrary JSON value; every
decoder of the registry ``DECODERS`` gets the same probes and the same three fuzzers.
Bounded in time: a fixed number of examples per decoder, no deadline per example (the
machine is shared), no example database.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kelastic import contract, etcd_values
from kelastic import inprocess_messages as ipm
from kelastic._control import ProtocolError, encode_message, parse_message
from kelastic._safejson import UnsafeJSONError, loads_bounded
from kelastic.control_messages import MAX_CHECK_LINE, Assign, Checked, Exited, Promote
from kelastic.errors import parse_error_data
from kelastic.etcd_values import MAX_RANK, MAX_ROUND, decode_master
from kelastic.prestop import parse_reply, reply_left, reply_not_left
from kelastic_operator.etcd_view import view_from_keys
from kelastic_sidecar.control import ControlProtocolError, parse_launcher_message
from kelastic_sidecar.rendezvous.state import (
    RendezvousState,
    RendezvousStateError,
    decode_state,
    encode_state,
)
from kelastic_sidecar.restart_budget import (
    RestartRecord,
    RestartRecordError,
    decode_record,
    encode_record,
)
from kelastic_sidecar.supervisor import node_report
from kelastic_sidecar.timer import TimerServer
from kelastic_sidecar.timer.wire import LineSplitter, _BadRequest, _parse
from kelastic_sidecar.torchrun_plugin import decode_envelope, encode_envelope

FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

HUGE = "9" * 5000
DEEP = b"[" * 50_000 + b"]" * 50_000  # 100 KB of nested brackets

# ------------------------------------------------------------------ valid documents

STATE = RendezvousState(
    run_id="run-1",
    round=3,
    complete=True,
    deadline=1.7e9,
    participants={"job-0": 0, "job-1": 1},
    wait_list=frozenset({"job-2"}),
    departed={"job-3": "rejoin"},
)
RECORD = RestartRecord(
    count=1,
    last_round=2,
    history=({"round": 2, "cause": "hang", "node": "job-0", "detail": {}, "time": 1.7e9},),
)
STARTED = {"type": "started", "attempt": 1, "pids": {"0": 1234, "1": 1235}, "warm": 0}
EXITED = {
    "type": "exited",
    "attempt": 1,
    "local_rank": 0,
    "pid": 1234,
    "exitcode": 1,
    "signal": None,
    "error": {"message": "boom"},
    "tail": ["line"],
    "oom": False,
}
ASSIGN = {
    "type": "assign",
    "attempt": 1,
    "round": 2,
    "workers": [{"local_rank": 0, "env": {"RANK": "0"}}],
}
FIFO_LINE = {
    "version": 1,
    "pid": 4242,
    "scope_id": "step",
    "expiration_time": 1.7e9,
    "signal": 9,
}

# ------------------------------------------------------------------ the decoders


def _state(raw: bytes) -> None:
    try:
        state = decode_state(raw)
    except RendezvousStateError:
        return
    assert 0 <= state.round <= MAX_ROUND
    assert all(0 <= r <= MAX_RANK for r in state.participants.values())
    assert state.deadline is None or math.isfinite(state.deadline)
    encode_state(state)  # what was accepted can be written back (no NaN, no huge ints)


def _record(raw: bytes) -> None:
    try:
        record = decode_record(raw)
    except RestartRecordError:
        return
    encode_record(record)


def _envelope(raw: bytes) -> None:
    with contextlib.suppress(ValueError):
        decode_envelope(raw, "key")


def _master(raw: bytes) -> None:
    try:
        addr, port = decode_master(raw, "key")
    except ValueError:
        return
    assert isinstance(addr, str) and 0 < port < 65536


def _report(raw: bytes) -> None:
    keys = contract.Keys("/p/")
    kv = {keys.rdzv_state: raw, keys.restarts: raw, keys.report("n"): raw,
          keys.inprocess_iteration: raw}  # fmt: skip
    view = view_from_keys("/p/", kv, 2)
    assert view.round is None or isinstance(view.round, int)


#: The network check's messages (and the hello that says the launcher answers it).
CHECK = {"type": "check", "round": 2, "params": '{"round": 2}', "timeout": 120.0}
CHECKED = {"type": "checked", "round": 2, "verdict": '{"round": 2}'}
HELLO = {"type": "hello", "pid": 4242, "nproc": 2, "netcheck": True}


def _launcher_side(raw: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_message(raw)


def _sidecar_side(raw: bytes) -> None:
    try:
        msg = parse_launcher_message(raw)
    except ControlProtocolError:
        return
    assert isinstance(msg.type, str)
    if isinstance(msg, Checked):  # exactly one of the two, within its bound
        assert (msg.verdict is None) != (msg.error is None)
        assert len((msg.verdict or msg.error or "").encode()) <= MAX_CHECK_LINE


def _fifo(raw: bytes) -> None:
    try:
        request = _parse(raw)
    except _BadRequest:
        return
    assert math.isfinite(request.expiration_time) and 0 < request.pid < 2**31


# ------------------------------------- the in-process record and barrier keys

IP_RECORD = {"iteration": 3, "round": 2, "restarts": 3, "cause": "exception", "node": "job-1",
             "rank": 5, "message": "ValueError: boom", "time": 1.7e9}  # fmt: skip
IP_READY = {"group_rank": 0, "addr": "10.0.0.7", "port": 29517, "round": 2}


def _inprocess_record(raw: bytes) -> None:
    from kelastic_sidecar.inprocess.record import (
        MAX_COUNTER,
        IterationRecordError,
        decode_iteration_record,
        encode_iteration_record,
    )

    try:
        record = decode_iteration_record(raw)
    except IterationRecordError:
        return
    assert 0 <= record.iteration <= MAX_COUNTER and 0 <= record.restarts <= MAX_COUNTER
    assert math.isfinite(record.time)
    assert decode_iteration_record(encode_iteration_record(record)) == record


def _inprocess_ready(raw: bytes) -> None:
    from kelastic_sidecar.inprocess.record import IterationRecordError, decode_ready, encode_ready

    try:
        ready = decode_ready(raw)
    except IterationRecordError:
        return
    assert 0 < ready.port < 65536 and 0 < len(ready.addr) <= 255
    assert decode_ready(encode_ready(ready)) == ready


def _inprocess_record_operator(raw: bytes) -> None:
    """The operator's own tolerant reader: a record within bounds, or None."""
    from kelastic_operator.inprocess_record import MAX_COUNTER, MAX_TEXT, decode_record

    record = decode_record(raw)
    if record is None:
        return
    assert 0 <= record.iteration <= MAX_COUNTER and 0 <= record.restarts <= MAX_COUNTER
    assert record.rank is None or 0 <= record.rank <= MAX_COUNTER
    assert record.time is None or math.isfinite(record.time)
    assert max(len(record.cause), len(record.node), len(record.message)) <= MAX_TEXT


# ------------------------------------- the in-process restart protocol's messages

IPM_WORKER = {"type": "fault", "iteration": 3, "local_rank": 1, "cause": "exception",
              "message": "ValueError: boom"}  # fmt: skip
IPM_COORDINATOR = {"type": "go", "iteration": 4, "env": {"MASTER_PORT": "29500"}}
#: every message type, so that one replaced field meets each type's own checks
IPM_KINDS = ("hello", "fault", "progress", "ready", "done", "abort", "go", "give_up", "other")


def _ipm_worker(raw: bytes) -> None:
    try:
        message = ipm.parse_worker_message(raw)
    except ipm.ProtocolError:
        return
    if not isinstance(message, ipm.Unknown):
        assert 0 <= message.iteration <= ipm.MAX_COUNTER
        assert 0 <= message.local_rank <= 4095
        ipm.encode(message)  # what was accepted can be sent on


def _ipm_coordinator(raw: bytes) -> None:
    try:
        message = ipm.parse_coordinator_message(raw)
    except ipm.ProtocolError:
        return
    if isinstance(message, ipm.Go):
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in message.env.items())
    if not isinstance(message, ipm.Unknown):
        ipm.encode(message)


def _every_kind(doc: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    return tuple({**doc, "type": kind, "pid": 42, "rank": 0, "reason": "r"} for kind in IPM_KINDS)


# ------------------------- spare ranks: promote (control) and a spare's hello (in-process)

PROMOTE = {"type": "promote", "attempt": 2, "spare_slot": 2, "local_rank": 1, "pid": 4242}
SPARE_HELLO = {"type": "hello", "pid": 4242, "local_rank": 2, "rank": 4, "iteration": 0,
               "spare": True}  # fmt: skip
ASSIGN_SPARES = {"type": "assign", "attempt": 1, "round": 0, "spares": 1,
                 "workers": [{"local_rank": 0, "env": {}},
                             {"local_rank": 1, "env": {}}]}  # fmt: skip


def _promote(raw: bytes) -> None:
    try:
        msg = parse_message(raw)
    except ProtocolError:
        return
    if isinstance(msg, Promote):
        assert 0 <= msg.spare_slot <= 4095 and 0 <= msg.local_rank <= 4095
        assert msg.spare_slot != msg.local_rank and msg.attempt >= 0 and 1 <= msg.pid < 2**31
    if isinstance(msg, Assign):
        assert 0 <= msg.spares <= contract.MAX_INPROCESS_SPARES


def _spare_hello(raw: bytes) -> None:
    try:
        msg = ipm.parse_worker_message(raw)
    except ipm.ProtocolError:
        return
    if isinstance(msg, ipm.Hello):
        assert isinstance(msg.spare, bool)
        ipm.encode(msg)


# ------------------------------------------ checkpoint slots: the manifest (kelastic.checkpoint)

CKPT_MANIFEST = {"format": 1, "tensors": [["float32", [2, 3], 0, 24], ["int64", [], 64, 8]],
                 "tree": ["d", "w", ["T", 0], "step", ["T", 1], "lr", 0.5]}  # fmt: skip


def _checkpoint_manifest(raw: bytes) -> None:
    from kelastic.checkpoint.slot_format import SlotFormatError, decode_manifest
    from kelastic.checkpoint.tree import build

    try:
        manifest = decode_manifest(raw, payload_len=4096)
    except SlotFormatError:
        return
    end = 0
    for tensor in manifest.tensors:
        assert end <= tensor.offset and tensor.offset + tensor.nbytes <= 4096
        end = tensor.offset + tensor.nbytes
    build(manifest.tree, [None] * len(manifest.tensors))  # what was accepted builds


# ------------------------- the one codec of each etcd value (kelastic.etcd_values)

REPORT = json.loads(node_report("failed", "job-0", "job failed: x"))


def _strict_and_partial(
    decode: Callable[..., Any], raw: bytes
) -> tuple[Any, type[Exception] | None, Any, type[Exception] | None]:
    """What the strict (the sidecars') and the partial (the operator's) reading make of
    ``raw``: (value, error class) each."""
    out: list[Any] = []
    for partial in (False, True):
        try:
            out += [decode(raw, partial=partial), None]
        except (etcd_values.CorruptValueError, etcd_values.ForeignValueError) as exc:
            out += [None, type(exc)]
    return out[0], out[1], out[2], out[3]


def _readers_agree(
    decode: Callable[..., Any], encode: Callable[[Any], bytes], doc_type: Any, raw: bytes
) -> None:
    """The strict reader's value is the partial reader's; a value with every field (and
    no other) that the strict reader calls corrupt, the partial reader refuses too; what
    is read is written back unchanged."""
    strict, strict_error, partial, partial_error = _strict_and_partial(decode, raw)
    try:
        doc = loads_bounded(raw, max_bytes=1 << 22)
    except UnsafeJSONError:
        doc = None
    complete = isinstance(doc, dict) and set(doc) == set(doc_type.__annotations__)
    if strict_error is None:
        assert partial == strict
        written = encode(strict)
        assert encode(decode(written)) == written  # read back alike, written alike
    elif strict_error is etcd_values.CorruptValueError and (complete or doc is None):
        assert partial_error is etcd_values.CorruptValueError, raw[:200]
    else:  # another version: the partial reader shows what it can, within the bounds
        assert partial_error in (None, etcd_values.CorruptValueError)


def _state_codec(raw: bytes) -> None:
    def decode(raw: bytes, partial: bool = False) -> etcd_values.StateDoc:
        return etcd_values.decode_state(raw, partial=partial)

    _readers_agree(decode, etcd_values.encode_state, etcd_values.StateDoc, raw)


def _restarts_codec(raw: bytes) -> None:
    def decode(raw: bytes, partial: bool = False) -> etcd_values.RestartsDoc:
        return etcd_values.decode_restarts(raw, partial=partial)

    _readers_agree(decode, etcd_values.encode_restarts, etcd_values.RestartsDoc, raw)


def _report_codec(raw: bytes) -> None:
    def decode(raw: bytes, partial: bool = False) -> etcd_values.ReportDoc:
        return etcd_values.decode_report(raw, partial=partial)

    _readers_agree(decode, etcd_values.encode_report, etcd_values.ReportDoc, raw)


def _departure(raw: bytes) -> None:
    reason = etcd_values.decode_departure(raw)
    assert isinstance(reason, str) and len(reason) <= etcd_values.MAX_NAME_LEN
    if reason:
        assert etcd_values.decode_departure(etcd_values.encode_departure(reason)) == reason


def _master_codec(raw: bytes) -> None:
    try:
        addr, port = decode_master(raw, "key")
    except etcd_values.CorruptValueError:
        return
    assert decode_master(etcd_values.encode_master(addr, port), "key") == (addr, port)


def _restored_codec(raw: bytes) -> None:
    import math

    from kelastic.checkpoint.restored import Restored, decode_restored

    got = decode_restored(raw, 3)  # never raises
    if got is None:
        return
    assert isinstance(got, Restored) and got.rank == 3 and got.tier in ("memory", "disk")
    assert 0 <= got.round <= 2**53 and 0 <= got.step <= 2**53
    assert math.isfinite(got.seconds) and 0 <= got.seconds <= 86400


RESTORED = {"round": 3, "step": 120, "tier": "memory", "seconds": 0.0123}


def _flight_record(raw: bytes) -> None:
    from kelastic.flight_recorder import MAX_GROUPS, MAX_NAME, FlightRecordError, decode_record

    with contextlib.suppress(FlightRecordError):
        got = decode_record(raw)
        assert 1 <= got.pid < 2**31 and (got.rank is None or 0 <= got.rank < 2**31)
        assert len(got.last) <= MAX_GROUPS and len({c.group for c in got.last}) == len(got.last)
        for c in got.last:
            assert 1 <= c.seq < 2**63 and 0 < len(c.group) <= MAX_NAME >= len(c.name)
            assert type(c.done) is bool


FLIGHT_RECORD = {"version": 1, "pid": 812, "rank": 3,
                 "last": [{"group": "default_pg", "seq": 5, "name": "gloo:all_reduce",
                           "done": False}, {"group": "1", "seq": 2, "name": "gloo:broadcast",
                                            "done": True}],
                 "trace": [{"collective_seq_id": 5,
                            "process_group": ["0", "default_pg"]}]}  # fmt: skip


def _hang(raw: bytes) -> None:
    from kelastic.etcd_values import CorruptValueError
    from kelastic.etcd_values.hangs import decode_hang
    from kelastic.hang_where import MAX_RANK_GROUPS, MAX_RANKS

    with contextlib.suppress(CorruptValueError):
        got = decode_hang(raw)
        assert len(got.ranks) <= MAX_RANKS
        assert all(len(r.collectives) <= MAX_RANK_GROUPS for r in got.ranks)


HANG = {"round": 3, "node": "job-1",
        "ranks": [{"rank": 2, "local_rank": 0, "pid": 812, "state": "S", "reaped": False,
                   "where": "main thread at /w/train.py:231 in _epochs",
                   "collectives": FLIGHT_RECORD["last"]}]}  # fmt: skip


def _netcheck_params(raw: bytes) -> None:
    from kelastic.netcheck import NetcheckError, decode_params

    with contextlib.suppress(NetcheckError):
        got = decode_params(raw)
        assert 0 <= got.rank < got.world_size <= 65536 and 0 <= got.round < 2**63
        assert 1 <= got.master_port <= 65535 and 1 <= len(got.master_addr) <= 253
        assert math.isfinite(got.timeout_s) and 1 <= got.timeout_s <= 600
        f = got.floors
        assert 1e-6 <= f.max_latency_s <= 60 and 1 <= f.min_bandwidth_bps <= 1e13
        assert 4 <= f.size_bytes <= 256 * 2**20 and f.size_bytes % 4 == 0
        assert 1 <= f.iterations <= 100


NETCHECK_PARAMS = {"round": 3, "rank": 1, "world_size": 4, "master_addr": "10.0.3.7",
                   "master_port": 29500, "timeout_s": 30.0,
                   "floors": {"max_latency_s": 0.05, "min_bandwidth_bps": 5e7,
                              "size_bytes": 4194304, "iterations": 5}}  # fmt: skip


def _netcheck_verdict(raw: bytes) -> None:
    from kelastic.netcheck import (
        MAX_FAILED,
        MAX_INCONCLUSIVE,
        MAX_REASON,
        NetcheckError,
        decode_verdict,
    )

    with contextlib.suppress(NetcheckError):
        got = decode_verdict(raw)
        assert 0 <= got.round < 2**63 and type(got.passed) is bool
        assert len(got.failed) <= MAX_FAILED and len(got.inconclusive) <= MAX_INCONCLUSIVE
        assert all(0 <= r < 65536 and len(why) <= MAX_REASON for r, why in got.failed.items())
        assert got.passed + bool(got.failed) + bool(got.inconclusive) == 1
        for x in (got.latency_s, got.bandwidth_bps, got.seconds):
            assert math.isfinite(x) and x >= 0


NETCHECK_VERDICT = {"round": 3, "passed": False,
                    "failed": {"2": "failed every pair test it was in (with rank 1: ...)"},
                    "inconclusive": "", "latency_s": 0.2, "bandwidth_bps": 2e7,
                    "seconds": 3.8}  # fmt: skip


def _netcheck_setting(raw: bytes) -> None:
    from kelastic.netcheck import NetcheckError, decode_setting

    with contextlib.suppress(NetcheckError):
        got = decode_setting(raw.decode("utf-8", errors="replace"))
        assert math.isfinite(got.timeout_s) and 1 <= got.timeout_s <= 600
        f = got.floors
        assert 1e-6 <= f.max_latency_s <= 60 and 1 <= f.min_bandwidth_bps <= 1e13
        assert 4 <= f.size_bytes <= 256 * 2**20 and 1 <= f.iterations <= 100


NETCHECK_SETTING = {"floors": NETCHECK_PARAMS["floors"], "timeoutSeconds": 30.0}


def _checkpoints_codec(raw: bytes) -> None:
    from kelastic.etcd_values.checkpoints import (
        MAX_PERSISTED,
        MAX_SLOTS,
        MAX_STEP,
        MAX_UNFETCHABLE,
        decode_checkpoints,
        encode_checkpoints,
        is_domain,
        parse_endpoint,
        restorable_step,
        restore_of,
    )

    try:
        doc = decode_checkpoints(raw, "key")
    except (etcd_values.CorruptValueError, etcd_values.ForeignValueError):
        return
    for rank, steps in doc.ranks.items():
        assert rank >= 0 and len(steps) <= MAX_SLOTS and all(0 <= s <= MAX_STEP for s in steps)
        assert list(steps) == sorted(set(steps), reverse=True)
    steps = [s for s, _ in doc.persisted]
    assert len(steps) <= MAX_PERSISTED and steps == sorted(set(steps), reverse=True)
    assert all(0 <= s <= MAX_STEP and 1 <= w <= 2**31 - 1 for s, w in doc.persisted)
    for rank, steps in doc.replicas.items():
        assert rank >= 0 and len(steps) <= MAX_SLOTS and all(0 <= s <= MAX_STEP for s in steps)
    assert is_domain(doc.domain) and len(doc.domain) <= 63
    assert len(doc.unfetchable) <= MAX_UNFETCHABLE
    assert list(doc.unfetchable) == sorted(set(doc.unfetchable), reverse=True)
    assert all(0 <= s <= MAX_STEP for s in doc.unfetchable)
    assert bool(doc.endpoint) == bool(doc.token)
    assert not doc.endpoint or parse_endpoint(doc.endpoint) is not None
    assert decode_checkpoints(encode_checkpoints(doc), "key") == doc  # written alike
    nodes = ("a",)
    step = restorable_step({"a": doc}, nodes, max(1, len(doc.ranks)), doc.job)
    assert step is None or all(step in doc.ranks.get(r, ()) for r in range(len(doc.ranks)))
    held = {s for r in (doc.ranks, doc.replicas) for ss in r.values() for s in ss}
    for replicated in (False, True):
        restore = restore_of(0, {"a": doc}, nodes, max(1, len(doc.ranks)), doc.job,
                             replicated=replicated)  # fmt: skip
        assert restore.step is None or restore.step in {*steps, *held}
        if restore.tier.value == "peer":
            assert restore.step not in doc.unfetchable


CHECKPOINTS = {"version": 4, "job": "uid", "ranks": {"0": [12, 11], "1": [12]},
               "replicas": {"2": [12, 10]}, "endpoint": "10.0.3.7:29610",
               "token": "0123456789abcdef", "unfetchable": [14, 13], "domain": "eu-west-1a",
               "persisted": [[10, 2], [5, 2]], "time": 1.5}  # fmt: skip
CHECKPOINTS_V3 = {"version": 3, "job": "uid", "ranks": {"0": [12, 11], "1": [12]},
                  "replicas": {"2": [12, 10]}, "endpoint": "10.0.3.7:29610",
                  "token": "0123456789abcdef", "persisted": [[10, 2], [5, 2]],
                  "time": 1.5}  # fmt: skip
CHECKPOINTS_V1 = {"version": 1, "job": "uid", "ranks": {"0": [12, 11], "1": [12]}, "time": 1.5}
CHECKPOINTS_V2 = {"version": 2, "job": "uid", "ranks": {"0": [12, 11], "1": [12]},
                  "persisted": [[10, 2], [5, 2]], "time": 1.5}  # fmt: skip


def _checkpoint_load(raw: bytes) -> None:
    from kelastic.etcd_values import CorruptValueError
    from kelastic.etcd_values.loads import MAX_LOCAL_RANKS, decode_load, encode_load

    for partial in (False, True):
        with contextlib.suppress(CorruptValueError):
            got = decode_load(raw, partial=partial)
            assert 1 <= got.ranks <= MAX_LOCAL_RANKS and got.tier in ("memory", "peer", "disk")
            assert math.isfinite(got.seconds) and 0 <= got.seconds <= 86400
            assert decode_load(encode_load(got)) == got  # what it read, the writer writes


CHECKPOINT_LOAD = {"round": 3, "step": 120, "tier": "disk", "ranks": 2, "seconds": 0.0123,
                   "time": 1764190000.5}  # fmt: skip


# ------------------------------------------------------------------ the registry


@dataclass(frozen=True)
class Decoder:
    """One decoder under fuzzing: it returns, or raises only its own corrupt-input error
    (the function asserts what it returned is within bounds), whatever the bytes."""

    decode: Callable[[bytes], None]
    #: a document it accepts; crafted literals and fuzzed values replace one field of it
    valid: dict[str, Any]
    #: more valid documents whose one field the fuzzer replaces (besides ``valid``)
    variants: tuple[dict[str, Any], ...] = ()


DECODERS: dict[str, Decoder] = {
    "state": Decoder(_state, json.loads(encode_state(STATE))),
    "record": Decoder(_record, json.loads(encode_record(RECORD))),
    "envelope": Decoder(_envelope, json.loads(encode_envelope(b"torch-state"))),
    "master": Decoder(_master, {"addr": "10.0.0.1", "port": 29500}),
    "node_report": Decoder(_report, json.loads(node_report("failed", "job-0", "job failed: x"))),
    "control_launcher": Decoder(_launcher_side, ASSIGN, (CHECK,)),
    "control_sidecar": Decoder(_sidecar_side, EXITED, (CHECKED, HELLO)),
    "fifo": Decoder(_fifo, FIFO_LINE),
    "inprocess_record": Decoder(_inprocess_record, IP_RECORD),
    "inprocess_record_operator": Decoder(_inprocess_record_operator, IP_RECORD),
    "inprocess_ready": Decoder(_inprocess_ready, IP_READY),
    "inprocess_worker": Decoder(_ipm_worker, IPM_WORKER, _every_kind(IPM_WORKER)),
    "inprocess_coordinator": Decoder(
        _ipm_coordinator, IPM_COORDINATOR, _every_kind(IPM_COORDINATOR)
    ),
    "promote": Decoder(_promote, PROMOTE),
    "assign_spares": Decoder(_promote, ASSIGN_SPARES),
    "spare_hello": Decoder(_spare_hello, SPARE_HELLO),
    "checkpoint_manifest": Decoder(_checkpoint_manifest, CKPT_MANIFEST),
    "state_codec": Decoder(_state_codec, json.loads(encode_state(STATE))),
    "restarts_codec": Decoder(_restarts_codec, json.loads(encode_record(RECORD))),
    "report_codec": Decoder(_report_codec, REPORT, ({**REPORT, "outcome": "succeeded"},)),
    "master_codec": Decoder(_master_codec, {"addr": "10.0.0.1", "port": 29500}),
    "departure": Decoder(_departure, {"reason": "scale_down"}),
    "checkpoints_codec": Decoder(
        _checkpoints_codec, CHECKPOINTS, (CHECKPOINTS_V1, CHECKPOINTS_V2, CHECKPOINTS_V3)
    ),
    "restored": Decoder(_restored_codec, RESTORED),
    "checkpoint_load": Decoder(_checkpoint_load, CHECKPOINT_LOAD),
    "flight_record": Decoder(_flight_record, FLIGHT_RECORD),
    "hang": Decoder(_hang, HANG),
    "netcheck_params": Decoder(_netcheck_params, NETCHECK_PARAMS),
    "netcheck_setting": Decoder(_netcheck_setting, NETCHECK_SETTING),
    "netcheck_verdict": Decoder(
        _netcheck_verdict,
        NETCHECK_VERDICT,
        (
            {**NETCHECK_VERDICT, "passed": True, "failed": {}},
            {**NETCHECK_VERDICT, "failed": {}, "inconclusive": "rank 0: forming the group failed"},
        ),
    ),
}
VALID: dict[str, dict[str, Any]] = {name: d.valid for name, d in DECODERS.items()}

# ------------------------------------------------------------- crafted (the probes)


def _with(doc: dict[str, Any], field: str, literal: str) -> bytes:
    """``doc`` with ``field`` set to a raw JSON literal (which json.dumps cannot write)."""
    text = json.dumps({**doc, field: "@@"})
    return text.replace('"@@"', literal).encode()


CRAFTED = [
    pytest.param(_with(VALID["state"], "round", HUGE), id="round-5000-digits"),
    pytest.param(DEEP, id="nested-brackets-100KB"),
    pytest.param(_with(VALID["state"], "closed_reason", DEEP.decode()), id="deep-reason"),
    pytest.param(_with(VALID["state"], "deadline", "NaN"), id="deadline-nan"),
    pytest.param(_with(VALID["state"], "deadline", "Infinity"), id="deadline-inf"),
    pytest.param(_with(VALID["state"], "deadline", "-Infinity"), id="deadline-neg-inf"),
    pytest.param(_with(VALID["state"], "deadline", "1e999"), id="deadline-1e999"),
    pytest.param(
        _with(VALID["state"], "participants", '{"a": 1000000000000000000000000000000}'),
        id="rank-10e30",
    ),
    pytest.param(_with(VALID["state"], "round", "true"), id="round-bool"),
    pytest.param(_with(VALID["state"], "version", "true"), id="version-bool"),
]
#: set in turn as every field of every decoder's valid document
CRAFTED_LITERALS = (HUGE, "NaN", "1e999", "-1", "true", "[" * 5000 + "]" * 5000)


@pytest.mark.parametrize("raw", CRAFTED)
def test_decode_state_refuses_crafted_values(raw: bytes) -> None:
    with pytest.raises(RendezvousStateError):
        decode_state(raw)


@pytest.mark.parametrize("raw", CRAFTED)
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_every_decoder_survives_crafted_values(name: str, raw: bytes) -> None:
    decoder = DECODERS[name]
    decoder.decode(raw)
    for field in decoder.valid:  # the same literals in every field of a valid document
        for literal in CRAFTED_LITERALS:
            decoder.decode(_with(decoder.valid, field, literal))


# ------------------------------------------------------------------ hypothesis

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(raw=st.binary(max_size=400))
def test_fuzz_bytes(name: str, raw: bytes) -> None:
    DECODERS[name].decode(raw)


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(value=json_values)
def test_fuzz_json_values(name: str, value: Any) -> None:
    DECODERS[name].decode(_dumps(value))


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(data=st.data(), value=json_values, depth=st.integers(0, 60))
def test_fuzz_one_field_of_a_valid_document(
    name: str, data: st.DataObject, value: Any, depth: int
) -> None:
    decoder = DECODERS[name]
    doc = dict(data.draw(st.sampled_from((decoder.valid, *decoder.variants))))
    field = data.draw(st.sampled_from(sorted(doc)))
    for _ in range(depth):  # nest the replacement: depth bound edges
        value = [value]
    doc[field] = value
    decoder.decode(_dumps(doc))


# ------------------------------------------------------- each decoder's own cases


@pytest.mark.parametrize("literal", [HUGE, "NaN", "Infinity", "1e999", "-1e999"])
def test_record_refuses_crafted_numbers(literal: str) -> None:
    with pytest.raises(RestartRecordError):
        decode_record(_with(VALID["record"], "count", literal))


def test_valid_documents_still_decode() -> None:
    assert decode_state(encode_state(STATE)) == STATE
    assert decode_record(encode_record(RECORD)) == RECORD
    assert decode_master(b'{"addr": "10.0.0.1", "port": 29500}', "k") == ("10.0.0.1", 29500)
    assert parse_launcher_message(json.dumps(STARTED).encode()).as_dict() == STARTED
    assert parse_launcher_message(json.dumps(EXITED).encode()).as_dict() == EXITED
    oom = {**EXITED, "signal": 9, "exitcode": None, "oom": True}
    assert parse_launcher_message(json.dumps(oom).encode()).as_dict() == oom
    # an older launcher sends no "oom": not OOM-killed
    older = {k: v for k, v in EXITED.items() if k != "oom"}
    assert parse_launcher_message(json.dumps(older).encode()) == parse_launcher_message(
        json.dumps(EXITED).encode()
    )
    assert _parse(json.dumps(FIFO_LINE).encode()).pid == 4242


def test_netcheck_valid_documents_decode() -> None:
    from kelastic.netcheck import decode_params, decode_verdict, encode_params, encode_verdict

    params = decode_params(json.dumps(NETCHECK_PARAMS).encode())
    assert json.loads(encode_params(params)) == NETCHECK_PARAMS
    for doc in (*DECODERS["netcheck_verdict"].variants, NETCHECK_VERDICT):
        assert json.loads(encode_verdict(decode_verdict(json.dumps(doc).encode()))) == doc


def test_loads_bounded_raises_only_its_error() -> None:
    for raw in (DEEP, HUGE.encode(), b"NaN", b"1e999", b"\xff", b'"\\ud800"x', b"{" * 40):
        with pytest.raises(UnsafeJSONError):
            loads_bounded(raw, max_bytes=1 << 20)
    assert loads_bounded(b'{"a": [1, 2.5, "[{"]}', max_bytes=100) == {"a": [1, 2.5, "[{"]}


_fifo_lines = st.lists(
    st.one_of(
        st.binary(max_size=200),
        json_values.map(_dumps),
        st.builds(
            lambda pid, exp, token: _dumps(
                {**FIFO_LINE, "pid": pid, "expiration_time": exp, "token": token}
            ),
            st.sampled_from([4242, 4243, 10**30, -1, 0]),
            st.one_of(st.floats(), st.integers(min_value=-(10**25), max_value=10**25)),
            st.one_of(st.none(), st.text(max_size=200), st.just("t0k3n")),
        ),
    ),
    max_size=30,
)


@FUZZ
@given(lines=_fifo_lines, cut=st.integers(1, 300))
def test_fuzz_fifo_stream_into_the_timer_table(
    tmp_path_factory: Any, lines: list[bytes], cut: int
) -> None:
    """Arbitrary lines, split at arbitrary points, through the server's splitter and
    table (not started: no thread, no FIFO): nothing raises, budgets hold."""
    server = TimerServer(
        tmp_path_factory.getbasetemp() / "never.fifo", max_timers=8, max_timers_per_pid=4,
        kill=lambda pid, sig: None,
    )  # fmt: skip
    server.watch_pid(4242, "t0k3n")
    stream = b"\n".join(lines) + b"\n"
    splitter = LineSplitter()
    with server._table.lock:
        for start in range(0, len(stream), cut):
            for line, oversized in splitter.feed(stream[start : start + cut]):
                server._table.handle_line(line, oversized)
    server._table.expire(time.time())
    assert server.active_timers() <= 8 + 4


@FUZZ
@given(data=json_values, timestamp=json_values)
@example(data="x", timestamp=1e300)
@example(data="x", timestamp=10**30)
@example(data="x", timestamp="9" * 300)
def test_fuzz_a_workers_error_file_never_stops_its_exit_report(data: Any, timestamp: Any) -> None:
    """Whatever a worker wrote as its error file, the launcher's "exited" message built
    from it is accepted by the sidecar (else the exit would go unreported)."""
    doc = {"message": {"message": data, "extraInfo": {"timestamp": timestamp}}}
    for value in (data, doc, {"message": "x", "timestamp": timestamp}):
        error = parse_error_data(value)
        message = {**EXITED, "error": error, "tail": ["a", "b"]}
        exited = parse_launcher_message(encode_message(message).rstrip(b"\n"))
        assert isinstance(exited, Exited) and exited.error == error


@pytest.mark.parametrize("value", [1, 0, "true", None, [], {}, 2.5])
def test_an_exited_oom_that_is_not_a_boolean_is_refused(value: object) -> None:
    """(Crafted numbers never reach the field: the bounded JSON decoder refuses them.)"""
    line = json.dumps({**EXITED, "oom": value}).encode()
    with pytest.raises(ControlProtocolError, match="'oom' must be true or false"):
        parse_launcher_message(line)


def test_inprocess_valid_documents_decode_and_crafted_counters_do_not() -> None:
    from kelastic_sidecar.inprocess.record import (
        IterationRecordError,
        decode_iteration_record,
        decode_ready,
    )

    assert decode_iteration_record(json.dumps(IP_RECORD).encode()).iteration == 3
    assert decode_ready(json.dumps(IP_READY).encode()).port == 29517
    for literal in (HUGE, "NaN", "Infinity", "1e999", "-2", "true", "9007199254740993"):
        with pytest.raises(IterationRecordError):
            decode_iteration_record(_with(IP_RECORD, "iteration", literal))
    with pytest.raises(IterationRecordError):
        decode_ready(_with(IP_READY, "port", "65536"))


def test_inprocess_messages_valid_documents_decode() -> None:
    assert ipm.parse_worker_message(ipm.encode(ipm.Fault(3, 1, "exception", "x"))[:-1]) == (
        ipm.Fault(3, 1, "exception", "x")
    )
    assert ipm.parse_coordinator_message(json.dumps(IPM_COORDINATOR).encode()) == ipm.Go(
        4, {"MASTER_PORT": "29500"}
    )


def test_spare_messages_decode_and_malformed_ones_are_refused() -> None:
    promote = Promote(2, 2, 1, 4242)
    assert parse_message(json.dumps(PROMOTE).encode()) == promote
    assert parse_message(encode_message(promote.as_dict())[:-1]) == promote
    assign = parse_message(json.dumps(ASSIGN_SPARES).encode())
    assert isinstance(assign, Assign) and assign.spares == 1
    assert "spares" not in Assign(1, 0, ()).as_dict()  # an old launcher sees no new field
    hello = ipm.parse_worker_message(json.dumps(SPARE_HELLO).encode())
    assert hello == ipm.Hello(4242, 2, 4, 0, spare=True)
    assert ipm.parse_worker_message(ipm.encode(hello)[:-1]) == hello
    plain = {k: v for k, v in SPARE_HELLO.items() if k != "spare"}
    assert ipm.parse_worker_message(json.dumps(plain).encode()) == ipm.Hello(4242, 2, 4, 0)
    for field, literal in (("spare_slot", "-1"), ("spare_slot", "4096"), ("local_rank", "2"),
                           ("local_rank", '"1"'), ("attempt", "true"), ("spare_slot", HUGE),
                           ("local_rank", "1.5"), ("pid", "0"), ("pid", "2147483648"),
                           ("pid", "null")):  # fmt: skip
        with pytest.raises(ProtocolError):
            parse_message(_with(PROMOTE, field, literal))  # local_rank 2 == the slot
    for literal in ("-1", "65", "true", '"1"', "1.0", HUGE):
        with pytest.raises(ProtocolError):
            parse_message(_with(ASSIGN_SPARES, "spares", literal))
    too_many = {**ASSIGN_SPARES, "workers": [{"local_rank": 4090, "env": {}}], "spares": 6}
    with pytest.raises(ProtocolError):
        parse_message(json.dumps(too_many).encode())  # spare slots past local rank 4095
    for literal in ("1", '"yes"', "null", "[]"):
        with pytest.raises(ipm.ProtocolError):
            ipm.parse_worker_message(_with(SPARE_HELLO, "spare", literal))


# ------------------------------- one bounded codec of the in-process record

#: Counters around every bound a reader or writer might have.
_EDGE_COUNTERS = st.sampled_from([0, 1, 2**31 - 2, 2**31 - 1, 2**31, 2**32, 2**53 - 1, 2**53,
                                  2**53 + 1, 2**63 - 1, -1, -2])  # fmt: skip


def _sidecar_reads(raw: bytes) -> tuple[int, int] | None:
    from kelastic_sidecar.inprocess.record import IterationRecordError, decode_iteration_record

    try:
        record = decode_iteration_record(raw)
    except IterationRecordError:
        return None
    return record.iteration, record.restarts


def _operator_reads(raw: bytes) -> tuple[int, int] | None:
    from kelastic_operator.inprocess_record import decode_record as operator_decode

    record = operator_decode(raw)
    return None if record is None else (record.iteration, record.restarts)


@FUZZ
@given(data=st.data(), value=json_values | _EDGE_COUNTERS)
@example(data=None, value=2**53).via("a forged iteration of 2**53")
def test_fuzz_every_reader_of_the_inprocess_record_agrees(data: Any, value: Any) -> None:
    """A record with one field replaced is refused by every reader alike, or
    read alike (before: the operator read records the sidecar refused, and the other way
    round)."""
    doc = dict(IP_RECORD)
    field = "iteration" if data is None else data.draw(st.sampled_from(sorted(doc)))
    doc[field] = value
    raw = _dumps(doc)
    assert _sidecar_reads(raw) == _operator_reads(raw), (field, value)


@FUZZ
@given(iteration=_EDGE_COUNTERS, restarts=_EDGE_COUNTERS, charge=st.booleans())
@example(iteration=2**53, restarts=0, charge=True).via("a forged iteration of 2**53")
def test_fuzz_what_the_writer_makes_of_a_record_it_read_is_read_back(
    iteration: int, restarts: int, charge: bool
) -> None:
    """The writer either refuses to advance a record the reader accepted, or
    writes one the reader accepts (before: it read 2**53 and wrote 2**53 + 1, which its
    own reader refused: in-process restart was off for the rest of the job)."""
    from kelastic_sidecar.inprocess.record import (
        IterationRecordError,
        decode_iteration_record,
        encode_iteration_record,
        next_record,
    )

    raw = _dumps({**IP_RECORD, "iteration": iteration, "restarts": restarts})
    try:
        record = decode_iteration_record(raw)
    except IterationRecordError:
        return
    try:
        after = next_record(record, round_=3, cause="exception", node="job-0", rank=1,
                            message="boom", now=1.7e9, charge=charge)  # fmt: skip
        written = encode_iteration_record(after)
    except IterationRecordError:
        return  # the strict writer refuses: nothing a reader refuses is stored
    assert decode_iteration_record(written).iteration == record.iteration + 1


_NOT_JSON_START = st.binary(min_size=1, max_size=1).filter(lambda b: b not in b' \t\r\n[{"')


@FUZZ
@given(head=_NOT_JSON_START, depth=st.integers(5, 200), tail=st.binary(max_size=40))
@example(head=b"\xff", depth=8, tail=b"").via("bytes that are not even UTF-8")
def test_fuzz_bytes_that_are_no_json_are_not_called_too_deep(
    head: bytes, depth: int, tail: bytes
) -> None:
    """Non-JSON bytes with brackets in them are "not JSON", not "nested deeper
    than 4" (the depth scan ran first and named the brackets)."""
    raw = head + b"[" * depth + tail + b"]" * depth
    with pytest.raises(UnsafeJSONError) as err:
        loads_bounded(raw, max_bytes=64 * 1024, max_depth=4)
    assert "nested deeper" not in str(err.value), raw
    assert "not JSON" in str(err.value)


# ------------------------------------------------- the preStop hook's answer line


@FUZZ
@given(raw=st.binary(max_size=600))
def test_fuzz_the_prestop_answer_is_a_reply_or_a_value_error(raw: bytes) -> None:
    """What the hook reads from the sidecar's socket (:func:`kelastic.prestop.parse_reply`):
    any bytes give a bounded, printable :class:`~kelastic.prestop.Reply` or ValueError."""
    try:
        reply = parse_reply(raw)
    except ValueError:
        return
    assert len(reply.text) <= 256 and reply.text.isprintable()


@FUZZ
@given(reason=st.text(max_size=300), timeout=st.floats(0.001, 1e6))
def test_fuzz_every_prestop_answer_the_sidecar_writes_is_read_back(
    reason: str, timeout: float
) -> None:
    left = parse_reply(reply_left(reason))
    assert left.left and left.text and "\n" not in left.text and len(left.text) <= 120
    assert not parse_reply(reply_not_left(timeout)).left
