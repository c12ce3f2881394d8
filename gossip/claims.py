"""Signed membership updates: a member's claim about itself and an accusation by a member.

Every holder of the swarm key is a peer we do not control, so no membership update is taken
on the word of whoever relays it:

- `Claim`: (peer id, incarnation, alive | left, host, port, region), signed by that peer. Only
  a peer can say that it is alive, where it is, or that it left. Others relay it unchanged.
- `Accusation`: (accuser, accused, incarnation, suspect | dead), signed by the accuser. It names
  an incarnation of the accused, and a member takes it only for the incarnation whose claim it
  holds, so an accusation never raises an incarnation.

Canonical encoding, as for measurement reports: a domain tag, then msgpack of a fixed list;
the signature covers exactly those bytes. On the wire an update is a list whose first element
says which of the two it is.

`ClaimVerifier` checks signatures and remembers the updates it verified, by (signer, subject,
incarnation, state), so a relayed update that was already checked costs a dict lookup rather
than an Ed25519 verification (50-100 us).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bytes, get_int, get_list, get_str, pack, verify_signature

from .members import MAX_HOST_LEN, MAX_INCARNATION, MAX_REGION_LEN, Member, MemberState

if TYPE_CHECKING:
    from dtfm.net import Identity

__all__ = ["Claim", "Accusation", "Update", "ClaimVerifier", "update_from_wire", "updates_from_wire",
           "SIGNATURE_LEN"]

CLAIM_DOMAIN = b"dtfm-member-claim-v1\x00"
ACCUSATION_DOMAIN = b"dtfm-member-accusation-v1\x00"
SIGNATURE_LEN = 64
KIND_CLAIM = 0
KIND_ACCUSATION = 1
CLAIM_STATES = (MemberState.ALIVE, MemberState.LEFT)
ACCUSATION_STATES = (MemberState.SUSPECT, MemberState.DEAD)


@dataclass(frozen=True)
class Claim:
    """A member's signed statement about itself."""

    peer_id: bytes
    incarnation: int
    state: MemberState  # ALIVE or LEFT
    host: str
    port: int
    region: str
    signature: bytes = b""

    def __post_init__(self) -> None:
        if len(self.peer_id) != PEER_ID_BYTES:
            raise ValueError(f"peer_id must be {PEER_ID_BYTES} bytes")
        if not 0 <= self.incarnation <= MAX_INCARNATION:
            raise ValueError("incarnation out of range")
        if self.state not in CLAIM_STATES:
            raise ValueError("a claim says alive or left")

    @property
    def subject(self) -> bytes:
        return self.peer_id

    @property
    def signer(self) -> bytes:
        return self.peer_id

    def key(self) -> tuple:
        """Order of claims about one peer: newer incarnation, then left over alive, then the
        rest of the fields (two claims of one incarnation differ only across restarts)."""
        return (self.incarnation, int(self.state), self.host, self.port, self.region)

    def member(self) -> Member:
        return Member(self.peer_id, self.incarnation, self.state, self.host, self.port, self.region)

    def signing_bytes(self) -> bytes:
        return CLAIM_DOMAIN + pack([self.peer_id, self.incarnation, int(self.state), self.host,
                                    self.port, self.region])

    @classmethod
    def create(cls, identity: Identity, incarnation: int, state: MemberState, host: str, port: int,
               region: str) -> "Claim":
        unsigned = cls(identity.peer_id, incarnation, state, host, port, region)
        return cls(identity.peer_id, incarnation, state, host, port, region,
                   identity.sign(unsigned.signing_bytes()))

    def verify(self) -> bool:
        return verify_signature(self.peer_id, self.signing_bytes(), self.signature)

    def to_wire(self) -> list:
        return [KIND_CLAIM, self.peer_id, self.incarnation, int(self.state), self.host, self.port,
                self.region, self.signature]

    @property
    def wire_size(self) -> int:
        """Upper bound of the packed size in bytes."""
        return 120 + len(self.host.encode()) + len(self.region.encode())

    @classmethod
    def from_wire(cls, obj: list) -> "Claim":
        if len(obj) != 8:
            raise ProtocolError("claim: expected a list of 8 fields")
        d = dict(zip(("kind", "id", "inc", "state", "host", "port", "region", "sig"), obj))
        state = MemberState(get_int(d, "state", 0, len(MemberState) - 1))
        if state not in CLAIM_STATES:
            raise ProtocolError(f"claim: state {state.name} is not alive or left")
        return cls(get_bytes(d, "id", PEER_ID_BYTES, PEER_ID_BYTES),
                   get_int(d, "inc", 0, MAX_INCARNATION), state,
                   get_str(d, "host", MAX_HOST_LEN), get_int(d, "port", 0, 65535),
                   get_str(d, "region", MAX_REGION_LEN),
                   get_bytes(d, "sig", SIGNATURE_LEN, SIGNATURE_LEN))


