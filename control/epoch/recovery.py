"""Weight recovery: a peer that takes on a stage it does not hold fetches it from the peers
that held it, in hash-verified chunks, from several holders at once.

    server = RecoveryServer(transport, authorize=rule)  # once per daemon; rule(peer, key): who may fetch
    await server.offer(run_id, state)                   # at a step boundary, or offer_checkpoint
    ...
    result = await fetch_stage(transport, holders, run_id=run_id, step=k, layer_range=(a, b),
                               digest=alloc_digest, max_total_bytes=limit)
    state = result.receiver.finish(spec, cfg, (a, b))   # or assemble_stage(...) from several

A holder *offers* a stage: it encodes the StageState once (`encode_transfer`: the safetensors
blob of parameters and Adam moments cut into chunks, and a `TransferManifest` with the
checkpoint description and every chunk's sha256) and keeps it under (run, step, layer range).
The offer's *digest* is `manifest_digest`, the sha256 of the manifest's canonical encoding:
replicas of a stage with equal weights, step and config, encoded with the same chunk size,
have the same digest. The coordinator puts the digest of each stage it wants recovered in the
signed allocation, so a fetcher trusts no holder: it trusts the digest.

An export needs the model, not the state a peer that trains the stage on needs: a holder
offers it the stage's *weights* (`offer_weights`: the parameters alone, `encode_transfer(...,
weights_only=True)`, about a third of the stage with AdamW), a distinct offer with its own
digest over exactly those bytes, kept apart from the stage offers and served only to the peers
named with it (the peer an operator's export names) and only to requests for weights.

Protocol (two requests on the peer transport):

- FETCH_MANIFEST (68): {"run": 16 bytes, "step": int, "layers": [a, b]} -> {"manifest":
  manifest.to_wire(), "digest": hex} or {"error": why} when the peer holds no such offer.
- FETCH_CHUNK (69): {"run", "step", "layers", "digest": hex, "index": int} -> {"ok": true}
  with the chunk as the reply's payload, or {"error": why} when the peer holds no offer with
  that digest. An index beyond the offer's chunks is a protocol error.
- Both with "part": "weights" ask for the weights offer of that stage instead: a stage offer is
  never served to such a request, a weights offer never to one without it.

Every body is checked field by field (no extra fields, ints in range, 64 hex digits); a
malformed body raises `ProtocolError`, which closes that connection. Then `authorize(peer,
key)` says whether the asking peer may have that stage (in the daemon: the peers the holder's
allocations name, control/epoch/access.py), or for weights, whether the offer names it; a
refused peer gets {"error": why}, and the refusal is logged at DEBUG and counted (`refusals`).

The fetcher asks the holders in turn for the manifest and takes the first whose digest equals
the allocation's (an export's: the one most holders offered) and that passes
`TransferManifest.from_wire` (bounded by `max_total_bytes`) and is of the part asked for.
Then `parallel` chunk requests run at once, spread round-robin over every holder still in
good standing (a holder not yet asked for the manifest is simply asked for chunks under the
digest; an error reply means it does not hold that stage). Each chunk is checked against its
hash as it arrives. A chunk that fails its hash, a timeout, a closed connection or an error
reply drops that holder (logged with its short id) and the chunk goes back in the queue for
another. When no holder is left, `RecoveryError` names the stage, the step and every holder
with why it failed. Every network wait has a timeout.

A chunk's deadline follows its link (`chunk_deadline_s`): given `rate_of(holder)` (bytes per
second of the link from the holder, as the swarm's view measured it), a chunk request may take
`timeout_s` plus the time the link needs, at a quarter of that rate (the holder's training
shares it), for this chunk and every chunk asked of the same holder before it and not yet
delivered. A link the view has no figure for is given a 1 Mbit/s link's time; no rate is taken
as slower than `MIN_LINK_BYTES_PER_S`, so a lying report bounds how long a stalled holder is
waited for. Without `rate_of` every chunk has `timeout_s`. (With four 1 MiB chunks in flight
to one holder, a flat 10 s failed every chunk on links under about 3.4 Mbit/s.)

A new layout with other layer ranges is built from the parts of several old stages by
`assemble_stage` (control/epoch/relayout.py); `needed_stages` says which old stages a new range needs.

The chunk size is part of the digest: every peer of a swarm offers with the same chunk size
(`DEFAULT_CHUNK_BYTES`), and the manifest (about 70 bytes per chunk) must fit one control frame.
"""

