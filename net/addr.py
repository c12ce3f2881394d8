"""Network addresses as `HOST:PORT` text, with IPv6 in brackets (`[::1]:7450`)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MAX_HOST_LEN = 253  # longest DNS name


class AddressError(ValueError):
    """A `HOST:PORT` string that does not parse; str() says what is wrong."""


@dataclass(frozen=True, order=True)
class Address:
    host: str
    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise AddressError("address needs a host")
        if len(self.host) > MAX_HOST_LEN:
            raise AddressError(f"host name longer than {MAX_HOST_LEN} characters")
        if any(c.isspace() or c in "[]/" for c in self.host):
            raise AddressError(f"host {self.host!r} contains a space, bracket or slash")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise AddressError(f"port must be an integer, got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise AddressError(f"port {self.port} is outside 0..65535")

    @classmethod
    def parse(cls, text: str) -> "Address":
        """Parse `HOST:PORT`, `[V6]:PORT`; raises AddressError with a clear message."""
        text = text.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise AddressError(f"{text!r}: expected [IPV6]:PORT")
            port_text = rest[1:]
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep:
                raise AddressError(f"{text!r}: expected HOST:PORT")
            if ":" in host:
                raise AddressError(f"{text!r}: write IPv6 addresses in brackets, [::1]:PORT")
        if not port_text.isdigit():
            raise AddressError(f"{text!r}: port {port_text!r} is not a number")
        return cls(host, int(port_text))

    @property
    def is_unspecified(self) -> bool:
        """True for 0.0.0.0 and ::, which mean "every interface" and cannot be dialled."""
        try:
            return ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            return False

    def __str__(self) -> str:
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"
