"""The built-in network preflight check: the nodes of a rendezvous round, one process per
node (``python -m kelastic.netcheck``), run it together before their workers start.

The check forms a gloo group of the nodes and measures its all-reduce: the latency (the
median time of a 4-byte all-reduce) and the bandwidth (the payload, a few MB, over the
median time of one all-reduce of it), the worst rank's of each, against two floors
(:class:`Floors`). Both met: the check passed. Else two passes of pair tests find the
culprits (semantics from DLRover's network check): pass 1 pairs the nodes ``(0,1),
(2,3), ...`` and measures each pair's round trips; pass 2 pairs the nodes that failed
every pass-1 test with new peers (the ring shifted by one). A node that failed every
test it was in, with a peer that passed a test with someone else, is judged bad
(:func:`judge`); if no node failed, the pair tests cleared everyone and the check passed.

A verdict is *inconclusive* when no node could be judged: the group could not form (a
peer never came), a step timed out or a peer vanished, a world of 2 missed the floors
(either end may be slow), or every pair test failed (the network as a whole is slow).
An inconclusive verdict blames no one; what to do with it is the launcher's call.

The parts: the params and verdict lines and the pure planning and judging
(:mod:`.codec`, stdlib only); the measuring with torch (:mod:`.check`, torch imported
only when a check runs); the command (:mod:`.__main__`); the job's setting, as the
operator writes it for the sidecar and the launcher (:mod:`.setting`).
"""

from .check import run_check
from .codec import (
    MAX_FAILED,
    MAX_INCONCLUSIVE,
    MAX_PARAMS_BYTES,
    MAX_REASON,
    MAX_VERDICT_BYTES,
    MAX_WORLD,
    Floors,
    NetcheckError,
    Pair,
    PairResult,
    Params,
    Verdict,
    clip,
    combine,
    decode_params,
    decode_verdict,
    encode_params,
    encode_verdict,
    judge,
    pair_steps,
    pairs,
    retest_steps,
)
from .setting import MAX_SETTING_BYTES, MAX_TIMEOUT, Setting, decode_setting, encode_setting

__all__ = [
    "MAX_FAILED",
    "MAX_INCONCLUSIVE",
    "MAX_PARAMS_BYTES",
    "MAX_REASON",
    "MAX_SETTING_BYTES",
    "MAX_TIMEOUT",
    "MAX_VERDICT_BYTES",
    "MAX_WORLD",
    "Floors",
    "NetcheckError",
    "Pair",
    "PairResult",
    "Params",
    "Setting",
    "Verdict",
    "clip",
    "combine",
    "decode_params",
    "decode_setting",
    "decode_verdict",
    "encode_params",
    "encode_setting",
    "encode_verdict",
    "judge",
    "pair_steps",
    "pairs",
    "retest_steps",
    "run_check",
]
