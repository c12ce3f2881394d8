"""train/memory.py: what a stage's memory is made of, and freed tensors leaving the process."""

import threading

import torch

from dtfm.peer.procmem import process_memory
from dtfm.train import GPTSpec, StageState, TrainConfig, limit_heap_caching, release_heap, stage_memory

MiB = 1 << 20


def test_stage_memory_counts_weights_gradients_moments_and_what_it_is_given():
    state = StageState(GPTSpec("m", n_layer=2, n_embd=64, n_head=4, seq_len=16), TrainConfig(), (0, 2))
    weights = 4 * sum(p.numel() for p in state.params.values())
    mem = stage_memory(state, snapshot_bytes=3 * weights, activations_bytes=1000)
    assert (mem.weights, mem.grads, mem.optimizer, mem.snapshot, mem.activations) == (
        weights, weights, 2 * weights, 3 * weights, 1000)
    assert mem.total == 7 * weights + 1000
    assert mem.to_wire() == {"stage_bytes": mem.total, "weights_bytes": weights, "grads_bytes": weights,
                             "optimizer_bytes": 2 * weights, "snapshot_bytes": 3 * weights,
                             "activations_bytes": 1000}


def test_tensors_freed_between_live_ones_leave_the_process_once_heap_caching_is_limited():
    """A worker thread allocates 8 MiB tensors in turn and frees every other one (holes between
    live blocks, as a step leaves them): with heap caching limited each block is its own mapping
    and its memory leaves at once, without a trim."""
    assert limit_heap_caching()
    got = {}

    def work():
        torch.empty(16 * MiB // 4).fill_(1)  # (a 16 MiB block freed: glibc would raise its threshold to it)
        before = process_memory().rss_bytes
        blocks = [torch.ones(2 * MiB) for _ in range(16)]  # 16 x 8 MiB, every page touched
        kept = blocks[1::2]
        del blocks
        got["freed"] = before + 16 * 8 * MiB - process_memory().rss_bytes
        got["kept"] = len(kept)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert got["kept"] == 8 and got["freed"] >= 48 * MiB  # the 8 freed blocks (64 MiB) are gone
    assert release_heap()


def test_a_forward_whose_backward_never_runs_leaves_nothing_behind_when_its_activations_are_counted():
    """A step counts its saved activations with autograd's saved-tensor hooks. A step that fails
    between its forward and its backward (a neighbour died) drops its outputs; every tensor its
    forward saved must go with them. (A hook that kept the tensor it was given tied each saved
    output to the operation that made it, in C++, where no collection sees it: the graph of
    every failed step stayed, about a step's activations per fault.)"""
    import gc
    import weakref

    from dtfm.train.worker import _SavedBytes

    state = StageState(GPTSpec("m", n_layer=2, n_embd=64, n_head=4, seq_len=16), TrainConfig(), (0, 2))
    saved: list[weakref.ref] = []

    class Watched(_SavedBytes):
        def pack(self, t: torch.Tensor) -> torch.Tensor:
            saved.append(weakref.ref(t))
            return super().pack(t)

    hooks = Watched(state.params.values())
    x = torch.randint(0, state.spec.vocab, (2, 16))
    gc.disable()  # (what is freed must be freed by reference counts alone)
    try:
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            out = state.module(x)
        assert hooks.peak > 0 and len(saved) > 10
        del out
        alive = [r() for r in saved if r() is not None]
        params = {id(p) for p in state.params.values()}
        assert [tuple(t.shape) for t in alive if id(t) not in params and t is not x] == []
    finally:
        gc.enable()
