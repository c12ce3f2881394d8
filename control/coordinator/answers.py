"""Reading the peers' answers to the coordinator's requests (untrusted: a malformed field reads
as no answer, never as an error of the machine)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from dtfm.net import ProtocolError, short_id

from ..epoch.runstate import PeerRunState

__all__ = ["refusal_code", "reported_number", "run_states"]

logger = logging.getLogger(__name__)

_REFUSAL_CODE = re.compile(r"[a-z][a-z-]{0,31}")


def run_states(answers: Mapping[bytes, dict]) -> dict[bytes, PeerRunState]:
    """The run states among `answers` (RUN_STATE `query`); a malformed one is left out."""
    out = {}
    for p, a in answers.items():
        try:
            out[p] = PeerRunState.from_wire(a)
        except ProtocolError as e:
            logger.debug("run state of %s: %s", short_id(p), e)
    return out


def refusal_code(answer: Mapping) -> str | None:
    """A refusing peer's code (untrusted: a short lower-case word), "malformed" for any other
    value, None when it gave none (it did not answer in time)."""
    code = answer.get("code")
    if code is None:
        return None
    if isinstance(code, str) and _REFUSAL_CODE.fullmatch(code):
        return code
    return "malformed"


def reported_number(v: object) -> float:
    """A count or a duration a peer reported, or 0 for anything else."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    return float(v) if 0 <= v < 1e18 else 0.0
