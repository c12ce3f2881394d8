"""Export a run's model: gather every stage from the peers that hold it into one Hugging Face
GPT-2 folder on the asking machine (`dtfm-peer export RUN --out DIR`, see docs/control.md,
"Export").

The operator signs an export of the run that names the local daemon's peer (`OperatorOp` kind
"export", args {"peer"}); the daemon asks every live member (RUN_STATE `export`, with the
signed export) what it holds of the run: `(first layer, end layer, step)` of its checkpoints,
and its stage in memory when it is not stepping. `choose_export` (pure) takes the newest step
at which held stages chain from layer 0 to the last layer. For each of those stages the daemon
asks up to `MAX_OFFER_HOLDERS` holders to offer its weights (RUN_STATE `export` with the step
and layers: the holder encodes the stage's parameters alone, without the optimizer moments and
compression state a peer that trains on needs, as a weights offer of its recovery server that
only the named peer may fetch), takes the digest most of them give and fetches it with
`fetch_stage(..., part=Part.WEIGHTS)` (hash-verified chunks, several holders at once,
control/epoch/recovery.py), no larger than the stage's parameters can be (`max_weights_bytes`,
from the plan's model). Every part's description must be of the run's model and that step, and
it must hold exactly the stage's parameters. The model is then written by `export_hf`
(train/hf.py): under a temporary name beside DIR, then renamed.

A holder answers only the peer that an operator's export of that run names, within the
operator clock skew window (`export_refusal`, control/epoch/access.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import trio

from dtfm.net import PeerTransport, ProtocolError, get_bytes, get_dict, get_int, get_list, short_id
from dtfm.train import CheckpointError, GPTSpec, stage_param_names, weight_tensors

from .allocation import Allocation
from .epoch.access import export_refusal
from .epoch.recovery import Part, RateOf, RecoveryError, fetch_stage
from .epoch.runstate import PeerRunState
from .epoch.stages import StageHost
from .operator import SignedOp
from .refusals import Refused, Refusals

__all__ = ["ExportError", "ExportPlan", "ExportProgress", "Held", "answer_export", "choose_export", "export_run",
           "max_weights_bytes", "parse_export_ask", "parse_held"]

logger = logging.getLogger(__name__)

MAX_HELD = 64  # (layers, step) entries one holder lists
MAX_OFFER_HOLDERS = 4  # holders asked to offer one stage
PARAM_BYTES = 4  # a stage's parameters are float32
HEADER_BYTES_PER_TENSOR = 256  # a safetensors header entry: name, dtype, shape, offsets (with room)


class ExportError(Exception):
    """An export that cannot be done, with the reason for the operator."""


@dataclass(frozen=True)
class Held:
    """What one peer holds of the run: (first layer, end layer, step) entries and the model."""

    entries: frozenset[tuple[int, int, int]]
    spec: GPTSpec | None


def parse_held(answer: object) -> Held:
    """A holder's answer to RUN_STATE `export` (no step); raises only ProtocolError."""
    d = get_dict(answer, "export answer")
    entries = set()
    for e in get_list(d, "held", MAX_HELD):
        if not isinstance(e, list) or len(e) != 3 or not all(type(x) is int for x in e):
            raise ProtocolError("export answer: held entries are [first, end, step]")
        a, b, step = e
        if not 0 <= a < b <= 10**6 or not 0 <= step < 2**63:
            raise ProtocolError("export answer: a held entry is out of range")
        entries.add((a, b, step))
    return Held(frozenset(entries), _spec_untrusted(d.get("spec")))


def _spec_untrusted(obj: object) -> GPTSpec | None:
    """A model spec from the network (None: none given); raises only ProtocolError."""
    if obj is None:
        return None
    if not isinstance(obj, dict) or len(obj) > 32 or not all(
            type(k) is str and (v is None or type(v) in (int, float, str, bool)) for k, v in obj.items()):
        raise ProtocolError("export answer: spec must be a small map of plain values")
    if type(obj.get("n_layer")) is not int or not 1 <= obj["n_layer"] <= 10**4:
        raise ProtocolError("export answer: spec n_layer must be an integer in [1, 10000]")
    try:
        return GPTSpec.from_dict(dict(obj))
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"export answer: bad model spec: {e}") from None


