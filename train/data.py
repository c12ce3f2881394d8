"""Training data: a corpus every machine has, tokenizers, deterministic sampling.

The default corpus is the source of the running interpreter's standard library; `--data`
names any text file or folder instead, or a pre-tokenized token file (`.bin`: token ids as
raw little-endian uint16, nanoGPT's `train.bin` convention, or uint32 for a `*.uint32.bin`),
read through a memory map so it may be larger than memory. Text is tokenized as UTF-8 bytes
by default, or by a Hugging Face tokenizer (`tokenizer.py`). Sample i of step k starts at an
offset drawn from (seed, k, i) alone, so a step's batch does not depend on which peer holds
which pipeline nor on how many pipelines there are: a pipeline simply takes its range of
sample indices.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from dtfm.files import atomic_file, atomic_write

from .tokenizer import ByteTokenizer, Tokenizer, token_dtype_for

if TYPE_CHECKING:
    import torch

__all__ = ["TOKEN_DTYPES", "ByteTokenizer", "Corpus", "load_corpus", "load_token_file", "split_batch",
           "tokenize_to_file", "write_token_file"]

_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".toml", ".json", ".c", ".h")
TOKEN_DTYPES = ("uint8", "uint16", "uint32")  # what a corpus's token ids may be stored as
_CHUNK_TOKENS = 1 << 22  # tokens hashed or scanned at a time: a memory-mapped corpus is never read whole


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # token ids (uint8 bytes, or uint16/uint32), in memory or memory-mapped
    name: str

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.dtype.name not in TOKEN_DTYPES:
            raise ValueError(f"corpus tokens must be a 1-d array of {'/'.join(TOKEN_DTYPES)}, "
                             f"got {self.tokens.dtype} {self.tokens.shape}")

    def _chunks(self) -> Iterator[np.ndarray]:
        for i in range(0, len(self.tokens), _CHUNK_TOKENS):
            yield np.ascontiguousarray(self.tokens[i:i + _CHUNK_TOKENS])

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the tokens (for uint16/uint32 ids, with the dtype's name first), computed
        once, a chunk at a time: peers of one run must agree on it."""
        h = hashlib.sha256()
        if self.tokens.dtype != np.uint8:
            h.update(f"dtfm-tokens/{self.tokens.dtype.name}\n".encode())
        for c in self._chunks():
            h.update(c.astype(c.dtype.newbyteorder("<"), copy=False).tobytes())
        return h.hexdigest()

    @cached_property
    def max_token(self) -> int:
        """The largest token id in the corpus (-1 when empty), computed once, a chunk at a time."""
        return max((int(c.max()) for c in self._chunks() if len(c)), default=-1)

    def check_vocab(self, vocab: int) -> None:
        """ValueError unless every token id is below the model's vocabulary size."""
        if self.max_token >= vocab:
            raise ValueError(f"corpus {self.name} holds token id {self.max_token}, the model's vocabulary has "
                             f"{vocab} ids: tokenize with the model's own tokenizer")

    def sample_offsets(self, seed: int, step: int, indices: range, seq_len: int) -> np.ndarray:
        hi = len(self.tokens) - seq_len - 1
        if hi < 1:
            raise ValueError(f"corpus {self.name} has {len(self.tokens)} tokens, too few for seq_len {seq_len}")
        return np.array([np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, i])))
                         .integers(0, hi) for i in indices], dtype=np.int64)

    def batch(self, seed: int, step: int, indices: range, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both (len(indices), seq_len) int64."""
        import torch  # (only a stage's worker asks for batches: loading and checking a corpus needs no torch)

        offs = self.sample_offsets(seed, step, indices, seq_len)
        win = np.stack([self.tokens[o:o + seq_len + 1] for o in offs]).astype(np.int64)
        t = torch.from_numpy(win)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _files_under(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__") and not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(_TEXT_SUFFIXES))
    return out


def _token_dtype_of(path: Path, token_dtype: str | None) -> str:
    dt = token_dtype or ("uint32" if path.name.endswith(".uint32.bin") else "uint16")
    if dt not in TOKEN_DTYPES:
        raise ValueError(f"token dtype must be one of {TOKEN_DTYPES}, got {dt!r}")
    return dt


def load_token_file(path: str | os.PathLike, token_dtype: str | None = None) -> Corpus:
    """A pre-tokenized corpus: raw little-endian token ids, memory-mapped (never read whole).

    `token_dtype` defaults to uint16 (nanoGPT's train.bin), or uint32 for `*.uint32.bin`."""
    path = Path(path)
    dt = np.dtype(_token_dtype_of(path, token_dtype)).newbyteorder("<")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ValueError(f"cannot read token file {path}: {e.strerror}") from None
    if size == 0:
        raise ValueError(f"token file {path} is empty")
    if size % dt.itemsize:
        raise ValueError(f"token file {path} has {size} bytes, not a whole number of {dt.name} tokens: "
                         "is the token dtype right?")
    return Corpus(np.memmap(path, dtype=dt, mode="r"), str(path))


def write_token_file(path: str | os.PathLike, tokens: np.ndarray, token_dtype: str = "uint16") -> Path:
    """Write token ids as a token file (atomically: a temporary file, fsynced, renamed)."""
    path = Path(path)
    dt = np.dtype(token_dtype).newbyteorder("<")
    arr = np.asarray(tokens)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(dt).max):
        raise ValueError(f"token ids outside {dt.name}'s range")
    atomic_write(path, arr.astype(dt).tobytes(), mode=0o600)
    return path


def _cut(data: bytes) -> int:
    """Where to end a block of text to tokenize: before the last newline that follows a
    non-space character (a pre-token boundary for GPT-2's byte-level BPE: no pre-token
    spans it), else at the last whole UTF-8 character."""
    i = data.rfind(b"\n")
    while i > 0 and data[i - 1] in b" \t\r\n\x0b\x0c":
        i = data.rfind(b"\n", 0, i)
    if i > 0:
        return i
    end = len(data)
    i = end
    while i > 0 and (data[i - 1] & 0xC0) == 0x80:  # continuation bytes: back to the character's start
        i -= 1
    if i == 0 or data[i - 1] < 0xC0:
        return end
    lead = data[i - 1]
    need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return end if end - (i - 1) >= need else i - 1


def tokenize_to_file(src: str | os.PathLike, tokenizer: Tokenizer, out: str | os.PathLike,
                     token_dtype: str | None = None, block_bytes: int = 1 << 22) -> tuple[Path, int]:
    """Tokenize the text file or folder `src` into the token file `out` without holding it in
    memory: text is encoded in blocks of about `block_bytes`, each ended before a newline that
    follows a non-space character (files are joined by a newline, as `load_corpus` joins
    them). With GPT-2's byte-level BPE this gives the ids of tokenizing the whole text at once.
    Returns (out, number of tokens)."""
    src, out = Path(src), Path(out)
    dt = np.dtype(token_dtype or token_dtype_for(tokenizer.vocab).name)
    if dt.name not in ("uint16", "uint32") or tokenizer.vocab > np.iinfo(dt).max + 1:
        raise ValueError(f"a vocabulary of {tokenizer.vocab} ids needs uint16 or uint32 tokens, not {dt.name}")
    if not src.exists():
        raise ValueError(f"data path {src} does not exist: pass a text file or a folder of text files")
    files = [src] if src.is_file() else _files_under(src)
    count = 0

    def emit(f: BinaryIO, piece: bytes) -> None:
        nonlocal count
        ids = tokenizer.encode(piece.decode("utf-8", errors="replace"))
        f.write(np.asarray(ids).astype(dt.newbyteorder("<")).tobytes())
        count += len(ids)

    with atomic_file(out, mode=0o600) as f:
        rest = b""
        for k, path in enumerate(files):
            with open(path, "rb") as fh:
                rest += b"\n" if k else b""
                while block := fh.read(block_bytes):
                    data = rest + block
                    cut = _cut(data)
                    if cut > 0:
                        emit(f, data[:cut])
                    rest = data[cut:]
        if rest:
            emit(f, rest)
    return out, count


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int = 32 << 20,
                tokenizer: Tokenizer | None = None, token_dtype: str | None = None) -> Corpus:
    """The text at `path` (a file, or the text files under a folder in sorted order), or by
    default the standard library's source; at most max_bytes of text are kept, tokenized as
    bytes or by `tokenizer`. A `.bin` file (or any file with `token_dtype`) is a token file
    instead (`load_token_file`), memory-mapped whole."""
    if path is not None and (token_dtype is not None or str(path).endswith(".bin")):
        if tokenizer is not None and not isinstance(tokenizer, ByteTokenizer):
            raise ValueError(f"{path} is a token file, already tokenized: leave the tokenizer out")
        if not Path(path).is_file():
            raise ValueError(f"token file {path} does not exist")
        return load_token_file(path, token_dtype)
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
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return Corpus(np.frombuffer(data, dtype=np.uint8).copy(), name)
    ids = tokenizer.encode(data.decode("utf-8", errors="replace"))
    return Corpus(np.asarray(ids).astype(token_dtype_for(tokenizer.vocab)), f"{name} ({tokenizer.name})")


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
