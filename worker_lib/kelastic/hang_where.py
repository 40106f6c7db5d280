"""Where each worker of a node was when a round hung: the one codec of the sidecar's
``/status`` ``hang_evidence`` (written by its attempt monitor before it stops the workers
of a hung round, read by ``kelastic run``), and the one line that says it.

A hang is declared on one node (a timer expired, a worker stopped), but the ranks of
every node hold part of the story: the stopped one, and those waiting for it in a
collective. Each node's sidecar reads its own workers' stacks as the hung round ends
(``py-spy``; the reaped ones' were read by their reap) and publishes them here, and in
etcd for the operator (:mod:`kelastic.etcd_values.hangs`), which puts every node's
together with :func:`summarize`: which rank held things up, and where the rest waited.

Strict for the writer (texts cut to :data:`MAX_TEXT` characters, at most
:data:`MAX_RANKS` ranks); the reader takes any JSON and returns None for what no writer
could produce (it only reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from kelastic.flight_recorder import Collective, decode_collectives

__all__ = [
    "MAX_RANKS",
    "MAX_RANK_GROUPS",
    "MAX_SUMMARY",
    "MAX_TEXT",
    "HangWhere",
    "RankWhere",
    "decode_where",
    "summarize",
]

#: Most ranks one node reports (a node's local world).
MAX_RANKS: Final = 1024
#: Most characters of a state or a location (a path and a function name).
MAX_TEXT: Final = 1024
#: Most process groups' collectives one rank reports (those it is in first).
MAX_RANK_GROUPS: Final = 4
#: Most characters of a :func:`summarize` line (the job's status and its Event).
MAX_SUMMARY: Final = 2048
_MAX_INT: Final = 2**31 - 1


@dataclass(frozen=True)
class RankWhere:
    """One worker as its hung round ended.

    Attributes:
        rank: its global rank.
        local_rank: its local rank.
        pid: its pid.
        state: its process state letter (``/proc/<pid>/stat``: ``T`` stopped, ``S``
            sleeping, e.g. waiting in a collective, ``R`` running); ``""`` when gone.
        reaped: killed by the timer server or the in-process hard timeout for this hang.
        where: its main thread's innermost user frame and the dump's path (``main thread
            at <file>:<line> in <function> (stacks in <path>)``), or why there is none.
        collectives: from its flight record (:mod:`kelastic.flight_recorder`), the newest
            collective it entered per process group, at most :data:`MAX_RANK_GROUPS`;
            empty when it had no record (the job did not turn torch's recorder on, the
            worker was stopped, ...).
    """

    rank: int
    local_rank: int
    pid: int
    state: str
    reaped: bool
    where: str
    collectives: tuple[Collective, ...] = ()

    @property
    def stopped(self) -> bool:
        """Its process was stopped (``T``: job control, ``t``: a tracer)."""
        return self.state in ("T", "t")

    @property
    def how(self) -> str:
        """``stopped``, ``reaped``, ``state S`` or ``gone``."""
        if self.stopped:
            return "stopped"
        if self.reaped:
            return "reaped"
        return f"state {self.state}" if self.state else "gone"

    @property
    def location(self) -> str:
        """:attr:`where` without its ``(stacks in ...)`` part: ranks at one frame share it."""
        return self.where.split(" (stacks in ", 1)[0]

    @property
    def inside(self) -> tuple[str, ...]:
        """The collectives its flight record says it is in (entered, not done):
        ``gloo:all_reduce #5 of default_pg``."""
        return tuple(f"{c.name} #{c.seq} of {c.group}" for c in self.collectives if not c.done)

    def describe(self) -> str:
        """``rank 2 (stopped): main thread at /w/train.py:231 in _epochs (stacks in ...)``,
        then `` [in gloo:all_reduce #5 of default_pg]`` when its record says so."""
        inside = f" [in {', '.join(self.inside)}]" if self.inside else ""
        return f"rank {self.rank} ({self.how}): {self.where}{inside}"


@dataclass(frozen=True)
class HangWhere:
    """Where each worker of ``node`` was when ``round`` hung (ranks in local-rank order)."""

    round: int
    node: str
    ranks: tuple[RankWhere, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "node", self.node[:MAX_TEXT])
        object.__setattr__(
            self,
            "ranks",
            tuple(
                RankWhere(
                    r.rank,
                    r.local_rank,
                    r.pid,
                    r.state[:MAX_TEXT],
                    r.reaped,
                    r.where[:MAX_TEXT],
                    tuple(sorted(r.collectives, key=lambda c: c.done))[:MAX_RANK_GROUPS],
                )
                for r in self.ranks[:MAX_RANKS]
            ),
        )

    def line(self) -> str:
        """Each rank's :meth:`RankWhere.describe`, joined by ``; ``."""
        return "; ".join(r.describe() for r in self.ranks) or "no workers"

    def as_dict(self) -> dict[str, Any]:
        """The ``/status`` form: ``{"round", "node", "ranks": [{...}]}``."""
        ranks = [
            {**asdict(r), "collectives": [asdict(c) for c in r.collectives]} for r in self.ranks
        ]
        return {"round": self.round, "node": self.node, "ranks": ranks}


def _int(value: object) -> int | None:
    ok = type(value) is int and 0 <= value <= _MAX_INT  # bool is not an int here
    return value if ok else None  # type: ignore[return-value]


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and len(value) <= MAX_TEXT else None


