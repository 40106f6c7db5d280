"""The checkpoint volume at the sidecar's start (``spec.checkpoint.memory``): allocated
and written in full before anything else runs, so a volume too small for the job fails
the Pod at once with a clear error, never the trainer later with SIGBUS (tmpfs pages are
allocated lazily; :func:`kelastic.checkpoint.volume.touch_volume`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from kelastic import contract
from kelastic.checkpoint import CheckpointError
from kelastic.checkpoint.volume import touch_volume

__all__ = ["prepare_volume"]

log = logging.getLogger(__name__)


def prepare_volume(env: Mapping[str, str]) -> int:
    """Allocate and write the checkpoint volume in full at the sidecar's start when the
    job has one (``$KELASTIC_CHECKPOINT_MEMORY`` bytes in
    :func:`kelastic.contract.checkpoint_dir`; see
    :func:`kelastic.checkpoint.volume.touch_volume`), so a volume too small fails now with
    a clear error instead of SIGBUS in the trainer later. Returns the bytes checked (0:
    no volume).

    Raises:
        ValueError: the variable is not a positive integer, or the volume is missing or
            cannot hold the bytes (the message names the folder, the bytes needed and
            free, and ``spec.checkpoint.memory``).
    """
    raw = env.get(contract.ENV_CHECKPOINT_MEMORY, "")
    if not raw:
        return 0
    if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 18 and int(raw) > 0):
        raise ValueError(f"${contract.ENV_CHECKPOINT_MEMORY}={raw!r:.40} is not a size in bytes")
    size = int(raw)
    directory = Path(env.get(contract.ENV_CHECKPOINT_DIR) or contract.DEFAULT_CHECKPOINT_DIR)
    started = time.monotonic()
    try:
        touch_volume(directory, size)
    except (CheckpointError, OSError) as exc:
        raise ValueError(
            f"the checkpoint volume ({size} bytes, spec.checkpoint.memory) is unusable: {exc}"
        ) from exc
    log.info("checkpoint volume %s: %d bytes allocated and written in %.3f s", directory, size,
             time.monotonic() - started)  # fmt: skip
    return size
