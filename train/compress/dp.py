"""A stage's compression state and the data-parallel operations on it.

`StageCompression` owns what compression adds to a stage: the error-feedback residual (what
compression has not sent yet), the anchor (the weights of the last synchronisation) and the
outer momentum (with outer_momentum > 0), each one flat float32 buffer over the stage's
parameters in their order, exposed per parameter as named tensors (`compress/ef/<name>`,
`compress/anchor/<name>`, `compress/outer_m/<name>`) for checkpoints and stage transfer.

Both methods exchange compressed payloads by all-gather (each member sends its payload to
every other member) and every member decodes all of them, its own included, and adds them in
group order: the same bytes through the same float operations, so every replica applies the
same bits and replicas stay identical. Everything is exchanged before anything changes, so a
step that fails in the exchange leaves the state as it was.

Both methods let each pipeline step AdamW on its own gradient and then synchronise the
replicas' pseudo-gradients (anchor - weights): every replica adds its own to its residual,
compresses it (top-k per chunk, low-bit values), and the mean of the decoded contributions
drives an SGD outer step (optionally Nesterov momentum) from the anchor; every replica takes the
result as its weights and new anchor, and its residual keeps exactly what it did not send.

Cocktail synchronises after every step and compresses only a random subset of the elements,
drawn from a seed every member derives from (run seed, step, stage), so no index of the draw
travels. It compresses the per-step model delta rather than the raw gradient: AdamW fed with
2 %-dense gradients trains far slower (measured: +25 % loss after 600 steps of `tiny`).
DiLoCo synchronises after every H steps and compresses all elements; with a warm start
(`dp_ramp_syncs`) it synchronises first at intervals 1, 2, 4, ... below H, each of those
averaging the replicas (the outer optimizer starts at interval H).

With `dp_overlap_steps` = tau, DiLoCo's exchange overlaps the next inner steps (streaming
DiLoCo's delayed outer update): after step t each replica keeps its weights as the exchange's
origin, sends its payload (`start_sync`) and steps on; after step t + tau (at most the gap to
the next synchronisation: `CompressionConfig.overlap_of`) it receives the others' payloads,
by then long arrived, and `finish_sync` applies the outer step of the group's mean to the
anchor and puts the replica's local progress since t on top (`delayed_outer_update`): the
anchor, the synchronised model, is the same bits on every replica; the weights are the anchor
plus each replica's own tau steps, which the next pseudo-gradient counts. The schedule is a
function of the step, and the origin is a buffer of the stage (`compress/origin/`), so a stage
checkpointed, resumed, fetched or re-laid out while an exchange is in flight completes it: the
payloads are sent again from the origin (the same bits) when the comm they went out on is not
the one the stage runs on now (another epoch's tag, or `forget_exchange`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from ..comm import Comm, CommError, PeerId, PendingSends, settle_sends
from .codec import CodecError, decode_sparse, encode_sparse, sparse_payload_bytes
from .config import CompressionConfig

__all__ = ["StageCompression", "allgather_payloads", "delayed_outer_update", "outer_step", "random_subset",
           "sync_payload_bytes", "STATE_PREFIX"]

STATE_PREFIX = "compress/"


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def random_subset(n: int, fraction: float, seed: int) -> torch.Tensor:
    """ceil(fraction n) distinct indices of range(n), the same for the same arguments on every
    machine and every library version: an arithmetic progression (a i + b) mod n with a coprime
    to n, a and b drawn from sha256 of the seed."""
    r = min(n, max(1, math.ceil(fraction * n)))
    if r == n:
        return torch.arange(n, dtype=torch.int64)
    a = 1 + _seed("a", seed) % (n - 1)
    while math.gcd(a, n) != 1:
        a += 1
    b = _seed("b", seed) % n
    return (torch.arange(r, dtype=torch.int64) * a + b) % n


def _domain(config: CompressionConfig, numel: int) -> int:
    """Candidates of one synchronisation: a random share of the stage (cocktail) or all of it."""
    if config.dp_method == "cocktail":
        return min(numel, max(1, math.ceil(config.dp_random_fraction * numel)))
    return numel


def sync_payload_bytes(config: CompressionConfig, numel: int) -> int:
    """Bytes of one member's DP payload for a stage of `numel` parameters (as `encode_sparse`
    makes it): what a receiver expects, computed from the plan, never read from the payload."""
    return sparse_payload_bytes(_domain(config, numel), config.dp_chunk_elems, config.dp_topk_per_chunk,
                                config.dp_value_bits)


def allgather_payloads(comm: Comm, group: Sequence[PeerId], payload: torch.Tensor, tag: str,
                       timeout_s: float, pending: PendingSends | None = None) -> list[torch.Tensor]:
    """Every member's uint8 payload, in group order (this member's is `payload` itself); the
    acknowledgements of its sends are waited for now, or left in `pending` (train/collective.py)."""
    handles = [comm.isend(p, tag, payload) for p in group if p != comm.me]
    out = []
    for p in group:
        if p == comm.me:
            out.append(payload)
            continue
        got = comm.recv(p, tag, timeout_s)
        if got.dtype != torch.uint8 or got.dim() != 1:
            raise CommError(f"peer {p!r} sent {got.dtype} {tuple(got.shape)} under {tag!r}, expected a uint8 payload")
        out.append(got)
    settle_sends(handles, pending, timeout_s)
    return out


def outer_step(config: CompressionConfig, step: int, anchor: torch.Tensor, momentum: torch.Tensor | None,
               avg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(new anchor, new outer momentum) from the group's mean decoded pseudo-gradient `avg` of
    the synchronisation after step `step`: a warm-start synchronisation averages (the anchor
    moves by the mean, the momentum stays), any other takes the outer SGD step (Nesterov or
    heavy-ball momentum). Pure: the inputs are not changed."""
    if config.ramp_sync(step):
        return anchor.sub(avg), momentum
    if momentum is not None:
        mom = momentum.mul(config.outer_momentum).add_(avg)
        update = avg.add(mom, alpha=config.outer_momentum) if config.outer_nesterov else mom
    else:
        mom, update = None, avg
    return anchor.sub(update, alpha=config.outer_lr), mom