def decode_where(doc: object) -> HangWhere | None:
    """A ``/status`` ``hang_evidence`` document back (:meth:`HangWhere.as_dict`'s form);
    None when absent or not what a writer produces (a field missing, of another type or
    out of bounds, too many ranks). Never raises."""
    if not isinstance(doc, dict):
        return None
    round_, node, ranks = _int(doc.get("round")), _text(doc.get("node")), doc.get("ranks")
    if round_ is None or node is None or not isinstance(ranks, list) or len(ranks) > MAX_RANKS:
        return None
    out: list[RankWhere] = []
    for item in ranks:
        if not isinstance(item, dict):
            return None
        ints = [_int(item.get(k)) for k in ("rank", "local_rank", "pid")]
        state, where, reaped = (
            _text(item.get("state")),
            _text(item.get("where")),
            item.get("reaped"),
        )
        collectives = decode_collectives(item.get("collectives", []), MAX_RANK_GROUPS)
        if None in ints or state is None or where is None or type(reaped) is not bool:
            return None
        if collectives is None:
            return None
        rank, local_rank, pid = (int(i) for i in ints if i is not None)
        out.append(RankWhere(rank, local_rank, pid, state, reaped, where, collectives))
    return HangWhere(round_, node, tuple(out))


def _who(members: Sequence[tuple[str, RankWhere]]) -> str:
    """``ranks 0, 1 on job-0 and rank 3 on job-1`` (nodes in order of first mention)."""
    by_node: dict[str, list[int]] = {}
    for node, rank in members:
        by_node.setdefault(node, []).append(rank.rank)
    return " and ".join(
        f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, sorted(ranks)))} on {node}"
        for node, ranks in by_node.items()
    )


def _groups(members: Sequence[tuple[str, RankWhere]]) -> list[str]:
    """The ranks grouped by where they were, the smallest group first:
    ``<who> (<how>[, <how>]): <location>[ [in <collective>]]``."""
    groups: dict[str, list[tuple[str, RankWhere]]] = {}
    for node, rank in members:
        groups.setdefault(rank.location, []).append((node, rank))
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[0]))
    return [
        f"{_who(m)} ({', '.join(sorted({r.how for _, r in m}))}): {loc}{_inside(m)}"
        for loc, m in ordered
    ]


def _inside(members: Sequence[tuple[str, RankWhere]]) -> str:
    """`` [in gloo:all_reduce #5 of default_pg]``: the collectives the ranks' flight
    records say they are in (entered, not done); ``""`` when none."""
    pending = sorted({inside for _, r in members for inside in r.inside})
    return f" [in {', '.join(pending)}]" if pending else ""


def _behind(
    members: Sequence[tuple[str, RankWhere]],
) -> tuple[list[tuple[str, RankWhere]], str] | None:
    """By the flight records: the ranks that never entered the newest collective their
    peers of a process group entered (a lower ``seq`` in that group), and that
    collective's description; None when the records name nobody (fewer than two ranks
    with records, or all of a group's ranks at its newest collective)."""
    newest: dict[str, Collective] = {}
    for _, rank in members:
        for c in rank.collectives:
            if c.group not in newest or c.seq > newest[c.group].seq:
                newest[c.group] = c
    for group, top in newest.items():
        holders = [m for m in members if any(c.group == group for c in m[1].collectives)]
        late = [m for m in holders if any(c.group == group and c.seq < top.seq
                                          for c in m[1].collectives)]  # fmt: skip
        if late and len(holders) >= 2:
            return late, f"{top.name} #{top.seq} of {group}"
    return None


def summarize(wheres: Sequence[HangWhere]) -> str:
    """One line for every node's evidence of the newest hung round among ``wheres``:
    which ranks held things up, and where the rest waited, e.g.
    ``hang in round 3 (2 nodes reported): culprit: rank 2 on job-1 (stopped): main thread
    at /w/train.py:231 in _epochs; waiting: ranks 0, 1 on job-0 and rank 3 on job-1
    (reaped): main thread at /w/train.py:94 in _wait_for_peers``.

    The culprit is named from the evidence alone: the stopped ranks; else the ranks whose
    flight records say they never entered the newest collective their peers of a
    process group entered; else, when more than half of the ranks are at one place (the
    collective the others wait in), the ranks that are not; else the summary says it is
    inconclusive and lists every place.
    At most :data:`MAX_SUMMARY` characters (cut with ``...``); ``""`` for no evidence.
    """
    if not wheres:
        return ""
    newest = max(w.round for w in wheres)
    docs = sorted((w for w in wheres if w.round == newest), key=lambda w: w.node)
    members = [(w.node, r) for w in docs for r in w.ranks]
    head = f"hang in round {newest} ({len(docs)} node{'s' if len(docs) != 1 else ''} reported)"
    places: dict[str, int] = {}
    for _, rank in members:
        places[rank.location] = places.get(rank.location, 0) + 1
    crowd = max(places, key=lambda loc: places[loc]) if places else ""
    behind = _behind(members)
    if any(r.stopped for _, r in members):
        culprits = [m for m in members if m[1].stopped]
    elif behind is not None:
        culprits = behind[0]
    elif places and len(members) / 2 < places[crowd] < len(members):
        culprits = [m for m in members if m[1].location != crowd]
    else:
        culprits = []
    if culprits:
        rest = [m for m in members if m not in culprits]
        parts = ["culprit: " + "; ".join(_groups(culprits))]
        if behind is not None and culprits == behind[0]:
            parts[0] += f" (flight records: not in {behind[1]}, which the others entered)"
        if rest:
            parts.append("waiting: " + "; ".join(_groups(rest)))
    elif members:
        parts = ["inconclusive (no rank stopped, no lone place): " + "; ".join(_groups(members))]
    else:
        parts = ["no workers"]
    line = f"{head}: " + "; ".join(parts)
    return line if len(line) <= MAX_SUMMARY else line[: MAX_SUMMARY - 3] + "..."
