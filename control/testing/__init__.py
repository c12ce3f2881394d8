"""dtfm.control.testing: the control plane in deterministic simulations, for tests and
benchmarks (as `trio.testing` ships trio's fakes beside, not inside, the product code).

    election_sim.py  `ElectionSim`: a simulated network of `ElectionState` nodes with virtual
                     time, drops, delays, partitions and liars
    sim.py           `PlaneSim`: the daemon's own machines (`ElectionState`, `EpochMachine`,
                     `Coordinator`) on every node of an `ElectionSim`, the simulation playing
                     the shell through the plane's input layer (control/inputs.py)

Nothing in the product package imports this one.
"""
