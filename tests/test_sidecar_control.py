"""The sidecar's control socket accepts the launcher whatever user the trainer runs as."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from kelastic_sidecar.control import ControlServer
from tests.conftest import wait_for

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


def test_a_launcher_of_another_user_can_connect() -> None:
    assert os.getuid() == 0, "the test suite runs as root (CI) to switch users"
    got: list[dict[str, object]] = []
    run_dir = Path(tempfile.mkdtemp(prefix="kl-run-", dir="/tmp"))
    run_dir.chmod(0o755)  # like the emptyDir: every user of the Pod reaches it
    path = run_dir / "control.sock"
    server = ControlServer(path, got.append)
    old = os.umask(0o077)  # a strict umask must not lock other users out
    try:
        server.start()
    finally:
        os.umask(old)
    try:
        assert path.stat().st_mode & 0o777 == 0o666
        subprocess.run([sys.executable, "-c", CONNECT_AS_NOBODY, str(path)], check=True, timeout=60)
        wait_for(lambda: any(m.get("type") == "hello" for m in got), what="hello")
    finally:
        server.close()
        shutil.rmtree(run_dir, ignore_errors=True)