@dataclass(frozen=True)
class ExportPlan:
    """The step to export, the stages (in layer order) and who holds each at that step."""

    step: int
    spec: GPTSpec
    ranges: tuple[tuple[int, int], ...]
    holders: Mapping[tuple[int, int], tuple[bytes, ...]]


def _chain(ranges: Iterable[tuple[int, int]], n_layer: int) -> tuple[tuple[int, int], ...] | None:
    """Ranges that split [0, n_layer) in order, the fewest (breadth first); None: none do."""
    by_start: dict[int, list[tuple[int, int]]] = {}
    for a, b in sorted(set(ranges)):
        by_start.setdefault(a, []).append((a, b))
    paths: dict[int, tuple[tuple[int, int], ...]] = {0: ()}
    frontier = [0]
    while frontier:
        nxt = []
        for at in frontier:
            for r in by_start.get(at, []):
                if r[1] not in paths:
                    paths[r[1]] = paths[at] + (r,)
                    nxt.append(r[1])
        frontier = nxt
    return paths.get(n_layer) if n_layer > 0 else None


def choose_export(held: Mapping[bytes, Held], run_name: str) -> ExportPlan:
    """The newest step at which the stages the peers hold cover the whole model (pure);
    ExportError naming what is missing when none does."""
    specs = Counter(h.spec for h in held.values() if h.spec is not None and h.entries)
    if not specs:
        raise ExportError(f"no live peer holds any stage of run {run_name}: are its peers up (they keep "
                          "checkpoints in DATA_DIR/checkpoints/RUN_ID)?")
    spec = specs.most_common(1)[0][0]
    if len(specs) > 1:
        logger.error("the holders of run %s disagree on its model: %s", run_name, dict(specs))
    n_layer = spec.n_layer
    at: dict[int, dict[tuple[int, int], list[bytes]]] = {}
    for peer, h in held.items():
        if h.spec != spec:
            continue
        for a, b, step in h.entries:
            if b <= n_layer:
                at.setdefault(step, {}).setdefault((a, b), []).append(peer)
    for step in sorted(at, reverse=True):
        chain = _chain(at[step], n_layer)
        if chain is not None:
            return ExportPlan(step, spec, chain, {r: tuple(sorted(at[step][r])) for r in chain})
    newest = max(at)
    covered = sorted(at[newest])
    missing = _gaps(covered, n_layer)
    raise ExportError(f"no step at which every layer of run {run_name} is held by a live peer: at step {newest}, "
                      f"the newest, nobody holds layers {', '.join(f'{a}-{b - 1}' for a, b in missing)}; "
                      "start the peers that hold them")


def _gaps(ranges: list[tuple[int, int]], n_layer: int) -> list[tuple[int, int]]:
    held = [False] * n_layer
    for a, b in ranges:
        for i in range(a, b):
            held[i] = True
    out: list[tuple[int, int]] = []
    for i, h in enumerate(held):
        if not h:
            if out and out[-1][1] == i:
                out[-1] = (out[-1][0], i + 1)
            else:
                out.append((i, i + 1))
    return out


def max_weights_bytes(spec: GPTSpec, layers: tuple[int, int]) -> int:
    """The most bytes the weights of stage `layers` of `spec` take encoded: its float32
    parameters and a header; what a holder's weights manifest may claim (an upper bound: a
    tied or head-less stage holds less)."""
    c, (a, b) = spec.n_embd, layers
    params = (b - a) * spec.layer_params
    if a == 0:
        params += (spec.vocab + spec.seq_len) * c
    if b == spec.n_layer:
        params += spec.vocab * c + 2 * c  # the head (or the tied embedding's copy) and the final norm
    return PARAM_BYTES * params + HEADER_BYTES_PER_TENSOR * len(stage_param_names(spec, layers)) + 1024


@dataclass
class ExportProgress:
    """How a running export is doing (the daemon's status shows it)."""

    run: str
    phase: str = "asking the peers what they hold"
    step: int | None = None
    stages_done: int = 0
    stages: int = 0
    bytes_fetched: int = 0
    per_stage: list[dict] = field(default_factory=list)

    def to_wire(self) -> dict:
        return {"run": self.run, "phase": self.phase, "step": self.step, "stages_done": self.stages_done,
                "stages": self.stages, "bytes_fetched": self.bytes_fetched}


