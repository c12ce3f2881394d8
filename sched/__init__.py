"""dtfm.sched: the DT-FM allocation scheduler (cost model, search, simulator, scenarios).

Pure numpy/scipy: no torch, no network. The swarm calls `solve` on its measured view.
"""

from .cost import CostBreakdown, CostModel
from .layers import layer_ranges, split_layers
from .matching import bottleneck_matching
from .path import open_path
from .search import SEARCH_PROFILES, SearchConfig
from .simulate import SimResult
from .simulate import simulate as simulate_iteration
from .solve import Allocation, candidate_shapes, cost_model, evaluate, solve
from .spec import PAPER_GPT3_XL, PRESETS, CommSpec, ModelSpec, Workload, get_preset

__all__ = [
    "Allocation", "CommSpec", "CostBreakdown", "CostModel", "ModelSpec", "PAPER_GPT3_XL", "PRESETS",
    "SEARCH_PROFILES", "SearchConfig", "SimResult", "Workload",
    "bottleneck_matching", "candidate_shapes", "cost_model", "evaluate", "get_preset", "layer_ranges",
    "open_path", "simulate_iteration", "solve", "split_layers",
]
