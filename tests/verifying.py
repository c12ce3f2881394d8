"""Answering a sans-IO `Swim`'s verification pings, as the members it pings would."""

from dtfm.gossip.messages import Ack, Ping


def answer_verifications(s, sends, now, *, only=None):
    """Ack every verification ping in `sends` (and those the acks start) from its target, or
    only those to peers in `only`; the other sends, unanswered."""
    rest = []
    while sends:
        more = []
        for x in sends:
            if x.dial and isinstance(x.msg, Ping) and (only is None or x.to in only):
                more += s.handle(x.to, Ack(x.msg.seq), now)
            else:
                rest.append(x)
        sends = more
    return rest
