"""Checkpoints in canonical names: read any megatron_ru checkpoint as full tensors, write one at any
(TP, PP), reshard (with optimizer state). See :mod:`megatron_ru.checkpointing.layout` for the format."""
from megatron_ru.checkpointing.layout import LAYERS_FORMAT
from megatron_ru.checkpointing.reader import CheckpointReader, read_checkpoint
from megatron_ru.checkpointing.writer import write_checkpoint

__all__ = ["LAYERS_FORMAT", "CheckpointReader", "read_checkpoint", "write_checkpoint"]
