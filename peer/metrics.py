"""`dtfm-peer join --metrics-listen HOST:PORT`: the daemon's status as Prometheus metrics.

`StatusCollector` is a prometheus_client collector over a status snapshot, by default the
daemon's own (`Daemon.status()`: what `dtfm-peer status --json` prints, with the transport's
peers, gossip's members and measurements, and the control plane's PlaneStatus under
"training"). It turns the snapshot into metric families at scrape time: nothing in the daemon
counts anything for the metrics' sake. prometheus_client writes the text format
(`generate_latest`); `serve_metrics` answers `GET /metrics` over HTTP/1.0 on a trio listener,
with a bounded request head, a timeout and a cap on scrapes at once. docs/daemon.md
("Metrics") lists the metrics.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from dtfm.gossip import MemberState

from .config import MetricsConfig
from .config import ListenError
from .daemon import Daemon

__all__ = ["MetricsPart", "StatusCollector", "metrics_registry", "serve_metrics"]

logger = logging.getLogger(__name__)

Snapshot = Callable[[], dict[str, Any]]
RECONFIG_PHASES = ("stop", "schedule", "offer", "transfer", "handout")
STEP_PHASES = ("compute", "pipeline", "sync")


def _num(value: object) -> float | None:
    """A finite number from the snapshot, else None (absent, null, or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _short(peer_id: object) -> str:
    return peer_id[:8] if isinstance(peer_id, str) else ""


def _version() -> str:
    try:
        return importlib.metadata.version("dtfm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class StatusCollector(Collector):
    """Metric families from one status snapshot per scrape (see the module docstring)."""

    def __init__(self, snapshot: Snapshot, clock: Callable[[], float] = time.time):
        self.snapshot = snapshot
        self.clock = clock  # wall time, for the time since the run's last step

    def collect(self) -> Iterator[Metric]:
        st = self.snapshot()
        training = _dict(st.get("training"))
        yield from self._daemon(st)
        yield from self._traffic(st, training)
        yield from self._gossip(_dict(st.get("gossip")))
        yield from self._election(training)
        yield from self._training(training)
        yield from self._reconfiguration(_dict(training.get("last_reconfig")))
        yield from self._run(_dict(training.get("issued")), self.clock())
        yield from self._checkpoints(_dict(training.get("checkpoints")))

    # ---- the daemon and its transport ----------------------------------------------------------

    def _daemon(self, st: dict) -> Iterator[Metric]:
        info = InfoMetricFamily("dtfm_peer", "this daemon: peer id, region, dtfm version")
        info.add_metric([], {"peer_id": str(st.get("peer_id", "")), "region": str(st.get("region") or ""),
                             "version": _version()})
        yield info
        uptime = _num(st.get("uptime_s"))
        if uptime is not None:
            yield GaugeMetricFamily("dtfm_uptime_seconds", "seconds since the daemon started", value=uptime)
        yield GaugeMetricFamily("dtfm_connected_peers", "peers with a live transport connection",
                                value=len(_list(st.get("peers"))))
        memory = _dict(st.get("memory"))
        for name, key, text in (("dtfm_memory_resident_bytes", "rss_bytes", "the daemon's resident memory"),
                                ("dtfm_memory_peak_resident_bytes", "peak_rss_bytes",
                                 "the daemon's peak resident memory since it started")):
            value = _num(memory.get(key))
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        loop = _dict(st.get("loop"))
        late = _num(loop.get("late_ms_worst_1m"))
        if late is not None:
            yield GaugeMetricFamily("dtfm_event_loop_late_seconds",
                                    "the event loop's latest wake-up in the last minute", value=late / 1000)
        stalls = _num(loop.get("stalls"))
        if stalls is not None:
            yield CounterMetricFamily("dtfm_event_loop_stalls", "wake-ups of the event loop late by its stall "
                                      "threshold or more", value=stalls)
        refused = CounterMetricFamily("dtfm_transport_refused_messages",
                                      "incoming messages the transport refused, by reason and message type",
                                      labels=["reason", "type"])
        for key, n in _dict(st.get("refused")).items():
            reason, _, msg_type = str(key).partition("/")
            if _num(n) is not None:
                refused.add_metric([reason, msg_type], n)
        yield refused

    def _traffic(self, st: dict, training: dict) -> Iterator[Metric]:
        """Payload bytes per connected peer, labelled with its place relative to this peer in the
        current allocation: pipeline (the previous or next stage), data (same stage, another
        pipeline), other (weight transfers, spares, no run)."""
        neighbours = {training.get("prev"), training.get("next")} - {None}
        group = set(_list(training.get("dp_group"))) - {None}
        family = CounterMetricFamily("dtfm_peer_payload_bytes",
                                     "payload bytes (tensors, weights) sent to and received from a peer on "
                                     "the current connection", labels=["peer", "direction", "axis"])
        for p in _list(st.get("peers")):
            peer = _dict(p)
            pid = peer.get("peer_id")
            axis = "pipeline" if pid in neighbours else "data" if pid in group else "other"
            for direction in ("sent", "received"):
                n = _num(peer.get(f"payload_bytes_{direction}"))
                if n is not None:
                    family.add_metric([_short(pid), direction, axis], n)
        yield family

    # ---- gossip: members and links -----------------------------------------------------------

    def _gossip(self, gossip: dict) -> Iterator[Metric]:
        members = GaugeMetricFamily("dtfm_members", "swarm members this peer knows, by state", labels=["state"])
        counts = {s.name.lower(): 0 for s in MemberState}
        for m in _list(gossip.get("members")):
            state = str(_dict(m).get("state", "unknown"))
            counts[state] = counts.get(state, 0) + 1
        for state, n in counts.items():
            members.add_metric([state], n)
        yield members
        rtt = GaugeMetricFamily("dtfm_link_rtt_seconds", "measured round trip to a peer", labels=["peer"])
        bandwidth = GaugeMetricFamily("dtfm_link_bandwidth_bytes_per_second", "measured bandwidth to a peer",
                                      labels=["peer"])
        for row in _list(gossip.get("latency")):
            row = _dict(row)
            target = str(row.get("target", ""))
            ms, gbps = _num(row.get("rtt_ms")), _num(row.get("bandwidth_gbps"))
            if ms is not None:
                rtt.add_metric([target], ms / 1000)
            if gbps is not None:
                bandwidth.add_metric([target], gbps * 1e9 / 8)
        yield rtt
        yield bandwidth
        refused = CounterMetricFamily("dtfm_gossip_refused_updates",
                                      "membership updates gossip refused, by reason (rates, caps per address "
                                      "group, a full table, signatures)", labels=["reason"])
        for reason, n in _dict(gossip.get("refused")).items():
            if _num(n) is not None:
                refused.add_metric([str(reason)], n)
        yield refused
        evicted = _num(gossip.get("evicted"))
        if evicted is not None:
            yield CounterMetricFamily("dtfm_gossip_evicted_members", "members removed to make room in a full "
                                      "member table", value=evicted)
        view = _dict(gossip.get("view"))
        for name, key, text in (("dtfm_view_links_measured", "measured_links", "directed links of the N x N view "
                                 "with a measurement"),
                                ("dtfm_view_links_expected", "expected_links", "directed links between live members")):
            value = _num(view.get(key))
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)

    # ---- the control plane ---------------------------------------------------------------------

    def _election(self, t: dict) -> Iterator[Metric]:
        term = _num(t.get("term"))
        if term is not None:
            yield GaugeMetricFamily("dtfm_coordinator_term", "the election term this peer is in", value=term)
        role = str(t.get("role") or "")
        yield GaugeMetricFamily("dtfm_is_coordinator", "1 on the coordinator of the current term",
                                value=1.0 if role == "coordinator" else 0.0)
        info = InfoMetricFamily("dtfm_election", "this peer's election role and the coordinator it follows")
        info.add_metric([], {"role": role, "coordinator": _short(t.get("coordinator"))})
        yield info

    def _training(self, t: dict) -> Iterator[Metric]:
        info = InfoMetricFamily("dtfm_training", "what this peer does in the run")
        info.add_metric([], {"state": str(t.get("state", "")), "run_id": _short(t.get("run_id")),
                             "preset": str(t.get("preset") or "")})
        yield info
        last = _dict(t.get("last_step"))
        gauges = (
            ("dtfm_train_step", "the last step this peer completed, as the step log numbers it (from 0; texts count from 1)", t.get("step", last.get("step"))),
            ("dtfm_train_epoch", "the run's epoch: one more after each reconfiguration", t.get("epoch")),
            ("dtfm_train_stage", "this peer's pipeline stage", t.get("stage")),
            ("dtfm_train_pipeline", "this peer's pipeline (data-parallel replica)", t.get("pipeline")),
            ("dtfm_train_stages", "pipeline stages of the current allocation", t.get("stages")),
            ("dtfm_train_pipelines", "pipelines of the current allocation", t.get("dp")),
            ("dtfm_train_end_step", "the step the run ends at", t.get("end_step")),
            ("dtfm_train_loss", "the loss of the last step (last stage only)", last.get("loss")),
            ("dtfm_train_fetched_bytes", "weight bytes this peer fetched for the current epoch",
             t.get("fetched_bytes")),
        )
        for name, text, value in gauges:
            v = _num(value)
            if v is not None:
                yield GaugeMetricFamily(name, text, value=v)
        memory = _dict(t.get("memory"))
        if memory:
            stage = GaugeMetricFamily("dtfm_stage_memory_bytes", "this peer's stage's own state as of its last "
                                      "step, by part", labels=["part"])
            for part in ("weights", "grads", "optimizer", "snapshot", "activations"):
                v = _num(memory.get(f"{part}_bytes"))
                if v is not None:
                    stage.add_metric([part], v)
            yield stage
        iteration = GaugeMetricFamily("dtfm_train_iteration_seconds",
                                      "time of one training step: measured (the last step) and predicted "
                                      "(the scheduler's, for the current allocation)", labels=["kind"])
        measured, predicted = _num(last.get("iteration_s")), _num(t.get("predicted_iteration_s"))
        for kind, value in (("measured", measured), ("predicted", predicted)):
            if value is not None:
                iteration.add_metric([kind], value)
        yield iteration
        phases = GaugeMetricFamily("dtfm_train_step_phase_seconds", "the last step's time by phase",
                                   labels=["phase"])
        for phase in STEP_PHASES:
            v = _num(last.get(f"{phase}_s"))
            if v is not None:
                phases.add_metric([phase], v)
        yield phases
        tokens = _num(t.get("tokens_per_step"))
        if tokens is not None and measured:
            yield GaugeMetricFamily("dtfm_train_tokens_per_second", "tokens the swarm trained per second "
                                    "in the last step (global batch x sequence / iteration time)",
                                    value=tokens / measured)

    def _run(self, issued: dict, now: float | None) -> Iterator[Metric]:
        """The run as its coordinator counts it (on the coordinator only, also when it holds no
        stage): how far, in what state, the steps, reconfigurations, rollbacks, steps lost and
        steps it could not log it counted since this daemon started, and the time since its last
        step."""
        if not issued:
            return
        run = _short(issued.get("run_id"))
        state = GaugeMetricFamily("dtfm_run_state", "1 for the run's state at its coordinator",
                                  labels=["run_id", "state"])
        state.add_metric([run, str(issued.get("state", ""))], 1.0)
        yield state
        for name, text, value in (
                ("dtfm_run_steps_completed", "steps of the run completed (0..N)", issued.get("steps_done")),
                ("dtfm_run_end_step", "the steps the run trains (N)", issued.get("end_step")),
                ("dtfm_run_epoch", "the run's current epoch", issued.get("epoch"))):
            v = _num(value)
            if v is not None:
                family = GaugeMetricFamily(name, text, labels=["run_id"])
                family.add_metric([run], v)
                yield family
        counts = _dict(issued.get("counts"))
        for name, key, text in (
                ("dtfm_run_steps", "steps", "step lines this coordinator logged"),
                ("dtfm_run_reconfigurations", "reconfigurations", "epochs this coordinator handed out after a run's first"),
                ("dtfm_run_rollbacks", "rollbacks", "reconfigurations that ran completed steps again"),
                ("dtfm_run_steps_lost", "steps_lost", "completed steps the rollbacks ran again"),
                ("dtfm_run_steps_unlogged", "steps_unlogged", "completed steps the step log could not log "
                 "(no peer kept a report of them)")):
            v = _num(counts.get(key))
            if v is not None:
                counter = CounterMetricFamily(name, text, labels=["run_id"])
                counter.add_metric([run], v)
                yield counter
        last = _num(counts.get("last_step_at"))
        if last is not None and now is not None:
            family = GaugeMetricFamily("dtfm_run_seconds_since_last_step", "seconds since the coordinator logged "
                                       "the run's last step", labels=["run_id"])
            family.add_metric([run], max(0.0, now - last))
            yield family

    def _checkpoints(self, disk: dict) -> Iterator[Metric]:
        if not disk:
            return
        for name, key, text in (("dtfm_checkpoint_bytes", "bytes", "bytes of this peer's checkpoints on disk"),
                                ("dtfm_checkpoints_kept", "kept", "checkpoints kept per stage of each run")):
            v = _num(disk.get(key))
            if v is not None:
                yield GaugeMetricFamily(name, text, value=v)
        for name, key, text in (("dtfm_checkpoints_saved", "saved", "checkpoints this daemon wrote"),
                                ("dtfm_checkpoints_refused", "refused", "checkpoint writes the disk refused")):
            v = _num(disk.get(key))
            if v is not None:
                yield CounterMetricFamily(name, text, value=v)

    def _reconfiguration(self, r: dict) -> Iterator[Metric]:
        """The coordinator's last reconfiguration (other peers have none to show)."""
        if not r:
            return
        phases = GaugeMetricFamily("dtfm_last_reconfiguration_phase_seconds",
                                   "how long each phase of the last reconfiguration took", labels=["phase"])
        for phase in RECONFIG_PHASES:
            v = _num(r.get(f"{phase}_s"))
            if v is not None:
                phases.add_metric([phase], v)
        yield phases
        at, started = _num(r.get("at")), _num(r.get("started_at"))
        if at is not None:
            yield GaugeMetricFamily("dtfm_last_reconfiguration_timestamp_seconds",
                                    "wall time the last reconfiguration completed", value=at)
            if started is not None:
                yield GaugeMetricFamily("dtfm_last_reconfiguration_duration_seconds",
                                        "the last reconfiguration, from its trigger to the resumed run",
                                        value=max(0.0, at - started))
        for name, key, text in (("dtfm_last_reconfiguration_bytes_moved", "bytes_moved", "weight bytes it moved"),
                                ("dtfm_last_reconfiguration_moves", "moves", "stages it moved to other peers"),
                                ("dtfm_last_reconfiguration_resume_step", "resume_step", "the step the run resumed at")):
            v = _num(r.get(key))
            if v is not None:
                yield GaugeMetricFamily(name, f"the last reconfiguration: {text}", value=v)
        info = InfoMetricFamily("dtfm_last_reconfiguration", "the last reconfiguration's kind and shapes")
        info.add_metric([], {"kind": str(r.get("kind", "")), "old_shape": str(r.get("old_shape") or ""),
                             "new_shape": str(r.get("new_shape") or ""),
                             "rollback": "true" if r.get("rollback") else "false"})
        yield info


def metrics_registry(snapshot: Snapshot) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) with the status collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))
    return registry


