"""``python -m kelastic.netcheck``: one node's part of the network check.

It imports torch first (a launcher starts it early, so that the import overlaps the
rendezvous), then reads ONE params line from stdin (:func:`.codec.encode_params`), runs
the check (:func:`.check.run_check`) and writes exactly one verdict line to stdout
(:func:`.codec.encode_verdict`). Exit status: 0 with a verdict, whatever it says; 0 with
nothing written when stdin ends before a line (the launcher did not need the check); 2
when the params line does not decode (the verdict written then is inconclusive, round 0,
naming the error). Its stdout holds the verdict line alone: anything else written to
file descriptor 1 (torch's C++ side) goes to stderr. On stderr, one INFO line with the
numbers (a WARNING when the check did not pass).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import BinaryIO

from .check import run_check
from .codec import (
    MAX_INCONCLUSIVE,
    MAX_PARAMS_BYTES,
    NetcheckError,
    Verdict,
    clip,
    decode_params,
    encode_verdict,
)

__all__ = ["main"]

log = logging.getLogger("kelastic.netcheck")


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m kelastic.netcheck",
        description="Run this node's part of kelastic's network check: read one params "
        "line (JSON) from stdin, run a gloo all-reduce with the other nodes against a "
        "latency and a bandwidth floor (pair tests attribute a failure to nodes), write one "
        "verdict line (JSON) to stdout. Exit 0 with a verdict, or with nothing written when "
        "stdin ends before a line; 2 when the params line does not decode.",
    )


def _claim_stdout() -> BinaryIO:
    """The process's stdout for the verdict alone: file descriptor 1 then points at
    stderr, so that nothing else (torch's C++ logging) lands in the verdict's stream."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return out


def _write(out: BinaryIO, verdict: Verdict) -> None:
    out.write(encode_verdict(verdict).encode("utf-8") + b"\n")
    out.flush()


def _log(verdict: Verdict, rank: int, world: int) -> None:
    numbers = (
        f"netcheck round {verdict.round} rank {rank}/{world}: latency "
        f"{verdict.latency_s * 1e3:.3g} ms, bandwidth {verdict.bandwidth_bps / 1e6:.4g} "
        f"MB/s, {verdict.seconds:.2f} s"
    )
    if verdict.passed:
        log.info("%s: passed", numbers)
    elif verdict.failed:
        log.warning("%s: failed ranks %s", numbers, sorted(verdict.failed))
    else:
        log.warning("%s: inconclusive: %s", numbers, verdict.inconclusive)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check as the module docstring says; returns the exit status (0 or 2).

    Args:
        argv: the arguments (``sys.argv[1:]`` when None); only ``--help`` is known.
    """
    _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    out = _claim_stdout()
    with contextlib.suppress(ImportError):  # the check itself reports it missing
        import torch  # noqa: F401  (first: the import overlaps the launcher's rendezvous)
    line = sys.stdin.buffer.readline(MAX_PARAMS_BYTES + 2)
    if not line:
        return 0
    try:
        params = decode_params(line)
    except NetcheckError as exc:
        why = clip(f"the params line does not decode: {exc}", MAX_INCONCLUSIVE)
        _write(out, Verdict(0, False, {}, why, 0.0, 0.0, 0.0))
        log.error("%s", why)
        return 2
    verdict = run_check(params)
    _write(out, verdict)
    _log(verdict, params.rank, params.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
