"""`python -m dtfm.train`: train a preset on one machine, S x D stage replicas in threads on the
in-memory Comm, with a progress line and optional JSON lines (one per step).

Exit status: 0 success, 1 an error explained on stderr (`python -m dtfm.train: error: ...`),
2 bad command line, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

import torch

from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from .data import ByteTokenizer, load_corpus, split_batch
from .local import LocalCluster
from .model import assemble, generate
from .plan import Plan
from .spec import PRESETS, TrainConfig, get_preset

__all__ = ["build_parser", "main"]

PROG = "python -m dtfm.train"

# CLI names that differ from the config field they set (the rest are the field name, dashed).
_RENAMED = {"global_batch_seqs": "batch", "grad_clip_norm": "grad-clip"}


class CliError(Exception):
    """A failure to report on stderr as `python -m dtfm.train: error: ...`, exit status 1."""


def _count(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is less than {low}")
        return value
    return parse


def _weights(text: str) -> list[float]:
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 epilog="Exit status: 0 success, 1 an error explained on stderr, "
                                        "2 bad command line, 130 interrupted.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape")
    ap.add_argument("--steps", type=_count(0), default=200, help="steps to train (from the resumed step, if any)")
    ap.add_argument("--stages", type=_count(1), default=1, help="pipeline stages S")
    ap.add_argument("--dp", type=_count(1), default=1, help="data-parallel pipelines D")
    ap.add_argument("--layer-weights", type=_weights, default=None,
                    help="comma-separated relative stage sizes, e.g. 1,2,1; unset: even split")
    ap.add_argument("--data", default=None, help="text file or folder; unset: the Python standard library's source")
    ap.add_argument("--device", default="cpu", help="torch device for every stage (cpu, cuda)")
    ap.add_argument("--checkpoint-dir", default=None, help="write stage checkpoints here; unset: none")
    ap.add_argument("--checkpoint-every", type=_count(0), default=0,
                    help="steps between checkpoints; 0: only at the end")
    ap.add_argument("--keep", type=_count(1), default=3, help="checkpoints kept per stage")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    ap.add_argument("--log-json", action="store_true", help="print one JSON object per step on stdout")
    ap.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    ap.add_argument("--sample", type=_count(0), default=0,
                    help="after training, print this many sampled bytes on stderr")
    ap.add_argument("--prompt", default="def ", help="text the --sample continues")
    cfg = ap.add_argument_group("training config (dtfm.train.TrainConfig)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + _RENAMED.get(f.name, f.name.replace("_", "-"))
        cfg.add_argument(flag, dest=f.name, type=type(f.default), default=f.default, help=f.metadata["help"])
    return ap


class Progress:
    """One status line on stderr, redrawn in place on a terminal, else printed every 10%."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.done = 0

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if not self.enabled:
            return
        self.done += 1
        frac = self.done / self.total
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        eta = (time.perf_counter() - self.t0) / self.done * (self.total - self.done)
        line = f"step {step:>6} [{bar}] {self.done}/{self.total} loss {loss:.4f} {tok_s:,.0f} tok/s eta {eta:.0f}s"
        if self.tty:
            print("\r" + line, end="\n" if self.done == self.total else "", file=sys.stderr, flush=True)
        elif self.done == self.total or self.done % max(1, self.total // 10) == 0:
            print(line, file=sys.stderr, flush=True)


def _resume_states(root: str, spec, cfg, plan: Plan, device: str) -> dict:
    """Newest step every stage has a checkpoint for, loaded for every replica."""
    per_stage = []
    for rng in plan.layer_ranges:
        paths = list_checkpoints(root, rng)
        if not paths:
            raise CheckpointError(f"no checkpoint for layers {rng} in {root}: resume with the same --stages "
                                  f"and --layer-weights as the run that wrote it")
        per_stage.append({int(p.stem.split("-")[1]): p for p in paths})
    common = set.intersection(*(set(d) for d in per_stage))
    if not common:
        raise CheckpointError(f"the stages in {root} share no checkpointed step")
    step = max(common)
    states = {}
    for s, rng in enumerate(plan.layer_ranges):
        for peer in plan.dp_group(s):
            st = load_checkpoint(per_stage[s][step], device)
            if st.spec != spec or st.cfg != cfg:
                raise CheckpointError(f"checkpoint {per_stage[s][step]} was made with another model or config")
            states[peer] = st
    return states


def _print_sample(spec, cfg, stages, step: int, args) -> None:
    tok = ByteTokenizer()
    model = assemble(spec, stages, cfg.seed).eval()
    prompt = torch.from_numpy(tok.encode(args.prompt).astype("int64"))
    gen = torch.Generator().manual_seed(cfg.seed)
    out = generate(model, prompt, args.sample, temperature=0.8, generator=gen)
    text = tok.decode(t for t in out.tolist() if t < tok.vocab)
    print(f"--- sample after {step} steps ---\n{text}\n---", file=sys.stderr)


def _setup(args, parser: argparse.ArgumentParser):
    """Config, model, plan, corpus and resumed states from the arguments.

    Flags that cannot go together are a bad command line (exit 2); values the config, the plan,
    the batch split or the corpus loader refuse are a CliError, a missing or foreign checkpoint
    a CheckpointError."""
    if args.sample and not args.prompt:
        parser.error("--sample needs a non-empty --prompt")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    spec = get_preset(args.preset)
    try:  # each of these only checks the values given on the command line
        cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
        plan = Plan.grid(spec.n_layer, args.stages, args.dp, args.layer_weights)
        split_batch(cfg.global_batch_seqs, plan.dp, cfg.micro_batches)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError("no CUDA device is available: use --device cpu")
    try:
        corpus = load_corpus(args.data)
    except ValueError as e:  # no such path, or no text in it
        raise CliError(str(e)) from None
    states = _resume_states(args.checkpoint_dir, spec, cfg, plan, args.device) if args.resume else None
    return cfg, spec, plan, corpus, states


def _train(args, cl: LocalCluster, cfg: TrainConfig, spec, plan: Plan) -> None:
    progress = Progress(args.steps, not args.quiet)
    tokens_per_step = cfg.global_batch_seqs * spec.seq_len
    for i in range(args.steps):
        step = cl.step_index
        t0 = time.perf_counter()
        loss = cl.step()
        dt = time.perf_counter() - t0
        norm = next(iter(cl.last_results.values())).grad_norm
        if args.log_json:
            print(json.dumps({"step": step, "loss": round(loss, 6), "grad_norm": round(norm, 6),
                              "lr": cfg.lr_at(step), "tokens": tokens_per_step, "step_s": round(dt, 4),
                              "tokens_per_s": round(tokens_per_step / dt, 1)}), flush=True)
        progress.update(step, loss, tokens_per_step / dt)
        every = args.checkpoint_every and cl.step_index % args.checkpoint_every == 0
        if args.checkpoint_dir and (every or i == args.steps - 1):
            for peer in plan.pipeline(0):  # replicas of a stage are identical: one copy each
                save_checkpoint(args.checkpoint_dir, cl.states[peer], args.keep)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(args, parser)
    except KeyboardInterrupt:
        return 130
    except (CliError, CheckpointError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


def _run(args, parser: argparse.ArgumentParser) -> int:
    cfg, spec, plan, corpus, states = _setup(args, parser)
    torch.set_num_threads(1 if len(plan.peers) > 1 else torch.get_num_threads())
    with LocalCluster(spec, cfg, plan, corpus, states=states, device=args.device) as cl:
        if not args.quiet:
            print(f"{spec.name}: {spec.params / 1e6:.2f} M parameters, {plan.stages} stage(s) {plan.layer_ranges} x "
                  f"{plan.dp} pipeline(s), {cfg.micro_batches} micro-batches, corpus {corpus.name} "
                  f"({len(corpus.tokens) / 1e6:.1f} MB), from step {cl.step_index}", file=sys.stderr)
        try:
            _train(args, cl, cfg, spec, plan)
        except KeyboardInterrupt:
            print(f"\ninterrupted before step {cl.step_index} finished; the last checkpoint is intact",
                  file=sys.stderr)
            return 130
        if args.sample > 0:
            _print_sample(spec, cfg, [cl.states[p].module for p in plan.pipeline(0)], cl.step_index, args)
    return 0
