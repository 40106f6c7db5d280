"""Who may use the sidecar's files on the shared volume: the timer FIFO, the control
socket, the in-process socket and the preStop socket (``$KELASTIC_IPC_ACCESS``); and why a
connection to a socket is dropped (:class:`DropReason`).

One rule for the four: :func:`ipc_access` says who (the sidecar's user only, its group,
or any user of the Pod), :func:`fifo_mode` and :func:`socket_mode` the file modes that
follow. Used by :mod:`kelastic_sidecar.timer`, :mod:`kelastic_sidecar.control`,
:mod:`kelastic_sidecar.inprocess` and :mod:`kelastic_sidecar.prestop`; imports nothing
of theirs.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Final

from kelastic.contract import ENV_IPC_ACCESS

__all__ = [
    "ACCESS_GROUP",
    "ACCESS_OWNER",
    "ACCESS_POD",
    "DROP_REASONS",
    "DropReason",
    "fifo_mode",
    "ipc_access",
    "socket_mode",
]

ACCESS_OWNER: Final = "owner"
ACCESS_GROUP: Final = "group"
ACCESS_POD: Final = "pod"
_MODES: Final = {  # (FIFO, socket): the sidecar reads the FIFO, so its owner keeps read
    ACCESS_OWNER: (0o600, 0o600),
    ACCESS_GROUP: (0o620, 0o660),
    ACCESS_POD: (0o622, 0o666),
}


def ipc_access(env: Mapping[str, str] | None = None) -> str:
    """Who may write the timer FIFO and connect to the control socket.

    ``$KELASTIC_IPC_ACCESS`` when set (``owner``, ``group`` or ``pod``); otherwise
    ``pod`` on Kubernetes (``$KUBERNETES_SERVICE_HOST`` is set in every container there):
    the trainer's user may be unknown to the operator, and only the Pod's containers
    mount the run volume; else ``owner``: locally ``kelastic run`` starts the sidecar and
    the trainer as the same user, and no other local user may write.

    Raises:
        ValueError: ``$KELASTIC_IPC_ACCESS`` holds another value.
    """
    env = os.environ if env is None else env
    value = env.get(ENV_IPC_ACCESS, "").strip().lower()
    if not value:
        return ACCESS_POD if env.get("KUBERNETES_SERVICE_HOST") else ACCESS_OWNER
    if value not in _MODES:
        raise ValueError(f"{ENV_IPC_ACCESS} must be one of {sorted(_MODES)}, got {value!r}")
    return value


def fifo_mode(access: str) -> int:
    """File mode of the timer FIFO for ``access`` (:func:`ipc_access`).

    Raises:
        KeyError: unknown ``access``.
    """
    return _MODES[access][0]


def socket_mode(access: str) -> int:
    """File mode of the control socket for ``access`` (:func:`ipc_access`).

    Raises:
        KeyError: unknown ``access``.
    """
    return _MODES[access][1]


class DropReason(enum.StrEnum):
    """Why a worker's connection was dropped for bad behaviour (the ``reason`` label of
    ``kelastic_inprocess_sessions_dropped_total``)."""

    #: A line that is not a message of the protocol.
    MALFORMED = "malformed"
    #: A first message other than ``hello``.
    NO_HELLO = "no_hello"
    #: A line over the protocol's longest.
    OVERSIZED = "oversized"
    #: More unread messages than the server holds for one connection.
    FLOOD = "flood"
    #: A send that did not complete within the send timeout (a peer that stopped reading).
    SEND_TIMEOUT = "send_timeout"
    #: A connection over the server's most sessions.
    TOO_MANY = "too_many"


#: Every :class:`DropReason`, in declaration order.
DROP_REASONS: Final = tuple(DropReason)