from __future__ import annotations

import builtins
import enum
import hashlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from dtfm.net import (
    ConnectionClosed,
    PeerConnection,
    PeerTransport,
    ProtocolError,
    RemoteError,
    Reply,
    RequestTimeout,
    get_bytes,
    get_dict,
    get_int,
    get_list,
    get_str,
    short_id,
)
from dtfm import train  # (each name loads on first use: the server refuses and lists offers without torch)

if TYPE_CHECKING:
    from dtfm.train import StageState, TransferManifest, TransferReceiver

from ..allocation import RUN_ID_BYTES
from ..messages import ControlMsg
from ..refusals import Refusals, Refused

__all__ = ["FetchResult", "Offer", "Part", "RecoveryError", "RecoveryServer", "fetch_stage", "manifest_digest"]

logger = logging.getLogger(__name__)

_MAX_INT = 2**63 - 1
_MAX_LAYER = 1 << 20
_MAX_CHUNKS = 1 << 31
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MANIFEST_FIELDS = frozenset({"run", "step", "layers"})
_CHUNK_FIELDS = _MANIFEST_FIELDS | {"digest", "index"}
_PART = "part"  # the field that asks for the weights offer ("weights"); absent: the stage offer

Key = tuple[bytes, int, tuple[int, int]]  # (run, step, layer range)
Authorize = Callable[[bytes, Key], "Refused | None"]  # (asking peer, key) -> None: it may fetch
Source = tuple[bytes, "tuple[str, int] | None"]  # (peer id, listen address or None)


class RecoveryError(Exception):
    """A stage could not be recovered (every holder failed) or assembled (a tensor is missing)."""


class Part(enum.Enum):
    """What an offer holds: a whole stage (weights, optimizer and compression state: recovery)
    or its weights alone (an export)."""

    STAGE = "stage"
    WEIGHTS = "weights"


