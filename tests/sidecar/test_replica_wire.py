"""The replication protocol's codec (:mod:`kelastic_sidecar.replica.wire`): every message
round-trips, every bound is enforced on both sides, and hostile bytes or JSON raise
:class:`ReplicaWireError` and nothing else (hypothesis, bounded like
``tests/test_decoder_fuzz.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kelastic_sidecar.replica import ReplicaWireError, new_token
from kelastic_sidecar.replica.wire import (
    MAX_BYTES,
    MAX_ERROR_CHARS,
    MAX_JOB_CHARS,
    MAX_LINE,
    MAX_RANK,
    MAX_STEP,
    MAX_TOKEN_CHARS,
    Op,
    Reply,
    Request,
    Trailer,
    check_token,
    decode_reply,
    decode_request,
    decode_trailer,
    encode_reply,
    encode_request,
    encode_trailer,
    refusal,
)
from tests.test_decoder_fuzz import json_values

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TOKEN = "0123456789abcdef0123456789abcdef"
PUT = {"v": 1, "op": "put", "job": "uid-1", "token": TOKEN, "rank": 3, "step": 120,
       "bytes": 1 << 20}  # fmt: skip
GET = {"v": 1, "op": "get", "job": "uid-1", "token": TOKEN, "rank": 3, "step": 120}
OK = {"v": 1, "ok": True, "bytes": 4096}
REFUSAL = {"v": 1, "ok": False, "error": "bad token"}
TRAILER = {"v": 1, "commit": True}


def _line(doc: Any) -> bytes:
    return json.dumps(doc).encode() + b"\n"


# ------------------------------------------------------------------ valid messages


def test_each_message_round_trips() -> None:
    put = Request(Op.PUT, "uid-1", TOKEN, 3, 120, 1 << 20)
    get = Request(Op.GET, "uid-1", TOKEN, 3, 120)
    for req in (put, get):
        raw = encode_request(req)
        assert raw.endswith(b"\n") and raw.count(b"\n") == 1 and len(raw) <= MAX_LINE
        assert decode_request(raw) == req
    assert decode_request(_line(PUT)) == put
    assert decode_request(_line(GET)) == get
    assert json.loads(encode_request(get)) == GET
    for reply in (Reply(True, nbytes=4096), Reply(False, error="bad token")):
        assert decode_reply(encode_reply(reply)) == reply
    assert decode_reply(_line(OK)) == Reply(True, nbytes=4096)
    for commit in (True, False):
        assert decode_trailer(encode_trailer(commit)) == Trailer(commit)
    assert decode_request(json.dumps(GET).encode()) == get  # the newline is optional


def test_the_bounds_are_inclusive() -> None:
    req = Request(Op.PUT, "j" * MAX_JOB_CHARS, "a" * MAX_TOKEN_CHARS, MAX_RANK, MAX_STEP,
                  MAX_BYTES)  # fmt: skip
    assert decode_request(encode_request(req)) == req
    assert decode_request(encode_request(Request(Op.GET, "j", "F" * 16, 0, 0))).token == "F" * 16
    assert decode_reply(encode_reply(Reply(False, error="e" * MAX_ERROR_CHARS))).error
    assert check_token(new_token()) and len(new_token()) == 32


BAD_REQUESTS = [
    pytest.param({**GET, "v": 2}, id="version-2"),
    pytest.param({**GET, "v": True}, id="version-bool"),
    pytest.param({k: v for k, v in GET.items() if k != "v"}, id="no-version"),
    pytest.param({**GET, "op": "delete"}, id="unknown-op"),
    pytest.param({**GET, "op": ["get"]}, id="op-list"),
    pytest.param({**GET, "bytes": 10}, id="get-with-bytes"),
    pytest.param({k: v for k, v in PUT.items() if k != "bytes"}, id="put-without-bytes"),
    pytest.param({**GET, "extra": 1}, id="extra-field"),
    pytest.param({**GET, "job": ""}, id="empty-job"),
    pytest.param({**GET, "job": "j" * (MAX_JOB_CHARS + 1)}, id="long-job"),
    pytest.param({**GET, "job": 7}, id="job-int"),
    pytest.param({**GET, "token": "0123456789abcde"}, id="token-15"),
    pytest.param({**GET, "token": "a" * (MAX_TOKEN_CHARS + 1)}, id="token-129"),
    pytest.param({**GET, "token": "0123456789abcdeg"}, id="token-not-hex"),
    pytest.param({**GET, "token": "٠١٢٣٤٥٦٧٨٩٠١٢٣٤٥"}, id="token-unicode-digits"),
    pytest.param({**GET, "rank": -1}, id="rank-negative"),
    pytest.param({**GET, "rank": MAX_RANK + 1}, id="rank-over"),
    pytest.param({**GET, "rank": True}, id="rank-bool"),
    pytest.param({**GET, "rank": 1.0}, id="rank-float"),
    pytest.param({**GET, "step": MAX_STEP + 1}, id="step-over"),
    pytest.param({**PUT, "bytes": MAX_BYTES + 1}, id="bytes-over"),
    pytest.param({**PUT, "bytes": -5}, id="bytes-negative"),
    pytest.param([GET], id="not-an-object"),
]


@pytest.mark.parametrize("doc", BAD_REQUESTS)
def test_a_bad_request_is_refused(doc: Any) -> None:
    with pytest.raises(ReplicaWireError):
        decode_request(_line(doc))


@pytest.mark.parametrize(
    "doc",
    [{**OK, "ok": 1}, {**OK, "error": "x"}, {**REFUSAL, "bytes": 1}, {**REFUSAL, "error": ""},
     {**REFUSAL, "error": "e" * (MAX_ERROR_CHARS + 1)}, {**OK, "bytes": -1}, {**OK, "v": 0},
     {"v": 1, "ok": None}],
)  # fmt: skip
def test_a_bad_reply_is_refused(doc: Any) -> None:
    with pytest.raises(ReplicaWireError):
        decode_reply(_line(doc))


@pytest.mark.parametrize(
    "doc", [{"v": 1, "commit": 1}, {"v": 1}, {"v": 1, "commit": True, "x": 0}, {"commit": True}]
)
def test_a_bad_trailer_is_refused(doc: Any) -> None:
    with pytest.raises(ReplicaWireError):
        decode_trailer(_line(doc))


def test_lines_past_the_bound_are_refused_both_ways() -> None:
    long_line = json.dumps({**GET, "job": "j" * 200}).encode() + b" " * MAX_LINE + b"\n"
    with pytest.raises(ReplicaWireError, match="over the 1024-byte line"):
        decode_request(long_line)
    # a job of 256 characters that JSON escapes to 6 bytes each does not fit a line
    with pytest.raises(ReplicaWireError, match="over the 1024-byte line"):
        encode_request(Request(Op.GET, "\x01" * MAX_JOB_CHARS, TOKEN, 0, 0))


def test_the_encoders_refuse_what_the_decoders_refuse() -> None:
    for req in (Request(Op.GET, "j", TOKEN, 0, 0, nbytes=5), Request(Op.GET, "", TOKEN, 0, 0),
                Request(Op.PUT, "j", "xyz", 0, 0, 1), Request(Op.PUT, "j", TOKEN, -1, 0, 1),
                Request(Op.PUT, "j", TOKEN, 0, MAX_STEP + 1, 1)):  # fmt: skip
        with pytest.raises(ReplicaWireError):
            encode_request(req)
    too_long = "e" * (MAX_ERROR_CHARS + 1)
    for reply in (Reply(True, error="x"), Reply(False, nbytes=3), Reply(False),
                  Reply(False, error=too_long), Reply(True, nbytes=-1)):  # fmt: skip
        with pytest.raises(ReplicaWireError):
            encode_reply(reply)


def test_a_refusal_always_encodes() -> None:
    for text in ("", "x" * 5000, "\U0001f600" * 300, "a\nb\x00c"):
        reply = refusal(text)
        raw = encode_reply(reply)
        assert b"\n" not in raw[:-1] and len(raw) <= MAX_LINE
        assert decode_reply(raw) == reply and 1 <= len(reply.error) <= MAX_ERROR_CHARS


# ------------------------------------------------------------------ hypothesis
# the JSON values every decoder of the project is fuzzed with (tests/test_decoder_fuzz.py)

DECODERS: dict[str, tuple[Callable[[bytes], object], tuple[dict[str, Any], ...]]] = {
    "request": (decode_request, (PUT, GET)),
    "reply": (decode_reply, (OK, REFUSAL)),
    "trailer": (decode_trailer, (TRAILER,)),
}


def _decodes_or_refuses(name: str, raw: bytes) -> None:
    decode, _ = DECODERS[name]
    try:
        value = decode(raw)
    except ReplicaWireError:
        return
    encode: Callable[[Any], bytes] = {
        "request": encode_request,
        "reply": encode_reply,
        "trailer": lambda t: encode_trailer(t.commit),
    }[name]
    assert decode(encode(value)) == value  # what was accepted is written back alike


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(raw=st.binary(max_size=1200))
def test_fuzz_bytes(name: str, raw: bytes) -> None:
    _decodes_or_refuses(name, raw)


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(value=json_values)
def test_fuzz_json_values(name: str, value: Any) -> None:
    _decodes_or_refuses(name, json.dumps(value, allow_nan=True).encode())


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(data=st.data(), value=json_values, depth=st.integers(0, 40))
def test_fuzz_one_field_of_a_valid_message(
    name: str, data: st.DataObject, value: Any, depth: int
) -> None:
    doc = dict(data.draw(st.sampled_from(DECODERS[name][1])))
    field = data.draw(st.sampled_from(sorted(doc)))
    for _ in range(depth):
        value = [value]
    doc[field] = value
    _decodes_or_refuses(name, json.dumps(doc, allow_nan=True).encode())


_jobs = st.text(min_size=1, max_size=MAX_JOB_CHARS)
_tokens = st.text("0123456789abcdefABCDEF", min_size=16, max_size=MAX_TOKEN_CHARS)


@FUZZ
@given(
    op=st.sampled_from(Op), job=_jobs, token=_tokens, rank=st.integers(0, MAX_RANK),
    step=st.integers(0, MAX_STEP), nbytes=st.integers(0, MAX_BYTES),
)  # fmt: skip
def test_fuzz_requests_round_trip(
    op: Op, job: str, token: str, rank: int, step: int, nbytes: int
) -> None:
    req = Request(op, job, token, rank, step, nbytes if op is Op.PUT else 0)
    try:
        raw = encode_request(req)
    except ReplicaWireError as exc:  # only a job JSON escapes past the line
        assert "line" in str(exc)
        return
    assert decode_request(raw) == req


@FUZZ
@given(ok=st.booleans(), nbytes=st.integers(0, MAX_BYTES), text=st.text(max_size=300))
def test_fuzz_replies_round_trip(ok: bool, nbytes: int, text: str) -> None:
    reply = Reply(True, nbytes=nbytes) if ok else refusal(text)
    assert decode_reply(encode_reply(reply)) == reply
