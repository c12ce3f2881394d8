"""Hugging Face GPT-2 folders: export a dtfm model as one, and start a run from one.

dtfm's GPT is GPT-2-shaped: learned token and position embeddings, pre-norm blocks (LayerNorm,
causal self-attention scaled by 1/sqrt(head width), LayerNorm, GELU MLP), a final LayerNorm
and a head, tied to the token embedding or not. The mapping onto `GPT2LMHeadModel` is:

| dtfm name                      | Hugging Face name                          | layout |
| ------------------------------ | ------------------------------------------ | ------ |
| `wte.weight` (V, C)            | `transformer.wte.weight`                   | same |
| `wpe.weight` (T, C)            | `transformer.wpe.weight`                   | same |
| `h.i.ln_1` / `ln_2` / `ln_f`   | `transformer.h.i.ln_1` ... `transformer.ln_f` | same |
| `h.i.attn.c_attn.weight` (3C, C) | `transformer.h.i.attn.c_attn.weight` (C, 3C) | transposed: `nn.Linear` (out, in) vs `Conv1D` (in, out) |
| `h.i.attn.c_proj`, `h.i.mlp.c_fc`, `h.i.mlp.c_proj` | the same names under `transformer.` | transposed |
| `lm_head.weight` (V, C)        | `lm_head.weight` (absent when tied)        | same |

GPT-2 always has biases; a dtfm model without them (`bias=False`) exports zeros, and a folder
whose config.json records the dtfm spec it came from gets that spec back when its biases are
still all zero. dtfm's "gelu" is PyTorch's exact GELU, Hugging Face's `"gelu"`; its "gelu_tanh"
is the tanh form OpenAI's checkpoints use (`"gelu_new"`, computed by `"gelu_pytorch_tanh"` with
the same kernel dtfm calls, which is what an export writes). LayerNorm epsilon is 1e-5 in both.

Weights are read only from safetensors files (one `model.safetensors` or shards listed in
`model.safetensors.index.json`), never from pickled `pytorch_model.bin` files. `load_hf_stage`
reads only the tensors of one stage, so each peer of a swarm loads only its layers; `hf_digest`
is the sha256 the coordinator hands out so that every peer checks it starts from the same folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dtfm.files import fsync_dir

from .compress import CompressionConfig, StageCompression
from .spec import GPTSpec, TrainConfig
from .tokenizer import TOKENIZER_FILES, ByteTokenizer, Tokenizer, load_tokenizer, write_byte_tokenizer
from .worker import StageState

__all__ = [
    "HF_ACTIVATIONS",
    "HFError",
    "export_checkpoint_dir",
    "export_hf",
    "hf_digest",
    "hf_stage_state",
    "load_hf",
    "load_hf_spec",
    "load_hf_stage",
    "model_tokenizer",
    "spec_to_hf_config",
    "stage_param_names",
]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
LN_EPS = 1e-5  # torch's nn.LayerNorm default, which dtfm's model uses; GPT-2's too

# Hugging Face's names of the GELU forms, onto dtfm's. gelu_fast is the same tanh formula
# written differently (equal within float rounding).
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
# What an export writes for each dtfm activation: the Hugging Face name computing it with the
# same torch kernel.
_EXPORT_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BLOCK_TENSORS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                  "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                  "mlp.c_proj.weight", "mlp.c_proj.bias")
_HASH_CHUNK = 1 << 20


class HFError(ValueError):
    """A folder is not a GPT-2-family model dtfm can load, or an export cannot be written."""


# ---- names ---------------------------------------------------------------------------------------


def stage_param_names(spec: GPTSpec, layer_range: tuple[int, int]) -> list[str]:
    """The dtfm parameter names of the stage holding blocks [start, end): what `GPTStage`
    registers, in its order, without building it."""
    start, end = layer_range
    if not 0 <= start < end <= spec.n_layer:
        raise ValueError(f"layer range {layer_range} is not inside [0, {spec.n_layer})")
    names = ["wte.weight", "wpe.weight"] if start == 0 else []
    for i in range(start, end):
        names += [f"h.{i}.{t}" for t in _BLOCK_TENSORS if spec.bias or not t.endswith(".bias")]
    if end == spec.n_layer:
        names += ["ln_f.weight"] + (["ln_f.bias"] if spec.bias else [])
        if not spec.tied_head:
            names.append("lm_head.weight")
        elif start != 0:
            names.append("wte.weight")  # the last stage's copy of the tied embedding
    return names


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else f"transformer.{name}"


def _is_transposed(name: str) -> bool:
    return name.startswith("h.") and name.endswith(_TRANSPOSED)


def _hf_bias_names(spec: GPTSpec) -> list[str]:
    """dtfm names of the biases a GPT-2 folder has and a bias-free dtfm model does not."""
    out = [f"h.{i}.{t}" for i in range(spec.n_layer) for t in _BLOCK_TENSORS if t.endswith(".bias")]
    return out + ["ln_f.bias"]


# ---- config --------------------------------------------------------------------------------------


def spec_to_hf_config(spec: GPTSpec, extra: Mapping | None = None) -> dict:
    """config.json of a `GPT2LMHeadModel` computing what `spec`'s model computes.

    `extra` adds keys (token ids, say) that do not change the computation. The dtfm spec is
    kept under "dtfm" so that loading the folder gives the same spec back."""
    n_inner = spec.mlp_ratio * spec.n_embd
    cfg = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": spec.vocab,
        "n_positions": spec.seq_len,
        "n_ctx": spec.seq_len,
        "n_embd": spec.n_embd,
        "n_layer": spec.n_layer,
        "n_head": spec.n_head,
        "n_inner": n_inner,
        "activation_function": _EXPORT_ACTIVATION[spec.activation],
        "layer_norm_epsilon": LN_EPS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": spec.tied_head,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }
    for k, v in (extra or {}).items():
        if k in cfg and k not in ("bos_token_id", "eos_token_id", "pad_token_id"):
            raise HFError(f"config key {k!r} is set by the model's shape and cannot be overridden")
        cfg[k] = v
    cfg["dtfm"] = {"spec": spec.to_dict()}
    return cfg


def _get(cfg: dict, key: str, kind: type, default: object = None) -> object:
    v = cfg.get(key, default)
    if kind is int and (type(v) is not int or v < 1):
        raise HFError(f"config.json: {key} must be a positive integer, got {v!r}")
    if kind is bool and type(v) is not bool:
        raise HFError(f"config.json: {key} must be true or false, got {v!r}")
    return v


def _spec_from_config(cfg: dict) -> GPTSpec:
    """The dtfm spec of a GPT-2 config (biases on); HFError for anything dtfm does not compute."""
    model_type = cfg.get("model_type")
    if model_type != "gpt2":
        raise HFError(f"config.json describes a {model_type!r} model; dtfm loads only the GPT-2 family "
                      "(model_type \"gpt2\": learned positions, LayerNorm, GELU MLP)")
    archs = cfg.get("architectures") or ["GPT2LMHeadModel"]
    if not isinstance(archs, list) or not set(archs) <= {"GPT2LMHeadModel", "GPT2Model", "GPT2DoubleHeadsModel"}:
        raise HFError(f"config.json names architectures {archs!r}; dtfm loads GPT2LMHeadModel weights")
    act = cfg.get("activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        raise HFError(f"activation_function {act!r} is not one dtfm computes; it knows {sorted(HF_ACTIVATIONS)}")
    eps = cfg.get("layer_norm_epsilon", LN_EPS)
    if not isinstance(eps, (int, float)) or not math.isclose(eps, LN_EPS, rel_tol=1e-9):
        raise HFError(f"layer_norm_epsilon {eps!r} differs from dtfm's {LN_EPS}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if cfg.get(key, want) != want:
            raise HFError(f"config.json sets {key} = {cfg.get(key)!r}; dtfm's attention needs {want}")
    n_embd = _get(cfg, "n_embd", int)
    n_inner = cfg.get("n_inner")
    n_inner = 4 * n_embd if n_inner is None else _get(cfg, "n_inner", int)  # type: ignore[operator]
    if n_inner % n_embd:  # type: ignore[operator]
        raise HFError(f"n_inner {n_inner} is not a multiple of n_embd {n_embd}")
    n_layer, n_head = _get(cfg, "n_layer", int), _get(cfg, "n_head", int)
    seq_len, vocab = _get(cfg, "n_positions", int), _get(cfg, "vocab_size", int)
    tied = _get(cfg, "tie_word_embeddings", bool, True)
    try:
        return GPTSpec(f"gpt2-hf-{n_layer}x{n_embd}", n_layer=n_layer, n_embd=n_embd, n_head=n_head,  # type: ignore[arg-type]
                       seq_len=seq_len, vocab=vocab, tied_head=tied, mlp_ratio=n_inner // n_embd,  # type: ignore[arg-type,operator]
                       bias=True, activation=HF_ACTIVATIONS[act])
    except ValueError as e:
        raise HFError(f"config.json: {e}") from None


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    if not folder.is_dir():
        raise HFError(f"{folder} is not a folder: pass a Hugging Face model folder (config.json, model.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{folder} has no config.json: is it a Hugging Face model folder?") from None
    except (OSError, ValueError) as e:
        raise HFError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{path} is not a JSON object")
    return cfg


# ---- weights on disk ------------------------------------------------------------------------------


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the folder, in the order the index lists them."""
    index = folder / WEIGHTS_INDEX
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFError(f"cannot read {index}: {e}") from None
        files = []
        for n in names:
            if not isinstance(n, str) or Path(n).name != n:
                raise HFError(f"{index} names a weight file outside the folder: {n!r}")
            files.append(folder / n)
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise HFError(f"{folder} holds only pickled weights (pytorch_model.bin), which dtfm never loads: "
                      "save the model with safe_serialization=True (model.safetensors)")
    raise HFError(f"{folder} has no model.safetensors")


