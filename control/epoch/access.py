"""Who may read this peer's run state, ask it for offers, and fetch the stages it offers: pure
rules over the allocations the peer applied (see docs/control.md, "Who may send what").

- RUN_STATE `query` (and `progress`, on a coordinator): this peer itself, the coordinator it
  recognises, and the peers of the run (those the current or previous allocation names: stage
  peers, spares, issuer, voters), while an epoch is in progress and after the run is over (an
  operator stopped it, it finished, or it could not go on): a run's id, epoch and step reports
  are for its peers. A peer that applied no allocation has nothing of a run to tell, and one
  whose stage stopped in a run that goes on (a peer the run left out) nothing current: both
  answer any peer, so a coordinator they do not know yet can find them and place them again.
- RUN_STATE `offer`: this peer itself and the coordinator it recognises. The coordinator
  sends its certificate with an offer or a STOP (`coordinator_certificate`): a holder outside the
  council hears no heartbeats, so it may not know a coordinator elected since its last
  allocation; the shell passes the certificate to the election (`learn`, checked against this
  peer's council) before it asks `offer_refusal` or the epoch machine.
- FETCH_MANIFEST / FETCH_CHUNK: the peers the current or previous allocation of that run names
  (stage peers and spares), and the peers the coordinator named when it asked for the offer
  (the next allocation's, which this peer may not have applied when their fetch arrives).
- RUN_STATE `export` (what this peer holds of a run, and an offer of one stage's weights,
  which the asking peer may then fetch): only the peer that an operator's signed export of that
  run names, within the operator clock skew window (`export_refusal`; `dtfm-peer export`).
  That peer fetches the weights offer (FETCH_* with `part: weights`, control/epoch/recovery.py),
  never a stage offer through it.
"""

from __future__ import annotations

from collections.abc import Collection

from dtfm.net import PEER_ID_BYTES, get_bytes, get_list

from ..allocation import Allocation
from ..election.certificate import Certificate
from ..operator import OperatorError, OperatorOp, SignedOp, check_op, check_time
from ..refusals import Refused

__all__ = ["MAX_FETCHERS", "coordinator_certificate", "export_refusal", "fetch_refusal", "offer_refusal",
           "parse_fetchers", "run_peers", "run_state_refusal"]

MAX_FETCHERS = 4096  # peers named with one offer: as many as an allocation names


def run_peers(alloc: Allocation | None) -> frozenset[bytes]:
    """The peers of the run as `alloc` names them: stage peers, spares, its issuer, its voters."""
    if alloc is None:
        return frozenset()
    return frozenset(alloc.peers) | frozenset(alloc.spares) | {alloc.issuer} | frozenset(alloc.configuration)


def run_state_refusal(sender: bytes, *, me: bytes, coordinator: bytes | None, current: Allocation | None,
                      previous: Allocation | None, in_progress: bool, over: bool = False) -> Refused | None:
    """None when `sender` may read this peer's run state. `in_progress`: this peer takes part in
    an epoch now (building, accepted, training, or a spare of it); `over`: the run of `current`
    is over (stopped or finished)."""
    if sender == me or (coordinator is not None and sender == coordinator) or current is None:
        return None
    if not in_progress and not over:
        return None
    if sender in run_peers(current):
        return None
    if previous is not None and current is not None and previous.run_id == current.run_id \
            and sender in run_peers(previous):
        return None
    return Refused.RUN_STATE_OUTSIDER


def offer_refusal(sender: bytes, *, me: bytes, coordinator: bytes | None) -> Refused | None:
    """None when `sender` may ask this peer to offer a stage."""
    if sender == me or (coordinator is not None and sender == coordinator):
        return None
    return Refused.OFFER_NOT_COORDINATOR


def fetch_refusal(sender: bytes, run_id: bytes, *, allocations: Collection[Allocation | None],
                  fetchers: Collection[bytes] = ()) -> Refused | None:
    """None when `sender` may fetch a stage of run `run_id`: `allocations` are this peer's
    current and previous ones, `fetchers` the peers the coordinator named with the offer."""
    if sender in fetchers:
        return None
    for a in allocations:
        if a is not None and a.run_id == run_id and (sender in a.peers or sender in a.spares):
            return None
    return Refused.FETCH_NOT_NAMED


def export_refusal(sender: bytes, signed: SignedOp | None, run_id: bytes, *, operators: Collection[bytes],
                   now_s: float, skew_s: float) -> tuple[OperatorOp | None, str | None]:
    """(the export, None) when `sender` may gather run `run_id` (list what this peer holds of
    it, have one stage offered to it and fetch that): `signed` is an export of that run, signed
    by one of `operators` within `skew_s` of `now_s` (wall clock), that names `sender`; else
    (None, why). A copied export lets no other peer fetch, and only for a while."""
    try:
        op = check_op(signed, "export", frozenset(operators), run_id=run_id)
        check_time(op, now_s, skew_s)
    except OperatorError as e:
        return None, str(e)
    if op.exporter() != sender:
        return None, f"the operator's export names peer {op.exporter().hex()[:8]}, not the peer that asks"
    return op, None


def coordinator_certificate(sender: bytes, d: dict) -> Certificate | None:
    """The certificate a RUN_STATE offer or a STOP carries when it names the sender as
    coordinator (to be checked by the election before use); None when absent or of another peer.
    Raises ProtocolError only (a malformed certificate)."""
    if d.get("cert") is None:
        return None
    cert = Certificate.from_wire(d["cert"])
    return cert if cert.candidate == sender else None


def parse_fetchers(d: dict) -> frozenset[bytes]:
    """The `for` field of a RUN_STATE offer (the peers the next allocation names), absent: none;
    raises ProtocolError only."""
    if "for" not in d:
        return frozenset()
    return frozenset(get_bytes({"peer": p}, "peer", PEER_ID_BYTES, PEER_ID_BYTES)
                     for p in get_list(d, "for", MAX_FETCHERS))
