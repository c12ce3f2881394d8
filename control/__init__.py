"""dtfm.control: agreement on who does what, and running it.

The coordinator election (election/), signed allocations (allocation/), the plane's two sans-IO
machines, `EpochMachine` (epoch/) and `Coordinator` (coordinator/), with `ControlPlane`, the IO
shell that runs them inside the daemon, the Comm over the peer transport (dataplane/), and
weight recovery. Sits above gossip, sched and train, below the daemon, which only starts it as
a service. See docs/control.md.
"""

from .allocation import (
                         ALLOCATION_DOMAIN,
                         MAX_ALLOCATION_BYTES,
                         REFUSAL_CODES,
                         AcceptContext,
                         Allocation,
                         Holding,
                         Refusal,
                         SignedAllocation,
                         check_allocation,
)
from .coordinator.request import TrainError, TrainRequest
from .coordinator.reshape import ReshapePlan, reshape
from .epoch.runstate import PeerRunState, ResumeError, ResumePoint, resume_point
from .coordinator.schedule import PLACEMENTS, Placement, choose_shape, random_shape, sched_spec
from .config import PlaneConfig
from .dataplane import CommConfig, TensorRouter, TransportComm
from .election import (
                         BecameCoordinator,
                         Certificate,
                         CoordinatorKnown,
                         ElectionAction,
                         ElectionConfig,
                         ElectionMessage,
                         ElectionRole,
                         ElectionSend,
                         ElectionService,
                         ElectionState,
                         ElectionStore,
                         ElectionStoreError,
                         FileElectionStore,
                         Heartbeat,
                         HeartbeatAck,
                         MemoryElectionStore,
                         Persist,
                         PreVote,
                         PreVoteReply,
                         RequestVote,
                         SteppedDown,
                         Vote,
                         decode_election,
)
from .epoch.recovery import RecoveryError, RecoveryServer, fetch_stage, manifest_digest
from .epoch.relayout import assemble_stage, needed_stages
from .epoch.runner import RunEnd, StageRunner, StepReport, params_sha256
from .messages import ControlMsg
from .plane import ControlPlane

__all__ = [
                         "ALLOCATION_DOMAIN",
                         "MAX_ALLOCATION_BYTES",
                         "PLACEMENTS",
                         "REFUSAL_CODES",
                         "AcceptContext",
                         "Allocation",
                         "BecameCoordinator",
                         "Certificate",
                         "CommConfig",
                         "ControlMsg",
                         "ControlPlane",
                         "CoordinatorKnown",
                         "ElectionAction",
                         "ElectionConfig",
                         "ElectionMessage",
                         "ElectionRole",
                         "ElectionSend",
                         "ElectionService",
                         "ElectionState",
                         "ElectionStore",
                         "ElectionStoreError",
                         "FileElectionStore",
                         "Heartbeat",
                         "HeartbeatAck",
                         "Holding",
                         "MemoryElectionStore",
                         "PeerRunState",
                         "Placement",
                         "PlaneConfig",
                         "Persist",
                         "PreVote",
                         "PreVoteReply",
                         "RecoveryError",
                         "RecoveryServer",
                         "Refusal",
                         "RequestVote",
                         "ReshapePlan",
                         "ResumeError",
                         "ResumePoint",
                         "RunEnd",
                         "SignedAllocation",
                         "StageRunner",
                         "StepReport",
                         "SteppedDown",
                         "TensorRouter",
                         "TrainError",
                         "TrainRequest",
                         "TransportComm",
                         "Vote",
                         "assemble_stage",
                         "check_allocation",
                         "choose_shape",
                         "decode_election",
                         "fetch_stage",
                         "manifest_digest",
                         "needed_stages",
                         "params_sha256",
                         "random_shape",
                         "reshape",
                         "resume_point",
                         "sched_spec",
]
