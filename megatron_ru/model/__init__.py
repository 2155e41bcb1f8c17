"""GPT/LLaMA-family decoder built from tensor-parallel layers (see docs/model.md)."""
from megatron_ru.model.gpt import (EmbeddingLayer, FinalNorm, GPTLoss, GPTModel, OutputLayer, PipelineLayer,
                                   pipeline_layers, tied_output_logits)
from megatron_ru.model.transformer import TransformerLayer

__all__ = ["EmbeddingLayer", "FinalNorm", "GPTLoss", "GPTModel", "OutputLayer", "PipelineLayer", "TransformerLayer",
           "pipeline_layers", "tied_output_logits"]
