"""In-process restart, the sidecar's side: one coordinator per node over ``inprocess.sock``
and the job's iteration record in etcd.

One public face: :class:`InProcessCoordinator` (:mod:`.coordinator`: its thread and the
supervisor's API) and :func:`respawn_failure` (how a dead rank's respawn is reported).
Inside: the worker sessions (:mod:`.server`), the etcd record and barrier keys, pure
(:mod:`.record`), a round and the barrier's verdict, pure (:mod:`.round`), the node's
state machine (:mod:`.machine`) and its rungs: the hybrid rung's verdicts, pure
(:mod:`.hybrid_verdicts`), the machine that takes worker deaths (:mod:`.hybrid`), spare
ranks (:mod:`.spares`), the node-change rung (:mod:`.carry`); their verdicts share
:mod:`.verdict`.
"""

from .coordinator import InProcessCoordinator
from .hybrid_verdicts import respawn_failure

__all__ = ["InProcessCoordinator", "respawn_failure"]
