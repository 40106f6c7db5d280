"""The network check's one codec (its params line in, its verdict line out) and its pure
planning and judging: which ranks test which in the pair passes, and who is to blame.

Semantics from DLRover's network check: the nodes are paired and each pair is measured;
nodes whose pairs failed are tested again against other peers; a node that failed every
test it was in, with a peer that passed a test with someone else, is the bad one. Here
pass 1 pairs neighbours ``(0,1), (2,3), ...`` and pass 2 the ring shifted by one, ``(1,2),
(3,4), ..., (0,n-1)``, so that every rank meets a new peer (:func:`pair_steps`); pass 2
runs only the pairs holding a rank that pass 1 left unresolved (:func:`retest_steps`).

Over ~400 lines because it is the check's whole wire format and whole logic in one
place, pure and stdlib only, so that the launcher, the check and the tests share one
reading of every line and every verdict (the torch half, :mod:`.check`, only measures).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Final

from .._safejson import UnsafeJSONError, is_int, loads_bounded

__all__ = [
    "MAX_FAILED",
    "MAX_INCONCLUSIVE",
    "MAX_PARAMS_BYTES",
    "MAX_REASON",
    "MAX_VERDICT_BYTES",
    "MAX_WORLD",
    "Floors",
    "NetcheckError",
    "Pair",
    "PairResult",
    "Params",
    "Verdict",
    "clip",
    "combine",
    "decode_params",
    "decode_verdict",
    "encode_params",
    "encode_verdict",
    "judge",
    "pair_steps",
    "pairs",
    "retest_steps",
]

#: Largest params line, bytes.
MAX_PARAMS_BYTES: Final = 4096
#: Most ranks judged bad in one verdict.
MAX_FAILED: Final = 1024
#: Longest reason a failed rank is given, characters.
MAX_REASON: Final = 512
#: Longest "inconclusive" reason, characters.
MAX_INCONCLUSIVE: Final = 1024
#: Largest world size.
MAX_WORLD: Final = 65536
#: Largest verdict line, bytes: every bound at its maximum, 4 bytes per character (UTF-8;
#: the text is printable, so no character is escaped to more), fits with room to spare.
MAX_VERDICT_BYTES: Final = 4 * 1024 * 1024
_MAX_ROUND: Final = 2**63 - 1
_MAX_FLOAT: Final = 1e300

#: A pair of group ranks, the lower first (it sends first in a pair test).
Pair = tuple[int, int]


class NetcheckError(ValueError):
    """A params or verdict line that no writer makes (corrupt, crafted, cut), or a value
    out of its bounds when one is built."""


def _show(value: object) -> str:
    """``value`` for a message: its repr cut to 80 characters (a huge integer by size)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)[:80]


def _number(name: str, value: object, low: float, high: float) -> float:
    """``value`` as a float in ``low..high`` (an int is a number, a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NetcheckError(f"{name} must be a number, got {_show(value)}")
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise NetcheckError(f"{name} must be within {low:g}..{high:g}, got {_show(value)}")
    return float(value)


def _integer(name: str, value: object, low: int, high: int) -> int:
    if not is_int(value, low, high):
        raise NetcheckError(f"{name} must be an integer within {low}..{high}, got {_show(value)}")
    return value


def _text(name: str, value: object, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        raise NetcheckError(
            f"{name} must be printable text of at most {limit} characters, got {_show(value)}"
        )
    return value


def clip(text: str, limit: int) -> str:
    """``text`` made a valid reason: every non-printable character (a newline, a control
    character) a space, runs of spaces one, cut to ``limit`` characters (``...`` ending a
    cut one)."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= limit else flat[: max(0, limit - 3)] + "..."