def delayed_outer_update(config: CompressionConfig, step: int, anchor: torch.Tensor, momentum: torch.Tensor | None,
                         avg: torch.Tensor, weights: torch.Tensor,
                         origin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(new anchor, new momentum, new weights) of an overlapped synchronisation: the outer step of
    `outer_step`, and the replica's weights moved onto it with the local progress made while
    the exchange travelled kept on top (weights - origin, origin being the weights the exchange
    started from). The anchor and momentum depend only on what every member shares, so they
    are the same bits on every replica; with no progress (weights == origin) the weights are
    the new anchor, as after a synchronisation that waits. Pure."""
    new_anchor, new_mom = outer_step(config, step, anchor, momentum, avg)
    return new_anchor, new_mom, new_anchor + (weights - origin)


def _received(comm: Comm, peer: PeerId, tag: str, timeout_s: float) -> torch.Tensor:
    got = comm.recv(peer, tag, timeout_s)
    if got.dtype != torch.uint8 or got.dim() != 1:
        raise CommError(f"peer {peer!r} sent {got.dtype} {tuple(got.shape)} under {tag!r}, expected a uint8 payload")
    return got


class StageCompression:
    """Compression settings and state of one stage replica (see the module docstring)."""

    def __init__(self, config: CompressionConfig, params: dict[str, torch.nn.Parameter], stage_key: int):
        self.config = config
        self.stage_key = stage_key  # the stage's first layer: part of the random draw's seed
        self.names = list(params)
        self.shapes = [tuple(p.shape) for p in params.values()]
        self.numel = sum(p.numel() for p in params.values())
        dev = next(iter(params.values())).device if params else torch.device("cpu")
        self.buffers: dict[str, torch.Tensor] = {}  # kind -> flat float32 (numel,)
        if config.dp_method != "exact":
            self.buffers["ef"] = torch.zeros(self.numel, dtype=torch.float32, device=dev)
            self.buffers["anchor"] = self._flat([p.detach() for p in params.values()]).clone()
            if config.outer_momentum > 0:
                self.buffers["outer_m"] = torch.zeros(self.numel, dtype=torch.float32, device=dev)
            if config.dp_overlap_steps:  # the weights an exchange in flight started from
                self.buffers["origin"] = self.buffers["anchor"].clone()
        # (tag, payload) of the exchange this replica started in this session and has not applied
        self._sent: tuple[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ state as named tensors

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, off = {}, 0
        for name, shape in zip(self.names, self.shapes):
            k = math.prod(shape)
            out[name] = flat[off:off + k].view(shape)
            off += k
        return out

    @staticmethod
    def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0)
        return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])

    def state_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A flat (numel,) vector in parameter order as one view per parameter name (e.g. the
        anchor as the stage's parameters)."""
        return self._views(flat)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """`compress/<kind>/<param name>` for every buffer: views, not copies."""
        return {f"{STATE_PREFIX}{kind}/{n}": v for kind, flat in self.buffers.items()
                for n, v in self._views(flat).items()}

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore every buffer by name; raises ValueError on a missing name or a wrong shape."""
        for key, dst in self.state_tensors().items():
            src = tensors.get(key)
            if src is None or tuple(src.shape) != tuple(dst.shape) or not src.is_floating_point():
                raise ValueError(f"compression state {key!r} is missing or has the wrong shape")
            dst.copy_(src)

    # ------------------------------------------------------------------ schedule

    def local(self, step: int) -> bool:
        """Whether step `step` updates from this pipeline's own gradient (else: the ring all-reduce)."""
        return self.config.dp_method != "exact" and step >= self.config.dp_warmup_steps

    @property
    def period_steps(self) -> int:
        """Steps between synchronisations once any warm start is over: 1 for cocktail, H for DiLoCo."""
        return 1 if self.config.dp_method == "cocktail" else self.config.inner_steps

    def sync_due(self, step: int) -> bool:
        """Whether a synchronisation follows the update of step `step` (`CompressionConfig.sync_due`)."""
        return self.config.sync_due(step)

    def payload_bytes(self) -> int:
        """Bytes of one member's DP payload for a stage of this size (as `encode_sparse` makes it)."""
        return sync_payload_bytes(self.config, self.numel)

    # ------------------------------------------------------------------ the exchange

    def _exchange(self, comm: Comm, group: Sequence[PeerId], x: torch.Tensor, tag: str,
                  timeout_s: float, pending: PendingSends | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of every member's decoded contribution in group order, this member's own)."""
        c = self.config
        k, chunk, bits = c.dp_topk_per_chunk, c.dp_chunk_elems, c.dp_value_bits
        mine = encode_sparse(x, chunk, k, bits)
        payloads = allgather_payloads(comm, group, mine, tag, timeout_s, pending)
        return self._decode_sum(group, comm.me, payloads, x, tag)

    @staticmethod
    def _check_group(comm: Comm, group: Sequence[PeerId]) -> None:
        if len(set(group)) != len(group) or comm.me not in group:
            raise ValueError(f"group {group!r} must list distinct peers including this one ({comm.me!r})")

    @torch.no_grad()
    def sync(self, comm: Comm, group: Sequence[PeerId], params: Sequence[torch.Tensor], seed: int, step: int,
             tag: str, timeout_s: float, pending: PendingSends | None = None) -> None:
        """Average the compressed pseudo-gradients (anchor - weights) of the group and take the
        outer step from the anchor: every member ends with the same weights, the new anchor.
        Cocktail compresses a random subset of the elements (drawn from `seed`, `step` and the
        stage), DiLoCo all of them. The acknowledgements of this member's sends are waited for
        before anything changes, or left in `pending`."""
        self._check_group(comm, group)
        c, ef, anchor, mom = self.config, self.buffers["ef"], self.buffers["anchor"], self.buffers.get("outer_m")
        acc = ef + (anchor - self._flat([p.detach() for p in params]).to(anchor.device))
        if c.dp_method == "cocktail":
            idx = random_subset(self.numel, c.dp_random_fraction, _seed("cocktail", seed, step, self.stage_key))
            idx = idx.to(acc.device)
            total, own = self._exchange(comm, group, acc[idx], tag, timeout_s, pending)
            avg = torch.zeros_like(acc)
            avg[idx] = total / torch.full((), len(group), dtype=total.dtype, device=total.device)
            acc[idx] -= own  # what was not sent stays, exactly where nothing of it was sent
        else:
            total, own = self._exchange(comm, group, acc, tag, timeout_s, pending)
            avg = total / torch.full((), len(group), dtype=total.dtype, device=total.device)  # (a tensor: correctly rounded on a GPU too)
            acc -= own
        ef.copy_(acc)
        new_anchor, new_mom = outer_step(c, step, anchor, mom, avg)
        anchor.copy_(new_anchor)
        if mom is not None and new_mom is not None:
            mom.copy_(new_mom)
        for p, v in zip(params, self._views(anchor).values()):
            p.copy_(v)

    # ------------------------------------------------------------------ the overlapped exchange

    @torch.no_grad()
    def start_sync(self, comm: Comm, group: Sequence[PeerId], params: Sequence[torch.Tensor], step: int,
                   tag: str, timeout_s: float, pending: PendingSends | None = None) -> None:
        """Send this replica's compressed pseudo-gradient for the synchronisation after step
        `step` and go on: the weights stay this replica's own, and `finish_sync`, after step
        `step` + `config.overlap_of(step)`, receives the others' and applies the outer update.
        Keeps the weights the exchange starts from (`compress/origin/`), so a stage stopped
        before that update can complete it (module docstring)."""
        self._check_group(comm, group)
        origin = self.buffers["origin"]
        origin.copy_(self._flat([p.detach() for p in params]).to(origin.device))
        mine = self._own_payload()
        handles = [comm.isend(p, tag, mine) for p in group if p != comm.me]
        settle_sends(handles, pending, timeout_s)
        self._sent = (tag, mine)

    @torch.no_grad()
    def finish_sync(self, comm: Comm, group: Sequence[PeerId], params: Sequence[torch.Tensor], step: int,
                    sent_tag: str, resend_tag: str, timeout_s: float, pending: PendingSends | None = None) -> None:
        """Complete the exchange of the synchronisation after step `step` (started by
        `start_sync`) and apply it: the outer update of the group's mean from the anchor, plus
        this replica's own progress since the exchange began (`delayed_outer_update`). The
        others' payloads are those sent under `sent_tag` when this replica sent its own there
        in this session; otherwise (a stage resumed, fetched or re-laid out since) every member
        sends its payload again, recomputed from the kept origin, under `resend_tag`: the same
        bits, so the same update. Nothing changes unless every payload arrived and decoded."""
        self._check_group(comm, group)
        c = self.config
        k, chunk, bits = c.dp_topk_per_chunk, c.dp_chunk_elems, c.dp_value_bits
        if self._sent is not None and self._sent[0] == sent_tag:
            mine, payloads = self._sent[1], []
            for p in group:
                payloads.append(mine if p == comm.me else _received(comm, p, sent_tag, timeout_s))
        else:
            mine = self._own_payload()
            payloads = allgather_payloads(comm, group, mine, resend_tag, timeout_s, pending)
        acc = self._accumulated()
        total, own = self._decode_sum(group, comm.me, payloads, acc, sent_tag)
        avg = total / torch.full((), len(group), dtype=total.dtype, device=total.device)
        weights = self._flat([p.detach() for p in params]).to(acc.device)
        anchor, mom = self.buffers["anchor"], self.buffers.get("outer_m")
        new_anchor, new_mom, new_weights = delayed_outer_update(c, step, anchor, mom, avg, weights,
                                                                self.buffers["origin"])
        self.buffers["ef"].copy_(acc - own)
        anchor.copy_(new_anchor)
        if mom is not None and new_mom is not None:
            mom.copy_(new_mom)
        for p, v in zip(params, self._views(new_weights).values()):
            p.copy_(v)
        self._sent = None

    @torch.no_grad()
    def in_flight_contribution(self) -> torch.Tensor:
        """This replica's decoded payload of the exchange in flight (what every member adds for
        it when the exchange lands): the group's sum of these in group order, over its size, is
        the mean `finish_sync` will apply."""
        c = self.config
        acc = self._accumulated()
        return decode_sparse(self._own_payload(), acc.numel(), c.dp_chunk_elems, c.dp_topk_per_chunk, c.dp_value_bits)

    def forget_exchange(self) -> None:
        """The comm an exchange in flight was sent on is gone (the stage moves to another plan or
        session): the exchange completes by every member sending its payload again."""
        self._sent = None

    def _accumulated(self) -> torch.Tensor:
        """What this replica sends at the exchange in flight: its residual plus its pseudo-gradient
        (anchor - origin), the same float operations wherever it is computed."""
        return self.buffers["ef"] + (self.buffers["anchor"] - self.buffers["origin"])

    def _own_payload(self) -> torch.Tensor:
        c = self.config
        return encode_sparse(self._accumulated(), c.dp_chunk_elems, c.dp_topk_per_chunk, c.dp_value_bits)

    def _decode_sum(self, group: Sequence[PeerId], me: PeerId, payloads: Sequence[torch.Tensor], x: torch.Tensor,
                    tag: str) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        decoded = []
        for p, payload in zip(group, payloads):
            try:
                decoded.append(decode_sparse(payload.to(x.device), x.numel(), c.dp_chunk_elems, c.dp_topk_per_chunk,
                                             c.dp_value_bits))
            except CodecError as e:
                raise CommError(f"peer {p!r} sent a bad compressed payload under {tag!r}: {e}") from None
        total = decoded[0].clone()
        for dec in decoded[1:]:
            total += dec
        return total, decoded[list(group).index(me)]

    @torch.no_grad()
    def track_anchor(self, params: Sequence[torch.Tensor]) -> None:
        """During exact warm-up steps the anchor follows the (synchronised) weights."""
        if "anchor" in self.buffers:
            self.buffers["anchor"].copy_(self._flat([p.detach() for p in params]))
