"""`dtfm-peer join --metrics-listen`: the status collector over a daemon-shaped status snapshot,
served by the trio endpoint on a real loopback socket, scraped and parsed with prometheus_client's
own parser."""

import importlib.metadata
import math

import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from dtfm.net import Address
from dtfm.peer.config import ConfigError, MetricsConfig
from dtfm.peer.metrics import StatusCollector, metrics_registry, serve_metrics

ME, PREV, NEXT, DP, SPARE = ("a1" * 32, "b2" * 32, "c3" * 32, "d4" * 32, "e5" * 32)


def status_snapshot() -> dict:
    """What Daemon.status() returns on a peer in stage 1 of pipeline 0 of a 3 x 2 run, which also
    coordinates it (the shape of `dtfm-peer status --json`)."""
    peers = [{"peer_id": p, "short_id": p[:8], "payload_bytes_sent": sent, "payload_bytes_received": got}
             for p, sent, got in ((PREV, 1000, 4000), (NEXT, 3000, 2000), (DP, 500, 500), (SPARE, 0, 70))]
    return {
        "peer_id": ME, "short_id": ME[:8], "region": "eu-west", "uptime_s": 12.5, "peers": peers,
        "refused": {"malformed/70": 3},
        "gossip": {
            "members": [{"id": p, "state": s} for p, s in ((ME, "alive"), (PREV, "alive"), (NEXT, "alive"),
                                                          (DP, "suspect"), (SPARE, "dead"))],
            "latency": [{"target": PREV[:8], "rtt_ms": 40.0, "bandwidth_gbps": 0.8, "samples": 3},
                        {"target": NEXT[:8], "rtt_ms": 2.0, "bandwidth_gbps": None, "samples": 1}],
            "view": {"measured_links": 14, "expected_links": 20},
            "refused": {"address group at its cap of members": 134}, "evicted": 7,
        },
        "training": {
            "state": "training", "role": "coordinator", "term": 4, "coordinator": ME, "run_id": "ab" * 16,
            "epoch": 3, "preset": "tiny", "stages": 3, "dp": 2, "end_step": 100, "stage": 1, "pipeline": 0,
            "prev": PREV, "next": NEXT, "dp_group": [ME, DP], "fetched_bytes": 123456, "step": 41,
            "predicted_iteration_s": 0.5, "tokens_per_step": 2048,
            "last_step": {"step": 41, "loss": 3.25, "iteration_s": 0.8, "compute_s": 0.3, "pipeline_s": 0.4,
                          "sync_s": 0.1},
            "last_reconfig": {"at": 1060.0, "started_at": 1052.5, "reason": "peer 77aa0011 is dead", "epoch": 3,
                              "term": 4, "old_shape": "3x3", "new_shape": "3x2", "kind": "shrink",
                              "predicted_old_s": 0.4, "predicted_new_s": 0.5, "moves": 2, "bytes_moved": 9_000_000,
                              "resume_step": 40, "rollback": False, "stop_s": 1.0, "schedule_s": 0.5,
                              "offer_s": 0.25, "transfer_s": 5.0, "handout_s": 0.75},
        },
    }


async def scrape(address, request: bytes) -> bytes:
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(request)
        answer = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                answer += chunk
    return answer