Ask = Callable[[Iterable[bytes], dict, float], Awaitable[dict[bytes, dict]]]


async def export_run(signed: SignedOp, run_id: bytes, out_dir: Path, *, me: bytes, peers: Iterable[bytes], ask: Ask,
                     stages: StageHost, transport: PeerTransport,
                     address_of: Callable[[bytes], tuple[str, int] | None], timeout_s: float,
                     progress: ExportProgress, overwrite: bool = False, rate_of: RateOf | None = None,
                     tokenizer_for: Callable[[GPTSpec], Path | None] = lambda spec: None) -> dict:
    """Gather run `run_id` from `peers` (RUN_STATE `export` through `ask`) and write it to
    `out_dir` as a Hugging Face folder, with the tokenizer files of `tokenizer_for(the run's
    model)` (None: the byte tokenizer); the summary. `rate_of`: each holder's link rate, which
    the fetches' chunk deadlines follow (`fetch_stage`). ExportError with the reason."""
    from dtfm.train import export_hf  # (torch-heavy; only here)

    name = run_id.hex()[:8]
    body = {"op": "export", "run": run_id, "signed": signed.to_wire()}
    answers = await ask(sorted(set(peers)), body, timeout_s)
    held: dict[bytes, Held] = {}
    for peer, a in answers.items():
        if "error" in a or "reason" in a:
            logger.info("export of run %s: %s holds nothing for us: %s", name, short_id(peer),
                        str(a.get("error") or a.get("reason"))[:200])
            continue
        try:
            held[peer] = parse_held(a)
        except ProtocolError as e:
            logger.warning("export of run %s: %s sent a malformed answer: %s", name, short_id(peer), e)
    plan = choose_export(held, name)
    spec = plan.spec
    progress.phase, progress.step, progress.stages = "fetching", plan.step, len(plan.ranges)
    logger.info("exporting run %s at step %d: %d stages (%s)", name, plan.step, len(plan.ranges),
                ", ".join(f"layers {a}-{b - 1} from {len(plan.holders[(a, b)])} holders" for a, b in plan.ranges))
    parts: list[Mapping] = []
    for i, r in enumerate(plan.ranges):
        if me in plan.holders[r]:  # this peer's own copy: read, not fetched
            try:
                own = await trio.to_thread.run_sync(stages.state_at, run_id, r, plan.step)
            except CheckpointError as e:
                own = None
                logger.warning("export of run %s: this peer's copy of layers %s is unreadable: %s", name, r, e)
            if own is not None:
                parts.append(weight_tensors(own))
                progress.stages_done = i + 1
                logger.info("export of run %s: layers %d-%d from this peer (%d of %d stages)", name, r[0], r[1] - 1,
                            i + 1, len(plan.ranges))
                continue
        holders = [p for p in plan.holders[r] if p != me][:MAX_OFFER_HOLDERS]
        if not holders:
            raise ExportError(f"layers {r[0]}-{r[1] - 1} at step {plan.step} are held only by this peer, which "
                              "cannot read them")
        offers = await ask(holders, {**body, "step": plan.step, "layers": list(r)}, timeout_s)
        digests = Counter(a["digest"] for a in offers.values() if isinstance(a.get("digest"), str))
        if not digests:
            why = "; ".join(f"{short_id(p)}: {str(a.get('error') or a.get('reason'))[:200]}" for p, a in offers.items())
            raise ExportError(f"no holder of layers {r[0]}-{r[1] - 1} offered them at step {plan.step}: {why}")
        digest = digests.most_common(1)[0][0]
        if len(digests) > 1:
            logger.error("export of run %s: holders of layers %s disagree at step %d: %s", name, r, plan.step,
                         dict(digests))
        sources = [(p, address_of(p)) for p, a in offers.items() if a.get("digest") == digest]
        try:
            result = await fetch_stage(transport, sources, run_id=run_id, step=plan.step, layer_range=r,
                                       digest=digest, max_total_bytes=max_weights_bytes(spec, r),
                                       timeout_s=timeout_s, part=Part.WEIGHTS, rate_of=rate_of)
        except RecoveryError as e:
            raise ExportError(f"cannot fetch layers {r[0]}-{r[1] - 1}: {e}") from None
        meta = result.receiver.manifest.meta
        try:
            part_spec, part_step = GPTSpec.from_dict(meta["spec"]), int(meta["step"])
        except (KeyError, TypeError, ValueError) as e:
            raise ExportError(f"layers {r[0]}-{r[1] - 1}: bad stage description: {e}") from None
        if part_spec != spec or part_step != plan.step:
            raise ExportError(f"layers {r[0]}-{r[1] - 1} from {', '.join(short_id(p) for p, _ in sources)} are of "
                              f"another model or step ({part_spec.name}, step {part_step})")
        try:
            tensors = result.receiver.tensors()
        except ValueError as e:  # (TransferError, CheckpointError)
            raise ExportError(f"layers {r[0]}-{r[1] - 1}: {e}") from None
        want = {f"param/{n}" for n in stage_param_names(spec, r)}
        if set(tensors) != want:
            odd = sorted(set(tensors) ^ want)
            raise ExportError(f"layers {r[0]}-{r[1] - 1} from {', '.join(short_id(p) for p, _ in sources)} are not "
                              f"the stage's parameters alone (unexpected or missing: {', '.join(odd[:3])})")
        parts.append(tensors)
        progress.stages_done, progress.bytes_fetched = i + 1, progress.bytes_fetched + result.bytes
        logger.info("export of run %s: layers %d-%d fetched (%d of %d stages, %d bytes in %.2f s)", name, r[0],
                    r[1] - 1, i + 1, len(plan.ranges), result.bytes, result.seconds)
    progress.phase = "writing"

    def write() -> Path:
        return export_hf(spec, parts, out_dir, overwrite=overwrite, tokenizer_from=tokenizer_for(spec))

    try:
        path = await trio.to_thread.run_sync(write)
    except (ValueError, OSError) as e:  # (HFError is a ValueError; TransferError too)
        raise ExportError(f"cannot write {out_dir}: {e}") from None
    progress.phase = "done"
    logger.info("exported run %s at step %d to %s", name, plan.step, path)
    return {"run_id": run_id.hex(), "step": plan.step, "model": spec.name, "out": str(path),
            "stages": [[a, b] for a, b in plan.ranges], "bytes_fetched": progress.bytes_fetched}


