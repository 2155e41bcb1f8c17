"""Build everything ``pretrain_gpt.py`` needs and run the loop: parse → groups → data → model →
engine → (resume) → train. ``main(argv)`` is the whole program; ``run(args)`` is callable from a
process that already initialised torch.distributed (tests).
"""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ru.flags.arguments import Arguments
from megatron_ru.plan.auto import out_of_memory_message, parse_with_auto_layout
from megatron_ru.parallel.state import ParallelState
from megatron_ru.parallel.failure import parse_on_rank0, report_failure, watch_for_stops
from megatron_ru.training.loop import BatchPlan, Progress, Throughput, TrainResult, Trainer
from megatron_ru.model.flops import ModelShape, flops_per_token
from megatron_ru.plan.hardware import device_peak_tflops
from megatron_ru.training.metrics import MetricsWriter
from megatron_ru.training.signals import ExitSignal, install_if_requested
from megatron_ru.utils.logging import get_logger, log_rank0, route_warnings

if TYPE_CHECKING:
    from megatron_ru.deepspeed_bridge.engine import DeepSpeedEngine

log = get_logger(__name__)


def model_shape(args: Arguments, vocab_size: int) -> ModelShape:
    return ModelShape.of(args.model, vocab_size, args.data.seq_length)


def batch_plan(args: Arguments) -> BatchPlan:
    """The resolved batch numbers of ``args`` (what the loop runs by)."""
    return BatchPlan(train_iters=args.train_iters, global_batch_size=args.global_batch_size,
                     micro_batch_size=args.training.micro_batch_size, grad_accum=args.grad_accum,
                     seq_length=args.data.seq_length, num_workers=args.data.num_workers, ramp=args.batch_ramp)


def throughput(args: Arguments, vocab_size: int) -> Throughput:
    flops = flops_per_token(model_shape(args, vocab_size), args.model.recompute)
    return Throughput(flops_per_iter=flops * args.global_batch_size * args.data.seq_length,
                      peak_tflops=device_peak_tflops(args.precision, args.logging.peak_tflops))


def build_model(args: Arguments, state: ParallelState, vocab_size: int) -> torch.nn.Module:
    """``GPTModel`` for PP = 1, a DeepSpeed ``PipelineModule`` over our layer list for PP > 1.
    Parameters are created in fp32 (DeepSpeed casts for bf16/fp16 and keeps fp32 masters)."""
    from megatron_ru.model.gpt import GPTLoss, GPTModel, pipeline_layers
    from megatron_ru.model.transformer import TransformerLayer, plan_recomputation
    common = dict(seed=args.training.seed, device=state.device)
    tp_group = state.tp_group if state.tp_size > 1 else None
    sp = args.parallel.sequence_parallel
    if state.pp_size == 1:
        model = GPTModel(args.model, vocab_size, tp_group, sp, **common)
    else:
        from megatron_ru.deepspeed_bridge.pipeline import pipeline_module
        layers = pipeline_layers(args.model, vocab_size, tp_group, sp, **common)
        # recomputation happens inside our layers (TP-aware RNG), not in DeepSpeed's pipeline: this stage's
        # transformer layers, in order, get their part (Megatron's uniform chunks / block count per stage)
        model = pipeline_module(layers, GPTLoss(vocab_size, tp_group), state,
                                partition_method="type:TransformerLayer", activation_checkpoint_interval=0)
        plan_recomputation([m for m in model.modules() if isinstance(m, TransformerLayer)], args.model)
    if args.training.fp8_format:
        from megatron_ru.model.fp8 import Fp8Spec, convert_to_fp8
        spec = Fp8Spec(args.training.fp8_format, args.training.fp8_recipe)
        converted, kept = convert_to_fp8(model, spec, state.device, state.cp_group if state.cp_size > 1 else None)
        log_rank0(log, f"--fp8-format: {spec.describe()}: {len(converted)} linears of the transformer layers in FP8"
                       f"{'; kept in ' + args.precision + ': ' + ', '.join(kept) if kept else ''}; the output head "
                       f"and the embedding in {args.precision}")
    if args.training.torch_compile:
        from megatron_ru.model.compile import compile_model
        compiled = compile_model(model)
        log_rank0(log, f"--torch-compile: {compiled} transformer layers"
                       f"{' and the loss' if state.tp_size == 1 else ''} run through torch.compile "
                       f"(compiled at the first step)")
    return model


