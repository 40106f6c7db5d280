"""The warm-start zygote: a process that imported torch once and forks ready workers.

A cold worker spends most of its start in ``import torch`` and in the lazy imports of
the first ``DistributedDataParallel(...)`` (``torch._dynamo``, sympy, ...): about 1 s
each on an idle core, several seconds when a node's workers all start at once. With
``python -m kelastic.launch --warm-start``, the launcher starts this process once; it
imports the *preload* modules and then, for every worker of every attempt, forks a
child that turns into the worker: ``python train.py args`` runs in a fresh ``__main__``
module (:meth:`ChildJob.run`) of a process that already holds the imported modules
(copy-on-write), so a restart costs
a fork instead of an interpreter start. This is the "zygote" of Android and of
Instagram's prefork servers; the same trick as torch's ``DataLoader`` fork workers.

Protocol (launcher side: :mod:`kelastic._warm`): one ``AF_UNIX``/``SOCK_SEQPACKET``
socket, one JSON message per packet. The zygote first sends ``{"type": "ready",
"preloaded": [...], "seconds": S}`` or ``{"type": "failed", "error": "..."}`` (then
exits 1). The launcher sends ``{"type": "spawn", "kind": "script"|"module"|"code",
"target": str, "argv": [...], "env": {...}, "cwd": str, "unbuffered": bool}`` with the
worker's stdout and stderr pipe ends attached (``SCM_RIGHTS``); the zygote answers
``{"type": "spawned", "pid": N}`` or ``{"type": "error", "error": "..."}``. End of file
on the socket makes the zygote exit 0.

How a worker is made (double fork, so the launcher, not the zygote, is its parent):
the zygote forks an intermediate child, which forks the worker and exits at once. The
worker calls ``setsid()`` (its pid is its process group id, as for a cold worker),
tells the zygote its pid, and waits until it was reparented to the launcher (a child
subreaper: ``PR_SET_CHILD_SUBREAPER``), so the launcher reaps it with
``waitpid(-1)`` like any worker. Only then does it set ``PR_SET_PDEATHSIG=SIGKILL``
(the death signal follows the *current* parent, which must be the launcher) and check
that the launcher is still its parent. Then it moves the pipes onto fds 1 and 2 and
``/dev/null`` onto 0, replaces ``os.environ`` with the worker's env, changes directory,
sets ``sys.argv``/``sys.path[0]`` the way the interpreter would, re-seeds numpy's
global generator (``random`` re-seeds itself after a fork), makes
``/proc/<pid>/cmdline`` and ``/proc/<pid>/environ`` show the worker's command and
environment (:func:`show_as`), and unwinds out of the
zygote's loop to run the program at top level, so that exit status, uncaught
exceptions, ``atexit`` handlers and non-daemon threads behave as in ``python
train.py``.

What differs from a cold worker: modules and environment variables read at import
time (``OMP_NUM_THREADS`` for the OpenMP runtime, torch's import-time settings) come
from the launcher's environment, not the assignment's (kelastic's assignment only
carries torch elastic's rendezvous variables, which torch reads later); the
interpreter options other than ``-u`` and ``-B`` cannot change (the launcher starts
such commands cold). Stdlib only; Linux.

Over ~400 lines because it is one cohesive thing: the program of one process (started as
``python -m kelastic._zygote``, importing nothing of the launcher): its protocol with the
launcher, the preload, the double fork and the child's turning into the worker, which
must agree step by step; this docstring, their design, is a fifth of it.
"""

from __future__ import annotations

import array
import builtins
import contextlib
import ctypes
import gc
import importlib
import importlib.machinery
import io
import json
import os
import runpy
import select
import socket
import sys
import time
import traceback
import types
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kelastic._workers import child_preexec

__all__ = [
    "ENV_PAD",
    "MAX_MESSAGE_BYTES",
    "ChildJob",
    "main",
    "recv_message",
    "send_message",
    "show_as",
]

