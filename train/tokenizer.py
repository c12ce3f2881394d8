"""Tokenizers: UTF-8 bytes (the default, no dependency) or a Hugging Face folder's tokenizer.

A Hugging Face tokenizer is read with the `tokenizers` library (an optional dependency:
`pip install 'dtfm[hf]'`), from the folder's tokenizer.json, or from vocab.json + merges.txt
(GPT-2's byte-level BPE). `write_byte_tokenizer` writes the byte tokenizer as a tokenizer.json
(a byte-level BPE with the 256 byte symbols as its vocabulary, id = byte value, and no merges),
so a folder exported from a byte-level dtfm model works with `tokenizers` and transformers'
`AutoTokenizer` as well as with `python -m dtfm.train sample`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

__all__ = [
    "TOKENIZER_FILES",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "token_dtype_for",
    "write_byte_tokenizer",
]

# Files that make up a Hugging Face tokenizer (copied along on export).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json")


class TokenizerError(ValueError):
    """No usable tokenizer: missing files, a missing optional package, an unreadable file."""


class Tokenizer(Protocol):
    vocab: int  # ids are in [0, vocab)
    name: str

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, tokens: Iterable[int]) -> str: ...


def token_dtype_for(vocab: int) -> np.dtype:
    """The smallest unsigned dtype holding ids below `vocab`: uint8, uint16 or uint32."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocabulary of {vocab} ids does not fit in uint32")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless for any text."""

    vocab = 256
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, tokens: Iterable[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _tokenizers_module() -> ModuleType:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("reading a Hugging Face tokenizer needs the `tokenizers` package: "
                             "pip install 'dtfm[hf]' (or pip install tokenizers)") from None
    return tokenizers


class HFTokenizer:
    """A `tokenizers.Tokenizer`; encodes without adding special tokens."""

    def __init__(self, tok: Any, name: str):
        self.tok, self.name = tok, name
        self.vocab = int(tok.get_vocab_size(with_added_tokens=True))
        self.dtype = token_dtype_for(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def decode(self, tokens: Iterable[int]) -> str:
        return self.tok.decode([int(t) for t in tokens], skip_special_tokens=False)


def load_tokenizer(folder: str | os.PathLike) -> HFTokenizer:
    """The tokenizer of a Hugging Face folder: tokenizer.json, else vocab.json + merges.txt."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"{folder} is not a folder: pass a Hugging Face model or tokenizer folder")
    tj, vocab, merges = folder / "tokenizer.json", folder / "vocab.json", folder / "merges.txt"
    if not (tj.is_file() or (vocab.is_file() and merges.is_file())):
        raise TokenizerError(f"{folder} has no tokenizer files (tokenizer.json, or vocab.json and merges.txt)")
    tk = _tokenizers_module()
    try:
        if tj.is_file():
            tok = tk.Tokenizer.from_file(str(tj))
        else:
            tok = tk.ByteLevelBPETokenizer.from_file(str(vocab), str(merges))
    except Exception as e:  # tokenizers raises its own exception types for unreadable files
        raise TokenizerError(f"cannot read the tokenizer in {folder}: {e}") from None
    return HFTokenizer(tok, f"hf:{folder.name}")


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_byte_tokenizer(folder: str | os.PathLike, model_max_length: int | None = None) -> None:
    """Write the byte tokenizer as tokenizer.json and tokenizer_config.json into `folder`."""
    folder = Path(folder)
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": level,
        "post_processor": None,
        "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {s: i for i, s in enumerate(_byte_symbols())}, "merges": []},
    }
    (folder / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False) + "\n", encoding="utf-8")
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if model_max_length is not None:
        cfg["model_max_length"] = model_max_length
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
