"""The sidecar's control socket accepts the launcher whatever user the trainer runs as."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kelastic_sidecar.control import ControlServer, Message
from tests.conftest import strict_umask, wait_for

CONNECT_AS_NOBODY = textwrap.dedent(
    """
    import os, socket, sys
    os.setgid(65534)
    os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    s.sendall(b'{"type": "hello", "pid": 1, "nproc": 1}\\n')
    s.close()
    """
)


def test_a_launcher_of_another_user_can_connect(pod_run_dir: Path) -> None:
    """With access "pod" (the default on Kubernetes); locally only the sidecar's user may
    connect (tests/sidecar/test_timer_hostile.py)."""
    assert os.getuid() == 0, "the test suite runs as root (CI) to switch users"
    got: list[Message] = []
    path = pod_run_dir / "control.sock"
    server = ControlServer(path, got.append, access="pod")
    with strict_umask():
        server.start()
    try:
        assert path.stat().st_mode & 0o777 == 0o666
        subprocess.run([sys.executable, "-c", CONNECT_AS_NOBODY, str(path)], check=True, timeout=60)
        wait_for(lambda: any(m.type == "hello" for m in got), what="hello")
    finally:
        server.close()