class _Weights:
    """Lazy access to a folder's tensors by dtfm name (either key style: `transformer.h.0...`
    as GPT2LMHeadModel saves, or `h.0...` as GPT2Model and OpenAI's converted files do)."""

    def __init__(self, folder: Path):
        self.where: dict[str, tuple[Path, str]] = {}
        self.files = _weight_files(folder)
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    keys = list(st.keys())
            except FileNotFoundError:
                raise HFError(f"weight file {f} is missing") from None
            except Exception as e:  # safetensors raises its own types for a damaged header
                raise HFError(f"cannot read {f}: {e}") from None
            for k in keys:
                name = k.removeprefix("transformer.")
                if name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue  # causal-mask buffers of older GPT-2 files, not parameters
                self.where.setdefault(name, (f, k))

    def has(self, name: str) -> bool:
        return name in self.where

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for n in names:
            if n not in self.where:
                raise HFError(f"the weights have no tensor {_hf_name(n)!r}")
            f, k = self.where[n]
            by_file.setdefault(f, []).append((n, k))
        out = {}
        for f, pairs in by_file.items():
            try:
                with safe_open(str(f), framework="pt") as st:
                    for n, k in pairs:
                        out[n] = st.get_tensor(k)
            except Exception as e:
                raise HFError(f"cannot read {f}: {e}") from None
        return out


