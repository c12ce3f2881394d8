"""Discrete-event simulation of many `Swim` state machines without trio: messages cross a
uniform link after a delay, a fraction of them is dropped, nodes can stall, die or leave.
It runs an hour of a 16-member swarm in seconds, for the failure-detection figures; the
Harness runs the full service (measurement, records) over trio instead.

By default every message goes through to_wire/pack/unpack/from_wire, so the byte counts are
exact and the codecs are exercised; `codec=False` hands the objects over (frames still counted).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import defaultdict
from typing import Callable

from dtfm.net import Identity, pack, unpack_untrusted

from .claims import ClaimVerifier
from .config import GossipConfig
from .members import Member, MemberState
from .messages import decode_swim
from .swim import Send, Swim

__all__ = ["SwimSimulator"]

FRAME_OVERHEAD = 32


class SwimSimulator:
    def __init__(self, n: int, config: GossipConfig, *, delay_s: float = 0.005,
                 drop_fraction: float = 0.0, seed: int = 0, join_spread_s: float = 0.0,
                 codec: bool = True, link_delay_s: Callable[[int, int], float] | None = None,
                 distinct_hosts: bool = False, count_bytes: bool = False) -> None:
        """link_delay_s(a, b): the one-way delay from node a to node b (default: delay_s).
        distinct_hosts: each node at its own host (one address group each) rather than all at
        one (whose cap of members per address then applies). count_bytes: with codec=False,
        still pack each message to count its exact bytes (decoding is what costs)."""
        self.config = config
        self.link_delay_s = link_delay_s
        self.codec = codec  # False: hand message objects over as they are (faster)
        self.count_bytes = count_bytes
        self.delay_s = delay_s
        self.drop_fraction = drop_fraction
        self.rng = random.Random(seed)
        self.now = 0.0
        self.identities = [Identity(self.rng.randbytes(32)) for _ in range(n)]
        self.ids = [i.peer_id for i in self.identities]
        # One verifier for all nodes (speed): an update one node signed counts as verified for
        # all; forged ones are still checked, and refused, by each node.
        self.verifier = ClaimVerifier()
        self.index = {p: k for k, p in enumerate(self.ids)}
        self.nodes: list[Swim] = []
        self.dead: set[int] = set()
        self.stalled_until = [0.0] * n
        self.frames = [0] * n
        self.bytes = [0] * n
        self.history: dict[tuple[int, int], list[tuple[float, MemberState]]] = defaultdict(list)
        self._heap: list = []
        self._count = itertools.count()
        self._tick_at = [float("nan")] * n
        for k, pid in enumerate(self.ids):
            me = Member(pid, 0, MemberState.ALIVE, "sim" if not distinct_hosts else f"sim{k}", 10000 + k, "")
            self.nodes.append(Swim(config, self.identities[k], me, random.Random(self.rng.random()), 0.0,
                                   verifier=self.verifier))
        for k in range(1, n):  # everyone joins through node 0
            at = self.rng.uniform(0, join_spread_s) if join_spread_s else 0.0
            self._push(at, ("join", k))

    def _push(self, t: float, item: tuple) -> None:
        heapq.heappush(self._heap, (t, next(self._count), item))

    def _send_all(self, k: int, sends: list[Send]) -> None:
        for s in sends:
            data = pack(s.msg.to_wire()) if self.codec or self.count_bytes else s.msg
            self.frames[k] += 1
            self.bytes[k] += (len(data) if isinstance(data, bytes) else 0) + FRAME_OVERHEAD
            if not self.codec:
                data = s.msg
            dst = self.index[s.to]
            if dst in self.dead or self.rng.random() < self.drop_fraction:
                continue
            delay = self.delay_s if self.link_delay_s is None else self.link_delay_s(k, dst)
            self._push(max(self.now, self.stalled_until[k]) + delay, ("msg", dst, k, s.msg.type, data))

    def _observe(self, k: int) -> None:
        for m in self.nodes[k].drain_changes():
            self.history[(k, self.index[m.peer_id])].append((self.now, m.state))
        t = self.nodes[k].next_deadline()
        if t != self._tick_at[k]:  # one scheduled tick per node; stale ones are skipped
            self._tick_at[k] = t
            self._push(t, ("tick", k))

    def run_until(self, t_end: float) -> None:
        for k in range(len(self.nodes)):
            self._tick_at[k] = self.now
            self._push(self.now, ("tick", k))
        while self._heap and self._heap[0][0] <= t_end:
            t, _, item = heapq.heappop(self._heap)
            kind, k = item[0], item[1]
            if k in self.dead:
                continue
            if t < self.stalled_until[k]:  # a stalled node handles it when it wakes up
                if kind == "tick":
                    if t != self._tick_at[k]:
                        continue
                    self._tick_at[k] = self.stalled_until[k]
                self._push(self.stalled_until[k], item)
                continue
            self.now = t
            node = self.nodes[k]
            if kind == "tick":
                if t != self._tick_at[k]:
                    continue
                self._tick_at[k] = float("nan")
                self._send_all(k, node.tick(t))
            elif kind == "join":
                seed = self.nodes[0].me
                self._send_all(k, node.add_seed(seed.peer_id, seed.address, t, origin="sim0"))
            elif kind == "msg":
                _, _, src, msg_type, data = item
                msg = (decode_swim(msg_type, unpack_untrusted(data, max_len=1 << 24))
                       if self.codec else data)
                self._send_all(k, node.handle(self.ids[src], msg, t, origin=f"sim{src}"))
            else:
                self.on_event(t, item)
            self._observe(k)
        self.now = t_end

    def on_event(self, t: float, item: tuple) -> None:
        """An event of a kind this class does not know (a subclass's: item[0] names it,
        item[1] is the node)."""
        raise ValueError(f"unknown event {item[0]!r}")

    def push(self, t: float, item: tuple) -> None:
        """Schedule an event (item[0]: its kind, item[1]: the node it happens at)."""
        self._push(t, item)

    def kill(self, k: int) -> None:
        self.dead.add(k)

    def leave(self, k: int) -> None:
        self._send_all(k, self.nodes[k].leave(self.now))
        self._observe(k)

    def stall(self, k: int, duration_s: float) -> None:
        self.stalled_until[k] = self.now + duration_s

    def first_time(self, observer: int, subject: int, state: MemberState) -> float | None:
        for t, s in self.history[(observer, subject)]:
            if s == state:
                return t
        return None

    def state_seen(self, observer: int, subject: int) -> MemberState | None:
        m = self.nodes[observer].members.get(self.ids[subject])
        return m.state if m else None

    def live(self) -> list[int]:
        return [k for k in range(len(self.nodes)) if k not in self.dead]
