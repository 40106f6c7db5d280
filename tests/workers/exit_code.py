"""A worker without torch that fails once with a chosen exit code or signal (the failure
rules' tests, tests/operator/local/test_failure_rules.py).

Prints ``rank=R round=N restart=K`` once, then ``step S`` lines (~0.05 s each). By env:
  EXIT_CODE        the code rank EXIT_RANK exits with at its step 2
  EXIT_SIGNAL      instead, the signal number it kills itself with
  EXIT_RANK        the global rank that fails (default 1)
  EXIT_ONCE_FILE   created just before it fails: while it exists no rank fails (so the
                   job can go on after the rule's action)
  STEPS_STOP_FILE  exit 0 once this file exists
  EXIT_WRAPPED     1: the steps run inside kelastic.inprocess.Wrapper (in-process
                   restart's worker; its exit is a death the hybrid rung could take)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> None:
    rank = int(os.environ["RANK"])
    print(f"rank={rank} round={os.environ['KELASTIC_ROUND']} "
          f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)  # fmt: skip
    once = Path(os.environ["EXIT_ONCE_FILE"])
    stop = Path(os.environ["STEPS_STOP_FILE"])
    fails = rank == int(os.environ.get("EXIT_RANK", "1")) and not once.exists()

    def steps(call_wrapper: object = None) -> None:
        step = 0
        while not stop.exists():
            time.sleep(0.05)
            step += 1
            print(f"step {step}", flush=True)
            if fails and step == 2:
                once.touch()
                if os.environ.get("EXIT_SIGNAL"):
                    os.kill(os.getpid(), int(os.environ["EXIT_SIGNAL"]))
                sys.exit(int(os.environ["EXIT_CODE"]))

    if os.environ.get("EXIT_WRAPPED") == "1":
        from kelastic.inprocess import Wrapper

        Wrapper()(steps)()
    else:
        steps()


if __name__ == "__main__":
    main()
