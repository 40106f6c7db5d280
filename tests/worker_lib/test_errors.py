"""``kelastic.errors``: torch elastic's error-file format, both ways."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kelastic import contract
from kelastic.errors import fault_time, read_error_file, record, stamp_fault, write_error_file
from tests.prereq import require_module


@record
def _fail(value: int) -> int:
    raise KeyError(f"missing {value}")


@record
def _ok(value: int, *, plus: int = 0) -> int:
    return value + plus


def test_record_writes_torch_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sub" / "error.json"
    monkeypatch.setenv(contract.TORCHELASTIC_ERROR_FILE, str(path))
    before = int(time.time())
    with pytest.raises(KeyError, match="missing 7"):
        _fail(7)
    data = json.loads(path.read_text())
    assert set(data) == {"message"}
    assert set(data["message"]) == {"message", "extraInfo"}
    assert data["message"]["message"] == "KeyError: 'missing 7'"
    extra = data["message"]["extraInfo"]
    assert set(extra) == {"py_callstack", "timestamp"}
    assert isinstance(extra["timestamp"], str)  # torch writes str(int(time.time()))
    assert before <= int(extra["timestamp"]) <= time.time() + 1
    assert extra["py_callstack"].startswith("Traceback (most recent call last)")
    assert "in _fail" in extra["py_callstack"]
    assert extra["py_callstack"].rstrip().endswith("KeyError: 'missing 7'")
    assert [p.name for p in path.parent.iterdir()] == ["error.json"]  # no temp file left

    info = read_error_file(path)
    assert info == {
        "message": "KeyError: 'missing 7'",
        "traceback": extra["py_callstack"],
        "timestamp": int(extra["timestamp"]),
    }


def test_record_without_env_only_reraises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contract.TORCHELASTIC_ERROR_FILE, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyError):
        _fail(1)
    assert list(tmp_path.iterdir()) == []


def test_record_returns_value_and_keeps_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(contract.TORCHELASTIC_ERROR_FILE, str(path))
    assert _ok(2, plus=3) == 5
    assert _ok.__name__ == "_ok"
    assert not path.exists()


def test_record_ignores_system_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(contract.TORCHELASTIC_ERROR_FILE, str(path))

    @record
    def leave() -> None:
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        leave()
    assert not path.exists()


def test_record_write_failure_does_not_mask_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(contract.TORCHELASTIC_ERROR_FILE, str(blocker / "error.json"))
    with (
        caplog.at_level(logging.WARNING, logger="kelastic.errors"),
        pytest.raises(KeyError, match="missing 2"),
    ):
        _fail(2)
    assert "could not write error file" in caplog.text


def test_read_missing_file_is_none_without_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kelastic.errors"):
        assert read_error_file(tmp_path / "nope.json") is None
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("content", "warning"),
    [
        (b"", "is empty"),
        (b"   \n", "is empty"),
        (b'{"message": {"message": "ValueError: x", "extraInfo": {"py_ca', "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[1, 2]", "unknown shape"),
        (b'{"message": 3}', "unknown shape"),
        (b'{"message": {"extraInfo": {"timestamp": "1"}}}', "unknown shape"),
        (b'{"other": "x"}', "unknown shape"),
        (b"[" * 100000, "not valid JSON"),
    ],
    ids=[
        "empty",
        "blank",
        "truncated",
        "binary",
        "list",
        "message-int",
        "no-message",
        "no-key",
        "deep",
    ],
)
def test_read_corrupt_file_is_none_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, warning: str
) -> None:
    path = tmp_path / "error.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="kelastic.errors"):
        assert read_error_file(path) is None
    assert warning in caplog.text
    assert str(path) in caplog.text


def test_read_unreadable_path_is_none_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kelastic.errors"):
        assert read_error_file(tmp_path) is None  # a directory
    assert "cannot read error file" in caplog.text


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"message": "RuntimeError: flat", "timestamp": 1700000000},
            {"message": "RuntimeError: flat", "traceback": None, "timestamp": 1700000000},
        ),
        (
            {"message": "flat, no time"},
            {"message": "flat, no time", "traceback": None, "timestamp": None},
        ),
        (
            {
                "message": {
                    "message": "E: x",
                    "extraInfo": {"py_callstack": "tb\nE: x\n", "timestamp": "17"},
                    "errorCode": -9,
                }
            },
            {"message": "E: x", "traceback": "tb\nE: x\n", "timestamp": 17},
        ),
        (
            {"message": {"extraInfo": {"py_callstack": "Traceback\nOSError: disk\n"}}},
            {
                "message": "OSError: disk",
                "traceback": "Traceback\nOSError: disk\n",
                "timestamp": None,
            },
        ),
        (
            {"message": {"message": "E: y", "extraInfo": {"timestamp": "soon"}}},
            {"message": "E: y", "traceback": None, "timestamp": None},
        ),
    ],
    ids=["flat", "flat-no-timestamp", "nested-error-code", "no-message", "bad-timestamp"],
)
def test_read_variants(tmp_path: Path, data: object, expected: dict[str, object]) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps(data))
    assert read_error_file(path) == expected


def test_error_file_from_torch_record_is_read(tmp_path: Path) -> None:
    """torch's own ``@record`` writes a file that ``read_error_file`` understands."""
    path = tmp_path / "error.json"
    script = textwrap.dedent(
        """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise RuntimeError("torch boom")

        main()
        """
    )
    script_path = tmp_path / "torch_worker.py"
    script_path.write_text(script)
    env = {**os.environ, contract.TORCHELASTIC_ERROR_FILE: str(path)}
    res = subprocess.run(
        [sys.executable, str(script_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 1, res.stderr
    info = read_error_file(path)
    assert info is not None
    assert info["message"] == "RuntimeError: torch boom"
    assert info["traceback"] is not None
    assert 'raise RuntimeError("torch boom")' in info["traceback"]
    assert info["timestamp"] is not None
    assert abs(info["timestamp"] - time.time()) < 300


def test_our_error_file_is_read_by_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``ProcessFailure`` (what torchrun's agent uses) reads our file."""
    errors = require_module("torch.distributed.elastic.multiprocessing.errors")
    path = tmp_path / "error.json"
    monkeypatch.setenv(contract.TORCHELASTIC_ERROR_FILE, str(path))
    with pytest.raises(KeyError):
        _fail(3)
    failure = errors.ProcessFailure(local_rank=0, pid=42, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "KeyError: 'missing 3'"
    assert "in _fail" in failure.message["extraInfo"]["py_callstack"]
    assert abs(failure.timestamp - time.time()) < 60
    formatted = errors.ChildFailedError("trainer", {0: failure}).format_msg()
    assert "KeyError: 'missing 3'" in formatted


def test_a_fault_stamped_when_raised_keeps_that_time_in_its_error_file(tmp_path: Path) -> None:
    """An in-process fault the sidecar could not restart in process is re-raised when
    the process ends, seconds after it was raised (its rank waited for etcd): its error
    file says when it was raised (``fault_time``, sub-second), which orders it before the
    errors it caused in its peers. torch's ``timestamp`` stays an integer string."""
    exc = ValueError("boom")
    stamp_fault(exc, 1_700_000_000.25)
    stamp_fault(exc, 1_700_000_009.0)  # the first stamp stays: the raise, not a re-raise
    assert fault_time(exc) == 1_700_000_000.25
    write_error_file(tmp_path / "error.json", exc)
    info = read_error_file(tmp_path / "error.json")
    assert info is not None
    assert (info["timestamp"], info.get("fault_time")) == (1_700_000_000, 1_700_000_000.25)
    extra = json.loads((tmp_path / "error.json").read_text())["message"]["extraInfo"]
    assert extra["timestamp"] == "1700000000"
    write_error_file(tmp_path / "plain.json", RuntimeError("no stamp"))
    plain = read_error_file(tmp_path / "plain.json")
    assert plain is not None and "fault_time" not in plain
    for bad in ("soon", float("nan"), -1.0, 2.0**60, True, None):
        data = {"message": {"message": "x", "extraInfo": {"fault_time": bad}}}
        (tmp_path / "bad.json").write_text(json.dumps(data))
        got = read_error_file(tmp_path / "bad.json")
        assert got is not None and "fault_time" not in got, bad