class MetricsPart:
    """The daemon's metrics endpoint: a service, and where it listens under "metrics" in status."""

    def __init__(self, config: MetricsConfig):
        self.config = config
        self.address: tuple[str, int] | None = None

    async def run(self, daemon: Daemon, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.address = await nursery.start(serve_metrics, metrics_registry(daemon.status), self.config)
            task_status.started()

    def status(self) -> dict | None:
        return None if self.address is None else {"url": f"http://{_host(self.address[0])}:{self.address[1]}/metrics"}


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ---- the HTTP endpoint ---------------------------------------------------------------------------

async def serve_metrics(registry: CollectorRegistry, config: MetricsConfig, *,
                        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer `GET /metrics` on `config.listen` until cancelled; `task_status.started` gets the
    bound (host, port)."""
    if config.listen is None:
        raise ValueError("no metrics address to listen on")
    limiter = trio.CapacityLimiter(config.max_connections)

    async def handle(stream: trio.SocketStream) -> None:
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            await trio.aclose_forcefully(stream)
            return
        try:
            with trio.move_on_after(config.request_timeout_s):
                await _answer(stream, registry, config.max_request_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            logger.debug("metrics scrape failed: %s", e)
        finally:
            limiter.release()
            await trio.aclose_forcefully(stream)

    try:
        listeners = await trio.open_tcp_listeners(config.listen.port, host=config.listen.host)
    except OSError as e:
        raise ListenError(f"cannot serve metrics on {config.listen}: {e.strerror or e}") from None
    host, port = listeners[0].socket.getsockname()[:2]
    logger.info("serving metrics at http://%s:%d/metrics", host, port)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started((host, port))


async def _answer(stream: trio.SocketStream, registry: CollectorRegistry, max_request_bytes: int) -> None:
    head = b""
    while b"\r\n\r\n" not in head and b"\n\n" not in head:
        chunk = await stream.receive_some(max_request_bytes)
        if not chunk:
            return
        head += chunk
        if len(head) > max_request_bytes:
            await _send(stream, 431, "text/plain", b"request head too long\n")
            return
    parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        await _send(stream, 400, "text/plain", b"bad request\n")
        return
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method not in (b"GET", b"HEAD"):
        await _send(stream, 405, "text/plain", b"only GET\n")
    elif target != b"/metrics":
        await _send(stream, 404, "text/plain", b"the metrics are at /metrics\n")
    else:
        body = generate_latest(registry)
        await _send(stream, 200, CONTENT_TYPE_LATEST, body if method == b"GET" else b"", length=len(body))


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


async def _send(stream: trio.SocketStream, status: int, content_type: str, body: bytes,
                length: int | None = None) -> None:
    head = (f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n")
    await stream.send_all(head.encode("ascii") + body)
