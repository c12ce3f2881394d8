"""dtfm.train.compress: compressed communication on both axes of training.

Pipeline: blockwise int8/int4 activations and activation gradients, optionally Hadamard-rotated
(`encode_activation` / `decode_activation`). Data-parallel: CocktailSGD-style sparsified,
quantized gradients with error feedback every step, or DiLoCo-style compressed pseudo-gradients
every H steps with a Nesterov outer step (`StageCompression`). Payloads are uint8 tensors whose
sizes follow from the plan and the `CompressionConfig`; decoders raise only `CodecError`.
"""

from typing import TYPE_CHECKING

from dtfm.lazy import lazy_exports

if TYPE_CHECKING:
    from .calibrate import measure_compress_cost, peer_codec_speed
    from .codec import (CodecError, decode_dense, decode_sparse, dense_payload_bytes, encode_dense, encode_sparse,
                        hadamard, sparse_payload_bytes)
    from .config import (AUTO, COMPRESSION_PRESETS, DEFAULT_SLOW_LINK, DP_METHODS, PP_METHODS, CompressionConfig,
                         LinkCodecs, get_compression, parse_compression)
    from .counting import AXES, ByteCounter, CountingComm, axis_of
    from .dp import (STATE_PREFIX, StageCompression, allgather_payloads, delayed_outer_update, outer_step,
                     random_subset, sync_payload_bytes)
    from .pp import activation_payload_bytes, decode_activation, encode_activation

__all__ = [
    "AUTO", "AXES", "COMPRESSION_PRESETS", "DEFAULT_SLOW_LINK", "DP_METHODS", "PP_METHODS", "STATE_PREFIX",
    "ByteCounter", "CodecError", "CompressionConfig", "CountingComm", "LinkCodecs", "StageCompression",
    "activation_payload_bytes", "allgather_payloads", "axis_of", "decode_activation", "decode_dense",
    "decode_sparse", "delayed_outer_update", "dense_payload_bytes", "encode_activation", "encode_dense", "encode_sparse",
    "get_compression", "hadamard", "measure_compress_cost", "outer_step", "parse_compression", "peer_codec_speed",
    "random_subset",
    "sparse_payload_bytes", "sync_payload_bytes",
]

# Imported on first use (PEP 562): the config (and the allocation that carries it) loads no torch.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".calibrate": ("measure_compress_cost", "peer_codec_speed"),
    ".codec": ("CodecError", "decode_dense", "decode_sparse", "dense_payload_bytes", "encode_dense", "encode_sparse",
               "hadamard", "sparse_payload_bytes"),
    ".config": ("AUTO", "COMPRESSION_PRESETS", "DEFAULT_SLOW_LINK", "DP_METHODS", "PP_METHODS", "CompressionConfig",
                "LinkCodecs", "get_compression", "parse_compression"),
    ".counting": ("AXES", "ByteCounter", "CountingComm", "axis_of"),
    ".dp": ("STATE_PREFIX", "StageCompression", "allgather_payloads", "delayed_outer_update", "outer_step",
            "random_subset", "sync_payload_bytes"),
    ".pp": ("activation_payload_bytes", "decode_activation", "encode_activation"),
}
__getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())
