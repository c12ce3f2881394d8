"""The data plane (control/dataplane/): TransportComm's training steps between real transports
on loopback, hostile tensors, lost neighbours and back-pressure."""

from __future__ import annotations

import dataclasses
import logging
import math
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from dtfm.control import ControlMsg
from dtfm.control.dataplane import ENTRY_OVERHEAD_BYTES, CommConfig, TensorRouter, TransportComm
from dtfm.net import ConnectionClosed, Identity, Transport, TransportConfig, short_id
from dtfm.train import (
    PRESETS,
    TEST_CONFIG,
    CommClosed,
    CommError,
    CommTimeout,
    LocalCluster,
    MessageRules,
    Plan,
    StageState,
    activation_payload_bytes,
    load_corpus,
    parse_compression,
    run_step,
    split_batch,
)
from dtfm.control import params_sha256

KEY = bytes(range(32))
RUN = bytes(16)
EPOCH = 2
TINY = PRESETS["tiny"]
ACT = (2, TINY.seq_len, TINY.n_embd)  # one micro-batch of TEST_CONFIG in a single pipeline


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=256 << 10)


@dataclasses.dataclass
class Node:
    transport: Transport
    router: TensorRouter
    addr: tuple[str, int] = ("", 0)

    @property
    def id(self) -> bytes:
        return self.transport.peer_id


@asynccontextmanager
async def swarm(n: int):
    """`n` transports listening on loopback, each with its tensor router."""
    nodes = []
    for _ in range(n):
        t = Transport(Identity.generate(), KEY, TransportConfig.test())
        nodes.append(Node(t, TensorRouter(t)))
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.addr = await nursery.start(node.transport.serve, "127.0.0.1", 0)
        try:
            yield nursery, nodes
        finally:
            with trio.move_on_after(5):
                for node in nodes:
                    await node.transport.aclose()
            nursery.cancel_scope.cancel()


def id_plan(names: Plan, nodes: list[Node]) -> Plan:
    """`names` (a Plan.grid) with the nodes' peer ids in place of the names, pipeline by pipeline."""
    it = iter(node.id for node in nodes)
    return Plan(tuple(tuple(next(it) for _ in p) for p in names.pipelines), names.layer_ranges, EPOCH)


def param_shapes(state: StageState) -> list:
    return [p.shape for p in state.params.values()]


async def start_comms(nursery, nodes, plan, spec, cfg, states, config=None,
                      compression=None) -> dict[bytes, TransportComm]:
    """A running, connected TransportComm per peer of `plan`."""
    rules = {p: MessageRules.for_peer(plan, spec, cfg, p, param_shapes(states[p]), compression=compression)
             for p in plan.peers}
    by_id = {node.id: node for node in nodes}
    comms = {}
    for p in plan.peers:
        comms[p] = TransportComm(by_id[p].transport, rules[p], run=RUN, router=by_id[p].router,
                                 config=config or CommConfig.test())
        await nursery.start(comms[p].run)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            for p in plan.peers:
                n.start_soon(comms[p].connect, {q: by_id[q].addr for q in rules[p].peers}, 5.0)
    return comms


def one_thread_step(*args):
    torch.set_num_threads(1)  # as LocalCluster's workers: the same reduction order, the same bits
    return run_step(*args)


async def run_steps(plan, states, comms, corpus, steps: int) -> list[float]:
    """`steps` training steps, one worker thread per peer; the global losses."""
    async def work(p, results):
        try:
            results[p] = await trio.to_thread.run_sync(one_thread_step, states[p], plan, p, comms[p], corpus)
        except BaseException:
            for c in comms.values():
                c.abort("a worker failed")
            raise

    losses = []
    for _ in range(steps):
        results: dict = {}
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for p in plan.peers:
                    n.start_soon(work, p, results)
        step_losses = {r.loss for r in results.values() if r.loss is not None}
        assert len(step_losses) == 1
        losses.append(step_losses.pop())
    return losses


