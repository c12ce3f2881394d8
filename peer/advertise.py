"""Which address this peer tells the swarm to dial: the `--advertise` address, else the listen
address, else (listening on 0.0.0.0 or ::) the address its peers see it at, once one of them
has dialled it back there.

A wildcard listen address cannot be dialled, and 127.0.0.1 reaches only this machine: on three
hosts, every member advertising 127.0.0.1:7450 makes a peer that lost its connection dial
itself. So a peer on a wildcard asks the peers it connects to "what address do you see me
at?" (ADDRESS_QUERY); the answering peer dials the host the connection came from at the port
the asker claims, checks that the handshake there yields the asker's verified peer id, and
says so. The first confirmed answer is adopted. Until then the peer advertises nothing
dialable (its peers still reach it over the connections it made), unless every peer is on
loopback: a loopback listen address, or a bootstrap list of loopback addresses only.

Sans-IO: `Advertiser` decides; dtfm.peer.discovery asks, answers and dials.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from dtfm.net import Address

from .pex import AddressSeen


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Advertiser:
    """The advertised address of one peer. `listen` is the bound listen address (real port)."""

    listen: Address
    configured: Address | None = None
    bootstrap: tuple[Address, ...] = ()
    address: Address | None = field(init=False, default=None)
    confirmed_by: bytes | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.address = self._initial()

    def _initial(self) -> Address | None:
        if self.configured is not None:
            return Address(self.configured.host, self.configured.port or self.listen.port)
        if not self.listen.is_unspecified:
            return self.listen
        if self.bootstrap and all(is_loopback(a.host) for a in self.bootstrap):
            host = self.bootstrap[0].host
            return Address("127.0.0.1" if host == "localhost" else host, self.listen.port)
        return None

    @property
    def needs_confirmation(self) -> bool:
        """True while nothing dialable is advertised: ask the peers we meet."""
        return self.address is None

    @property
    def loopback_ok(self) -> bool:
        """Whether a loopback address may be advertised: only when every peer is on this
        machine, as far as this peer can tell."""
        return is_loopback(self.listen.host) or (
            bool(self.bootstrap) and all(is_loopback(a.host) for a in self.bootstrap))

    def query_port(self) -> int:
        return self.listen.port

    def observed(self, seen: AddressSeen, by: bytes) -> tuple[Address | None, str]:
        """A peer's answer to our ADDRESS_QUERY: (the address now advertised, None if the
        answer was not adopted; the reason)."""
        if not self.needs_confirmation:
            return None, f"already advertising {self.address}"
        if not seen.confirmed:
            return None, f"{seen.address} not confirmed: the dial back did not reach us"
        if seen.address.port != self.listen.port:
            return None, f"{seen.address} is not our listen port {self.listen.port}"
        if seen.address.is_unspecified:
            return None, f"{seen.address} is a wildcard"
        if is_loopback(seen.address.host) and not self.loopback_ok:
            return None, f"{seen.address} is loopback but our peers are not all on this machine"
        self.address = seen.address
        self.confirmed_by = by
        return self.address, "confirmed by a dial back"
