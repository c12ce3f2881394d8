"""dtfm.control: agreement on who does what, and running it.

Signed allocations and their acceptance, the Comm over the peer transport, the trainer service
that runs a stage inside the daemon, and the issuer's hand-out protocol. Sits above gossip,
sched and train, below the daemon, which only starts it as a service.
"""

__all__: list[str] = []