def model_vocab_size(args: Arguments, tokenizer_size: int) -> int:
    """The model's vocabulary rows V: the checkpoint's (``--use-checkpoint-args``, or the checkpoint
    --load starts from, which fixes the weights' shapes), else the tokenizer's size. A tokenizer
    with more ids than the model has rows is an error."""
    vocab = args.model_vocab_size
    if vocab is None and args.checkpoint.load:
        meta = args.load_target().meta
        vocab = None if meta is None else meta.vocab_size
    if vocab is None:
        return tokenizer_size
    if tokenizer_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer_size} ids but the checkpoint in --load "
                         f"{args.checkpoint.load} has {vocab} vocabulary rows: use the checkpoint's tokenizer "
                         f"(--use-checkpoint-args without tokenizer flags picks the one recorded with it), or adapt "
                         f"the vocabulary first")
    return vocab


def checkpoint_record(args: Arguments, vocab_size: int, loaded: Any = None) -> dict[str, Any]:
    """What every checkpoint of this run records about the model: the ModelConfig, V, the tokenizer
    flags (paths made absolute, so ``--use-checkpoint-args`` finds them from anywhere) and the
    vocabulary adaptation recorded by the checkpoint it started from (``loaded``, its CheckpointMeta)."""
    import dataclasses
    import os

    from megatron_ru.model.spec import model_args_dict
    tokenizer = dataclasses.asdict(args.tokenizer)
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        if tokenizer.get(key):
            tokenizer[key] = os.path.abspath(tokenizer[key])
    record: dict[str, Any] = {"model_args": model_args_dict(args.model), "vocab_size": vocab_size,
                              "tokenizer": tokenizer}
    base = _lora_base(args, loaded)
    if base is not None:
        record["lora_base"] = base
    adaptation = getattr(loaded, "vocab_adaptation", None)
    if adaptation is not None:  # which rows a vocabulary adaptation initialised: kept for later runs
        record["vocab_adaptation"] = adaptation
    return record


def _lora_base(args: Arguments, loaded: Any) -> Optional[dict[str, Any]]:
    """The base checkpoint a LoRA run's checkpoints refer to instead of storing the frozen weights: the
    --load checkpoint when it has no adapters, else the one it refers to (None: save everything)."""
    import os
    if args.model.lora is None or loaded is None:
        return None
    if getattr(loaded, "lora_base", None) is not None:
        return loaded.lora_base
    if (loaded.model_args or {}).get("lora") is None:
        from megatron_ru.checkpointing.meta import iteration_dir_name
        from megatron_ru.checkpointing.lora_base import fingerprint_distributed
        load = os.path.abspath(args.checkpoint.load)
        # what the base is, not only where: a later reader refuses another model put at that path
        fp = fingerprint_distributed(os.path.join(load, iteration_dir_name(int(loaded.iteration))))
        return {"load": load, "iteration": int(loaded.iteration), "fingerprint": fp}
    return None


def _train_new_rows_only(engine: "DeepSpeedEngine", state: ParallelState, args: Arguments, vocab_size: int,
                         loaded: Any) -> None:
    """--train-embedding-rows new: the rows outside the adaptation's new rows stay as loaded."""
    from megatron_ru.training.embedding_rows import KeptRows, new_rows_of, restore_after_step
    rows = new_rows_of(loaded, args.checkpoint.load)
    kept = KeptRows(engine.module, args.model, vocab_size, rows, state.tp_rank)
    restore_after_step(engine, kept)


