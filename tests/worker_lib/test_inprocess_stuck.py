"""A rank that does not leave an aborted iteration says where it is stuck
(:mod:`kelastic.inprocess.stuck`): once per abort, after ``after`` seconds, every
thread's stack on stderr; nothing when it leaves in time."""

from __future__ import annotations

import io
import threading

from kelastic.inprocess.stuck import LeaveWatch, thread_stacks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _blocked_in_a_named_function(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(30)


def test_the_stacks_are_written_once_when_the_abort_is_not_left_in_time() -> None:
    out, clock = io.StringIO(), Clock()
    watch = LeaveWatch(3, after=5.0, out=out, clock=clock)
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_blocked_in_a_named_function, args=(started, release),
                              name="blocked-one")  # fmt: skip
    worker.start()
    try:
        assert started.wait(10)
        assert not watch.check()  # no abort: nothing to say
        watch.aborted(0, 1)
        clock.now += 4.9
        assert not watch.check() and out.getvalue() == ""
        clock.now += 0.2
        assert watch.check()
        text = out.getvalue()
        assert text.startswith(
            "kelastic.inprocess: local rank 3 has not left iteration 0 5.1s after its abort "
            "(to iteration 1)")  # fmt: skip
        assert "--- thread 'blocked-one':" in text and "_blocked_in_a_named_function" in text
        assert "release.wait(30)" in text  # the innermost frame: where it blocks
        clock.now += 60
        assert not watch.check() and watch.dumps == 1  # once per abort
        watch.aborted(0, 2)  # a later abort of the same stuck iteration: no new dump
        assert not watch.check()
        watch.left(2)
        watch.aborted(2, 3)  # the next abort, left in time: nothing
        clock.now += 1.0
        watch.left(3)
        clock.now += 10.0
        assert not watch.check() and watch.dumps == 1
        watch.aborted(3, 4)  # and one not left: a second dump
        clock.now += 5.0
        assert watch.check() and watch.dumps == 2
    finally:
        release.set()
        worker.join(10)


def test_an_abort_already_left_or_stale_starts_no_clock() -> None:
    out, clock = io.StringIO(), Clock()
    watch = LeaveWatch(0, after=1.0, out=out, clock=clock)
    watch.left(5)  # ready for 5 before its abort was seen by the monitor
    watch.aborted(4, 5)
    clock.now += 10
    assert not watch.check() and out.getvalue() == ""


def test_a_closed_stderr_is_no_error() -> None:
    out, clock = io.StringIO(), Clock()
    watch = LeaveWatch(0, after=0.0, out=out, clock=clock)
    out.close()
    watch.aborted(0, 1)
    assert not watch.check() and watch.dumps == 0


def test_thread_stacks_names_every_thread_but_the_skipped_one() -> None:
    text = thread_stacks()
    assert f"--- thread {threading.current_thread().name!r}:" in text
    assert "test_thread_stacks_names_every_thread" in text
    assert threading.current_thread().name not in thread_stacks(skip=threading.get_ident())
