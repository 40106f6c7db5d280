"""Reading ``py-spy dump``'s text (:mod:`kelastic_sidecar.hang_evidence.pyspy_text`):
a real dump's shape, then property-based fuzzing with hypothesis (any text parses
without an error; generated dumps parse back to what generated them; the summary names
the main thread's innermost user frame; truncation stays within its bound). Bounded: a
fixed number of examples, no deadline per example (the machine is shared), no database.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kelastic_sidecar.hang_evidence.pyspy_text import (
    TRUNCATED,
    Frame,
    ThreadStack,
    innermost_user_frame,
    is_library_file,
    main_thread,
    parse_dump,
    summary,
    truncate,
)

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

#: py-spy 0.4.3's ``dump --nonblocking --full-filenames`` of a SIGSTOPped process.
REAL = """\
Process 4881: /root/.pyenv/versions/3.11.7/bin/python3 /tmp/sleeper.py
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

Thread 4890 (idle): "bg"
    <lambda> (/tmp/sleeper.py:6)
    Thread.run (/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py:982)
    Thread._bootstrap (/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py:1002)
Thread 4881 (idle): "MainThread"
    sleep (/usr/lib/python3/dist-packages/torch/distributed/c10d.py:77)
    inner_wait (/tmp/sleeper.py:3)
    work (/tmp/sleeper.py:5)
    <module> (/tmp/sleeper.py:7)
"""


def test_a_real_dump_names_the_main_threads_innermost_user_frame() -> None:
    threads = parse_dump(REAL)
    assert [(t.thread_id, t.status, t.name) for t in threads] == [
        ("4890", "idle", "bg"),
        ("4881", "idle", "MainThread"),
    ]
    main = main_thread(threads, 4881)
    assert main is threads[1]
    assert main.frames[1] == Frame("inner_wait", "/tmp/sleeper.py", 3)
    # the torch frame is a library's: the user's innermost frame is the one that called it
    assert summary(REAL, 4881) == "main thread at /tmp/sleeper.py:3 in inner_wait"


def test_the_main_thread_is_found_by_name_then_by_pid_then_first() -> None:
    a = ThreadStack("11", "idle", "worker", ())
    b = ThreadStack("12", "active", "", ())
    assert main_thread([a, b], 12) is b
    assert main_thread([a, b], 99) is a
    assert main_thread([], 1) is None


def test_library_files_are_the_interpreters_installed_packages_and_the_given_dirs() -> None:
    assert is_library_file("/usr/lib/python3.11/threading.py")
    assert is_library_file("/venv/lib/python3.12/site-packages/torch/nn/module.py")
    assert is_library_file("<frozen importlib._bootstrap>")
    assert is_library_file("/work/worker_lib/kelastic/timer.py", ["/work/worker_lib/kelastic"])
    assert not is_library_file("/work/worker_lib/kelastic2/x.py", ["/work/worker_lib/kelastic"])
    assert not is_library_file("/workspace/train.py")
    only_library = ThreadStack("1", "idle", "MainThread", (Frame("f", "/lib/python3.11/x.py", 1),))
    assert innermost_user_frame(only_library) == only_library.frames[0]  # none of the user's


def test_a_dump_without_frames_of_the_main_thread_has_no_summary() -> None:
    assert summary("", 1) is None
    assert summary("Error: Permission denied (os error 13)\n", 1) is None
    assert summary('Thread 5 (idle): "MainThread"\n', 5) is None


def test_truncation_marks_the_cut_and_refuses_a_bound_smaller_than_its_marker() -> None:
    assert truncate("short", 1024) == "short"
    cut = truncate("x" * 5000, 1024)
    assert len(cut.encode()) <= 1024 and cut.endswith(TRUNCATED.format(limit=1024))
    with pytest.raises(ValueError, match="smaller than the truncation marker"):
        truncate("x" * 5000, 10)


# ------------------------------------------------------------------------------ fuzz

_names = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"), blacklist_characters='"'),
    max_size=20,
)
_func = st.from_regex(r"[A-Za-z_<>][A-Za-z0-9_.<> ]{0,15}[A-Za-z0-9_>]", fullmatch=True)
_file = st.from_regex(r"/[A-Za-z0-9_./-]{1,40}\.py", fullmatch=True)
_frames = st.lists(
    st.builds(Frame, _func, _file, st.one_of(st.none(), st.integers(1, 10**6))), max_size=6
)
_threads = st.lists(
    st.builds(
        ThreadStack,
        st.one_of(st.integers(1, 4 * 10**6).map(str), st.just("0x7F12AB")),
        st.sampled_from(["idle", "active", "active+gil", "gil"]),
        _names.filter(lambda n: n.strip() == n),
        _frames.map(tuple),
    ),
    max_size=5,
)


def _render(threads: list[ThreadStack]) -> str:
    """A dump as py-spy 0.4 writes it."""
    out = ["Process 7: python train.py", "Python v3.11.7 (/usr/bin/python3.11)", ""]
    for t in threads:
        out.append(f'Thread {t.thread_id} ({t.status}): "{t.name}"')
        for f in t.frames:
            at = f.file if f.line is None else f"{f.file}:{f.line}"
            out.append(f"    {f.function} ({at})")
    return "\n".join(out) + "\n"


@FUZZ
@given(st.text(max_size=2000))
def test_any_text_parses_without_an_error(text: str) -> None:
    for thread in parse_dump(text):
        assert all(isinstance(f.line, int | None) for f in thread.frames)
    line = summary(text, 7)
    assert line is None or ("\n" not in line and line.startswith("main thread at "))


@FUZZ
@given(_threads)
def test_a_generated_dump_parses_back_to_its_threads(threads: list[ThreadStack]) -> None:
    assert parse_dump(_render(threads)) == threads


@FUZZ
@given(_threads, st.integers(1, 4 * 10**6))
def test_the_summary_names_the_main_threads_innermost_user_frame(
    threads: list[ThreadStack], pid: int
) -> None:
    line = summary(_render(threads), pid)
    main = main_thread(threads, pid)
    if main is None or not main.frames:
        assert line is None
        return
    users = [f for f in main.frames if not is_library_file(f.file)]
    frame = users[0] if users else main.frames[0]
    # the summary is one line: runs of whitespace in a name collapse to one space (a
    # generated function "<  0" failed the exact compare once)
    assert line == " ".join(f"main thread at {frame.where()}".split())


@FUZZ
@given(st.text(max_size=4000), st.integers(1024, 5000))
def test_truncation_stays_within_its_bound_and_keeps_a_prefix(text: str, limit: int) -> None:
    cut = truncate(text, limit)
    assert len(cut.encode()) <= limit
    if len(text.encode()) <= limit:
        assert cut == text
    else:
        marker = TRUNCATED.format(limit=limit)
        assert cut.endswith(marker) and text.startswith(cut[: -len(marker)])
