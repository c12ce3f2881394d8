"""Network scenario files: regions with peer counts and links, as in the DT-FM paper's experiments.

Format (TOML)::

    name = "worldwide"
    [defaults]                 # optional: any region pair without a [[link]]
    inter_delay_ms = 0
    inter_bandwidth_gbps = 1
    [[region]]
    name = "Oregon"
    peers = 8
    delay_ms = 5               # one-way, between two peers of this region
    bandwidth_gbps = 2
    compute_scale = 1.0        # optional extension: relative compute speed of its peers
    memory_gib = 16            # optional extension: memory per peer
    [[link]]
    a = "Oregon"
    b = "Virginia"
    delay_ms = 67              # one-way; links are symmetric
    bandwidth_gbps = 0.79

Peers are numbered in file order. Matrices use scenario units (ms one-way, Gbps); a peer's
entry with itself is 0 ms and infinite bandwidth.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import numpy as np

__all__ = ["Region", "Scenario", "ScenarioError", "builtin_scenarios", "load_scenario", "parse_scenario"]


class ScenarioError(ValueError):
    """A scenario file that cannot be used, with the reason."""


@dataclass(frozen=True)
class Region:
    name: str
    peers: int
    delay_ms: float  # one-way delay between two peers of this region
    bandwidth_gbps: float  # bandwidth between two peers of this region
    compute_scale: float = 1.0  # relative compute speed of each peer (1.0 = reference GPU)
    memory_gib: float | None = None  # memory per peer; None = unconstrained


@dataclass(frozen=True)
class Scenario:
    name: str
    regions: tuple[Region, ...]
    # (a, b) -> (delay_ms, bandwidth_gbps) for a != b; stored for both orders.
    links: dict[tuple[str, str], tuple[float, float]] = field(repr=False)
    description: str = ""

    @property
    def n_peers(self) -> int:
        return sum(r.peers for r in self.regions)

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def link(self, a: str, b: str) -> tuple[float, float]:
        """One-way delay (ms) and bandwidth (Gbps) between a peer of region a and one of b."""
        if a == b:
            r = self.region(a)
            return r.delay_ms, r.bandwidth_gbps
        return self.links[(a, b)]

    def peer_regions(self) -> list[str]:
        """Region name of every peer, in peer order."""
        return [r.name for r in self.regions for _ in range(r.peers)]

    def delay_ms(self) -> np.ndarray:
        """(N, N) one-way delay in ms; zero on the diagonal."""
        return self._matrix(0)

    def bandwidth_gbps(self) -> np.ndarray:
        """(N, N) bandwidth in Gbps; infinite on the diagonal."""
        return self._matrix(1)

    def compute_scale(self) -> np.ndarray:
        return np.array([r.compute_scale for r in self.regions for _ in range(r.peers)], dtype=float)

    def _matrix(self, which: int) -> np.ndarray:
        names = self.peer_regions()
        n = len(names)
        out = np.empty((n, n), dtype=float)
        for i, a in enumerate(names):
            for j, b in enumerate(names):
                out[i, j] = self.link(a, b)[which]
        np.fill_diagonal(out, 0.0 if which == 0 else math.inf)
        return out

    def scaled(self, n_peers: int) -> "Scenario":
        """The same regions and links with n_peers in all, keeping the regions' proportions.

        Largest-remainder rounding; every region with peers keeps at least one while
        n_peers allows, so a small test swarm still spans the scenario's regions.
        """
        if n_peers < 1:
            raise ScenarioError(f"need at least one peer, got {n_peers}")
        total = self.n_peers
        active = [r for r in self.regions if r.peers > 0]
        quotas = [r.peers * n_peers / total for r in active]
        counts = [int(q) for q in quotas]
        if n_peers >= len(active):
            counts = [max(c, 1) for c in counts]
        while sum(counts) > n_peers:  # the at-least-one floor overshot: take from the largest
            i = max(range(len(counts)), key=lambda k: (counts[k] - quotas[k], counts[k]))
            counts[i] -= 1
        order = sorted(range(len(active)), key=lambda k: (-(quotas[k] - counts[k]), k))
        k = 0
        while sum(counts) < n_peers:
            counts[order[k % len(order)]] += 1
            k += 1
        regions = tuple(
            Region(r.name, c, r.delay_ms, r.bandwidth_gbps, r.compute_scale, r.memory_gib)
            for r, c in zip(active, counts)
        )
        return Scenario(self.name, regions, self.links, self.description)


def _num(table: dict, key: str, where: str, *, positive: bool = False) -> float:
    if key not in table:
        raise ScenarioError(f"{where}: missing {key!r}")
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScenarioError(f"{where}: {key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ScenarioError(f"{where}: {key} must be {'positive' if positive else 'non-negative'}, got {value}")
    return value


def parse_scenario(data: dict, source: str = "<scenario>") -> Scenario:
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"{source}: missing scenario name")
    raw_regions = data.get("region")
    if not isinstance(raw_regions, list) or not raw_regions:
        raise ScenarioError(f"{source}: no [[region]] tables")
    regions = []
    for k, r in enumerate(raw_regions):
        where = f"{source}: region #{k + 1}"
        rname = r.get("name")
        if not isinstance(rname, str) or not rname:
            raise ScenarioError(f"{where}: missing name")
        where = f"{source}: region {rname!r}"
        peers = r.get("peers")
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 0:
            raise ScenarioError(f"{where}: peers must be a non-negative integer, got {peers!r}")
        memory = _num(r, "memory_gib", where, positive=True) if "memory_gib" in r else None
        compute = _num(r, "compute_scale", where, positive=True) if "compute_scale" in r else 1.0
        regions.append(Region(rname, peers, _num(r, "delay_ms", where),
                              _num(r, "bandwidth_gbps", where, positive=True), compute, memory))
    names = [r.name for r in regions]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{source}: duplicate region names")
    links: dict[tuple[str, str], tuple[float, float]] = {}
    for k, link in enumerate(data.get("link", [])):
        where = f"{source}: link #{k + 1}"
        a, b = link.get("a"), link.get("b")
        for end in (a, b):
            if end not in names:
                raise ScenarioError(f"{where}: unknown region {end!r}")
        if a == b:
            raise ScenarioError(f"{where}: a link joins two different regions")
        value = (_num(link, "delay_ms", where), _num(link, "bandwidth_gbps", where, positive=True))
        if (a, b) in links:
            raise ScenarioError(f"{where}: {a}-{b} given twice")
        links[(a, b)] = links[(b, a)] = value
    defaults = data.get("defaults", {})
    for a in names:
        for b in names:
            if a != b and (a, b) not in links:
                if "inter_delay_ms" not in defaults or "inter_bandwidth_gbps" not in defaults:
                    raise ScenarioError(f"{source}: no link between {a!r} and {b!r} and no [defaults]")
                links[(a, b)] = (_num(defaults, "inter_delay_ms", f"{source}: defaults"),
                                 _num(defaults, "inter_bandwidth_gbps", f"{source}: defaults", positive=True))
    scenario = Scenario(name, tuple(regions), links, str(data.get("description", "")))
    if scenario.n_peers == 0:
        raise ScenarioError(f"{source}: the scenario has no peers")
    return scenario


def builtin_scenarios() -> list[str]:
    return sorted(p.name[:-5] for p in files("dtfm.scenarios").iterdir() if p.name.endswith(".toml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A scenario by built-in name ("worldwide") or from a TOML file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text()
        except OSError as e:
            raise ScenarioError(f"cannot read scenario file {path}: {e.strerror}") from None
        source = str(path)
    elif str(name_or_path) in builtin_scenarios():
        text = (files("dtfm.scenarios") / f"{name_or_path}.toml").read_text()
        source = f"{name_or_path}.toml"
    else:
        raise ScenarioError(
            f"no scenario {str(name_or_path)!r}: give a TOML file or one of {', '.join(builtin_scenarios())}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{source}: not valid TOML: {e}") from None
    return parse_scenario(data, source)
