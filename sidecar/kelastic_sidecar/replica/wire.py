"""The replication protocol's wire format: the one codec of its server and its clients.

One request per TCP connection, each message a single JSON line (``\\n``-terminated, at
most :data:`MAX_LINE` bytes, the newline included)::

    request  {"v":1,"op":"put","job":J,"token":T,"rank":R,"step":S,"bytes":N}  + N raw bytes
             {"v":1,"op":"get","job":J,"token":T,"rank":R,"step":S}
    reply    {"v":1,"ok":true,"bytes":N}         a get's answer (+ N raw bytes), a put's ack
             {"v":1,"ok":false,"error":"..."}    a refusal (at most MAX_ERROR_CHARS)
    trailer  {"v":1,"commit":true|false}         right after the raw bytes, by their sender

A put: request, slot bytes, trailer -> reply. A get: request -> reply, slot bytes,
trailer. The trailer says whether the source slot's commit word was unchanged once its
bytes were read (a trainer may begin a save over the slot meanwhile: ``false`` means
torn, and the receiver discards the bytes).

Decoding is bounded (:func:`kelastic._safejson.load_object`) and strict: exact field
sets, integers within bounds (a ``bool`` is no integer), ``job`` 1..:data:`MAX_JOB_CHARS`
characters, ``token`` :data:`MIN_TOKEN_CHARS`..:data:`MAX_TOKEN_CHARS` ASCII hex digits.
Anything else raises :class:`ReplicaWireError` (a ``ValueError``) and nothing else,
whatever the bytes. The encoders refuse what the decoders refuse. Pure: no sockets.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Final

from kelastic._safejson import is_int, load_object

__all__ = [
    "MAX_BYTES",
    "MAX_ERROR_CHARS",
    "MAX_JOB_CHARS",
    "MAX_LINE",
    "MAX_RANK",
    "MAX_STEP",
    "MAX_TOKEN_CHARS",
    "MIN_TOKEN_CHARS",
    "WIRE_VERSION",
    "Op",
    "ReplicaWireError",
    "Reply",
    "Request",
    "Trailer",
    "check_token",
    "decode_reply",
    "decode_request",
    "decode_trailer",
    "encode_reply",
    "encode_request",
    "encode_trailer",
    "new_token",
    "refusal",
]

WIRE_VERSION: Final = 1
#: Longest message line, bytes, its newline included.
MAX_LINE: Final = 1024
#: Highest global rank (the slot format's bound).
MAX_RANK: Final = 2**31 - 2
#: Highest step (the slot format's bound: exact as a JSON number anywhere).
MAX_STEP: Final = 2**53
#: Most raw bytes one message announces (1 TiB).
MAX_BYTES: Final = 2**40
MAX_JOB_CHARS: Final = 256
MIN_TOKEN_CHARS: Final = 16
MAX_TOKEN_CHARS: Final = 128
MAX_ERROR_CHARS: Final = 200
_HEX: Final = re.compile(r"[0-9a-fA-F]+")
_DEPTH: Final = 2


class ReplicaWireError(ValueError):
    """A replication message is malformed, outside its bounds, or of another version (the
    message says which field and why); also raised by the encoders for a message no
    decoder would accept."""


class Op(enum.StrEnum):
    """What a request asks for."""

    #: Store the slot whose bytes follow as a replica.
    PUT = "put"
    #: Send back a committed slot of (rank, step).
    GET = "get"


@dataclass(frozen=True)
class Request:
    """A client's request. ``nbytes`` is the slot's used bytes that follow a put (0 for a
    get, which carries none)."""

    op: Op
    job: str
    token: str
    rank: int
    step: int
    nbytes: int = 0


@dataclass(frozen=True)
class Reply:
    """The server's answer: ``ok`` with ``nbytes`` (a get's slot bytes that follow; a
    put's bytes stored), or a refusal with its ``error`` text."""

    ok: bool
    nbytes: int = 0
    error: str = ""


@dataclass(frozen=True)
class Trailer:
    """Sent right after a slot's raw bytes: whether the source slot's commit word was
    still the same once they were read (False: torn, discard them)."""

    commit: bool


def check_token(token: object) -> str:
    """``token`` if it is a string of :data:`MIN_TOKEN_CHARS`..:data:`MAX_TOKEN_CHARS`
    ASCII hex digits.

    Raises:
        ReplicaWireError: it is not.
    """
    if not (
        isinstance(token, str)
        and MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS
        and token.isascii()
        and _HEX.fullmatch(token)
    ):
        raise ReplicaWireError(
            f"token must be {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} ASCII hex digits"
        )
    return token


def new_token() -> str:
    """A fresh shared secret for a job's replica servers and clients: 32 lower-case hex
    digits (``secrets.token_hex(16)``: 128 bits)."""
    return secrets.token_hex(16)


def refusal(text: str) -> Reply:
    """A refusal whose error is ``text`` made printable ASCII and cut to
    :data:`MAX_ERROR_CHARS` (so that it always encodes)."""
    clean = "".join(c if " " <= c <= "~" else "?" for c in text)[:MAX_ERROR_CHARS]
    return Reply(False, error=clean or "refused")


# ------------------------------------------------------------------ encoding


def _line(doc: dict[str, Any], what: str) -> bytes:
    raw = json.dumps(doc, separators=(",", ":")).encode("ascii") + b"\n"
    if len(raw) > MAX_LINE:
        raise ReplicaWireError(f"{what} of {len(raw)} bytes, over the {MAX_LINE}-byte line")
    return raw