@dataclass(frozen=True)
class Floors:
    """What the network must do for the check to pass.

    Attributes:
        max_latency_s: longest median time of a 4-byte all-reduce (pair test: of a 4-byte
            round trip), seconds; 1e-6..60.
        min_bandwidth_bps: least bandwidth, bytes/second: ``size_bytes`` / the median
            time of one all-reduce of ``size_bytes`` (pair test: 2 * ``size_bytes`` / the
            median round trip of ``size_bytes``); 1..1e13.
        size_bytes: the bandwidth test's payload, bytes; 4..256 MiB, a multiple of 4
            (float32 elements).
        iterations: timed repetitions of each measurement (the median is kept); 1..100.

    Raises:
        NetcheckError: a value of another type (a bool is no number), not finite, or
            out of its bounds.
    """

    max_latency_s: float = 0.05
    min_bandwidth_bps: float = 50e6
    size_bytes: int = 4 * 2**20
    iterations: int = 5

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "max_latency_s", _number("max_latency_s", self.max_latency_s, 1e-6, 60))
        set_(
            self, "min_bandwidth_bps", _number("min_bandwidth_bps", self.min_bandwidth_bps, 1, 1e13)
        )
        _integer("size_bytes", self.size_bytes, 4, 256 * 2**20)
        if self.size_bytes % 4:
            raise NetcheckError(f"size_bytes must be a multiple of 4, got {self.size_bytes}")
        _integer("iterations", self.iterations, 1, 100)

    def met(self, latency_s: float, bandwidth_bps: float) -> bool:
        """Whether ``latency_s`` (seconds) and ``bandwidth_bps`` (bytes/second) meet both
        floors."""
        return latency_s <= self.max_latency_s and bandwidth_bps >= self.min_bandwidth_bps


@dataclass(frozen=True)
class Params:
    """What one node's check process is told (the launcher's one params line).

    Attributes:
        round: the rendezvous round, >= 0 (echoed in the verdict).
        rank: this node's rank in the check's group, 0 <= rank < world_size.
        world_size: the group's size (one process per node), 1..65536.
        master_addr: where rank 0 serves the group's TCPStore: 1..253 printable ASCII
            characters, no whitespace.
        master_port: its port, 1..65535.
        timeout_s: gloo's timeout of each step (forming the group, each collective, each
            send or receive), seconds; 1..600.
        floors: the :class:`Floors` to meet.

    Raises:
        NetcheckError: a value of another type or out of its bounds.
    """

    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    timeout_s: float
    floors: Floors = field(default_factory=Floors)

    def __post_init__(self) -> None:
        _integer("round", self.round, 0, _MAX_ROUND)
        _integer("world_size", self.world_size, 1, MAX_WORLD)
        _integer("rank", self.rank, 0, self.world_size - 1)
        addr = self.master_addr
        if (
            not isinstance(addr, str)
            or not 1 <= len(addr) <= 253
            or not all(33 <= ord(c) <= 126 for c in addr)
        ):
            raise NetcheckError(
                "master_addr must be 1..253 printable ASCII characters without "
                f"whitespace, got {_show(addr)}"
            )
        _integer("master_port", self.master_port, 1, 65535)
        object.__setattr__(self, "timeout_s", _number("timeout_s", self.timeout_s, 1, 600))
        if not isinstance(self.floors, Floors):
            raise NetcheckError(f"floors must be Floors, got {type(self.floors).__name__}")


