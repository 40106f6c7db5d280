"""A node's committed checkpoint steps at :meth:`kelastic.contract.Keys.checkpoint`:
bytes <-> :class:`CheckpointsDoc`, and the job's restorable step (pure, stdlib only).

Over ~400 lines because the record's codec and the agreement computed from it are one
contract: every sidecar and the operator must compute the same step and tier from the
same decoded records, so the rules live beside the one codec they read.

Each node's sidecar writes, before it joins a rendezvous round (its workers stopped, so
its slots hold still), the steps of ``kelastic.checkpoint`` that each global rank of its
slot folder has committed *and* that pass their checksums::

    {"version": 4, "job": "<run id>", "ranks": {"0": [12, 11], "1": [12, 11]},
     "replicas": {"2": [12, 10]}, "endpoint": "10.0.3.7:29610", "token": "<hex>",
     "unfetchable": [20], "domain": "eu-west-1a", "persisted": [[10, 4], [5, 4]],
     "time": 1764190000.5}

``persisted``: the job's steps complete on its persistence volume
(``spec.checkpoint.persist``, :mod:`kelastic.checkpoint.persist`) as the node saw them,
each with the world size it was saved in, newest first. ``replicas``: the verified steps
of other nodes' ranks this node holds as replicas (``spec.checkpoint.replicas``; the
peer tier), served to the job's other sidecars at ``endpoint`` (``host:port``; ``""``:
none) to a request carrying ``token``. ``unfetchable``: the steps this node could not
get from any peer that listed them in an earlier round (a port the network refuses, a
transport that keeps corrupting): no round restores them from a peer again, so a fault
that repeats costs one round, not every round until the restart budget is spent (the
step after it goes to disk or an older step: "a checksum mismatch drops to the next
tier"). ``domain``: the node's failure domain (its Node's ``topology.kubernetes.io/zone``;
``""``: unknown), so that a node's replicas go to a peer in another zone where the
round allows (``kelastic_sidecar.replication.ring_order``). Versions 1 (no
``persisted``), 2 (no ``replicas``, ``endpoint``, ``token``) and 3 (no ``unfetchable``,
``domain``) are still read, as records that hold none.

Once the round is complete, every sidecar reads its participants' records and agrees on
:func:`restore_of`: from memory, :func:`restorable_step`, the highest step that the node
now running each rank of the new world committed for that rank (the process-restart rung
restores from the node's own slots, so a rank whose node changed holds nothing yet); from
disk, :func:`persisted_step`, the highest step every participant saw complete, saved by
a world at least as large as the round's (rank ``r`` loads the step's ``rank-<r>``);
from a peer, :func:`peer_step`, the highest step that *some* participant holds for each
rank (in its slots or as a replica), the ranks whose node holds none fetching it before
they start (:func:`peer_sources`); the newest of the three, memory before peer before disk
when equal (fastest first). Every node computes the same value
from the same records; no step in common makes it None (the user's own fallback, for
every rank alike: never a mixed step or tier).

With a *replicated* state (``spec.checkpoint.stateLayout: Replicated``: every rank saves
the same state, as under DDP) any rank's copy of a step serves every rank, so a world
that grew or was renumbered still restores: from memory, :func:`replicated_step`, the
highest step every participant holds for some rank (its ranks missing it take a copy of
one on the node); from a peer, the highest step every participant holds or some serving
participant does (:func:`replicated_sources`); from disk, a persisted step whatever
world saved it.

Bounds (writer and reader alike): at most :data:`MAX_CHECKPOINTS_BYTES` bytes; ``job``
a name (1..1024 characters); at most :data:`MAX_LOCAL_RANKS` ranks, each a decimal
global rank in 0..:data:`MAX_RANK` with at most :data:`MAX_SLOTS` distinct steps (a rank's slots)
in 0..:data:`MAX_STEP`, newest first (``replicas`` alike); at most :data:`MAX_PERSISTED`
persisted steps, distinct, newest first, each with a world size in 1..:data:`MAX_RANK` + 1;
at most :data:`MAX_UNFETCHABLE` ``unfetchable`` steps, distinct, newest first; ``domain``
empty or a label value (:data:`MAX_DOMAIN` characters of ``[A-Za-z0-9._-]``, alphanumeric
at both ends);
``endpoint`` empty or ``host:port`` (at most :data:`MAX_ENDPOINT` characters, no spaces,
port 1..65535); ``token`` empty or 16..128 lower-case hex digits; ``time`` seconds since
the epoch.
"""

