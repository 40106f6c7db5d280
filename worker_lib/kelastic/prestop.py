"""``python -m kelastic.prestop``: the trainer container's ``preStop`` hook.

The kubelet runs it before it sends the trainer SIGTERM, when the Pod is deleted (a
scale-down, ``kubectl drain``, a preemption, ``kubectl delete pod``). It tells the
kelastic sidecar that the Pod is terminating, over the sidecar's Unix socket on the shared
volume (:func:`kelastic.contract.prestop_socket_path`), and waits until the sidecar's node
has left the rendezvous (at most ``--timeout`` seconds): the peers re-form before this
Pod's workers stop, and a departure the operator planned (an eviction, a scale-down) is
charged to no one. See :mod:`kelastic_sidecar.prestop` for the sidecar's side.

The protocol, one line each way, is defined here once for both sides: the request
:data:`REQUEST`, the answers :func:`reply_left` / :func:`reply_not_left`, read by
:func:`parse_reply`. The hook always exits 0 (a failed hook only delays the stop and
raises a ``FailedPreStopHook`` Event): what happened is printed on one line. Stdlib only.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kelastic import contract
from kelastic.sockaddr import unix_address

__all__ = ["REQUEST", "Reply", "main", "parse_reply", "reply_left", "reply_not_left", "tell"]

#: The request line (without its newline).
REQUEST: Final = b"terminating"
#: Longest answer line read, bytes.
MAX_REPLY: Final = 256
_LEFT: Final = "left"
_NOT_LEFT: Final = "not left"


@dataclass(frozen=True)
class Reply:
    """What the sidecar answered.

    Attributes:
        left: the node left the rendezvous.
        text: the departure reason (``left``), or why not.
    """

    left: bool
    text: str


def _clean(text: str, limit: int = 120) -> str:
    """``text`` as one printable line of at most ``limit`` characters."""
    return "".join(c if c.isprintable() else "?" for c in text)[:limit]


def reply_left(reason: str) -> bytes:
    """The answer: the node left with departure ``reason`` (``""``: none to leave)."""
    return f"{_LEFT} {_clean(reason) or '-'}\n".encode()


def reply_not_left(timeout: float) -> bytes:
    """The answer: the node had not left after ``timeout`` seconds."""
    return f"{_NOT_LEFT}: still in the rendezvous after {timeout:g} s\n".encode()


def parse_reply(line: bytes) -> Reply:
    """Read an answer line (its newline optional).

    Raises:
        ValueError: not an answer of :func:`reply_left`, :func:`reply_not_left`, or the
            sidecar's ``error: ...`` (then the message says it).
    """
    text = _clean(line.split(b"\n", 1)[0].decode("utf-8", errors="replace"), MAX_REPLY)
    if text.startswith(_LEFT + " "):
        return Reply(True, text[len(_LEFT) + 1 :])
    if text.startswith(_NOT_LEFT + ":"):
        return Reply(False, text[len(_NOT_LEFT) + 1 :].strip())
    raise ValueError(f"the sidecar answered {text!r}")


def tell(path: Path, timeout: float) -> Reply:
    """Tell the sidecar at ``path`` that the Pod is terminating; wait up to ``timeout``
    seconds for its answer.

    Raises:
        OSError: no sidecar listens there (it has exited, or the path is wrong), or no
            answer in time (``TimeoutError``).
        ValueError: the answer is not one (:func:`parse_reply`).
    """
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        with unix_address(path) as address:
            sock.connect(address)
        sock.sendall(REQUEST + b"\n")
        buf = b""
        while b"\n" not in buf and len(buf) < MAX_REPLY:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(MAX_REPLY - len(buf))
            if not chunk:
                break
            buf += chunk
    return parse_reply(buf)


def main(argv: Sequence[str] | None = None) -> int:
    """The hook's entry point; always 0 (see the module doc)."""
    parser = argparse.ArgumentParser(
        prog="python -m kelastic.prestop",
        description="The trainer's preStop hook: tell the kelastic sidecar that the Pod is "
        "terminating, and wait until its node has left the rendezvous.",
    )
    parser.add_argument(
        "--timeout", type=float, default=contract.PRESTOP_TIMEOUT_SECONDS,
        help="seconds to wait for the sidecar (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--socket", type=Path, default=None,
        help="the sidecar's socket (default: prestop.sock in $KELASTIC_RUN_DIR)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not args.timeout > 0 or args.timeout == float("inf"):
        parser.error(f"--timeout must be a finite number > 0: {args.timeout}")
    path = args.socket or contract.prestop_socket_path()
    try:
        reply = tell(path, args.timeout)
    except (OSError, ValueError) as exc:
        print(f"kelastic prestop: the sidecar did not answer at {path}: {exc}", flush=True)
        return 0
    said = f"left the rendezvous ({reply.text})" if reply.left else f"not left: {reply.text}"
    print(f"kelastic prestop: the sidecar {said}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
