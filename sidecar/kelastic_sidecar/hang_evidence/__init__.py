"""Hang evidence: a hung worker's Python stacks, read from outside it with ``py-spy
dump`` just before the sidecar kills it (the timer server's reap, the in-process hard
timeout's kill), written to the run's volume and summarised in the reap's reason.

The parts: what a collection found (:class:`Evidence`, :class:`Outcome`; the injected
:data:`Collect` callable's result: :mod:`.evidence`), reading py-spy's text (plain
functions: :mod:`.pyspy_text`), running py-spy within a budget (:class:`StackCollector`:
:mod:`.collector`).
"""

from .collector import DEFAULT_BUDGET, DEFAULT_MAX_BYTES, ENV_BUDGET, StackCollector
from .evidence import Collect, Evidence, Outcome, collect_all

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_MAX_BYTES",
    "ENV_BUDGET",
    "Collect",
    "Evidence",
    "Outcome",
    "StackCollector",
    "collect_all",
]