def samples(text: str) -> dict:
    """{(name, frozen labels): value} of every sample in a scrape."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def config(**kw) -> MetricsConfig:
    return MetricsConfig(listen=Address("127.0.0.1", 0), **kw)


async def test_a_scrape_over_loopback_has_the_daemon_s_figures():
    snapshot = status_snapshot()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_metrics, metrics_registry(lambda: snapshot), config())
        answer = await scrape(address, b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        nursery.cancel_scope.cancel()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK\r\n") and b"Content-Type: text/plain; version=" in head
    got = samples(body.decode())

    def value(name, **labels):
        return got[(name, frozenset(labels.items()))]

    assert value("dtfm_train_step") == 41 and value("dtfm_train_loss") == 3.25
    assert value("dtfm_train_epoch") == 3 and value("dtfm_coordinator_term") == 4
    assert value("dtfm_is_coordinator") == 1
    assert value("dtfm_train_iteration_seconds", kind="measured") == 0.8
    assert value("dtfm_train_iteration_seconds", kind="predicted") == 0.5
    assert value("dtfm_train_tokens_per_second") == pytest.approx(2048 / 0.8)
    assert value("dtfm_train_step_phase_seconds", phase="pipeline") == 0.4
    # bytes per peer and axis: the pipeline neighbours, the data-parallel group, the rest
    assert value("dtfm_peer_payload_bytes_total", peer=PREV[:8], direction="received", axis="pipeline") == 4000
    assert value("dtfm_peer_payload_bytes_total", peer=NEXT[:8], direction="sent", axis="pipeline") == 3000
    assert value("dtfm_peer_payload_bytes_total", peer=DP[:8], direction="sent", axis="data") == 500
    assert value("dtfm_peer_payload_bytes_total", peer=SPARE[:8], direction="received", axis="other") == 70
    assert value("dtfm_members", state="alive") == 3 and value("dtfm_members", state="suspect") == 1
    assert value("dtfm_members", state="dead") == 1 and value("dtfm_members", state="left") == 0
    assert value("dtfm_link_rtt_seconds", peer=PREV[:8]) == pytest.approx(0.040)
    assert value("dtfm_link_bandwidth_bytes_per_second", peer=PREV[:8]) == pytest.approx(1e8)
    assert (("dtfm_link_bandwidth_bytes_per_second", frozenset({("peer", NEXT[:8])})) not in got)  # unmeasured
    assert value("dtfm_view_links_measured") == 14 and value("dtfm_connected_peers") == 4
    assert value("dtfm_transport_refused_messages_total", reason="malformed", type="70") == 3
    assert value("dtfm_gossip_refused_updates_total", reason="address group at its cap of members") == 134
    assert value("dtfm_gossip_evicted_members_total") == 7
    assert value("dtfm_last_reconfiguration_phase_seconds", phase="transfer") == 5.0
    assert value("dtfm_last_reconfiguration_duration_seconds") == 7.5
    assert value("dtfm_last_reconfiguration_bytes_moved") == 9_000_000
    assert value("dtfm_last_reconfiguration_info", kind="shrink", old_shape="3x3", new_shape="3x2",
                 rollback="false") == 1
    assert value("dtfm_peer_info", peer_id=ME, region="eu-west", version=importlib.metadata.version("dtfm")) == 1
    assert value("dtfm_training_info", state="training", run_id="abababab", preset="tiny") == 1


def test_an_idle_daemon_has_no_training_figures_and_nothing_breaks():
    """A daemon before any run (no training map, no gossip yet): only what it knows is exported."""
    families = {f.name for f in StatusCollector(lambda: {"peer_id": ME, "peers": [], "training": None}).collect()}
    assert {"dtfm_peer", "dtfm_connected_peers", "dtfm_members", "dtfm_is_coordinator"} <= families
    assert not {"dtfm_train_step", "dtfm_train_loss", "dtfm_coordinator_term"} & families
    weird = {"peer_id": ME, "peers": ["x", {"peer_id": 3, "payload_bytes_sent": "many"}], "uptime_s": math.nan,
             "training": {"last_step": {"loss": None, "iteration_s": 0}, "tokens_per_step": 10, "term": True},
             "gossip": {"members": [None], "latency": [{"rtt_ms": "fast"}]}, "refused": {"x": "y"}}
    assert list(StatusCollector(lambda: weird).collect())  # odd values are left out, not raised on


def test_the_run_s_series_are_wherever_its_coordinator_is_also_without_a_stage():
    """A coordinator that holds no stage (a spare of its run) still exports the run as it counts
    it: steps completed of N, its state, the counters since this daemon started, the time since
    the last step (by the collector's clock), and its checkpoints on disk."""
    snap = {"peer_id": ME, "peers": [], "training": {
        "state": "spare", "role": "coordinator", "term": 2, "coordinator": ME, "run_id": "ab" * 16,
        "issued": {"run_id": "ab" * 16, "state": "paused", "reason": "only 1 of 3 voters are reachable",
                   "completed": 41, "steps_done": 42, "end_step": 100, "epoch": 5,
                   "counts": {"steps": 47, "reconfigurations": 4, "rollbacks": 1, "steps_lost": 5,
                              "last_step_at": 1000.0, "steps_unlogged": 2}},
        "checkpoints": {"path": "/d/checkpoints", "bytes": 3_000_000, "kept": 3, "saved": 12, "refused": 1,
                        "refusal": "no checkpoint of layers 0-1 at step 40: the disk is full"}}}
    got = samples(generate(StatusCollector(lambda: snap, clock=lambda: 1012.5)))
    run = frozenset({("run_id", "abababab")})
    assert got[("dtfm_run_state", run | {("state", "paused")})] == 1.0
    assert got[("dtfm_run_steps_completed", run)] == 42 and got[("dtfm_run_end_step", run)] == 100
    assert got[("dtfm_run_steps_total", run)] == 47 and got[("dtfm_run_reconfigurations_total", run)] == 4
    assert got[("dtfm_run_rollbacks_total", run)] == 1 and got[("dtfm_run_steps_lost_total", run)] == 5
    assert got[("dtfm_run_steps_unlogged_total", run)] == 2
    assert got[("dtfm_run_seconds_since_last_step", run)] == 12.5
    assert got[("dtfm_checkpoint_bytes", frozenset())] == 3_000_000
    assert got[("dtfm_checkpoints_refused_total", frozenset())] == 1
    assert not any(name == "dtfm_train_stage" for name, _ in got)  # (it holds no stage)


def generate(collector: StatusCollector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET / HTTP/1.0\r\n\r\n", b"404"),
    (b"POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", b"405"),
    (b"nonsense\r\n\r\n", b"400"),
    (b"GET /metrics HTTP/1.0\r\nX: " + b"a" * 200 + b"\r\n\r\n", b"431"),
])
async def test_other_requests_get_an_error_status(request_bytes, status):
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_metrics, metrics_registry(status_snapshot),
                                      config(max_request_bytes=128))
        answer = await scrape(address, request_bytes)
        nursery.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.0 " + status + b" ")


