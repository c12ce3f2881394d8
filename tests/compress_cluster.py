"""What the compressed-training tests share (tests/train/test_train_compress.py,
tests/control/allocation/test_compress_links.py): the small model and run they train in a `LocalCluster`, and the
hashes that tell whether a stage's DP replicas hold the same bits."""

from __future__ import annotations

import hashlib

from dtfm.train import GPTSpec, LocalCluster, TrainConfig

SPEC = GPTSpec("c", n_layer=4, n_embd=32, n_head=4, seq_len=16)
CFG = TrainConfig(global_batch_seqs=12, micro_batches=2, lr=3e-3, comm_timeout_s=20.0)


def replica_hashes(cl: LocalCluster, s: int) -> list[str]:
    """The SHA-256 of each replica's parameters of stage `s`, in its DP group's order."""
    out = []
    for peer in cl.plan.dp_group(s):
        h = hashlib.sha256()
        for p in cl.states[peer].params.values():
            h.update(p.detach().numpy().tobytes())
        out.append(h.hexdigest())
    return out
