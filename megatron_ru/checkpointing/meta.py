"""A checkpoint's directory layout and its ``metadata.json``: the ``iter_XXXXXXX`` directories, the
``latest`` pointer (written last, atomically), pruning old iterations, and :class:`CheckpointMeta`, what
every checkpoint records about the run that wrote it (read by training, the offline reader and writer,
``--use-checkpoint-args`` and the tools)."""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Optional

from megatron_ru.checkpointing.files import CheckpointError, derive_expected

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
HF_SOURCE_DIR = "hf_source"   # import-hf's copy of the source config.json / generation_config.json (export reads it)
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
#: metadata.json files read by this process: (path, mtime, size) -> CheckpointMeta
_READ: dict[tuple[str, int, int], Any] = {}


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def write_text_atomic(path: str, text: str) -> None:
    """Write to a temporary name, fsync, rename over ``path`` (atomic on POSIX)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_latest_iteration(load_dir: str) -> Optional[int]:
    """The iteration in ``latest_checkpointed_iteration.txt``; None when there is no checkpoint."""
    path = os.path.join(load_dir, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
    if text == "release":
        raise CheckpointError(f"{path} says 'release' (a Megatron-LM release checkpoint); this loader reads "
                              f"checkpoints written by megatron_ru: point --load at one of those")
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number, found {text[:40]!r}; the checkpoint "
                              f"directory is damaged: fix or remove the file, or point --load elsewhere")
    return int(text)


def pointed_checkpoint(load_dir: str, step: Optional[int] = None) -> Optional[tuple[int, str]]:
    """(iteration, directory) of the checkpoint ``--load load_dir`` reads: ``iter_<step>`` of ``--ckpt-step``,
    else the one the pointer names; None when there is no pointer (and no ``step``). A pointer or step that
    names no complete checkpoint is a :class:`CheckpointError` saying what it said and which iterations are
    complete."""
    if step is None:
        pointed = read_latest_iteration(load_dir)
        return None if pointed is None else _checkpoint_of(load_dir, None, pointed)
    return _checkpoint_of(load_dir, step, None)


def _checkpoint_of(load_dir: str, step: Optional[int], pointed: Optional[int]) -> tuple[int, str]:
    """(iteration, directory) of ``--ckpt-step step``, else of the iteration the pointer said (``pointed``,
    already read); a :class:`CheckpointError` when that names no complete checkpoint."""
    pointer = os.path.join(load_dir, TRACKER_FILE)
    if step is None:
        assert pointed is not None
        step, source = pointed, f"{pointer} says {pointed}"
    else:
        source = f"--ckpt-step {step} asks for iteration {step}"
    ckpt_dir = os.path.join(load_dir, iteration_dir_name(step))
    if os.path.isfile(os.path.join(ckpt_dir, METADATA_FILE)):
        return step, ckpt_dir
    state = "does not exist" if not os.path.isdir(ckpt_dir) else f"is incomplete (no {METADATA_FILE}: its save never finished)"
    complete = complete_iterations(load_dir)
    found = (f"the complete checkpoints there are iterations {', '.join(map(str, complete[-6:]))}" if complete
             else "there is no complete checkpoint there")
    raise CheckpointError(f"{source}, but {ckpt_dir} {state}; {found}: write one of them into {pointer} (or pass "
                          f"--ckpt-step N), or point --load elsewhere")


def list_iterations(save_dir: str) -> list[int]:
    if not os.path.isdir(save_dir):
        return []
    out = [int(m.group(1)) for m in (_ITER_RE.match(n) for n in os.listdir(save_dir)) if m]
    return sorted(out)


def complete_iterations(save_dir: str) -> list[int]:
    """The iterations of ``save_dir`` whose directory holds ``metadata.json`` (a save writes it last)."""
    return [i for i in list_iterations(save_dir)
            if os.path.isfile(os.path.join(save_dir, iteration_dir_name(i), METADATA_FILE))]


def prune_checkpoints(save_dir: str, keep_last: int, current: int) -> list[int]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never ``current``)."""
    iters = [i for i in list_iterations(save_dir) if i <= current]
    doomed = iters[:-keep_last] if keep_last > 0 else []
    for it in doomed:
        if it != current:
            shutil.rmtree(os.path.join(save_dir, iteration_dir_name(it)), ignore_errors=True)
    return doomed


