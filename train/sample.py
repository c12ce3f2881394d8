"""`python -m dtfm.train sample`: generate text from a Hugging Face GPT-2 folder (one that
`dtfm-peer export` or `python -m dtfm.train --export` wrote, or any GPT-2-family folder with
safetensors weights), with the folder's tokenizer (the byte tokenizer for dtfm's byte-level
models; the Hugging Face tokenizer files otherwise, via the `tokenizers` package)."""

from __future__ import annotations

import argparse
import os

import torch

from dtfm.cli_base import POSITIVE_INT, CliError, DefaultsHelpFormatter, number, run_command

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


def build_sample_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face GPT-2 folder (config.json, model.safetensors)")
    ap.add_argument("--prompt", required=True, help="text the sample continues")
    ap.add_argument("--tokens", type=POSITIVE_INT, default=200, help="tokens to generate")
    ap.add_argument("--temperature", type=number(float, 0.0, "a non-negative number"), default=0.8, help="softmax temperature; 0: greedy")
    ap.add_argument("--top-k", type=POSITIVE_INT, default=None, help="sample among the k likeliest tokens only")
    ap.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    return ap


def sample_main(argv: list[str]) -> int:
    args = build_sample_parser().parse_args(argv)

    def command() -> int:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise CliError("no CUDA device is available: use --device cpu")
        try:
            text = sample_text(args.model, args.prompt, args.tokens, args.temperature, args.top_k, args.seed,
                               args.device)
        except ValueError as e:
            raise CliError(str(e)) from None
        print(text)
        return 0
    return run_command(PROG, command, user_errors=(HFError, TokenizerError))
