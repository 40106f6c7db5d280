"""The outcome of a pure decision of the restart ladder: what to do, and why not.

:data:`~kelastic_sidecar.inprocess.hybrid_verdicts.AbsorbVerdict` (a dead worker: absorb it in
process?) and :data:`~kelastic_sidecar.inprocess.spares.SpareVerdict` (a spare's
``hello``: keep it waiting?) are this one type over their own enum of actions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Verdict"]

K = TypeVar("K", bound=enum.Enum)


@dataclass(frozen=True)
class Verdict(Generic[K]):
    """What a pure decision function chose.

    Attributes:
        kind: the action (a member of the decision's own enum).
        reason: why the cheaper action is not taken (empty when it is); logged, and sent
            to the worker where the action tells it (a spare's ``give_up``).
    """

    kind: K
    reason: str = ""