def assert_equals_local(spec, cfg, names: Plan, plan: Plan, states, losses, corpus, compression=None):
    """Losses and every parameter equal a LocalCluster run of the same plan, within 1e-6."""
    with LocalCluster(spec, cfg, names, corpus, compression=compression) as cl:
        want = cl.run(len(losses))
        for got, w in zip(losses, want):
            assert abs(got - w) <= 1e-6 * abs(w), (losses, want)
        for d, pipe in enumerate(plan.pipelines):
            for s, p in enumerate(pipe):
                ref = cl.states[names.pipelines[d][s]].params
                for n, t in states[p].params.items():
                    assert float((t.detach() - ref[n].detach()).abs().max()) <= 1e-6, n


def act_body(tag: str, seq: int, **changes) -> dict:
    body = {"run": RUN, "epoch": EPOCH, "seq": seq, "tag": tag, "dtype": "float32", "shape": list(ACT)}
    body.update(changes)
    return body


def act_payload(nbytes: int = 4 * ACT[0] * ACT[1] * ACT[2]) -> bytes:
    return bytes(nbytes)


# ---- (a) training between transports equals the in-process run -----------------------------


@pytest.mark.parametrize("stages,dp", [(2, 1), (2, 2)])
async def test_steps_over_transports_equal_local_cluster(corpus, stages, dp):
    names = Plan.grid(TINY.n_layer, stages, dp)
    async with swarm(stages * dp) as (nursery, nodes):
        plan = id_plan(names, nodes)
        states = {p: StageState(TINY, TEST_CONFIG, plan.layer_ranges[plan.position(p)[1]]) for p in plan.peers}
        comms = await start_comms(nursery, nodes, plan, TINY, TEST_CONFIG, states)
        losses = await run_steps(plan, states, comms, corpus, 2)
        for comm in comms.values():
            for q in comm.rules.neighbours:
                st = comm.stats(q)
                assert st["buffered_bytes"] == 0 and st["peak_buffered_bytes"] <= st["buffer_limit_bytes"]
            comm.close()
    assert_equals_local(TINY, TEST_CONFIG, names, plan, states, losses, corpus)


# ---- (b) hostile input is refused, the honest run goes on -----------------------------------