def manifest_digest(manifest: TransferManifest) -> str:
    """sha256 hex of the manifest's canonical encoding: what the allocation names a stage by."""
    return hashlib.sha256(json.dumps(manifest.to_wire(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ----------------------------------------------------------------------------- request bodies


def _key_untrusted(d: dict) -> Key:
    run = get_bytes(d, "run", RUN_ID_BYTES, RUN_ID_BYTES)
    step = get_int(d, "step", 0, _MAX_INT)
    layers = get_list(d, "layers", 2)
    if len(layers) != 2 or any(type(x) is not int for x in layers):
        raise ProtocolError("field 'layers': expected two ints [a, b]")
    a, b = layers
    if not 0 <= a < b <= _MAX_LAYER:
        raise ProtocolError(f"field 'layers': [{a}, {b}) is not a layer range")
    return run, step, (a, b)


def _part_untrusted(d: dict, fields: frozenset[str], what: str) -> Part:
    """The part a request asks for, its fields exactly `fields` (and "part" for weights)."""
    if set(d) == fields:
        return Part.STAGE
    if set(d) != fields | {_PART}:
        raise ProtocolError(f"{what} fields {sorted(map(str, d))}, expected {sorted(fields)} (and {_PART!r})")
    if d[_PART] != Part.WEIGHTS.value:
        raise ProtocolError(f"field {_PART!r}: only {Part.WEIGHTS.value!r} is asked for by name")
    return Part.WEIGHTS


def parse_manifest_request(body: object) -> tuple[Key, Part]:
    """A FETCH_MANIFEST body: (key, part), every field checked; raises ProtocolError only."""
    d = get_dict(body, "fetch-manifest request")
    part = _part_untrusted(d, _MANIFEST_FIELDS, "fetch-manifest")
    return _key_untrusted(d), part


def parse_chunk_request(body: object) -> tuple[Key, Part, str, int]:
    """A FETCH_CHUNK body: (key, part, digest, index); raises ProtocolError only."""
    d = get_dict(body, "fetch-chunk request")
    part = _part_untrusted(d, _CHUNK_FIELDS, "fetch-chunk")
    digest = get_str(d, "digest", 64)
    if not _HEX64.match(digest):
        raise ProtocolError("field 'digest': expected 64 lowercase hex digits")
    return _key_untrusted(d), part, digest, get_int(d, "index", 0, _MAX_CHUNKS)


def _key_body(run: bytes, step: int, layer_range: tuple[int, int], part: Part) -> dict:
    body: dict = {"run": run, "step": step, "layers": [layer_range[0], layer_range[1]]}
    if part is Part.WEIGHTS:
        body[_PART] = part.value
    return body


# ----------------------------------------------------------------------------- holder side


@dataclass
class Offer:
    """A stage (or its weights) this peer serves: encoded once, served chunk by chunk."""

    run: bytes
    step: int
    layer_range: tuple[int, int]
    manifest: TransferManifest
    chunks: list[memoryview]  # read-only views of the one encoded blob
    digest: str
    served_bytes: int = 0
    part: Part = Part.STAGE
    fetchers: frozenset[builtins.bytes] = frozenset()  # weights: the peers that may fetch them

    @property
    def key(self) -> Key:
        return self.run, self.step, self.layer_range

    def describe(self) -> dict:
        """For status: run, step, layers, part, digest, bytes, chunks, bytes served."""
        return {"run": self.run.hex(), "step": self.step, "layers": list(self.layer_range), "part": self.part.value,
                "digest": self.digest, "bytes": self.manifest.total_bytes, "chunks": len(self.chunks),
                "served_bytes": self.served_bytes}


class RecoveryServer:
    """Serves the stages this peer offers to the peers `authorize` lets fetch them, and the
    weights it offers for an export to the peers named with them; `max_offers` of each."""

    def __init__(self, transport: PeerTransport, *, authorize: Authorize, max_offers: int = 4,
                 chunk_bytes: int | None = None):
        if max_offers < 1:
            raise ValueError("max_offers must be at least 1")
        self.transport, self.max_offers = transport, max_offers
        self.chunk_bytes = chunk_bytes  # None: train's DEFAULT_CHUNK_BYTES
        self.authorize = authorize
        self.refusals = Refusals()
        self._offers: dict[Part, dict[Key, Offer]] = {p: {} for p in Part}  # insertion order: oldest first
        self.served_bytes = 0
        transport.handle(ControlMsg.FETCH_MANIFEST, self._on_manifest)
        transport.handle(ControlMsg.FETCH_CHUNK, self._on_chunk)

    async def offer(self, run_id: bytes, state: StageState) -> Offer:
        """Offer `state` (as it is now: call between steps) under (run_id, state.step, its layers)."""
        if len(run_id) != RUN_ID_BYTES:
            raise ValueError(f"a run id is {RUN_ID_BYTES} bytes")
        # an earlier offer under the same key goes first: two encoded copies are never held at once
        self._offers[Part.STAGE].pop((run_id, state.step, state.layer_range), None)
        manifest, chunks = await trio.to_thread.run_sync(train.encode_transfer, state, self._chunk_bytes())
        return self._keep(Offer(run_id, state.step, state.layer_range, manifest, chunks,
                                manifest_digest(manifest)))

    def offered(self, key: Key, part: Part = Part.STAGE) -> Offer | None:
        """The offer held under `key` (run, step, layers), if any."""
        return self._offers[part].get(key)

    async def offer_weights(self, run_id: bytes, state: StageState, fetchers: frozenset[builtins.bytes]) -> Offer:
        """Offer the parameters of `state` alone, to `fetchers` only (and to those its earlier
        weights offer under the same key named, when the weights are the same)."""
        if len(run_id) != RUN_ID_BYTES:
            raise ValueError(f"a run id is {RUN_ID_BYTES} bytes")

        def encode() -> tuple[TransferManifest, list[memoryview]]:
            return train.encode_transfer(state, self._chunk_bytes(), weights_only=True)

        manifest, chunks = await trio.to_thread.run_sync(encode)
        digest = manifest_digest(manifest)
        earlier = self._offers[Part.WEIGHTS].get((run_id, state.step, state.layer_range))
        if earlier is not None and earlier.digest == digest:
            fetchers = fetchers | earlier.fetchers
        return self._keep(Offer(run_id, state.step, state.layer_range, manifest, chunks, digest,
                                part=Part.WEIGHTS, fetchers=fetchers))

    async def offer_checkpoint(self, run_id: bytes, json_path: str | Path) -> Offer:
        """Offer a checkpoint from disk (hash-checked as it is loaded); CheckpointError if bad."""
        state = await trio.to_thread.run_sync(train.load_checkpoint, json_path)
        return await self.offer(run_id, state)

    def _chunk_bytes(self) -> int:
        return self.chunk_bytes if self.chunk_bytes is not None else train.DEFAULT_CHUNK_BYTES

    def _keep(self, offer: Offer) -> Offer:
        offers = self._offers[offer.part]
        offers.pop(offer.key, None)
        offers[offer.key] = offer
        while len(offers) > self.max_offers:
            old = offers.pop(next(iter(offers)))
            logger.info("dropped the %s offer of layers %s at step %d (keeping %d)", old.part.value, old.layer_range,
                        old.step, self.max_offers)
        logger.info("offering the %s of layers %s at step %d: %d bytes in %d chunks, digest %s", offer.part.value,
                    offer.layer_range, offer.step, offer.manifest.total_bytes, len(offer.chunks), offer.digest[:16])
        return offer

    def withdraw(self, run_id: bytes | None, part: Part | None = None, *, keep: Collection[Key] = ()) -> int:
        """Stop serving the offers of `run_id` (None: of every run), of `part` only when given
        (stages or weights), but those whose key (run, step, layers) is in `keep`; how many went.
        An offer's memory (its encoded blob) goes with the last reference."""
        n = 0
        for p, offers in self._offers.items():
            if part is not None and p is not part:
                continue
            gone = [k for k in offers if (run_id is None or k[0] == run_id) and k not in keep]
            for k in gone:
                del offers[k]
            n += len(gone)
        return n

    def offers(self) -> list[dict]:
        """The offers, stages then weights, oldest first, for status (`Offer.describe`)."""
        return [o.describe() for part in Part for o in self._offers[part].values()]

    def _refused(self, conn: PeerConnection, key: Key, part: Part) -> str | None:
        if part is Part.WEIGHTS:  # only the peers the weights offer names (none held: "not held")
            offer = self._offers[part].get(key)
            why = None if offer is None or conn.peer_id in offer.fetchers else Refused.EXPORT_NOT_SIGNED
        else:
            why = self.authorize(conn.peer_id, key)
        if why is None:
            return None
        self.refusals.refuse(why, conn.peer_id, f"the {part.value} of layers {list(key[2])} at step {key[1]}")
        return why.text

    async def _on_manifest(self, conn: PeerConnection, msg_type: int, body: object, payload) -> dict:
        key, part = parse_manifest_request(body)
        refused = self._refused(conn, key, part)
        if refused is not None:
            return {"error": refused}
        offer = self._offers[part].get(key)
        if offer is None:
            logger.debug("%s asked for layers %s at step %d, not held", conn.short_id, key[2], key[1])
            return {"error": f"layers {list(key[2])} at step {key[1]} of this run are not held here"}
        return {"manifest": offer.manifest.to_wire(), "digest": offer.digest}

    async def _on_chunk(self, conn: PeerConnection, msg_type: int, body: object, payload) -> object:
        key, part, digest, index = parse_chunk_request(body)
        refused = self._refused(conn, key, part)
        if refused is not None:
            return {"error": refused}
        offer = self._offers[part].get(key)
        if offer is None or offer.digest != digest:
            logger.debug("%s asked for a chunk of layers %s at step %d (digest %s), not held", conn.short_id,
                         key[2], key[1], digest[:16])
            return {"error": f"layers {list(key[2])} at step {key[1]} with digest {digest[:16]} are not held here"}
        if index >= len(offer.chunks):
            raise ProtocolError(f"chunk {index} of {len(offer.chunks)}")
        chunk = offer.chunks[index]
        offer.served_bytes += len(chunk)
        self.served_bytes += len(chunk)
        return Reply({"ok": True}, chunk)


# ----------------------------------------------------------------------------- fetcher side


@dataclass
class FetchResult:
    receiver: TransferReceiver  # complete: every chunk in and verified
    bytes: int  # bytes of verified chunks received (the stage's size)
    seconds: float
    # below, `bytes` is the field above: the builtin is builtins.bytes
    per_source: dict[builtins.bytes, int] = field(default_factory=dict)  # chunks each holder delivered
    failed: dict[builtins.bytes, str] = field(default_factory=dict)  # holders dropped, and why


Connect = Callable[[bytes, "tuple[str, int] | None"], Awaitable[PeerConnection]]
_NET_ERRORS = (ConnectionClosed, RequestTimeout, RemoteError, ProtocolError, OSError, trio.TooSlowError)
RateOf = Callable[[bytes], "float | None"]  # bytes per second of the link from a holder; None: unknown

LINK_RATE_SHARE = 0.25  # of a link's measured rate, what a fetch's chunks are given time at
UNKNOWN_LINK_BYTES_PER_S = 125_000.0  # a link the view has no figure for: given a 1 Mbit/s link's time
MIN_LINK_BYTES_PER_S = 32_000.0  # no link is taken as slower (a chunk of 1 MiB: at most 33 s more)


def chunk_deadline_s(timeout_s: float, rate: float | None, bytes_ahead: int) -> float:
    """Seconds a chunk request may take: `timeout_s`, plus `bytes_ahead` (the chunk and those
    asked of the same holder before it, still in flight) at `LINK_RATE_SHARE` of the link's
    `rate` (bytes/s; None: `UNKNOWN_LINK_BYTES_PER_S`, whole), never slower than
    `MIN_LINK_BYTES_PER_S`."""
    usable = UNKNOWN_LINK_BYTES_PER_S if rate is None or not rate > 0 else rate * LINK_RATE_SHARE
    return timeout_s + bytes_ahead / max(usable, MIN_LINK_BYTES_PER_S)


class _Fetch:
    """One fetch's state: holders in good standing and the counters."""

    def __init__(self, transport, sources, run_id, step, layer_range, digest, timeout_s, connect, part,
                 rate_of: RateOf | None = None):
        self.transport, self.timeout_s, self._connect = transport, timeout_s, connect
        self._rate_of = rate_of
        self.in_flight: dict[bytes, int] = {}  # bytes of chunks asked of each holder, not yet delivered
        self._rates: dict[bytes, float | None] = {}  # each holder's link rate, read once per fetch
        self.part = part
        self.key_body = _key_body(run_id, step, tuple(layer_range), part)
        self.step, self.layer_range, self.digest = step, tuple(layer_range), digest
        self.addr = dict(sources)
        self.live = [p for p in dict.fromkeys(p for p, _ in sources) if p != transport.peer_id]  # not itself
        self.conns: dict[bytes, PeerConnection] = {}
        self.locks: dict[bytes, trio.Lock] = {}
        self.failed: dict[bytes, str] = {}
        self.per_source: dict[bytes, int] = {}
        self.nbytes = 0
        self._rr = 0

    def drop(self, peer: bytes, reason: str) -> None:
        if peer in self.live:
            self.live.remove(peer)
            self.failed[peer] = reason
            logger.warning("fetch of the %s of layers %s at step %d: dropped holder %s: %s", self.part.value,
                           self.layer_range, self.step, short_id(peer), reason)

    def next_source(self) -> bytes:
        self._rr += 1
        return self.live[self._rr % len(self.live)]

    async def conn(self, peer: bytes) -> PeerConnection:
        async with self.locks.setdefault(peer, trio.Lock()):  # one dial per holder, not one per worker
            return await self._conn_locked(peer)

    async def _conn_locked(self, peer: bytes) -> PeerConnection:
        c = self.conns.get(peer)
        if c is not None and not c.closed:
            return c
        with trio.fail_after(self.timeout_s):
            if self._connect is not None:
                c = await self._connect(peer, self.addr.get(peer))
            else:
                c = self.transport.connection(peer)
                if c is None:
                    addr = self.addr.get(peer)
                    if addr is None:
                        raise ConnectionClosed("no connection and no address")
                    c = await self.transport.connect(addr[0], addr[1], peer_id=peer)
        self.conns[peer] = c
        return c

    async def manifest_from(self, peer: bytes, max_total_bytes: int) -> TransferManifest:
        """The manifest `peer` holds, checked against the digest; raises RecoveryError with why not."""
        try:
            c = await self.conn(peer)
            reply, _ = await c.request(ControlMsg.FETCH_MANIFEST, self.key_body, timeout_s=self.timeout_s)
        except _NET_ERRORS as e:
            raise RecoveryError(_why(e)) from None
        if type(reply) is not dict or not (set(reply) == {"manifest", "digest"} or set(reply) == {"error"}):
            raise RecoveryError("malformed manifest reply")
        if "error" in reply:
            raise RecoveryError(f"refused: {str(reply['error'])[:200]}")
        try:
            manifest = train.TransferManifest.from_wire(reply["manifest"], max_total_bytes)
        except train.TransferError as e:
            raise RecoveryError(f"bad manifest: {e}") from None
        got = manifest_digest(manifest)
        if got != self.digest:
            raise RecoveryError(f"holds digest {got[:16]}, expected {self.digest[:16]}")
        if manifest.weights_only != (self.part is Part.WEIGHTS):
            raise RecoveryError("offers the weights alone where the whole stage was asked for" if manifest.weights_only
                                else "offers a whole stage where its weights alone were asked for")
        m_range, m_step = tuple(manifest.meta["layer_range"]), manifest.meta["step"]
        if m_range != self.layer_range or m_step != self.step:
            raise RecoveryError(f"manifest describes layers {m_range} at step {m_step}")
        return manifest

    async def chunk_worker(self, receiver: TransferReceiver, indices: trio.MemoryReceiveChannel,
                           scope: trio.CancelScope) -> None:
        """Fetch chunks from the queue, each from the next holder in turn until one delivers it;
        cancel the fetch when no holder is left."""
        async for index in indices:
            while True:
                if not self.live:
                    scope.cancel()
                    return
                if await self._one_chunk(receiver, self.next_source(), index):
                    break

    def deadline_s(self, peer: bytes, size: int) -> float:
        """The deadline of a chunk of `size` bytes asked of `peer` now (`chunk_deadline_s`)."""
        if self._rate_of is None:
            return self.timeout_s
        if peer not in self._rates:
            self._rates[peer] = self._rate_of(peer)
        return chunk_deadline_s(self.timeout_s, self._rates[peer], self.in_flight.get(peer, 0) + size)

    async def _one_chunk(self, receiver: TransferReceiver, peer: bytes, index: int) -> bool:
        body = dict(self.key_body, digest=self.digest, index=index)
        size = receiver.manifest.chunk_size(index)
        try:
            c = await self.conn(peer)
            deadline = self.deadline_s(peer, size)
            self.in_flight[peer] = self.in_flight.get(peer, 0) + size
            try:
                reply, payload = await c.request(ControlMsg.FETCH_CHUNK, body, timeout_s=deadline)
            finally:
                self.in_flight[peer] -= size
        except _NET_ERRORS as e:
            self.drop(peer, _why(e))
            return False
        if type(reply) is dict and set(reply) == {"error"}:
            self.drop(peer, f"refused: {str(reply['error'])[:200]}")
            return False
        if reply != {"ok": True} or payload is None:
            self.drop(peer, f"malformed reply to chunk {index}")
            return False
        try:
            receiver.feed(index, payload)  # copied into the stage's buffer; the transport's buffer goes back
        except train.TransferError as e:
            self.drop(peer, str(e))
            return False
        self.nbytes += len(payload)
        self.per_source[peer] = self.per_source.get(peer, 0) + 1
        return True

    def error(self) -> RecoveryError:
        why = "; ".join(f"{short_id(p)}: {r}" for p, r in self.failed.items()) or "no holders given"
        return RecoveryError(f"cannot recover layers {list(self.layer_range)} at step {self.step}: "
                             f"every holder failed ({why}); recover from another holder or a checkpoint")


def _why(e: BaseException) -> str:
    if isinstance(e, (trio.TooSlowError, RequestTimeout)):
        return "timed out"
    return f"{type(e).__name__}: {e}"[:200]


async def fetch_stage(transport: PeerTransport, sources: Sequence[Source], *, run_id: bytes, step: int,
                      layer_range: tuple[int, int], digest: str, max_total_bytes: int, parallel: int = 4,
                      timeout_s: float = 30.0, connect: Connect | None = None,
                      part: Part = Part.STAGE, rate_of: RateOf | None = None) -> FetchResult:
    """Fetch the stage named by `digest` from its holders `sources` [(peer id, address or None)];
    `part` Part.WEIGHTS: their weights offer of it (an export), the parameters alone.

    `connect(peer, address)` overrides how a holder is reached (by default the transport's live
    connection, else `transport.connect`). `rate_of(peer)`: bytes per second of the link from a
    holder, which each chunk's deadline follows (`chunk_deadline_s`; None: `timeout_s` flat).
    Raises RecoveryError when every holder failed."""
    if parallel < 1 or not timeout_s > 0:
        raise ValueError("parallel must be >= 1 and timeout_s > 0")
    f = _Fetch(transport, sources, run_id, step, layer_range, digest, timeout_s, connect, part, rate_of)
    t0 = trio.current_time()
    manifest = None
    for peer in list(f.live):
        try:
            manifest = await f.manifest_from(peer, max_total_bytes)
            break
        except RecoveryError as e:
            f.drop(peer, str(e))
    if manifest is None:
        raise f.error()
    receiver = train.TransferReceiver(manifest)
    n = len(manifest.chunk_sha256)
    send, recv = trio.open_memory_channel(n)  # bounded by the manifest's chunk count
    for i in range(n):
        send.send_nowait(i)
    send.close()  # a worker whose holder fails retries its chunk itself, with the next holder
    async with trio.open_nursery() as nursery:
        for _ in range(min(parallel, n)):
            nursery.start_soon(f.chunk_worker, receiver, recv, nursery.cancel_scope)
    if not receiver.complete:
        raise f.error()
    seconds = trio.current_time() - t0
    logger.info("fetched the %s of layers %s at step %d: %d bytes in %.2f s from %s", part.value, f.layer_range,
                step, f.nbytes, seconds, ", ".join(f"{short_id(p)} ({k})" for p, k in f.per_source.items()))
    return FetchResult(receiver, f.nbytes, seconds, f.per_source, f.failed)
