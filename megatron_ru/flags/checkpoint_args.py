"""``--use-checkpoint-args`` (Megatron's flag): the model's shape flags come from the checkpoint in
``--load``, so a continued-pretraining command does not repeat (and cannot mistype) them.

Every :class:`ModelConfig` field the checkpoint recorded is taken from it; a flag given on the
command line that contradicts the checkpoint is an error naming both values (equal values are
fine). Dropout is the run's choice, but its default comes from the checkpoint too: an imported
LLaMA / Mistral / Qwen2 records its source's (0: those models are trained without dropout, and
Megatron's default 0.1 would train a broken network — SmolLM2's first loss on Russian text is 12.4
nats with it, 2.1 without), and every later checkpoint (adapted, LoRA, continued) records the
dropout it was trained with; ``--hidden-dropout``/``--attention-dropout`` given on the command line
win without a conflict. Tokenizer flags not given on the command line come from the tokenizer recorded with the
checkpoint (``tools/convert_checkpoint.py import-hf`` copies the model's tokenizer next to it).
The model's vocabulary rows (``vocab_size`` in the metadata; for imported models config.json's,
which may exceed the tokenizer's size) are recorded on :class:`Arguments` as ``model_vocab_size``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Optional

from megatron_ru.config.base import flag_name
from megatron_ru.config.model import ModelConfig
from megatron_ru.config.tokenizer import TokenizerConfig

if TYPE_CHECKING:
    from megatron_ru.flags.arguments import Arguments
    from megatron_ru.checkpointing.meta import CheckpointMeta

#: model fields that do not describe the weights: the run may choose them freely
RUN_CHOICES = frozenset({"hidden_dropout", "attention_dropout", "recompute_granularity", "checkpoint_activations",
                         "init_method_std"})
#: run choices whose default is the checkpoint's recorded value (a flag on the command line wins)
CHECKPOINT_DEFAULTS = ("hidden_dropout", "attention_dropout")
_PATH_FIELDS = ("tokenizer_model", "vocab_file", "merge_file")


def read_checkpoint_meta(load_dir: str, step: Optional[int] = None) -> Optional["CheckpointMeta"]:
    """The metadata of the checkpoint ``load_dir`` points at, or of its iteration ``step`` (``--ckpt-step``);
    None when there is no pointer and no ``step``."""
    from megatron_ru.checkpointing.meta import resolve_load
    return resolve_load(load_dir, step).meta


def checkpoint_model_args(meta: "CheckpointMeta") -> Optional[dict[str, Any]]:
    """The ModelConfig fields a checkpoint recorded (older checkpoints: its saved run arguments)."""
    if meta.model_args is not None:
        return meta.model_args
    return (meta.args or {}).get("model")


def apply_checkpoint_args(args: "Arguments", explicit: set[str]) -> None:
    """Fill ``args.model`` (and tokenizer flags not in ``explicit``) from ``--load``'s checkpoint;
    raise one ValueError listing every flag that contradicts it."""
    load = args.checkpoint.load
    if not load:
        raise ValueError("--use-checkpoint-args takes the model's flags from a checkpoint: add --load DIR")
    meta = args.load_target().meta  # read here, once: start-up's checks and the load reuse it
    if meta is None:
        raise ValueError(f"--use-checkpoint-args: --load {load} holds no checkpoint "
                         f"(no latest_checkpointed_iteration.txt); point --load at a directory written by --save "
                         f"or by tools/convert_checkpoint.py")
    recorded = checkpoint_model_args(meta)
    if recorded is None:
        raise ValueError(f"--use-checkpoint-args: the checkpoint in {load} did not record its model arguments; "
                         f"give the model flags on the command line instead")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    conflicts: list[str] = []
    for name, value in recorded.items():
        if name in CHECKPOINT_DEFAULTS and name not in explicit and value is not None:
            setattr(args.model, name, value)
        if name not in known or name in RUN_CHOICES:
            continue
        given = getattr(args.model, name)
        if name in explicit and given != value:
            conflicts.append(f"{flag_name(name)} {given!r} contradicts the checkpoint's {value!r}")
        else:
            setattr(args.model, name, value)
    if conflicts:
        raise ValueError(f"--use-checkpoint-args: {'; '.join(conflicts)} ({load}); drop these flags to use the "
                         f"checkpoint's values, or drop --use-checkpoint-args")
    args.model_vocab_size = meta.vocab_size
    if meta.tokenizer and not (explicit & {f.name for f in dataclasses.fields(TokenizerConfig)} - {
            "tokenizer_num_threads", "eod_token"}):
        for name, value in meta.tokenizer.items():
            if name in explicit:  # --eod-token given with the recorded tokenizer
                continue
            if name in _PATH_FIELDS and value is not None and not os.path.isabs(value):
                value = os.path.join(load, value)
            setattr(args.tokenizer, name, value)
