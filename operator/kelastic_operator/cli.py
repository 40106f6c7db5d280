"""The ``kelastic`` command.

``kelastic run job.yaml`` runs an ElasticJob on this machine (local mode: embedded etcd,
one sidecar and one launcher process per replica). More subcommands arrive with the
operator.
"""

from __future__ import annotations

import signal
import sys

TYPE_CHECKING = False  # typing is not imported before the SIGINT handler is in place
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def _exit_interrupted(signum: int, frame: object) -> None:
    """SIGINT handler of ``python -m kelastic_operator.cli`` until :func:`main` runs."""
    print("kelastic: interrupted", file=sys.stderr)
    raise SystemExit(130)


def _take_sigint(handler: Callable[[int, Any], None]) -> Any:
    """Install ``handler`` for SIGINT, then unblock SIGINT; returns the previous handler.

    Until a program installs a handler, SIGINT has its default action (the interpreter's
    first milliseconds: the process dies by the signal, exit -2) or Python's (a
    ``KeyboardInterrupt`` traceback from ``site``). A parent that must not lose a Ctrl-C
    that early, or have it end the process so, starts ``kelastic run`` with SIGINT blocked
    (the mask survives ``exec``; a supervisor's usual way): the signal then stays pending
    until here and is delivered to ``handler``, so it exits 130 like any other Ctrl-C.
    Unblocking a signal that is not blocked changes nothing.
    """
    previous = signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    return previous


if __name__ == "__main__":  # python -m: a Ctrl-C during the imports below exits 130 too
    _take_sigint(_exit_interrupted)

import argparse  # noqa: E402
import math  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from kelastic import contract  # noqa: E402

if TYPE_CHECKING:
    from rich.console import Console

    from .local.faults import Fault
    from .model import ElasticJob

# Only the standard library is imported before main() runs: a Ctrl-C during the imports
# (rich, pydantic, the runner: most of the first second) must end in exit 130, not a
# traceback.

_RUN_EPILOG = """\
examples:
  kelastic run examples/digits/elasticjob.yaml
  kelastic run examples/digits/elasticjob.yaml --replicas 3
  kelastic run job.yaml --fault kill:rank=1,after=3 --fault hang:rank=2,after=3
  kelastic run examples/digits/elasticjob.yaml --in-process --fault raise:rank=1,after=4
  kelastic run job.yaml --etcd 127.0.0.1:2379

faults (for demos and tests; each fires once, one after another in the given order):
  kill:rank=R,after=S   SIGKILL the worker with global rank R, S seconds into training
  hang:rank=R,after=S   SIGSTOP it instead: it hangs inside expires(...) and the sidecar's
                        timer server must reap it
  raise:rank=R,after=S  SIGUSR1 it: kelastic.inprocess.Wrapper raises an exception inside
                        the wrapped training function (KELASTIC_INJECT_RAISE=1 is set on
                        the trainer); with --in-process only that function restarts, on
                        every rank, in the same processes; without, the worker fails
  "S seconds into training": the clock starts when rank R's node has taken its first
  timed step (expires) in an attempt (or in-process iteration) begun after the previous
  fault fired.

recovery, cheapest rung first: in-process restart (--in-process or spec.inProcess:
the wrapped function restarts in the live workers, spec.inProcess.maxRestarts times; a
dead worker process is replaced by a waiting spare, --spares, or started again), then
process restart (the worker group restarts, spec.maxRestarts), then Pod replacement
(spec.podReplacement).

exit status: 0 the job succeeded, 1 it failed (root cause printed), 2 bad input,
130 interrupted. Logs stay in the run dir printed at start.
"""


