"""Per-local-rank step time from the timer server's requests, and the straggler verdict.

What a step is: the time from a watched worker's *acquire* of an ``expires()`` timer to
its *release* of the same scope (torch's ``expires`` context manager releases on exit),
as the sidecar receives them (its own ``time.monotonic()``; the workers' clocks are not
used). Acquire to release, rather than acquire to the next acquire, because:

- it is the region the user timed, so time spent between steps (a checkpoint, an
  evaluation, a data wait outside the ``with``) does not count as a slow step;
- a release marks the end of the step exactly, where the next acquire may come much later
  (or never: the last step);
- the acquire-to-acquire period is the same on every rank of a synchronous job (every
  rank waits for the slowest in the step's collective), so it could never single out a
  straggler; acquire to release can, as far as the timed region is the rank's own work.
  A region that includes the step's synchronising collective (e.g. DDP's all-reduce
  inside the ``with``) measures the same on every rank too: the fast ranks' wait fills
  the difference. Time only the compute (forward, backward) to find the slow rank.

An acquire while a step of the same scope is open (a renewal) keeps the step's start; a
release without an open step is ignored. A duration below 0 (a clock going backwards,
only possible with an injected clock) is dropped and counted.

Memory is bounded: one window of the last :data:`WINDOW` steps per (local rank, scope),
at most :data:`MAX_SCOPES` scopes per local rank (further scopes are ignored and counted),
open steps only of bound pids (at most :data:`MAX_SCOPES` each). Pids come and go with
:meth:`StepTimes.bind` and :meth:`StepTimes.unbind`; an unbound pid's requests are
ignored, so a reused pid never ends a step its predecessor began.

The verdict (:func:`stragglers`; NVIDIA resiliency-ext's straggler detector compares a
rank's performance score with the others' the same way): per scope, among the local ranks
with at least ``min_steps`` steps in their window, a rank whose median step time exceeds
``factor`` times the median of the *other* ranks' medians is a straggler (the others'
median: with two ranks the node's median is their mean, which a 2x slower rank exceeds
only by 1.33x). An episode begins when a rank becomes a straggler (logged once as a
warning, counted by ``on_straggler``) and ends when it no longer is (logged once). It is
taken by :meth:`StepTimes.judge_if_due`, which the timer server calls after each loop turn
(at most once a second, after a new step), outside its table's lock: :meth:`StepTimes.observe`
runs under that lock, which the reaps wait on, so it only records.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kelastic.contract import ENV_STRAGGLER_FACTOR, ENV_STRAGGLER_MIN_STEPS

__all__ = [
    "BUCKETS",
    "DEFAULT_FACTOR",
    "DEFAULT_MIN_STEPS",
    "ENV_STRAGGLER_FACTOR",
    "ENV_STRAGGLER_MIN_STEPS",
    "MAX_SCOPES",
    "WINDOW",
    "StepHistogram",
    "StepTimes",
    "Straggler",
    "StragglerSettings",
    "stragglers",
]

log = logging.getLogger("kelastic_sidecar.steptime")

DEFAULT_FACTOR: Final = 1.5
DEFAULT_MIN_STEPS: Final = 20
#: The largest factor accepted (above it the verdict could never fire in practice).
MAX_FACTOR: Final = 1000.0
#: Steps kept per (local rank, scope): the window the medians are taken over.
WINDOW: Final = 64
#: Scopes tracked per local rank (the first ones seen).
MAX_SCOPES: Final = 4
#: Upper bounds (seconds) of the node's step-time histogram's buckets (``+Inf`` implied).
BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                  120.0, 300.0)  # fmt: skip
#: Seconds between verdicts taken on the timer server's thread (``status`` takes one too).
VERDICT_EVERY: Final = 1.0


@dataclass(frozen=True)
class StragglerSettings:
    """The straggler verdict's knobs (``$KELASTIC_STRAGGLER_FACTOR``,
    ``$KELASTIC_STRAGGLER_MIN_STEPS``).

    Attributes:
        factor: a rank is a straggler when its median step time exceeds this many times
            the other ranks' median; finite, > 1 and <= :data:`MAX_FACTOR`.
        min_steps: steps a rank needs in its window to count; 1..:data:`WINDOW`.
    """

    factor: float = DEFAULT_FACTOR
    min_steps: int = DEFAULT_MIN_STEPS

    def problems(self) -> list[str]:
        """What is wrong with these settings, each naming its variable (empty when valid)."""
        out = []
        if not 1.0 < self.factor <= MAX_FACTOR:  # NaN fails too
            out.append(f"{ENV_STRAGGLER_FACTOR} must be a number above 1 and at most "
                       f"{MAX_FACTOR:g}, got {self.factor}")  # fmt: skip
        if not 1 <= self.min_steps <= WINDOW:
            out.append(f"{ENV_STRAGGLER_MIN_STEPS} must be in 1..{WINDOW} (the window), "
                       f"got {self.min_steps}")  # fmt: skip
        return out


@dataclass(frozen=True)
class Straggler:
    """A rank slower than the others of its node in one scope.

    Attributes:
        local_rank: the slow rank; scope: the timer scope its steps were timed with.
        median_s: its median step time over its window, seconds.
        others_median_s: the median of the other judged ranks' medians, seconds.
        ratio: ``median_s / others_median_s``.
    """

    local_rank: int
    scope: str
    median_s: float
    others_median_s: float
    ratio: float

    def as_dict(self) -> dict[str, Any]:
        """The ``/status`` form."""
        return {"local_rank": self.local_rank, "scope": self.scope,
                "median_s": self.median_s, "others_median_s": self.others_median_s,
                "ratio": self.ratio}  # fmt: skip


def stragglers(medians: Mapping[int, float], scope: str, factor: float) -> list[Straggler]:
    """The ranks of ``medians`` (local rank -> median step seconds, one scope) whose median
    exceeds ``factor`` times the median of the others'; none with fewer than two ranks, or
    when the others' median is not above 0. Pure; ``factor`` as
    :class:`StragglerSettings`."""
    out = []
    for rank, mine in medians.items():
        others = [m for r, m in medians.items() if r != rank]
        if not others:
            continue
        theirs = statistics.median(others)
        if theirs > 0 and mine > factor * theirs:
            out.append(Straggler(rank, scope, mine, theirs, mine / theirs))
    return out


@dataclass(frozen=True)
class StepHistogram:
    """Every step time observed on the node, as Prometheus' cumulative histogram
    (``kelastic_step_seconds``): counted here (a ``bisect`` per step) rather than with
    ``prometheus_client``'s ``Histogram.observe``, which costs the timer server's thread
    several times more per step.

    Attributes:
        buckets: upper bounds, seconds (:data:`BUCKETS`).
        counts: steps of at most each bound, cumulative; one more entry: all steps.
        sum: their total, seconds.
    """

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float


class StepTimes:
    """Step times per local rank and the straggler episodes of one node (see the module
    doc). Thread-safe: :meth:`observe` (under the timer table's lock) and
    :meth:`judge_if_due` run on the timer server's thread, :meth:`status` on the HTTP
    server's.

    Args:
        settings: the verdict's knobs.
        on_step: called with each step's seconds, on the observing thread; keep it quick.
        on_straggler: called once per straggler episode, when it begins (the counter).
        on_change: called with ``(generation, stragglers now)`` each time the set of
            ongoing episodes changes (one begins or ends; a new attempt ends them all),
            outside the lock, on the judging thread; ``generation`` grows with each
            change, so that a consumer can drop a report older than one it already has
            (two threads may judge at once). Keep it quick: it runs on the timer
            server's thread.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        settings: StragglerSettings | None = None,
        *,
        on_step: Callable[[float], None] | None = None,
        on_straggler: Callable[[Straggler], None] | None = None,
        on_change: Callable[[int, list[Straggler]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or StragglerSettings()
        self._on_step = on_step
        self._on_straggler = on_straggler
        self._on_change = on_change
        self._generation = 0  # changes of the set of episodes
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[int, int] = {}  # bound pid -> local rank
        self._open: dict[tuple[int, str], float] = {}  # (pid, scope) -> start
        self._windows: dict[tuple[int, str], deque[float]] = {}  # (rank, scope) -> steps
        self._episodes: dict[tuple[int, str], Straggler] = {}  # ongoing, by (rank, scope)
        self._last_verdict = -math.inf
        self._stepped = False  # a step ended since the last verdict
        self._counts = [0] * (len(BUCKETS) + 1)  # per bucket (the last: above them all)
        self._sum = 0.0
        #: Steps dropped for a negative duration; scopes beyond :data:`MAX_SCOPES`.
        self.backwards = 0
        self.scopes_ignored = 0

    def bind(self, pid: int, local_rank: int) -> None:
        """``pid`` is the worker of ``local_rank`` now: its requests count for that rank.
        A rank taken over by another pid keeps its window (the same rank's steps)."""
        with self._lock:
            self._drop_pid(pid)
            self._ranks[pid] = local_rank

    def unbind(self, pid: int) -> None:
        """``pid`` exited: its open steps are dropped and its requests ignored."""
        with self._lock:
            self._drop_pid(pid)
            self._ranks.pop(pid, None)

    def clear(self) -> None:
        """A new attempt (a new world): forget every pid, window and episode."""
        with self._lock:
            self._ranks.clear()
            self._open.clear()
            self._windows.clear()
            ended = bool(self._episodes)
            self._episodes.clear()
            self._generation += ended
            generation = self._generation
        if ended and self._on_change is not None:
            self._on_change(generation, [])

    def _drop_pid(self, pid: int) -> None:
        for key in [k for k in self._open if k[0] == pid]:
            del self._open[key]

    def observe(self, pid: int, scope: str, release: bool) -> None:
        """A watched worker's timer request (the timer table's hook): an acquire opens a
        step of ``scope``, a release ends it."""
        now = self._clock()
        seconds = None
        with self._lock:
            rank = self._ranks.get(pid)
            if rank is None:
                return
            if not release:
                if (pid, scope) not in self._open and self._room(rank, scope):
                    self._open[(pid, scope)] = now
                return
            start = self._open.pop((pid, scope), None)
            if start is None:
                return
            seconds = now - start
            if not seconds >= 0.0:
                self.backwards += 1
                return
            window = self._windows.get((rank, scope))
            if window is None:
                window = self._windows[(rank, scope)] = deque(maxlen=WINDOW)
            window.append(seconds)
            self._counts[bisect.bisect_left(BUCKETS, seconds)] += 1  # its bucket: <= bound
            self._sum += seconds
            self._stepped = True
        if self._on_step is not None:
            self._on_step(seconds)

    def judge_if_due(self) -> None:
        """Take the verdict (:meth:`judge`) if a step ended since the last one and it was
        at least :data:`VERDICT_EVERY` seconds ago (or the clock stepped back); else
        nothing. Called by the timer server after each loop turn, outside its lock."""
        with self._lock:
            now = self._clock()
            due = self._stepped and not 0.0 <= now - self._last_verdict < VERDICT_EVERY
        if due:
            self.judge()

    def histogram(self) -> StepHistogram:
        """The node's step times so far (never reset: a Prometheus histogram only grows)."""
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        return StepHistogram(BUCKETS, tuple(cumulative), total)

    def _room(self, rank: int, scope: str) -> bool:
        """Whether ``scope`` is, or may become, one of ``rank``'s tracked scopes."""
        if (rank, scope) in self._windows:
            return True
        held = sum(1 for r, _ in self._windows if r == rank)
        if held < MAX_SCOPES:
            self._windows[(rank, scope)] = deque(maxlen=WINDOW)
            return True
        self.scopes_ignored += 1
        return False

    def _medians(self) -> dict[str, dict[int, float]]:
        """scope -> local rank -> median step seconds, for windows of at least
        ``min_steps`` steps (lock held)."""
        out: dict[str, dict[int, float]] = {}
        for (rank, scope), window in self._windows.items():
            if len(window) >= self.settings.min_steps:
                out.setdefault(scope, {})[rank] = statistics.median(window)
        return out

    def judge(self) -> list[Straggler]:
        """Take the verdict now: begin and end episodes (logged once each); return the
        stragglers."""
        begun: list[Straggler] = []
        with self._lock:
            self._last_verdict, self._stepped = self._clock(), False
            found = {
                (s.local_rank, s.scope): s
                for scope, medians in self._medians().items()
                for s in stragglers(medians, scope, self.settings.factor)
            }
            for key, straggler in found.items():
                if key not in self._episodes:
                    begun.append(straggler)
            for key in self._episodes.keys() - found.keys():
                log.info("local rank %d is no longer a straggler (scope %r)", *key)
            changed = found.keys() != self._episodes.keys()
            self._episodes = found
            self._generation += changed
            generation = self._generation
        if changed and self._on_change is not None:
            self._on_change(generation, list(found.values()))
        for s in begun:
            log.warning(
                "straggler: local rank %d's median step (scope %r) is %.3f s, %.2fx the "
                "other ranks' median of %.3f s (factor %g, over its last %d+ steps)",
                s.local_rank, s.scope, s.median_s, s.ratio, s.others_median_s,
                self.settings.factor, self.settings.min_steps,
            )  # fmt: skip
            if self._on_straggler is not None:
                self._on_straggler(s)
        return list(found.values())

    def status(self) -> dict[str, Any]:
        """The ``/status`` part: each judged rank's median step per scope, the slowest
        rank with its ratio to the node's median (all ranks' medians of its scope), the
        stragglers now, and the settings."""
        found = self.judge()
        with self._lock:
            medians = self._medians()
            counts = {key: len(w) for key, w in self._windows.items() if w}
        ranks = [
            {"local_rank": rank, "scope": scope, "median_s": median, "steps": counts[(rank, scope)]}
            for scope, by_rank in sorted(medians.items())
            for rank, median in sorted(by_rank.items())
        ]
        return {
            "window": WINDOW,
            "factor": self.settings.factor,
            "min_steps": self.settings.min_steps,
            "ranks": ranks,
            "slowest": _slowest(medians),
            "stragglers": [s.as_dict() for s in sorted(found, key=lambda s: s.local_rank)],
            "steps_dropped_backwards": self.backwards,
            "scopes_ignored": self.scopes_ignored,
        }


def _slowest(medians: Mapping[str, Mapping[int, float]]) -> dict[str, Any] | None:
    """The rank with the highest ratio of its median to its scope's node median (ranks of
    scopes with two or more judged ranks); None if there is none."""
    best: dict[str, Any] | None = None
    for scope, by_rank in medians.items():
        if len(by_rank) < 2:
            continue
        node = statistics.median(by_rank.values())
        rank, mine = max(by_rank.items(), key=lambda kv: kv[1])
        if node <= 0:
            continue  # steps of 0 s: no ratio
        ratio = mine / node
        if best is None or ratio > best["ratio_to_node_median"]:
            best = {"local_rank": rank, "scope": scope, "median_s": mine,
                    "node_median_s": node, "ratio_to_node_median": ratio}  # fmt: skip
    return best
