"""Which tensor messages a peer receives in a step under a `Plan`: the rules a transport checks
every incoming tensor against before it uses a byte of it.

`run_step` (worker.py) and the collectives (collective.py) send tensors under tags
"<epoch>.<step>/<what>", where <what> is one of

    act/<m>            stage s-1 -> s, the output of micro-batch m (wire dtype, (B_m, T, C))
    grad/<m>           stage s+1 -> s, the gradient of that output (wire dtype, (B_m, T, C))
    loss               last stage -> the other last stages: its summed loss (float64, (1,))
    norm               any stage -> the rest of its pipeline: its squared gradient norm (float64, (1,))
    tied               first <-> last stage with a tied head: the embedding gradient (V, C)
    dp/<ph><i>/b<b>    DP group member r-1 -> r: bucket b's chunk in ring step i of phase
                       ph (rs: reduce-scatter, ag: all-gather); 1-D, the parameters' dtype
    dpc                every other member of the DP group -> r: its compressed pseudo-gradient
                       (DP compression: uint8, (payload bytes,))

With a `CompressionConfig` (train/compress/) that quantizes the pipeline, act/<m> and grad/<m>
are uint8 payloads of exactly the size the codec makes for (B_m, T, C); with DP compression the
members exchange `dpc` payloads of exactly the size the stage's parameter count gives (and the
ring's chunks only when exact warm-up steps come first). A payload's size is the plan's, never
the payload's own. A per-link run's plan (`Plan.links`) says per link and group: a link left
exact carries the wire dtype, a group left exact runs the ring (no `dpc`), and with both kinds
of group in the run `norm` is two float64s (the exact groups' share and the rest's).

`MessageRules.for_peer` derives, for one receiving peer, every (source, <what>) pair it may
receive and the exact dtype and shape each carries, from the plan, the model, the train config
and the shapes of the peer's own stage parameters (the members of a DP group hold the same
stage, so the ring's chunk shapes follow from them). Any step is allowed, the epoch must be the
plan's, and anything else (another tag, another sender, a malformed number) is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Sequence
from types import MappingProxyType

import torch

from .codec import TORCH_DTYPES
from .collective import make_buckets
from .compress import CompressionConfig, activation_payload_bytes, sync_payload_bytes
from .data import split_batch
from .plan import Plan
from .spec import GPTSpec, TrainConfig

__all__ = ["MAX_TAG_CHARS", "MessageRules", "describe_tag"]

PeerId = Hashable
Expected = tuple[str, tuple[int, ...]]  # (wire dtype name, shape)

# Longest tag a peer may send; the longest real one ("<epoch>.<step>/dp/rs<i>/b<b>") is far shorter.
MAX_TAG_CHARS = 96
# "<epoch>.<step>/": decimal, no sign, no leading zeros, at most 19 digits (fits in 63 bits).
_PREFIX = re.compile(r"(0|[1-9][0-9]{0,18})\.(0|[1-9][0-9]{0,18})/", re.ASCII)
_SMALL: Expected = ("float64", (1,))  # loss and norm: one float64 each


def split_tag(tag: object) -> tuple[int, int, str] | None:
    """(epoch, step, <what>) of a well-formed tag prefix, or None; <what> is not checked here."""
    if not isinstance(tag, str) or len(tag) > MAX_TAG_CHARS:
        return None
    m = _PREFIX.match(tag)
    if m is None:
        return None
    return int(m[1]), int(m[2]), tag[m.end():]


# <what> in words, for people (a message's first part; the rest are its numbers)
_WHAT_WORDS = {"act": "the activations of micro-batch {0}", "grad": "the gradients of micro-batch {0}",
               "loss": "the loss", "norm": "the gradient norm", "tied": "the tied embedding's gradient",
               "dp": "the data-parallel gradient sync", "dpc": "the compressed data-parallel sync"}


def describe_tag(tag: object) -> str:
    """A tensor message's tag as people read it: `1.42/loss` is "the loss of step 43 (epoch
    1)", `1.42/act/3` "the activations of micro-batch 3 of step 43 (epoch 1)"; steps count from
    1, as every text does. A tag that is not well formed is shown quoted, as it came."""
    parts = split_tag(tag)
    if parts is None:
        return repr(tag)
    epoch, step, what = parts
    kind, _, rest = what.partition("/")
    words = _WHAT_WORDS.get(kind)
    if words is None:
        return repr(tag)
    return f"{words.format(rest) if '{0}' in words else words} of step {step + 1} (epoch {epoch})"


class MessageRules:
    """The tensor messages one peer (`me`) receives in any step of one plan's epoch."""

    def __init__(self, me: PeerId, epoch: int, table: dict[str, dict[PeerId, Expected]],
                 bursts: dict[PeerId, tuple[int, int]], destinations: frozenset):
        self.me, self.epoch = me, epoch
        self._table = MappingProxyType({what: MappingProxyType(dict(by_src)) for what, by_src in table.items()})
        self._bursts = dict(bursts)
        self.neighbours: frozenset = frozenset(src for by_src in table.values() for src in by_src)  # send to me
        self.destinations: frozenset = destinations  # peers `me` sends to: the same but for the ring's next member
        self.peers: frozenset = self.neighbours | destinations  # every peer `me` exchanges tensors with
        self._max = {src: 0 for src in self.neighbours}
        for by_src in table.values():
            for src, exp in by_src.items():
                self._max[src] = max(self._max[src], _nbytes(exp))

    @classmethod
    def for_peer(cls, plan: Plan, spec: GPTSpec, cfg: TrainConfig, me: PeerId,
                 param_shapes: Sequence[Sequence[int]], param_dtype: str = "float32",
                 compression: CompressionConfig | None = None) -> MessageRules:
        """The rules for `me` under `plan`; `param_shapes` are its stage's parameters, in order;
        `compression` the run's (None: exact)."""
        comp = compression or CompressionConfig()
        try:
            d, s = plan.position(me)
        except KeyError:
            raise ValueError(f"peer {me!r} has no place in the plan") from None
        if param_dtype not in TORCH_DTYPES:
            raise ValueError(f"parameter dtype {param_dtype!r} cannot travel on the wire")
        table: dict[str, dict[PeerId, Expected]] = {}
        bursts: dict[PeerId, list[int]] = {}

        def add(what: str, src: PeerId, exp: Expected) -> None:
            table.setdefault(what, {})[src] = exp

        def burst(src: PeerId, msgs: int, nbytes: int) -> None:
            b = bursts.setdefault(src, [0, 0])
            b[0] += msgs
            b[1] += nbytes

        pipe = plan.pipeline(d)
        micro = split_batch(cfg.global_batch_seqs, plan.dp, cfg.micro_batches)[d]
        shapes = [(len(idx), spec.seq_len, spec.n_embd) for idx in micro]

        def boundary_of(coded: bool) -> list[Expected]:
            if comp.pp_method == "exact" or not coded:
                return [(cfg.wire_dtype, shape) for shape in shapes]
            return [("uint8", (activation_payload_bytes(shape, comp),)) for shape in shapes]

        prev, nxt = (pipe[s - 1] if s > 0 else None), (pipe[s + 1] if s + 1 < plan.stages else None)
        for src, kind, link in ((prev, "act", s - 1), (nxt, "grad", s)):
            if src is not None:  # a whole forward (backward) pass goes out without a wait
                boundary = boundary_of(plan.link_compressed(link, d))
                for m, exp in enumerate(boundary):
                    add(f"{kind}/{m}", src, exp)
                burst(src, len(boundary), sum(map(_nbytes, boundary)))
        if s == plan.stages - 1:
            for src in plan.dp_group(s):
                if src != me:
                    add("loss", src, _SMALL)
                    burst(src, 1, _nbytes(_SMALL))
        links = plan.links  # some groups exact, others not: the norm's two parts (worker.py)
        norm = ("float64", (2,)) if comp.dp_method != "exact" and links is not None and not all(links.dp) else _SMALL
        for src in pipe:
            if src != me:
                add("norm", src, norm)
                burst(src, 1, _nbytes(norm))
        if spec.tied_head and plan.stages > 1 and s in (0, plan.stages - 1):
            src = pipe[plan.stages - 1 if s == 0 else 0]
            exp = (param_dtype, (spec.vocab, spec.n_embd))
            add("tied", src, exp)
            burst(src, 1, _nbytes(exp))
        group = plan.dp_group(s)
        sends_to = set(bursts)  # every relation above is symmetric
        coded = comp.dp_method != "exact" and plan.group_compressed(s)
        ring = not coded or comp.dp_warmup_steps > 0
        if len(group) > 1 and param_shapes and ring:
            src, ring_burst = _ring(add, group, group.index(me), param_shapes, param_dtype, cfg.bucket_bytes)
            burst(src, *ring_burst)
            sends_to.add(group[(group.index(me) + 1) % len(group)])
        if len(group) > 1 and param_shapes and coded:  # the all-gather: every member
            exp = ("uint8", (sync_payload_bytes(comp, sum(math.prod(shape) for shape in param_shapes)),))
            for src in group:
                if src != me:
                    add("dpc", src, exp)
                    burst(src, 1, _nbytes(exp))
                    sends_to.add(src)
        return cls(me, plan.epoch, table, {src: (m, b) for src, (m, b) in bursts.items()}, frozenset(sends_to))

    def expect(self, src: PeerId, tag: object) -> Expected | None:
        """(dtype name, shape) that `src` sends `me` under `tag`, or None if it may not send it."""
        parts = split_tag(tag)
        if parts is None or parts[0] != self.epoch:
            return None
        by_src = self._table.get(parts[2])
        return None if by_src is None else by_src.get(src)

    def expected(self, step: int) -> dict[tuple[PeerId, str], Expected]:
        """Every message `me` receives in `step`: {(source, tag): (dtype name, shape)}."""
        return {(src, f"{self.epoch}.{step}/{what}"): exp
                for what, by_src in self._table.items() for src, exp in by_src.items()}

    def max_message_bytes(self, src: PeerId) -> int:
        """The largest message `src` may send `me` (0 when it sends nothing)."""
        return self._max.get(src, 0)

    def burst(self, src: PeerId) -> tuple[int, int]:
        """(messages, bytes): an upper bound on what `src` sends `me` in a row before it next
        waits to receive anything (a pass's activations or gradients, one ring step's buckets,
        the tied gradient, the loss and the norm, summed)."""
        return self._bursts.get(src, (0, 0))


