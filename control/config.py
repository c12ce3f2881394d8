"""The control plane's settings: `PlaneConfig`, one frozen dataclass nesting the election's
(`ElectionConfig`) and the tensor traffic's (`CommConfig`), with named profiles.

Every timing the plane waits on is a field here, with its trade-off; the protocol they time is
in docs/control.md. The daemon embeds this class as its `[plane]` table (dtfm.peer.config).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .dataplane import CommConfig
from .election import COUNCIL_SIZES, ElectionConfig

if TYPE_CHECKING:
    from .coordinator.machine import CoordinatorTimings

__all__ = ["DEVICE_RE", "PIPELINE_SCHEDULES", "PlaneConfig"]

DEVICE_RE = re.compile(r"cpu|cuda(:[0-9]{1,3})?")  # the devices a stage may be built on
PIPELINE_SCHEDULES = ("fitted", "gpipe")  # `PlaneConfig.pipeline_schedule`


@dataclass(frozen=True)
class PlaneConfig:
    """What one daemon's control plane waits for, how long, and how often it looks; the
    defaults are the `wan` profile."""

    # Torch threads of the stage worker; several daemons on one machine want 1 each.
    torch_threads: int = 1
    # Checkpoints kept on disk per stage of each run (`--keep-checkpoints`), the newest: more lets
    # a swarm roll back to an older common step when its peers' newest checkpoints differ, and
    # costs 12 bytes a parameter each (a tiny stage: ~1 MB; a gpt3-xl stage of 4: ~5 GB).
    checkpoints_kept: int = 3
    # Runs whose checkpoints stay on disk (`--keep-runs`), the newest: an older run's folder is
    # deleted when a checkpoint of a newer one lands. A run is resumed or exported from its own
    # checkpoints, so more keeps older runs resumable, at their checkpoints' size each.
    runs_kept: int = 4
    # How long a peer may take to build its stage (fetching it included) and connect its
    # neighbours before the coordinator gives up on the hand-out. Longer tolerates slow fetches
    # and loaded machines; shorter notices a peer lost during the hand-out sooner.
    accept_timeout_s: float = 120.0
    # Of that, how long a peer waits for the connections to its neighbours once its stage is
    # built: shorter refuses a hand-out to an unreachable neighbour sooner.
    connect_timeout_s: float = 60.0
    # START, STOP and RUN_STATE requests, one per peer. Longer waits out a slow peer; shorter
    # reconfigures around a silent one sooner.
    request_timeout_s: float = 10.0
    # Scheduler time when `train start` picks the shape, and for each reconfiguration: more
    # searches further, and every reconfiguration waits for it.
    schedule_time_s: float = 3.0
    # The stages' order of forwards and backwards in each allocation: "fitted", the schedule the
    # simulator predicts fastest (1F1B with each stage's warm-up fitted to its links' round trips,
    # or GPipe where nothing is faster); "gpipe", every forward first (the DT-FM paper's; holds
    # all micro-batches' activations).
    pipeline_schedule: str = "fitted"
    # Torch data set of this peer (`--data`): a text file or folder, or a token file (`.bin`);
    # None: the standard library's source.
    data_path: str | None = None
    # The folder whose Hugging Face tokenizer tokenizes text data (`--tokenizer`); None: bytes.
    tokenizer_path: str | None = None
    # Hugging Face GPT-2-family folders a run may start from (`--model-dir`), found by digest.
    model_paths: tuple[str, ...] = ()
    # The torch device the stage is built and trained on: "cpu", "cuda" or "cuda:N".
    device: str = "cpu"
    # The coordinator election's timings.
    election: ElectionConfig = field(default_factory=ElectionConfig.wan)
    # Flow control of tensor traffic between the stages; every peer of a swarm uses the same.
    comm: CommConfig = field(default_factory=CommConfig.default)
    # How long `train start` waits for this peer to be elected (or learn the coordinator).
    elect_timeout_s: float = 30.0
    # How long the coordinator waits for running peers to stop at a step boundary before it
    # aborts their step; longer lets a slow step finish, shorter reconfigures sooner.
    stop_timeout_s: float = 60.0
    # The coordinator looks for joined peers this often: shorter places a joined or returned peer
    # sooner, at a RUN_STATE query per outside peer per check.
    check_interval_s: float = 5.0
    # ... and for network drift this often: shorter follows a changing network sooner, at one
    # scheduler run (schedule_time_s) per check.
    drift_check_s: float = 60.0
    # ... and an epoch's first drift check after this many of its predicted steps (and 5 s of
    # gossip) where that is sooner: the prediction `train start` printed is re-estimated on the
    # peers' own steps early in each epoch; 0: at drift_check_s.
    first_drift_steps: int = 20
    # A new allocation must be predicted faster by this fraction (and by more than its weight
    # moves) before a drifting network reschedules.
    min_gain: float = 0.1
    # After a trigger the coordinator waits this long for the other peers' reports of the same
    # event (a death every neighbour notices), so one reconfiguration covers them all; each
    # reconfiguration starts that much later.
    report_gather_s: float = 0.5
    # Cap on the RUN_STATE probes of peers outside the run (joined, or returned while the run is
    # paused; request_timeout_s when shorter). A probe that times out is retried at the next
    # check, so shorter keeps the coordinator's loop brisk while an unreachable peer stays one.
    probe_timeout_s: float = 5.0
    # A run paused for want of a holder retries this long after it paused even if no peer out of
    # reach answers: shorter recovers sooner from a holder that answers unseen, at a failed
    # reconfiguration per retry.
    paused_retry_s: float = 30.0
    # A rollback that would run many completed steps again (more than a checkpoint interval)
    # first waits for a holder of a newer state to come back, as long as running those steps
    # again would take and at most this long (0: never): a restarted peer brings its checkpoints.
    rollback_wait_max_s: float = 120.0
    # While stopping an epoch the coordinator polls the peers' run states this often: shorter
    # notices the stop sooner, at a RUN_STATE round per poll.
    stop_poll_s: float = 0.2
    # A training peer checks this often that its epoch's coordinator is still the one it
    # recognises (5 heartbeats of the election).
    coordinator_check_s: float = 1.0
    # ... and stops training, discarding the step in progress, once it has been gone this long
    # (3 election timeouts): shorter stops a minority sooner, but must outlast a re-election or
    # a slow heartbeat stops a healthy run.
    coordinator_lost_after_s: float = 6.9
    # An allocation from a coordinator this peer does not recognise yet waits this long for its
    # first heartbeat (2 heartbeats and 1 s), which may arrive after the allocation; longer
    # accepts a slower new coordinator, shorter refuses a stale one sooner.
    heartbeat_wait_s: float = 1.4
    # A `train start` or `reschedule` forwarded to the coordinator waits this long for its
    # answer: the hand-out's accept_timeout_s plus a minute for scheduling and starting.
    forward_timeout_s: float = 180.0
    # A planned leave (`dtfm-peer leave`) waits this long for the coordinator to hand the
    # leaving peer's part off (stop at a step boundary, offers, fetches, hand-out); then it
    # leaves anyway and the run treats it as failed. Longer covers slower fetches of its stage.
    leave_hand_off_s: float = 120.0
    # `train start --min-peers` re-counts the live, measured peers this often.
    swarm_poll_s: float = 1.0
    # An operator's signed start, stop or reschedule is taken this long before or after the
    # time it was signed (a start also for its --min-peers wait after it): more tolerates
    # worse clocks, less shortens the time in which a copied signed operation could be sent
    # again (a start is never taken twice by one coordinator, a reschedule only when newer).
    operator_skew_s: float = 300.0
    # Voters of the council the coordinator keeps (3, 5 or 7; control/election/council.py): 5
    # survive one crashed voter and 7 two, at one more vote per election each; never every peer.
    council_size: int = 5
    # Failed reconfigurations of one trigger before the coordinator stops the run: more rides
    # out longer trouble, fewer gives up (and says why) sooner.
    max_reconfig_attempts: int = 5
    # A peer that refuses an allocation the other peers accept (or does not answer it) is left
    # out of the next attempts this long, doubled with each refusal in a row up to the max; its
    # refusal does not count toward max_reconfig_attempts (docs/control.md, "Refusing peers").
    # Shorter places an honest peer whose trouble passed sooner, at a failed hand-out and a
    # reconfiguration each time a peer that keeps refusing is tried again.
    refused_backoff_s: float = 30.0
    refused_backoff_max_s: float = 600.0
    # Joined peers are taken in as a wave: one reconfiguration once no other peer joined for
    # join_settle_s, or once the first of them waited join_wait_max_s. Shorter places a lone
    # joiner sooner, at a stop of the run per join of a growing swarm.
    join_settle_s: float = 10.0
    join_wait_max_s: float = 60.0
    # The step deadline (docs/control.md, "Gray failures"): once no step of the coordinator's
    # epoch has completed for max(step_deadline_floor_s, median + step_deadline_mads x MAD of the
    # recent step intervals), it probes the peers that have not reported the step. A lower floor
    # and fewer MADs notice a frozen peer or a cut link sooner, at more probes of merely slow
    # steps (a probe that is answered costs one RUN_STATE round and excludes nobody).
    step_deadline_floor_s: float = 3.0
    step_deadline_mads: float = 6.0
    # ... and the deadline of an epoch's first step, and of the next while fewer than three step
    # intervals are known (a reconfigured epoch starts from the last epoch's, scaled by the
    # predicted step times): it must outlast the connections warming up and the first step's
    # allocations.
    step_deadline_first_s: float = 15.0
    # A laggard answers that probe within this, its pings to its neighbours get half of it:
    # longer tolerates a stalled event loop on a loaded machine, shorter takes a frozen peer
    # out sooner.
    deadline_probe_timeout_s: float = 4.0
    # A link cut during a step is pinged from one end this often until it answers: shorter
    # uses a healed link sooner, at one ping per cut link per retest.
    link_retest_s: float = 2.0

    def __post_init__(self) -> None:
        if type(self.device) is not str or not DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if type(self.torch_threads) is not int or self.torch_threads < 1:
            raise ValueError(f"torch_threads must be an integer >= 1, got {self.torch_threads!r}")
        if self.council_size not in COUNCIL_SIZES or type(self.council_size) is not int:
            raise ValueError(f"council_size must be one of {', '.join(map(str, COUNCIL_SIZES))}, "
                             f"got {self.council_size!r}")
        if type(self.checkpoints_kept) is not int or not 1 <= self.checkpoints_kept <= 1000:
            raise ValueError(f"checkpoints_kept must be an integer from 1 to 1000, got {self.checkpoints_kept!r}")
        if type(self.runs_kept) is not int or not 1 <= self.runs_kept <= 1000:
            raise ValueError(f"runs_kept must be an integer from 1 to 1000, got {self.runs_kept!r}")
        if type(self.rollback_wait_max_s) not in (int, float) or not 0 <= self.rollback_wait_max_s < 1e6:
            raise ValueError(f"rollback_wait_max_s must be 0 or a positive number of seconds, "
                             f"got {self.rollback_wait_max_s!r}")
        if type(self.first_drift_steps) is not int or not 0 <= self.first_drift_steps < 1_000_000:
            raise ValueError(f"first_drift_steps must be an integer in [0, 1000000), got {self.first_drift_steps!r}")
        if type(self.max_reconfig_attempts) is not int or self.max_reconfig_attempts < 1:
            raise ValueError(f"max_reconfig_attempts must be an integer >= 1, got {self.max_reconfig_attempts!r}")
        for name in ("accept_timeout_s", "connect_timeout_s", "request_timeout_s", "schedule_time_s", "elect_timeout_s",
                     "stop_timeout_s", "check_interval_s", "drift_check_s", "report_gather_s", "probe_timeout_s",
                     "paused_retry_s", "stop_poll_s", "coordinator_check_s", "coordinator_lost_after_s",
                     "heartbeat_wait_s", "forward_timeout_s", "leave_hand_off_s", "swarm_poll_s", "step_deadline_floor_s",
                     "step_deadline_first_s", "deadline_probe_timeout_s", "link_retest_s", "operator_skew_s",
                     "refused_backoff_s", "refused_backoff_max_s", "join_settle_s", "join_wait_max_s"):
            v = getattr(self, name)
            if type(v) not in (int, float) or not 0 < v < 1e6:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if type(self.step_deadline_mads) not in (int, float) or not 0 <= self.step_deadline_mads < 1000:
            raise ValueError(f"step_deadline_mads must be in [0, 1000), got {self.step_deadline_mads!r}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, "
                             f"got {self.pipeline_schedule!r:.40}")
        if type(self.min_gain) not in (int, float) or not 0 <= self.min_gain < 10:
            raise ValueError(f"min_gain must be in [0, 10), got {self.min_gain!r}")
        if self.data_path is not None and not isinstance(self.data_path, str):
            raise ValueError(f"data_path must be a path string or None, got {self.data_path!r}")
        if not isinstance(self.election, ElectionConfig):
            raise ValueError(f"election must be an ElectionConfig, got {self.election!r}")
        if not isinstance(self.comm, CommConfig):
            raise ValueError(f"comm must be a CommConfig, got {self.comm!r}")
        if not self.connect_timeout_s < self.accept_timeout_s:
            raise ValueError("connect_timeout_s must be less than accept_timeout_s: the connections are part of "
                             "the hand-out")
        if not self.refused_backoff_s <= self.refused_backoff_max_s:
            raise ValueError("refused_backoff_s must not exceed refused_backoff_max_s")
        if not self.join_settle_s <= self.join_wait_max_s:
            raise ValueError("join_settle_s must not exceed join_wait_max_s")
        if not self.forward_timeout_s > self.accept_timeout_s:
            raise ValueError("forward_timeout_s must exceed accept_timeout_s: a forwarded `train start` "
                             "waits for the whole hand-out")
        if not self.coordinator_lost_after_s > self.election.election_timeout_max_s:
            raise ValueError("coordinator_lost_after_s must exceed the election's election_timeout_max_s, "
                             "or a re-election stops a healthy run")

    @classmethod
    def lan(cls) -> PlaneConfig:
        """One data centre or region: the election's lan timings (and the waits that follow
        them); everything else as wan."""
        return cls().with_election(ElectionConfig.lan())

    @classmethod
    def wan(cls) -> PlaneConfig:
        """Peers across continents: the defaults."""
        return cls().with_election(ElectionConfig.wan())

    @classmethod
    def test(cls) -> PlaneConfig:
        """A test swarm of daemons on one loaded machine: the election's lan timings (its test
        profile, a 0.24 s lease, is for simulations; a 2-core machine running a swarm stalls a
        daemon's event loop longer than that), quick checks and polls, and timeouts that still
        let CPU stages build. The drift check is halved, not more: each one runs the scheduler
        for schedule_time_s on a machine the stages share, and a static emulated network seldom
        drifts. The scheduler keeps its time, so it picks the same allocations, and tensor flow
        control its defaults (CommConfig.test fails a step whose worker waits 5 s for the CPU).
        Emulated links slower than a data centre's want `with_election(ElectionConfig.wan())`:
        the lan lease (0.4 s) is shorter than a worldwide round trip."""
        return cls(
            accept_timeout_s=60.0, connect_timeout_s=30.0, request_timeout_s=5.0, elect_timeout_s=15.0,
            stop_timeout_s=20.0, check_interval_s=1.0, drift_check_s=30.0, probe_timeout_s=2.0, paused_retry_s=6.0, stop_poll_s=0.1,
            forward_timeout_s=120.0, swarm_poll_s=0.2, join_settle_s=2.0, join_wait_max_s=10.0,
        ).with_election(ElectionConfig.lan())

    def with_(self, **changes: Any) -> PlaneConfig:
        return replace(self, **changes)

    def coordinator_timings(self) -> CoordinatorTimings:
        """The coordinator machine's timings from these settings (the shell's and the
        simulation's one mapping)."""
        # (the coordinator's module loads numpy and the scheduler: not for a command that only
        # reads the daemon's settings)
        from .coordinator.deadline import DeadlineRules
        from .coordinator.machine import CoordinatorTimings

        return CoordinatorTimings(
            accept_timeout_s=self.accept_timeout_s, request_timeout_s=self.request_timeout_s,
            stop_timeout_s=self.stop_timeout_s, check_interval_s=self.check_interval_s,
            drift_check_s=self.drift_check_s, first_drift_steps=self.first_drift_steps,
            report_gather_s=self.report_gather_s,
            probe_timeout_s=self.probe_timeout_s, paused_retry_s=self.paused_retry_s, stop_poll_s=self.stop_poll_s,
            max_reconfig_attempts=self.max_reconfig_attempts,
            deadline=DeadlineRules(floor_s=self.step_deadline_floor_s, mads=self.step_deadline_mads,
                                   first_s=self.step_deadline_first_s),
            deadline_probe_timeout_s=self.deadline_probe_timeout_s, link_retest_s=self.link_retest_s,
            operator_skew_s=self.operator_skew_s, council_size=self.council_size,
            refused_backoff_s=self.refused_backoff_s, refused_backoff_max_s=self.refused_backoff_max_s,
            join_settle_s=self.join_settle_s, join_wait_max_s=self.join_wait_max_s,
            rollback_wait_max_s=self.rollback_wait_max_s)

    def with_election(self, election: ElectionConfig) -> PlaneConfig:
        """These settings on other election timings, with the waits that follow them as the
        profiles derive them: 5 heartbeats, 3 election timeouts, 2 heartbeats and 1 s (rounded,
        so that binary fractions do not show: 3 * 2.3 is 6.8999999999999995)."""
        return replace(self, election=election,
                       coordinator_check_s=round(5 * election.heartbeat_interval_s, 9),
                       coordinator_lost_after_s=round(3 * election.election_timeout_max_s, 9),
                       heartbeat_wait_s=round(2 * election.heartbeat_interval_s + 1.0, 9))
