"""`python -m dtfm.train`: train a preset on one machine, S x D stage replicas in threads on the
in-memory Comm, with a progress line and optional JSON lines (one per step).

Other commands: `python -m dtfm.train sample` (text from a model folder), `... tokenize` (a text
corpus into a token file), `... export` (stage checkpoints into a Hugging Face GPT-2 folder);
each has its own --help.

Exit status: 0 success, 1 an error explained on stderr (`python -m dtfm.train: error: ...`),
2 bad command line, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

import torch

from dtfm.cli_base import (NON_NEGATIVE_INT, POSITIVE_INT, CliError, DefaultsHelpFormatter, run_command,
                           version_text)

from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint, stage_tensors
from .compress import COMPRESSION_PRESETS, CompressionConfig, parse_compression
from .data import TOKEN_DTYPES, load_corpus, split_batch, tokenize_to_file
from .hf import HFError, export_checkpoint_dir, export_hf, hf_stage_state, load_hf_spec, model_tokenizer
from .local import LocalCluster
from .model import assemble, generate
from .plan import Plan
from .spec import PRESETS, TrainConfig, get_preset
from .tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer
from .plan import check_compression

__all__ = ["build_parser", "main"]

PROG = "python -m dtfm.train"

# CLI names that differ from the config field they set (the rest are the field name, dashed).
_RENAMED = {"global_batch_seqs": "batch", "grad_clip_norm": "grad-clip"}


def _weights(text: str) -> list[float]:
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 epilog="Commands: `sample`, `tokenize`, `export` (see `python -m dtfm.train "
                                        "COMMAND --help`). Exit status: 0 success, 1 an error explained on "
                                        "stderr, 2 bad command line, 130 interrupted.",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--version", action="version", version=version_text())
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model shape; unset: tiny")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="start from the weights of a Hugging Face GPT-2 folder (its shape replaces --preset)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="tokenize text data with this Hugging Face folder's tokenizer; unset: bytes, or "
                         "the --init-from folder's tokenizer")
    ap.add_argument("--token-dtype", default=None, choices=TOKEN_DTYPES,
                    help="read --data as a token file of this dtype; unset: a .bin file is uint16 "
                         "(*.uint32.bin: uint32), anything else text")
    ap.add_argument("--export", default=None, metavar="DIR",
                    help="after training, write the model here as a Hugging Face GPT-2 folder")
    ap.add_argument("--steps", type=NON_NEGATIVE_INT, default=200, help="steps to train (from the resumed step, if any)")
    ap.add_argument("--stages", type=POSITIVE_INT, default=1, help="pipeline stages S")
    ap.add_argument("--dp", type=POSITIVE_INT, default=1, help="data-parallel pipelines D")
    ap.add_argument("--compress", default="exact", metavar="NAME[,FIELD=VALUE...]",
                    help="compression preset, with fields of dtfm.train.compress.CompressionConfig changed after "
                         "commas, e.g. diloco,inner_steps=8 (docs/compression.md); slow-link is the choice for "
                         "slow networks. dp_overlap_steps=N (DiLoCo) sends a synchronisation's pseudo-gradient and "
                         "runs the next N inner steps while it travels, applying the outer update after them "
                         "(streaming DiLoCo's overlap; 0: the stage waits for the exchange). The presets: " + " ".join(f"{name}: {c.describe()}." for name, c in
                                                                   COMPRESSION_PRESETS.items()) +
                         " (default: %(default)s)")
    ap.add_argument("--compress-option", action="append", default=[], metavar="FIELD=VALUE",
                    help="override one field of the --compress preset (dtfm.train.compress.CompressionConfig), "
                         "e.g. inner_steps=16; repeatable")
    ap.add_argument("--layer-weights", type=_weights, default=None,
                    help="comma-separated relative stage sizes, e.g. 1,2,1; unset: even split")
    ap.add_argument("--data", default=None, metavar="FILE|DIR",
                    help="text file or folder; unset: the Python standard library's source")
    ap.add_argument("--device", default="cpu", help="torch device for every stage (cpu, cuda)")
    ap.add_argument("--checkpoint-dir", default=None, help="write stage checkpoints here; unset: none")
    ap.add_argument("--checkpoint-every", type=NON_NEGATIVE_INT, default=0,
                    help="steps between checkpoints; 0: only at the end")
    ap.add_argument("--keep", type=POSITIVE_INT, default=3, help="checkpoints kept per stage")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    ap.add_argument("--log-json", action="store_true", help="print one JSON object per step on stdout")
    ap.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    ap.add_argument("--sample", type=NON_NEGATIVE_INT, default=0,
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


def checkpoint_roots(root: str, plan: Plan, comp: CompressionConfig) -> list[str]:
    """Where pipeline d's stages are checkpointed: `root` for all of them when the replicas of a
    stage are identical (exact DP), else `root/pipeline-<d>` each (the error-feedback residual and,
    with DiLoCo, the weights between synchronisations and the inner AdamW moments are per replica)."""
    if comp.dp_method == "exact":
        return [root] * plan.dp
    return [f"{root}/pipeline-{d}" for d in range(plan.dp)]


def _resume_states(root: str, spec, cfg, plan: Plan, device: str, comp: CompressionConfig) -> dict:
    """Newest step every stage (of every replica, with per-replica state) has a checkpoint for."""
    roots = checkpoint_roots(root, plan, comp)
    per_stage = []
    for r in sorted(set(roots)):
        for rng in plan.layer_ranges:
            paths = list_checkpoints(r, rng)
            if not paths:
                raise CheckpointError(f"no checkpoint for layers {rng} in {r}: resume with the same --stages, "
                                      f"--layer-weights, --compress (and, with DP compression, --dp) as the run "
                                      f"that wrote it")
            per_stage.append({(r, rng, int(p.stem.split("-")[1])): p for p in paths})
    common = set.intersection(*({k[2] for k in d} for d in per_stage))
    if not common:
        raise CheckpointError(f"the stages in {root} share no checkpointed step")
    step = max(common)
    found = {k: p for d in per_stage for k, p in d.items()}
    states = {}
    for s, rng in enumerate(plan.layer_ranges):
        for d, peer in enumerate(plan.dp_group(s)):
            path = found[(roots[d], rng, step)]
            st = load_checkpoint(path, device)
            if st.spec != spec or not cfg.trains_as(st.cfg):  # (under any pipeline schedule)
                raise CheckpointError(f"checkpoint {path} was made with another model or config")
            if st.compress.config != comp:
                raise CheckpointError(f"checkpoint {path} was made with compression "
                                      f"{st.compress.config.describe()!r}, not {comp.describe()!r}")
            states[peer] = st
    return states


def _print_sample(spec, cfg, stages, step: int, args, tok) -> None:
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
    if args.init_from and (args.preset or args.resume):
        parser.error("--init-from sets the model: leave out --preset and --resume")
    if args.tokenizer and (args.token_dtype or (args.data or "").endswith(".bin")):
        parser.error("--data is a token file, already tokenized: leave out --tokenizer")
    if args.export and os.path.exists(args.export):
        raise CliError(f"--export {args.export} exists: choose a new folder")
    try:
        spec = load_hf_spec(args.init_from) if args.init_from else get_preset(args.preset or "tiny")
        tok = _tokenizer(args)
    except (HFError, TokenizerError) as e:
        raise CliError(str(e)) from None
    try:  # each of these only checks the values given on the command line
        cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
        plan = Plan.grid(spec.n_layer, args.stages, args.dp, args.layer_weights)
        split_batch(cfg.global_batch_seqs, plan.dp, cfg.micro_batches)
        cfg.warmups(plan.stages)  # (--pipeline-warmups: one count per stage)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError("no CUDA device is available: use --device cpu")
    try:
        corpus = load_corpus(args.data, tokenizer=tok, token_dtype=args.token_dtype)
        corpus.check_vocab(spec.vocab)
    except ValueError as e:  # no such path, no text in it, ids the model has no embedding for
        raise CliError(str(e)) from None
    try:
        comp = parse_compression(args.compress).with_options(args.compress_option)
        check_compression(spec, plan, comp)
    except ValueError as e:
        raise CliError(str(e)) from None
    states = _resume_states(args.checkpoint_dir, spec, cfg, plan, args.device, comp) if args.resume else None
    if args.init_from:
        try:
            states = {p: hf_stage_state(args.init_from, cfg, plan.layer_ranges[plan.position(p)[1]], spec,
                                        device=args.device) for p in plan.peers}
        except HFError as e:
            raise CliError(str(e)) from None
    return cfg, spec, plan, corpus, tok, states, comp


def _tokenizer(args) -> ByteTokenizer | HFTokenizer:
    """--tokenizer's, else for text data the --init-from folder's (bytes for a model trained on
    bytes), else bytes."""
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    token_file = args.token_dtype or (args.data or "").endswith(".bin")
    if args.init_from and not token_file:
        return model_tokenizer(args.init_from)  # type: ignore[return-value]
    return ByteTokenizer()


def _train(args, cl: LocalCluster, cfg: TrainConfig, spec, plan: Plan) -> None:
    roots = checkpoint_roots(args.checkpoint_dir, plan, cl.compression) if args.checkpoint_dir else []
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
                              "tokens_per_s": round(tokens_per_step / dt, 1),
                              "bytes_sent": cl.last_step_bytes}), flush=True)
        progress.update(step, loss, tokens_per_step / dt)
        every = args.checkpoint_every and cl.step_index % args.checkpoint_every == 0
        if args.checkpoint_dir and (every or i == args.steps - 1):
            for d in sorted({roots.index(r) for r in roots}):  # identical replicas: pipeline 0 only
                for peer in plan.pipeline(d):
                    save_checkpoint(roots[d], cl.states[peer], args.keep)


def build_tokenize_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"{PROG} tokenize",
                                 description="Tokenize a text file or folder into a token file (raw uint16 or "
                                             "uint32 ids, nanoGPT's train.bin convention) for --data.",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--tokenizer", required=True, metavar="DIR", help="Hugging Face folder with tokenizer files")
    ap.add_argument("--data", required=True, metavar="FILE|DIR", help="text file or folder")
    ap.add_argument("--out", required=True, help="token file to write (name it *.bin; *.uint32.bin for uint32)")
    ap.add_argument("--token-dtype", default=None, choices=("uint16", "uint32"),
                    help="unset: uint32 for a *.uint32.bin name or a vocabulary over 65536 ids, else uint16")
    return ap


def build_export_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"{PROG} export",
                                 description="Write the stage checkpoints of a --checkpoint-dir as one Hugging "
                                             "Face GPT-2 folder (model.safetensors, config.json, tokenizer).",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--checkpoint-dir", required=True, help="folder of stage checkpoints")
    ap.add_argument("--out", required=True, help="folder to write (must not exist, unless --force)")
    ap.add_argument("--step", type=NON_NEGATIVE_INT, default=None, help="unset: the newest step every stage has")
    ap.add_argument("--tokenizer-from", default=None, metavar="DIR",
                    help="copy this Hugging Face folder's tokenizer files; unset: the byte tokenizer")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    return ap


def _tokenize(argv: list[str]) -> int:
    args = build_tokenize_parser().parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    dtype = args.token_dtype or ("uint32" if args.out.endswith(".uint32.bin") or tok.vocab > 65536 else "uint16")
    try:
        out, n = tokenize_to_file(args.data, tok, args.out, dtype)
    except (OSError, ValueError) as e:  # no such data path, a vocabulary too large for the dtype
        raise CliError(str(e)) from None
    print(f"{out}: {n:,} {dtype} tokens", file=sys.stderr)
    return 0


def _export(argv: list[str]) -> int:
    args = build_export_parser().parse_args(argv)
    out = export_checkpoint_dir(args.checkpoint_dir, args.out, args.step, tokenizer_from=args.tokenizer_from,
                                overwrite=args.force)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "sample":
        from .sample import sample_main
        return sample_main(argv[1:])

    def command() -> int:
        if argv and argv[0] in ("tokenize", "export"):
            return (_tokenize if argv[0] == "tokenize" else _export)(argv[1:])
        parser = build_parser()
        return _run(parser.parse_args(argv), parser)
    return run_command(PROG, command, user_errors=(CheckpointError, HFError, TokenizerError))


def _run(args, parser: argparse.ArgumentParser) -> int:
    cfg, spec, plan, corpus, tok, states, comp = _setup(args, parser)
    torch.set_num_threads(1 if len(plan.peers) > 1 else torch.get_num_threads())
    with LocalCluster(spec, cfg, plan, corpus, states=states, device=args.device, compression=comp) as cl:
        if not args.quiet:
            print(f"{spec.name}: {spec.params / 1e6:.2f} M parameters, {plan.stages} stage(s) {plan.layer_ranges} x "
                  f"{plan.dp} pipeline(s), {cfg.micro_batches} micro-batches, corpus {corpus.name} "
                  f"({len(corpus.tokens) / 1e6:.1f} M tokens), from step {cl.step_index}; compression "
                  f"{args.compress}: {comp.describe()}", file=sys.stderr)
        try:
            _train(args, cl, cfg, spec, plan)
        except KeyboardInterrupt:
            print(f"\ninterrupted before step {cl.step_index} finished; the last checkpoint is intact",
                  file=sys.stderr)
            return 130
        if args.sample > 0:
            _print_sample(spec, cfg, [cl.states[p].module for p in plan.pipeline(0)], cl.step_index, args, tok)
        if args.export:
            out = export_hf(spec, [stage_tensors(cl.states[p]) for p in plan.pipeline(0)], args.export,
                            tokenizer_from=args.tokenizer or (args.init_from if isinstance(tok, HFTokenizer)
                                                              else None))
            print(f"wrote {out}", file=sys.stderr)
    return 0