def _resolve_spec(folder: Path, cfg: dict, weights: _Weights) -> GPTSpec:
    """The config's spec, or the dtfm spec recorded at export when it still describes the weights."""
    spec = _spec_from_config(cfg)
    recorded = cfg.get("dtfm", {}).get("spec") if isinstance(cfg.get("dtfm"), dict) else None
    if not isinstance(recorded, dict):
        return spec
    try:
        mine = GPTSpec.from_dict(recorded)
    except (ValueError, TypeError):
        return spec
    same_shape = all(getattr(mine, f) == getattr(spec, f) for f in (
        "n_layer", "n_embd", "n_head", "seq_len", "vocab", "tied_head", "mlp_ratio", "activation"))
    if not same_shape:
        return spec
    if not mine.bias:
        biases = weights.read(_hf_bias_names(spec))
        if any(bool(b.count_nonzero()) for b in biases.values()):
            return GPTSpec(**{**mine.to_dict(), "bias": True, "name": spec.name})
    return mine


def load_hf_spec(folder: str | os.PathLike) -> GPTSpec:
    """The dtfm model spec of a GPT-2-family folder; HFError if dtfm cannot compute that model."""
    folder = Path(folder)
    cfg = _read_config(folder)
    spec = _spec_from_config(cfg)  # refuse a foreign model before touching its weights
    return _resolve_spec(folder, cfg, _Weights(folder)) if "dtfm" in cfg else spec


