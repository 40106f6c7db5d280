"""The launcher's network checker part (``kelastic._checker``) with real processes: a
stand-in interpreter (a shell script run in place of ``python -m kelastic.netcheck``)
answers, hangs, dies or says nothing; the part passes the verdict line up unread, kills
a checker past its timeout (its whole session), and never blocks. The real checker with
real gloo: ``tests/worker_lib/test_netcheck_gloo.py``; the launcher and sidecar together:
``tests/operator/local/test_netcheck_run.py``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kelastic._checker import Checker
from kelastic.control_messages import Check, Checked
from tests.conftest import wait_for

#: Stands in for the interpreter: ``$MODE`` says what the checker does with its line.
FAKE = """#!/bin/sh
echo $$ > "$PIDFILE"
case "$MODE" in
  answer) read line; echo "noise on stdout"; echo "verdict:$line" ;;
  silent) read line; exit 3 ;;
  hang) read line; sleep 600 & sleep 600 ;;
  die) exit 7 ;;
esac
"""


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    path = tmp_path / "python"
    path.write_text(FAKE)
    path.chmod(0o755)
    return path


def _env(tmp_path: Path, mode: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "MODE": mode, "PIDFILE": str(tmp_path / "pid")}


def _answer(checker: Checker, deadline: float = 20.0) -> Checked:
    """Drive the part as the launcher's loop does (select on its fd, reap, poll)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        _reap(checker)
        answer = checker.on_readable() or checker.poll()
        if answer is not None:
            return answer
        time.sleep(0.01)
    raise AssertionError("the checker part gave no answer")


def _reap(checker: Checker) -> None:
    """Reap what the test started (as the launcher, a subreaper, reaps its children), not
    the session's processes."""
    for child in psutil.Process().children():
        if child.pid in _SESSION:
            continue
        try:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if pid:
            checker.on_reaped(pid, os.waitstatus_to_exitcode(status))


#: The processes this pytest process had before the test (a test cluster's, an etcd).
_SESSION: set[int] = set()


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    """Kill what the test started and left, and only that: the session's own processes
    (a test cluster's API server, an embedded etcd) are children of this process too."""
    _SESSION.clear()
    _SESSION.update(p.pid for p in psutil.Process().children(recursive=True))
    yield
    for child in psutil.Process().children(recursive=True):
        if child.pid not in _SESSION:
            child.kill()


def test_the_verdict_line_is_passed_up_unread(tmp_path: Path, fake: Path) -> None:
    checker = Checker(enabled=True, python=str(fake))
    checker.prestart(_env(tmp_path, "answer"))
    wait_for(lambda: (tmp_path / "pid").exists(), 10, what="the checker started ahead")
    ahead = int((tmp_path / "pid").read_text())
    assert checker.begin(Check(round=4, params='{"p": 1}', timeout=30), {}) is None
    assert checker.fileno() is not None
    assert _answer(checker) == Checked(round=4, verdict='verdict:{"p": 1}')
    assert int((tmp_path / "pid").read_text()) == ahead  # the one started ahead answered
    assert checker.fileno() is None


def test_a_disabled_checker_starts_none_ahead_but_runs_when_asked(
    tmp_path: Path, fake: Path
) -> None:
    checker = Checker(enabled=False, python=str(fake))
    checker.prestart(_env(tmp_path, "answer"))
    assert not (tmp_path / "pid").exists()
    assert checker.begin(Check(round=1, params="x", timeout=30), _env(tmp_path, "answer")) is None
    assert _answer(checker) == Checked(round=1, verdict="verdict:x")


def test_a_checker_past_its_timeout_is_killed_with_its_session(tmp_path: Path, fake: Path) -> None:
    checker = Checker(enabled=True, python=str(fake))
    checker.prestart(_env(tmp_path, "hang"))
    assert checker.begin(Check(round=2, params="x", timeout=1), {}) is None
    wait_for(lambda: (tmp_path / "pid").exists(), 10, what="the checker started")
    pid = int((tmp_path / "pid").read_text())
    wait_for(lambda: len(psutil.Process(pid).children()) == 2, 10, what="its two sleeps")
    session = [p.pid for p in psutil.Process(pid).children()]
    started = time.monotonic()
    answer = _answer(checker)
    assert answer.round == 2 and answer.verdict is None
    assert answer.error is not None and "did not end within 1 s" in answer.error
    assert time.monotonic() - started < 10
    for p in [pid, *session]:  # the whole session: the sleeps too
        wait_for(lambda p=p: not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie",
                 10, what=f"{p} killed")  # fmt: skip
        _reap(checker)


def test_a_checker_ending_without_a_line_says_so(tmp_path: Path, fake: Path) -> None:
    checker = Checker(enabled=True, python=str(fake))
    assert checker.begin(Check(round=5, params="x", timeout=30), _env(tmp_path, "silent")) is None
    answer = _answer(checker)
    assert answer.verdict is None and answer.error is not None
    assert answer.error.startswith("the network checker ended without a verdict"), answer


def test_an_idle_checker_that_died_is_forgotten_and_started_again(
    tmp_path: Path, fake: Path
) -> None:
    checker = Checker(enabled=True, python=str(fake))
    checker.prestart(_env(tmp_path, "die"))
    wait_for(lambda: (tmp_path / "pid").exists(), 10, what="the checker started ahead")
    first = int((tmp_path / "pid").read_text())

    def gone() -> bool:
        _reap(checker)
        return not psutil.pid_exists(first)

    wait_for(gone, 10, what="the idle checker reaped")
    (tmp_path / "pid").unlink()
    assert checker.begin(Check(round=6, params="y", timeout=30), _env(tmp_path, "answer")) is None
    assert _answer(checker) == Checked(round=6, verdict="verdict:y")
    assert int((tmp_path / "pid").read_text()) != first


def test_an_interpreter_that_cannot_start_is_answered_at_once(tmp_path: Path) -> None:
    checker = Checker(enabled=True, python=str(tmp_path / "no-such-python"))
    checker.prestart({})  # logged, nothing raised
    answer = checker.begin(Check(round=7, params="x", timeout=30), {})
    assert answer is not None and answer.round == 7 and answer.error is not None
    assert "could not run" in answer.error


def test_a_second_check_while_one_runs_is_answered_with_an_error(
    tmp_path: Path, fake: Path
) -> None:
    checker = Checker(enabled=True, python=str(fake))
    assert checker.begin(Check(round=8, params="x", timeout=30), _env(tmp_path, "hang")) is None
    answer = checker.begin(Check(round=9, params="x", timeout=30), {})
    assert answer == Checked(round=9, error="round 8's network check is still running")
    wait_for(lambda: (tmp_path / "pid").exists(), 10, what="pid written")
    pid = int((tmp_path / "pid").read_text())
    checker.close()
    assert checker.fileno() is None

    def killed() -> bool:
        _reap(checker)
        return not psutil.pid_exists(pid)

    wait_for(killed, 10, what="the running checker killed on close")
