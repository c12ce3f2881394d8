"""Daemons that train together: 8 real daemon processes on the emulated worldwide scenario,
handed an allocation by one of them, train `tiny` across processes over the encrypted peer
transport (bounded in time). A key holder outside the run cannot end a resumed run with a copy of
the operator's old stop.

The oracle is single-process training: every step's loss equals the reference within 1e-5,
whatever the S x D shape, and at the end every DP group's replicas hold identical weights; so
too across `train stop` and `train resume` (and `dtfm-peer export` of that run loads in
transformers with dtfm's logits; that run starts from a GPT-2 that transformers built and saved,
with training knobs given as flags and in a run-spec file), and when both holders of a stage are
lost before the first checkpoint (it rolls back to the initial weights). A SIGKILLed training
peer makes every other daemon stop its step, say why, and keep answering. (The swarm healing
from a killed coordinator, a frozen peer, a cut link and an outsider's attacks:
tests/swarm/test_swarm_heal.py, on a swarm of its own.)
"""

import json
import time
from pathlib import Path

import pytest
import trio
from hf_models import save_gpt2
from polling import wait_for
from swarms import ReferenceLosses, check_log, coordinator, run_ended, swarm_up, trainings, wait_steps

from dtfm.control import ControlMsg
from dtfm.net import Identity, Transport, TransportConfig, load_swarm_key
from dtfm.swarm import cli as swarm
from dtfm.swarm.proc import peer_request, peer_status
from dtfm.swarm.state import load_state
from dtfm.swarm.train import operator_op, read_log, stop_training
from dtfm.train import PRESETS, TrainConfig

TINY = PRESETS["tiny"]

N_PEERS = 8
STEPS = 4