#: Largest control packet (bytes); the worker's env dominates it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Seconds a new worker waits to be reparented to the launcher before giving up.
REPARENT_TIMEOUT = 10.0
#: Seconds the zygote waits for a new worker to report its pid.
PID_REPORT_TIMEOUT = 10.0


def send_message(sock: socket.socket, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one JSON packet on a ``SOCK_SEQPACKET`` socket, with ``fds`` attached.

    Raises:
        OSError: the send failed (the peer is gone, or the packet exceeds the socket's
            buffer); ``ValueError`` if the encoded message exceeds
            :data:`MAX_MESSAGE_BYTES`.
    """
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    ancillary = []
    if fds:
        ancillary.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes()))
    sock.sendmsg([data], ancillary)


def recv_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]] | None:
    """Receive one JSON packet and the fds attached to it; ``None`` at end of file.

    Raises:
        OSError: the receive failed (including a timeout set on the socket).
        ValueError: the packet is not a JSON object or was truncated; any fds it
            carried are closed first.
    """
    fd_size = array.array("i").itemsize
    data, ancdata, flags, _ = sock.recvmsg(
        MAX_MESSAGE_BYTES, socket.CMSG_SPACE(max(1, max_fds) * fd_size)
    )
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % fd_size])
            fds.extend(got)
    if not data and not fds:
        return None
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ValueError("truncated packet")
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return obj, fds


@dataclass
class ChildJob:
    """What a forked worker runs once it left the zygote's loop.

    Attributes:
        kind: ``"script"`` (``python path``), ``"module"`` (``python -m name``) or
            ``"code"`` (``python -c code``).
        target: the script path, module name or code.
        argv: ``sys.argv`` from ``argv[1:]`` on (``argv[0]`` is set per ``kind``).
    """

    kind: str
    target: str
    argv: list[str]

    def run(self) -> None:
        """Run the program in a fresh ``__main__`` module, as the interpreter would.

        The module stays ``sys.modules["__main__"]`` until the interpreter exits, so
        what its globals hold is destroyed during finalisation, as for ``python
        script.py`` (``runpy.run_path``'s temporary module would free it when the
        program returns; a gloo process group freed then can deadlock: its destructor
        joins a thread that waits for the GIL). Exceptions and ``SystemExit`` propagate.
        """
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        if self.kind == "script":
            path = self.target
            sys.argv = [path, *self.argv]
            sys.path[0] = os.path.dirname(os.path.realpath(path))
            if os.path.isdir(path) or zipfile.is_zipfile(path):  # a __main__.py inside
                main.__dict__.update(runpy.run_path(path, run_name="__main__"))
                return
            with io.open_code(path) as fp:
                code = compile(fp.read(), path, "exec")
            main.__dict__.update(
                __file__=path,
                __cached__=None,
                __loader__=importlib.machinery.SourceFileLoader("__main__", path),
            )
            exec(code, main.__dict__)
        elif self.kind == "module":
            sys.argv = ["-m", *self.argv]  # the module's file replaces argv[0]
            sys.path[0] = os.getcwd()
            # What `python -m` itself runs: the module's code in sys.modules["__main__"].
            runpy._run_module_as_main(self.target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = ["-c", *self.argv]
            sys.path[0] = ""
            exec(compile(self.target, "<string>", "exec"), main.__dict__)


def _become_worker(request: dict[str, Any], fds: list[int], report_w: int, launcher: int) -> None:
    """In the worker (grandchild of the zygote): detach, wait for the launcher, set up."""
    os.setsid()
    os.write(report_w, os.getpid().to_bytes(4, "little"))
    os.close(report_w)
    deadline = time.monotonic() + REPARENT_TIMEOUT
    while os.getppid() != launcher:
        if time.monotonic() > deadline:
            os.write(2, b"kelastic zygote: worker was not reparented to the launcher\n")
            os._exit(1)
        time.sleep(0.0002)
    child_preexec(launcher)  # PR_SET_PDEATHSIG now that the launcher is our parent
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if request.get("unbuffered"):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    if request.get("dont_write_bytecode"):
        sys.dont_write_bytecode = True
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh process seeds numpy's global generator from the OS
        with contextlib.suppress(Exception):
            numpy.random.seed()
    show_as(request.get("title") or [], request["env"])


def _proc_areas() -> tuple[int, int, int, int] | None:
    """``(arg_start, arg_end, env_start, env_end)`` of this process (``/proc/self/stat``)."""
    try:
        with open("/proc/self/stat", "rb") as fp:
            stat = fp.read()
        fields = stat[stat.rfind(b")") + 2 :].split()
        areas = tuple(int(x) for x in fields[45:49])  # fields 48-51 of proc(5)
    except (OSError, ValueError):
        return None
    if len(areas) != 4 or not 0 < areas[0] < areas[1] <= areas[2] < areas[3]:
        return None
    return areas[0], areas[1], areas[2], areas[3]


def _fill(start: int, end: int, entries: Sequence[bytes]) -> int:
    """Overwrite memory ``[start, end)`` with NUL-terminated ``entries`` (as many as fit)."""
    buf = bytearray(end - start)
    pos = written = 0
    for entry in entries:
        if b"\0" in entry or pos + len(entry) + 1 > len(buf):
            break
        buf[pos : pos + len(entry)] = entry
        pos += len(entry) + 1
        written += 1
    ctypes.memmove(start, bytes(buf), len(buf))
    return written


def show_as(argv: Sequence[str], env: dict[str, str]) -> bool:
    """Make ``/proc/self/cmdline`` and ``/proc/self/environ`` show ``argv`` and ``env``.

    A forked worker would otherwise show the zygote's command line and environment to
    ``ps``, ``psutil`` and every tool that finds a rank by its ``RANK`` variable. Both
    files read fixed areas of the initial stack (``arg_start..arg_end`` and
    ``env_start..env_end`` in ``/proc/self/stat``); they are overwritten in place, as
    ``setproctitle`` does (the launcher pads the zygote's argv and environment so the
    worker's usually fit; what does not fit is left out: environment entries that
    differ from the zygote's come first). The C library's ``environ`` no longer
    points there once ``os.environ`` was replaced.

    Returns:
        Whether the areas could be found and written.
    """
    areas = _proc_areas()
    if areas is None:
        return False
    arg_start, arg_end, env_start, env_end = areas
    _fill(arg_start, arg_end, [os.fsencode(a) for a in argv])
    inherited = _ZYGOTE_ENV
    entries = sorted(env.items(), key=lambda kv: inherited.get(kv[0]) == kv[1])
    _fill(env_start, env_end, [os.fsencode(f"{k}={v}") for k, v in entries])
    return True


def _spawn(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> ChildJob | None:
    """Fork a worker for ``request``; in the worker return its job, in the zygote ``None``."""
    kind, target, argv = request.get("kind"), request.get("target"), request.get("argv")
    env, cwd = request.get("env"), request.get("cwd")
    if (
        kind not in ("script", "module", "code")
        or not isinstance(target, str)
        or not isinstance(argv, list)
        or not all(isinstance(a, str) for a in argv)
        or not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        or not isinstance(cwd, str)
        or len(fds) != 2
    ):
        for fd in fds:
            os.close(fd)
        send_message(sock, {"type": "error", "error": "malformed spawn request"})
        return None
    launcher = os.getppid()
    report_r, report_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:  # the intermediate child: fork the worker and exit at once
        code = 0
        try:
            if os.fork() == 0:
                try:
                    sock.close()
                    os.close(report_r)
                    _become_worker(request, fds, report_w, launcher)
                except BaseException:  # reported on the worker's stderr
                    traceback.print_exc()
                    sys.stderr.flush()
                    os._exit(1)
                return ChildJob(kind, target, list(argv))
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(report_w)
    for fd in fds:
        os.close(fd)
    try:
        pid = _read_pid(report_r)
    finally:
        os.close(report_r)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(middle, 0)
    if pid is None:
        send_message(sock, {"type": "error", "error": "the forked worker did not report"})
    else:
        send_message(sock, {"type": "spawned", "pid": pid})
    return None


def _read_pid(fd: int) -> int | None:
    data = b""
    deadline = time.monotonic() + PID_REPORT_TIMEOUT
    os.set_blocking(fd, False)
    while len(data) < 4 and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4 - len(data))
        if not chunk:
            break
        data += chunk
    return int.from_bytes(data, "little") if len(data) == 4 else None


#: torch's switch that makes ``torch.cuda.is_available()`` ask NVML instead of
#: initialising the CUDA driver (set while preloading: see :func:`_preload`).
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _preload(modules: Sequence[str]) -> str | None:
    """Import ``modules``; the first failure as text, or ``None``.

    CUDA does not survive ``fork``: a worker forked after CUDA was initialised cannot
    use the GPU. Preloading asks torch to answer ``torch.cuda.is_available()`` from NVML
    (no driver initialisation), and fails if a module initialised CUDA anyway.
    """
    had = os.environ.get(_NVML_CHECK)
    os.environ[_NVML_CHECK] = "1"
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException as e:  # SystemExit from an import too
                return f"import {name} failed: {type(e).__name__}: {e}"
    finally:
        if had is None:
            del os.environ[_NVML_CHECK]
        else:
            os.environ[_NVML_CHECK] = had
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        initialized = bool(cuda is not None and cuda.is_initialized())
    except Exception:
        initialized = False
    if initialized:
        return (
            "a preload module initialised CUDA, which forked workers could not use "
            "(CUDA does not survive fork): preload only modules that do not touch the GPU"
        )
    return None


def serve(sock: socket.socket, preload: Sequence[str]) -> ChildJob | None:
    """Preload, report, and fork workers until end of file on ``sock``.

    Returns:
        In a forked worker, the job to run; in the zygote ``None`` at end of file.
    """
    start = time.monotonic()
    error = _preload(preload)
    if error is not None:
        with contextlib.suppress(OSError):
            send_message(sock, {"type": "failed", "error": error})
        sys.exit(1)
    gc.collect()
    gc.freeze()  # keep the preloaded objects' pages shared with the workers (no gc writes)
    try:
        send_message(
            sock,
            {"type": "ready", "preloaded": list(preload), "seconds": time.monotonic() - start},
        )
    except OSError:  # the launcher is gone (it closed the socket while we preloaded)
        return None
    while True:
        try:
            got = recv_message(sock, max_fds=2)
        except ValueError as e:
            send_message(sock, {"type": "error", "error": f"bad request: {e}"})
            continue
        if got is None:
            return None
        request, fds = got
        if request.get("type") != "spawn":
            for fd in fds:
                os.close(fd)
            error = f"unknown request {request.get('type')!r}"
            send_message(sock, {"type": "error", "error": error})
            continue
        job = _spawn(sock, request, fds)
        if job is not None:
            return job


#: The zygote's environment as it started (without the padding), see :func:`show_as`.
_ZYGOTE_ENV: dict[str, str] = {}
#: Variable the launcher adds to the zygote's environment to make room for a worker's
#: (removed from ``os.environ`` at start).
ENV_PAD = "KELASTIC_ZYGOTE_ENV_PAD"


def main(argv: Sequence[str] | None = None) -> None:
    """``kelastic._zygote <socket fd> <module>...``: serve, and in a worker run its job.

    Empty arguments are ignored (the launcher pads the command line with them).
    """
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a]
    os.environ.pop(ENV_PAD, None)
    _ZYGOTE_ENV.update(os.environ)
    sock = socket.socket(fileno=int(args[0]))
    job = serve(sock, args[1:])
    if job is None:
        sys.exit(0)
    job.run()


if __name__ == "__main__":
    main()
