"""MessageRules accept exactly the messages a real run sends, with their dtypes and shapes."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dtfm.train import (
    TORCH_DTYPES,
    CompressionConfig,
    GPTSpec,
    InMemoryHub,
    LinkCodecs,
    MessageRules,
    Plan,
    StageState,
    TrainConfig,
    load_corpus,
    run_step,
)

SPEC = GPTSpec("rules", n_layer=4, n_embd=32, n_head=4, seq_len=16)
# Small buckets, so the ring all-reduce sends several per step, some split unevenly.
CFG = TrainConfig(global_batch_seqs=16, micro_batches=4, lr=3e-3, bucket_bytes=8192, comm_timeout_s=20.0)
_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=64 << 10)


class Recording:
    """An InMemoryComm that records every message sent, and the bytes each peer sends each other
    peer between two of its own receives (what the rules' `burst` must cover)."""

    def __init__(self, inner, log: list, lock: threading.Lock, run: dict):
        self.inner, self.me, self.log, self.lock, self.run = inner, inner.me, log, lock, run

    def isend(self, peer, tag, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        with self.lock:
            self.log.append((self.me, peer, tag, _NAMES[tensor.dtype], tuple(tensor.shape)))
            old = self.run.get((self.me, peer), (0, 0, 0, 0))
            msgs, total = old[0] + 1, old[1] + nbytes
            self.run[(self.me, peer)] = (msgs, total, max(old[2], msgs), max(old[3], total))
        return self.inner.isend(peer, tag, tensor)

    def recv(self, peer, tag, timeout_s):
        with self.lock:
            for key, (_, _, peak_m, peak_b) in list(self.run.items()):
                if key[0] == self.me:
                    self.run[key] = (0, 0, peak_m, peak_b)
        return self.inner.recv(peer, tag, timeout_s)


def run_recorded(spec, cfg, plan, corpus, steps, comp=None):
    """Run `steps` steps of `plan` in threads; (states, sent messages, peak bursts per pair)."""
    states = {p: StageState(spec, cfg, plan.layer_ranges[plan.position(p)[1]], compression=comp) for p in plan.peers}
    log, lock, run = [], threading.Lock(), {}
    for _ in range(steps):
        hub = InMemoryHub()
        with ThreadPoolExecutor(len(plan.peers)) as pool:
            futs = [pool.submit(run_step, states[p], plan, p, Recording(hub.endpoint(p), log, lock, run), corpus)
                    for p in plan.peers]
            try:
                for f in futs:
                    f.result(timeout=60)
            except BaseException:
                hub.abort()
                raise
    return states, log, {k: (v[2], v[3]) for k, v in run.items()}


SHAPES = [
    pytest.param(SPEC, CFG, Plan.grid(4, 1, 1, epoch=3), id="1x1"),
    pytest.param(SPEC, CFG, Plan.grid(4, 2, 2, epoch=3), id="2x2"),
    pytest.param(SPEC, CFG, Plan.grid(4, 4, 1, epoch=3), id="4x1"),
    pytest.param(SPEC, CFG, Plan.grid(4, 1, 4, epoch=3), id="1x4"),
    pytest.param(SPEC, CFG, Plan.grid(4, 2, 3, epoch=3), id="2x3"),  # a ring that is not symmetric
    pytest.param(dataclasses.replace(SPEC, tied_head=True), dataclasses.replace(CFG, wire_dtype="bfloat16"),
                 Plan.grid(4, 2, 2, epoch=3), id="2x2-tied-bf16"),
    pytest.param(dataclasses.replace(SPEC, n_layer=5), dataclasses.replace(CFG, global_batch_seqs=14, micro_batches=3),
                 Plan.grid(5, 3, 2, weights=[1, 3, 1], epoch=3), id="3x2-uneven"),
]


@pytest.mark.parametrize("spec,cfg,plan", SHAPES)
def test_rules_accept_exactly_what_a_run_sends(corpus, spec, cfg, plan):
    check_rules(corpus, spec, cfg, plan)


# int8 links and CocktailSGD-style DP (a synchronisation every step), chosen per link
PER_LINK = CompressionConfig(pp_method="int8", dp_method="cocktail", dp_random_fraction=0.25, dp_topk_fraction=0.25,
                             dp_chunk_elems=256, outer_lr=1.0, outer_momentum=0.0, per_link=True)


@pytest.mark.parametrize("links", [
    LinkCodecs(((True, False, True),), (True, False)),  # an exact group beside a compressed one: a 2-part norm
    LinkCodecs(((False, True, False),), (True, True)),
    LinkCodecs(((False, False, False),), (False, False)),
], ids=["mixed-groups", "compressed-groups", "all-exact"])
def test_rules_follow_a_per_link_plan(corpus, links):
    check_rules(corpus, SPEC, CFG, dataclasses.replace(Plan.grid(4, 2, 3, epoch=3), links=links), PER_LINK)


def check_rules(corpus, spec, cfg, plan, comp=None):
    steps = 2
    states, log, peaks = run_recorded(spec, cfg, plan, corpus, steps, comp)
    rules = {p: MessageRules.for_peer(plan, spec, cfg, p, [t.shape for t in states[p].params.values()],
                                      compression=comp)
             for p in plan.peers}
    for src, dst, tag, dtype, shape in log:
        assert rules[dst].expect(src, tag) == (dtype, shape), (src, dst, tag)
        nbytes = TORCH_DTYPES[dtype].itemsize * torch.Size(shape).numel()
        assert nbytes <= rules[dst].max_message_bytes(src)
    for dst in plan.peers:  # nothing else: every message the rules name was sent, once
        for step in range(steps):
            sent = [((s, t), (dt, sh)) for s, d, t, dt, sh in log if d == dst and t.startswith(f"3.{step}/")]
            assert len(sent) == len(set(sent))
            assert dict(sent) == rules[dst].expected(step)
        assert rules[dst].neighbours == {s for s, d, *_ in log if d == dst}
        assert rules[dst].destinations == {d for s, d, *_ in log if s == dst}
        assert rules[dst].peers == rules[dst].neighbours | rules[dst].destinations
    for (src, dst), (msgs, nbytes) in peaks.items():  # what a peer sends in a row before it receives
        assert msgs <= rules[dst].burst(src)[0] and nbytes <= rules[dst].burst(src)[1], (src, dst)


def test_rule_sizes_for_a_two_by_two_plan():
    plan = Plan.grid(4, 2, 2, epoch=1)
    shapes = [(256, 32), (16, 32), (31,), (96, 32), (32, 32)]  # an odd number of elements in all
    cfg = dataclasses.replace(CFG, bucket_bytes=1 << 20)  # one bucket: each ring step carries half of it
    r = MessageRules.for_peer(plan, SPEC, cfg, "peer0.0", shapes)
    assert r.neighbours == r.destinations == {"peer0.1", "peer1.0"}
    act = 4 * 2 * 16 * 32  # 8 sequences per pipeline: 2 of (16, 32) floats per micro-batch
    assert r.max_message_bytes("peer0.1") == act
    assert r.burst("peer0.1") == (4 + 1, 4 * act + 8)  # the backward's gradients, then its norm
    total = sum(torch.Size(s).numel() for s in shapes)
    assert total % 2 == 1
    assert r.expect("peer1.0", "1.0/dp/rs0/b0") == ("float32", (total // 2,))  # chunk 1 of 2, the smaller
    assert r.expect("peer1.0", "1.0/dp/ag0/b0") == ("float32", (total // 2 + 1,))  # chunk 0
    assert r.burst("peer1.0") == (1, 4 * (total // 2 + 1))
    assert r.max_message_bytes("mallory") == 0 and r.burst("mallory") == (0, 0)


def _refusals():
    """Rules of the last stage of pipeline 0 in a 2 x 2 plan; two buckets in its ring."""
    return MessageRules.for_peer(Plan.grid(4, 2, 2, epoch=7), SPEC, CFG, "peer0.1", [(256, 32), (32,)])


REFUSED = [
    ("peer0.0", "6.0/act/0", "another epoch"),
    ("peer0.0", "8.0/act/0", "a later epoch"),
    ("peer0.0", "07.0/act/0", "leading zero in the epoch"),
    ("peer0.0", "7.00/act/0", "leading zero in the step"),
    ("peer0.0", "7.-1/act/0", "negative step"),
    ("peer0.0", "+7.0/act/0", "signed epoch"),
    ("peer0.0", "7.0/act/01", "leading zero in the micro-batch"),
    ("peer0.0", "7.0/act/4", "micro-batch out of range"),
    ("peer0.0", "7.0/act/", "no micro-batch"),
    ("peer0.0", "7.0/act/0 ", "trailing space"),
    ("peer0.0", "7.0/act/0/x", "trailing part"),
    ("peer0.0", "7.0//act/0", "empty part"),
    ("peer0.0", "7.0/act/\u0660", "non-ASCII digit"),
    ("peer0.0", "\u0667.0/act/0", "non-ASCII digit in the epoch"),
    ("peer0.0", "7.12345678901234567890/act/0", "step over 19 digits"),
    ("peer0.0", "7.0/grad/0", "a last stage receives no gradient"),
    ("peer1.0", "7.0/act/0", "activations from another pipeline"),
    ("peer0.0", "7.0/loss", "loss from a first stage"),
    ("peer0.1", "7.0/loss", "loss from itself"),
    ("peer1.0", "7.0/norm", "norm from another pipeline"),
    ("peer0.0", "7.0/tied", "no tied head in this model"),
    ("peer1.1", "7.0/dp/rs1/b0", "a two-member ring has one step"),
    ("peer1.1", "7.0/dp/xy0/b0", "unknown ring phase"),
    ("peer1.1", "7.0/dp/rs0/b9", "bucket out of range"),
    ("peer0.0", "7.0/dp/rs0/b0", "ring chunk from outside the DP group"),
    ("mallory", "7.0/norm", "a peer outside the plan"),
    ("peer0.0", "7.0/ACT/0", "case matters"),
    ("peer0.0", "7.0/act/0" + "0" * 100, "too long"),
    ("peer0.0", b"7.0/act/0", "bytes, not a string"),
    ("peer0.0", 7, "not a string"),
    ("peer0.0", None, "no tag"),
]


@pytest.mark.parametrize("src,tag,why", REFUSED, ids=[w for *_, w in REFUSED])
def test_refused_tags(src, tag, why):
    assert _refusals().expect(src, tag) is None


def test_accepted_counterparts_of_the_refusals():
    r = _refusals()
    assert r.expect("peer0.0", "7.0/act/0") == ("float32", (2, 16, 32))
    assert r.expect("peer0.0", "7.999999999999999999/act/3") == ("float32", (2, 16, 32))  # any step
    assert r.expect("peer1.1", "7.0/loss") == r.expect("peer0.0", "7.5/norm") == ("float64", (1,))
    assert r.expect("peer1.1", "7.0/dp/ag0/b1") == ("float32", (16,))
    assert r.expect("peer1.1", "7.0/dp/rs0/b0") == ("float32", (4096,))


def test_in_a_ring_of_three_a_peer_hears_from_one_member_and_sends_to_the_other():
    r = MessageRules.for_peer(Plan.grid(4, 2, 3), SPEC, CFG, "peer1.0", [(256, 32)])  # a first stage
    assert r.neighbours == {"peer1.1", "peer0.0"}  # its pipeline's next stage, the ring's previous member
    assert r.destinations == {"peer1.1", "peer2.0"}  # ... the ring's next member
    assert r.peers == {"peer1.1", "peer0.0", "peer2.0"}
    assert r.expect("peer0.0", "0.0/dp/rs1/b0") is not None and r.expect("peer2.0", "0.0/dp/rs0/b0") is None


def test_a_peer_outside_the_plan_has_no_rules():
    with pytest.raises(ValueError, match="no place"):
        MessageRules.for_peer(Plan.grid(4, 2, 1), SPEC, CFG, "mallory", [])
    with pytest.raises(ValueError, match="dtype"):
        MessageRules.for_peer(Plan.grid(4, 2, 1), SPEC, CFG, "peer0.0", [], param_dtype="complex64")


@pytest.mark.parametrize("tag, words", [
    ("1.42/loss", "the loss of step 43 (epoch 1)"),
    ("3.0/act/2", "the activations of micro-batch 2 of step 1 (epoch 3)"),
    ("3.7/grad/0", "the gradients of micro-batch 0 of step 8 (epoch 3)"),
    ("2.9/norm", "the gradient norm of step 10 (epoch 2)"),
    ("2.9/tied", "the tied embedding's gradient of step 10 (epoch 2)"),
    ("1.26/dp/rs1/b0", "the data-parallel gradient sync of step 27 (epoch 1)"),
    ("1.26/dpc", "the compressed data-parallel sync of step 27 (epoch 1)"),
    ("1.26/what", "'1.26/what'"),  # not a message of the plan: shown as it came
    ("x/loss", "'x/loss'"),
    (7, "7"),
])
def test_a_tag_reads_as_words_with_steps_counted_from_one(tag, words):
    # Operator review L5: "... while this peer waited for '1.42/loss'" is an internal tag
    from dtfm.train import describe_tag
    assert describe_tag(tag) == words