@dataclass(frozen=True)
class Verdict:
    """What the check found (its one verdict line); every rank of a group finds the same,
    but for ``seconds``.

    Attributes:
        round: the params' round.
        passed: the group met both floors, or the pair tests cleared everyone.
        failed: group rank -> why it is judged bad (at most :data:`MAX_FAILED`, reasons
            printable, at most :data:`MAX_REASON` characters); empty when passed or
            inconclusive.
        inconclusive: "" or why no node could be judged (at most
            :data:`MAX_INCONCLUSIVE` printable characters): the group could not form, a
            step timed out, a world of 2 with a slow link, every pair test failed.
        latency_s: the whole group's all-reduce latency, seconds; 0.0 when not measured.
        bandwidth_bps: the whole group's bandwidth, bytes/second; 0.0 when not measured.
        seconds: the check's wall time, seconds.

    Raises:
        NetcheckError: a value out of its bounds, or the three outcomes mixed: passed
            with failed ranks or a reason, failed ranks with a reason, or none of them.
    """

    round: int
    passed: bool
    failed: dict[int, str]
    inconclusive: str
    latency_s: float
    bandwidth_bps: float
    seconds: float

    def __post_init__(self) -> None:
        _integer("round", self.round, 0, _MAX_ROUND)
        if type(self.passed) is not bool:
            raise NetcheckError(f"passed must be a bool, got {_show(self.passed)}")
        if not isinstance(self.failed, dict) or len(self.failed) > MAX_FAILED:
            raise NetcheckError(f"failed must be a dict of at most {MAX_FAILED} ranks")
        for rank, reason in self.failed.items():
            _integer("failed rank", rank, 0, MAX_WORLD - 1)
            _text(f"failed[{rank}]", reason, MAX_REASON)
        _text("inconclusive", self.inconclusive, MAX_INCONCLUSIVE)
        for name in ("latency_s", "bandwidth_bps", "seconds"):
            object.__setattr__(self, name, _number(name, getattr(self, name), 0, _MAX_FLOAT))
        outcomes = (self.passed, bool(self.failed), bool(self.inconclusive))
        if sum(outcomes) != 1:
            raise NetcheckError(
                f"a verdict is exactly one of passed, failed ranks or inconclusive, got {outcomes}"
            )


# ------------------------------------------------------------------ the two lines


def encode_params(p: Params) -> str:
    """``p`` as one JSON line (no newline in it, none at its end): ``{"round", "rank",
    "world_size", "master_addr", "master_port", "timeout_s", "floors": {"max_latency_s",
    "min_bandwidth_bps", "size_bytes", "iterations"}}``."""
    return json.dumps(asdict(p), separators=(",", ":"), allow_nan=False)


def _exact(doc: object, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise NetcheckError(f"{what}: not a JSON object")
    if set(doc) != keys:
        missing, extra = sorted(keys - set(doc)), sorted(set(doc) - keys)
        raise NetcheckError(f"{what}: missing keys {missing}, unknown keys {extra}")
    return doc


def _load(raw: bytes | str, max_bytes: int, what: str) -> object:
    try:
        return loads_bounded(raw, max_bytes=max_bytes, max_depth=4)
    except UnsafeJSONError as exc:
        raise NetcheckError(f"{what}: {exc}") from None


def decode_params(raw: bytes | str) -> Params:
    """A params line back (:func:`encode_params`'s form; a trailing newline is fine).

    Raises:
        NetcheckError: over :data:`MAX_PARAMS_BYTES`, not bounded JSON (``NaN``, ``1e999``,
            a 5000-digit number, deep nesting), a key missing or unknown, or a value of
            another type or out of bounds; the message says which. Nothing else.
    """
    doc = _exact(
        _load(raw, MAX_PARAMS_BYTES, "netcheck params"),
        {f.name for f in fields(Params)},
        "netcheck params",
    )
    floors = _exact(doc["floors"], {f.name for f in fields(Floors)}, "netcheck params floors")
    try:
        return Params(**{**doc, "floors": Floors(**floors)})  # each checks its values
    except NetcheckError as exc:
        raise NetcheckError(f"netcheck params: {exc}") from None


def encode_verdict(v: Verdict) -> str:
    """``v`` as one JSON line (no newline in it, none at its end; UTF-8 text): ``{"round",
    "passed", "failed": {"<rank>": reason}, "inconclusive", "latency_s", "bandwidth_bps",
    "seconds"}``, the failed ranks in order."""
    doc = {**asdict(v), "failed": {str(r): v.failed[r] for r in sorted(v.failed)}}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def decode_verdict(raw: bytes | str) -> Verdict:
    """A verdict line back (:func:`encode_verdict`'s form; a trailing newline is fine).

    Raises:
        NetcheckError: over :data:`MAX_VERDICT_BYTES`, not bounded JSON, a key missing or
            unknown, a failed rank not a canonical decimal, or a value of another type or
            out of bounds (see :class:`Verdict`). Nothing else.
    """
    doc = _exact(
        _load(raw, MAX_VERDICT_BYTES, "netcheck verdict"),
        {f.name for f in fields(Verdict)},
        "netcheck verdict",
    )
    failed = doc["failed"]
    if not isinstance(failed, dict) or len(failed) > MAX_FAILED:
        raise NetcheckError(
            f"netcheck verdict: failed must be an object of at most {MAX_FAILED} ranks"
        )
    ranks: dict[int, str] = {}
    for key, reason in failed.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 5 and str(int(key)) == key):
            raise NetcheckError(f"netcheck verdict: failed rank {key[:20]!r} is not a rank")
        ranks[int(key)] = reason
    try:
        return Verdict(**{**doc, "failed": ranks})
    except NetcheckError as exc:
        raise NetcheckError(f"netcheck verdict: {exc}") from None