def parse_export_ask(d: dict) -> tuple[bytes, SignedOp | None, int | None, tuple[int, int] | None]:
    """A RUN_STATE `export` body: (run, signed export, step, layers), the last two None for the
    listing; raises only ProtocolError."""
    run = get_bytes(d, "run", 16, 16)
    signed = SignedOp.from_wire(d["signed"]) if "signed" in d else None
    if "step" not in d:
        return run, signed, None, None
    step = get_int(d, "step", 0, 2**63 - 1)
    layers = d.get("layers")
    if not isinstance(layers, list) or len(layers) != 2 or not all(type(x) is int for x in layers) \
            or not 0 <= layers[0] < layers[1]:
        raise ProtocolError("RUN_STATE export: layers must be [first, end]")
    return run, signed, step, (layers[0], layers[1])



async def answer_export(sender: bytes, body: dict, *, operators: Iterable[bytes], now_s: float, skew_s: float,
                        stages: StageHost, current: Allocation | None, state: PeerRunState,
                        refusals: Refusals) -> dict:
    """A holder's answer to RUN_STATE `export` (see the module docstring): what it holds of the
    run, or an offer of one stage that the named peer may fetch; only for the peer an
    operator's signed export of that run names."""
    run, signed, step, layers = parse_export_ask(body)
    _, why = export_refusal(sender, signed, run, operators=frozenset(operators), now_s=now_s, skew_s=skew_s)
    if why is not None:
        refusals.refuse(Refused.EXPORT_NOT_SIGNED, sender, why)
        return {"error": why}
    if step is None or layers is None:
        held = set(stages.checkpoints(run))
        if state.run_id == run and state.layers is not None and state.at is not None and not state.running:
            held.add((state.layers[0], state.layers[1], state.at))
        entries = sorted(held, key=lambda e: e[2])[-MAX_HELD:]
        spec: dict | None = None
        if current is not None and current.run_id == run:
            spec = current.model.to_dict()
        else:  # an earlier run: the model its checkpoints were made with
            if entries:
                spec = await trio.to_thread.run_sync(stages.checkpoint_spec, run, entries[-1])
        return {"held": [list(e) for e in entries], "spec": spec}
    return await stages.offer_weights(run, step, layers, sender)