def _init_dora_after_load(engine: "DeepSpeedEngine") -> None:
    """DoRA magnitudes start as the row norms of the loaded base weights (peft), also in the fp32
    masters DeepSpeed made from the constructed weights."""
    from megatron_ru.deepspeed_bridge.masters import has_fp32_master, set_fp32_master
    from megatron_ru.model.lora import init_dora_magnitudes, lora_adapters
    if not init_dora_magnitudes(engine.module):
        return
    for _, adapters in lora_adapters(engine.module):
        for ad in adapters.values():
            if ad.use_dora and has_fp32_master(ad.magnitude):
                set_fp32_master(ad.magnitude, ad.magnitude.detach().float())


def _resume(engine: "DeepSpeedEngine", state: ParallelState, args: Arguments) -> Progress:
    from megatron_ru.parallel.random import set_rng_state
    from megatron_ru.training.checkpoint import load_checkpoint
    c = args.checkpoint
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.use_checkpoint_schedule = c.use_checkpoint_opt_param_scheduler
    loaded = load_checkpoint(engine, c.load, state, zero_stage=args.training.zero_stage,
                             load_optim=not c.no_load_optim, finetune=c.finetune,
                             load_rng=not c.no_load_rng, save_dir=c.save, iteration=c.ckpt_step,
                             exit_on_missing=c.exit_on_missing_checkpoint, target=args.load_target())
    if loaded is None:
        return Progress()
    meta, rng = loaded
    if c.finetune:
        return Progress()
    if rng is not None and not c.no_load_rng:
        set_rng_state(rng)
    if c.no_load_optim or engine.lr_scheduler.unit_changed:
        # weights only, but the position in training (iteration, data, LR curve) continues; or the checkpoint
        # counted the schedule's steps in another unit (--rampup-batch-size added or dropped)
        engine.lr_scheduler.set_position(meta.iteration, meta.consumed_train_samples, args.data.seq_length)
    return Progress(meta.iteration, meta.consumed_train_samples, meta.consumed_valid_samples)


def claim_save_dir(args: Arguments, state: ParallelState) -> Optional[Any]:
    """Rank 0 takes the --save directory's lock, refuses a run that would overwrite checkpoints it does not
    continue, removes what killed saves left (megatron_ru/checkpointing/save_dir.py) and checks that --load has
    the checkpoint it must have; every rank learns the outcome, so that a refusal is the same error on all of
    them, before anything else runs. Returns rank 0's lock (None elsewhere). --load's pointer is read once
    (``args.load_target()``), under the lock when --load is --save (at parse time, before it, with
    --use-checkpoint-args, which needs the checkpoint to parse): the checks and the load see one pointer."""
    import os
    c = args.checkpoint
    if not c.save and not c.load:
        return None
    from megatron_ru.checkpointing.files import CheckpointError
    from megatron_ru.checkpointing.save_dir import claim_save_dir as claim
    from megatron_ru.training.checkpoint import missing_checkpoint_problem
    same = c.save and c.load and c.ckpt_step is None and os.path.realpath(c.save) == os.path.realpath(c.load)
    lock, error = None, None
    if state.rank == 0:
        try:
            lock = claim(c.save, c.load, c.ckpt_step,
                         read_pointer=(lambda: args.load_target().pointer) if same else None) if c.save else None
            if c.load and args.load_target().iteration is None:
                error = missing_checkpoint_problem(c.load, c.finetune, c.save, c.exit_on_missing_checkpoint)
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = (f"--save {c.save}: cannot create or lock the directory ({e.strerror or e}): give a --save "
                     f"this user can write")
        if error and lock is not None:
            lock.release()
            lock = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CheckpointError(error)
    return lock


