"""The pipeline axis: an activation or activation gradient as a compressed payload, sized by
the plan (the receiver knows the shape: micro-batch, sequence length, width)."""

from __future__ import annotations

import math

import torch

from .codec import decode_dense, dense_payload_bytes, encode_dense
from .config import CompressionConfig

__all__ = ["activation_payload_bytes", "decode_activation", "encode_activation"]


def encode_activation(t: torch.Tensor, config: CompressionConfig) -> torch.Tensor:
    """`t` as the run's pipeline payload (a 1-D uint8 tensor); config.pp_method must not be exact."""
    return encode_dense(t, config.pp_method, config.pp_block_elems, config.pp_hadamard)


def decode_activation(payload: object, shape: tuple[int, ...], config: CompressionConfig) -> torch.Tensor:
    """The float32 tensor of `shape` in a pipeline payload; raises CodecError for a bad one."""
    return decode_dense(payload, shape, config.pp_method, config.pp_block_elems, config.pp_hadamard)


def activation_payload_bytes(shape: tuple[int, ...], config: CompressionConfig) -> int:
    return dense_payload_bytes(math.prod(shape), config.pp_method, config.pp_block_elems)
