"""A timer server in its own process, driven over stdin/stdout by the timer benchmarks.

``python -m bench._timer_proc torch FIFO MAX_INTERVAL`` runs torch's ``FileTimerServer``;
``python -m bench._timer_proc kelastic FIFO`` runs the sidecar's ``TimerServer``
(``kelastic-norelease``: without ``process_mrelease`` after its kills).
It prints ``ready`` once requests can be written, then answers stdin commands:
``watch PID`` -> ``ok`` (kelastic only signals watched pids; torch ignores it),
``stats`` -> a JSON object with the number of requests read, ``quit``.
kelastic's server observes its watched workers' requests for step times, as the sidecar
wires it (:mod:`kelastic_sidecar.steptime`); ``$BENCH_STEP_TIMES=0`` leaves that out (to
measure its cost). With ``$BENCH_REAP_LOG`` set, each kill is appended there as
``pid time.time()`` taken just before the server's ``os.kill`` (the server-side view of
the reap latency).

torch's server kills its own process with the reap signal after every reap (it expects
torchrun's agent to restart it); that self-kill is disabled here so that one server
serves all repetitions. It happens after the worker was signalled, so it does not change
the measured latency.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def _reap_logger() -> Callable[[int], None]:
    path = os.environ.get("BENCH_REAP_LOG")
    if not path:
        return lambda pid: None
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def record(pid: int) -> None:
        os.write(fd, f"{pid} {time.time()!r}\n".encode())

    return record


def main() -> int:
    impl, fifo = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.ERROR)
    record = _reap_logger()
    if impl == "torch":
        from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

        class Server(FileTimerServer):
            def _reap_worker(self, worker_pid: int, signal: int) -> bool:
                if worker_pid == os.getpid():
                    return True  # no self-kill: keep serving (see the module doc)
                record(worker_pid)
                return bool(super()._reap_worker(worker_pid, signal))

        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
        theirs = Server(fifo, run_id="bench", max_interval=float(sys.argv[3]))
        theirs.start()
        server: Any = theirs

        def stats() -> dict[str, int]:
            return {"requests": theirs._request_count}

        def watch(pid: int) -> None:
            pass
    else:
        from kelastic_sidecar.steptime import StepTimes
        from kelastic_sidecar.timer import TimerServer

        steps = StepTimes() if os.environ.get("BENCH_STEP_TIMES", "1") != "0" else None

        logging.getLogger("kelastic_sidecar").setLevel(logging.ERROR)

        def kill(pid: int, sig: int) -> None:
            record(pid)
            os.kill(pid, sig)

        ours = TimerServer(
            fifo,
            kill=kill,
            release=impl != "kelastic-norelease",
            observe=steps.observe if steps is not None else None,
        )
        ours.start()
        server = ours

        def stats() -> dict[str, int]:
            return {"requests": ours.stats().requests}

        def watch(pid: int) -> None:
            ours.watch_pid(pid)
            if steps is not None:
                steps.bind(pid, pid % 64)  # any local rank: the bench has no ranks

    print("ready", flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "watch":
                for pid in cmd[1:]:
                    watch(int(pid))
                print("ok", flush=True)
            elif cmd[0] == "stats":
                print(json.dumps(stats()), flush=True)
            elif cmd[0] == "quit":
                break
    finally:
        if impl != "torch":
            server.stop()
        elif os.path.exists(fifo):
            os.remove(fifo)  # torch's stop() joins its thread, which may block in open()
    return 0


if __name__ == "__main__":
    sys.exit(main())