# ------------------------------------------------------------------ planning


def pair_steps(world_size: int, shift: int) -> list[list[Pair]]:
    """The pair tests of one pass, in steps: each step a list of disjoint pairs (lower
    rank first) tested at once; the steps run one after the other, every rank in the
    same order, so a rank in two pairs meets its peers one at a time and none waits for
    another.

    Pass 1 (``shift`` 0): ``(0,1), (2,3), ...``; with an odd world size a second step
    pairs the last rank with rank 0. Pass 2 (``shift`` 1): ``(1,2), (3,4), ...`` and,
    for an even world size, ``(0,n-1)``; for an odd one (5 and more) a second step
    ``(0,2)``. Every rank of pass 2 meets a peer it did not meet in pass 1; a world of 2
    has no such peer (pass 2 is empty) and in a world of 3 rank 0 met both others already.
    A world of 1 has no pairs.

    Raises:
        NetcheckError: ``world_size`` not in 1..65536, ``shift`` not 0 or 1.
    """
    n = _integer("world_size", world_size, 1, MAX_WORLD)
    if shift not in (0, 1) or isinstance(shift, bool):
        raise NetcheckError(f"shift must be 0 or 1, got {_show(shift)}")
    if n < 2 or (shift and n == 2):
        return []
    if not shift:
        first = [(r, r + 1) for r in range(0, n - 1, 2)]
        return [first, [(0, n - 1)]] if n % 2 else [first]
    ring = [(r, r + 1) for r in range(1, n - 1, 2)]
    if n % 2 == 0:
        return [[(0, n - 1), *ring]]
    return [ring, [(0, 2)]] if n >= 5 else [ring]


def pairs(world_size: int, shift: int) -> list[Pair]:
    """Every pair of :func:`pair_steps` (``world_size``, ``shift``), step after step."""
    return [p for step in pair_steps(world_size, shift) for p in step]


def _unresolved(world_size: int, results: Mapping[Pair, PairResult]) -> set[int]:
    """The ranks tested whose every test failed."""
    tested: dict[int, bool] = {}
    for (a, b), res in results.items():
        for r in (a, b):
            tested[r] = tested.get(r, False) or res.ok
    return {r for r, ok in tested.items() if not ok and r < world_size}


def retest_steps(world_size: int, first: Mapping[Pair, PairResult]) -> list[list[Pair]]:
    """Pass 2's steps (:func:`pair_steps` shift 1) cut to the pairs holding a rank that
    failed every pass-1 test it was in (``first``); empty steps dropped. Every rank,
    given the same ``first``, plans the same."""
    left = _unresolved(world_size, first)
    steps = [[p for p in s if p[0] in left or p[1] in left] for s in pair_steps(world_size, 1)]
    return [s for s in steps if s]


# ------------------------------------------------------------------ judging