from __future__ import annotations

import enum
import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kelastic._safejson import is_int, load_object

from ._fields import CorruptValueError, ForeignValueError, is_name, is_time

__all__ = [
    "CHECKPOINTS_VERSION",
    "MAX_CHECKPOINTS_BYTES",
    "MAX_DOMAIN",
    "MAX_ENDPOINT",
    "MAX_LOCAL_RANKS",
    "MAX_PERSISTED",
    "MAX_SLOTS",
    "MAX_STEP",
    "CheckpointsDoc",
    "Restore",
    "RestoreTier",
    "decode_checkpoints",
    "encode_checkpoints",
    "is_domain",
    "parse_endpoint",
    "peer_sources",
    "peer_step",
    "persisted_step",
    "replicated_sources",
    "replicated_step",
    "restorable_step",
    "restore_of",
    "unfetchable",
]

CHECKPOINTS_VERSION: Final = 4
#: Largest record accepted, bytes.
MAX_CHECKPOINTS_BYTES: Final = 256 * 1024
#: Most ranks one node's record holds (its slot folder's ranks).
MAX_LOCAL_RANKS: Final = 4096
#: Highest global rank, and highest step (as ``kelastic.checkpoint.slot_format``).
MAX_RANK: Final = 2**31 - 2
MAX_STEP: Final = 2**53
#: Most steps a rank's record lists: its slots (``kelastic.checkpoint.store.SLOTS``).
MAX_SLOTS: Final = 3
#: Most persisted steps a record lists (the newest; ``persist.keep`` keeps fewer by default).
MAX_PERSISTED: Final = 16
#: Most ``unfetchable`` steps a record lists (the newest).
MAX_UNFETCHABLE: Final = 16
#: Longest ``domain``, characters (a Kubernetes label value).
MAX_DOMAIN: Final = 63
#: Longest ``endpoint``, characters (a DNS name of 253 and a port).
MAX_ENDPOINT: Final = 260
_FIELDS: Final = {
    1: frozenset({"version", "job", "ranks", "time"}),
    2: frozenset({"version", "job", "ranks", "persisted", "time"}),
    3: frozenset({"version", "job", "ranks", "replicas", "endpoint", "token", "persisted", "time"}),
    4: frozenset(
        {
            "version",
            "job",
            "ranks",
            "replicas",
            "endpoint",
            "token",
            "unfetchable",
            "domain",
            "persisted",
            "time",
        }
    ),
}
_TOKEN: Final = re.compile(r"[0-9a-f]{16,128}")
_DOMAIN: Final = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")


class RestoreTier(enum.StrEnum):
    """Where a round's workers restore their state from (``status.lastCheckpoint.tier``,
    the sidecar's ``kelastic_checkpoint_restores_total{tier}``)."""

    #: Every rank from its own node's slots (the process-restart rung).
    MEMORY = "memory"
    #: The ranks whose node holds the step from a node that does, the others from their
    #: own slots: a replica of another node (``spec.checkpoint.replicas``), or the slots
    #: of a node that ran the rank before (a Pod replaced, a node lost, ranks renumbered).
    PEER = "peer"
    #: Every rank from the job's persistence volume (torch DCP's format): no step every
    #: rank holds in memory is as new (a Pod replaced, a node lost, the job restarted).
    DISK = "disk"
    #: No step every rank holds: the workers start without one (their own fallback).
    NONE = "none"


@dataclass(frozen=True)
class Restore:
    """What a round's workers restore (:func:`restore_of`).

    Attributes:
        round: the rendezvous round.
        step: the step every rank loads; None with :attr:`RestoreTier.NONE`.
        tier: where from.
        ranks: the round's world size.
        held: whether some rank's node recorded some step of the job (False on a fresh
            start: nothing was lost).
        time: when the newest of the participants' records was written, seconds since
            the epoch (0.0: none was).
    """

    round: int
    step: int | None
    tier: RestoreTier
    ranks: int
    held: bool
    time: float = 0.0


