"""One codec per etcd value of a job: what the sidecars write and what the sidecars and
the operator read, bytes <-> document, in one place (stdlib only, no I/O).

Each codec is strict for the writer (a value outside its bounds is refused before it is
stored, so nothing written is refused when read) and bounded for every reader (a value
no writer could produce is refused by every reader alike, with
:class:`CorruptValueError` and nothing else, whatever the bytes); a reader that only
reports (the operator) reads with ``partial``: missing or unknown fields and another
version are let through, each field present held to the same bounds.

The values under ``/kelastic/<ns>/<job>/<uid>/`` (:class:`kelastic.contract.Keys`):

=============================  ==============================  ============================
key                            codec                           written by / read by
=============================  ==============================  ============================
``rdzv/state``                 :mod:`.rendezvous` (state)      sidecars / sidecars, operator
``rdzv/departing/<node>``      :mod:`.rendezvous` (departure)  operator / sidecars
``fenced/<pod uid>``           :mod:`.rendezvous` (departure)  operator / sidecars
``rdzv/alive/<node>``,         none: keys only (the value is   sidecars / nobody
``rdzv/joining/<node>``        informative, never read)
``rounds/<n>/master``          :mod:`.rounds`                  group rank 0 / its peers
``restarts``                   :mod:`.restarts`                sidecars / sidecars, operator
``reports/<node>``             :mod:`.reports`                 a sidecar / the operator
``inprocess/iteration``        :mod:`kelastic.inprocess_record`  sidecars / sidecars,
                                                               operator, ``kelastic run``
``inprocess/ready/<m>/<node>`` ``kelastic_sidecar.inprocess.    sidecars / sidecars
                               record`` (sidecars only)
``inprocess/go/<m>``           the ready key's codec (its value  group rank 0 / sidecars
                               is group rank 0's ready value)
``checkpoints/<node>``         :mod:`.checkpoints`             a sidecar / sidecars
``checkpoint-loads/<node>``    :mod:`.loads`                   a sidecar / the operator
``hangs/<node>``               :mod:`.hangs`                   a sidecar / the operator
``stragglers/<node>``          :mod:`.stragglers`              a sidecar / the operator
=============================  ==============================  ============================
"""

from ._fields import MAX_NAME_LEN, MAX_TIME, CorruptValueError, ForeignValueError, is_name
from .hangs import MAX_HANG_BYTES, decode_hang, encode_hang
from .rendezvous import (
    MAX_DEADLINE,
    MAX_RANK,
    MAX_ROUND,
    MAX_STATE_BYTES,
    STATE_VERSION,
    StateDoc,
    decode_departure,
    decode_state,
    encode_departure,
    encode_state,
)
from .reports import MAX_SUMMARY, ReportDoc, ReportOutcome, decode_report, encode_report
from .restarts import HISTORY_LIMIT, RECORD_VERSION, RestartsDoc
from .restarts import decode_record as decode_restarts
from .restarts import encode_record as encode_restarts
from .rounds import decode_master, encode_master
from .stragglers import StragglersDoc, decode_stragglers, encode_stragglers

__all__ = [
    "HISTORY_LIMIT",
    "MAX_DEADLINE",
    "MAX_HANG_BYTES",
    "MAX_NAME_LEN",
    "MAX_RANK",
    "MAX_ROUND",
    "MAX_STATE_BYTES",
    "MAX_SUMMARY",
    "MAX_TIME",
    "RECORD_VERSION",
    "STATE_VERSION",
    "CorruptValueError",
    "ForeignValueError",
    "ReportDoc",
    "ReportOutcome",
    "RestartsDoc",
    "StateDoc",
    "StragglersDoc",
    "decode_departure",
    "decode_hang",
    "decode_master",
    "decode_report",
    "decode_restarts",
    "decode_state",
    "decode_stragglers",
    "encode_departure",
    "encode_hang",
    "encode_master",
    "encode_report",
    "encode_restarts",
    "encode_state",
    "encode_stragglers",
    "is_name",
]
