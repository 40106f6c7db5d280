"""The network check's two control messages (``check`` down, ``checked`` up): round trips
through the wire form, and every bad field refused with a ProtocolError that says which."""

from __future__ import annotations

import json

import pytest

from kelastic.control_messages import (
    MAX_CHECK_LINE,
    Check,
    Checked,
    Hello,
    ProtocolError,
    Unknown,
    encode_message,
    parse_launcher_message,
    parse_message,
)

PARAMS = '{"round": 3, "rank": 1}'


def _down(**fields: object) -> bytes:
    return json.dumps({"type": "check", "round": 3, "params": PARAMS, "timeout": 120.0,
                       **fields}).encode()  # fmt: skip


def _up(**fields: object) -> bytes:
    return json.dumps({"type": "checked", "round": 3, **fields}).encode()


def test_check_round_trips() -> None:
    msg = Check(round=3, params=PARAMS, timeout=120.0)
    assert parse_message(encode_message(msg.as_dict()).rstrip(b"\n")) == msg
    assert parse_message(_down(timeout=5)) == Check(round=3, params=PARAMS, timeout=5.0)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"params": ""}, "check params must be a string"),
        ({"params": 7}, "check params must be a string"),
        ({"params": "x" * (MAX_CHECK_LINE + 1)}, "check params must be a string"),
        ({"params": "a\nb"}, "one line"),
        ({"timeout": 0}, "check timeout must be"),
        ({"timeout": 3601}, "check timeout must be"),
        ({"timeout": True}, "check timeout must be"),
        ({"timeout": "60"}, "check timeout must be"),
        ({"round": -1}, "round"),
        ({"round": "3"}, "round"),
    ],
)
def test_a_bad_check_is_refused_saying_which_field(fields: dict, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        parse_message(_down(**fields))


def test_a_nan_timeout_is_refused_before_any_field_is_read() -> None:
    line = _down(timeout="@").replace(b'"@"', b"NaN")
    with pytest.raises(ProtocolError, match="not JSON"):
        parse_message(line)


@pytest.mark.parametrize(
    "msg",
    [Checked(round=3, verdict='{"round": 3}'), Checked(round=0, error="the checker timed out")],
)
def test_checked_round_trips(msg: Checked) -> None:
    assert parse_launcher_message(encode_message(msg.as_dict()).rstrip(b"\n")) == msg


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({}, "exactly one of"),
        ({"verdict": "v", "error": "e"}, "exactly one of"),
        ({"verdict": ""}, "'verdict' must be"),
        ({"verdict": 5}, "'verdict' must be"),
        ({"verdict": "x" * (MAX_CHECK_LINE + 1)}, "'verdict' must be"),
        ({"error": ""}, "'error' must be"),
        ({"error": "e" * 5000}, "'error' must be"),
        ({"round": True, "error": "e"}, "'round'"),
    ],
)
def test_a_bad_checked_is_refused_saying_which_field(fields: dict, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        parse_launcher_message(_up(**fields))


def test_an_older_peer_sees_an_unknown_type_not_an_error() -> None:
    """A launcher without the check parses ``check`` as this version parses a newer type."""
    assert parse_message(b'{"type": "check2", "round": 1}') == Unknown(type="check2")
    assert parse_launcher_message(b'{"type": "checked2"}') == Unknown(type="checked2")


def test_hello_says_whether_the_launcher_answers_check() -> None:
    new = Hello(pid=7, nproc=2, netcheck=True)
    assert parse_launcher_message(encode_message(new.as_dict()).rstrip(b"\n")) == new
    older = b'{"type": "hello", "pid": 7, "nproc": 2}'  # no key: it cannot run the check
    assert parse_launcher_message(older) == Hello(pid=7, nproc=2, netcheck=False)
    assert "netcheck" not in Hello(pid=7).as_dict()
    for bad in (b'"yes"', b"1", b"null"):
        with pytest.raises(ProtocolError, match="'netcheck' must be true or false"):
            parse_launcher_message(older[:-1] + b', "netcheck": ' + bad + b"}")
