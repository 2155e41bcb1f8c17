"""``python -m megatron_ru.plan`` / ``tools/plan_layout.py``: which layouts of a model fit a
number of GPUs and which is fastest, before the job waits in the queue.

    python -m megatron_ru.plan --num-layers 40 --hidden-size 5120 --num-attention-heads 40 \\
        --max-position-embeddings 2048 --vocab-size 50257 --seq-length 2048 \\
        --global-batch-size 512 --num-gpus 32 --gpus-per-node 4 --gpu v100-16gb --fp16
    python -m megatron_ru.plan --hf-config path/config.json --num-gpus 64 --gpu h100-80gb ...
    python -m megatron_ru.plan --load CKPT_DIR --use-checkpoint-args --num-gpus 16 ...

The model flags are ``pretrain_gpt.py``'s (ModelConfig, LoRA); the result is a table on stdout
(``--json PATH``, or ``--json -`` for stdout, writes the whole plan as one JSON object).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence

from megatron_ru.config.base import add_config_arguments, explicit_dests, flag_name, from_namespace
from megatron_ru.config.lora import LoraConfig, LoraSpec
from megatron_ru.config.model import ModelConfig
from megatron_ru.plan.hardware import PRESETS, gpu_spec
from megatron_ru.plan.report import format_plan, plan_dict
from megatron_ru.plan.search import MEMORY_MARGIN, SearchSpace, plan_layouts
from megatron_ru.plan.throughput import ACHIEVABLE_FRACTION
from megatron_ru.utils import cli


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m megatron_ru.plan", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_arguments(p, ModelConfig)
    add_config_arguments(p, LoraConfig)
    g = p.add_argument_group("Model source (instead of the model flags)")
    g.add_argument("--hf-config", help="A Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text, GPT-2 ...).")
    g.add_argument("--load", help="A megatron_ru checkpoint directory (with --use-checkpoint-args).")
    g.add_argument("--use-checkpoint-args", action="store_true", help="Take the model from --load's checkpoint.")
    g.add_argument("--vocab-size", type=int, help="Vocabulary size (not needed with --hf-config or --load).")
    g = p.add_argument_group("Cluster")
    g.add_argument("--num-gpus", type=int, required=True, help="GPUs of the job.")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (ABCI V100 nodes: 4).")
    g.add_argument("--gpu", choices=sorted(PRESETS), help="GPU preset; or the four numbers below.")
    g.add_argument("--gpu-memory-gib", type=float, help="Memory of one GPU (GiB).")
    g.add_argument("--memory-margin", type=float, default=MEMORY_MARGIN,
                   help=f"Share of a GPU's memory a layout leaves free to fit (default {MEMORY_MARGIN}: the planner's "
                        "measured error and what a run holds beyond its step; BENCHMARKS.md).")
    g.add_argument("--peak-tflops", type=float, help="Dense peak TFLOP/s of one GPU in the training precision.")
    g.add_argument("--intra-node-gbps", type=float, help="NVLink GB/s per GPU and direction.")
    g.add_argument("--inter-node-gbps", type=float, help="Network GB/s per GPU and direction.")
    g = p.add_argument_group("Training")
    g.add_argument("--seq-length", type=int, help="Sequence length (default --max-position-embeddings).")
    g.add_argument("--global-batch-size", type=int, required=True, help="Samples per optimizer step.")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, metavar="N",
                   help="START INCREMENT SAMPLES of pretrain_gpt.py's batch ramp: only layouts that can run it; the "
                        "best one's time over the ramp (memory: the full batch's is the run's peak).")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", help="bf16 (default except on V100).")
    prec.add_argument("--fp16", action="store_true", help="fp16 (default on V100).")
    prec.add_argument("--fp32", action="store_true", help="fp32.")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g = p.add_argument_group("Search")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), action="append",
                   help="Only these ZeRO stages (repeat the flag); default: every valid stage.")
    g.add_argument("--sequence-parallel", choices=("auto", "on", "off"), default="auto")
    g.add_argument("--max-micro-batch-size", type=int, default=8)
    g.add_argument("--context-parallel-size", type=int, action="append", metavar="CP",
                   help="Only these context-parallel sizes (repeat the flag; the ring exchange); default: 1 and every "
                        "size that splits --seq-length into 2 x CP chunks with TP x CP within a node.")
    g.add_argument("--tensor-model-parallel-size", type=int, action="append", metavar="TP",
                   help="Only these TP sizes (repeat the flag); default: every size up to a node.")
    g.add_argument("--pipeline-model-parallel-size", type=int, action="append", metavar="PP",
                   help="Only these PP sizes (repeat the flag); default: every size.")
    g.add_argument("--micro-batch-size", type=int, action="append", metavar="MB",
                   help="Only these micro batch sizes (repeat the flag); default: 1, 2, 4 ... --max-micro-batch-size.")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="Whose memory the prediction is: a GPU's (the CUDA context counted) or a CPU process's (what "
                        "pretrain_gpt.py --auto-layout plans with on CPU).")
    g.add_argument("--attention-kernel", choices=("fused", "math"), default="fused",
                   help="fused: PyTorch's flash/memory-efficient attention keeps no s x s scores (torch >= 2.1 on "
                        "V100 and newer); math: kernels that keep them (older stacks).")
    g.add_argument("--top", type=int, default=10, help="Rows of the table.")
    g.add_argument("--json", help="Write the plan as JSON to this file ('-': stdout instead of the table).")
    return p


def _model_from_checkpoint(load: str, given: ModelConfig, explicit: set[str]) -> tuple[ModelConfig, int]:
    from megatron_ru.flags.checkpoint_args import RUN_CHOICES, checkpoint_model_args, read_checkpoint_meta
    from megatron_ru.model.spec import model_config_from_dict
    meta = read_checkpoint_meta(load)
    if meta is None:
        raise ValueError(f"--load {load} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    recorded = checkpoint_model_args(meta)
    if recorded is None or meta.vocab_size is None:
        raise ValueError(f"the checkpoint in {load} did not record its model arguments; give the model flags instead")
    cfg = model_config_from_dict(dict(recorded))
    conflicts = [f"{flag_name(k)} {getattr(given, k)!r} contradicts the checkpoint's {getattr(cfg, k)!r}"
                 for k in sorted(explicit) if hasattr(cfg, k) and k not in RUN_CHOICES
                 and getattr(given, k) != getattr(cfg, k)]
    if conflicts:
        raise ValueError("--use-checkpoint-args: " + "; ".join(conflicts))
    for k in RUN_CHOICES & explicit:
        setattr(cfg, k, getattr(given, k))
    return cfg, int(meta.vocab_size)


def resolve_model(ns: argparse.Namespace, argv: Sequence[str]) -> tuple[ModelConfig, int, str]:
    """(model, vocabulary size, where it came from) from the flags, a checkpoint or a config.json."""
    given = from_namespace(ModelConfig, ns)
    explicit = explicit_dests([ModelConfig], argv)
    if ns.hf_config:
        from megatron_ru.convert.hf_mapping import model_config_from_hf
        try:
            with open(ns.hf_config, encoding="utf-8") as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"--hf-config {ns.hf_config}: no such file") from None
        cfg, vocab = model_config_from_hf(hf)
        for k in explicit & {"recompute_granularity", "checkpoint_activations", "hidden_dropout", "attention_dropout"}:
            setattr(cfg, k, getattr(given, k))
        source = f"config.json {ns.hf_config}"
    elif ns.use_checkpoint_args:
        if not ns.load:
            raise ValueError("--use-checkpoint-args takes the model from a checkpoint: add --load DIR")
        cfg, vocab = _model_from_checkpoint(ns.load, given, explicit)
        source = f"checkpoint {ns.load}"
    else:
        cfg = given
        if ns.vocab_size is None:
            raise ValueError("give --vocab-size (the tokenizer's size), or take the model from --hf-config PATH or "
                             "--load DIR --use-checkpoint-args")
        vocab, source = ns.vocab_size, "flags"
    if ns.vocab_size is not None:
        vocab = ns.vocab_size
    lora = from_namespace(LoraConfig, ns)
    if lora.enabled:
        from megatron_ru.config.lora import resolve_adapters
        spec = LoraSpec.from_config(lora)
        resolve_adapters(spec, cfg.num_layers, cfg.gated_mlp)
        cfg.lora = spec.to_dict()
    problems = cfg.problems()
    if problems:
        raise ValueError("; ".join(problems))
    return cfg, vocab, source


def _precision(ns: argparse.Namespace, generation: str) -> str:
    if ns.fp32:
        return "fp32"
    if ns.fp16:
        return "fp16"
    if ns.bf16:
        return "bf16"
    return "fp16" if generation == "V100" else "bf16"


def run(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    try:
        cfg, vocab, source = resolve_model(ns, argv)
        gpu = gpu_spec(ns.gpu, memory_gib=ns.gpu_memory_gib, peak_tflops=ns.peak_tflops,
                       intra_node_gbps=ns.intra_node_gbps, inter_node_gbps=ns.inter_node_gbps)
        seq = ns.seq_length
        if seq is None and cfg.position_embedding_type == "learned_absolute":
            seq = cfg.max_position_embeddings
        if seq is None:
            raise ValueError(f"give --seq-length (the training sequence length; the model allows up to "
                             f"{cfg.max_position_embeddings})")
        if ns.num_gpus < 1 or ns.gpus_per_node < 1 or ns.global_batch_size < 1:
            raise ValueError("--num-gpus, --gpus-per-node and --global-batch-size must be >= 1")
        precision = _precision(ns, gpu.generation)
        from megatron_ru.config.batch_ramp import BatchRamp, ramp_problems
        problems = ramp_problems(ns.rampup_batch_size, ns.global_batch_size, 1, 1)
        if problems:
            raise ValueError("; ".join(problems))
        ramp = BatchRamp.of(ns.rampup_batch_size, ns.global_batch_size)
        space = SearchSpace(recompute=("full",) if cfg.recompute else
                            ("selective",) if cfg.recompute_granularity == "selective" else None,
                            sequence_parallel={"auto": None, "on": (True,), "off": (False,)}[ns.sequence_parallel],
                            zero_stages=tuple(ns.zero_stage) if ns.zero_stage else None,
                            max_micro_batch=ns.max_micro_batch_size,
                            context_parallel=tuple(ns.context_parallel_size) if ns.context_parallel_size else None,
                            tensor_parallel=_sizes(ns.tensor_model_parallel_size),
                            pipeline_parallel=_sizes(ns.pipeline_model_parallel_size),
                            micro_batches=_sizes(ns.micro_batch_size))
        model_cfg = dataclasses.replace(cfg, recompute_granularity=None, checkpoint_activations=False)
        plan = plan_layouts(model_cfg, vocab, gpu, ns.num_gpus, ns.global_batch_size, seq, precision,
                            gpus_per_node=ns.gpus_per_node, optimizer=ns.optimizer, space=space,
                            attention=ns.attention_kernel, ramp=ramp, device=ns.device, margin=ns.memory_margin)
    except (ValueError, FileNotFoundError) as e:
        cli.error(str(e))
        return 2
    from megatron_ru.plan.params import total_param_count
    params = total_param_count(cfg, vocab)
    model_line = (f"model from {source}: {params / 1e9:.2f}B parameters, {cfg.num_layers} layers, hidden "
                  f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, vocabulary {vocab}, sequence {seq}, "
                  f"global batch {ns.global_batch_size}, {precision}, {ns.optimizer}; compute at "
                  f"{ACHIEVABLE_FRACTION:.0%} of peak (docs/planner.md)")
    model = {"source": source, "parameters": params, "vocab_size": vocab, "seq_length": seq,
             "config": dataclasses.asdict(cfg), "precision": precision}
    if ns.json:
        text = json.dumps(plan_dict(plan, gpu, ns.num_gpus, ns.gpus_per_node, model, ns.top), default=str, indent=1)
        if ns.json == "-":
            cli.emit(text)
            return 0
        with open(ns.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    ramp_line = _ramp_line(plan, model_cfg, vocab, gpu, ns.gpus_per_node, ramp)
    cli.emit(format_plan(plan, gpu, ns.num_gpus, ns.gpus_per_node, model_line, ns.top)
             + (f"\n{ramp_line}" if ramp_line else ""))
    return 0


def _sizes(values: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
    return tuple(values) if values else None


def _ramp_line(plan, cfg, vocab: int, gpu, gpus_per_node: int, ramp) -> Optional[str]:
    """The best layout's predicted time over --rampup-batch-size (None without a ramp or a fitting layout)."""
    if ramp is None or plan.best is None:
        return None
    from megatron_ru.plan.ramp import ramp_time
    best = plan.best
    t = ramp_time(cfg, vocab, best.layout, gpu, ramp, gpus_per_node=gpus_per_node, memory=best.memory)
    return f"{t.summary()} on the best layout ({best.layout.short()})"
