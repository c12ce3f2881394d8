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
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from ..comm import Comm, CommError, PeerId, PendingSends, settle_sends
from .codec import CodecError, decode_sparse, encode_sparse, sparse_payload_bytes
from .config import CompressionConfig

__all__ = ["StageCompression", "allgather_payloads", "random_subset", "sync_payload_bytes", "STATE_PREFIX"]

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
        decoded = []
        for p, payload in zip(group, payloads):
            try:
                decoded.append(decode_sparse(payload.to(x.device), x.numel(), chunk, k, bits))  # where x is
            except CodecError as e:
                raise CommError(f"peer {p!r} sent a bad compressed payload under {tag!r}: {e}") from None
        total = decoded[0].clone()
        for dec in decoded[1:]:
            total += dec
        return total, decoded[list(group).index(comm.me)]

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
        if c.ramp_sync(step):  # the warm start averages the replicas; the outer optimizer waits
            anchor.sub_(avg)
            for p, v in zip(params, self._views(anchor).values()):
                p.copy_(v)
            return
        if mom is not None:
            mom.mul_(c.outer_momentum).add_(avg)
            update = avg.add(mom, alpha=c.outer_momentum) if c.outer_nesterov else mom
        else:
            update = avg
        anchor.sub_(update, alpha=c.outer_lr)
        for p, v in zip(params, self._views(anchor).values()):
            p.copy_(v)

    @torch.no_grad()
    def track_anchor(self, params: Sequence[torch.Tensor]) -> None:
        """During exact warm-up steps the anchor follows the (synchronised) weights."""
        if "anchor" in self.buffers:
            self.buffers["anchor"].copy_(self._flat([p.detach() for p in params]))
