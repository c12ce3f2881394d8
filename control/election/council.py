"""The council: who may vote, rooted in the operator and changed one voter at a time.

The voters of the election are a council of at most MAX_COUNCIL peers (3, 5 or 7 chosen by
the coordinator's `council_size`), never every peer of the allocation. Nothing a message says
alone decides who they are:

- The first council is named by an operator's signed operation, the **root**: a run's start
  (its `council` argument) or a `council` operation that re-roots a swarm whose council lost
  its quorum. The root's bytes travel opaque here; the control plane checks the operator's
  signature and that the root names exactly `root_voters` (control/operator.py
  `check_council_root`) before a `Council` is used.
- Every later council is one **link** further: the coordinator of `term`, elected by a quorum
  of the council before (its `Certificate` over exactly those voters), signs the council after,
  which differs from the one before by one voter (one added or one removed). So every quorum
  of the old council meets every quorum of the new (certificate.py), and the links from the
  root to now are a proof, checkable by any peer, that each council came from the one before.
- The root also names the council's `size` (3, 5 or 7): a voter is added only to a council
  smaller than that. A configured peer also checks each change it had not seen against its
  own gossip (control/epoch/machine.py): an added voter is a live member, a removed one is not
  (unless the council is above its size). So a coordinator cannot grow the council with its
  own identities, nor remove live voters to make room; it can only fill the seat of a dead
  voter (with a live member of the swarm).

A `Council` is the root, its voters and the links since; `voters` is the newest. An
allocation carries its run's council (`Allocation.council`, this module's `encode()`): a peer
without a configuration (a joiner) checks the whole chain; a configured peer checks that it
extends its own by at most one link (state.py `may_apply`). At most MAX_LINKS links follow a
root: a council that reached that many changes is re-rooted by the operator (the coordinator
then stops changing it and says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bytes, get_int, get_list, pack, unpack_untrusted, verify_signature

from .certificate import Certificate, CertificateCheck, config_digest
from .limits import MAX_TERM, SIGNATURE_BYTES, check_voters

__all__ = [
    "COUNCIL_SIZES", "LINK_DOMAIN", "MAX_COUNCIL", "MAX_COUNCIL_BYTES", "MAX_LINKS", "MAX_ROOT_BYTES", "Council",
    "CouncilLink", "change_refusal", "link_payload",
]

MAX_COUNCIL = 7  # voters of a council
COUNCIL_SIZES = (3, 5, 7)  # the sizes a coordinator may aim for (`council_size`)
MAX_LINKS = 64  # changes after a root; then the operator re-roots
MAX_ROOT_BYTES = 4096 + 128  # an operator's signed operation, encoded (operator.MAX_OP_BYTES + its signature)
MAX_COUNCIL_BYTES = MAX_ROOT_BYTES + 1024 + MAX_LINKS * 1024  # a council on the wire
LINK_DOMAIN = b"dtfm-council-link-v1\x00"
_MAX_TIME_MS = 2**53


def link_payload(term: int, epoch: int, before: tuple[bytes, ...], after: tuple[bytes, ...]) -> bytes:
    """What a coordinator signs to change the council `before` into `after` in the allocation
    of (`term`, `epoch`)."""
    return (LINK_DOMAIN + term.to_bytes(8, "big") + epoch.to_bytes(8, "big") + config_digest(before)
            + config_digest(after))


def change_refusal(before: tuple[bytes, ...], after: tuple[bytes, ...]) -> str | None:
    """None if `after` is one voter away from `before` (one added or one removed) and within
    MAX_COUNCIL voters; else why not."""
    added = set(after) - set(before)
    removed = set(before) - set(after)
    if len(after) > MAX_COUNCIL:
        return f"a council has at most {MAX_COUNCIL} voters, the change makes {len(after)}"
    if len(added) + len(removed) != 1:
        return (f"a council changes one voter at a time: this change adds {len(added)} and removes "
                f"{len(removed)}")
    return None


@dataclass(frozen=True)
class CouncilLink:
    """One change of the council, made by the allocation of (term, `epoch`): `certificate`
    elects the issuer in its term over the council before (its voters); `after` is the council
    after; `signature` is the issuer's of `link_payload(term, epoch, before, after)`."""

    certificate: Certificate
    after: tuple[bytes, ...]
    signature: bytes
    epoch: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "after", check_voters(tuple(self.after)))
        if type(self.epoch) is not int or not 1 <= self.epoch <= MAX_TERM:
            raise ValueError(f"a link's epoch must be in [1, {MAX_TERM}]")
        if type(self.signature) is not bytes or len(self.signature) != SIGNATURE_BYTES:
            raise ValueError(f"a link's signature is {SIGNATURE_BYTES} bytes")
        why = change_refusal(self.before, self.after)
        if why is not None:
            raise ValueError(why)

    @property
    def issuer(self) -> bytes:
        return self.certificate.candidate

    @property
    def term(self) -> int:
        return self.certificate.term

    @property
    def before(self) -> tuple[bytes, ...]:
        return self.certificate.voters

    def to_wire(self) -> list:
        return [self.certificate.to_wire(), list(self.after), self.epoch, self.signature]

    @classmethod
    def from_wire(cls, obj: object) -> CouncilLink:
        if type(obj) is not list or len(obj) != 4:
            raise ProtocolError("council link: expected [certificate, after, epoch, signature]")
        after = tuple(get_bytes({"v": x}, "v", PEER_ID_BYTES, PEER_ID_BYTES)
                      for x in get_list({"after": obj[1]}, "after", MAX_COUNCIL))
        try:
            return cls(Certificate.from_wire(obj[0]), after,
                       get_bytes({"s": obj[3]}, "s", SIGNATURE_BYTES, SIGNATURE_BYTES),
                       get_int({"epoch": obj[2]}, "epoch", 1, MAX_TERM))
        except ValueError as e:
            raise ProtocolError(f"council link: {e}") from None


