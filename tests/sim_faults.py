"""The fault moves shared by the hypothesis state machines over `ElectionSim`: time passing,
crash, restart, partition, heal, drop / duplicate / reorder / delay, clock jumps. A machine
subclasses `SimFaults` and sets `self.sim` in its initialize rule."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from dtfm.control.testing.election_sim import NetConditions


class SimFaults(RuleBasedStateMachine):
    sim = None  # an ElectionSim, set by the subclass

    def _k(self, i):
        return i % self.sim.n

    @rule(dt=st.floats(0.01, 3.0))
    def run(self, dt):
        self.sim.run_for(dt)

    @rule(i=st.integers(0, 8))
    def crash(self, i):
        self.sim.crash(self._k(i))

    @rule(i=st.integers(0, 8))
    def restart(self, i):
        self.sim.restart(self._k(i))

    @rule(sides=st.lists(st.integers(0, 2), min_size=9, max_size=9))
    def partition(self, sides):
        self.sim.partition([sides[k % len(sides)] for k in range(self.sim.n)])

    @rule()
    def heal(self):
        self.sim.heal()

    @rule(drop=st.sampled_from([0.0, 0.1, 0.5]), dup=st.sampled_from([0.0, 0.2]),
          reorder=st.sampled_from([0.0, 0.05, 0.5]), scale=st.sampled_from([0.5, 1.0, 10.0]))
    def network(self, drop, dup, reorder, scale):
        self.sim.net = NetConditions(jitter=1.0, drop_fraction=drop, duplicate_fraction=dup, reorder_s=reorder,
                                     delay_scale=scale)

    @rule(i=st.integers(0, 8), delta=st.sampled_from([-5.0, -0.2, 0.2, 1.0, 30.0]))
    def jump_clock(self, i, delta):
        self.sim.jump_clock(self._k(i), delta)
