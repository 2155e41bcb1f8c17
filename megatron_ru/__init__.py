"""megatron_ru: Megatron-DeepSpeed-style 3D-parallel pretraining for GPT/LLaMA-family models."""

__version__ = "0.1.0"
