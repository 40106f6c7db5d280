"""The sidecar's kept last status (:mod:`kelastic.last_status`): one codec for writer and
reader; a crafted, torn or oversized file raises :class:`LastStatusError` and nothing
else; the file is replaced whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kelastic.last_status import (
    LAST_STATUS_NAME,
    MAX_BYTES,
    LastStatusError,
    decode_last_status,
    encode_last_status,
    keep_last_status,
    read_last_status,
    write_last_status,
)

DOC = {"node": "steps-0", "phase": "succeeded", "round": 3, "last_progress_age_s": 0.25,
       "step_times": {"stragglers": [{"local_rank": 1, "median_s": 0.2, "ratio": 4.0}]},
       "hang_evidence": None}  # fmt: skip


def test_a_written_status_reads_back_equal_and_replaces_the_last(tmp_path: Path) -> None:
    assert read_last_status(tmp_path) is None  # none kept yet (or the sidecar was killed)
    path = write_last_status(tmp_path, {"node": "x"})
    assert path == tmp_path / LAST_STATUS_NAME
    write_last_status(tmp_path, DOC)
    assert read_last_status(tmp_path) == DOC
    assert [p.name for p in tmp_path.iterdir()] == [LAST_STATUS_NAME]  # no temporary left


@pytest.mark.parametrize(
    "doc",
    [
        {"ratio": float("nan")},
        {"median_s": float("inf")},
        {"pid": object()},
        {"big": "x" * MAX_BYTES},
    ],
    ids=["nan", "inf", "not-json", "too-big"],
)
def test_a_document_the_reader_would_refuse_is_not_written_and_the_old_one_stays(
    tmp_path: Path, doc: dict[str, Any]
) -> None:
    write_last_status(tmp_path, DOC)
    with pytest.raises(LastStatusError):
        write_last_status(tmp_path, doc)
    assert read_last_status(tmp_path) == DOC
    assert [p.name for p in tmp_path.iterdir()] == [LAST_STATUS_NAME]


def test_an_unwritable_run_dir_raises_oserror_and_leaves_nothing(tmp_path: Path) -> None:
    gone = tmp_path / "no-such-dir"
    with pytest.raises(OSError):
        write_last_status(gone, DOC)
    assert not gone.exists()


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b'{"node": "x"',
        b"[1, 2]",
        b"null",
        b'"text"',
        b"\xff\xfe{}",
        b"[" * 100_000,
        b'{"n": ' + b"9" * 5000 + b"}",
        b'{"r": NaN}',
        b'{"r": 1e999}',
        b" " * (MAX_BYTES + 1),
    ],
    ids=[
        "empty",
        "open",
        "torn",
        "array",
        "null",
        "string",
        "not-utf8",
        "deep",
        "huge-int",
        "nan",
        "overflow",
        "oversized",
    ],
)
def test_a_crafted_or_torn_file_raises_last_status_error(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / LAST_STATUS_NAME).write_bytes(raw)
    with pytest.raises(LastStatusError, match=LAST_STATUS_NAME):
        read_last_status(tmp_path)


def test_a_folder_in_the_files_place_raises_oserror(tmp_path: Path) -> None:
    (tmp_path / LAST_STATUS_NAME).mkdir()
    with pytest.raises(OSError):
        read_last_status(tmp_path)


@given(raw=st.binary(max_size=300))
def test_the_decoder_returns_an_object_or_raises_last_status_error(raw: bytes) -> None:
    try:
        doc = decode_last_status(raw)
    except LastStatusError:
        return
    assert isinstance(doc, dict)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20,
)  # fmt: skip


@given(doc=st.dictionaries(st.text(max_size=8), _JSON, max_size=6))
def test_what_the_writer_encodes_the_reader_decodes_equal(doc: dict[str, Any]) -> None:
    assert decode_last_status(encode_last_status(doc)) == json.loads(json.dumps(doc))


def test_keeping_it_never_raises_and_says_why_it_could_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert keep_last_status(tmp_path, lambda: DOC) and read_last_status(tmp_path) == DOC

    def half_stopped() -> dict[str, Any]:
        raise RuntimeError("the timer server is stopped")

    assert not keep_last_status(tmp_path, half_stopped)
    assert not keep_last_status(tmp_path / "gone", lambda: DOC)
    assert not keep_last_status(tmp_path, lambda: {"ratio": float("nan")})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and "the timer server is stopped" in said[0], said
    assert read_last_status(tmp_path) == DOC  # what was kept stays
