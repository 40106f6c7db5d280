"""The job's network check setting (``spec.preflight.network``) as the operator writes it
into ``$KELASTIC_NETCHECK`` of both containers and the sidecar and launcher read it: one
codec, :func:`encode_setting` / :func:`decode_setting`. Pure, stdlib only."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Final

from kelastic._safejson import UnsafeJSONError, loads_bounded

from .codec import Floors, NetcheckError

__all__ = ["MAX_SETTING_BYTES", "MAX_TIMEOUT", "Setting", "decode_setting", "encode_setting"]

#: Longest env value, bytes.
MAX_SETTING_BYTES: Final = 4096
#: Longest timeout of one step of the check (the gloo timeout), seconds.
MAX_TIMEOUT: Final = 600.0
_FLOOR_KEYS: Final = {"max_latency_s", "min_bandwidth_bps", "size_bytes", "iterations"}


@dataclass(frozen=True)
class Setting:
    """The check of every round: ``floors`` (what the group's all-reduce must meet) and
    ``timeout_s`` (seconds, 1..:data:`MAX_TIMEOUT`: the gloo timeout of each step; the
    whole check is bounded by :meth:`deadline`).

    Raises:
        NetcheckError: a timeout out of bounds (NaN and bool included).
    """

    floors: Floors = field(default_factory=Floors)
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 1 <= t <= MAX_TIMEOUT:
            raise NetcheckError(f"timeoutSeconds must be 1..{MAX_TIMEOUT:g}, got {t!r:.40}")

    def deadline(self) -> float:
        """Seconds after which the launcher kills the checker: the group's forming, the
        all-reduce and both passes of pair tests, each within ``timeout_s``, plus the
        checker's start (its torch import when it was not started ahead)."""
        return 3 * self.timeout_s + 30.0


def encode_setting(setting: Setting) -> str:
    """The env value: ``{"floors": {...}, "timeoutSeconds": N}``."""
    return json.dumps({"floors": asdict(setting.floors), "timeoutSeconds": setting.timeout_s})


def decode_setting(raw: str) -> Setting:
    """An env value back (:func:`encode_setting`'s form).

    Raises:
        NetcheckError: not bounded JSON, not exactly the keys the encoder writes, or a
            value out of :class:`Setting`'s or :class:`Floors`' bounds.
    """
    try:
        doc = loads_bounded(raw.encode(), max_bytes=MAX_SETTING_BYTES)
    except UnsafeJSONError as exc:
        raise NetcheckError(f"not a network check setting: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"floors", "timeoutSeconds"}:
        raise NetcheckError(
            "not a network check setting: needs exactly 'floors' and 'timeoutSeconds'"
        )
    floors, timeout = doc["floors"], doc["timeoutSeconds"]
    if not isinstance(floors, dict) or set(floors) != _FLOOR_KEYS:
        raise NetcheckError(f"floors must have exactly {sorted(_FLOOR_KEYS)}")
    if isinstance(timeout, (int, float)) and not math.isfinite(timeout):
        raise NetcheckError(f"timeoutSeconds must be finite, got {timeout}")
    try:
        return Setting(Floors(**floors), timeout)
    except TypeError as exc:  # pragma: no cover - the keys were checked above
        raise NetcheckError(str(exc)) from None
