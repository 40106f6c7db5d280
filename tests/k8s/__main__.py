"""Run the emulator on its own: ``python -m tests.k8s [--port N] [--dir DIR]``.

Prints the URL and the kubeconfig path, then serves until interrupted (Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import tempfile
import threading
from pathlib import Path

from .harness import K8sApi


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.k8s", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: random)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the kubeconfig")
    args = parser.parse_args()
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="k8s-emulator-"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with K8sApi(workdir, port=args.port) as api:
        print(f"url: {api.url}\nkubeconfig: {api.kubeconfig}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()


if __name__ == "__main__":
    main()
