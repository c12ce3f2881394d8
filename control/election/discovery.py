"""Finding the coordinator from a peer that does not hear it: the question, the answers, and
what to tell the operator when no coordinator can be found.

Heartbeats go to the voters of the coordinator's configuration only, so a peer outside it (a
fresh joiner, a peer restarted after the run reconfigured without it) never hears who the
coordinator is, and its own pre-votes go unanswered (voters count only their configuration's
messages). Such a peer asks peers it knows (ControlMsg.COORDINATOR, an empty request) and each
answers with a `CoordinatorAnswer`: its term, its role, whether it heard its coordinator within
its lease, the size of its configuration, and the certificate of the coordinator it recognises
(or only heard of). The asker never takes an answer's word: it hands each certificate to its
`ElectionState.learn`, which checks every signature (state.py), and forwards an operator's
request only to a coordinator whose certificate verified there.

`explain` turns the answers into the reason an operator reads when no coordinator is found:
how many peers answered, who holds a lease of which coordinator, and how many voters answer.
Everything here is pure; the asking is ElectionService.find_coordinator (service.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtfm.net import ProtocolError, get_bool, get_dict, get_int, get_str, short_id

from .certificate import Certificate, quorum
from .limits import MAX_TERM, MAX_VOTERS

__all__ = ["CoordinatorAnswer", "Discovery", "explain"]

ROLES = ("follower", "pre-candidate", "candidate", "coordinator")
MAX_NAMED = 4  # peers named one by one in an explanation; the rest are counted


@dataclass(frozen=True)
class CoordinatorAnswer:
    """One peer's answer to "who is the coordinator?" (untrusted: the certificate is checked
    by the asker's election before it is used)."""

    term: int
    role: str
    recognised: bool  # the certificate's candidate is the coordinator this peer recognises
    in_lease: bool  # this peer is the coordinator, or heard it within its lease
    voters: int  # the size of this peer's configuration (0: none yet)
    certificate: Certificate | None

    @property
    def coordinator(self) -> bytes | None:
        return None if self.certificate is None else self.certificate.candidate

    def to_wire(self) -> dict:
        return {"term": self.term, "role": self.role, "recognised": self.recognised, "lease": self.in_lease,
                "voters": self.voters, "cert": None if self.certificate is None else self.certificate.to_wire()}

    @classmethod
    def from_wire(cls, obj: object) -> CoordinatorAnswer:
        """The answer in a decoded reply; raises only ProtocolError."""
        d = get_dict(obj, "COORDINATOR answer")
        role = get_str(d, "role", 16)
        if role not in ROLES:
            raise ProtocolError(f"COORDINATOR answer: unknown role {role!r}")
        cert = d.get("cert")
        return cls(get_int(d, "term", 0, MAX_TERM), role, get_bool(d, "recognised"), get_bool(d, "lease"),
                   get_int(d, "voters", 0, MAX_VOTERS),
                   None if cert is None else Certificate.from_wire(cert))


@dataclass(frozen=True)
class Discovery:
    """What asking peers found: the coordinator to forward to (None: none), why none was found
    (for the operator), and how many of the answering peers have a configuration (a peer
    without one may make a first configuration only in a swarm where none has one)."""

    coordinator: bytes | None
    why: str
    configured: int


def explain(asked: int, answers: dict[bytes, CoordinatorAnswer | str], voters: tuple[bytes, ...],
            me: bytes) -> str:
    """Why no coordinator was found, from the answers (a peer's answer, or why it gave none)
    of the `asked` peers and this peer's own configuration `voters`."""
    got = {p: a for p, a in answers.items() if isinstance(a, CoordinatorAnswer)}
    parts = [f"{len(got)} of the {asked} peers asked answered"]
    if not asked:
        parts = ["no other live peer is known to this one: is its --bootstrap address right?"]
    leases = [(p, a) for p, a in got.items() if a.in_lease and a.coordinator is not None]
    for p, a in sorted(leases, key=lambda x: x[0])[:MAX_NAMED]:
        assert a.coordinator is not None
        who = "itself" if a.coordinator == p else short_id(a.coordinator)
        parts.append(f"{short_id(p)} holds a lease of coordinator {who} (term {a.term}), whose certificate "
                     "this peer could not verify")
    heard = [(p, a) for p, a in got.items() if not a.in_lease and a.coordinator is not None]
    for p, a in sorted(heard, key=lambda x: x[0])[:MAX_NAMED]:
        assert a.coordinator is not None
        parts.append(f"{short_id(p)} last heard of coordinator {short_id(a.coordinator)} (term {a.term}), "
                     "not within its lease")
    if voters:
        others = [v for v in voters if v != me]
        answering = sum(1 for v in others if v in got) + (me in voters)
        parts.append(f"{answering} of the {len(voters)} voters of this peer's configuration answer "
                     f"({quorum(len(voters))} elect a coordinator)")
    else:
        sizes = sorted({a.voters for a in got.values() if a.voters})
        if sizes:
            parts.append(f"this peer is no voter; the peers that answered have configurations of "
                         f"{', '.join(map(str, sizes))} voters, a quorum of which must be reachable to elect one")
    unreachable = [p for p, a in answers.items() if not isinstance(a, CoordinatorAnswer)]
    if unreachable:
        shown = ", ".join(f"{short_id(p)} ({answers[p]})" for p in sorted(unreachable)[:MAX_NAMED])
        more = len(unreachable) - MAX_NAMED
        parts.append(f"no answer from {shown}" + (f" and {more} more" if more > 0 else ""))
    return "; ".join(parts)

