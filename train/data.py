"""Training data: a corpus every machine has, a byte tokenizer, deterministic sampling.

The default corpus is the source of the running interpreter's standard library; `--data`
names any text file or folder instead. Sample i of step k starts at an offset drawn from
(seed, k, i) alone, so a step's batch does not depend on which peer holds which pipeline nor
on how many pipelines there are: a pipeline simply takes its range of sample indices.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["ByteTokenizer", "Corpus", "load_corpus", "split_batch"]

_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".toml", ".json", ".c", ".h")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless for any text."""

    vocab = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # uint8 byte tokens, the whole corpus
    name: str

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokens: peers of one run must agree on it."""
        return hashlib.sha256(self.tokens.tobytes()).hexdigest()

    def sample_offsets(self, seed: int, step: int, indices: range, seq_len: int) -> np.ndarray:
        hi = len(self.tokens) - seq_len - 1
        if hi < 1:
            raise ValueError(f"corpus {self.name} has {len(self.tokens)} tokens, too few for seq_len {seq_len}")
        return np.array([np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, i])))
                         .integers(0, hi) for i in indices], dtype=np.int64)

    def batch(self, seed: int, step: int, indices: range, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both (len(indices), seq_len) int64."""
        offs = self.sample_offsets(seed, step, indices, seq_len)
        win = np.stack([self.tokens[o:o + seq_len + 1] for o in offs]).astype(np.int64)
        t = torch.from_numpy(win)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _files_under(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__") and not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(_TEXT_SUFFIXES))
    return out


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int = 32 << 20) -> Corpus:
    """The text at `path` (a file, or the text files under a folder in sorted order), or by
    default the standard library's source; at most max_bytes are kept."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files, name = _files_under(root), f"stdlib:{root}"
    else:
        root = Path(path)
        if not root.exists():
            raise ValueError(f"data path {root} does not exist: pass a text file or a folder of text files")
        files, name = ([root] if root.is_file() else _files_under(root)), str(root)
    parts, size = [], 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError:
            continue
        parts.append(b)
        size += len(b)
        if size >= max_bytes:
            break
    data = b"\n".join(parts)[:max_bytes]
    if not data:
        raise ValueError(f"no text found at {name}")
    return Corpus(np.frombuffer(data, dtype=np.uint8).copy(), name)


def split_batch(global_batch: int, pipelines: int, micro_batches: int) -> list[list[range]]:
    """Sample-index ranges: [pipeline][micro-batch], contiguous, as even as possible.

    Every index in [0, global_batch) lands in exactly one micro-batch of one pipeline.
    """
    if pipelines < 1 or micro_batches < 1:
        raise ValueError("need at least one pipeline and one micro-batch")
    if global_batch < pipelines * micro_batches:
        raise ValueError(f"global batch {global_batch} is too small for {pipelines} pipelines x "
                         f"{micro_batches} micro-batches: every micro-batch needs a sample")
    out = []
    for d in range(pipelines):
        lo, hi = global_batch * d // pipelines, global_batch * (d + 1) // pipelines
        n = hi - lo
        out.append([range(lo + n * m // micro_batches, lo + n * (m + 1) // micro_batches) for m in range(micro_batches)])
    return out
