"""dtfm.control: agreement on who does what, and running it.

Signed allocations and their acceptance, the coordinator election and its driver, the Comm over
the peer transport, the trainer service that runs a stage inside the daemon, the coordinator's
hand-out protocol, reconfiguration (resume point, re-allocation) and weight recovery. Sits above gossip,
sched and train, below the daemon, which only starts it as a service.
"""

from .allocation import (
                         ALLOCATION_DOMAIN,
                         MAX_ALLOCATION_BYTES,
                         REFUSAL_CODES,
                         AcceptContext,
                         Allocation,
                         Refusal,
                         SignedAllocation,
                         check_allocation,
)
from .allocation_fields import Holding
from .coordinator import ElectionService
from .dataplane import CommConfig, TensorRouter, TransportComm
from .election import (
                         BecameCoordinator,
                         CoordinatorKnown,
                         ElectionAction,
                         ElectionConfig,
                         ElectionRole,
                         ElectionSend,
                         ElectionState,
                         Persist,
                         SteppedDown,
)
from .election_messages import (
                         ElectionMessage,
                         Heartbeat,
                         HeartbeatAck,
                         PreVote,
                         PreVoteReply,
                         RequestVote,
                         Vote,
                         decode_election,
)
from .election_store import ElectionStore, ElectionStoreError, FileElectionStore, MemoryElectionStore
from .messages import ControlMsg
from .plane import ControlPlane, TrainerConfig
from .recovery import RecoveryError, RecoveryServer, fetch_stage, manifest_digest
from .relayout import assemble_stage, needed_stages
from .request import TrainError, TrainRequest
from .reshape import Current, ReshapePlan, reshape
from .runner import RunEnd, StageRunner, StepReport, params_sha256
from .runstate import PeerRunState, ResumeError, ResumePoint, resume_point
from .schedule import PLACEMENTS, Shape, choose_shape, random_shape, sched_spec

__all__ = [
                         "ALLOCATION_DOMAIN",
                         "MAX_ALLOCATION_BYTES",
                         "PLACEMENTS",
                         "REFUSAL_CODES",
                         "AcceptContext",
                         "Allocation",
                         "BecameCoordinator",
                         "CommConfig",
                         "ControlMsg",
                         "ControlPlane",
                         "CoordinatorKnown",
                         "Current",
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
                         "Shape",
                         "SignedAllocation",
                         "StageRunner",
                         "StepReport",
                         "SteppedDown",
                         "TensorRouter",
                         "TrainError",
                         "TrainRequest",
                         "TrainerConfig",
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