def setup(args: Arguments, exit_signal: Optional[ExitSignal] = None,
          resources: Optional[contextlib.ExitStack] = None) -> Trainer:
    """Everything before the first iteration: groups, seeds, --save's lock, tokenizer, data, model, engine,
    resume. ``exit_signal``: a handler installed earlier (by ``pretrain_gpt.py``, before its imports), else
    one is installed here when --exit-signal-handler is given. ``resources``: where the lock's release is
    registered (default: at the process's exit, or at the next run in this process)."""
    from megatron_ru.parallel.env import init_distributed
    from megatron_ru.parallel.random import model_parallel_seed, set_keyed_dropout_data_parallel
    from megatron_ru.training.data import build_datasets, document_masking
    from megatron_ru.deepspeed_bridge.engine import attach_comm, quiet
    from megatron_ru.training.engine import initialize_engine
    from megatron_ru.model.lora import init_dora_magnitudes
    from megatron_ru.training.freeze import apply_freezing, apply_lora_freezing
    from megatron_ru.training.banner import log_banner
    from megatron_ru.config.lr_schedule import schedule_from_config

    p = args.parallel
    init_distributed(p.backend, p.distributed_timeout_minutes)
    # the layout validated at parse time, checked against the real process group
    state = ParallelState.build(args.tp, args.pp, world_size=args.layout.world_size,
                                sequence_parallel=args.sequence_parallel, timeout_minutes=p.distributed_timeout_minutes,
                                cp=args.cp)
    lock = claim_save_dir(args, state)
    if lock is not None and resources is not None:
        resources.callback(lock.release)
    # Megatron: a different dropout stream per pipeline stage, the TP stream inside the tracker
    model_parallel_seed(args.training.seed + 100 * state.pp_rank, state.tp_rank)
    set_keyed_dropout_data_parallel(state.dp_size, state.dp_rank)
    tokenizer = args.built_tokenizer()
    vocab_size = model_vocab_size(args, tokenizer.vocab_size)
    if args.checkpoint.load:  # another model shape: one error naming the flags, before the model is built
        from megatron_ru.training.model_match import check_model_matches
        check_model_matches(args.load_target().meta, args.model, vocab_size, args.checkpoint.load)
    train_ds, valid_ds, test_ds = build_datasets(args, is_builder_rank=state.rank == 0, barrier=dist.barrier,
                                                 vocab_size=vocab_size)
    with quiet():
        attach_comm()
        model = build_model(args, state, vocab_size)
        if state.cp_size > 1:  # every attention layer exchanges over the CP group (all_gather runs as the ring)
            from megatron_ru.parallel.context import enable_context_parallel
            enable_context_parallel(model, state.cp_group, "a2a" if p.cp_comm_type == "a2a" else "p2p")
        pp_group = state.pp_group if state.pp_size > 1 else None
        apply_freezing(model, args.model, train_only_embeddings=args.training.train_only_embeddings,
                       freeze=args.training.freeze, group=pp_group)
        apply_lora_freezing(model, args.model, group=pp_group)
        init_dora_magnitudes(model)
        schedule = schedule_from_config(args.optimizer, args.train_iters, args.global_batch_size,
                                        in_samples=args.batch_ramp is not None, train_samples=args.training.train_samples,
                                        seq_length=args.data.seq_length)
        engine = initialize_engine(model, state, args, schedule)
    progress = _resume(engine, state, args) if args.checkpoint.load else Progress()
    loaded = args.load_target().meta if args.checkpoint.load else None
    if loaded is not None and (loaded.model_args or {}).get("lora") is None:
        _init_dora_after_load(engine)
    if args.training.train_embedding_rows == "new":
        _train_new_rows_only(engine, state, args, vocab_size, loaded)
    prediction = log_banner(args, engine.module, state, (train_ds, valid_ds, test_ds), vocab_size)
    metrics = MetricsWriter(args.logging, active=state.rank == 0, run_config=args.to_dict(),
                            save_dir=args.checkpoint.save)
    if args.auto_layout is not None:  # the choice printed after the banner, and its record before iteration 1's
        log_rank0(log, args.auto_layout["block"])
        metrics.log_auto_layout(args.auto_layout)
    if exit_signal is None and args.training.exit_signal_handler:
        exit_signal = ExitSignal().install()
    return Trainer(engine, state, batch_plan(args), args.training, args.checkpoint, args.logging, train_ds, valid_ds,
                   throughput(args, vocab_size), metrics, progress, exit_signal, run_config=args.to_dict(),
                   checkpoint_record=checkpoint_record(args, vocab_size, loaded),
                   text_tables=text_tables(tokenizer, vocab_size, state.device) if valid_ds is not None else None,
                   predicted_memory_mib=None if prediction is None else prediction.total_bytes / 2 ** 20,
                   documents=document_masking(args, tokenizer.eod))