def _to_dtfm(spec: GPTSpec, raw: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors read by dtfm name, in the folder's layout, to dtfm's layout in float32."""
    out = {}
    for n, t in raw.items():
        t = t.to(torch.float32)
        out[n] = t.t().contiguous() if _is_transposed(n) else t
    return out


def _check_shapes(spec: GPTSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    c, v, ff = spec.n_embd, spec.vocab, spec.mlp_ratio * spec.n_embd
    for n, t in tensors.items():
        if n == "wte.weight" or n == "lm_head.weight":
            want: tuple[int, ...] = (v, c)
        elif n == "wpe.weight":
            want = (spec.seq_len, c)
        elif n.endswith("c_attn.weight"):
            want = (3 * c, c)
        elif n.endswith("c_attn.bias"):
            want = (3 * c,)
        elif n.endswith("mlp.c_fc.weight"):
            want = (ff, c)
        elif n.endswith("mlp.c_fc.bias"):
            want = (ff,)
        elif n.endswith("mlp.c_proj.weight"):
            want = (c, ff)
        elif n.endswith("attn.c_proj.weight"):
            want = (c, c)
        else:  # norms and the remaining biases
            want = (c,)
        if tuple(t.shape) != want:
            raise HFError(f"tensor {_hf_name(n)!r} has shape {tuple(t.shape)} in dtfm's layout, the config "
                          f"implies {want}")


def _stage_tensors(spec: GPTSpec, weights: _Weights, layer_range: tuple[int, int]) -> dict[str, torch.Tensor]:
    names = stage_param_names(spec, layer_range)
    want = [n for n in names if not (n == "lm_head.weight" and spec.tied_head)]
    tensors = _to_dtfm(spec, weights.read(want))  # a bias-free model leaves the folder's zero biases
    _check_shapes(spec, tensors)
    return tensors


def load_hf(folder: str | os.PathLike) -> tuple[GPTSpec, dict[str, torch.Tensor]]:
    """The whole model of a GPT-2-family folder: its dtfm spec and its parameters by dtfm name
    (float32, dtfm's layout), ready for `GPTStage(spec, (0, spec.n_layer), seed).load_state_dict`."""
    folder = Path(folder)
    cfg = _read_config(folder)
    _spec_from_config(cfg)
    weights = _Weights(folder)
    spec = _resolve_spec(folder, cfg, weights)
    return spec, _stage_tensors(spec, weights, (0, spec.n_layer))


def load_hf_stage(folder: str | os.PathLike, layer_range: tuple[int, int],
                  spec: GPTSpec | None = None) -> tuple[GPTSpec, dict[str, torch.Tensor]]:
    """Only the parameters of the stage holding blocks [start, end) (with the embeddings on the
    first stage, the norm and head, or the tied embedding's copy, on the last), read lazily
    from the safetensors files. `spec`, when given, must be the folder's (a run's model)."""
    folder = Path(folder)
    cfg = _read_config(folder)
    _spec_from_config(cfg)
    weights = _Weights(folder)
    mine = _resolve_spec(folder, cfg, weights)
    if spec is not None and dataclasses.replace(mine, name=spec.name) != spec:
        raise HFError(f"{folder} holds model {mine}, the run trains {spec}")
    try:
        return mine, _stage_tensors(mine, weights, layer_range)
    except ValueError as e:
        if isinstance(e, HFError):
            raise
        raise HFError(str(e)) from None


def hf_stage_state(folder: str | os.PathLike, cfg: TrainConfig, layer_range: tuple[int, int],
                   spec: GPTSpec | None = None, digest: str | None = None, device: str = "cpu",
                   compression: CompressionConfig | None = None) -> StageState:
    """A fresh stage (step 0, zero optimizer moments) whose weights are the folder's.

    `digest`, when given, must equal `hf_digest(folder)`: the peers of a run check that they
    start from the same files before any of them trains. `spec`, when given, must be the
    folder's model but for its name (a swarm run names it by the folder's digest), and the
    stage carries it. The compression state starts from the folder's weights."""
    if digest is not None:
        mine = hf_digest(folder)
        if mine != digest:
            raise HFError(f"{folder} has digest {mine[:12]}, the run starts from {digest[:12]}: "
                          "copy the same model folder to every peer")
    found, tensors = load_hf_stage(folder, layer_range, spec)
    state = StageState(spec or found, cfg, layer_range, device)
    with torch.no_grad():
        for n, p in state.params.items():
            p.copy_(tensors[n])
    if compression is not None and not compression.exact:
        state.compress = StageCompression(compression, state.params, layer_range[0])
    return state


def hf_digest(folder: str | os.PathLike) -> str:
    """sha256 of what decides the model: config.json and the weight files (names, sizes, bytes)."""
    folder = Path(folder)
    files = [folder / CONFIG] + _weight_files(folder)
    h = hashlib.sha256(b"dtfm-hf/1\n")
    for f in files:
        try:
            size = f.stat().st_size
            h.update(f"{f.name}\n{size}\n".encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    h.update(chunk)
        except OSError as e:
            raise HFError(f"cannot read {f}: {e}") from None
    return h.hexdigest()


# ---- export --------------------------------------------------------------------------------------


def _merge(spec: GPTSpec, stages: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]
           ) -> dict[str, torch.Tensor]:
    """One dtfm state dict from a whole model's or from stages' tensors (`name` or `param/name`
    keys; optimizer moments and other keys ignored); every parameter must be present once, a
    tied copy must equal the embedding."""
    parts = [stages] if isinstance(stages, Mapping) else list(stages)
    need = set(stage_param_names(spec, (0, spec.n_layer)))
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, t in part.items():
            name = key.removeprefix("param/")
            if "/" in name or name not in need:
                continue
            if name in out:
                if not torch.equal(out[name].cpu(), t.detach().cpu()):
                    raise HFError(f"two stages hold different values of {name!r}")
                continue
            out[name] = t.detach().to("cpu", torch.float32)
    missing = sorted(need - set(out))
    if missing:
        raise HFError(f"the stages do not cover the model: missing {missing[:3]}")
    _check_shapes(spec, out)
    return out


def _hf_tensors(spec: GPTSpec, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name in stage_param_names(spec, (0, spec.n_layer)):
        t = params[name]
        out[_hf_name(name)] = (t.t() if _is_transposed(name) else t).contiguous().clone()
    if not spec.bias:
        for name in _hf_bias_names(spec):
            size = 3 * spec.n_embd if name.endswith("c_attn.bias") else (
                spec.mlp_ratio * spec.n_embd if name.endswith("c_fc.bias") else spec.n_embd)
            out[_hf_name(name)] = torch.zeros(size)
    return out


def export_hf(spec: GPTSpec, stages: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
              out_dir: str | os.PathLike, *, tokenizer_from: str | os.PathLike | None = None,
              config_extra: Mapping | None = None, overwrite: bool = False) -> Path:
    """Write `out_dir` as a Hugging Face GPT-2 folder: model.safetensors, config.json, and a
    tokenizer (the files of `tokenizer_from`, a Hugging Face folder, else the byte tokenizer
    as tokenizer.json: dtfm's default data is bytes, whatever the vocabulary size). `stages` is a whole state dict or one per stage (`stage_tensors` /
    transfer keys `param/<name>` also work).

    The folder is written under a temporary name beside `out_dir`, fsynced, then renamed, so
    `out_dir` either does not exist or is complete. An existing `out_dir` is refused unless
    `overwrite`. Returns the folder's path."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise HFError(f"{out} exists: choose another folder or pass overwrite")
    params = _merge(spec, stages)
    tensors = _hf_tensors(spec, params)
    extra = dict(config_extra or {})
    tok_files: list[Path] = []
    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        tok_files = [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
        if not tok_files:
            raise HFError(f"{src} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        src_cfg = _read_config(src) if (src / CONFIG).is_file() else {}
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in src_cfg and k not in extra:
                extra[k] = src_cfg[k]
    cfg = spec_to_hf_config(spec, extra)
    cfg["dtfm"]["tokenizer"] = "hf" if tok_files else "bytes"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if tok_files:
            for f in tok_files:
                shutil.copyfile(f, tmp / f.name)
        else:
            write_byte_tokenizer(tmp, spec.seq_len)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # weights are not secret; safetensors creates its file 0600
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        fsync_dir(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_checkpoint_dir(root: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None,
                          **kw: Any) -> Path:
    """Export the stage checkpoints under `root` (train/checkpoint.py's layout) of `step`, by
    default the newest step every stage has, as a Hugging Face folder (see `export_hf`)."""
    from .checkpoint import decode_tensors, saved_checkpoints

    saved = saved_checkpoints(root)
    if not saved:
        raise HFError(f"no checkpoints under {root}")

    def covering(k: int) -> list[tuple[int, int]] | None:
        """The stage ranges with a checkpoint of step k, if they split the layers from 0."""
        ranges = sorted({(a, b) for a, b, s in saved if s == k})
        chain, end = [], 0
        for a, b in ranges:
            if a == end:
                chain.append((a, b))
                end = b
        return chain if chain and ranges and chain[-1][1] == _n_layer(root, ranges[0], k) else None

    steps = sorted({s for _, _, s in saved}, reverse=True)
    if step is None:
        step = next((k for k in steps if covering(k)), None)
        if step is None:
            raise HFError(f"no step under {root} has a checkpoint of every stage")
    ranges = covering(step)
    if ranges is None:
        raise HFError(f"the checkpoints of step {step} under {root} do not cover every layer")
    stages, spec = [], None
    for a, b in ranges:
        base = Path(root) / f"stage-{a:03d}-{b:03d}" / f"step-{step:08d}"
        try:
            meta = json.loads(base.with_suffix(".json").read_text())
            blob = base.with_suffix(".safetensors").read_bytes()
            this = GPTSpec.from_dict(meta["spec"])
            stages.append(decode_tensors(blob, meta))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFError(f"cannot read checkpoint {base}: {e}") from None
        if spec is not None and this != spec:
            raise HFError(f"the checkpoints under {root} are of different models")
        spec = this
    assert spec is not None
    return export_hf(spec, stages, out_dir, **kw)


def _n_layer(root: str | os.PathLike, layer_range: tuple[int, int], step: int) -> int:
    """The model's layer count, from one checkpoint's description."""
    a, b = layer_range
    path = Path(root) / f"stage-{a:03d}-{b:03d}" / f"step-{step:08d}.json"
    try:
        return int(json.loads(path.read_text())["spec"]["n_layer"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HFError(f"cannot read checkpoint {path}: {e}") from None


def model_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The tokenizer that goes with a model folder: the byte tokenizer for a folder dtfm
    exported from a model trained on bytes (no optional package needed), else the folder's
    Hugging Face tokenizer files, else the byte tokenizer for a 256-id vocabulary."""
    folder = Path(folder)
    cfg = _read_config(folder)
    spec = _spec_from_config(cfg)
    marker = cfg.get("dtfm", {}).get("tokenizer") if isinstance(cfg.get("dtfm"), dict) else None
    if marker == "bytes" and spec.vocab >= ByteTokenizer.vocab:
        return ByteTokenizer()
    if any((folder / n).is_file() for n in ("tokenizer.json", "vocab.json")):
        tok = load_tokenizer(folder)
        if tok.vocab > spec.vocab:
            raise HFError(f"the tokenizer in {folder} has {tok.vocab} ids, the model only {spec.vocab}")
        return tok
    if spec.vocab == ByteTokenizer.vocab:
        return ByteTokenizer()
    raise HFError(f"{folder} has no tokenizer files (tokenizer.json, or vocab.json and merges.txt) and its "
                  f"vocabulary of {spec.vocab} ids is not the byte tokenizer's")