@dataclass(frozen=True)
class CheckpointsDoc:
    """One node's committed, verified steps.

    Attributes:
        job: the run id (``TORCHELASTIC_RUN_ID``) the slots were saved under.
        ranks: global rank -> its committed steps, newest first (at most
            :data:`MAX_SLOTS`).
        time: when the sidecar read its slots, seconds since the epoch.
        persisted: ``(step, world size)`` of the job's steps complete on its persistence
            volume, newest first (at most :data:`MAX_PERSISTED`; empty without one).
        replicas: global rank of another node -> the verified steps this node holds as
            its replicas, newest first.
        endpoint: ``host:port`` where this node's sidecar serves its slots and replicas
            (``""``: it serves none).
        token: what a request to ``endpoint`` must carry (``""`` with no endpoint).
        unfetchable: steps this node could not get from any peer in an earlier round,
            newest first (at most :data:`MAX_UNFETCHABLE`): never the peer tier's again.
        domain: the node's failure domain (its zone; ``""``: unknown).
    """

    job: str
    ranks: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    time: float = 0.0
    persisted: tuple[tuple[int, int], ...] = ()
    replicas: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    endpoint: str = ""
    token: str = ""
    unfetchable: tuple[int, ...] = ()
    domain: str = ""


def _check(doc: Any, where: str) -> CheckpointsDoc:
    def bad(what: str) -> CorruptValueError:
        return CorruptValueError(f"corrupt checkpoint record at {where}: {what}")

    if not isinstance(doc, dict):
        raise bad(f"fields {type(doc).__name__}")
    version = doc.get("version")
    if not is_int(version, 0, 2**31):
        raise bad("bad version")
    if version not in _FIELDS:
        raise ForeignValueError(
            f"checkpoint record at {where} has version {version}, "
            f"this kelastic reads {', '.join(map(str, _FIELDS))}"
        )
    if set(doc) != _FIELDS[version]:
        raise bad(f"fields {sorted(doc)}")
    if not is_name(doc["job"]):
        raise bad("bad job")
    if not is_time(doc["time"]):
        raise bad("bad time")
    endpoint, token = doc.get("endpoint", ""), doc.get("token", "")
    if not (isinstance(endpoint, str) and (endpoint == "" or parse_endpoint(endpoint))):
        raise bad(f"endpoint {endpoint!r:.60} is not host:port")
    if not (isinstance(token, str) and (token == "" or _TOKEN.fullmatch(token))):
        raise bad("token is not 16..128 hex digits")
    if bool(endpoint) != bool(token):
        raise bad("an endpoint needs a token and a token an endpoint")
    domain = doc.get("domain", "")
    if not is_domain(domain):
        raise bad(f"domain {domain!r:.80} is not a label value")
    return CheckpointsDoc(
        doc["job"],
        _steps_by_rank(doc["ranks"], "ranks", bad),
        float(doc["time"]),
        _persisted(doc.get("persisted", []), bad),
        _steps_by_rank(doc.get("replicas", {}), "replicas", bad),
        endpoint,
        token,
        _unfetchable(doc.get("unfetchable", []), bad),
        domain,
    )


def _unfetchable(value: Any, bad: Callable[[str], CorruptValueError]) -> tuple[int, ...]:
    """The ``unfetchable`` field: distinct steps, newest first."""
    if not (isinstance(value, list) and len(value) <= MAX_UNFETCHABLE
            and all(is_int(s, 0, MAX_STEP) for s in value)):  # fmt: skip
        raise bad(f"unfetchable is not a list of at most {MAX_UNFETCHABLE} steps")
    if any(a <= b for a, b in itertools.pairwise(value)):
        raise bad("unfetchable steps are not distinct, newest first")
    return tuple(value)


def is_domain(value: object) -> bool:
    """Whether ``value`` is a record's ``domain``: ``""`` or a Kubernetes label value
    (at most :data:`MAX_DOMAIN` characters)."""
    return isinstance(value, str) and _DOMAIN.fullmatch(value) is not None


def parse_endpoint(value: str) -> tuple[str, int] | None:
    """``(host, port)`` of a record's ``endpoint`` (``host:port``, ``[v6]:port``), or None
    when it is not one (empty host, spaces or control characters, a port outside
    1..65535, more than :data:`MAX_ENDPOINT` characters)."""
    if not (0 < len(value) <= MAX_ENDPOINT and value.isascii() and value.isprintable()):
        return None
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not (sep and host and " " not in host and port.isdigit() and len(port) <= 5):
        return None
    number = int(port)
    return (host, number) if 0 < number < 65536 and port == str(number) else None