# The run started from a Hugging Face folder, and its training knobs (float32 on the wire: the
# 1e-5 oracle).
HF_KNOBS = TrainConfig(seed=0, lr=3e-3, warmup_steps=2, global_batch_seqs=16, micro_batches=2, weight_decay=0.05,
                       grad_clip_norm=0.5)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A small GPT-2 built and saved by transformers (its own initialisation; nothing downloaded)."""
    return save_gpt2(tmp_path_factory.mktemp("hf") / "gpt2-small-test", n_positions=64, n_embd=64)


@pytest.fixture(scope="module")
def run_dir(hf_model):
    with swarm_up("dtfm-tr-", peers=N_PEERS, extra=("--model-dir", str(hf_model))) as d:
        yield d


@pytest.fixture(scope="module")
def reference_run():
    """Single-process training of STEPS steps, the oracle: the losses and the model after them."""
    from dtfm.train import TrainConfig, get_preset, load_corpus, reference_state, reference_step

    state, corpus = reference_state(get_preset("tiny"), TrainConfig(seed=0)), load_corpus()
    return [reference_step(state, corpus) for _ in range(STEPS)], state


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages, dp", [(4, 2)])  # (2 x 4: stopped and resumed, below)
def test_swarm_trains_like_one_process(run_dir, reference, stages, dp):
    assert swarm.main(["train", "--run-dir", str(run_dir), "--stages", str(stages), "--dp", str(dp),
                       "--steps", str(STEPS)]) == 0
    assert swarm.main(["wait", "--run-dir", str(run_dir), "--step", str(STEPS), "--timeout", "300"]) == 0
    rows = read_log(run_dir / "train.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    for row, ref in zip(rows, reference):
        assert row["loss"] == pytest.approx(ref, abs=1e-5)
        assert row["epoch"] == rows[0]["epoch"] and row["iteration_s"] > 0 and row["tokens_per_s"] > 0
    state = load_state(run_dir)
    ends = wait_for("every peer to finish",
                    lambda: (t := trainings(state)) and all("last_end" in v for v in t.values()) and t,
                    60, interval_s=0.5)
    groups: dict[int, set[str]] = {}
    for v in ends.values():
        assert v["last_end"]["failed"] is False and v["last_end"]["completed"] == STEPS - 1
        assert (v["stages"], v["dp"]) == (stages, dp)
        groups.setdefault(v["stage"], set()).add(v["last_end"]["params_sha256"])
    assert sorted(groups) == list(range(stages))
    assert all(len(hashes) == 1 for hashes in groups.values()), groups


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    """Single-process training of the Hugging Face model with HF_KNOBS: the losses and the model."""
    import torch

    from dtfm.train import load_corpus, load_hf, reference_state, reference_step

    spec, params = load_hf(hf_model)
    state = reference_state(spec, HF_KNOBS)
    with torch.no_grad():
        for n, p in state.params.items():
            p.copy_(params[n])
    corpus = load_corpus()
    return [reference_step(state, corpus) for _ in range(STEPS)], state


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_run_resumes_like_one_process_and_its_export_loads_in_transformers(run_dir, hf_model, hf_reference,
                                                                                  tmp_path):
    """2 x 4 of a GPT-2 that transformers built and saved (`--init-from`; every daemon holds the
    folder, `join --model-dir`), with training knobs as flags and in a run spec (`--spec`), and
    `train stop` after the first step: every peer checkpoints its stage where the run ends;
    `dtfm-peer train resume` continues the run (a new epoch of the same run) and every step's
    loss is the single-process reference's (the folder's weights, the same knobs), every DP
    group's replicas hold identical weights at the end; `dtfm-peer export` on another peer
    gathers the model from the peers into one folder that transformers loads with the logits of
    dtfm's forward of the same weights (1e-5), which are the reference's after the run's steps."""
    import torch
    from transformers import GPT2LMHeadModel

    from dtfm.peer import cli as peer_cli
    from dtfm.train import GPTStage, load_hf

    spec_file = tmp_path / "run.toml"
    spec_file.write_text(f"steps = {STEPS}\nlr = {HF_KNOBS.lr!r}\nwarmup_steps = {HF_KNOBS.warmup_steps}\n"
                         f"micro_batches = {HF_KNOBS.micro_batches}\nweight_decay = {HF_KNOBS.weight_decay!r}\n"
                         "batch = 999\n")  # (the flag wins)
    assert swarm.main(["train", "--run-dir", str(run_dir), "--spec", str(spec_file), "--init-from", str(hf_model),
                       "--stages", "2", "--dp", "4", "--checkpoint-every", "0", "--batch",
                       str(HF_KNOBS.global_batch_seqs), "--grad-clip", str(HF_KNOBS.grad_clip_norm)]) == 0
    allocation = json.loads((run_dir / "run.json").read_text())["allocation"]
    # the knobs asked for, and the pipeline schedule the coordinator fitted (any: the same bits)
    warmups = allocation["train"].pop("pipeline_warmups", "")
    assert allocation["train"] == {k: v for k, v in HF_KNOBS.to_dict().items() if k != "pipeline_warmups"}
    assert allocation["model"].startswith("hf-")
    TrainConfig(micro_batches=2, pipeline_warmups=warmups).warmups(2)  # (one count per stage, or GPipe's "")
    assert swarm.main(["wait", "--run-dir", str(run_dir), "--step", "1", "--timeout", "300"]) == 0
    state = load_state(run_dir)
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    stop = operator_op(run_dir, state.peers[0], "stop")  # (as `stop_training`, keeping the signed stop)
    at = peer_request(state.peers[0], "train_stop", {"op": stop.to_wire()}, timeout_s=30.0)["at_step"]
    assert 0 < at < STEPS
    ends = wait_for("every peer to stop", lambda: (t := trainings(state)) and all(
        v.get("last_end", {}).get("reason") == "stopped" for v in t.values()) and t, 60, interval_s=0.5)
    saved = [p for p in state.peers if ends[p.name].get("stage") is not None]
    assert len(saved) == N_PEERS and all(
        list(Path(p.data_dir, "checkpoints", run_id).glob(f"stage-*/step-{at:08d}.json")) for p in saved)
    assert peer_cli.main(["train", "resume", run_id[:8], "--data-dir", state.peers[1].data_dir]) == 0
    # Review 2026-11-28, N4: a fresh identity with the swarm key replays the operator's old stop
    # (every peer of the run received its bytes) to the coordinator: refused, the run goes on.
    name, _ = wait_for("a coordinator", lambda: coordinator(state), 30, interval_s=0.5)
    c_peer = next(p for p in state.peers if p.name == name)
    answer = trio.run(_replay_stop, c_peer, load_swarm_key(run_dir / "swarm.key"), stop)
    assert "sign a new one" in answer.get("error", ""), answer
    assert swarm.main(["wait", "--run-dir", str(run_dir), "--step", str(STEPS), "--timeout", "300"]) == 0
    losses, ref = hf_reference
    check_log(run_dir, losses)
    ends = wait_for("every peer to finish", lambda: (t := trainings(state)) and all(
        v.get("last_end", {}).get("reason") == "finished" for v in t.values()) and t, 60, interval_s=0.5)
    groups: dict[int, set[str]] = {}
    for v in ends.values():
        assert v["last_end"]["completed"] == STEPS - 1 and (v["stages"], v["dp"]) == (2, 4)
        groups.setdefault(v["stage"], set()).add(v["last_end"]["params_sha256"])
    assert sorted(groups) == [0, 1] and all(len(h) == 1 for h in groups.values()), groups  # replicas agree
    out = tmp_path / "model"
    assert peer_cli.main(["export", "--data-dir", state.peers[2].data_dir, "--out", str(out)]) == 0
    spec, params = load_hf(out)
    x = torch.arange(64).reshape(2, 32) % spec.vocab
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    mine = GPTStage(spec, (0, spec.n_layer), seed=0)
    mine.load_state_dict(params)
    with torch.no_grad():
        assert (hf(x).logits - mine.eval()(x)).abs().max() < 1e-5
    for name, p in ref.params.items():  # (a DP of 4 sums the batch in another order than one process)
        assert torch.allclose(params[name], p.detach(), atol=1e-5, rtol=1e-4), name


