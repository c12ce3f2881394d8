"""Small GPT-2 folders that transformers itself builds and saves, for the tests that start runs
from a Hugging Face model folder (tests/peer/test_run_spec.py, tests/swarm/test_swarm_train.py). Nothing
is downloaded; transformers is imported only when a folder is built."""

from __future__ import annotations

from pathlib import Path


def save_gpt2(folder: Path, *, n_positions: int, n_embd: int) -> Path:
    """A GPT-2 of 4 layers, 4 heads and 256 tokens, with transformers' own initialisation from
    seed 0, saved in `folder`; `folder`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=n_positions, n_embd=n_embd, n_layer=4,
                               n_head=4)).save_pretrained(folder)
    return folder
