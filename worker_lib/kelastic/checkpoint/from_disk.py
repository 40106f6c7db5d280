"""A rank's load of a step the job restores from its persistence folder (the ``disk``
tier: ``$KELASTIC_CHECKPOINT_TIER=disk``): the step's ``rank-<R>`` folder, a torch DCP
checkpoint written by the sidecars (:mod:`kelastic.checkpoint.persist`), read with torch's
own reader and no template (DCP's empty-state planner, as
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` reads one), in this
process alone (``no_dist``: the ranks load their own folders, no collective).

DCP stores mapping keys as text: an int key (an optimizer's ``state``) would load as
``"0"``, and ``Optimizer.load_state_dict`` would drop that state without a word. The
sidecar lists the int keys beside the checkpoint (:data:`~.persist.INT_KEYS`), and the
load turns them back: a step loads from disk as it does from memory.

The step was agreed by the sidecars from every node's record of the complete steps it
saw (:func:`kelastic.etcd_values.checkpoints.restore_of`), so every rank loads the same
step. A folder gone or unreadable now (pruned, a volume fault) raises
:class:`~kelastic.checkpoint.CheckpointRestoreError`, as a memory slot failing its checks
does: the worker fails and the next round agrees without that step, never a mixed
restore.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kelastic import contract
from kelastic._safejson import is_int, loads_bounded

from ._slotfile import CheckpointRestoreError
from .persist import COMPLETE, INT_KEYS

__all__ = ["load_persisted", "persist_root", "source_rank"]

#: Largest :data:`~.persist.INT_KEYS` file read, bytes (an optimizer of a million
#: parameter tensors lists about 20 MB).
MAX_INT_KEYS_BYTES = 64 << 20
_DECIMAL = re.compile(r"-?(0|[1-9][0-9]{0,18})")
_RANK_DIR = re.compile(r"rank-(0|[1-9][0-9]{0,9})")


def persist_root() -> Path | None:
    """The job's persistence folder as the trainer sees it
    (``$KELASTIC_CHECKPOINT_PERSIST_DIR``), or None when unset."""
    value = os.environ.get(contract.ENV_CHECKPOINT_PERSIST_DIR, "")
    return Path(value) if value else None


def source_rank(step_dir: Path, rank: int) -> int:
    """Which rank's folder of the persisted step at ``step_dir`` holds a *replicated*
    state for ``rank``: its own when there is one, else ``rank mod W`` of the ``W`` rank
    folders the step has (a world that grew since: the folders are alike)."""
    if (step_dir / f"rank-{rank}").is_dir():
        return rank
    try:
        world = sum(1 for p in step_dir.iterdir() if _RANK_DIR.fullmatch(p.name) and p.is_dir())
    except OSError:
        return rank
    return rank % world if world else rank


def load_persisted(step: int, rank: int, root: Path | None, *,
                   replicated: bool = False) -> tuple[int, Any]:  # fmt: skip
    """``(step, state_dict)`` of ``rank``'s part of the persisted ``step`` under ``root``
    (``root/step-<step>/rank-<rank>``; with ``replicated``, another rank's folder when
    the step was saved by a smaller world: :func:`source_rank`), its tensors on the CPU.

    Raises:
        CheckpointRestoreError: ``root`` is None, the step is not complete there, or
            torch cannot read it (the message says which).
    """

    def fail(why: str) -> CheckpointRestoreError:
        return CheckpointRestoreError(
            f"rank {rank} cannot load the agreed checkpoint step {step} from disk ({why}); "
            "the next round agrees on a step without it"
        )

    if root is None:
        raise fail(f"${contract.ENV_CHECKPOINT_PERSIST_DIR} is not set")
    step_dir = root / f"step-{step}"
    if not (step_dir / COMPLETE).is_file():
        raise fail(f"{step_dir} is not complete")
    part = step_dir / f"rank-{source_rank(step_dir, rank) if replicated else rank}"
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(part),
                         planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
                         no_dist=True)  # fmt: skip
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        raise fail(f"{part}: {type(exc).__name__}: {exc}") from None
    try:
        _int_keys(state, _read_int_keys(part / INT_KEYS))
    except (OSError, ValueError) as exc:
        raise fail(f"its {INT_KEYS}: {exc}") from None
    return step, state


def _read_int_keys(path: Path) -> list[list[str | int]]:
    """The paths of :data:`~.persist.INT_KEYS` (none when the file is absent).

    Raises:
        ValueError: not a bounded JSON list of non-empty paths whose last element is a
            decimal key.
        OSError: the file cannot be read.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_INT_KEYS_BYTES + 1)
    except FileNotFoundError:
        return []
    paths = loads_bounded(raw, max_bytes=MAX_INT_KEYS_BYTES)
    if not isinstance(paths, list):
        raise ValueError("not a list")
    for path in paths:
        if not (isinstance(path, list) and path and all(
                isinstance(e, str) or (is_int(e, 0, 2**31)) for e in path)):  # fmt: skip
            raise ValueError(f"{path!r:.60} is not a path")
        if not (isinstance(path[-1], str) and _DECIMAL.fullmatch(path[-1])):
            raise ValueError(f"{path[-1]!r:.40} is not an int key")
    return paths


def _int_keys(state: dict[str, Any], paths: list[list[str | int]]) -> None:
    """Turn the keys at ``paths`` back into ints in ``state`` (in place, keeping the
    mappings' order), the deepest first (a path runs through keys still text)."""
    by_parent: dict[tuple[str | int, ...], set[str]] = {}
    for path in paths:
        by_parent.setdefault(tuple(path[:-1]), set()).add(str(path[-1]))
    for parent in sorted(by_parent, key=len, reverse=True):
        node: Any = state
        for key in parent:
            in_dict = isinstance(node, dict) and isinstance(key, str) and key in node
            in_list = isinstance(node, list) and isinstance(key, int) and key < len(node)
            if not (in_dict or in_list):
                raise ValueError(f"no mapping at {list(parent)!r:.80}")
            node = node[key]
        if not isinstance(node, dict):
            raise ValueError(f"no mapping at {list(parent)!r:.80}")
        keys = by_parent[parent]
        rebuilt = {(int(k) if isinstance(k, str) and k in keys else k): v for k, v in node.items()}
        node.clear()
        node.update(rebuilt)