def _seconds(minimum: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of seconds ``>= minimum`` (``> minimum``
    unless ``inclusive``); anything else is refused as bad input (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        ok = value >= minimum if inclusive else value > minimum
        if not math.isfinite(value) or not ok:
            bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number {bound}")
        return value

    return parse


def _spare_count(text: str) -> int:
    """An argparse ``type``: spare ranks per node, an integer in 0..64."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= contract.MAX_INPROCESS_SPARES:
        raise argparse.ArgumentTypeError(f"{text!r}: must be in 0..{contract.MAX_INPROCESS_SPARES}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kelastic",
        description="kelastic: elastic, fault-tolerant PyTorch training on Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run an ElasticJob on this machine (no Kubernetes)",
        description="Run an ElasticJob manifest locally: an embedded etcd, and per replica "
        "a kelastic sidecar and a launcher starting nprocPerNode workers, exactly as the "
        "operator's Pods would.",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("manifest", type=Path, help="ElasticJob YAML file")
    run.add_argument(
        "--replicas", type=int, help="nodes to start (default: spec.replicas)", metavar="N"
    )
    run.add_argument(
        "--etcd",
        metavar="ENDPOINTS",
        help="comma-separated host:port of an existing etcd (default: start an embedded one)",
    )
    run.add_argument(
        "--fault", action="append", default=[], metavar="SPEC", help="inject a fault (see below)"
    )
    run.add_argument(
        "--workdir",
        type=Path,
        help="parent folder of the run dir (default: $TMPDIR/kelastic)",
    )
    run.add_argument(
        "--stop-grace",
        type=_seconds(0.0, inclusive=True),
        default=5.0,
        metavar="SECONDS",
        help="SIGTERM-to-SIGKILL grace for workers (default 5)",
    )
    run.add_argument(
        "--warm-start",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fork restarted workers from a process that already imported torch "
        "(default: spec.warmStart.enabled)",
    )
    run.add_argument(
        "--in-process",
        action="store_true",
        help="restart the training function in the running workers after a fault, before "
        "restarting the worker processes (turns spec.inProcess.enabled on; the script must "
        "wrap its function with kelastic.inprocess.Wrapper, as examples/digits does)",
    )
    run.add_argument(
        "--spares",
        type=_spare_count,
        default=None,
        metavar="N",
        help="spare worker processes per node (sets spec.inProcess.spareRanks; needs "
        "in-process restart: --in-process or spec.inProcess.enabled): each waits, warm, in "
        "the Wrapper and takes the place of a worker process that dies, without a process "
        "start",
    )
    run.add_argument(
        "--status-interval",
        type=_seconds(0.0, inclusive=False),
        default=10.0,
        metavar="SECONDS",
        help="seconds between progress lines (default 10)",
    )
    sub.add_parser("version", help="print the version")
    return parser


class StartUpInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) before the runner took over its signals, raised by the handler
    :func:`main` installs first.

    Not a plain :class:`KeyboardInterrupt` on purpose: CPython (3.11, 3.12) remembers a
    plain one that ends a string ``exec`` (the path of ``PyRun_String``: ``dataclasses``
    and ``collections.namedtuple`` build their methods that way, thousands of times while
    rich and pydantic import) as *unhandled* even when a caller catches it, and
    ``python -m`` then exits by SIGINT's default action (exit -2) instead of the status
    :func:`main` returned. The check is on the exact type, so a subclass is never taken
    for it.
    """


class _StartUpSigint:
    """The SIGINT handler of the start-up: records the interrupt and raises
    :class:`StartUpInterrupted` in the main thread."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum: int, frame: object) -> None:
        self.fired = True
        code = getattr(frame, "f_code", None)
        if code is not None and code.co_filename.startswith("<frozen importlib"):
            return  # raised there (a module lock's callback) it is printed and lost; main re-raises
        raise StartUpInterrupted()


_start_up_sigint = _StartUpSigint()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kelastic`` console script; returns the exit status.

    A Ctrl-C before the runner takes over its signals (imports, reading the manifest)
    returns 130 with one line on stderr, never a traceback (its own SIGINT handler is the
    first thing this installs: see :class:`StartUpInterrupted`); so does a missing 'local'
    extra (rich, pydantic, ...: ``pip install "kelastic[local]"``), with exit status 2.
    What came before this function runs, the interpreter's own start (its first ~25 ms,
    ``site``), is Python's, unless the parent blocked SIGINT: see :func:`_take_sigint`.
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        _start_up_sigint.fired = False
        previous = _take_sigint(_start_up_sigint)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("kelastic: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        from kelastic._extras import missing_extra

        return missing_extra("kelastic", "local", exc)
    except Exception as exc:
        if not (_start_up_sigint.fired and _caused_by_interrupt(exc)):
            raise
        # Python wrapped the interrupt (raised in a class body's __set_name__, pydantic's
        # import runs thousands: RuntimeError "Error calling __set_name__", caused by it)
        print("kelastic: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _caused_by_interrupt(exc: BaseException) -> bool:
    """Whether ``exc``'s chain of causes and contexts (50 links at most) holds a
    :class:`KeyboardInterrupt`."""
    link: BaseException | None = exc
    for _ in range(50):
        if link is None:
            return False
        if isinstance(link, KeyboardInterrupt):
            return True
        link = link.__cause__ or link.__context__
    return False


def _main(argv: list[str] | None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        from kelastic import __version__

        print(f"kelastic {__version__}")
        return 0
    if args.command != "run":
        parser.print_help()
        return 2
    return _run(args)


def with_run_options(job: ElasticJob, args: argparse.Namespace, faults: list[Fault]) -> ElasticJob:
    """The job as ``kelastic run``'s options change it (the manifest is not modified).

    ``--warm-start``/``--no-warm-start`` set ``spec.warmStart.enabled``; ``--in-process``
    sets ``spec.inProcess.enabled``; ``--spares N`` sets ``spec.inProcess.spareRanks``; a
    ``raise`` fault puts ``KELASTIC_INJECT_RAISE=1`` in the trainer's env
    (:func:`~kelastic_operator.local.faults.arm_raise`).

    Args:
        job: the validated manifest.
        args: the parsed ``run`` arguments (``warm_start``: bool or None, ``in_process``,
            ``spares``: int or None).
        faults: the parsed ``--fault`` values.

    Raises:
        ValueError: ``--spares`` without in-process restart.
    """
    from .local.faults import arm_raise

    spec = job.spec
    if args.warm_start is not None:
        warm = spec.warm_start.model_copy(update={"enabled": args.warm_start})
        spec = spec.model_copy(update={"warm_start": warm})
    if getattr(args, "in_process", False):
        inproc = spec.in_process.model_copy(update={"enabled": True})
        spec = spec.model_copy(update={"in_process": inproc})
    spares = getattr(args, "spares", None)
    if spares is not None:
        if not spec.in_process.enabled:
            raise ValueError("--spares needs in-process restart (--in-process, or "
                             "spec.inProcess.enabled in the manifest)")  # fmt: skip
        inproc = spec.in_process.model_copy(update={"spare_ranks": spares})
        spec = spec.model_copy(update={"in_process": inproc})
    return arm_raise(job.model_copy(update={"spec": spec}), faults)


def _usage_error(err: Console, message: str) -> int:
    from rich.markup import escape

    err.print(f"[bold red]kelastic run:[/] {escape(message)}")
    return 2


def _run(args: argparse.Namespace) -> int:
    # What the runner and its sidecar processes import later: a missing one is named now.
    import grpc  # noqa: F401
    import prometheus_client  # noqa: F401
    import pyetcd  # noqa: F401
    from rich.console import Console
    from rich.markup import escape

    from kelastic_etcd.call import parse_endpoint

    from .local.faults import Fault
    from .local.runner import LocalOptions, LocalRunner, refuse_unsupported
    from .model import ManifestError, load_manifest

    out = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        job = refuse_unsupported(load_manifest(args.manifest), args.manifest)
        faults = [Fault.parse(f) for f in args.fault]
        job = with_run_options(job, args, faults)
    except (ManifestError, ValueError) as exc:
        return _usage_error(err, str(exc))
    spec = job.spec
    if args.replicas is not None and not spec.min_nodes <= args.replicas <= spec.max_nodes:
        return _usage_error(
            err,
            f"--replicas {args.replicas} is outside [minReplicas, maxReplicas] = "
            f"[{spec.min_nodes}, {spec.max_nodes}]",
        )
    for fault in faults:
        top = (args.replicas or spec.replicas) * spec.nproc_per_node
        if fault.rank >= top:
            return _usage_error(err, f"fault rank {fault.rank} >= world size {top}")
    endpoints = [e.strip() for e in (args.etcd or "").split(",") if e.strip()]
    if args.etcd is not None and not endpoints:
        return _usage_error(err, f"--etcd {args.etcd!r}: no endpoint (expected host:port,...)")
    for endpoint in endpoints:
        try:
            parse_endpoint(endpoint)
        except ValueError as exc:
            return _usage_error(err, f"--etcd: {exc}")
    options = LocalOptions(
        replicas=args.replicas,
        etcd=endpoints,
        faults=faults,
        workdir=args.workdir,
        stop_grace=args.stop_grace,
        status_interval=args.status_interval,
    )

    def say(line: str) -> None:
        out.print(f"[bold cyan]\\[kelastic][/] {escape(line)}")

    def echo(line: str, is_err: bool) -> None:
        (err if is_err else out).print(escape(line), markup=True)

    runner = LocalRunner(job, args.manifest.resolve().parent, options, say, echo)
    if _start_up_sigint.fired:  # its exception was swallowed (e.g. in a finalizer)
        raise StartUpInterrupted()
    return runner.run()


if __name__ == "__main__":
    sys.exit(main())
