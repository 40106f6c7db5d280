"""How ``kelastic run`` starts a container process (``local/containers.start_process``):
with ``die_with_parent`` it dies with the thread that started it, and no Python code runs
in the child between fork and exec when util-linux's ``setpriv`` is there (a
``preexec_fn`` in a process with other threads can deadlock before exec)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from kelastic_operator.local import containers
from kelastic_operator.local.containers import start_process
from tests.conftest import wait_for


def _started_by_a_thread_that_ends(tmp_path: Path) -> subprocess.Popen[bytes]:
    """``sleep 600`` started with ``die_with_parent`` by a thread that lives until the
    child runs ``sleep`` (after exec), then ends."""
    box: list[subprocess.Popen[bytes]] = []
    done = threading.Event()

    def start() -> None:
        quiet = subprocess.DEVNULL
        env = {"PATH": "/usr/bin:/bin"}
        box.append(start_process(["sleep", "600"], env, tmp_path, quiet, quiet,
                                 die_with_parent=True))  # fmt: skip
        pid = box[0].pid
        wait_for(lambda: Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep"), 10,
                 what="the child exec'd sleep")  # fmt: skip
        done.set()

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    assert done.is_set()
    return box[0]


@pytest.mark.skipif(containers._SETPRIV is None, reason="util-linux setpriv is not installed")
def test_with_setpriv_no_preexec_runs_and_the_child_dies_with_its_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[object] = []
    real = subprocess.Popen

    def spy(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        seen.append(kwargs.get("preexec_fn"))
        return real(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(subprocess, "Popen", spy)
    proc = _started_by_a_thread_that_ends(tmp_path)
    assert seen == [None]  # vfork/exec: nothing of ours in the child
    assert proc.wait(timeout=10) == -9  # SIGKILL when its starting thread ended


def test_without_setpriv_the_preexec_does_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(containers, "_SETPRIV", None)
    proc = _started_by_a_thread_that_ends(tmp_path)
    assert proc.wait(timeout=10) == -9


def test_a_label_the_pod_lacks_reads_empty_as_on_a_node_and_other_sources_are_reported() -> None:
    """The sidecar's zone (``metadata.labels['topology.kubernetes.io/zone']``) is empty
    locally, as the kubelet reads a missing label; a secret reference cannot be resolved
    here and is reported, not invented."""
    fields = {"metadata.name": "job-0", "metadata.labels['app']": "digits"}
    warnings: list[str] = []

    def ref(path: str) -> dict[str, object]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    container = {"env": [
        {"name": "NAME", **ref("metadata.name")},
        {"name": "APP", **ref("metadata.labels['app']")},
        {"name": "ZONE", **ref("metadata.labels['topology.kubernetes.io/zone']")},
        {"name": "NOTE", **ref("metadata.annotations['x']")},
        {"name": "IP", **ref("status.hostIP")},
        {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ]}  # fmt: skip
    env = containers.container_env(container, {}, fields, warnings.append)
    assert env == {"NAME": "job-0", "APP": "digits", "ZONE": "", "NOTE": ""}
    assert [w.split(":")[0] for w in warnings] == ["env IP", "env PW"]
