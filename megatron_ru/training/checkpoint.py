"""Checkpoints: one directory per iteration, an atomic ``latest`` pointer, loading at any layout.

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt     "10" — Megatron's pointer, replaced atomically last
    DIR/iter_0000010/
        metadata.json                         iteration, consumed samples, layout, args, model arguments, the
                                              optimizer's shared state, and every *.pt file with its size
                                              (rank 0, after all ranks wrote)
        layer_XX-model_YY-model_states.pt     pipeline layer XX's TP shard YY by canonical local name
        optim_states-ppPP-tpTT-dpDDD.pt       the optimizer state (fp32 masters, Adam moments) that rank holds
        rng_rank_00003.pt                     RNG states of every rank

That is the layer format (``--ckpt-format megatron_ru``, the default; megatron_ru/checkpointing/saver.py):
every rank writes its own slices under temporary names, renamed when complete. ``--ckpt-format deepspeed``
(and ``auto`` where only DeepSpeed's files hold the optimizer state: ZeRO 3, fp16 without ZeRO) has
DeepSpeed write its own model/optimizer files instead (``save_checkpoint`` with our tag and
``save_latest=False``, its writes routed through a recorder). Either way we add the metadata and RNG files
and own the pointer: it is written to a temporary name and ``os.replace``-d only after every rank reported
its files written, so a crash during a save leaves the previous checkpoint current. A save that fails on
any rank (a full disk) is abandoned by all ranks together: the partial directory is removed, the pointer
stays, and the error says "no space left on DEVICE while writing PATH".

Loading first checks that every file the load needs is there with its saved size (one error naming the
missing or truncated files). The layer format, and DeepSpeed's files at another TP/PP/DP size or ZeRO
stage, are loaded by canonical names (:mod:`megatron_ru.checkpointing.loader`): each rank reads its own
tensors and keeps its slices; RNG states are restored at the saved layout and re-seeded (one line says so)
at another. DeepSpeed's files at their own layout go through DeepSpeed's loader, which then reads exactly
this rank's files (it never merges or splits our TP shards). Nothing is unpickled as code: every file is
read with ``torch.load(weights_only=True)`` (DeepSpeed's optimizer files need four of its plain data
classes, allow-listed explicitly). Every problem with a checkpoint is a :class:`CheckpointError` (a
``ValueError``) naming the file and the fix.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable, Optional

import torch

from megatron_ru.checkpointing.files import (CheckpointError, CheckpointSaveError, check_files, describe_write_failure,
                                             file_kind, list_files, rng_file_name, safe_load)
from megatron_ru.checkpointing.layout import LAYERS_FORMAT
from megatron_ru.checkpointing.loader import layers_layout_problem, load_by_names
from megatron_ru.checkpointing.lora_base import verify_distributed
from megatron_ru.checkpointing.meta import (METADATA_FILE, TRACKER_FILE, CheckpointMeta, LoadTarget,
                                            complete_iterations, iteration_dir_name, zero_partition_problems,
                                            list_iterations, prune_checkpoints, read_latest_iteration,
                                            resolve_load, write_text_atomic)
from megatron_ru.checkpointing.saver import write_rank_files
from megatron_ru.checkpointing.writer import jsonable
from megatron_ru.config.lora import is_adapter_parameter
from megatron_ru.deepspeed_bridge import compat as dsc
from megatron_ru.deepspeed_bridge import masters as dsm
from megatron_ru.model.spec import canonical_name, model_config_from_dict
from megatron_ru.parallel.launcher_watch import exit_if_launcher_gone
from megatron_ru.utils.logging import get_logger, log_rank0

__all__ = ["CheckpointError", "CheckpointSaveError", "CheckpointMeta", "load_checkpoint", "save_checkpoint",
           "read_latest_iteration", "safe_load", "write_text_atomic"]

log = get_logger(__name__)


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _all_gather(obj: Any) -> list[Any]:
    if not torch.distributed.is_initialized():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _save_error(recorder: dsc.SaveRecorder) -> Optional[str]:
    return None if recorder.failure is None else describe_write_failure(*recorder.failure)


def _abandon(errors: list[str], ckpt_dir: str, save_dir: str, iteration: int, rank: int) -> CheckpointSaveError:
    """Every rank: remove the partial directory (rank 0) and build the one error all ranks raise."""
    if rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    _barrier()
    previous = read_latest_iteration(save_dir)
    kept = (f"iteration {previous} ({os.path.join(save_dir, iteration_dir_name(previous))}) is still the "
            f"current checkpoint" if previous is not None else "no earlier checkpoint exists")
    more = f" (and {len(errors) - 1} more failed writes on other ranks)" if len(errors) > 1 else ""
    return CheckpointSaveError(
        f"{errors[0]}{more}: the save of iteration {iteration} was abandoned and its partial directory "
        f"{ckpt_dir} removed; {kept}. Free space (e.g. a smaller --keep-last) or point --save at a file "
        f"system with room")


def optimizer_groups_record(engine: Any, meta: CheckpointMeta) -> Optional[tuple[int, dict[str, Any]]]:
    """(DeepSpeed's model-parallel rank, {"pp_rank", "tp_rank", "groups": [[canonical names]]}) of this
    rank: the order in which the optimizer holds the parameters, so that an offline reader
    (megatron_ru.checkpointing) maps the saved optimizer state to parameters without guessing."""
    try:
        cfg = model_config_from_dict(meta.model_args) if meta.model_args else None
        mpu = getattr(engine, "mpu", None)
        if getattr(engine, "optimizer", None) is None or (mpu is not None and mpu.get_data_parallel_rank() != 0):
            return None  # one record per model-parallel rank (the data-parallel replicas hold the same order)
        mp_rank, groups = dsc.optimizer_param_names(engine)
        if cfg is not None:
            groups = [[canonical_name(n, cfg) for n in g] for g in groups]
        pp_rank = mpu.get_pipe_parallel_rank() if mpu is not None else 0
        tp_rank = mpu.get_slice_parallel_rank() if mpu is not None else 0
        return mp_rank, {"pp_rank": pp_rank, "tp_rank": tp_rank, "groups": groups}
    except Exception as e:  # noqa: BLE001 - a record the save can do without; never fail a save over it
        log.warning(f"could not record the optimizer's parameter order ({type(e).__name__}: {e}); resharding "
                    f"this checkpoint's optimizer state may be refused")
        return None


def resolve_format(engine: Any, requested: str, meta: CheckpointMeta) -> str:
    """``megatron_ru`` or ``deepspeed``: the format ``--ckpt-format`` asks for (``auto``: megatron_ru unless the
    engine's optimizer state exists only in DeepSpeed's files, or the model is not described by ``model_args``).
    An explicit ``megatron_ru`` that cannot hold this run's state is a ValueError naming the flag."""
    problem = dsm.by_name_problem(engine)
    if meta.model_args is None or meta.vocab_size is None:
        problem = "the checkpoint does not record the model's arguments"
    if requested == "deepspeed" or (requested == "auto" and problem):
        return "deepspeed"
    if problem:
        raise ValueError(f"--ckpt-format megatron_ru cannot hold this run's optimizer state ({problem}): use "
                         f"--ckpt-format deepspeed (or auto)")
    return "megatron_ru"


def _write_by_name(engine: Any, ckpt_dir: str, meta: CheckpointMeta, state: Any, recorder: dsc.SaveRecorder) -> None:
    """This rank's files in the layer format (megatron_ru/checkpointing/saver.py); the metadata says so."""
    cfg = model_config_from_dict(meta.model_args)
    pp_size, pp_rank, tp_rank, dp_rank = ((state.pp_size, state.pp_rank, state.tp_rank, state.dp_rank)
                                          if state is not None else (1, 0, 0, 0))
    write_rank_files(engine, ckpt_dir, cfg, int(meta.vocab_size), pp_size=pp_size, pp_rank=pp_rank, tp_rank=tp_rank,
                     dp_rank=dp_rank, zero_stage=meta.zero_stage, exclude_frozen=meta.lora_base is not None,
                     run=recorder.run)
    meta.format = LAYERS_FORMAT
    meta.optimizer_fragments = meta.data_parallel_size if meta.zero_stage > 0 else 1
    meta.optimizer = jsonable(dsm.engine_common_state(engine)) if getattr(engine, "optimizer", None) else None


def _coordinates(state: Any) -> tuple[int, int, int, int]:
    """(rank, TP, PP, DP) of ``state`` (this rank's ParallelState; None: one process)."""
    return (0, 1, 1, 1) if state is None else (state.rank, state.tp_size, state.pp_size, state.dp_size)


def save_checkpoint(engine: Any, save_dir: str, iteration: int, meta: CheckpointMeta, rng_state: dict[str, Any],
                    keep_last: Optional[int] = None, before_commit: Optional[Callable[[], None]] = None, *,
                    state: Any = None, ckpt_format: str = "auto") -> str:
    """Write ``iter_XXXXXXX/`` on every rank, then (rank 0, once every rank reported success) the
    pointer. Collective: every rank calls it. ``state``: this rank's ParallelState (None: one process).
    ``ckpt_format``: ``--ckpt-format``. Raises :class:`CheckpointSaveError` on every rank when a write
    failed on any."""
    rank = _coordinates(state)[0]
    ckpt_dir = os.path.join(save_dir, iteration_dir_name(iteration))
    if read_latest_iteration(save_dir) == iteration:
        return ckpt_dir  # already saved (e.g. interval save followed by the save on exit)
    fmt = resolve_format(engine, ckpt_format, meta)
    started = time.perf_counter()
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        # a directory of this iteration left by a crashed save is not current: start clean
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        os.makedirs(ckpt_dir, exist_ok=True)
    _barrier()
    # a failed write is recorded, not raised: raising half-way would leave the other ranks waiting
    # in DeepSpeed's collectives; all ranks learn of it below and give up together
    recorder = dsc.SaveRecorder()
    if fmt == "megatron_ru":
        _write_by_name(engine, ckpt_dir, meta, state, recorder)
    else:
        dsc.install_checkpoint_io(engine, safe_load, recorder)
        try:
            recorder.run(ckpt_dir, lambda: engine.save_checkpoint(
                save_dir, tag=iteration_dir_name(iteration), save_latest=False,
                exclude_frozen_parameters=meta.lora_base is not None))
        finally:
            dsc.install_checkpoint_io(engine, safe_load)
    rng_path = os.path.join(ckpt_dir, rng_file_name(rank))

    def write_rng() -> None:
        torch.save(rng_state, rng_path + ".tmp")
        os.replace(rng_path + ".tmp", rng_path)
    recorder.run(rng_path, write_rng)
    if before_commit is not None:  # test hook: simulate a crash between the files and the pointer
        before_commit()
    _barrier()  # every rank has finished its files: each lists what it sees (node-local disks too)
    gathered = _all_gather((_save_error(recorder), list_files(ckpt_dir) if recorder.failure is None else {},
                            optimizer_groups_record(engine, meta) if fmt == "deepspeed" else None))
    errors = [e for e, _, _ in gathered if e]
    if rank == 0:
        exit_if_launcher_gone(f"the save of iteration {iteration}")
    if not errors and rank == 0:
        files: dict[str, int] = {}
        groups: dict[str, Any] = {}
        for _, seen, record in gathered:
            files.update(seen)
            if record is not None:
                groups.setdefault(str(record[0]), record[1])
        meta.files = dict(sorted(files.items()))
        meta.optimizer_groups = dict(sorted(groups.items(), key=lambda kv: int(kv[0]))) or None
        path = os.path.join(ckpt_dir, METADATA_FILE)
        recorder.run(path, lambda: write_text_atomic(path, json.dumps(meta.__dict__, indent=1, default=str)))
    errors += [e for e in _all_gather(_save_error(recorder) if not errors else None) if e]
    if errors:
        raise _abandon(errors, ckpt_dir, save_dir, iteration, rank)
    if rank == 0:
        exit_if_launcher_gone(f"the save of iteration {iteration}")
        write_text_atomic(os.path.join(save_dir, TRACKER_FILE), f"{iteration}\n")
        if keep_last:
            prune_checkpoints(save_dir, keep_last, iteration)
    _barrier()
    log_rank0(log, f"saved checkpoint at iteration {iteration} to {ckpt_dir} in {time.perf_counter() - started:.1f} s "
                   f"({'by canonical name' if fmt == 'megatron_ru' else 'DeepSpeed files'})")
    return ckpt_dir


def missing_checkpoint_problem(load_dir: str, finetune: bool, save_dir: Optional[str],
                               exit_on_missing: bool = False) -> Optional[str]:
    """Why a ``load_dir`` without a pointer is an error (None: it is also --save, resume-or-start)."""
    resume_or_start = save_dir is not None and os.path.realpath(save_dir) == os.path.realpath(load_dir)
    if resume_or_start and not finetune and not exit_on_missing:
        return None
    complete = complete_iterations(load_dir)
    if not os.path.isdir(load_dir):
        found = "does not exist"
    elif complete:
        found = (f"holds complete checkpoints ({', '.join(iteration_dir_name(i) for i in complete[-4:])}) but no "
                 f"{TRACKER_FILE} (it was deleted, or copied without it)")
    elif list_iterations(load_dir):
        found = f"holds iter_* directories but no {TRACKER_FILE} (no save there completed)"
    else:
        found = f"holds no {TRACKER_FILE}" + ("" if os.listdir(load_dir) else " (it is empty)")
    if complete:
        return (f"--load {load_dir} {found}: pass --ckpt-step N to load iteration N ({complete[-1]} is the newest), "
                f"or write its number into {os.path.join(load_dir, TRACKER_FILE)}")
    why = ("--finetune starts from the weights of a checkpoint" if finetune else
           "--exit-on-missing-checkpoint asks for one" if exit_on_missing else
           "--load names a checkpoint to start from and is not the --save directory")
    return (f"--load {load_dir} {found}: {why}, and there is none. Point --load at a directory written by --save "
            f"(it holds {TRACKER_FILE})" + ("" if finetune else
                                            ", or drop --exit-on-missing-checkpoint to start from scratch"
                                            if exit_on_missing else
                                            ", pass the same directory to --save and --load to resume-or-start, "
                                            "or drop --load to start from scratch"))


def _no_checkpoint(load_dir: str, finetune: bool, save_dir: Optional[str], exit_on_missing: bool = False) -> None:
    """No pointer in ``load_dir``: fine when it is also --save (resume-or-start); otherwise an error."""
    problem = missing_checkpoint_problem(load_dir, finetune, save_dir, exit_on_missing)
    if problem:
        raise CheckpointError(problem)
    log_rank0(log, f"no {TRACKER_FILE} in {load_dir}: starting from scratch")


def load_checkpoint(engine: Any, load_dir: str, state: Any = None, *, zero_stage: int,
                    load_optim: bool, finetune: bool, load_rng: bool = True,
                    save_dir: Optional[str] = None, iteration: Optional[int] = None, exit_on_missing: bool = False,
                    target: Optional[LoadTarget] = None) -> Optional[tuple[CheckpointMeta, Optional[dict]]]:
    """Load the checkpoint ``latest`` points at (``iteration``: that one instead, ``--ckpt-step``); None when ``load_dir`` has none and is also the
    ``save_dir`` (resume-or-start). With ``finetune``, or a ``load_dir`` other than ``save_dir``, a
    missing checkpoint is a :class:`CheckpointError`.

    ``target``: ``load_dir``'s pointer and metadata as start-up already read them (``Arguments.load_target``);
    the load then reads neither file again, so it loads the very iteration start-up checked (the model's
    shape, the vocabulary, the --save directory) even if another job moved the pointer in between. Without
    it both are read here.

    ``state``: this rank's ParallelState, as :func:`save_checkpoint` takes it (None: one process).
    Returns the metadata and this rank's saved RNG state (None when ``load_rng`` is off or with
    ``finetune``)."""
    rank, tp, pp, dp = _coordinates(state)
    if target is None:
        target = resolve_load(load_dir, iteration)
    assert (target.load_dir, target.step) == (load_dir, iteration), "the target of another --load / --ckpt-step"
    if target.iteration is None:
        _no_checkpoint(load_dir, finetune, save_dir, exit_on_missing)
        return None
    iteration, ckpt_dir, meta = target.iteration, target.ckpt_dir, target.meta
    assert ckpt_dir is not None and meta is not None
    pointer = os.path.join(load_dir, TRACKER_FILE)
    weights_only = finetune or not load_optim
    if meta.lora_base is not None:  # the frozen weights first, from the checkpoint the adapters were trained on
        _load_lora_base(engine, ckpt_dir, meta.lora_base, state, zero_stage=zero_stage)
    other_dp = not weights_only and (meta.data_parallel_size != dp or meta.zero_stage != zero_stage) and \
        meta.model_args is not None and meta.zero_stage <= 1 and zero_stage <= 2 and max(meta.zero_stage, zero_stage) >= 1
    if meta.format is not None or other_dp or \
            (meta.tensor_model_parallel_size, meta.pipeline_model_parallel_size) != (tp, pp):
        return _load_any_layout(engine, load_dir, ckpt_dir, meta, rank=rank, tp=tp, pp=pp, dp=dp, zero_stage=zero_stage,
                             weights_only=weights_only, finetune=finetune, load_rng=load_rng, pointer=pointer)
    problems = zero_partition_problems(meta, dp, zero_stage, load_optim=not weights_only, load_dir=load_dir)
    if weights_only and 3 in (meta.zero_stage, zero_stage):
        problems.append(
            f"loading weights only (--finetune or --no-load-optim) with ZeRO stage 3 (the checkpoint's stage "
            f"{meta.zero_stage}, this run's {zero_stage}) is not supported: DeepSpeed gathers ZeRO-3 weights from "
            f"its partitioned files with unrestricted unpickling and a 'latest' file megatron_ru does not write; "
            f"resume the full state instead (drop --finetune/--no-load-optim; same data-parallel size and "
            f"--zero-stage as the checkpoint)")
    if problems:
        raise CheckpointError(f"cannot load {ckpt_dir}: " + "; ".join(problems))
    want_rng = load_rng and not finetune
    kinds = {"model"} | ({"optim"} if not weights_only else set()) | ({"rng"} if want_rng else set())
    present = sorted(list_files(ckpt_dir))
    check_files(ckpt_dir, meta.expected_files(present), kinds=kinds, pointer=pointer,
                earlier=[i for i in list_iterations(load_dir) if i < iteration])
    if not want_rng and not finetune:
        missing = "" if os.path.isfile(os.path.join(ckpt_dir, rng_file_name(rank))) else \
            f" ({rng_file_name(rank)} is missing from {ckpt_dir})"
        log_rank0(log, f"--no-load-rng: resuming with fresh random states{missing}; dropout and other random "
                       f"streams differ from an uninterrupted run, so this resume is not exact", level=30)
    dsc.install_checkpoint_io(engine, safe_load)
    dsc.install_numeric_model_file_order(engine)
    if pp > 1:
        dsc.install_exact_layer_loading(engine.module)
    try:
        # a base checkpoint (no adapters) under a run with LoRA adapters: they are not in the files; a
        # checkpoint with a LoRA base holds only the trained tensors (the rest was loaded from the base)
        base_only = meta.lora_base is not None or ((meta.model_args or {}).get("lora") is None and any(
            is_adapter_parameter(n) for n, _ in engine.module.named_parameters()))
        path, _ = engine.load_checkpoint(load_dir, tag=iteration_dir_name(iteration),
                                         load_optimizer_states=not weights_only,
                                         load_lr_scheduler_states=not weights_only,
                                         load_module_only=weights_only, load_module_strict=not base_only)
    except AssertionError as e:  # DeepSpeed's own consistency checks
        raise CheckpointError(f"DeepSpeed refused {ckpt_dir}: {e}; the checkpoint does not match this run or is "
                              f"damaged: restore it from a copy, or load an earlier one via {pointer}") from None
    if path is None:
        raise CheckpointError(f"DeepSpeed found no model files in {ckpt_dir} for this rank; the checkpoint "
                              f"is incomplete or was saved with another layout")
    rng = safe_load(os.path.join(ckpt_dir, rng_file_name(rank))) if want_rng else None
    log_rank0(log, f"loaded checkpoint {ckpt_dir} (iteration {meta.iteration}, "
                   f"{'weights only' if weights_only else 'full state'})")
    return meta, rng


def _load_lora_base(engine: Any, ckpt_dir: str, base: dict[str, Any], state: Any, *, zero_stage: int) -> None:
    where = f"{ckpt_dir} holds only the LoRA adapters and trained modules; its frozen weights are in {base['load']} " \
            f"iteration {base['iteration']} (lora_base in metadata.json)"
    if not os.path.isdir(os.path.join(base["load"], iteration_dir_name(int(base["iteration"])))):
        raise CheckpointError(f"{where}, which does not exist: restore that checkpoint there, or write its path into "
                              f"lora_base")
    verify_distributed(ckpt_dir, base)  # the same base by content, not only by path
    try:
        load_checkpoint(engine, base["load"], state, zero_stage=zero_stage, load_optim=False,
                        finetune=True, load_rng=False, iteration=int(base["iteration"]))
    except CheckpointError as e:
        raise CheckpointError(f"{where}, which cannot be loaded: {e}") from None


def _load_any_layout(engine: Any, load_dir: str, ckpt_dir: str, meta: CheckpointMeta, *, rank: int, tp: int, pp: int,
                  dp: int, zero_stage: int, weights_only: bool, finetune: bool, load_rng: bool, pointer: str
                  ) -> tuple[CheckpointMeta, Optional[dict]]:
    """Every checkpoint in the layer format (training's own, reshard's, import-hf's), and DeepSpeed's files saved
    at another layout (TP, PP, or DP size and ZeRO stage): each rank reads its own tensors by canonical name
    and keeps its slices for this run's TP/PP/DP and ZeRO stage (megatron_ru/checkpointing/loader.py). RNG
    states continue exactly at the layout they were saved at (one file per rank); at another, the run keeps
    the states it seeded from --seed and says so."""
    saved = (meta.tensor_model_parallel_size, meta.pipeline_model_parallel_size, meta.data_parallel_size)
    problem = layers_layout_problem(meta, zero_stage)
    if problem:
        raise CheckpointError(f"cannot load {ckpt_dir} (saved at TP {saved[0]} x PP {saved[1]}) at TP {tp} x PP "
                              f"{pp}: {problem}")
    load_optim = not weights_only and (meta.format is None or meta.optimizer is not None)
    if not weights_only and not load_optim and not finetune:
        log_rank0(log, f"{ckpt_dir} holds weights only (no optimizer state): the optimizer starts fresh", level=30)
    present = sorted(list_files(ckpt_dir))
    expected = meta.expected_files(present)
    has_rng = any(file_kind(n) == "rng" for n in expected)
    same_ranks = saved == (tp, pp, dp)
    want_rng = load_rng and not finetune and has_rng and same_ranks
    check_files(ckpt_dir, expected, kinds={"model"} | ({"optim"} if load_optim else set()) |
                ({"rng"} if want_rng else set()),
                pointer=pointer, earlier=[i for i in list_iterations(load_dir) if i < meta.iteration])
    load_by_names(engine, ckpt_dir, meta, rank=rank, tp=tp, pp=pp, load_optim=load_optim)
    if has_rng and not finetune and load_rng and not same_ranks:
        log_rank0(log, f"{ckpt_dir} was saved at TP {saved[0]} x PP {saved[1]} x DP {saved[2]}, this run is TP {tp} x "
                       f"PP {pp} x DP {dp}: random states start fresh from --seed (with dropout on, the "
                       f"continuation is not exact)", level=30)
    elif has_rng and not finetune and not load_rng:
        log_rank0(log, "--no-load-rng: resuming with fresh random states; dropout and other random streams differ "
                       "from an uninterrupted run, so this resume is not exact", level=30)
    rng = safe_load(os.path.join(ckpt_dir, rng_file_name(rank))) if want_rng else None
    return meta, rng
