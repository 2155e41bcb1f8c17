"""Megatron-LM's and Megatron-DeepSpeed's flags that ``pretrain_gpt.py`` knows under another name, that
change nothing here, or that it refuses: one table, read by the parser (each flag is accepted with its
arity), ``--help`` (each flag's line says its class), the start-up banner (the flags given without effect)
and ``docs/megatron_flags.md`` (``python -m megatron_ru.flags.megatron_flags`` writes it; a test checks
that the file is what it prints).

The classes, for every flag of the two parents' vocabulary a dense GPT/LLaMA job script uses:

* **same**: our own dataclass fields carry Megatron's name and meaning (``--num-layers``, ``--lr``, ...);
  they are not listed here but in the generated doc, read from the parser;
* **spelling**: another name (or value) for something we do, mapped with the same result;
* **no effect**: a kernel, memory, profiling or logging knob that cannot change what is computed; accepted
  and listed once in the start-up banner's debug record;
* **refused**: a feature we do not have; one line names the flag, says it is not supported and what to use
  instead. Some flags are refused only for some values (``--rotary-percent 0.5``; 1.0 is the same).

This module imports only the standard library and ``megatron_ru.config``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from megatron_ru.flags.megatron_flags_rest import GROUPS as REST

if TYPE_CHECKING:
    from megatron_ru.flags.arguments import Arguments

SPELLING, NO_EFFECT, REFUSED = "spelling", "no effect", "refused"
#: a flag's values: 0 (a switch), 1, "+" (one or more), "*" (any number) or "?" (a switch or one value)
Arity = Union[int, str]
#: (arguments, the flag's value, the flags given explicitly) -> a problem, or None when it applied
Apply = Callable[["Arguments", Any, "set[str]"], Optional[str]]


@dataclass(frozen=True)
class MegatronFlag:
    flag: str
    kind: str
    arity: Arity
    #: spelling: what it means here; no effect: why; refused: why, and what to use instead
    note: str
    #: spelling: how it sets our flags; refused only for some values: returns the refusal for a value (else None)
    apply: Optional[Apply] = None
    #: which parent defines it: "LM", "DS" or "LM, DS"
    source: str = "LM, DS"

    @property
    def dest(self) -> str:
        return "megatron__" + self.flag.lstrip("-").replace("-", "_")


# ---- spellings -----------------------------------------------------------------------------------

def _set(args: "Arguments", explicit: set[str], section: str, name: str, value: Any, flag: str) -> Optional[str]:
    """Set ``args.<section>.<name>`` unless the user gave that flag with another value."""
    cfg = getattr(args, section)
    current = getattr(cfg, name)
    if name in explicit and current != value:
        return f"{flag} means --{name.replace('_', '-')} {value}, but --{name.replace('_', '-')} {current} is given too"
    setattr(cfg, name, value)
    return None


def _num_key_value_heads(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return (_set(args, explicit, "model", "group_query_attention", True, "--num-key-value-heads") or
            _set(args, explicit, "model", "num_query_groups", int(value), f"--num-key-value-heads {value}"))


def _rotary(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return _set(args, explicit, "model", "position_embedding_type", "rope", "--use-rotary-position-embeddings")


def _rotary_theta(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return _set(args, explicit, "model", "rotary_base", float(value), f"--rotary-position-embeddings-theta {value}")


def _distributed_optimizer(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    t = args.training
    if t.zero_stage >= 1:
        return None  # already sharded at least that much
    if "zero_stage" in explicit:
        return "--use-distributed-optimizer shards the optimizer state (ZeRO stage 1), but --zero-stage 0 is given too"
    t.zero_stage = 1
    return None


def _distribute(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return _set(args, explicit, "model", "distribute_saved_activations", True, "--distribute-checkpointed-activations")


def _checkpoint_num_layers(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return _set(args, explicit, "model", "recompute_num_layers", int(value), f"--checkpoint-num-layers {value}")


def _recompute_activations(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return _set(args, explicit, "model", "recompute_granularity", "selective", "--recompute-activations")


def _wandb_name(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return _set(args, explicit, "logging", "wandb_exp_name", value, f"--wandb-name {value}")


def _fp8_format(fmt: str) -> Apply:
    """Megatron-DeepSpeed's TransformerEngine switches --fp8-e4m3 / --fp8-hybrid: = --fp8-format FMT."""
    def apply(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
        return _set(args, explicit, "training", "fp8_format", fmt, f"--fp8-{fmt}")
    return apply


def _data_impl(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    if value in ("mmap", "infer"):
        return None
    return (f"--data-impl {value} is not supported: megatron_ru reads the mmap format (.bin/.idx, MMIDIDX) that "
            f"tools/preprocess_data.py writes; use --data-impl mmap (or drop the flag)")


def _ds_sequence_parallel(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    size = int(value)
    if size == 1:
        return None
    return (_set(args, explicit, "parallel", "context_parallel_size", size, f"--ds-sequence-parallel-size {value}")
            or _set(args, explicit, "parallel", "cp_comm_type", "a2a", f"--ds-sequence-parallel-size {value}"))


def _value_equals(flag: str, number: float, instead: str) -> Apply:
    """Accept ``flag`` at the one value that runs here (``number``); refuse any other, saying ``instead``."""
    def check(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
        if float(value) == number:
            return None
        return f"{flag} {value} is not supported: {instead}"
    return check


def _dataloader_type(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    if value == "single":
        return None
    return (f"--dataloader-type {value} is not supported: megatron_ru reads samples in Megatron's 'single' order (one "
            f"pass over the shuffled sample index per epoch); drop the flag")


def _no_position_embedding(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    if args.model.position_embedding_type == "rope":
        return None  # what rope does here: no learned absolute embedding
    return ("--no-position-embedding without --position-embedding-type rope (a model with no position information) "
            "is not supported: use --position-embedding-type rope")


def _no_pipeline_parallel(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    if args.parallel.pipeline_model_parallel_size == 1:
        return None
    return ("--no-pipeline-parallel runs the model without a pipeline, but --pipeline-model-parallel-size is "
            f"{args.parallel.pipeline_model_parallel_size}: drop one of them")


def _tiktoken(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    if args.tokenizer.tokenizer_type != "TikTokenizer":
        return None  # Megatron reads it only for TikTokenizer
    return (f"--tiktoken-pattern {value} is not supported: megatron_ru's TikTokenizer pre-tokenizes with LLaMA-3's "
            f"pattern; for another one use --tokenizer-type HuggingFaceTokenizer with the tokenizer's tokenizer.json")


def _norm_epsilon(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return _set(args, explicit, "model", "norm_epsilon", float(value), f"--layernorm-epsilon {value}")


def _llama3_rope_scaling(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    """Megatron-LM's ``--use-rope-scaling``: Llama 3.1's frequency scaling with ``--rope-scaling-factor`` and the
    fixed low/high-frequency factors 1 and 4 and original context 8192 of its rotary embedding."""
    m = args.model
    problem = _set(args, explicit, "model", "rope_scaling_type", "llama3", "--use-rope-scaling")
    if problem:
        return problem
    fixed = {"rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
             "rope_scaling_original_max_position_embeddings": 8192}
    for name, megatrons in fixed.items():
        if name in explicit and getattr(m, name) != megatrons:
            return (f"--use-rope-scaling scales with Megatron-LM's fixed --{name.replace('_', '-')} {megatrons}, but "
                    f"{getattr(m, name)} is given: drop --use-rope-scaling and give --rope-scaling-type llama3")
        setattr(m, name, megatrons)
    return None


def _fp32_grad_reduction(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    t = args.training
    if t.fp16:
        return ("--accumulate-allreduce-grads-in-fp32 with --fp16 is not supported: DeepSpeed's fp16 optimizer "
                "accumulates and reduces gradients in fp16; use --bf16, which does both in fp32")
    if getattr(t, "grad_reduce_in_bf16", False):
        return "--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16: give one"
    return None  # bf16: fp32 gradient accumulation and reduction (DeepSpeed's grad_accum_dtype); fp32: all fp32


def _no_initialization(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    if args.checkpoint.load:
        return None  # the loaded checkpoint replaces every initial weight (a missing one is an error)
    return ("--no-initialization without --load (weights left uninitialised) is not supported: it only saves time "
            "when a checkpoint replaces the weights; add --load DIR or drop the flag")


def _exit_signal_handler(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    return _set(args, explicit, "training", "exit_signal_handler", True, "--exit-signal-handler-for-training")


def _value_is(flag: str, allowed: tuple[str, ...], instead: str) -> Apply:
    def check(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
        if str(value) in allowed:
            return None
        return f"{flag} {value} is not supported: {instead}"
    return check


def _embedding_init_std(args: "Arguments", value: Any, explicit: set[str]) -> Optional[str]:
    if float(value) == args.model.init_method_std:
        return None
    return (f"--embedding-init-method-std {value} is not supported: the embedding is drawn from N(0, "
            f"--init-method-std {args.model.init_method_std}) like every weight; give the same value or drop the flag")


_FP32_STATE = "Adam's moments, the master weights and the main gradients are fp32 here: use fp32 (or drop the flag)"


_NO_FUSION = "a fused kernel's switch: the same result, computed by another kernel"

TABLE: tuple[MegatronFlag, ...] = (
    # ---- spellings --------------------------------------------------------------------------------
    MegatronFlag("--num-key-value-heads", SPELLING, 1, "= --group-query-attention --num-query-groups N",
                 _num_key_value_heads, "DS"),
    MegatronFlag("--use-rotary-position-embeddings", SPELLING, 0, "= --position-embedding-type rope", _rotary, "DS"),
    MegatronFlag("--rotary-position-embeddings-theta", SPELLING, 1, "= --rotary-base", _rotary_theta, "DS"),
    MegatronFlag("--use-distributed-optimizer", SPELLING, 0,
                 "= --zero-stage 1 (the optimizer state sharded over the data-parallel ranks) unless a higher stage "
                 "is given", _distributed_optimizer, "LM"),
    MegatronFlag("--wandb-name", SPELLING, 1, "= --wandb-exp-name", _wandb_name, "DS"),
    MegatronFlag("--fp8-e4m3", SPELLING, 0, "= --fp8-format e4m3", _fp8_format("e4m3"), "DS"),
    MegatronFlag("--fp8-hybrid", SPELLING, 0, "= --fp8-format hybrid", _fp8_format("hybrid"), "DS"),
    MegatronFlag("--data-impl", SPELLING, 1, "mmap (and infer, which finds mmap files) is the one format read here; "
                 "lazy and cached are refused", _data_impl, "DS"),
    MegatronFlag("--ds-sequence-parallel-size", SPELLING, 1, "= --context-parallel-size N --cp-comm-type a2a "
                 "(DeepSpeed-Ulysses: the all-to-all exchange)", _ds_sequence_parallel, "DS"),
    MegatronFlag("--rotary-percent", SPELLING, 1, "1.0 (rotary on the whole head) is what runs here; partial rotary "
                 "is refused", _value_equals("--rotary-percent", 1, "partial rotary embeddings are not available; "
                                             "use --rotary-percent 1.0"), "LM"),
    MegatronFlag("--dataloader-type", SPELLING, 1, "single is the order used here; cyclic and external are refused",
                 _dataloader_type, "LM, DS"),
    MegatronFlag("--no-position-embedding", SPELLING, 0, "with --position-embedding-type rope, what rope does here (no "
                 "learned absolute embedding); without it refused", _no_position_embedding, "LM, DS"),
    MegatronFlag("--no-pipeline-parallel", SPELLING, 0, "with --pipeline-model-parallel-size 1, what runs here (no "
                 "pipeline module)", _no_pipeline_parallel, "DS"),
    MegatronFlag("--distribute-checkpointed-activations", SPELLING, 0, "= --distribute-saved-activations",
                 _distribute, "DS"),
    MegatronFlag("--partition-activations", SPELLING, 0, "DeepSpeed's activation partitioning: = "
                 "--distribute-saved-activations", _distribute, "DS"),
    MegatronFlag("--checkpoint-num-layers", SPELLING, 1, "= --recompute-num-layers (layers per recomputed chunk "
                 "under --checkpoint-activations)", _checkpoint_num_layers, "DS"),
    MegatronFlag("--recompute-activations", SPELLING, 0, "= --recompute-granularity selective (Megatron's meaning: "
                 "the core attention recomputed)", _recompute_activations),
    MegatronFlag("--layernorm-epsilon", SPELLING, 1, "= --norm-epsilon", _norm_epsilon, "DS"),
    MegatronFlag("--use-rope-scaling", SPELLING, 0, "= --rope-scaling-type llama3 with --rope-scaling-factor and "
                 "Megatron-LM's fixed low/high-frequency factors 1 and 4 and original context 8192",
                 _llama3_rope_scaling, "LM"),
    MegatronFlag("--universal-checkpoint", SPELLING, 0, "what --load does here: it reads a checkpoint saved at any "
                 "TP x PP x DP x ZeRO", lambda args, value, explicit: None, "DS"),
    MegatronFlag("--accumulate-allreduce-grads-in-fp32", SPELLING, 0, "what --bf16 does here (DeepSpeed's "
                 "grad_accum_dtype fp32); with --fp16 refused", _fp32_grad_reduction),
    MegatronFlag("--lr-warmup-init", SPELLING, 1, "0 (warmup from zero) is what runs here; more is refused",
                 _value_equals("--lr-warmup-init", 0, "the warmup here rises from 0 to --lr; use --lr-warmup-init 0"),
                 "LM"),
    MegatronFlag("--weight-decay-incr-style", SPELLING, 1, "constant is what runs here; linear and cosine are refused",
                 _value_is("--weight-decay-incr-style", ("constant",), "weight decay here is the constant "
                           "--weight-decay; use --weight-decay-incr-style constant")),
    MegatronFlag("--softmax-type", SPELLING, 1, "vanilla (the standard softmax) is what runs here; the off-by-one "
                 "and learnable variants are refused", _value_is("--softmax-type", ("vanilla",), "only the "
                                                                  "standard attention softmax is available"), "LM"),
    MegatronFlag("--glu-linear-offset", SPELLING, 1, "0 is what runs here; an offset is refused",
                 _value_equals("--glu-linear-offset", 0, "the gated linear unit here has no offset; use 0"), "LM"),
    MegatronFlag("--embedding-init-method-std", SPELLING, 1, "the value of --init-method-std is what runs here; "
                 "another is refused", _embedding_init_std, "LM"),
    MegatronFlag("--exp-avg-dtype", SPELLING, 1, "fp32 is what runs here; others are refused",
                 _value_is("--exp-avg-dtype", ("fp32",), _FP32_STATE), "LM"),
    MegatronFlag("--exp-avg-sq-dtype", SPELLING, 1, "see --exp-avg-dtype",
                 _value_is("--exp-avg-sq-dtype", ("fp32",), _FP32_STATE), "LM"),
    MegatronFlag("--main-grads-dtype", SPELLING, 1, "see --exp-avg-dtype",
                 _value_is("--main-grads-dtype", ("fp32",), _FP32_STATE), "LM"),
    MegatronFlag("--main-params-dtype", SPELLING, 1, "see --exp-avg-dtype",
                 _value_is("--main-params-dtype", ("fp32",), _FP32_STATE), "LM"),
    MegatronFlag("--exit-signal-handler-for-training", SPELLING, 0, "= --exit-signal-handler (SIGTERM/SIGUSR1: save "
                 "and exit)", _exit_signal_handler, "LM"),
    MegatronFlag("--exit-signal-handler-for-dataloader", SPELLING, 0, "= --exit-signal-handler, which here covers "
                 "the whole run, data loading included", _exit_signal_handler, "LM"),
    MegatronFlag("--no-initialization", NO_EFFECT, 0, "skips initialising weights that --load replaces: the same "
                 "model; without --load refused", _no_initialization),
    # ---- no effect --------------------------------------------------------------------------------
    MegatronFlag("--use-mcore-models", NO_EFFECT, 0, "one model implementation here", source="LM"),
    MegatronFlag("--transformer-impl", NO_EFFECT, 1, "one transformer implementation here (local and "
                 "transformer_engine compute the same layers)", source="LM"),
    MegatronFlag("--no-query-key-layer-scaling", NO_EFFECT, 0, "query-key layer scaling is a fp16 overflow guard that "
                 "does not change the attention scores; it is not applied here"),
    MegatronFlag("--attention-softmax-in-fp32", NO_EFFECT, 0, "the attention softmax runs in fp32 here (torch SDPA)"),
    MegatronFlag("--use-flash-attn", NO_EFFECT, 0, "torch's scaled_dot_product_attention picks the flash or "
                 "memory-efficient kernel itself"),
    MegatronFlag("--use-flash-attn-v2", NO_EFFECT, 0, "see --use-flash-attn", source="DS"),
    MegatronFlag("--attention-backend", NO_EFFECT, 1, "torch's scaled_dot_product_attention picks the kernel itself",
                 source="LM"),
    MegatronFlag("--cross-entropy-loss-fusion", NO_EFFECT, 0, "the vocabulary-parallel cross entropy is fused here "
                 "already", source="LM"),
    MegatronFlag("--no-gradient-accumulation-fusion", NO_EFFECT, 0, _NO_FUSION),
    MegatronFlag("--no-bias-dropout-fusion", NO_EFFECT, 0, _NO_FUSION),
    MegatronFlag("--no-bias-gelu-fusion", NO_EFFECT, 0, _NO_FUSION),
    MegatronFlag("--no-bias-swiglu-fusion", NO_EFFECT, 0, _NO_FUSION, source="LM"),
    MegatronFlag("--no-masked-softmax-fusion", NO_EFFECT, 0, _NO_FUSION),
    MegatronFlag("--no-rope-fusion", NO_EFFECT, 0, _NO_FUSION, source="LM"),
    MegatronFlag("--no-persist-layer-norm", NO_EFFECT, 0, _NO_FUSION),
    MegatronFlag("--no-async-tensor-model-parallel-allreduce", NO_EFFECT, 0, "an overlap of communication with "
                 "compute: the same result"),
    MegatronFlag("--overlap-grad-reduce", NO_EFFECT, 0, "overlaps the gradient reduction with the backward pass: the "
                 "same result (DeepSpeed schedules its reductions itself)", source="LM"),
    MegatronFlag("--overlap-param-gather", NO_EFFECT, 0, "overlaps the parameter all-gather with the forward pass: the "
                 "same result", source="LM"),
    MegatronFlag("--no-scatter-gather-tensors-in-pipeline", NO_EFFECT, 0, "how activations travel between pipeline "
                 "stages: the same tensors arrive"),
    MegatronFlag("--deepspeed-activation-checkpointing", NO_EFFECT, 0, "recomputation here runs inside the layers "
                 "(tensor-parallel RNG states kept), whatever implementation is named", source="DS"),
    MegatronFlag("--no-create-attention-mask-in-dataloader", NO_EFFECT, 0, "the causal mask is never materialised "
                 "here", source="LM"),
    MegatronFlag("--no-mmap-bin-files", NO_EFFECT, 0, "how the .bin file is read: the same tokens", source="LM"),
    MegatronFlag("--manual-gc", NO_EFFECT, 0, "Python's garbage collector timing", source="LM"),
    MegatronFlag("--manual-gc-interval", NO_EFFECT, 1, "see --manual-gc", source="LM"),
    MegatronFlag("--empty-unused-memory-level", NO_EFFECT, 1, "when the CUDA cache is emptied", source="LM"),
    MegatronFlag("--data-parallel-sharding-strategy", NO_EFFECT, 1, "read only with --use-megatron-fsdp, which is "
                 "refused", source="LM"),
    MegatronFlag("--tiktoken-pattern", NO_EFFECT, 1, "read only by --tokenizer-type TikTokenizer, which here cuts "
                 "text with LLaMA-3's pattern: with TikTokenizer, Megatron's v1/v2 patterns are refused",
                 _tiktoken, "LM"),
    MegatronFlag("--profile", NO_EFFECT, "?", "Nsight/torch profiler ranges: use torch.profiler or nsys around "
                 "pretrain_gpt.py", source="LM"),
    MegatronFlag("--profile-step-start", NO_EFFECT, 1, "see --profile", source="LM"),
    MegatronFlag("--profile-step-end", NO_EFFECT, 1, "see --profile", source="LM"),
    MegatronFlag("--use-pytorch-profiler", NO_EFFECT, 0, "see --profile", source="LM"),
    MegatronFlag("--log-throughput", NO_EFFECT, 0, "throughput (tokens/s, TFLOP/s, MFU) is logged at every "
                 "--log-interval here already"),
    MegatronFlag("--log-learning-rate-to-tensorboard", NO_EFFECT, 0, "the learning rate is written at every "
                 "--log-interval here already"),
    MegatronFlag("--log-loss-scale-to-tensorboard", NO_EFFECT, 0, "the loss scale is written at every --log-interval "
                 "here already"),
    MegatronFlag("--timing-log-level", NO_EFFECT, 1, "Megatron's timers; step time is logged here already",
                 source="LM"),
    # ---- refused ----------------------------------------------------------------------------------
    MegatronFlag("--no-save-optim", REFUSED, 0, "checkpoints here always hold the optimizer state (a resume is "
                 "exact); convert one to weights only with tools/convert_checkpoint.py reshard"),
    MegatronFlag("--no-save-rng", REFUSED, 0, "checkpoints here always hold every rank's RNG state (a resume is "
                 "exact); load without it with --no-load-rng"),
    MegatronFlag("--num-layers-per-virtual-pipeline-stage", REFUSED, 1, "virtual (interleaved) pipeline stages are "
                 "not available: use --pipeline-model-parallel-size alone"),
    MegatronFlag("--virtual-pipeline-model-parallel-size", REFUSED, 1, "see --num-layers-per-virtual-pipeline-stage",
                 source="LM"),
    MegatronFlag("--fp8-param-gather", REFUSED, 0, "FP8 all-gathers of sharded weights are not available: "
                 "--fp8-format computes in FP8, weights are gathered in the training precision", source="LM"),
    MegatronFlag("--num-experts", REFUSED, "+", "mixture-of-experts layers are not available: dense models only"),
    MegatronFlag("--expert-model-parallel-size", REFUSED, 1, "see --num-experts", source="LM"),
    MegatronFlag("--moe-router-topk", REFUSED, 1, "see --num-experts", source="LM"),
    MegatronFlag("--cpu-offload", REFUSED, 0, "CPU offload is not available: use a higher --zero-stage", source="DS"),
    MegatronFlag("--optimizer-cpu-offload", REFUSED, 0, "see --cpu-offload", source="LM"),
    MegatronFlag("--curriculum-learning-legacy", REFUSED, 0, "curriculum learning is not available: order the data "
                 "in --data-path's blend", source="DS"),
    MegatronFlag("--use-megatron-fsdp", REFUSED, 0, "FSDP is not available: use --zero-stage 3 (DeepSpeed's "
                 "parameter sharding)", source="LM"),
    MegatronFlag("--use-torch-fsdp2", REFUSED, 0, "see --use-megatron-fsdp", source="LM"),
    MegatronFlag("--encoder-num-layers", REFUSED, 1, "encoder-decoder models are not available: GPT/LLaMA only"),
)

TABLE += tuple(MegatronFlag(flag, kind, arity, note, source=source)
               for kind, note, flags in REST for flag, arity, source in flags)

BY_FLAG = {f.flag: f for f in TABLE}


def add_to_parser(parser: argparse.ArgumentParser) -> None:
    """Every flag of the table, accepted with its arity; its help line says its class."""
    group = parser.add_argument_group("Megatron-LM / Megatron-DeepSpeed flags under another name, without effect "
                                      "here, or refused (docs/megatron_flags.md)")
    for f in TABLE:
        kwargs: dict[str, Any] = {"dest": f.dest, "default": None, "help": f"[{f.kind}] {f.note}"}
        if f.arity == 0:
            kwargs["action"] = "store_true"
        elif f.arity in ("+", "*"):
            kwargs.update(nargs=f.arity, metavar="VALUE")
        elif f.arity == "?":  # Megatron-LM's switch, Megatron-DeepSpeed's flag with a value
            kwargs.update(nargs="?", const=True, metavar="VALUE")
        else:
            kwargs["metavar"] = "VALUE"
        group.add_argument(f.flag, **kwargs)


def apply_megatron_flags(args: "Arguments", values: dict[str, Any], explicit: set[str]) -> list[str]:
    """Apply the spellings given in ``values`` (the parser's namespace) to ``args``; record the flags without
    effect on ``args.megatron_no_effect``; return the problems (refusals, contradictions), each naming its flag."""
    problems: list[str] = []
    given = [f for f in TABLE if values.get(f.dest) not in (None, False)]
    for f in given:
        value = values[f.dest]
        if f.kind == REFUSED:
            problems.append(f"{f.flag} is not supported: {f.note}")
            continue
        problem = f.apply(args, value, explicit) if f.apply is not None else None
        if problem:
            problems.append(problem)
        elif f.kind == NO_EFFECT:
            args.megatron_no_effect.append(f.flag)
        else:
            args.megatron_spellings.append(f.flag)
    return problems


_VALUES: dict[Arity, str] = {0: "", 1: " N", "+": " ...", "*": " ...", "?": " [N]"}


def markdown(same: list[str]) -> str:
    """docs/megatron_flags.md: ``same`` (our parser's flags) and the table."""
    lines = ["# Megatron-LM and Megatron-DeepSpeed flags in megatron_ru", "",
             "Generated by `python -m megatron_ru.flags.megatron_flags` from the table in "
             "`megatron_ru/flags/megatron_flags.py` (tests/unit/test_megatron_flags.py fails when this file "
             "differs). `pretrain_gpt.py --help` prints the same classes.", "",
             "* **same**: our flag, with Megatron's name and meaning;",
             "* **spelling**: another name or value for something we do, with the same result;",
             "* **no effect**: cannot change what is computed; accepted and listed in the start-up banner's debug "
             "record;",
             "* **refused**: not available; the job stops with one line naming the flag and what to use instead.",
             "", f"## same ({len(same)})", "", ", ".join(f"`{s}`" for s in same), ""]
    for kind in (SPELLING, NO_EFFECT, REFUSED):
        rows = [f for f in TABLE if f.kind == kind]
        lines += [f"## {kind} ({len(rows)})", "", "| flag | from | here |", "|---|---|---|"]
        lines += [f"| `{f.flag}`{_VALUES[f.arity]} | {f.source} | "
                  f"{f.note} |" for f in rows]
        lines.append("")
    return "\n".join(lines)


def same_flags() -> list[str]:
    from megatron_ru.flags.arguments import CONFIG_CLASSES
    from megatron_ru.config.base import build_parser
    parser = build_parser(CONFIG_CLASSES)
    return sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")} - {"--help"})


if __name__ == "__main__":
    sys.stdout.write(markdown(same_flags()))