@dataclass(frozen=True)
class PairResult:
    """One pair test: the worse of its two ends' measurements.

    Attributes:
        latency_s: median round trip of 4 bytes, seconds.
        bandwidth_bps: 2 * size / the median round trip of ``size_bytes``, bytes/second.
        ok: both floors met.
    """

    latency_s: float
    bandwidth_bps: float
    ok: bool


def combine(
    steps: Sequence[Sequence[Pair]],
    measured: Sequence[Sequence[tuple[float, float]]],
    floors: Floors,
) -> dict[Pair, PairResult]:
    """The pair results of one pass from what every rank measured: ``measured[rank][step]``
    is ``(latency_s, bandwidth_bps)`` of its test in that step (negative: none); a
    pair's result is the worse of its ends (the longer latency, the lower bandwidth).

    Raises:
        NetcheckError: a rank missing, or one end of a planned pair reported nothing.
    """
    out: dict[Pair, PairResult] = {}
    for s, step in enumerate(steps):
        for a, b in step:
            if max(a, b) >= len(measured) or min(len(measured[a]), len(measured[b])) <= s:
                raise NetcheckError(f"no measurement of pair {(a, b)} in step {s}")
            (la, ba), (lb, bb) = measured[a][s], measured[b][s]
            if min(la, ba, lb, bb) < 0:
                raise NetcheckError(f"an end of pair {(a, b)} reported no measurement")
            lat, bw = max(la, lb), min(ba, bb)
            out[(a, b)] = PairResult(lat, bw, floors.met(lat, bw))
    return out


def _describe(peer: int, res: PairResult) -> str:
    return (
        f"with rank {peer}: latency {res.latency_s * 1e3:.3g} ms, "
        f"bandwidth {res.bandwidth_bps / 1e6:.4g} MB/s"
    )


def judge(world_size: int, results: Mapping[Pair, PairResult]) -> tuple[dict[int, str], str]:
    """Who is to blame for the failed pair tests ``results`` (both passes).

    A rank is bad when every test it was in failed and at least one of its peers passed
    a test with someone else (so that peer's link is fine; the fault is this rank's).
    Deterministic: every rank judges the same from the same results.

    Returns:
        ``(failed, inconclusive)``: the bad ranks, each with a reason naming its tests;
        and, when no rank is bad though a test failed, why no one could be judged (a
        world of 2: either end may be slow; every test failed: the network as a whole
        is slow, or no one is to blame; else the failed pairs). ``({}, "")``: every
        test passed.

    Raises:
        NetcheckError: a pair out of ``0..world_size-1`` or not lower rank first.
    """
    tests: dict[int, list[tuple[int, PairResult]]] = {}
    for (a, b), res in sorted(results.items()):
        if not 0 <= a < b < world_size:
            raise NetcheckError(f"pair {(a, b)} is not two ranks of a world of {world_size}")
        tests.setdefault(a, []).append((b, res))
        tests.setdefault(b, []).append((a, res))
    cleared = {r for r, ts in tests.items() if any(res.ok for _, res in ts)}
    failed: dict[int, str] = {}
    for rank in sorted(set(tests) - cleared):
        if any(peer in cleared for peer, _ in tests[rank]) and len(failed) < MAX_FAILED:
            said = "; ".join(_describe(p, res) for p, res in tests[rank])
            failed[rank] = clip(f"failed every pair test it was in ({said})", MAX_REASON)
    slow = sorted(p for p, res in results.items() if not res.ok)
    if failed or not slow:
        return failed, ""
    if world_size == 2:
        why = (
            "world size 2: the one link, between ranks 0 and 1, missed the floors "
            f"({_describe(1, results[(0, 1)])}); either end may be the slow one"
        )
    elif not cleared:
        why = (
            f"every pair test ({len(slow)}) missed the floors: the network as a whole is "
            "slow (or the floors too high); no node is to blame"
        )
    else:
        why = (
            f"pair tests {', '.join(map(str, slow))} missed the floors, but no rank failed "
            "every test it was in against a peer that passed another: a link may be slow, "
            "not a node"
        )
    return {}, clip(why, MAX_INCONCLUSIVE)