def text_tables(tokenizer: Any, vocab_size: int, device: torch.device) -> Optional[torch.Tensor]:
    """[2, V] int64: UTF-8 bytes and characters per token id (0 for special and padding ids), for bits
    per byte in validation; None for a tokenizer whose ids have no text (NullTokenizer)."""
    from megatron_ru.data.token_text import byte_and_char_counts, token_texts
    try:
        nbytes, nchars = byte_and_char_counts(token_texts(tokenizer))
    except ValueError:
        return None
    out = torch.zeros((2, vocab_size), dtype=torch.int64)
    out[0, :len(nbytes)] = torch.from_numpy(nbytes)
    out[1, :len(nchars)] = torch.from_numpy(nchars)
    return out.to(device)


def run(args: Arguments, job_started: Optional[float] = None,
        exit_signal: Optional[ExitSignal] = None) -> TrainResult:
    """Set up and train. ``job_started`` (default: now) is when --exit-duration-in-mins starts
    counting: like Megatron, from the start of the job, so start-up and checkpoint loading are
    inside the budget the job scripts derive from the scheduler's time limit. ``exit_signal``:
    see :func:`setup`; a signal received during set-up stops training after the first iteration."""
    job_started = time.time() if job_started is None else job_started
    with contextlib.ExitStack() as resources:  # --save's lock: released however the run ends
        trainer = setup(args, exit_signal, resources)
        try:
            result = trainer.train(job_started=job_started)
        except torch.OutOfMemoryError as e:
            if args.auto_layout is None:
                raise
            peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available() else
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
            raise RuntimeError(out_of_memory_message(args.auto_layout, peak)) from e
        finally:
            trainer.metrics.close()
            if trainer.exit_signal is not None:
                trainer.exit_signal.restore()
    log_rank0(log, f"finished at iteration {result.iteration} ({result.exit_reason})")
    return result


def main(argv: Optional[Sequence[str]] = None, job_started: Optional[float] = None,
         exit_signal: Optional[ExitSignal] = None) -> int:
    """The whole program; returns the exit status: 0 done (also after a signal-triggered save),
    2 a configuration or input error, 1 a failure during training. A failure is printed once per
    job, without a traceback unless MEGATRON_RU_DEBUG=1 (:mod:`megatron_ru.parallel.failure`).
    On failure the process group is left for the process exit to drop: destroying it could wait
    on a peer that is stuck (``pretrain_gpt.py`` exits at once with :func:`flush_and_exit`)."""
    job_started = time.time() if job_started is None else job_started
    argv = sys.argv[1:] if argv is None else list(argv)
    route_warnings()  # library deprecations to debug records, each warning once per process
    watch_for_stops()  # a rank stopped and continued must not report its peers as lost
    if exit_signal is None:
        exit_signal = install_if_requested(argv)
    timeout_minutes: Optional[float] = None
    try:
        args = parse_on_rank0(parse_with_auto_layout, argv)
        timeout_minutes = args.parallel.distributed_timeout_minutes
        run(args, job_started, exit_signal)
    except Exception as e:  # noqa: BLE001 - every failure ends here: one message, one exit status
        return report_failure(e, timeout_minutes)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
