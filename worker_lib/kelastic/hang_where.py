"""Where each worker of a node was when a round hung: the one codec of the sidecar's
``/status`` ``hang_evidence`` (written by its attempt monitor before it stops the workers
of a hung round, read by ``kelastic run``), and the one line that says it.

A hang is declared on one node (a timer expired, a worker stopped), but the ranks of
every node hold part of the story: the stopped one, and those waiting for it in a
collective. Each node's sidecar reads its own workers' stacks as the hung round ends
(``py-spy``; the reaped ones' were read by their reap) and publishes them here.

Strict for the writer (texts cut to :data:`MAX_TEXT` characters, at most
:data:`MAX_RANKS` ranks); the reader takes any JSON and returns None for what no writer
could produce (it only reports).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

__all__ = ["MAX_RANKS", "MAX_TEXT", "HangWhere", "RankWhere", "decode_where"]

#: Most ranks one node reports (a node's local world).
MAX_RANKS: Final = 1024
#: Most characters of a state or a location (a path and a function name).
MAX_TEXT: Final = 1024
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
    """

    rank: int
    local_rank: int
    pid: int
    state: str
    reaped: bool
    where: str

    def describe(self) -> str:
        """``rank 2 (stopped): main thread at /w/train.py:231 in _epochs (stacks in ...)``."""
        if self.state in ("T", "t"):
            how = "stopped"
        elif self.reaped:
            how = "reaped"
        else:
            how = f"state {self.state}" if self.state else "gone"
        return f"rank {self.rank} ({how}): {self.where}"


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
                    r.rank, r.local_rank, r.pid, r.state[:MAX_TEXT], r.reaped, r.where[:MAX_TEXT]
                )
                for r in self.ranks[:MAX_RANKS]
            ),
        )

    def line(self) -> str:
        """Each rank's :meth:`RankWhere.describe`, joined by ``; ``."""
        return "; ".join(r.describe() for r in self.ranks) or "no workers"

    def as_dict(self) -> dict[str, Any]:
        """The ``/status`` form: ``{"round", "node", "ranks": [{...}]}``."""
        return {"round": self.round, "node": self.node, "ranks": [asdict(r) for r in self.ranks]}


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
        if None in ints or state is None or where is None or type(reaped) is not bool:
            return None
        rank, local_rank, pid = (int(i) for i in ints if i is not None)
        out.append(RankWhere(rank, local_rank, pid, state, reaped, where))
    return HangWhere(round_, node, tuple(out))
