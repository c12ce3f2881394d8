"""dtfm.control: agreement on who does what, and running it.

The coordinator election (election/), signed allocations (allocation/), the plane's two sans-IO
machines, `EpochMachine` (epoch/) and `Coordinator` (coordinator/), with `ControlPlane`, the IO
shell that runs them inside the daemon, the Comm over the peer transport (dataplane/), and
weight recovery. Sits above gossip, sched and train, below the daemon, which only starts it as
a service. See docs/control.md.
"""

from dtfm.lazy import lazy_exports
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    from .coordinator.request import HF_PRESET_PREFIX, KNOBS, PLACEMENTS, TrainError, TrainRequest, hf_preset
    from .coordinator.reshape import ReshapePlan, reshape
    from .epoch.runstate import PeerRunState, ResumeError, ResumePoint, resume_point
    from .coordinator.schedule import Placement, choose_shape, random_shape, sched_spec
    from .compute import MachineNow, kind_factors
    from .config import DEVICE_RE, PlaneConfig
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
    from .epoch.report import RunEnd, StepReport
    from .epoch.runner import StageRunner, params_sha256
    from .messages import ControlMsg
    from .operator import (
        OperatorError,
        OperatorOp,
        SignedOp,
        check_council,
        check_op,
        check_operator_start,
        council_arg,
        root_council,
        sign_op,
    )
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
                         "OperatorError",
                         "OperatorOp",
                         "PeerRunState",
                         "Placement",
                         "PlaneConfig",
                         "DEVICE_RE",
                         "HF_PRESET_PREFIX",
                         "KNOBS",
                         "hf_preset",
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
                         "SignedOp",
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
                         "check_op",
                         "check_operator_start",
                         "choose_shape",
                         "decode_election",
                         "fetch_stage",
                         "manifest_digest",
                         "needed_stages",
                         "params_sha256",
                         "random_shape",
                         "reshape",
                         "resume_point",
                         "sched_spec", "kind_factors", "MachineNow",
                         "sign_op", "check_council", "council_arg", "root_council",
]

# Where each name above is defined. A name is imported from its module on first use (PEP 562):
# a command that needs only light parts of the package (`dtfm-peer status` reads the daemon's
# config classes) does not load torch, scipy or the rest. tests/test_layers.py checks that this
# table, the imports above and __all__ name the same things.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".allocation": (
        "ALLOCATION_DOMAIN", "MAX_ALLOCATION_BYTES", "REFUSAL_CODES", "AcceptContext", "Allocation",
        "Holding", "Refusal", "SignedAllocation", "check_allocation",
    ),
    ".coordinator.request": ("HF_PRESET_PREFIX", "KNOBS", "PLACEMENTS", "TrainError", "TrainRequest", "hf_preset"),
    ".coordinator.reshape": ("ReshapePlan", "reshape"),
    ".epoch.runstate": ("PeerRunState", "ResumeError", "ResumePoint", "resume_point"),
    ".coordinator.schedule": ("Placement", "choose_shape", "random_shape", "sched_spec"),
    ".compute": ("MachineNow", "kind_factors"),
    ".config": ("DEVICE_RE", "PlaneConfig"),
    ".dataplane": ("CommConfig", "TensorRouter", "TransportComm"),
    ".election": (
        "BecameCoordinator", "Certificate", "CoordinatorKnown", "ElectionAction", "ElectionConfig", "ElectionMessage",
        "ElectionRole", "ElectionSend", "ElectionService", "ElectionState", "ElectionStore",
        "ElectionStoreError", "FileElectionStore", "Heartbeat", "HeartbeatAck", "MemoryElectionStore",
        "Persist", "PreVote", "PreVoteReply", "RequestVote", "SteppedDown", "Vote", "decode_election",
    ),
    ".epoch.recovery": ("RecoveryError", "RecoveryServer", "fetch_stage", "manifest_digest"),
    ".epoch.relayout": ("assemble_stage", "needed_stages"),
    ".epoch.report": ("RunEnd", "StepReport"),
    ".epoch.runner": ("StageRunner", "params_sha256"),
    ".messages": ("ControlMsg",),
    ".operator": ("OperatorError", "OperatorOp", "SignedOp", "check_council", "check_op", "check_operator_start",
                  "council_arg", "root_council", "sign_op"),
    ".plane": ("ControlPlane",),
}
__getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())