def _steps_by_rank(
    ranks: Any, name: str, bad: Callable[[str], CorruptValueError]
) -> dict[int, tuple[int, ...]]:
    """``ranks`` or ``replicas``: decimal global rank -> distinct steps, newest first."""
    if not isinstance(ranks, dict) or len(ranks) > MAX_LOCAL_RANKS:
        raise bad(f"{name} is not an object of at most {MAX_LOCAL_RANKS} ranks")
    out: dict[int, tuple[int, ...]] = {}
    for key, steps in ranks.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad(f"{name}: rank {key!r:.40} is not a decimal rank")
        rank = int(key)
        if rank > MAX_RANK or key != str(rank):
            raise bad(f"{name}: rank {key!r:.40} is out of range")
        if not isinstance(steps, list) or len(steps) > MAX_SLOTS:
            raise bad(f"{name}: rank {rank}: steps is not a list of at most {MAX_SLOTS}")
        if not all(is_int(s, 0, MAX_STEP) for s in steps):
            raise bad(f"{name}: rank {rank}: a step outside 0..{MAX_STEP}")
        if any(a <= b for a, b in itertools.pairwise(steps)):
            raise bad(f"{name}: rank {rank}: steps {steps} are not distinct, newest first")
        out[rank] = tuple(steps)
    return out


def _persisted(value: Any, bad: Callable[[str], CorruptValueError]) -> tuple[tuple[int, int], ...]:
    """The ``persisted`` field: ``[[step, world size], ...]``, distinct steps newest first."""
    if not isinstance(value, list) or len(value) > MAX_PERSISTED:
        raise bad(f"persisted is not a list of at most {MAX_PERSISTED}")
    out: list[tuple[int, int]] = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and is_int(item[0], 0, MAX_STEP)
                and is_int(item[1], 1, MAX_RANK + 1)):  # fmt: skip
            raise bad(f"persisted {item!r:.60} is not [step, world size]")
        out.append((item[0], item[1]))
    if any(a[0] <= b[0] for a, b in itertools.pairwise(out)):
        raise bad("persisted steps are not distinct, newest first")
    return tuple(out)


def decode_checkpoints(raw: bytes, where: str) -> CheckpointsDoc:
    """Parse a node's checkpoint record (bounded, :func:`kelastic._safejson.load_object`).

    Args:
        raw: the bytes read from etcd.
        where: the etcd key, for the message.

    Raises:
        CorruptValueError: outside the module's bounds (not bounded JSON, a missing or
            unknown field, a bad rank or step, steps not newest first).
        ForeignValueError: another version of the record.
    """
    doc = load_object(raw, f"corrupt checkpoint record at {where}",
                      max_bytes=MAX_CHECKPOINTS_BYTES, error=CorruptValueError)  # fmt: skip
    return _check(doc, where)


def encode_checkpoints(doc: CheckpointsDoc) -> bytes:
    """The record of ``doc`` (ranks in increasing order).

    Raises:
        CorruptValueError: outside :func:`decode_checkpoints`'s bounds (strict: nothing
            written is refused when read).
    """
    value = {
        "version": CHECKPOINTS_VERSION,
        "job": doc.job,
        "ranks": {str(r): list(doc.ranks[r]) for r in sorted(doc.ranks)},
        "replicas": {str(r): list(doc.replicas[r]) for r in sorted(doc.replicas)},
        "endpoint": doc.endpoint,
        "token": doc.token,
        "unfetchable": list(doc.unfetchable),
        "domain": doc.domain,
        "persisted": [list(p) for p in doc.persisted],
        "time": doc.time,
    }
    raw = json.dumps(value, separators=(",", ":")).encode()
    if len(raw) > MAX_CHECKPOINTS_BYTES:
        raise CorruptValueError(f"a checkpoint record of {len(raw)} bytes is too large")
    _check(json.loads(raw), "the checkpoint record to write")
    return raw


