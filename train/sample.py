"""`python -m dtfm.train sample`: generate text from a Hugging Face GPT-2 folder (one that
`dtfm-peer export` or `python -m dtfm.train --export` wrote, or any GPT-2-family folder with
safetensors weights), with the folder's tokenizer (the byte tokenizer for dtfm's byte-level
models; the Hugging Face tokenizer files otherwise, via the `tokenizers` package)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from .hf import HFError, load_hf, model_tokenizer
from .model import GPTStage, generate
from .tokenizer import TokenizerError

__all__ = ["sample_text", "build_sample_parser", "sample_main"]

PROG = "python -m dtfm.train sample"


def sample_text(folder: str | os.PathLike, prompt: str, tokens: int, temperature: float = 0.8,
                top_k: int | None = None, seed: int = 0, device: str = "cpu") -> str:
    """The prompt and `tokens` sampled tokens after it, decoded; HFError or TokenizerError if
    the folder cannot be used, ValueError for a bad argument."""
    if not prompt:
        raise ValueError("the prompt must not be empty")
    if top_k is not None and top_k < 1:
        raise ValueError("top_k must be at least 1")
    tok = model_tokenizer(folder)
    spec, params = load_hf(folder)
    model = GPTStage(spec, (0, spec.n_layer), seed=0)
    model.load_state_dict(params)
    model = model.to(device).eval()
    ids = torch.from_numpy(tok.encode(prompt).astype("int64"))
    if ids.numel() == 0:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens")
    gen = torch.Generator().manual_seed(seed)
    out = generate(model, ids, tokens, temperature=temperature, generator=gen, top_k=top_k)
    return tok.decode(out.tolist())


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if v < (1 if kind is int else 0):
            raise argparse.ArgumentTypeError(f"{text!r} is too small")
        return v
    return parse


def build_sample_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face GPT-2 folder (config.json, model.safetensors)")
    ap.add_argument("--prompt", required=True, help="text the sample continues")
    ap.add_argument("--tokens", type=_positive(int), default=200, help="tokens to generate")
    ap.add_argument("--temperature", type=_positive(float), default=0.8, help="softmax temperature; 0: greedy")
    ap.add_argument("--top-k", type=_positive(int), default=None, help="sample among the k likeliest tokens only")
    ap.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    return ap


def sample_main(argv: list[str]) -> int:
    args = build_sample_parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{PROG}: error: no CUDA device is available: use --device cpu", file=sys.stderr)
        return 1
    try:
        text = sample_text(args.model, args.prompt, args.tokens, args.temperature, args.top_k, args.seed,
                           args.device)
    except (HFError, TokenizerError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(text)
    return 0
