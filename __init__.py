"""dtfm: decentralized training of foundation models over slow, uneven networks."""

__version__ = "0.1.0"
