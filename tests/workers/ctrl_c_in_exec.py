"""``kelastic run`` with a Ctrl-C landing inside a string ``exec`` during its start-up,
deterministically: run as ``python -m tests.workers.ctrl_c_in_exec run job.yaml ...``
(``-m``, as ``kelastic run`` is run by the tests and the images), it reads the manifest
through a ``load_manifest`` that raises SIGINT from code run by ``exec`` of a string (what
``dataclasses`` and ``collections.namedtuple`` do while rich and pydantic import).

``CTRL_C_PLAIN=1``: Python's own handler (a plain ``KeyboardInterrupt``) is put back
first, as before ``kelastic run`` had a start-up handler of its own: CPython then exits
-2 (killed by SIGINT) although ``main`` caught the interrupt and returned 130.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import kelastic_operator.cli as cli
import kelastic_operator.model as model


def load_manifest(path: Path) -> Any:
    if os.environ.get("CTRL_C_PLAIN") == "1":
        signal.signal(signal.SIGINT, signal.default_int_handler)
    exec("import signal\nsignal.raise_signal(signal.SIGINT)\n", {})
    raise AssertionError("the SIGINT raised nothing")


model.load_manifest = load_manifest  # cli._run imports it from the module at call time

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