def restorable_step(records: Mapping[str, CheckpointsDoc | None], participants: Sequence[str],
                    nproc: int, job: str) -> int | None:  # fmt: skip
    """The step every rank of the round can restore from its own node's slots.

    Rank ``r`` of the round runs on ``participants[r // nproc]`` (group rank order,
    ``nproc`` workers per node, as ``kelastic_sidecar.assignment``); the result is the
    highest step that every rank's node recorded for that rank under ``job``.

    Args:
        records: node name -> its decoded record, or None (missing or corrupt).
        participants: the round's nodes, ordered by group rank.
        nproc: workers per node (>= 1).
        job: the run id; a record of another run counts as none.

    Returns:
        The step, or None when some rank has no step in common with the others (or
        there are no ranks).

    Raises:
        ValueError: ``nproc`` < 1.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    common: set[int] | None = None
    for group_rank, node in enumerate(participants):
        doc = records.get(node)
        for local_rank in range(nproc):
            rank = group_rank * nproc + local_rank
            steps = set(doc.ranks.get(rank, ())) if doc is not None and doc.job == job else set()
            common = steps if common is None else common & steps
            if not common:
                return None
    return max(common) if common else None


def persisted_step(records: Mapping[str, CheckpointsDoc | None], participants: Sequence[str],
                   nproc: int, job: str, *, replicated: bool = False) -> int | None:  # fmt: skip
    """The step every rank of the round can restore from the job's persistence volume:
    the highest step that every participant's record (of ``job``) lists as persisted,
    saved by a world of at least ``len(participants) * nproc`` ranks (rank ``r`` loads
    the step's ``rank-<r>``), or by any world when the state is ``replicated`` (rank
    ``r`` loads ``rank-<r mod W>`` of a world of ``W``). None when there is none or no
    participants.

    Raises:
        ValueError: ``nproc`` < 1.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    world = len(participants) * nproc
    common: set[int] | None = None
    for node in participants:
        doc = records.get(node)
        seen = doc.persisted if doc is not None and doc.job == job else ()
        steps = {step for step, saved_by in seen if replicated or saved_by >= world}
        common = steps if common is None else common & steps
        if not common:
            return None
    return max(common) if common else None


def _held_for(records: Mapping[str, CheckpointsDoc | None], participants: Sequence[str],
              job: str, rank: int, runner: str) -> set[int]:  # fmt: skip
    """The steps of ``rank`` that its ``runner`` holds (in its slots or as a replica) or
    that another participant holds and can serve (its record has an endpoint)."""
    steps: set[int] = set()
    for node in participants:
        doc = records.get(node)
        if doc is not None and doc.job == job and (node == runner or doc.endpoint):
            steps.update(doc.ranks.get(rank, ()))
            steps.update(doc.replicas.get(rank, ()))
    return steps


