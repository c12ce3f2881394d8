"""A Vivaldi coordinate that diverged starts again from the origin instead of overflowing (a
fresh-check saw the gravity term overflow in `observe` and end a daemon's measurement task)."""

import random

from dtfm.gossip.vivaldi import COORD_DIMS, MAX_COORD_MS, Coordinate, Vivaldi


def test_a_diverged_coordinate_starts_again_from_the_origin():
    v = Vivaldi(random.Random(0))
    v.coord = Coordinate((1e200,) * COORD_DIMS, 1.0, 0.5)  # finite, but no round trip on Earth
    other = Coordinate((10.0,) + (0.0,) * (COORD_DIMS - 1), 1.0, 0.5)
    got = v.observe(b"p" * 32, other, 40.0)
    assert got == Coordinate.origin(v.config) and v.resets == 1 and v.samples == 1
    # a sane coordinate moves as before, and is never reset
    for _ in range(20):
        got = v.observe(b"p" * 32, other, 40.0)
    assert v.resets == 1 and 0 < abs(got.rtt_ms(other)) < MAX_COORD_MS