def _ring(add: Callable[[str, PeerId, Expected], None], group: Sequence[PeerId], r: int, param_shapes: Sequence[Sequence[int]], dtype: str,
          bucket_bytes: int) -> tuple[PeerId, tuple[int, int]]:
    """Add the chunks member r receives from r-1 in `ring_all_reduce`; (r-1, its largest ring step)."""
    n, dt = len(group), TORCH_DTYPES[dtype]
    prv = group[(r - 1) % n]
    metas = [torch.empty(tuple(shape), dtype=dt, device="meta") for shape in param_shapes]
    buckets = make_buckets(metas, bucket_bytes)
    sizes = []  # sizes[b][c]: elements of chunk c of bucket b, as torch.tensor_split cuts them
    for bucket in buckets:
        total = sum(metas[i].numel() for i in bucket)
        sizes.append([c.numel() for c in torch.tensor_split(torch.empty(total, device="meta"), n)])
    worst = (0, 0)
    for phase in ("rs", "ag"):
        for step in range(n - 1):
            recv_c = (r - step - 1) % n if phase == "rs" else (r - step) % n
            step_bytes = 0
            for b, chunk_sizes in enumerate(sizes):
                exp = (dtype, (chunk_sizes[recv_c],))
                add(f"dp/{phase}{step}/b{b}", prv, exp)
                step_bytes += _nbytes(exp)
            worst = max(worst, (len(sizes), step_bytes), key=lambda x: x[1])
    return prv, worst


def _nbytes(exp: Expected) -> int:
    n = TORCH_DTYPES[exp[0]].itemsize
    for dim in exp[1]:
        n *= dim
    return n
