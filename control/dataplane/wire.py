"""The TENSOR message of the data plane: its body and its replies.

A tensor travels as one `ControlMsg.TENSOR` request: a msgpack body {run, epoch, seq, tag,
dtype, shape} (`TensorMsg.from_wire` checks every field) and the tensor's bytes as the payload.
The receiver answers `ACCEPTED` once the tensor is in its buffer, or `{"ok": False, "why",
"dup"}` when it refuses it (`refuse`, logged at DEBUG with the peer); `verdict` reads that
answer on the sender's side. The protocol is in docs/control.md ("The Comm over the transport").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dtfm.net import ProtocolError, get_bytes, get_dict, get_int, get_list, get_str, short_id
from dtfm.train import CommError

__all__ = ["ACCEPTED", "MAX_RUN_BYTES", "MAX_TAG_FIELD_CHARS", "TensorMsg", "peer_name", "refuse", "verdict"]

logger = logging.getLogger("dtfm.control.dataplane")  # one log for the whole data plane

MAX_RUN_BYTES = 32
MAX_TAG_FIELD_CHARS = 256
_MAX_INT = 2**63 - 1
_FIELDS = frozenset({"run", "epoch", "seq", "tag", "dtype", "shape"})
ACCEPTED = {"ok": True}


def peer_name(peer: object) -> str:
    """A peer as log lines and errors name it."""
    return short_id(peer) if isinstance(peer, bytes) else repr(peer)


@dataclass(frozen=True)
class TensorMsg:
    """A TENSOR request's body, with every field checked."""

    run: bytes
    epoch: int
    seq: int
    tag: str
    header: dict  # the whole body: its dtype and shape are the tensor's header (dtfm.train.check_tensor)

    @classmethod
    def from_wire(cls, body: object) -> TensorMsg:
        d = get_dict(body, "tensor message")
        if set(d) != _FIELDS:
            raise ProtocolError(f"tensor message fields {sorted(map(str, d))}, expected {sorted(_FIELDS)}")
        get_str(d, "dtype", 16)
        get_list(d, "shape", 8)
        return cls(get_bytes(d, "run", 1, MAX_RUN_BYTES), get_int(d, "epoch", 0, _MAX_INT),
                   get_int(d, "seq", 0, _MAX_INT), get_str(d, "tag", MAX_TAG_FIELD_CHARS), d)


def refuse(name: str, tag: str, why: str, duplicate: bool = False) -> dict:
    """The reply refusing tensor `tag` from peer `name`, logged at DEBUG."""
    logger.debug("refused tensor %r from %s: %s", tag[:MAX_TAG_FIELD_CHARS], name, why)
    return {"ok": False, "why": why[:200], "dup": duplicate}


def verdict(reply: object, name: str, tag: str, resent: bool) -> CommError | None:
    """The receiver's answer to one tensor: None when it has it, else the error."""
    if type(reply) is not dict or type(reply.get("ok")) is not bool:
        return CommError(f"{name} answered {tag!r} with a malformed reply")
    if reply["ok"] or (resent and reply.get("dup") is True):
        return None
    why = reply.get("why")
    return CommError(f"{name} refused {tag!r}: {why if isinstance(why, str) else 'no reason given'}")
