"""Preflight checks (``spec.preflight``): the user's command, run by the launcher in the
trainer container (where the GPUs are) before the node's workers ever join a round.

The operator writes the spec into the trainer's ``$KELASTIC_PREFLIGHT`` (one codec:
:func:`encode_preflight` / :func:`decode_preflight`); the launcher runs it before its
``hello`` (:func:`run_preflight`) and says how it failed in that ``hello``
(``preflight_error``). The sidecar waits for the ``hello`` before it joins the
rendezvous, so a node whose check fails never joins: its Pod fails (the trainer
container exits 1, its termination message naming the check) and the operator replaces
it, charged to ``podReplacement``, not to ``maxRestarts``; the round forms without it.

It runs once per Pod, at its start: a node already in the job is judged by its workers'
failures (and a ``RestartPod`` failure rule gives it a new Pod, which runs the check
again). Semantics from DLRover's node check and NVIDIA's health checks before a rank
joins; the check itself is the user's (``nvidia-smi``, ``dcgmi diag -r 1``, a script).

The command runs in a session of its own with the trainer's environment; past its
timeout the whole session is SIGKILLed. Its exit code 0 passes; anything else fails,
with the last :data:`TAIL_BYTES` bytes of its output in the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from kelastic._safejson import UnsafeJSONError, loads_bounded

__all__ = [
    "MAX_ARGS",
    "MAX_ARG_CHARS",
    "MAX_ERROR_CHARS",
    "MAX_TIMEOUT",
    "Preflight",
    "PreflightError",
    "check_node",
    "decode_preflight",
    "encode_preflight",
    "run_preflight",
]

log = logging.getLogger("kelastic.launch")

#: Most arguments of the command (the program included).
MAX_ARGS: Final = 64
#: Longest argument, characters.
MAX_ARG_CHARS: Final = 4096
#: Longest timeout, seconds.
MAX_TIMEOUT: Final = 3600
#: Bytes of the command's output kept for the reason.
TAIL_BYTES: Final = 2048
#: Longest failure reason sent in ``hello`` (``preflight_error``), characters.
MAX_ERROR_CHARS: Final = 4096
_MAX_ENV_BYTES: Final = 2 * MAX_ARGS * MAX_ARG_CHARS


class PreflightError(ValueError):
    """``$KELASTIC_PREFLIGHT`` is not a preflight the operator could have written."""


@dataclass(frozen=True)
class Preflight:
    """The check: ``command`` (program and arguments, no shell) and ``timeout`` (seconds,
    1..:data:`MAX_TIMEOUT`).

    Raises:
        PreflightError: an empty command, too many or too long arguments, a timeout out
            of bounds (NaN included).
    """

    command: tuple[str, ...]
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= len(self.command) <= MAX_ARGS:
            raise PreflightError(f"the command needs 1..{MAX_ARGS} arguments")
        if not all(isinstance(a, str) and 0 < len(a) <= MAX_ARG_CHARS for a in self.command):
            raise PreflightError(f"each argument must be a string of 1..{MAX_ARG_CHARS} chars")
        if isinstance(self.timeout, bool) or not 1 <= self.timeout <= MAX_TIMEOUT:
            raise PreflightError(f"timeoutSeconds must be 1..{MAX_TIMEOUT}, got {self.timeout}")


def encode_preflight(check: Preflight) -> str:
    """The env value: ``{"command": [...], "timeoutSeconds": N}``."""
    return json.dumps({"command": list(check.command), "timeoutSeconds": check.timeout})


def decode_preflight(raw: str) -> Preflight:
    """An env value back (:func:`encode_preflight`'s form).

    Raises:
        PreflightError: not bounded JSON (:func:`kelastic._safejson.loads_bounded`), not
            an object with exactly ``command`` and ``timeoutSeconds``, or out of bounds.
    """
    try:
        doc = loads_bounded(raw.encode(), max_bytes=_MAX_ENV_BYTES)
    except UnsafeJSONError as exc:
        raise PreflightError(f"not a preflight: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"command", "timeoutSeconds"}:
        raise PreflightError("not a preflight: needs exactly 'command' and 'timeoutSeconds'")
    command, timeout = doc["command"], doc["timeoutSeconds"]
    if not isinstance(command, list) or len(command) > MAX_ARGS:
        raise PreflightError(f"the command must be a list of 1..{MAX_ARGS} strings")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise PreflightError(f"timeoutSeconds must be a number, got {timeout!r:.40}")
    if not math.isfinite(timeout):
        raise PreflightError(f"timeoutSeconds must be finite, got {timeout}")
    return Preflight(tuple(command), float(timeout))


def run_preflight(check: Preflight, env: Mapping[str, str] | None = None) -> str | None:
    """Run ``check``; None when it passed (exit 0), else why it failed, e.g. ``exited
    with code 3: GPU 1 has 2 uncorrectable ECC errors`` or ``timed out after 60 s: ...``
    (at most :data:`MAX_ERROR_CHARS` characters). Raises nothing."""
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(
                check.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=dict(os.environ if env is None else env), start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            return f"could not start {check.command[0]!r}: {exc}"[:MAX_ERROR_CHARS]
        try:
            code = proc.wait(check.timeout)
            how = None if code == 0 else _exit_text(code)
        except subprocess.TimeoutExpired:
            how = f"timed out after {check.timeout:g} s"
        finally:
            with contextlib.suppress(OSError):  # the whole session: its children go too
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if how is None:
            return None
        size = out.seek(0, os.SEEK_END)
        out.seek(max(0, size - TAIL_BYTES))
        tail = out.read().decode(errors="replace").strip()
    return (f"{how}: {tail}" if tail else how)[:MAX_ERROR_CHARS]


def check_node(check: Preflight | None) -> str | None:
    """The launcher's step before its ``hello``: run ``check`` (None: nothing to run),
    logged; how it failed, or None."""
    if check is None:
        return None
    log.info("preflight: running %s (timeout %g s)", list(check.command), check.timeout)
    failed = run_preflight(check)
    if failed is None:
        log.info("preflight passed")
    else:
        log.error("preflight failed: %s", failed)
    return failed


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
