"""Stage hand-over between peers: the checkpoint encoding, streamed in hash-verified chunks.

The sender builds a `TransferManifest` (the checkpoint description, the chunk size and the
sha256 of every chunk) and the chunks. The receiver checks the manifest with
`TransferManifest.from_wire` (bounded sizes, every field typed), feeds chunks in any order to
a `TransferReceiver` (each chunk checked against its hash as it arrives, so a corrupt chunk
is refused at once and can be fetched again, from another holder if need be), and finally
rebuilds the stage it expects (its own model spec, config and layer range, never sizes taken
from the sender), with the whole blob checked against the hash in the description. An export
moves the parameters alone (`encode_transfer(..., weights_only=True)`, format
WEIGHTS_FORMAT): their tensors can be read, never rebuilt into a stage to train on. Every
malformed input raises `TransferError`; the peer transport turns it into its ProtocolError.

Memory: the sender's chunks are read-only views of the one encoded blob (one copy of the stage,
not two); the receiver copies each verified chunk into one buffer of the stage's size, allocated
at the first chunk, and the tensors it gives are views of that buffer, so rebuilding a stage
holds the received bytes and the new stage, nothing more.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np
import torch

from .checkpoint import (
    FORMAT,
    WEIGHTS_FORMAT,
    CheckpointError,
    _meta_fields,
    compression_of,
    decode_tensors,
    encode_stage,
    encode_weights,
    stage_from_tensors,
)
from .compress import CompressionConfig
from .spec import GPTSpec, TrainConfig
from .worker import StageState

__all__ = ["TransferManifest", "TransferReceiver", "TransferError", "encode_transfer",
           "MAX_META_BYTES", "DEFAULT_CHUNK_BYTES"]

MAX_META_BYTES = 64 << 10  # a checkpoint description is a few hundred bytes
DEFAULT_CHUNK_BYTES = 1 << 20  # smaller chunks retry cheaper, larger cost fewer messages
MAX_CHUNK_BYTES = 64 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class TransferError(CheckpointError):
    """A transferred stage is malformed, oversized, incomplete or fails a hash."""


@dataclass(frozen=True)
class TransferManifest:
    meta: dict  # the checkpoint description: step, spec, config, layer range, sha256, bytes
    chunk_bytes: int
    chunk_sha256: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return int(self.meta["bytes"])

    def chunk_size(self, index: int) -> int:
        """Bytes of chunk `index` (every chunk `chunk_bytes`, the last what is left)."""
        n = len(self.chunk_sha256)
        return self.chunk_bytes if index < n - 1 else self.total_bytes - self.chunk_bytes * (n - 1)

    @property
    def weights_only(self) -> bool:
        """The parameters alone (an export's), not a whole stage."""
        return self.meta.get("format") == WEIGHTS_FORMAT

    def to_wire(self) -> dict:
        return {"meta": json.dumps(self.meta, sort_keys=True), "chunk_bytes": self.chunk_bytes,
                "chunk_sha256": list(self.chunk_sha256)}

    @classmethod
    def from_wire(cls, obj: object, max_total_bytes: int) -> "TransferManifest":
        """Validate a manifest from the network; raises TransferError only."""
        if not isinstance(obj, dict) or set(obj) != {"meta", "chunk_bytes", "chunk_sha256"}:
            raise TransferError("manifest must be a map with meta, chunk_bytes, chunk_sha256")
        raw, chunk, hashes = obj["meta"], obj["chunk_bytes"], obj["chunk_sha256"]
        if not isinstance(raw, str) or len(raw) > MAX_META_BYTES:
            raise TransferError("manifest meta must be a JSON string of bounded size")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= MAX_CHUNK_BYTES:
            raise TransferError(f"chunk_bytes must be an integer in [1, {MAX_CHUNK_BYTES}]")
        try:
            meta = json.loads(raw)
        except ValueError:
            raise TransferError("manifest meta is not valid JSON") from None
        if not isinstance(meta, dict):
            raise TransferError("manifest meta must be a JSON object")
        if meta.get("format") not in (FORMAT, WEIGHTS_FORMAT):
            raise TransferError(f"manifest meta format must be {FORMAT} or {WEIGHTS_FORMAT}")
        total = meta.get("bytes")
        if not isinstance(total, int) or isinstance(total, bool) or not 0 < total <= max_total_bytes:
            raise TransferError(f"stage size {total!r} is not in (0, {max_total_bytes}]")
        if not isinstance(meta.get("sha256"), str) or not _HEX64.match(meta["sha256"]):
            raise TransferError("manifest meta needs a sha256 hex digest")
        try:
            _meta_fields(meta)
        except CheckpointError as e:
            raise TransferError(str(e)) from None
        if not isinstance(hashes, list) or len(hashes) != -(-total // chunk):
            raise TransferError("manifest must list one hash per chunk")
        if not all(isinstance(h, str) and _HEX64.match(h) for h in hashes):
            raise TransferError("chunk hashes must be sha256 hex digests")
        return cls(meta, chunk, tuple(hashes))


def encode_transfer(state: StageState, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *,
                    weights_only: bool = False) -> tuple[TransferManifest, list[memoryview]]:
    """The manifest and chunks that hand `state` to another peer; `weights_only`: its
    parameters alone (an export), not the optimizer and compression state. The chunks are
    read-only views of one blob, which lives as long as any of them."""
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}]")
    blob, meta = encode_weights(state) if weights_only else encode_stage(state)
    chunks = [blob[i:i + chunk_bytes] for i in range(0, blob.nbytes, chunk_bytes)]
    return TransferManifest(meta, chunk_bytes, tuple(hashlib.sha256(c).hexdigest() for c in chunks)), chunks


