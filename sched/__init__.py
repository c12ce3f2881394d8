"""dtfm.sched: the DT-FM allocation scheduler (cost model, search, simulator, scenarios).

Pure numpy/scipy: no torch, no network. The swarm calls `solve` on its measured view.
With `CompressionOptions` the cost model and the simulator price each codec's payload and
coding time, and `choose_compression` picks a codec per pipeline link and DP group.
"""

from .choose import ChoiceReason, CompressionPlan, GroupChoice, LinkChoice, choose_compression
from .compression import (CODEC_SPEED_LEN, REFERENCE_CODEC_SPEED, STEP_EFFICIENCY, WIRE_PRESETS, CodecAssignment, CodecSpeed,
                          CompressionFields, CompressionOptions, DataParallelCodec, PipelineCodec, compression_options,
                          load_codec_speed, shape_step_efficiency, step_efficiency, wire_codecs)
from .cost import CostBreakdown, CostModel
from .fastest import (FIT_SHARE, MAX_MICRO_BATCHES, REFINE_MAX_PEERS, REFINE_SHARE, SCHEDULE_GAIN_BOUND, FastestShape, RunModel, ScheduleInputs, fit_in_order,
                      micro_batch_options, refine_by_simulation, shape_space, solve_fastest)
from .layers import layer_ranges, split_layers
from .matching import bottleneck_matching, linear_assignment
from .path import open_path
from .search import SEARCH_PROFILES, SearchConfig
from .simulate import TRAINER_WINDOW_MESSAGES, FittedSchedule, SimResult, check_warmups, fitted_warmups, stage_program
from .simulate import simulate as simulate_iteration
from .solve import Allocation, candidate_shapes, cost_model, evaluate, solve
from .spec import PAPER_GPT3_XL, PRESETS, UPDATE_KIND, CommSpec, ModelSpec, Workload, get_preset, update_s_per_param

__all__ = [
    "Allocation", "FastestShape", "MAX_MICRO_BATCHES", "RunModel", "ScheduleInputs", "micro_batch_options",
    "shape_space", "solve_fastest", "REFINE_MAX_PEERS", "REFINE_SHARE", "FIT_SHARE", "SCHEDULE_GAIN_BOUND", "fit_in_order", "refine_by_simulation", "CODEC_SPEED_LEN", "ChoiceReason", "CodecAssignment", "CodecSpeed", "CommSpec", "CompressionFields",
    "CompressionOptions", "CompressionPlan", "CostBreakdown", "CostModel", "DataParallelCodec", "GroupChoice",
    "LinkChoice", "ModelSpec", "PAPER_GPT3_XL", "PRESETS", "PipelineCodec", "REFERENCE_CODEC_SPEED",
    "SEARCH_PROFILES", "STEP_EFFICIENCY", "SearchConfig", "SimResult", "TRAINER_WINDOW_MESSAGES", "WIRE_PRESETS", "Workload",
    "bottleneck_matching", "candidate_shapes", "choose_compression", "compression_options", "cost_model",
    "evaluate", "get_preset", "layer_ranges", "linear_assignment", "load_codec_speed", "open_path", "simulate_iteration", "solve", "split_layers",
    "shape_step_efficiency", "step_efficiency", "UPDATE_KIND", "update_s_per_param",
    "wire_codecs", "check_warmups", "FittedSchedule", "fitted_warmups", "stage_program",
]