async def test_a_silent_client_is_cut_off_and_the_endpoint_keeps_serving():
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_metrics, metrics_registry(status_snapshot),
                                      config(request_timeout_s=0.2, max_connections=1))
        silent = await trio.open_tcp_stream(*address)
        with trio.fail_after(10):  # closed by the server after its request timeout
            assert await silent.receive_some(100) == b""
        await silent.aclose()
        answer = await scrape(address, b"GET /metrics HTTP/1.0\r\n\r\n")
        nursery.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.0 200 OK")


def test_metrics_settings_are_checked():
    with pytest.raises(ConfigError):
        MetricsConfig(max_connections=0)
    with pytest.raises(ConfigError):
        MetricsConfig(request_timeout_s=0)


def test_memory_figures_are_gauges():
    """The daemon's resident memory (now, peak) and its stage's own state by part."""
    snap = status_snapshot()
    snap["memory"] = {"rss_bytes": 2_000_000_000, "peak_rss_bytes": 2_500_000_000}
    snap["training"]["memory"] = {"stage_bytes": 1_300_000_000, "weights_bytes": 170_000_000,
                                  "grads_bytes": 170_000_000, "optimizer_bytes": 340_000_000,
                                  "snapshot_bytes": 510_000_000, "activations_bytes": 110_000_000}
    text = metrics_registry(lambda: snap).collect()
    got = {(s.name, frozenset(s.labels.items())): s.value for family in text for s in family.samples}
    assert got[("dtfm_memory_resident_bytes", frozenset())] == 2_000_000_000
    assert got[("dtfm_memory_peak_resident_bytes", frozenset())] == 2_500_000_000
    assert {dict(k)["part"]: v for (name, k), v in got.items() if name == "dtfm_stage_memory_bytes"} == {
        "weights": 170_000_000, "grads": 170_000_000, "optimizer": 340_000_000, "snapshot": 510_000_000,
        "activations": 110_000_000}
    families = {f.name for f in StatusCollector(status_snapshot).collect()}  # not reported: not exported
    assert not {"dtfm_memory_resident_bytes", "dtfm_stage_memory_bytes"} & families
