"""What a peer trains from besides its preset: the data set it was started with, tokenized by
a Hugging Face tokenizer where it names one (`load_peer_corpus`), and the Hugging Face
GPT-2-family folders it holds (`dtfm-peer join --model-dir DIR`), by
digest: a run started with `train start --init-from DIR` names its folder by `hf_digest` (its
config.json and weights) and trains the model of that shape under the preset name
`hf_preset(digest)`; every peer of the run must hold a copy of the same folder, found here, and
a peer without it refuses the run (docs/train.md, "Bring your own model").

Weights never travel for a start: each peer reads only its stage's layers from its own copy
(train/hf.py `load_hf_stage`), and the digest binds them, as the data hash binds `--data`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dtfm.train import Corpus, GPTSpec

from dtfm.net import ProtocolError

from .allocation import Allocation
from .coordinator.request import HF_PRESET_PREFIX, hf_preset
from .operator import SignedOp

__all__ = ["HeldModel", "load_held_models", "load_peer_corpus", "model_refusal", "start_model"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldModel:
    """One model folder: where it is, its digest, and the spec a run of it trains (named by
    the preset name of its digest)."""

    path: Path
    digest: str
    spec: GPTSpec


def load_peer_corpus(data_path: str | None, tokenizer_path: str | None) -> Corpus:
    """The data set at `data_path` (`join --data`; None: the standard library's source): text
    tokenized as bytes, or by the tokenizer of the folder at `tokenizer_path` (`--tokenizer`: a
    model folder's tokenizer, or tokenizer files alone), or a token file as it is. Blocking;
    ValueError (TokenizerError, HFError) names what is wrong."""
    from dtfm.train import load_corpus, load_tokenizer, model_tokenizer  # (torch: only for training)
    if tokenizer_path is None:
        return load_corpus(data_path)
    folder = Path(tokenizer_path)
    tokenizer = model_tokenizer(folder) if (folder / "config.json").is_file() else load_tokenizer(folder)
    return load_corpus(data_path, tokenizer=tokenizer)


def load_held_models(paths: Sequence[str]) -> dict[str, HeldModel]:
    """The folders at `paths` by preset name (`hf_preset(digest)`): each folder's weights are
    hashed whole (blocking: call it in a thread). A folder that is no GPT-2-family model dtfm
    computes is left out with an error in the log (runs of presets go on; a run naming it is
    refused with the folders this peer holds)."""
    out: dict[str, HeldModel] = {}
    if not paths:
        return out
    from dtfm.train import HFError, hf_digest, load_hf_spec  # (torch: only where a folder is named)

    for p in paths:
        path = Path(p)
        try:
            spec = load_hf_spec(path)
            digest = hf_digest(path)
        except HFError as e:
            logger.error("model folder %s is left out: %s", path, e)
            continue
        name = hf_preset(digest)
        out[name] = HeldModel(path, digest, dataclasses.replace(spec, name=name))
        logger.info("model folder %s: %s, sha256 %s", path, name, digest[:12])
    return out


def model_refusal(preset: str, digest: str | None, name: str, held: Mapping[str, HeldModel]) -> str | None:
    """Why this peer cannot train the model folder of `digest` (called `name`), or None."""
    if digest is None:
        return None
    mine = held.get(preset)
    if mine is None or mine.digest != digest:
        have = ", ".join(f"{m.path} ({m.digest[:12]})" for m in held.values()) or "none"
        return (f"the run starts from model folder {name[:100]!r} (sha256 {digest[:12]}), which this peer does not "
                f"hold (its folders: {have[:300]}): copy the folder here and start the daemon with "
                f"`--model-dir DIR`")
    return None


def start_model(alloc: Allocation, held: Mapping[str, HeldModel]) -> HeldModel | None:
    """The folder a fresh stage of `alloc` is built from: None for a preset's fresh weights; for
    a run started from a model folder, this peer's copy of it, by the whole digest the
    operator's start names (the epoch machine checked that start). ValueError says why not."""
    if not alloc.preset.startswith(HF_PRESET_PREFIX):
        return None
    try:
        req = SignedOp.decode(alloc.operator_start).open().request()
    except (ProtocolError, ValueError) as e:
        raise ValueError(f"the run's operator start is unreadable: {e}") from None
    refusal = model_refusal(alloc.preset, req.init_from, req.init_name, held)
    if refusal is not None:
        raise ValueError(refusal)
    if req.init_from is None:
        raise ValueError(f"model {alloc.preset!r} is not a built-in preset and the operator's start names no folder")
    return held[alloc.preset]
