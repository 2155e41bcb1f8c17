"""DeepSpeed's JSON config from the flags: what the engine is built with, and what the planner reads its
bucket sizes from."""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_ru.flags.arguments import Arguments


def build_ds_config(args: "Arguments") -> dict[str, Any]:
    """The DeepSpeed JSON config from the flags (or the user's ``--deepspeed_config`` with the
    flags' batch sizes, precision and ZeRO stage filled in; validation already checked they agree)."""
    t, o = args.training, args.optimizer
    cfg: dict[str, Any] = {}
    if t.deepspeed_config:
        with open(t.deepspeed_config, encoding="utf-8") as f:
            cfg = json.load(f)
    cfg.update({
        # DeepSpeed's data-parallel world is DP x CP (the CP ranks of a sample hold the same weights): each of
        # them runs micro batch x accumulation "samples" (a CP rank's share of them), so it counts the global
        # batch CP times
        "train_batch_size": args.global_batch_size * args.cp,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": args.grad_accum,
    })
    cfg.setdefault("gradient_clipping", o.clip_grad)
    cfg.setdefault("steps_per_print", 2 ** 31 - 1)  # our loop logs
    cfg.setdefault("wall_clock_breakdown", False)
    cfg.setdefault("zero_allow_untested_optimizer", True)  # torch AdamW under ZeRO
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = t.zero_stage
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": bool(t.bf16)}
    fp16 = {**cfg.get("fp16", {}), "enabled": bool(t.fp16)}
    if t.fp16:
        fp16.setdefault("loss_scale", 0 if t.loss_scale is None else t.loss_scale)  # 0 = dynamic
        fp16.setdefault("initial_scale_power", int(round(math.log2(t.initial_loss_scale))))
        fp16.setdefault("loss_scale_window", t.loss_scale_window)
        fp16.setdefault("hysteresis", t.hysteresis)
        fp16.setdefault("min_loss_scale", t.min_loss_scale)
    cfg["fp16"] = fp16
    if args.parallel.sequence_parallel:
        # DeepSpeed's pipeline splits activations/gradients sent between stages across the TP
        # ranks, assuming every TP rank holds the same tensor; with sequence parallelism each holds
        # its own shard, so each rank must send its whole tensor
        cfg["pipeline"] = {**cfg.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    if t.bf16:
        # accumulate and reduce gradients in fp32 (bf16 sums over micro batches lose digits), unless
        # --grad-reduce-in-bf16 asks for Megatron-LM's bf16 gradient buffers
        cfg.setdefault("data_types", {}).setdefault("grad_accum_dtype", "bf16" if t.grad_reduce_in_bf16 else "fp32")
    return cfg
