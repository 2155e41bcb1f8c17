"""A run resuming from a checkpoint of another model shape: one error naming each model flag whose
value differs, with both values, before the model is built (the checkpoint records its model
arguments). Without this, DeepSpeed's loader printed one ``size mismatch`` line per tensor."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_ru.checkpointing.files import CheckpointError
from megatron_ru.config.base import flag_name
from megatron_ru.flags.checkpoint_args import RUN_CHOICES, checkpoint_model_args
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.spec import model_config_from_dict, parameter_specs


def _shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    return {p.name: tuple(p.shape) for p in parameter_specs(cfg, vocab_size)}


def model_mismatch(meta: Any, cfg: ModelConfig, vocab_size: int, load: str) -> Optional[str]:
    """Why the checkpoint ``meta`` (in ``load``) cannot be loaded into a model of ``cfg`` with
    ``vocab_size`` rows: its parameters differ in names or shapes. None when they agree, or when the
    checkpoint did not record its model arguments (the loader then says what it finds)."""
    recorded = checkpoint_model_args(meta)
    if recorded is None:
        return None
    try:
        saved = model_config_from_dict(recorded)
    except (ValueError, TypeError):
        return None  # a newer megatron_ru's checkpoint: the loader refuses it by name
    saved_vocab = meta.vocab_size if meta.vocab_size is not None else vocab_size
    if (saved.lora is None) != (cfg.lora is None):  # adapters start fresh on a base (or are not wanted)
        saved, cfg = dataclasses.replace(saved, lora=None), dataclasses.replace(cfg, lora=None)
    if _shapes(saved, saved_vocab) == _shapes(cfg, vocab_size):
        return None
    diffs = []
    for f in dataclasses.fields(ModelConfig):
        ours, theirs = getattr(cfg, f.name), getattr(saved, f.name)
        if f.name in RUN_CHOICES or ours == theirs:
            continue
        flag = "--lora-* flags (adapters)" if f.name == "lora" else flag_name(f.name)
        diffs.append(f"{flag}: the checkpoint has {theirs!r}, this run {ours!r}")
    if saved_vocab != vocab_size:
        diffs.append(f"vocabulary rows (the tokenizer's size, --vocab-size): the checkpoint has {saved_vocab}, this "
                     f"run {vocab_size}")
    return (f"--load {load}: the checkpoint (iteration {meta.iteration}) holds another model than this run builds: "
            f"{'; '.join(diffs) or 'its parameters have other shapes'}. Give the checkpoint's values, or add "
            f"--use-checkpoint-args to take the model flags from it")


def check_model_matches(meta: Any, cfg: ModelConfig, vocab_size: int, load: str) -> None:
    """:func:`model_mismatch` for the checkpoint ``load`` points at (``meta``, its metadata as start-up read it:
    ``Arguments.load_target``; None: no checkpoint), as a :class:`CheckpointError`."""
    if meta is None:
        return
    problem = model_mismatch(meta, cfg, vocab_size, load)
    if problem:
        raise CheckpointError(problem)