def encode_request(req: Request) -> bytes:
    """The request's line (newline included).

    Raises:
        ReplicaWireError: a field outside its bounds, or a line over :data:`MAX_LINE`.
    """
    doc: dict[str, Any] = {"v": WIRE_VERSION, "op": req.op.value, "job": req.job,
                           "token": req.token, "rank": req.rank, "step": req.step}  # fmt: skip
    if req.op is Op.PUT:
        doc["bytes"] = req.nbytes
    elif req.nbytes:
        raise ReplicaWireError("a get carries no bytes")
    _check_request(doc, req.op)
    return _line(doc, "request")


def encode_reply(reply: Reply) -> bytes:
    """The reply's line (newline included); see :func:`refusal` for a refusal's text.

    Raises:
        ReplicaWireError: a field outside its bounds.
    """
    if reply.ok:
        if reply.error:
            raise ReplicaWireError("an ok reply carries no error")
        doc: dict[str, Any] = {"v": WIRE_VERSION, "ok": True, "bytes": reply.nbytes}
    else:
        if reply.nbytes:
            raise ReplicaWireError("a refusal carries no bytes")
        doc = {"v": WIRE_VERSION, "ok": False, "error": reply.error}
    _check_reply(doc)
    return _line(doc, "reply")


def encode_trailer(commit: bool) -> bytes:
    """The trailer's line (newline included)."""
    return _line({"v": WIRE_VERSION, "commit": bool(commit)}, "trailer")


# ------------------------------------------------------------------ decoding


def _object(raw: bytes, what: str) -> dict[str, Any]:
    if len(raw) > MAX_LINE:
        raise ReplicaWireError(f"{what} of {len(raw)} bytes, over the {MAX_LINE}-byte line")
    doc = load_object(raw, what, max_bytes=MAX_LINE, max_depth=_DEPTH, error=ReplicaWireError)
    version = doc.get("v")
    if not is_int(version) or version != WIRE_VERSION:
        raise ReplicaWireError(f"{what}: version {version!r:.40}, not {WIRE_VERSION}")
    return doc


def _fields(doc: dict[str, Any], expected: set[str], what: str) -> None:
    if set(doc) != expected:
        raise ReplicaWireError(
            f"{what} must have exactly the fields {sorted(expected)}, got {sorted(doc)[:10]!r:.200}"
        )


def _int(doc: dict[str, Any], name: str, high: int, what: str) -> int:
    value = doc[name]
    if not is_int(value, 0, high):
        raise ReplicaWireError(f"{what}: {name} must be an integer in 0..{high}, got {value!r:.40}")
    return value


def _check_request(doc: dict[str, Any], op: Op) -> Request:
    what = f"{op.value} request"
    expected = {"v", "op", "job", "token", "rank", "step"}
    _fields(doc, expected | {"bytes"} if op is Op.PUT else expected, what)
    job = doc["job"]
    if not isinstance(job, str) or not 1 <= len(job) <= MAX_JOB_CHARS:
        raise ReplicaWireError(f"{what}: job must be a string of 1..{MAX_JOB_CHARS} characters")
    try:
        token = check_token(doc["token"])
    except ReplicaWireError as exc:
        raise ReplicaWireError(f"{what}: {exc}") from None
    rank = _int(doc, "rank", MAX_RANK, what)
    step = _int(doc, "step", MAX_STEP, what)
    nbytes = _int(doc, "bytes", MAX_BYTES, what) if op is Op.PUT else 0
    return Request(op, job, token, rank, step, nbytes)


def decode_request(raw: bytes) -> Request:
    """Decode a request line (its trailing newline optional).

    Raises:
        ReplicaWireError: not a request of this version within its bounds; nothing else.
    """
    doc = _object(raw, "request")
    op = doc.get("op")
    if not isinstance(op, str) or op not in ("put", "get"):
        raise ReplicaWireError(f"request: unknown op {op!r:.40}")
    return _check_request(doc, Op(op))


def _check_reply(doc: dict[str, Any]) -> Reply:
    ok = doc.get("ok")
    if ok is True:
        _fields(doc, {"v", "ok", "bytes"}, "reply")
        return Reply(True, nbytes=_int(doc, "bytes", MAX_BYTES, "reply"))
    if ok is False:
        _fields(doc, {"v", "ok", "error"}, "refusal")
        error = doc["error"]
        if not isinstance(error, str) or not 1 <= len(error) <= MAX_ERROR_CHARS:
            raise ReplicaWireError(f"refusal: error must be 1..{MAX_ERROR_CHARS} characters")
        return Reply(False, error=error)
    raise ReplicaWireError(f"reply: ok must be true or false, got {ok!r:.40}")


def decode_reply(raw: bytes) -> Reply:
    """Decode a reply line (its trailing newline optional).

    Raises:
        ReplicaWireError: not a reply of this version within its bounds; nothing else.
    """
    return _check_reply(_object(raw, "reply"))


def decode_trailer(raw: bytes) -> Trailer:
    """Decode a trailer line (its trailing newline optional).

    Raises:
        ReplicaWireError: not a trailer of this version; nothing else.
    """
    doc = _object(raw, "trailer")
    _fields(doc, {"v", "commit"}, "trailer")
    commit = doc["commit"]
    if not isinstance(commit, bool):
        raise ReplicaWireError(f"trailer: commit must be true or false, got {commit!r:.40}")
    return Trailer(commit)
