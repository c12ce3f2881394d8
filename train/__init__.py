"""dtfm.train: GPT stages, GPipe pipeline, data-parallel all-reduce, optimizer, data,
checkpoints and stage transfer; talks to other peers only through `Comm`."""

from dtfm.lazy import lazy_exports
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .checkpoint import (
        CheckpointError,
        checkpoint_at,
        checkpoint_notes,
        compression_of,
        encode_stage,
        list_checkpoints,
        load_checkpoint,
        save_checkpoint,
        saved_checkpoints,
        stage_from_tensors,
        stage_tensors,
        weight_tensors,
    )
    from .codec import (
        MAX_TENSOR_DIMS,
        TENSOR_ITEMSIZE,
        TORCH_DTYPES,
        CodecError,
        check_tensor,
        tensor_from_wire,
        tensor_header,
        tensor_to_wire,
    )
    from .collective import all_reduce_small, ring_all_reduce
    from .memory import StageMemory, limit_heap_caching, release_heap, stage_memory
    from .comm import (
        Comm,
        EventHandle,
        InMemoryComm,
        InMemoryHub,
        Link,
        PendingSends,
        SendHandle,
    )
    from .compress import (
        COMPRESSION_PRESETS,
        ByteCounter,
        CompressionConfig,
        CountingComm,
        LinkCodecs,
        StageCompression,
        activation_payload_bytes,
        decode_activation,
        encode_activation,
        get_compression,
        parse_compression,
        peer_codec_speed,
    )
    from .errors import CommClosed, CommError, CommTimeout
    from .data import (
        TOKEN_DTYPES,
        Corpus,
        load_corpus,
        load_token_file,
        split_batch,
        tokenize_to_file,
        write_token_file,
    )
    from .hf import (
        HFError,
        export_checkpoint_dir,
        export_hf,
        hf_digest,
        hf_stage_state,
        load_hf,
        load_hf_spec,
        load_hf_stage,
        model_tokenizer,
        spec_to_hf_config,
        stage_param_names,
    )
    from .local import LocalCluster
    from .messages import MessageRules, describe_tag
    from .model import Block, GPTStage, assemble, generate
    from .native import load_torch_libraries
    from .optim import AdamW
    from .plan import Plan, check_compression
    from .reference import reference_state, reference_step
    from .sample import sample_text
    from .precision import autocast
    from .spec import ACTIVATIONS, PRECISIONS, PRESETS, TEST_CONFIG, WIRE_DTYPES, GPTSpec, TrainConfig, get_preset
    from .staging import HostStaging
    from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError, load_tokenizer, write_byte_tokenizer
    from .transfer import DEFAULT_CHUNK_BYTES, TransferError, TransferManifest, TransferReceiver, encode_transfer
    from .worker import StageState, StepResult, run_step

__all__ = [
    "ACTIVATIONS",
    "COMPRESSION_PRESETS",
    "DEFAULT_CHUNK_BYTES",
    "MAX_TENSOR_DIMS",
    "PRECISIONS",
    "PRESETS",
    "TEST_CONFIG",
    "Tokenizer",
    "TokenizerError",
    "TENSOR_ITEMSIZE",
    "TOKEN_DTYPES",
    "TORCH_DTYPES",
    "AdamW",
    "ByteCounter",
    "ByteTokenizer",
    "CheckpointError",
    "CodecError",
    "Comm",
    "CommClosed",
    "CommError",
    "CommTimeout",
    "CompressionConfig",
    "Corpus",
    "CountingComm",
    "EventHandle",
    "LinkCodecs",
    "Block",
    "GPTSpec",
    "GPTStage",
    "HostStaging",
    "HFError",
    "HFTokenizer",
    "InMemoryComm",
    "InMemoryHub",
    "Link",
    "LocalCluster",
    "MessageRules",
    "describe_tag",
    "PendingSends",
    "Plan",
    "SendHandle",
    "StageCompression",
    "StageMemory",
    "StageState",
    "StepResult",
    "TrainConfig",
    "WIRE_DTYPES",
    "TransferError",
    "TransferManifest",
    "TransferReceiver",
    "all_reduce_small",
    "activation_payload_bytes",
    "assemble",
    "autocast",
    "check_compression",
    "check_tensor",
    "checkpoint_at",
    "checkpoint_notes",
    "compression_of",
    "decode_activation",
    "encode_activation",
    "encode_stage",
    "encode_transfer",
    "export_checkpoint_dir",
    "export_hf",
    "generate",
    "get_compression",
    "get_preset",
    "parse_compression",
    "peer_codec_speed",
    "hf_digest",
    "hf_stage_state",
    "list_checkpoints",
    "load_checkpoint",
    "load_corpus",
    "load_hf",
    "load_hf_spec",
    "load_hf_stage",
    "load_token_file",
    "load_torch_libraries",
    "load_tokenizer",
    "model_tokenizer",
    "reference_state",
    "limit_heap_caching",
    "reference_step",
    "release_heap",
    "ring_all_reduce",
    "run_step",
    "sample_text",
    "save_checkpoint",
    "saved_checkpoints",
    "spec_to_hf_config",
    "split_batch",
    "stage_memory",
    "stage_from_tensors",
    "stage_param_names",
    "stage_tensors",
    "tensor_from_wire",
    "tensor_header",
    "tensor_to_wire",
    "tokenize_to_file",
    "write_byte_tokenizer",
    "weight_tensors",
    "write_token_file",
]

