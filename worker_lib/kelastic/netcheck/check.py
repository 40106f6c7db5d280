"""The network check itself, with torch's gloo (imported only when a check runs).

:func:`run_check` forms a gloo group of the round's nodes (one process per node) over a
``TCPStore`` that rank 0 serves, measures the whole group's all-reduce against the
floors and, when it misses them, runs the pair tests (:func:`.codec.pair_steps`) and
judges them (:func:`.codec.judge`). Every rank reaches the same verdict: the group's
times are all-reduced with MAX before they are compared, and every pair measurement is
gathered to every rank before it is judged.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from .codec import (
    MAX_INCONCLUSIVE,
    Floors,
    Pair,
    PairResult,
    Params,
    Verdict,
    clip,
    combine,
    judge,
    pair_steps,
    retest_steps,
)

__all__ = ["run_check"]


def _median_time(op: Callable[[], object], iterations: int) -> float:
    """Median wall time of ``op`` over ``iterations`` runs, seconds."""
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _group_times(torch: Any, dist: Any, floors: Floors) -> tuple[float, float]:
    """(latency_s, bandwidth_bps) of the whole group's all-reduce, the worst rank's: each
    rank's median times, all-reduced with MAX so that every rank holds the same."""
    small = torch.zeros(1, dtype=torch.float32)
    big = torch.zeros(floors.size_bytes // 4, dtype=torch.float32)
    dist.all_reduce(small)  # warm-up: the first collective pays for lazy set-up
    dist.all_reduce(big)
    latency = _median_time(lambda: dist.all_reduce(small), floors.iterations)
    seconds = _median_time(lambda: dist.all_reduce(big), floors.iterations)
    worst = torch.tensor([latency, seconds], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    latency, seconds = (float(x) for x in worst.tolist())
    return latency, floors.size_bytes / max(seconds, 1e-9)


def _pair_test(torch: Any, dist: Any, me: int, peer: int, floors: Floors) -> tuple[float, float]:
    """(latency_s, bandwidth_bps) between this rank and ``peer``: the median round trip
    of 4 bytes, and 2 * ``size_bytes`` / the median round trip of ``size_bytes``. The
    lower rank sends first."""

    def trip(tensor: Any) -> None:
        if me < peer:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)

    small = torch.zeros(1, dtype=torch.float32)
    big = torch.zeros(floors.size_bytes // 4, dtype=torch.float32)
    trip(small)  # warm-up
    latency = _median_time(lambda: trip(small), floors.iterations)
    seconds = _median_time(lambda: trip(big), floors.iterations)
    return latency, 2 * floors.size_bytes / max(seconds, 1e-9)


def _run_pass(
    torch: Any, dist: Any, params: Params, steps: Sequence[Sequence[Pair]]
) -> dict[Pair, PairResult]:
    """Run one pass's ``steps`` (a barrier after each: the pairs of a step are measured
    alone), then gather every rank's measurements to every rank and combine them."""
    mine = torch.full((len(steps), 2), -1.0, dtype=torch.float64)
    for s, step in enumerate(steps):
        peer = next((b if a == params.rank else a for a, b in step if params.rank in (a, b)), None)
        if peer is not None:
            latency, bandwidth = _pair_test(torch, dist, params.rank, peer, params.floors)
            mine[s] = torch.tensor([latency, bandwidth], dtype=torch.float64)
        dist.barrier()
    every = [torch.empty_like(mine) for _ in range(params.world_size)]
    dist.all_gather(every, mine)
    measured = [[(float(lat), float(bw)) for lat, bw in t.tolist()] for t in every]
    return combine(steps, measured, params.floors)


def _measure(torch: Any, dist: Any, params: Params) -> tuple[dict[int, str], str, float, float]:
    """(failed, inconclusive, latency_s, bandwidth_bps) in a formed group: the group's
    all-reduce, then, when it misses the floors, pass 1 and pass 2 of the pair tests
    (pass 2 only for what pass 1 left unresolved)."""
    latency, bandwidth = _group_times(torch, dist, params.floors)
    if params.floors.met(latency, bandwidth):
        return {}, "", latency, bandwidth
    results = _run_pass(torch, dist, params, pair_steps(params.world_size, 0))
    again = retest_steps(params.world_size, results)
    if again:
        results.update(_run_pass(torch, dist, params, again))
    failed, inconclusive = judge(params.world_size, results)
    return failed, inconclusive, latency, bandwidth


def run_check(params: Params) -> Verdict:
    """Run this node's part of the network check with the other ranks of ``params``.

    Rank 0 serves a ``torch.distributed.TCPStore`` at ``master_addr:master_port`` (not
    waiting for the others to connect); every rank forms a gloo group over it
    (``params.timeout_s`` for each step), warms up, and measures: the latency is the
    median time of ``iterations`` 1-element float32 all-reduces, the bandwidth
    ``size_bytes`` / the median time of ``iterations`` all-reduces of ``size_bytes``,
    the worst rank's of each. Both floors met: passed. Else the pair tests of pass 1,
    then of pass 2 for the pairs holding a rank whose every pass-1 test failed
    (:func:`.codec.retest_steps`), and :func:`.codec.judge`. The group is destroyed at
    the end, whatever happened. A world of 1 passes at once (nothing to test; no torch).

    Returns:
        The :class:`Verdict`: every rank of the group returns the same, but for
        ``seconds`` (this call's wall time) and the reason of an inconclusive one.

    Never raises for a network problem or a peer that never comes: an exception of
    torch (a timeout, a refused connection, a peer gone), or torch missing, makes an
    inconclusive verdict naming it.
    """
    start = time.monotonic()

    def verdict(failed: dict[int, str], why: str, latency: float, bandwidth: float) -> Verdict:
        return Verdict(
            params.round,
            not failed and not why,
            failed,
            why,
            latency,
            bandwidth,
            time.monotonic() - start,
        )

    if params.world_size == 1:
        return verdict({}, "", 0.0, 0.0)
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return verdict({}, clip(f"torch cannot be imported: {exc}", MAX_INCONCLUSIVE), 0, 0)
    step = "forming the group"
    store = None
    try:
        timeout = timedelta(seconds=params.timeout_s)
        store = dist.TCPStore(
            params.master_addr,
            params.master_port,
            params.world_size,
            params.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        dist.init_process_group(
            "gloo", store=store, rank=params.rank, world_size=params.world_size, timeout=timeout
        )
        step = "measuring"
        return verdict(*_measure(torch, dist, params))
    except Exception as exc:  # torch raises many kinds (DistError, RuntimeError, ...)
        said = str(exc).split("\nException raised from")[0]  # not torch's C++ stack
        why = f"rank {params.rank}: {step} failed: {type(exc).__name__}: {said}"
        return verdict({}, clip(why, MAX_INCONCLUSIVE), 0.0, 0.0)
    finally:
        with contextlib.suppress(Exception):  # a group half torn down by a peer's fault
            if dist.is_initialized():
                dist.destroy_process_group()
        del store
