"""torch's flight recorder on a hang: each worker's record of the collectives it entered,
written when its sidecar asks, and read by the sidecar with the worker's stacks.

The parts: the record file's one codec and the reading of torch's dump, pure
(:mod:`.codec`); arming a worker to answer its sidecar's ask (a FIFO) from a thread of
its own, and writing the record (:mod:`.dump`). ``kelastic.errors.record`` arms the
worker when the job turns torch's recorder on (``TORCH_FR_BUFFER_SIZE`` > 0).
"""

from .codec import (
    MAX_GROUPS,
    MAX_NAME,
    MAX_RECORD_BYTES,
    Collective,
    FlightRecord,
    FlightRecordError,
    decode_collectives,
    decode_record,
    encode_record,
    last_collectives,
    record_name,
)
from .dump import arm, ask_fifo, enabled, write_record

__all__ = [
    "MAX_GROUPS",
    "MAX_NAME",
    "MAX_RECORD_BYTES",
    "Collective",
    "FlightRecord",
    "FlightRecordError",
    "arm",
    "ask_fifo",
    "decode_collectives",
    "decode_record",
    "enabled",
    "encode_record",
    "last_collectives",
    "record_name",
    "write_record",
]
