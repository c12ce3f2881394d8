"""Collectives over an ordered group of peers, built only on `Comm.isend` / `Comm.recv`.

`ring_all_reduce` is the bandwidth-optimal ring (reduce-scatter, then all-gather): each member
sends 2 (N-1)/N of the data. The tensors are packed into buckets of at most `bucket_bytes`
(a tensor larger than that is a bucket of its own, reduced in place through a view: no copy)
and the buckets advance through the ring together, so one bucket's transfer overlaps the
others'. Every element's sum is computed once, by one member, and copied to the rest, so
all members end with bit-identical results (replicas stay equal). `all_reduce_small` sends
every value to every member and sums in group order: for scalars such as the squared
gradient norm or the loss.

A member has its result once it has received everything; its own sends' acknowledgements come
about half a round trip later and only say whether they failed. With `pending` (a
`PendingSends`) a collective leaves its send handles there for the caller to wait for later
(the training step does, before the next step changes the state); without, it waits for them
before it returns.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .comm import Comm, CommError, PeerId, PendingSends, settle_sends

__all__ = ["ring_all_reduce", "all_reduce_small", "make_buckets"]


def make_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `tensors` grouped in order into buckets of at most bucket_bytes (or one tensor)."""
    buckets: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


def _checked(t: torch.Tensor, like: torch.Tensor, peer: PeerId, tag: str) -> torch.Tensor:
    if t.dtype != like.dtype or t.shape != like.shape:
        raise CommError(f"peer {peer!r} sent {t.dtype} {tuple(t.shape)} under {tag!r}, "
                        f"expected {like.dtype} {tuple(like.shape)}")
    return t


def ring_all_reduce(comm: Comm, group: Sequence[PeerId], tensors: Sequence[torch.Tensor], tag: str,
                    timeout_s: float, bucket_bytes: int = 4 << 20, pending: PendingSends | None = None) -> None:
    """Sum `tensors` (same shapes, same order on every member) in place across `group`; the
    acknowledgements of its sends are waited for now, or left in `pending`."""
    n = len(group)
    if n <= 1 or not tensors:
        return
    if len(set(group)) != n or comm.me not in group:
        raise ValueError(f"group {group!r} must list distinct peers including this one ({comm.me!r})")
    r = list(group).index(comm.me)
    nxt, prv = group[(r + 1) % n], group[(r - 1) % n]
    buckets = make_buckets(tensors, bucket_bytes)
    # a bucket of one contiguous tensor is reduced in place, through a view (no copy of it, no
    # copy back); several tensors are packed into one flat copy
    flats = [tensors[b[0]].view(-1) if len(b) == 1 and tensors[b[0]].is_contiguous()
             else torch.cat([tensors[i].reshape(-1) for i in b]) for b in buckets]
    chunks = [list(torch.tensor_split(f, n)) for f in flats]
    handles = []
    for phase in ("rs", "ag"):
        for step in range(n - 1):
            if phase == "rs":
                send_c, recv_c = (r - step) % n, (r - step - 1) % n
            else:
                send_c, recv_c = (r + 1 - step) % n, (r - step) % n
            for b, ch in enumerate(chunks):
                handles.append(comm.isend(nxt, f"{tag}/{phase}{step}/b{b}", ch[send_c]))
            for b, ch in enumerate(chunks):
                t = f"{tag}/{phase}{step}/b{b}"
                got = _checked(comm.recv(prv, t, timeout_s), ch[recv_c], prv, t).to(ch[recv_c].device)
                if phase == "rs":
                    ch[recv_c].add_(got)
                else:
                    ch[recv_c].copy_(got)
    settle_sends(handles, pending, timeout_s)  # isend copied every chunk: `flats` may change now
    for bucket, flat in zip(buckets, flats):
        if flat.data_ptr() == tensors[bucket[0]].data_ptr() and len(bucket) == 1:
            continue  # reduced in place
        off = 0
        for i in bucket:
            k = tensors[i].numel()
            tensors[i].copy_(flat[off:off + k].view_as(tensors[i]))
            off += k


def all_reduce_small(comm: Comm, group: Sequence[PeerId], value: torch.Tensor, tag: str,
                     timeout_s: float, pending: PendingSends | None = None) -> torch.Tensor:
    """The sum of `value` over `group`, added in group order: the same bits on every member; the
    acknowledgements of its sends are waited for now, or left in `pending`."""
    if len(group) <= 1:
        return value.clone()
    if comm.me not in group:
        raise ValueError(f"group {group!r} must include this peer ({comm.me!r})")
    handles = [comm.isend(p, tag, value) for p in group if p != comm.me]
    parts = [value if p == comm.me else _checked(comm.recv(p, tag, timeout_s), value, p, tag).to(value.device)
             for p in group]
    settle_sends(handles, pending, timeout_s)
    total = parts[0].clone()
    for x in parts[1:]:
        total += x
    return total