@dataclass(frozen=True)
class Council:
    """A root (an operator's signed operation naming `root_voters`, signed at `root_at_ms`)
    and the links since (module docstring)."""

    root: bytes
    root_voters: tuple[bytes, ...]
    root_at_ms: int
    size: int = 5  # the council size the root names: a voter is added only below it
    links: tuple[CouncilLink, ...] = ()

    def __post_init__(self) -> None:
        if type(self.root) is not bytes or len(self.root) > MAX_ROOT_BYTES:
            raise ValueError(f"a council's root is at most {MAX_ROOT_BYTES} bytes")
        voters = check_voters(tuple(self.root_voters))
        if len(voters) > MAX_COUNCIL:
            raise ValueError(f"a council has at most {MAX_COUNCIL} voters, the root names {len(voters)}")
        object.__setattr__(self, "root_voters", voters)
        if type(self.root_at_ms) is not int or not 0 <= self.root_at_ms <= _MAX_TIME_MS:
            raise ValueError("root_at_ms must be an integer of milliseconds")
        if type(self.size) is not int or not 1 <= self.size <= MAX_COUNCIL:
            raise ValueError(f"a council's size is 1 to {MAX_COUNCIL} voters, got {self.size!r}")
        object.__setattr__(self, "links", tuple(self.links))
        if len(self.links) > MAX_LINKS:
            raise ValueError(f"a council has at most {MAX_LINKS} links after its root, got {len(self.links)}")

    @property
    def voters(self) -> tuple[bytes, ...]:
        """The council now: the last link's, else the root's."""
        return self.links[-1].after if self.links else self.root_voters

    @property
    def full(self) -> bool:
        """No further link fits: the operator re-roots before the council changes again."""
        return len(self.links) >= MAX_LINKS

    def same_root(self, other: Council) -> bool:
        return ((self.root, self.root_voters, self.root_at_ms, self.size)
                == (other.root, other.root_voters, other.root_at_ms, other.size))

    def extended(self, link: CouncilLink) -> Council:
        if link.before != self.voters:
            raise ValueError("the link does not start from this council")
        return Council(self.root, self.root_voters, self.root_at_ms, self.size, (*self.links, link))

    def truncated(self, n: int) -> Council:
        """This council's first `n` links (an undone change left out)."""
        return Council(self.root, self.root_voters, self.root_at_ms, self.size, self.links[:n])

    def since(self, own: Council | None) -> tuple[CouncilLink, ...]:
        """The links of this council after the longest prefix it shares with `own` (all of them
        when `own` is None or of another root): the changes a peer holding `own` had not seen."""
        if own is None or not own.same_root(self):
            return self.links
        n = 0
        for a, b in zip(own.links, self.links):
            if a != b:
                break
            n += 1
        return self.links[n:]

    def verify(self, checker: CertificateCheck, start: int = 0) -> str | None:
        """None if every link from index `start` on follows from the council before it: its
        certificate is over exactly that council and a quorum of it signed (each signature
        checked, once per certificate and council: `checker` caches), its issuer signed the
        change, the change is one voter, and terms do not go back; else why not. The root
        itself is the control plane's to check (control/operator.py)."""
        current = self.links[start - 1].after if start else self.root_voters
        made = (self.links[start - 1].term, self.links[start - 1].epoch) if start else (0, 0)
        for i, link in enumerate(self.links[start:], start):
            if link.before != current:
                return f"link {i} changes another council than the one before it"
            if (link.term, link.epoch) <= made:
                return (f"link {i} is of term {link.term} epoch {link.epoch}, not after the link before it "
                        f"(term {made[0]} epoch {made[1]})")
            if len(link.after) > len(current) and len(current) >= self.size:
                return f"link {i} adds a voter to a council of {len(current)}, its root's size"
            why = checker.check(link.certificate, current, config_digest(current))
            if why is not None:
                return f"link {i}: its certificate: {why}"
            if not verify_signature(link.issuer, link_payload(link.term, link.epoch, link.before, link.after),
                                    link.signature):
                return f"link {i} is not signed by its issuer"
            current, made = link.after, (link.term, link.epoch)
        return None

    def encode(self) -> bytes:
        return pack([self.root, list(self.root_voters), self.root_at_ms, self.size,
                     [link.to_wire() for link in self.links]])

    @classmethod
    def decode(cls, data: bytes) -> Council:
        """The council in bytes from the network; raises only ProtocolError (no signature is
        checked here: `verify`)."""
        obj = unpack_untrusted(data, max_len=MAX_COUNCIL_BYTES)
        if type(obj) is not list or len(obj) != 5:
            raise ProtocolError("council: expected [root, voters, root time, size, links]")
        d = dict(zip(("root", "voters", "at", "size", "links"), obj))
        voters = tuple(get_bytes({"v": x}, "v", PEER_ID_BYTES, PEER_ID_BYTES)
                       for x in get_list(d, "voters", MAX_COUNCIL))
        links = tuple(CouncilLink.from_wire(x) for x in get_list(d, "links", MAX_LINKS))
        try:
            council = cls(get_bytes(d, "root", 0, MAX_ROOT_BYTES), voters, get_int(d, "at", 0, _MAX_TIME_MS),
                          get_int(d, "size", 1, MAX_COUNCIL), links)
        except ValueError as e:
            raise ProtocolError(f"council: {e}") from None
        if council.encode() != bytes(data):
            raise ProtocolError("council: not in its canonical encoding")
        return council

    def describe(self) -> str:
        return f"{len(self.voters)} voters, {len(self.links)} change(s) since its root"

