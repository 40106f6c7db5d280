"""The sidecar's persistence, alone in a process of its own (as in a Pod, where the
sidecar is a container beside the trainer): ``python -m bench._persister SLOTS DIR EVERY``
persists the slots in ``SLOTS`` marked due (every ``EVERY`` steps) to ``DIR`` until its
standard input closes, then prints ``persisted <steps>`` and exits.

Used by :mod:`bench.persist_overhead` to measure the trainer's step time while it runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kelastic_sidecar.config import PersistSettings
from kelastic_sidecar.persister import Persister


def main(argv: list[str]) -> None:
    slots, directory, every = Path(argv[0]), Path(argv[1]), int(argv[2])
    steps: list[int] = []
    settings = PersistSettings(directory=directory, every_steps=every, on_stop=False, keep=2)
    persister = Persister(settings, "bench", slots, on_step=steps.append)
    persister.start()
    print("ready", flush=True)
    sys.stdin.read()  # until the bench closes it
    persister.close(timeout=30.0)
    print("persisted " + " ".join(map(str, steps)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
