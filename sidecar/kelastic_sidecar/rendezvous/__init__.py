"""The rendezvous: torch's dynamic rendezvous semantics on etcd (no torch imported).

One public face: :class:`EtcdRendezvousHandler` (:mod:`.handler`), its settings, round
info and errors, and the round check's reasons. Inside: the state, its wire form and
transitions, pure (:mod:`.state`); join/exit/leave/close steps, pure (:mod:`.steps`); the
state held against etcd (:mod:`.holder`); operations run to completion (:mod:`.executor`).
"""

from ..vocabulary import DEPARTURE_REJOIN, DEPARTURE_SUCCEEDED, CheckReason
from .finished import finished_in
from .handler import (
    LEAVE_OUTAGE_TIMEOUT,
    EtcdRendezvousHandler,
    RendezvousConnectionError,
    RendezvousFencedError,
)
from .state import (
    CorruptStateError,
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousStateError,
    RendezvousTimeoutError,
    RoundCheck,
)

__all__ = [
    "DEPARTURE_REJOIN",
    "DEPARTURE_SUCCEEDED",
    "LEAVE_OUTAGE_TIMEOUT",
    "CheckReason",
    "CorruptStateError",
    "EtcdRendezvousHandler",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousFencedError",
    "RendezvousInfo",
    "RendezvousSettings",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RoundCheck",
    "finished_in",
]
