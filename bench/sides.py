"""Each side of a comparison measured in a helper process with a deadline of its own.

A case that measures several sides one after the other in its own process loses every
row when one side is slow or hangs: the suite's time limit ends the whole case.
:class:`SideRunner` runs each side's repetitions in a helper process
(``python -m bench.sides``, started once and reused); the side's samples come back one
line each as they are measured. A side that does not finish by its deadline has its
helper killed (its process group) and its row reads ``timed out after X s``; one that
raises reads ``failed: ...``; the next side gets a fresh helper. So a slow or failing
side costs only its own rows.

``BENCH_SIDE_FAULTS`` (JSON ``{side: "hang" | "fail"}``) makes the helper hang or raise
instead of measuring that side: how the smoke test checks the above.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from .common import LineReader, child_env, log

#: seconds a helper may take to start (import torch on a loaded machine); not a side's time
START_TIMEOUT = 180.0


class SideRunner:
    """Runs sides in a helper process, each within its deadline."""

    def __init__(self, case: str) -> None:
        self.case = case
        self._proc: subprocess.Popen[str] | None = None
        self._reader: LineReader | None = None

    def _start(self) -> LineReader:
        if self._proc is not None and self._proc.poll() is None and self._reader is not None:
            return self._reader
        self.close()
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.sides"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(BENCH_SIDE_PARENT=str(os.getpid())),
            start_new_session=True,  # its own process group: killed whole at a deadline
        )
        self._proc, self._reader = proc, LineReader(proc)
        end = time.monotonic() + START_TIMEOUT
        while _parse(self._reader.get(end - time.monotonic())).get("ev") != "ready":
            pass
        return self._reader

    def run(
        self, side: str, fn: str, args: Sequence[Any], reps: int, deadline: float
    ) -> tuple[list[Any], str]:
        """Call ``fn`` (``"module:function"``) with ``args`` ``reps`` times in the helper.

        Returns the values that came back before the deadline and a status: ``""`` when
        all ``reps`` ran, else ``"timed out after X s (k of reps runs)"`` or
        ``"failed: ..."``. Each value is logged as it arrives.
        """
        try:
            reader = self._start()
        except Exception as exc:  # the helper itself did not start: this side's loss only
            self.close()
            return [], f"failed: the side helper did not start: {exc}"[:300]
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"side": side, "fn": fn, "args": list(args),
                                               "reps": reps}) + "\n")  # fmt: skip
            self._proc.stdin.flush()
        except OSError as exc:  # the helper died since its last side
            self.close()
            return [], f"failed: the side helper is gone: {exc}"
        values: list[Any] = []
        end = time.monotonic() + deadline
        while True:
            left = end - time.monotonic()
            try:
                doc = _parse(reader.get(left))
            except TimeoutError:
                self.close()  # kills the hung or slow side, and whatever it started
                return values, f"timed out after {deadline:g} s ({len(values)} of {reps} runs)"
            except RuntimeError as exc:  # the helper exited
                self.close()
                return values, f"failed: {exc}"
            if "value" in doc:
                values.append(doc["value"])
                log(f"{self.case}: {side}: run {len(values)}/{reps}: {doc['value']}")
            elif "error" in doc:
                self.close()  # it may have left threads behind: the next side gets a new one
                return values, f"failed: {doc['error']}"[:300]
            elif doc.get("ev") == "done":
                return values, ""

    def close(self) -> None:
        """Kill the helper's process group (if any) and reap it."""
        proc, self._proc, self._reader = self._proc, None, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()

    def __enter__(self) -> SideRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse(line: str) -> dict[str, Any]:
    """The helper's JSON line; ``{}`` for anything else a library printed to its stdout."""
    try:
        doc = json.loads(line)
    except ValueError:
        doc = None
    return doc if isinstance(doc, dict) else {}


def _faults() -> dict[str, str]:
    raw = os.environ.get("BENCH_SIDE_FAULTS", "")
    return json.loads(raw) if raw else {}


def _emit(**doc: Any) -> None:
    print(json.dumps(doc), flush=True)


def _die_with_parent() -> None:
    """SIGKILL this helper when the case's process dies (the suite kills that one at the
    case's time limit; this helper is in a process group of its own)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != os.environ.get("BENCH_SIDE_PARENT"):
        os._exit(1)  # it died before the line above


def main() -> None:
    """The helper: one JSON command per stdin line, one JSON line per value."""
    import logging

    _die_with_parent()
    logging.basicConfig(level=logging.ERROR)
    faults = _faults()
    _emit(ev="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        module, name = cmd["fn"].split(":")
        try:
            fn = getattr(importlib.import_module(module), name)
            fault = faults.get(cmd["side"])
            for _ in range(int(cmd["reps"])):
                if fault == "hang":
                    while True:
                        time.sleep(3600)
                if fault == "fail":
                    raise RuntimeError("injected by BENCH_SIDE_FAULTS")
                _emit(value=fn(*cmd["args"]))
        except Exception as exc:
            _emit(error=f"{type(exc).__name__}: {exc}")
            os._exit(1)  # threads of the failed run may be blocked: leave them behind
        _emit(ev="done")


if __name__ == "__main__":
    main()
    os._exit(0)  # daemon threads may be blocked in etcd or TCPStore calls