def peer_step(records: Mapping[str, CheckpointsDoc | None], participants: Sequence[str],
              nproc: int, job: str) -> int | None:  # fmt: skip
    """The highest step that, for every rank of the round, the rank's node holds (in its
    slots or as a replica) or another participant of ``job`` can serve it (its record
    has an ``endpoint``; :func:`peer_sources` says which); same arguments and errors as
    :func:`restorable_step`, whose steps it includes. None when some rank has no step in
    common with the others. Without replication (no endpoints, no replicas) it is
    :func:`restorable_step`. A step some participant lists ``unfetchable`` is never it."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    common: set[int] | None = None
    for group_rank, runner in enumerate(participants):
        for local_rank in range(nproc):
            steps = _held_for(records, participants, job, group_rank * nproc + local_rank,
                              runner)  # fmt: skip
            common = steps if common is None else common & steps
            if not common:
                return None
    return max((common or set()) - unfetchable(records, participants, job), default=None)


def unfetchable(records: Mapping[str, CheckpointsDoc | None], participants: Sequence[str],
                job: str) -> set[int]:  # fmt: skip
    """The steps some participant's record of ``job`` lists as ``unfetchable``: the peer
    tier never restores them."""
    return {step for node in participants if (d := records.get(node)) is not None
            and d.job == job for step in d.unfetchable}  # fmt: skip


def peer_sources(records: Mapping[str, CheckpointsDoc | None], participants: Sequence[str],
                 job: str, rank: int, step: int) -> list[tuple[str, CheckpointsDoc]]:  # fmt: skip
    """The participants that hold ``step`` of ``rank`` for ``job`` and can serve it, each
    with its record: those holding it in their slots first (the rank's own writer made
    them), then as a replica, each in group-rank order; a node whose record has no
    ``endpoint`` is left out (it serves nobody; the caller copies its own replica
    itself)."""
    own: list[tuple[str, CheckpointsDoc]] = []
    replica: list[tuple[str, CheckpointsDoc]] = []
    for node in participants:
        doc = records.get(node)
        if doc is None or doc.job != job or not doc.endpoint:
            continue
        if step in doc.ranks.get(rank, ()):
            own.append((node, doc))
        elif step in doc.replicas.get(rank, ()):
            replica.append((node, doc))
    return own + replica


def _any_rank(doc: CheckpointsDoc | None, job: str) -> set[int]:
    """Every step ``doc`` (of ``job``) holds for any rank, in its slots or as a replica."""
    if doc is None or doc.job != job:
        return set()
    return {step for held in (doc.ranks, doc.replicas) for steps in held.values()
            for step in steps}  # fmt: skip


def replicated_step(records: Mapping[str, CheckpointsDoc | None], participants: Sequence[str],
                    job: str, *, served: bool = False) -> int | None:  # fmt: skip
    """The newest step of a replicated state (every rank saves the same state) that every
    participant holds for *some* rank, in its slots or as a replica: each of its ranks
    restores from a copy on its own node, whatever ranks the node ran before. With
    ``served``, a step some participant that serves (its record has an ``endpoint``)
    holds counts for every participant too: those without it fetch a copy
    (:func:`replicated_sources`), but not one a participant lists ``unfetchable``. None
    when there is none or no participants.

    Args:
        records: node name -> its decoded record, or None (missing or corrupt).
        participants: the round's nodes.
        job: the run id; a record of another run counts as none.
        served: count the steps participants serve to the others (the peer tier).
    """
    offered: set[int] = set()
    if served:
        for node in participants:
            doc = records.get(node)
            if doc is not None and doc.endpoint:
                offered |= _any_rank(doc, job)
        offered -= unfetchable(records, participants, job)
    common: set[int] | None = None
    for node in participants:
        steps = _any_rank(records.get(node), job) | offered
        common = steps if common is None else common & steps
        if not common:
            return None
    return max(common) if common else None


def replicated_sources(records: Mapping[str, CheckpointsDoc | None],
                       participants: Sequence[str], job: str,
                       step: int) -> list[tuple[str, CheckpointsDoc, int]]:  # fmt: skip
    """Where a node gets ``step`` of a replicated state it does not hold: each serving
    participant (its record has an ``endpoint``) with its record and the lowest rank
    whose copy it holds, in its slots before as a replica, in group-rank order."""
    own: list[tuple[str, CheckpointsDoc, int]] = []
    replica: list[tuple[str, CheckpointsDoc, int]] = []
    for node in participants:
        doc = records.get(node)
        if doc is None or doc.job != job or not doc.endpoint:
            continue
        in_slots = sorted(r for r, steps in doc.ranks.items() if step in steps)
        in_replicas = sorted(r for r, steps in doc.replicas.items() if step in steps)
        if in_slots:
            own.append((node, doc, in_slots[0]))
        elif in_replicas:
            replica.append((node, doc, in_replicas[0]))
    return own + replica


def restore_of(round_: int, records: Mapping[str, CheckpointsDoc | None],
               participants: Sequence[str], nproc: int, job: str, *,
               replicated: bool = False) -> Restore:  # fmt: skip
    """The round's :class:`Restore`: the newest of :func:`restorable_step` (memory),
    :func:`peer_step` (peer) and :func:`persisted_step` (disk) of ``records`` (same
    arguments, same errors), memory before peer before disk when equal (the fastest),
    with where from, how many ranks, whether anything was held and when the records were
    written. Every sidecar and the operator compute the same one from the same records.
    With ``replicated`` (``spec.checkpoint.stateLayout: Replicated``) the three are
    :func:`replicated_step`, the same with the served steps, and :func:`persisted_step`
    of any world."""
    if replicated:
        memory = replicated_step(records, participants, job)
        peer = replicated_step(records, participants, job, served=True)
    else:
        memory = restorable_step(records, participants, nproc, job)
        peer = peer_step(records, participants, nproc, job)
    disk = persisted_step(records, participants, nproc, job, replicated=replicated)
    newest = max((s for s in (memory, peer, disk) if s is not None), default=None)
    if newest is None:
        step, tier = None, RestoreTier.NONE
    elif memory == newest:
        step, tier = newest, RestoreTier.MEMORY
    elif peer == newest:
        step, tier = newest, RestoreTier.PEER
    else:
        step, tier = newest, RestoreTier.DISK
    mine = [d for n in participants if (d := records.get(n)) is not None and d.job == job]
    return Restore(
        round=round_,
        step=step,
        tier=tier,
        ranks=len(participants) * nproc,
        held=any(d.ranks or d.persisted or d.replicas for d in mine),
        time=max((d.time for d in mine), default=0.0),
    )