class TransferReceiver:
    """Collects a stage's chunks, verifying each on arrival."""

    def __init__(self, manifest: TransferManifest):
        self.manifest = manifest
        self._have: set[int] = set()
        self._blob: np.ndarray | None = None  # the stage's bytes, allocated at the first chunk

    @property
    def missing(self) -> list[int]:
        return [i for i in range(len(self.manifest.chunk_sha256)) if i not in self._have]

    @property
    def complete(self) -> bool:
        return not self.missing

    def feed(self, index: int, chunk: bytes | bytearray | memoryview) -> None:
        """Check chunk `index` against its hash and copy it into place (the caller may reuse
        `chunk`'s memory once this returns)."""
        m = self.manifest
        n = len(m.chunk_sha256)
        if not isinstance(index, int) or not 0 <= index < n:
            raise TransferError(f"chunk index {index!r} is out of range [0, {n})")
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise TransferError("a chunk must be bytes")
        data = memoryview(chunk).cast("B")
        expected = m.chunk_size(index)
        if data.nbytes != expected:
            raise TransferError(f"chunk {index} has {data.nbytes} bytes, expected {expected}")
        if hashlib.sha256(data).hexdigest() != m.chunk_sha256[index]:
            raise TransferError(f"chunk {index} fails its hash")
        if self._blob is None:
            try:  # (pages are touched only as chunks land: the size is the manifest's, bounded by its reader)
                self._blob = np.empty(m.total_bytes, dtype=np.uint8)
            except MemoryError:
                raise TransferError(f"no memory for a stage of {m.total_bytes} bytes") from None
        at = index * m.chunk_bytes
        self._blob[at:at + expected] = np.frombuffer(data, dtype=np.uint8)
        self._have.add(index)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stage's named tensors (only `param/<name>` ones from a WEIGHTS_FORMAT manifest),
        once every chunk is in; the whole blob is hash-checked. They are views of the received
        bytes: writing to one changes what a later call returns."""
        if not self.complete or self._blob is None:
            raise TransferError(f"{len(self.missing)} chunks are still missing")
        try:  # views of the received bytes
            return decode_tensors(self._blob.data, self.manifest.meta, (FORMAT, WEIGHTS_FORMAT))
        except CheckpointError as e:
            raise TransferError(str(e)) from None

    def finish(self, spec: GPTSpec, cfg: TrainConfig, layer_range: tuple[int, int],
               device: str = "cpu", compression: CompressionConfig | None = None) -> StageState:
        """The received stage, which must be the stage the receiver expects (its own model,
        config, compression and layer range: nothing is allocated from what the sender claims)."""
        if self.manifest.meta.get("format") != FORMAT:
            raise TransferError(f"the sender offers {self.manifest.meta.get('format')!r}, not a whole stage ({FORMAT})")
        m_spec, m_cfg, m_range, step, ostep = _meta_fields(self.manifest.meta)
        if m_spec != spec or not cfg.trains_as(m_cfg) or m_range != tuple(layer_range):
            raise TransferError(f"the sender offers layers {m_range} of {m_spec.name!r}, "
                                f"expected layers {tuple(layer_range)} of {spec.name!r} with this run's config")
        try:
            mine, theirs = compression or CompressionConfig(), compression_of(self.manifest.meta) or CompressionConfig()
        except CheckpointError as e:
            raise TransferError(str(e)) from None
        if mine != theirs:
            raise TransferError(f"the sender's stage was trained with compression {theirs.describe()!r}, "
                                f"this run uses {mine.describe()!r}")
        try:
            return stage_from_tensors(spec, cfg, m_range, self.tensors(), step, ostep, device, compression)
        except TransferError:
            raise
        except CheckpointError as e:
            raise TransferError(str(e)) from None
