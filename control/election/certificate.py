"""Proof of election: signed votes, and the certificate a coordinator carries.

A granted vote is the voter's Ed25519 signature (its peer id is its public key) of

    VOTE_DOMAIN || term (8 bytes, big-endian) || candidate (32 bytes) || configuration digest (32 bytes)

where the configuration digest (`config_digest`) is blake2b-256 of CONFIG_DOMAIN and the sorted
voter ids of the configuration the candidate stood in. A voter signs at most one candidate per
term (its vote is persisted before it is signed and sent), so a certificate, the votes of a
quorum, names the one coordinator of its term.

The quorum (`quorum(n)`) of n voters is a plain majority for n <= 3 and ceil((n + 2) / 2) from
n = 4 on: the smallest count such that any two quorums share at least two voters. One voter
that lies (signs votes for two candidates in one term) is then never enough to make two
certificates of one term: they share an honest voter, who signs one vote per term. The cost:
for an odd number of voters one vote more than a majority, so one crash fewer is tolerated
(5 voters: 4 votes, 1 crash; 7: 5, 2); for an even number nothing changes. Two quorums of two
configurations that differ by one voter (an allocation changes at most one) still share two
voters from 4 voters on.

A `Certificate` holds the term, the candidate, the configuration (its voters, sorted) and the
votes as (index into the voters, signature), indices increasing. Its wire form is bounded
(MAX_VOTERS voters, as many votes) and checked field by field before any signature is looked
at; a certificate is a quorum of its own voters by construction.

`CertificateCheck` verifies a certificate against a configuration (a peer's own, or for a peer
without one the certificate's): the votes of that configuration's voters must be a quorum of
it, and each of their signatures must verify. Signatures are checked at most once per
(certificate, configuration): the answer is cached, keyed by their digests, in a bounded LRU.
Everything here is pure (nacl's verification is deterministic and does no I/O), so the
sans-IO `ElectionState` uses it directly.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from dataclasses import dataclass, field

from dtfm.net import (
    PEER_ID_BYTES,
    ProtocolError,
    get_bytes,
    get_dict,
    get_int,
    get_list,
    short_id,
    verify_signature,
)

from .limits import MAX_TERM, MAX_VOTERS, SIGNATURE_BYTES, check_voters

__all__ = [
    "CONFIG_DOMAIN", "VOTE_DOMAIN", "Certificate", "CertificateCheck", "config_digest", "quorum", "vote_payload",
]

VOTE_DOMAIN = b"dtfm-election-vote-v1\x00"
CONFIG_DOMAIN = b"dtfm-election-config-v1\x00"
_CERT_DOMAIN = b"dtfm-election-certificate-v1\x00"  # the cache key's hash only; nothing is signed with it
DIGEST_BYTES = 32
CACHE_ENTRIES = 256  # (certificate, configuration) pairs whose answer is kept


def quorum(n: int) -> int:
    """The votes (acks) that make a decision of n voters: any two such sets share a voter, and
    from n = 4 on two of them (see the module docstring)."""
    if n <= 3:
        return n // 2 + 1
    return (n + 3) // 2


def config_digest(voters: tuple[bytes, ...]) -> bytes:
    """The digest of a configuration (its voters, sorted) that votes are signed over."""
    return hashlib.blake2b(CONFIG_DOMAIN + b"".join(voters), digest_size=DIGEST_BYTES).digest()


def vote_payload(term: int, candidate: bytes, config: bytes) -> bytes:
    """What a voter signs to vote for `candidate` in `term` in the configuration `config`."""
    if type(term) is not int or not 1 <= term <= MAX_TERM:
        raise ValueError(f"term must be an integer in [1, {MAX_TERM}], got {term!r}")
    return VOTE_DOMAIN + term.to_bytes(8, "big") + candidate + config


@dataclass(frozen=True)
class Certificate:
    """The votes of a quorum of `voters` for `candidate` in `term`."""

    term: int
    candidate: bytes
    voters: tuple[bytes, ...]  # the configuration the candidate stood in, sorted
    votes: tuple[tuple[int, bytes], ...]  # (index into voters, signature), indices increasing
    config: bytes = field(init=False, repr=False, compare=False)  # config_digest(voters)
    digest: bytes = field(init=False, repr=False, compare=False)  # names this certificate (the cache's key)

    def __post_init__(self) -> None:
        if type(self.term) is not int or not 1 <= self.term <= MAX_TERM:
            raise ValueError(f"certificate term must be an integer in [1, {MAX_TERM}], got {self.term!r}")
        if type(self.candidate) is not bytes or len(self.candidate) != PEER_ID_BYTES:
            raise ValueError(f"certificate candidate must be a {PEER_ID_BYTES}-byte peer id")
        object.__setattr__(self, "voters", check_voters(self.voters))
        if self.candidate not in self.voters:
            raise ValueError("the certificate's candidate is not one of its voters")
        votes = tuple((i, s) for i, s in self.votes)
        for i, s in votes:
            if type(i) is not int or not 0 <= i < len(self.voters):
                raise ValueError(f"vote index {i!r} outside the {len(self.voters)} voters")
            if type(s) is not bytes or len(s) != SIGNATURE_BYTES:
                raise ValueError(f"a vote's signature is {SIGNATURE_BYTES} bytes")
        if any(a >= b for (a, _), (b, _) in itertools.pairwise(votes)):
            raise ValueError("vote indices must be increasing")
        if len(votes) < quorum(len(self.voters)):
            raise ValueError(f"{len(votes)} votes are not a quorum of {len(self.voters)} voters "
                             f"({quorum(len(self.voters))})")
        object.__setattr__(self, "votes", votes)
        config = config_digest(self.voters)
        object.__setattr__(self, "config", config)
        h = hashlib.blake2b(_CERT_DOMAIN + self.term.to_bytes(8, "big") + self.candidate + config,
                            digest_size=DIGEST_BYTES)
        for i, s in votes:
            h.update(i.to_bytes(2, "big") + s)
        object.__setattr__(self, "digest", h.digest())

    @classmethod
    def of(cls, term: int, candidate: bytes, voters: tuple[bytes, ...], signatures: dict[bytes, bytes]) -> Certificate:
        """The certificate of the signatures of `voters` (others are left out)."""
        return cls(term, candidate, voters, tuple((i, signatures[v]) for i, v in enumerate(voters) if v in signatures))

    def signed(self) -> list[tuple[bytes, bytes]]:
        """(voter, signature) of every vote."""
        return [(self.voters[i], s) for i, s in self.votes]

    @property
    def signers(self) -> frozenset[bytes]:
        return frozenset(self.voters[i] for i, _ in self.votes)

    def to_wire(self) -> dict:
        return {"t": self.term, "c": self.candidate, "v": list(self.voters), "s": [[i, s] for i, s in self.votes]}

    @classmethod
    def from_wire(cls, obj: object) -> Certificate:
        """The certificate in a decoded wire value; raises only ProtocolError. Bounded before
        anything is built: MAX_VOTERS voters and votes; no signature is checked here."""
        d = get_dict(obj, "certificate")
        if len(d) != 4:
            raise ProtocolError(f"certificate: {len(d)} fields, expected 4")
        voters = tuple(get_bytes({"v": x}, "v", PEER_ID_BYTES, PEER_ID_BYTES) for x in get_list(d, "v", MAX_VOTERS))
        votes = []
        for x in get_list(d, "s", MAX_VOTERS):
            if type(x) is not list or len(x) != 2:
                raise ProtocolError("certificate: a vote is a pair [index, signature]")
            pair = {"i": x[0], "s": x[1]}
            index = get_int(pair, "i", 0, MAX_VOTERS - 1)
            votes.append((index, get_bytes(pair, "s", SIGNATURE_BYTES, SIGNATURE_BYTES)))
        try:
            return cls(get_int(d, "t", 1, MAX_TERM), get_bytes(d, "c", PEER_ID_BYTES, PEER_ID_BYTES), voters,
                       tuple(votes))
        except ValueError as e:
            raise ProtocolError(f"certificate: {e}") from None


class CertificateCheck:
    """Verifies certificates against configurations, each pair at most once (see the module
    docstring)."""

    def __init__(self, entries: int = CACHE_ENTRIES) -> None:
        self._entries = entries
        self._cache: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
        self.verified = 0  # signatures checked so far (tests read it)

    def check(self, cert: Certificate, voters: tuple[bytes, ...], config: bytes) -> str | None:
        """None if the votes of `voters` (whose digest is `config`) in `cert` are a quorum of
        them and every one of their signatures verifies; else why not."""
        members = frozenset(voters)
        mine = [(v, s) for v, s in cert.signed() if v in members]
        need = quorum(len(voters))
        if len(mine) < need:
            return f"signed by {len(mine)} of the {len(voters)} voters, {need} needed"
        key = cert.digest + config
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        payload = vote_payload(cert.term, cert.candidate, cert.config)
        why = None
        for v, s in mine:
            self.verified += 1
            if not verify_signature(v, payload, s):
                why = f"the vote of {short_id(v)} is not its signature"
                break
        self._cache[key] = why
        if len(self._cache) > self._entries:
            self._cache.popitem(last=False)
        return why
