"""Words the sidecar's packages share, as enums and constants: a leaf, imported by the
pure modules of every package (the rendezvous state, how a round ended) without pulling
in what speaks to etcd.

:class:`CheckReason` says why a completed round cannot go on (the rendezvous' round
check, torch's ``_should_keep_alive``/``num_nodes_waiting`` questions as one answer); the
departure reasons are what a participant that left a round wrote (others: the operator's
``contract.DEPARTURE_SCALE_DOWN``, the supervisor's ``shutdown``).
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["DEPARTURE_PREFLIGHT", "DEPARTURE_REJOIN", "DEPARTURE_SUCCEEDED", "CheckOutcome",
           "CheckReason"]  # fmt: skip

#: Departure reason recorded when a participant exits a round to re-rendezvous.
DEPARTURE_REJOIN: Final = "rejoin"
#: Departure of a node whose workers all exited 0: its peers carry on.
DEPARTURE_SUCCEEDED: Final = "succeeded"
#: Departure of a node the round's network check judged bad: it never trains.
DEPARTURE_PREFLIGHT: Final = "preflight_failed"


class CheckOutcome(enum.StrEnum):
    """What a round's network check decided for this node (:mod:`~kelastic_sidecar.netcheck`)."""

    #: The group met the floors, or the pair tests cleared every node: the workers start.
    PASSED = "passed"
    #: This node was judged bad: it leaves and its Pod fails.
    SELF_FAILED = "self_failed"
    #: Other nodes were judged bad: rendezvous again without them.
    PEERS_FAILED = "peers_failed"
    #: No node could be judged: the workers start.
    INCONCLUSIVE = "inconclusive"


class CheckReason(enum.StrEnum):
    """Why a completed round cannot go on (the rendezvous' ``RoundCheck.reason``)."""

    #: It can: nothing changed.
    HEALTHY = ""
    #: Nodes wait to join (a scale-up).
    NODES_WAITING = "nodes_waiting"
    #: A participant's liveness key is gone (lease expired, or removed by the operator).
    PARTICIPANT_LOST = "participant_lost"
    #: A participant left the round (its departure notice says why).
    PARTICIPANT_LEFT = "participant_left"
    #: The rendezvous is closed.
    CLOSED = "closed"
    #: Another round completed meanwhile.
    ROUND_ADVANCED = "round_advanced"
    #: This node's own lease was lost.
    LEASE_LOST = "lease_lost"
