"""Run a Pod's containers as local processes: the container "runtime" of local mode.

Used by ``kelastic run`` (which renders each replica's sidecar and trainer itself) and by
the tests' local kubelet (which runs the Pods the operator creates). There are no images:

- ``command``: a leading ``python``/``python3`` is this interpreter, ``kelastic-sidecar``
  is ``python -m kelastic_sidecar``; anything else runs as is from ``PATH``
  (:func:`local_launcher_argv` does the same for the worker command of ``kelastic run``);
- ``workingDir`` is mapped by the caller (an image's folder has no local meaning);
- volumes are local folders; an env value equal to or under a ``mountPath`` is rewritten
  to the folder, and the ``kelastic-run`` mount sets ``KELASTIC_RUN_DIR``;
- ``env`` ``value`` is used as is; ``valueFrom.fieldRef`` is resolved from the fields the
  caller gives (``metadata.name``, ``status.podIP``, ...), a label or annotation the Pod
  lacks as ``""`` (the kubelet's reading); other sources are reported.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from kelastic import contract
from kelastic._workers import child_preexec


def local_argv(command: list[str]) -> list[str]:
    """Map a container command to a local argv (see the module doc).

    Raises:
        ValueError: an empty command.
    """
    if not command:
        raise ValueError("empty container command")
    head, rest = command[0], list(command[1:])
    if head in ("python", "python3"):
        return [sys.executable, *rest]
    if head == "kelastic-sidecar":
        return [sys.executable, "-m", "kelastic_sidecar", *rest]
    return [head, *rest]


def local_launcher_argv(command: list[str]) -> list[str]:
    """A launcher command (``python -m kelastic.launch ... -- <worker command>``) whose
    worker command runs a leading ``python``/``python3`` with this interpreter too.

    The launcher resolves the worker's program on ``PATH``: without this, a virtualenv
    used without activating it runs ``kelastic`` with its own interpreter but the
    workers with the system one, which lacks the job's packages. Commands without
    ``--`` are returned unchanged.
    """
    argv = list(command)
    if "--" in argv:
        at = argv.index("--") + 1
        if at < len(argv) and argv[at] in ("python", "python3"):
            argv[at] = sys.executable
    return argv


def mount_map(container: Mapping[str, Any], volumes: Mapping[str, Path]) -> dict[str, Path]:
    """``mountPath -> local folder`` for the container's mounts of known volumes."""
    out: dict[str, Path] = {}
    for m in container.get("volumeMounts") or []:
        if isinstance(m, dict) and m.get("name") in volumes and m.get("mountPath"):
            out[str(m["mountPath"]).rstrip("/") or "/"] = volumes[str(m["name"])]
    return out


def rewrite_path(value: str, mounts: Mapping[str, Path]) -> str:
    """``value`` with a leading mount path replaced by its local folder."""
    for path, local in mounts.items():
        if value == path or value.startswith(path + "/"):
            return str(local) + value[len(path) :]
    return value


def container_env(
    container: Mapping[str, Any],
    mounts: Mapping[str, Path],
    fields: Mapping[str, str],
    warn: Callable[[str], None],
) -> dict[str, str]:
    """The container's env as a local process sees it (see the module doc).

    Args:
        container: the container spec.
        mounts: from :func:`mount_map`.
        fields: values for ``fieldRef.fieldPath`` (e.g. ``{"metadata.name": "job-0"}``).
        warn: called once per variable that cannot be resolved locally (it is skipped).
    """
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if not isinstance(item, dict) or not item.get("name"):
            continue
        name = str(item["name"])
        if "value" in item:
            env[name] = rewrite_path(str(item["value"]), mounts)
            continue
        ref = (item.get("valueFrom") or {}).get("fieldRef") or {}
        path = ref.get("fieldPath")
        if isinstance(path, str) and path in fields:
            env[name] = fields[path]
        elif isinstance(path, str) and path.startswith(_MAP_FIELDS) and path.endswith("']"):
            env[name] = ""  # a label or annotation the Pod lacks reads empty, as the kubelet's
        else:
            warn(f"env {name}: {item.get('valueFrom')} cannot be resolved locally; skipped")
    run_dir = mounts.get(contract.DEFAULT_RUN_DIR)
    if run_dir is not None:
        env[contract.ENV_RUN_DIR] = str(run_dir)
    return env


#: ``fieldRef`` paths into the Pod's labels and annotations (``metadata.labels['k']``).
_MAP_FIELDS = ("metadata.labels['", "metadata.annotations['")


#: util-linux's ``setpriv`` (sets the parent-death signal, then execs), if installed.
_SETPRIV = shutil.which("setpriv")


def start_process(
    argv: list[str],
    env: Mapping[str, str],
    cwd: Path,
    stdout: IO[bytes] | int,
    stderr: IO[bytes] | int,
    *,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start one container process in its own session (so a terminal's Ctrl-C reaches
    only the runner, which stops everything in order).

    Args:
        die_with_parent: the process gets ``PR_SET_PDEATHSIG=SIGKILL`` (Linux): it is
            killed when the *thread* that started it ends (the kernel's notion of the
            parent), so start it from a thread that lives as long as the process
            should: ``kelastic run`` starts everything from its main loop. Set by
            util-linux's ``setpriv --pdeathsig`` before it execs the program, where
            installed: no Python runs between fork and exec (a ``preexec_fn`` forks a
            process whose other threads (gRPC's, the output pumps') may hold locks the
            child then waits on for ever, before exec: CPython warns of it; seen once as
            a replacement Pod whose trainer never started); else by ``preexec_fn``.

    Raises:
        OSError: the program cannot be started.
    """
    preexec = None
    if die_with_parent and _SETPRIV is not None:
        argv = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
    elif die_with_parent:
        preexec = functools.partial(child_preexec, os.getpid())
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=preexec,
    )


def base_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's env plus ``extra``: local containers inherit the host's PATH etc."""
    return {**os.environ, **extra}