@dataclass
class CheckpointMeta:
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    args: dict[str, Any]
    #: every ``*.pt`` file of the checkpoint with its size in bytes (None: saved before the list existed)
    files: Optional[dict[str, int]] = None
    #: every ModelConfig field (``megatron_ru.model.spec.model_args_dict``); None: saved before they were recorded
    model_args: Optional[dict[str, Any]] = None
    #: the model's vocabulary rows V (unpadded; config.json's vocab_size for imported models)
    vocab_size: Optional[int] = None
    #: how to build the tokenizer saved with the checkpoint (import-hf): tokenizer flags, paths relative to
    #: the --load directory; None: the run's own tokenizer flags
    tokenizer: Optional[dict[str, Any]] = None
    #: None: DeepSpeed's own files; "megatron_ru.layers": tensors by canonical name, written by training
    #: (checkpointing/saver.py) or by write_checkpoint (reshard, import-hf); both load at any layout
    format: Optional[str] = None
    #: layer format: the state all parameters share (step, lr_scheduler, loss_scaler, ...); None: no optimizer
    optimizer: Optional[dict[str, Any]] = None
    #: layer format written by a training run: how many data-parallel ranks' ``optim_states-pp*-tp*-dp*.pt``
    #: files hold the optimizer state (each rank's fragments); None: per-layer optimizer files (the tools)
    optimizer_fragments: Optional[int] = None
    #: DeepSpeed files: per model-parallel rank {"pp_rank", "tp_rank", "groups": [[canonical names of
    #: each optimizer group, in order]]} — how the flat optimizer state maps to parameters
    optimizer_groups: Optional[dict[str, Any]] = None
    #: written by tools/adapt_vocab.py and carried by every later save of the model: {"mode": "replace" |
    #: "extend", "old_vocab_size": int, "new_rows": [[start, stop], ...] (the rows adaptation initialised)}
    vocab_adaptation: Optional[dict[str, Any]] = None
    #: a run with LoRA adapters that started from a checkpoint without them: {"load": dir, "iteration": N}
    #: of that base; the files then hold only the trained tensors (adapters, --lora-modules-to-save) and
    #: the frozen ones are read from the base
    lora_base: Optional[dict[str, Any]] = None

    @classmethod
    def read(cls, ckpt_dir: str) -> "CheckpointMeta":
        path = os.path.join(ckpt_dir, METADATA_FILE)
        pointer = os.path.join(os.path.dirname(os.path.abspath(ckpt_dir)), TRACKER_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a complete megatron_ru "
                                  f"checkpoint; point --load at a directory written by --save, or resume from "
                                  f"an earlier checkpoint by writing its iteration into {pointer}")
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
        if key not in _READ:  # read once per process and version of the file (each reader gets a copy)
            try:
                with open(path, encoding="utf-8") as f:
                    meta = cls(**json.load(f))
            except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError, missing/extra fields
                raise CheckpointError(
                    f"{path} is damaged ({type(e).__name__}: {str(e)[:200]}); it describes the checkpoint and is "
                    f"written by --save: restore it from a copy, or resume from an earlier checkpoint by writing "
                    f"its iteration into {pointer}") from None
            if len(_READ) > 32:
                _READ.clear()
            _READ[key] = meta
        return copy.deepcopy(_READ[key])

    def expected_files(self, present: list[str]) -> dict[str, Optional[int]]:
        """Every ``*.pt`` file of the checkpoint (and its size, when the save recorded it)."""
        if self.files is not None:
            return dict(self.files)
        if self.format is not None and self.model_args is not None and self.vocab_size is not None:
            from megatron_ru.checkpointing.layout import derive_layers_expected
            from megatron_ru.model.spec import model_config_from_dict
            return derive_layers_expected(model_config_from_dict(self.model_args), int(self.vocab_size),
                                          self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                                          self.data_parallel_size, self.optimizer_fragments,
                                          self.optimizer is not None, present)
        return derive_expected(self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                               self.data_parallel_size, self.zero_stage, present)


@dataclass(frozen=True)
class LoadTarget:
    """What ``--load`` points at, resolved once per process (:func:`resolve_load`; ``Arguments.load_target``
    holds it): ``--use-checkpoint-args``, the ``--save``/``--load`` checks, the model's vocabulary rows, the
    model check and the load itself all read this record instead of the files. Beyond saving reads, this
    closes a race: another job moving ``latest_checkpointed_iteration.txt`` between the checks and the load
    cannot make the run check one iteration and load another, because the pointer is read once."""
    load_dir: str
    #: ``--ckpt-step``: the iteration asked for (the pointer is then not read)
    step: Optional[int]
    #: what the pointer said (None: no pointer, or not read because ``step`` was given)
    pointer: Optional[int]
    #: the iteration to load and its directory; None: no checkpoint (no pointer and no ``step``)
    iteration: Optional[int]
    ckpt_dir: Optional[str]
    meta: Optional[CheckpointMeta]


def resolve_load(load_dir: str, step: Optional[int] = None) -> LoadTarget:
    """Read ``load_dir``'s pointer (unless ``step``) and the pointed checkpoint's ``metadata.json``, once.
    Raises :class:`CheckpointError` as :func:`pointed_checkpoint` and :meth:`CheckpointMeta.read` do."""
    pointer = None if step is not None else read_latest_iteration(load_dir)
    if step is None and pointer is None:
        return LoadTarget(load_dir, None, None, None, None, None)
    iteration, ckpt_dir = _checkpoint_of(load_dir, step, pointer)
    return LoadTarget(load_dir, step, pointer, iteration, ckpt_dir, CheckpointMeta.read(ckpt_dir))


def zero_partition_problems(meta: CheckpointMeta, dp: int, zero_stage: int, load_optim: bool,
                            load_dir: str = "DIR") -> list[str]:
    """Why a DeepSpeed checkpoint of this run's TP/PP cannot be loaded at the current DP size and ZeRO stage
    (empty list: it can; another TP/PP is loaded by canonical names, see :func:`_load_other_layout`)."""
    out = []
    if load_optim and (meta.data_parallel_size != dp or meta.zero_stage != zero_stage) and \
            max(meta.zero_stage, zero_stage) > 0:
        out.append(
            f"the checkpoint's optimizer state is partitioned for ZeRO stage {meta.zero_stage} over "
            f"{meta.data_parallel_size} data-parallel ranks, this run uses stage {zero_stage} over {dp}: "
            f"keep the data-parallel size and --zero-stage, or load weights only with --no-load-optim or "
            f"--finetune (optimizer state is re-partitioned by name only from ZeRO stage 0 or 1 checkpoints "
            f"that record their model arguments, into runs with ZeRO stage 0, 1 or 2)")
    return out
