"""A round's c10d store address at :meth:`kelastic.contract.Keys.master`: bytes <-> pair.

Group rank 0's sidecar picks a free port on its pod IP fresh each round and writes
``{"addr": "10.0.0.7", "port": 29517}``; the other sidecars of the round read it as
``MASTER_ADDR``/``MASTER_PORT``. Bounds (reader and writer alike): at most
:data:`MAX_MASTER_BYTES` bytes, ``addr`` a string of 1..:data:`MAX_ADDR` characters,
``port`` an integer in 1..65535. Stdlib only, no I/O.
"""

from __future__ import annotations

import json
from typing import Final

from kelastic._safejson import is_int, load_object

from ._fields import CorruptValueError

__all__ = ["MAX_ADDR", "MAX_MASTER_BYTES", "decode_master", "encode_master"]

#: Largest master value accepted, bytes.
MAX_MASTER_BYTES: Final = 4096
#: Longest address, characters.
MAX_ADDR: Final = 255


def _check(addr: object, port: object, where: str, raw: object) -> tuple[str, int]:
    if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR:
        raise CorruptValueError(f"corrupt master record at {where}: bad addr: {raw!r:.200}")
    if not is_int(port, 1, 65535):
        raise CorruptValueError(f"corrupt master record at {where}: bad port: {raw!r:.200}")
    return addr, port


def decode_master(raw: bytes, where: str) -> tuple[str, int]:
    """Parse a round's master value (bounded, :func:`kelastic._safejson.loads_bounded`).

    Args:
        raw: the bytes read from etcd.
        where: the etcd key, for the message.

    Returns:
        ``(MASTER_ADDR, MASTER_PORT)``.

    Raises:
        CorruptValueError: not bounded JSON, not an object, an address that is not a
            string of 1..255 characters, a port outside 1..65535; never another error.
    """
    doc = load_object(raw, f"corrupt master record at {where}", max_bytes=MAX_MASTER_BYTES,
                      error=CorruptValueError)  # fmt: skip
    return _check(doc.get("addr"), doc.get("port"), where, raw[:200])


def encode_master(addr: str, port: int) -> bytes:
    """The master value of ``addr``/``port``.

    Raises:
        CorruptValueError: outside :func:`decode_master`'s bounds (strict).
    """
    _check(addr, port, "the master value to write", (addr, port))
    return json.dumps({"addr": addr, "port": port}, separators=(",", ":")).encode()
