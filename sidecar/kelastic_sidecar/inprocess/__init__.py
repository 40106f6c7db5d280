"""In-process restart, the sidecar's side: one coordinator per node over ``inprocess.sock``
and the job's iteration record in etcd.

One public face: :class:`InProcessCoordinator` (:mod:`.coordinator`: its thread and the
supervisor's API) and :func:`respawn_failure` (how a dead rank's respawn is reported).
Inside: the worker sessions (:mod:`.server`), the etcd record and barrier keys, pure
(:mod:`.record`), a round and the barrier's verdict, pure (:mod:`.round`), and one
state machine per node (:mod:`.machine`: one class, one compare-and-set of the record)
with its parts, each owning its state: the termination barrier (:mod:`.barrier`), the
hard timeout (:mod:`.hard_timeout`), the restarts told in ``/status`` and the metrics
(:mod:`.history`), and the rungs, called at named points: worker deaths
(:mod:`.hybrid`, its verdicts pure in :mod:`.hybrid_verdicts`), spare ranks
(:mod:`.spares`), the node-change rung (:mod:`.carry`). What the machine and its parts
know of each other is :mod:`.parts` (types only); the verdicts share :mod:`.verdict`.
"""

from .coordinator import InProcessCoordinator
from .hybrid_verdicts import respawn_failure

__all__ = ["InProcessCoordinator", "respawn_failure"]
