"""kelastic's in-container client library (stdlib only; torch optional).

- :mod:`kelastic.contract`: env names, paths and etcd key layout shared with the sidecar
  and operator.
- :mod:`kelastic.timer`: ``configure()`` and ``expires(after=...)`` expiration timers,
  wire-compatible with torch's ``FileTimerClient``.
- :mod:`kelastic.errors`: the ``record`` decorator writing torch-style ``error.json``.
- :mod:`kelastic.launch`: ``python -m kelastic.launch -- cmd ...`` starts the workers.
"""

__version__ = "0.1.0"