async def test_hostile_tensors_are_refused_and_the_run_goes_on(corpus, caplog):
    caplog.set_level(logging.DEBUG, logger="dtfm.control.dataplane")
    names = Plan.grid(TINY.n_layer, 2, 1)
    async with swarm(3) as (nursery, nodes):
        plan = id_plan(names, nodes[:2])
        a, b, mallory = nodes
        states = {p: StageState(TINY, TEST_CONFIG, plan.layer_ranges[plan.position(p)[1]]) for p in plan.peers}
        comms = await start_comms(nursery, nodes, plan, TINY, TEST_CONFIG, states)
        losses = await run_steps(plan, states, comms, corpus, 1)

        to_b = a.transport.connection(b.id)  # the honest neighbour's own connection
        tag = f"{EPOCH}.1/act/0"
        cases = [
            (to_b, act_body(f"{EPOCH + 1}.1/act/0", 5, epoch=EPOCH + 1), act_payload(), "epoch 3, this peer is in"),
            (to_b, act_body(tag, 5, run=b"x" * 16), act_payload(), "run 78787878"),
            (to_b, act_body(f"{EPOCH + 1}.1/act/0", 5), act_payload(), "not a tag"),
            (to_b, act_body(f"{EPOCH}.1/grad/0", 5), act_payload(), "not a tag"),
            (to_b, act_body(f"{EPOCH}.1/act/9", 5), act_payload(), "not a tag"),
            (to_b, act_body(tag, 5, shape=[4, TINY.seq_len, TINY.n_embd]), act_payload(2 * len(act_payload())),
             "shape [4, 128, 128]"),
            (to_b, act_body(tag, 5, dtype="float16"), act_payload(len(act_payload()) // 2), "dtype 'float16'"),
            (to_b, act_body(tag, 5), act_payload(len(act_payload()) + 4), "header says"),
            (to_b, act_body(tag, 0), act_payload(), "duplicate sequence number 0"),
            (to_b, act_body(tag, 10**6), act_payload(), "outside the window"),
        ]
        with trio.fail_after(10):
            m_conn = await mallory.transport.connect(*b.addr)
            cases.append((m_conn, act_body(tag, 5), act_payload(), "not a neighbour"))
            for conn, body, payload, why in cases:
                reply, _ = await conn.request(ControlMsg.TENSOR, body, payload=payload)
                assert reply["ok"] is False and why in reply["why"], (why, reply)
                sender = short_id(mallory.id if conn is m_conn else a.id)
                assert any(sender in r.getMessage() and why in r.getMessage() for r in caplog.records), why
            with pytest.raises(ConnectionClosed):  # a malformed body closes the sender's connection
                await m_conn.request(ControlMsg.TENSOR, {"run": RUN}, payload=act_payload())
        assert a.transport.connection(b.id) is to_b and not to_b.closed
        losses += await run_steps(plan, states, comms, corpus, 1)
        for comm in comms.values():
            comm.close()
    assert_equals_local(TINY, TEST_CONFIG, names, plan, states, losses, corpus)


async def test_compressed_payloads_of_the_plan_pass_and_hostile_ones_are_refused(corpus, caplog):
    # int8 activations and CocktailSGD-style DP over real transports: the receiver expects each
    # payload's exact size from the plan and the run's compression (never from the payload), the
    # DP replicas stay bit-identical, and a payload of another size or dtype, an oversized one,
    # or a DP payload from a peer outside the group is refused while the run goes on.
    caplog.set_level(logging.DEBUG, logger="dtfm.control.dataplane")
    comp = parse_compression("cocktail,pp_method=int8")
    names = Plan.grid(TINY.n_layer, 2, 2)
    async with swarm(4) as (nursery, nodes):
        plan = id_plan(names, nodes)
        (a, b), (c, d) = [[next(n for n in nodes if n.id == p) for p in pipe] for pipe in plan.pipelines]
        states = {p: StageState(TINY, TEST_CONFIG, plan.layer_ranges[plan.position(p)[1]], compression=comp)
                  for p in plan.peers}
        comms = await start_comms(nursery, nodes, plan, TINY, TEST_CONFIG, states, compression=comp)
        losses = await run_steps(plan, states, comms, corpus, 1)

        rules = comms[b.id].rules
        act_tag, dpc_tag = f"{EPOCH}.1/act/0", f"{EPOCH}.1/dpc"
        act = rules.expect(a.id, act_tag)
        dpc = rules.expect(d.id, dpc_tag)
        n_act, n_dpc = act[1][0], dpc[1][0]
        assert act[0] == dpc[0] == "uint8" and n_act == activation_payload_bytes(rules_shape(b, plan), comp)
        assert n_dpc == states[b.id].compress.payload_bytes() < 4 * sum(p.numel() for p in states[b.id].params.values())

        def body(tag, dtype, shape):
            return {"run": RUN, "epoch": EPOCH, "seq": 5, "tag": tag, "dtype": dtype, "shape": list(shape)}

        from_a, from_d = a.transport.connection(b.id), d.transport.connection(b.id)
        cases = [
            (from_a, body(act_tag, "uint8", [n_act + 1]), bytes(n_act + 1), f"shape [{n_act + 1}]"),
            (from_a, body(act_tag, "uint8", [n_act - 1]), bytes(n_act - 1), f"shape [{n_act - 1}]"),
            (from_a, body(act_tag, "float32", rules_shape(b, plan)), bytes(4 * math.prod(rules_shape(b, plan))),
             "dtype 'float32', the tag carries uint8"),
            (from_a, body(act_tag, "uint8", [n_act]), bytes(2 * n_act), "header says"),  # oversized payload
            (from_d, body(dpc_tag, "uint8", [n_dpc * 4]), bytes(n_dpc * 4), f"shape [{n_dpc * 4}]"),
            (from_d, body(dpc_tag, "float32", [n_dpc // 4]), bytes(n_dpc // 4 * 4), "dtype 'float32'"),
            (from_d, body(dpc_tag, "uint8", [n_dpc]), bytes(n_dpc + 1), "header says"),
            (from_a, body(dpc_tag, "uint8", [n_dpc]), bytes(n_dpc), "not a tag"),  # a is not in b's DP group
            (from_d, body(f"{EPOCH}.1/dp/rs0/b0", "float32", [8]), bytes(32), "not a tag"),  # no exact ring here
        ]
        with trio.fail_after(10):
            for conn, msg, payload, why in cases:
                reply, _ = await conn.request(ControlMsg.TENSOR, msg, payload=payload)
                assert reply["ok"] is False and why in reply["why"], (why, reply)
                sender = short_id(a.id if conn is from_a else d.id)
                assert any(sender in r.getMessage() and why in r.getMessage() for r in caplog.records), why
        losses += await run_steps(plan, states, comms, corpus, 1)
        for comm in comms.values():
            comm.close()
    for s in range(plan.stages):  # every synchronisation gave both replicas the same bits
        assert len({params_sha256(states[pipe[s]]) for pipe in plan.pipelines}) == 1
    assert_equals_local(TINY, TEST_CONFIG, names, plan, states, losses, corpus, compression=comp)


def rules_shape(node: Node, plan: Plan) -> tuple[int, int, int]:
    """The activation shape of micro-batch 0 of `node`'s pipeline."""
    d, _ = plan.position(node.id)
    return (len(split_batch(TEST_CONFIG.global_batch_seqs, plan.dp, TEST_CONFIG.micro_batches)[d][0]),
            TINY.seq_len, TINY.n_embd)


# ---- (c) a lost neighbour fails the waiting worker at once ----------------------------------


@pytest.mark.parametrize("how", ["transport closes", "fail()"])
async def test_lost_neighbour_fails_the_waiting_recv_at_once(corpus, how):
    names = Plan.grid(TINY.n_layer, 2, 1)
    async with swarm(2) as (nursery, nodes):
        plan = id_plan(names, nodes)
        a, b = nodes
        states = {p: StageState(TINY, TEST_CONFIG, plan.layer_ranges[plan.position(p)[1]]) for p in plan.peers}
        comms = await start_comms(nursery, nodes, plan, TINY, TEST_CONFIG, states)
        failed: list = []

        async def worker_b():
            try:
                await trio.to_thread.run_sync(run_step, states[b.id], plan, b.id, comms[b.id], corpus)
            except CommError as e:
                failed.append((e, trio.current_time()))

        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                n.start_soon(worker_b)
                # a's stage sends its first activation only, then goes away mid-step
                h = comms[a.id].isend(b.id, f"{EPOCH}.0/act/0", torch.ones(ACT))
                await trio.to_thread.run_sync(h.wait, 5.0)
                t0 = trio.current_time()
                if how == "fail()":
                    comms[b.id].fail(a.id, "declared dead by gossip")
                else:
                    await a.transport.aclose()
        (err, t1), = failed
        assert t1 - t0 < 1.0 < TEST_CONFIG.comm_timeout_s
        assert short_id(a.id) in str(err) and not isinstance(err, CommTimeout)
        assert ("declared dead by gossip" if how == "fail()" else "connection lost") in str(err)
        if how == "fail()":  # and b refuses what a still sends
            late = comms[a.id].isend(b.id, f"{EPOCH}.0/act/1", torch.ones(ACT))
            with pytest.raises(CommError, match="no longer receiving"):
                await trio.to_thread.run_sync(late.wait, 5.0)
        for comm in comms.values():
            comm.close()


async def test_close_wakes_waiters_with_comm_closed(corpus):
    async with swarm(2) as (nursery, nodes):
        plan = id_plan(Plan.grid(TINY.n_layer, 2, 1), nodes)
        a, b = nodes
        states = {p: StageState(TINY, TEST_CONFIG, plan.layer_ranges[plan.position(p)[1]]) for p in plan.peers}
        comms = await start_comms(nursery, nodes, plan, TINY, TEST_CONFIG, states)
        got: list = []

        def wait_for_act():
            try:
                comms[b.id].recv(a.id, f"{EPOCH}.0/act/0", 30.0)
            except CommError as e:
                got.append(e)

        with trio.fail_after(5):  # whether the thread waits already or not, it meets CommClosed
            async with trio.open_nursery() as n:
                n.start_soon(trio.to_thread.run_sync, wait_for_act)
                comms[b.id].abort("the epoch ended")
        assert isinstance(got[0], CommClosed) and "the epoch ended" in str(got[0])
        with pytest.raises(CommClosed):
            comms[b.id].isend(a.id, f"{EPOCH}.0/grad/0", torch.ones(ACT))
        with pytest.raises(CommError, match="the plan has no message"):
            comms[a.id].recv(b.id, f"{EPOCH}.0/act/0", 1.0)  # a is the first stage: nothing comes from b
        comms[a.id].close()


async def test_connect_dials_when_the_smaller_peer_does_not_and_names_the_unreachable():
    async with swarm(2) as (nursery, nodes):
        small, large = sorted(nodes, key=lambda node: node.id)
        plan = Plan(((small.id, large.id),), ((0, 2), (2, 4)), EPOCH)
        rules = MessageRules.for_peer(plan, TINY, TEST_CONFIG, large.id, [])
        comm = TransportComm(large.transport, rules, run=RUN, router=large.router, config=CommConfig.test())
        await nursery.start(comm.run)
        t0 = trio.current_time()
        await comm.connect({small.id: small.addr}, 1.0)  # the smaller peer never dials: after 0.5 s, it does
        assert 0.5 <= trio.current_time() - t0 < 1.0 and large.transport.connection(small.id) is not None
        with pytest.raises(CommError, match=short_id(bytes(32))):
            await comm.connect({bytes(32): ("127.0.0.1", 1)}, 1.0)  # nobody listens there
        comm.close()


# ---- (d) back-pressure -----------------------------------------------------------------------


async def test_sender_blocks_at_the_window_and_the_buffer_stays_bounded(corpus):
    cfg = dataclasses.replace(TEST_CONFIG, micro_batches=8)  # 8 activations of one sequence each
    one = 4 * TINY.seq_len * TINY.n_embd + ENTRY_OVERHEAD_BYTES
    config = dataclasses.replace(CommConfig.test(), window_messages=2, max_buffer_bytes=3 * one)
    async with swarm(2) as (nursery, nodes):
        plan = id_plan(Plan.grid(TINY.n_layer, 2, 1), nodes)
        a, b = nodes
        states = {p: StageState(TINY, cfg, plan.layer_ranges[plan.position(p)[1]]) for p in plan.peers}
        comms = await start_comms(nursery, nodes, plan, TINY, cfg, states, config)
        sender, receiver = comms[a.id], comms[b.id]
        assert receiver.stats(a.id)["buffer_limit_bytes"] == 3 * one
        tag = f"{EPOCH}.0/act/0"
        x = torch.empty(1, TINY.seq_len, TINY.n_embd)
        handles = []
        for i in range(16):  # one tensor reused: each isend copies it
            x.fill_(i)
            handles.append(sender.isend(b.id, tag, x))
        # The receiver consumes nothing: it settles with 3 buffered, 2 sent and unacknowledged (in
        # its handlers) and the other 11 queued at the sender, never more in flight.
        def settled():
            st = sender.stats(b.id)
            return (receiver.stats(a.id)["buffered_bytes"], st["unacked_messages"], st["queued_messages"])
        with trio.fail_after(5):
            while settled() != (3 * one, 2, 11):
                await trio.sleep(0.01)
        assert sender.stats(b.id)["peak_unacked_messages"] == 2
        for h in handles[:3]:
            h.wait(0)  # acknowledged: buffered at the receiver
        for h in handles[3:]:
            with pytest.raises(CommTimeout):
                h.wait(0)
        assert receiver.stats(a.id)["peak_buffered_bytes"] == 3 * one

        def drain():
            return [float(receiver.recv(a.id, tag, 5.0)[0, 0, 0]) for _ in range(16)]

        with trio.fail_after(10):
            assert await trio.to_thread.run_sync(drain) == [float(i) for i in range(16)]  # FIFO
            for h in handles:
                await trio.to_thread.run_sync(h.wait, 5.0)
        assert receiver.stats(a.id)["peak_buffered_bytes"] <= 3 * one
        assert sender.stats(b.id)["peak_unacked_messages"] == 2
        for comm in comms.values():
            comm.close()


@pytest.mark.parametrize("pool_copies", [0, 2])
async def test_send_copies_are_reused_up_to_the_pool_and_never_while_in_flight(corpus, pool_copies):
    one = 4 * TINY.seq_len * TINY.n_embd
    config = dataclasses.replace(CommConfig.test(), send_pool_bytes=pool_copies * one)
    async with swarm(2) as (nursery, nodes):
        plan = id_plan(Plan.grid(TINY.n_layer, 2, 1), nodes)
        a, b = nodes
        cfg = dataclasses.replace(TEST_CONFIG, micro_batches=8)
        states = {p: StageState(TINY, cfg, plan.layer_ranges[plan.position(p)[1]]) for p in plan.peers}
        comms = await start_comms(nursery, nodes, plan, TINY, cfg, states, config)
        sender, receiver = comms[a.id], comms[b.id]
        tag, x = f"{EPOCH}.0/act/0", torch.empty(1, TINY.seq_len, TINY.n_embd)
        for round_ in range(3):  # rounds after the first copy into the kept buffers
            handles = []
            for i in range(4):
                x.fill_(10 * round_ + i)
                handles.append(sender.isend(b.id, tag, x))
            x.fill_(-1)  # the copies are the caller's no longer

            def drain():
                got = [receiver.recv(a.id, tag, 5.0) for _ in range(4)]
                for h in handles:
                    h.wait(5.0)
                return [float(t[0, 0, 0]) for t in got], [bool(t.eq(t[0, 0, 0]).all()) for t in got]

            with trio.fail_after(10):
                values, uniform = await trio.to_thread.run_sync(drain)
            assert values == [10.0 * round_ + i for i in range(4)] and all(uniform)
            assert sender.stats(b.id)["send_pool_bytes"] == pool_copies * one
        for comm in comms.values():
            comm.close()


def test_config_is_validated_and_sizes_buffers_from_the_rules():
    with pytest.raises(ValueError):
        CommConfig(window_messages=0)
    with pytest.raises(ValueError):
        CommConfig(window_messages=33)
    with pytest.raises(ValueError):
        CommConfig(buffer_factor=0.5)
    with pytest.raises(ValueError):
        CommConfig(ack_timeout_s=10.0, handler_wait_timeout_s=10.0)
    with pytest.raises(ValueError):
        CommConfig(send_pool_bytes=-1)
    plan = Plan.grid(4, 2, 1)
    rules = MessageRules.for_peer(plan, TINY, TEST_CONFIG, "peer0.1", [])
    act = 4 * 2 * TINY.seq_len * TINY.n_embd
    burst = 4 * (act + ENTRY_OVERHEAD_BYTES) + 8 + ENTRY_OVERHEAD_BYTES  # the forward's four, and the norm
    assert CommConfig().buffer_limit(rules, "peer0.0") == burst
    assert CommConfig(buffer_factor=8.0).buffer_limit(rules, "peer0.0") == 8 * (act + ENTRY_OVERHEAD_BYTES)
    assert CommConfig(max_buffer_bytes=1).buffer_limit(rules, "peer0.0") == act + ENTRY_OVERHEAD_BYTES