async def _replay_stop(peer, key: bytes, stop) -> dict:
    """A fresh identity, never a member, sends `peer` a TRAIN_OP carrying a copy of `stop`."""
    me = Identity.generate()
    transport = Transport(me, key, TransportConfig.test())
    async with trio.open_nursery() as nursery:
        await nursery.start(transport.run)
        with trio.fail_after(30):
            conn = await transport.connect("127.0.0.1", peer.port, peer_id=bytes.fromhex(peer.peer_id))
            answer, _ = await conn.request(ControlMsg.TRAIN_OP, {"op": "stop", "signed": stop.to_wire()})
        await transport.aclose()
    return answer


# int8 activations and CocktailSGD-style DP, each link and DP group chosen by the coordinator's
# scheduler on the measured view (the run's codec where it pays, else exact)
COMPRESS = "cocktail,pp_method=int8,per_link=True"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compressed_run_survives_a_killed_peer_with_identical_replicas(run_dir):
    """A per-link run with int8 activations and CocktailSGD-style DP (`--compress
    cocktail,pp_method=int8,per_link=true`): 2 stages x 3 pipelines and two spares; the
    coordinator chooses which links and DP groups compress and says so in its start event and in
    every peer's status. A training peer is SIGKILLed: the run goes on in a new epoch (each
    survivor keeps its own replica, error-feedback residual included; a peer new to a stage would
    fetch one), every step is logged once with the bytes sent per axis (the int8 payloads of the
    compressed links below float32), and at the end every stage's DP replicas hold identical
    weights, exact groups and compressed ones. The peer killed is the coordinator (a training
    peer or a spare, as the scheduler placed it): a new one is elected in a higher term and the
    run goes on in a new epoch. The killed peer is restarted with its data dir for the next
    test."""
    state = load_state(run_dir)
    assert swarm.main(["train", "--run-dir", str(run_dir), "--stages", "2", "--dp", "3", "--steps", "400",
                       "--compress", COMPRESS]) == 0
    assert swarm.main(["wait", "--run-dir", str(run_dir), "--step", "2", "--timeout", "120"]) == 0
    t = trainings(state)
    assert {v.get("compression") for v in t.values()} == {COMPRESS}, t
    assert all(" links int8/64" in v.get("compression_details", "") for v in t.values() if "stage" in v), t
    notes = [e["compress_links"] for f in sorted(run_dir.glob("p*/events.jsonl")) for e in read_log(f)
             if e.get("event") == "start" and "compress_links" in e]
    assert notes and notes[-1].startswith("links compressed: "), notes
    print(f"per-link choice at the start: {notes[-1]}")
    # the victim is the coordinator: a new one is elected in a higher term and takes the run on
    name, before = coordinator(state)
    victim = next(p for p in state.peers if p.name == name)
    place = f"stage {t[name]['stage']}" if t.get(name, {}).get("stage") is not None else "a spare"
    killed_at = time.monotonic()
    assert swarm.main(["kill", victim.name, "--run-dir", str(run_dir)]) == 0
    wait_steps(run_dir, 2)
    recovered_s = time.monotonic() - killed_at
    t = trainings(state)
    assert max(v.get("epoch", 0) for v in t.values()) > before["epoch"]
    new_name, after = wait_for("a new coordinator", lambda: coordinator(state), 30, interval_s=0.5)
    assert new_name != name and after["term"] > before["term"]
    stop_training(run_dir, next(p for p in state.peers if p.name == coordinator(state)[0]))

    ended = wait_for("every peer to end", lambda: run_ended(state), 60, interval_s=0.5)
    groups: dict[int, set[str]] = {}
    for v in ended.values():
        groups.setdefault(v["stage"], set()).add(v["last_end"]["params_sha256"])
    assert sorted(groups) == [0, 1] and all(len(h) == 1 for h in groups.values()), groups
    swarm.main(["wait", "--run-dir", str(run_dir), "--step", "1", "--timeout", "10"])
    rows = read_log(run_dir / "train.jsonl")
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= 4
    cfg = TrainConfig()
    fp32 = cfg.global_batch_seqs * TINY.seq_len * TINY.n_embd * 4  # one stage boundary, every pipeline
    # (a step the victim died in may miss its report; a back-filled line holds only the reports kept)
    full = [r for r in rows if not r.get("partial") and not r.get("backfilled")]
    assert len(full) >= 3
    for r in full:
        sent = r.get("bytes_sent")
        assert r["loss"] == r["loss"] and sent, r
        assert 0 < sent["pp_fwd"] == sent["pp_bwd"] <= fp32 and sent["dp"] > 0, r
    if not notes[-1].startswith("links compressed: none"):  # a coded link sends int8 payloads
        assert min(r["bytes_sent"]["pp_fwd"] for r in full) < fp32
    fetched = sum(v.get("fetched_bytes", 0) for v in ended.values())
    print(f"compressed run, coordinator {name} killed ({place}): training again after {recovered_s:.1f} s, {fetched} bytes fetched; "
          f"shape {ended[next(iter(ended))]['stages']} x {ended[next(iter(ended))]['dp']}; "
          f"bytes per step {rows[-1]['bytes_sent']}")

    t0 = time.monotonic()
    assert swarm.main(["restart", victim.name, "--run-dir", str(run_dir)]) == 0
    state = load_state(run_dir)
    wait_for("gossip to count every peer live again", lambda: all(
        (v := ((peer_status(p) or {}).get("gossip") or {}).get("view", {})).get("peer_count") == len(state.peers)
        and v.get("complete") for p in state.peers), 60, interval_s=0.5)
    print(f"the swarm whole again {time.monotonic() - t0:.1f} s after the restart")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_stage_lost_before_the_first_checkpoint_rolls_back_to_the_initial_weights(run_dir):
    """4 x 2 with a checkpoint every 50 steps: both holders of one stage are SIGKILLed after step
    2, before any checkpoint, then restarted with their data dirs. Step 0 is a checkpoint every
    peer of the run rebuilds from the seed: the swarm rolls back to it (a `rollback` event with
    `restored_from` "initial" and the steps lost) and goes on; the merged log has every step
    once with single-process training's loss (1e-5), and every stage's replicas end identical."""
    reference = ReferenceLosses()
    state = load_state(run_dir)
    assert swarm.main(["train", "--run-dir", str(run_dir), "--stages", "4", "--dp", "2", "--steps", "400",
                       "--checkpoint-every", "50"]) == 0
    assert swarm.main(["wait", "--run-dir", str(run_dir), "--step", "2", "--timeout", "120"]) == 0
    def placed():
        # (a snapshot of one epoch with both holders of every stage: under load a peer may have
        # just lost sight of the coordinator, and the swarm reconfigures around it first)
        c = coordinator(state)
        if c is None:
            return None
        name, t = c[0], trainings(state)
        epoch = max((v.get("epoch") or 0 for v in t.values()), default=0)
        holders = {s: sorted(n for n, v in t.items() if v.get("stage") == s and v.get("epoch") == epoch)
                   for s in range(4)}
        return (name, t, holders) if all(len(h) == 2 for h in holders.values()) else None

    name, t, holders = wait_for("both holders of every stage in one epoch", placed, 60, interval_s=0.5)
    run_id = t[name]["run_id"]
    stage = next(s for s in range(4) if name not in holders[s])
    victims = holders[stage]
    for v in victims:
        assert swarm.main(["kill", v, "--run-dir", str(run_dir)]) == 0
    for v in victims:
        assert swarm.main(["restart", v, "--run-dir", str(run_dir)]) == 0

    def rolled_back():
        return [e for f in sorted(run_dir.glob("p*/events.jsonl")) for e in read_log(f)
                if e.get("event") == "rollback" and e.get("run") == run_id and e.get("restored_from") == "initial"]
    [event, *_] = wait_for("a rollback to the initial weights", rolled_back, 240, interval_s=0.5)
    assert event["resume_step"] == 0 and event["steps_lost"] >= 2, event
    wait_steps(run_dir, 3)
    state = load_state(run_dir)
    stop_training(run_dir, next(p for p in state.peers if p.name == coordinator(state)[0]))

    ended = wait_for("every peer to end", lambda: run_ended(state), 60, interval_s=0.5)
    groups: dict[int, set[str]] = {}
    for v in ended.values():
        groups.setdefault(v["stage"], set()).add(v["last_end"]["params_sha256"])
    assert all(len(h) == 1 for h in groups.values()), groups
    swarm.main(["wait", "--run-dir", str(run_dir), "--step", "1", "--timeout", "10"])
    rows = check_log(run_dir, reference)
    assert len(rows) >= 3
    print(f"both holders of stage {stage} lost at step 2: rolled back to step 0 ({event['steps_lost']} steps "
          f"lost), {len(rows)} steps logged")
