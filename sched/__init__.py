"""dtfm.sched: the DT-FM allocation scheduler (cost model, search, simulator, scenarios).

Pure numpy/scipy: no torch, no network. The swarm calls `solve` on its measured view.
"""

from .cost import CostBreakdown, CostModel, split_layers
from .matching import bottleneck_matching
from .path import open_path
from .scenario import Scenario, ScenarioError, builtin_scenarios, load_scenario
from .search import SearchConfig
from .solve import Allocation, candidate_shapes, evaluate, solve
from .spec import PAPER_GPT3_XL, PRESETS, CommSpec, ModelSpec, Workload, get_preset

__all__ = [
    "Allocation", "CommSpec", "CostBreakdown", "CostModel", "ModelSpec", "PAPER_GPT3_XL", "PRESETS",
    "Scenario", "ScenarioError", "SearchConfig", "Workload", "bottleneck_matching", "builtin_scenarios",
    "candidate_shapes", "evaluate", "get_preset", "load_scenario", "open_path", "solve", "split_layers",
]
