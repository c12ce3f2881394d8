"""dtfm.train: GPT stages, GPipe pipeline, data-parallel all-reduce, optimizer, data,
checkpoints and stage transfer; talks to other peers only through `Comm`."""

from .checkpoint import (
    CheckpointError,
    checkpoint_at,
    encode_stage,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    saved_checkpoints,
    stage_from_tensors,
    stage_tensors,
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
from .comm import Comm, CommClosed, CommError, CommTimeout, EventHandle, InMemoryComm, InMemoryHub, Link, SendHandle
from .data import ByteTokenizer, Corpus, load_corpus, split_batch
from .local import LocalCluster
from .messages import MessageRules
from .model import GPTStage, assemble, generate
from .optim import AdamW
from .plan import Plan
from .reference import reference_state, reference_step
from .spec import PRESETS, TEST_CONFIG, GPTSpec, TrainConfig, get_preset
from .transfer import DEFAULT_CHUNK_BYTES, TransferError, TransferManifest, TransferReceiver, encode_transfer
from .worker import StageState, StepResult, run_step

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_TENSOR_DIMS",
    "PRESETS",
    "TEST_CONFIG",
    "TENSOR_ITEMSIZE",
    "TORCH_DTYPES",
    "AdamW",
    "ByteTokenizer",
    "CheckpointError",
    "CodecError",
    "Comm",
    "CommClosed",
    "CommError",
    "CommTimeout",
    "Corpus",
    "EventHandle",
    "GPTSpec",
    "GPTStage",
    "InMemoryComm",
    "InMemoryHub",
    "Link",
    "LocalCluster",
    "MessageRules",
    "Plan",
    "SendHandle",
    "StageState",
    "StepResult",
    "TrainConfig",
    "TransferError",
    "TransferManifest",
    "TransferReceiver",
    "all_reduce_small",
    "assemble",
    "check_tensor",
    "checkpoint_at",
    "encode_stage",
    "encode_transfer",
    "generate",
    "get_preset",
    "list_checkpoints",
    "load_checkpoint",
    "load_corpus",
    "reference_state",
    "reference_step",
    "ring_all_reduce",
    "run_step",
    "save_checkpoint",
    "saved_checkpoints",
    "split_batch",
    "stage_from_tensors",
    "stage_tensors",
    "tensor_from_wire",
    "tensor_header",
    "tensor_to_wire",
]
