"""Memory and throughput model of a training layout (issue 14): what one GPU holds and how fast a
step runs, for every candidate TP x PP x DP x micro batch x recomputation x ZeRO layout.

``python -m megatron_ru.plan`` (or ``tools/plan_layout.py``) ranks the layouts that fit; the
formulas and their sources are in docs/planner.md. For a run's own flags:
``predict_for_arguments(args, world_size).summary()``.
"""
from megatron_ru.plan.api import layout_for_arguments, predict_for_arguments
from megatron_ru.plan.layout import Layout
from megatron_ru.plan.memory import MemoryPrediction, predict_memory
from megatron_ru.plan.params import StageParams, stage_param_counts, stage_params

__all__ = ["Layout", "MemoryPrediction", "StageParams", "layout_for_arguments", "predict_for_arguments",
           "predict_memory", "stage_param_counts", "stage_params"]