# Where each name above is defined. A name is imported from its module on first use (PEP 562):
# a command that needs only light parts of the package (`dtfm-peer status` reads the daemon's
# config classes) does not load torch, scipy or the rest. tests/test_layers.py checks that this
# table, the imports above and __all__ name the same things.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".checkpoint": (
        "CheckpointError", "checkpoint_at", "checkpoint_notes", "compression_of", "encode_stage", "list_checkpoints", "load_checkpoint",
        "save_checkpoint", "saved_checkpoints", "stage_from_tensors", "stage_tensors", "weight_tensors",
    ),
    ".codec": (
        "MAX_TENSOR_DIMS", "TENSOR_ITEMSIZE", "TORCH_DTYPES", "CodecError", "check_tensor",
        "tensor_from_wire", "tensor_header", "tensor_to_wire",
    ),
    ".collective": ("all_reduce_small", "ring_all_reduce"),
    ".compress": (
        "COMPRESSION_PRESETS", "ByteCounter", "CompressionConfig", "CountingComm", "LinkCodecs", "StageCompression",
        "activation_payload_bytes", "decode_activation", "encode_activation", "get_compression",
        "parse_compression", "peer_codec_speed",
    ),
    ".comm": (
        "Comm", "EventHandle", "InMemoryComm", "InMemoryHub",
        "Link", "PendingSends", "SendHandle",
    ),
    ".data": (
        "TOKEN_DTYPES", "Corpus", "load_corpus", "load_token_file", "split_batch", "tokenize_to_file",
        "write_token_file",
    ),
    ".hf": (
        "HFError", "export_checkpoint_dir", "export_hf", "hf_digest", "hf_stage_state", "load_hf",
        "load_hf_spec", "load_hf_stage", "model_tokenizer", "spec_to_hf_config", "stage_param_names",
    ),
    ".local": ("LocalCluster",),
    ".memory": ("StageMemory", "limit_heap_caching", "release_heap", "stage_memory"),
    ".messages": ("MessageRules", "describe_tag"),
    ".model": ("Block", "GPTStage", "assemble", "generate"),
    ".native": ("load_torch_libraries",),
    ".optim": ("AdamW",),
    ".errors": ("CommClosed", "CommError", "CommTimeout"),
    ".plan": ("Plan", "check_compression"),
    ".reference": ("reference_state", "reference_step"),
    ".sample": ("sample_text",),
    ".precision": ("autocast",),
    ".spec": ("ACTIVATIONS", "PRECISIONS", "PRESETS", "TEST_CONFIG", "WIRE_DTYPES", "GPTSpec", "TrainConfig", "get_preset"),
    ".staging": ("HostStaging",),
    ".tokenizer": (
        "ByteTokenizer", "HFTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer",
        "write_byte_tokenizer",
    ),
    ".transfer": (
        "DEFAULT_CHUNK_BYTES", "TransferError", "TransferManifest", "TransferReceiver", "encode_transfer",
    ),
    ".worker": ("StageState", "StepResult", "run_step"),
}
__getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())