@dataclass(frozen=True)
class Accusation:
    """A member's signed statement that another member, at one incarnation, is suspect or dead."""

    accuser: bytes
    accused: bytes
    incarnation: int
    state: MemberState  # SUSPECT or DEAD
    signature: bytes = b""

    def __post_init__(self) -> None:
        if len(self.accuser) != PEER_ID_BYTES or len(self.accused) != PEER_ID_BYTES:
            raise ValueError(f"peer ids must be {PEER_ID_BYTES} bytes")
        if self.accuser == self.accused:
            raise ValueError("a member does not accuse itself")
        if not 0 <= self.incarnation <= MAX_INCARNATION:
            raise ValueError("incarnation out of range")
        if self.state not in ACCUSATION_STATES:
            raise ValueError("an accusation says suspect or dead")

    @property
    def subject(self) -> bytes:
        return self.accused

    @property
    def signer(self) -> bytes:
        return self.accuser

    def signing_bytes(self) -> bytes:
        return ACCUSATION_DOMAIN + pack([self.accuser, self.accused, self.incarnation, int(self.state)])

    @classmethod
    def create(cls, identity: Identity, accused: bytes, incarnation: int, state: MemberState) -> "Accusation":
        unsigned = cls(identity.peer_id, accused, incarnation, state)
        return cls(identity.peer_id, accused, incarnation, state, identity.sign(unsigned.signing_bytes()))

    def verify(self) -> bool:
        return verify_signature(self.accuser, self.signing_bytes(), self.signature)

    def to_wire(self) -> list:
        return [KIND_ACCUSATION, self.accuser, self.accused, self.incarnation, int(self.state), self.signature]

    @property
    def wire_size(self) -> int:
        return 150

    @classmethod
    def from_wire(cls, obj: list) -> "Accusation":
        if len(obj) != 6:
            raise ProtocolError("accusation: expected a list of 6 fields")
        d = dict(zip(("kind", "by", "of", "inc", "state", "sig"), obj))
        state = MemberState(get_int(d, "state", 0, len(MemberState) - 1))
        if state not in ACCUSATION_STATES:
            raise ProtocolError(f"accusation: state {state.name} is not suspect or dead")
        accuser = get_bytes(d, "by", PEER_ID_BYTES, PEER_ID_BYTES)
        accused = get_bytes(d, "of", PEER_ID_BYTES, PEER_ID_BYTES)
        if accuser == accused:
            raise ProtocolError("accusation: a member accuses itself")
        return cls(accuser, accused, get_int(d, "inc", 0, MAX_INCARNATION), state,
                   get_bytes(d, "sig", SIGNATURE_LEN, SIGNATURE_LEN))


Update = Claim | Accusation


def update_from_wire(obj: object) -> Update:
    if not isinstance(obj, list) or not obj:
        raise ProtocolError("update: expected a non-empty list")
    kind = get_int({"kind": obj[0]}, "kind", KIND_CLAIM, KIND_ACCUSATION)
    return Claim.from_wire(obj) if kind == KIND_CLAIM else Accusation.from_wire(obj)


def updates_from_wire(d: dict, key: str, max_len: int) -> tuple[Update, ...]:
    return tuple(update_from_wire(x) for x in get_list(d, key, max_len))


class ClaimVerifier:
    """Signature checks with a bounded cache of the updates found valid.

    One verifier may be shared by many state machines in one process (the simulator, the
    harness), so each distinct update is verified once there too.
    """

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.max_entries = max_entries
        self.checks = 0  # signatures actually verified
        self._valid: OrderedDict[tuple, Update] = OrderedDict()

    @staticmethod
    def _key(u: Update) -> tuple:
        return (type(u), u.signer, u.subject, u.incarnation, int(u.state))

    def remember(self, u: Update) -> None:
        """Record an update known to be valid (one we signed ourselves)."""
        key = self._key(u)
        self._valid[key] = u
        self._valid.move_to_end(key)
        while len(self._valid) > self.max_entries:
            self._valid.popitem(last=False)

    def verify(self, u: Update) -> bool:
        key = self._key(u)
        held = self._valid.get(key)
        if held is not None and held == u:
            self._valid.move_to_end(key)
            return True
        self.checks += 1
        if not u.verify():
            return False
        self.remember(u)
        return True
