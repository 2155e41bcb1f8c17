"""GPT/LLaMA-family decoder built from tensor-parallel layers (see docs/model.md).

The layers are imported on first use (PEP 562): the description (:mod:`megatron_ru.model.spec`), the shard
arithmetic and the FLOP count are read by the planner, which builds no layer and so need not import torch's
compiler with them (``python -m megatron_ru.plan --help`` stays quick on a login node).
"""
from importlib import import_module
from typing import Any

_HOME = {"EmbeddingLayer": "gpt", "FinalNorm": "gpt", "GPTLoss": "gpt", "GPTModel": "gpt", "OutputLayer": "gpt",
         "PipelineLayer": "gpt", "pipeline_layers": "gpt", "tied_output_logits": "gpt",
         "TransformerLayer": "transformer"}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value
