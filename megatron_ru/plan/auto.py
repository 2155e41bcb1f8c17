"""``pretrain_gpt.py --auto-layout``: the layout chosen at start-up by the planner, before any weight is built.

Every rank parses the same command line and asks the planner the same question (this job's number of ranks, the
model of the flags or of ``--use-checkpoint-args``' checkpoint, the sequence, the global batch and its ramp, the
precision, the devices), so every rank gets the same answer without a message: the planner is a pure function
of those inputs. The answer is the planner's best row, as ``python -m megatron_ru.plan ... --json -`` ranks it
for the same inputs, and its flags (``Layout.flags``) are appended to the command line, which is then parsed and
validated as if the user had typed them. The layout flags the user did type are constraints the search keeps.

Rerun on another number of ranks, the same command chooses again and continues the checkpoint: checkpoints load
at any layout, and the global batch (hence the data order, the schedule and the optimizer's steps) is the
user's, not the layout's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from megatron_ru.flags.arguments import CONFIG_CLASSES, Arguments, parse_arguments
from megatron_ru.plan.hardware import GIB, PEAK_TFLOPS, PRESETS, GpuSpec, gpu_spec, peak_tflops_for
from megatron_ru.plan.search import MEMORY_MARGIN, Candidate, Plan, SearchSpace, plan_layouts

#: the flags a choice sets (a user's explicit value of one of them is a constraint)
LAYOUT_DESTS = frozenset({"tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                          "sequence_parallel", "micro_batch_size", "recompute_granularity", "checkpoint_activations",
                          "zero_stage"})
RUNNERS_UP = 3
#: the largest job the refusal of a job that fits nowhere looks at
MAX_GPUS = 4096


#: Megatron's spellings of layout flags (megatron_ru/flags/megatron_flags.py) and what they set: constraints too
SPELLED_LAYOUT = {"--recompute-activations": "recompute_granularity",
                  "--ds-sequence-parallel-size": "context_parallel_size", "--use-distributed-optimizer": "zero_stage",
                  "--no-pipeline-parallel": "pipeline_model_parallel_size"}


def _given(argv: Sequence[str], flag: str) -> bool:
    """Whether ``flag`` is on the command line: itself, ``flag=value``, or a prefix argparse takes for it."""
    for a in argv:
        if a == "--":
            return False
        name = a.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and flag.startswith(name):
            return True
    return False


def wants_auto_layout(argv: Sequence[str]) -> bool:
    return _given(argv, "--auto-layout")


def parse_with_auto_layout(argv: Sequence[str], *, world_size: Optional[int] = None,
                           device_type: Optional[str] = None) -> Arguments:
    """``parse_arguments(argv)``; with ``--auto-layout``, with the planner's choice appended first."""
    argv = list(argv)
    if not wants_auto_layout(argv):
        return parse_arguments(argv, world_size=world_size, device_type=device_type)
    from megatron_ru.config.base import explicit_dests
    first = parse_arguments(argv, world_size=world_size, device_type=device_type, validate=False)
    explicit = explicit_dests(CONFIG_CLASSES, argv) | {dest for flag, dest in SPELLED_LAYOUT.items() if _given(argv, flag)}
    choice = choose_layout(first, explicit & LAYOUT_DESTS)
    args = parse_arguments(argv + choice["flags"], world_size=world_size, device_type=device_type)
    args.auto_layout = choice
    return args


def _gpus_per_node(args: Arguments) -> int:
    if args.parallel.gpus_per_node:
        return args.parallel.gpus_per_node
    from megatron_ru.parallel.env import discover_environment
    try:
        local = discover_environment().local_world_size
    except ValueError:
        local = 0
    return max(1, min(args.world_size, local or args.world_size))


def device_spec(args: Arguments) -> tuple[GpuSpec, str]:
    """The device the choice plans for and where that came from: --gpu / --gpu-memory-gib / --peak-tflops, else
    the detected GPU (its name, memory and the peak of the training precision from the built-in table)."""
    p, peak = args.parallel, args.logging.peak_tflops
    if p.gpu is not None or (p.gpu_memory_gib is not None and peak is not None):
        source = " ".join(f"{flag} {v}" for flag, v in (("--gpu", p.gpu), ("--gpu-memory-gib", p.gpu_memory_gib),
                                                         ("--peak-tflops", peak)) if v is not None)
        return gpu_spec(p.gpu, memory_gib=p.gpu_memory_gib, peak_tflops=peak), source
    if args.device_type != "cuda":
        raise ValueError("--auto-layout on a machine without a GPU plans for a device you name: add --gpu PRESET ("
                         f"{', '.join(PRESETS)}) or --gpu-memory-gib N with --peak-tflops N (the memory and speed of "
                         "one rank's device)")
    import torch
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    generation = next((key for key in PEAK_TFLOPS if key in props.name.upper()), None)
    like = next((s for s in PRESETS.values() if s.generation == generation), None)
    tflops = peak if peak is not None else peak_tflops_for(props.name, args.precision)
    if tflops is None:
        raise ValueError(f"--auto-layout: no {args.precision} peak TFLOP/s is known for {props.name}: add "
                         f"--peak-tflops N (or plan for a preset with --gpu {'|'.join(PRESETS)})")
    memory = int(p.gpu_memory_gib * GIB) if p.gpu_memory_gib is not None else int(props.total_memory)
    base = like or GpuSpec("custom", 0, {}, 2000.0, 300.0, 25.0, "custom")
    spec = dataclasses.replace(base, name=props.name, memory_bytes=memory,
                               peak_tflops={**base.peak_tflops, args.precision: tflops})
    return spec, f"detected {props.name}"


def search_space(args: Arguments, constraints: set[str]) -> SearchSpace:
    """The planner's choices, narrowed to the values of the layout flags the user gave."""
    p, t, m = args.parallel, args.training, args.model
    recompute: Optional[tuple[str, ...]] = None
    if constraints & {"recompute_granularity", "checkpoint_activations"}:
        recompute = ("full",) if m.recompute else (m.recompute_granularity or "none",)
    return SearchSpace(
        tensor_parallel=(p.tensor_model_parallel_size,) if "tensor_model_parallel_size" in constraints else None,
        pipeline_parallel=(p.pipeline_model_parallel_size,) if "pipeline_model_parallel_size" in constraints else None,
        context_parallel=(p.context_parallel_size,) if "context_parallel_size" in constraints else None,
        sequence_parallel=(p.sequence_parallel,) if "sequence_parallel" in constraints else None,
        micro_batches=(t.micro_batch_size,) if "micro_batch_size" in constraints else None,
        zero_stages=(t.zero_stage,) if "zero_stage" in constraints else None,
        recompute=recompute)


def _plan(args: Arguments, gpu: GpuSpec, num_gpus: int, per_node: int, space: SearchSpace, vocab: int) -> Plan:
    from megatron_ru.config.batch_ramp import BatchRamp
    t = args.training
    model = dataclasses.replace(args.model, recompute_granularity=None, checkpoint_activations=False)
    return plan_layouts(model, vocab, gpu, num_gpus, t.global_batch_size, args.data.seq_length, args.precision,
                        gpus_per_node=per_node, optimizer=args.optimizer.optimizer, space=space,
                        ramp=BatchRamp.of(t.rampup_batch_size, t.global_batch_size), device=args.device_type,
                        margin=memory_margin(args))


def memory_margin(args: Arguments) -> float:
    m = args.parallel.memory_margin
    return MEMORY_MARGIN if m is None else m


def _smallest_fitting(args: Arguments, gpu: GpuSpec, per_node: int, space: SearchSpace,
                      vocab: int) -> Optional[tuple[int, Candidate]]:
    """The smallest number of these devices on which the planner finds a layout, and that layout: more than the
    job has, up to a node one by one, then whole nodes (up to 64) and doublings of a node or of the job."""
    doublings = [2 ** k for k in range(13)]
    counts = sorted(n for n in ({per_node * k for k in range(1, 65)} | {per_node * d for d in doublings}
                                | {args.world_size * d for d in doublings} | set(range(args.world_size + 1, per_node)))
                    if args.world_size < n <= MAX_GPUS)
    for n in counts:
        best = _plan(args, gpu, n, min(per_node, n), space, vocab).best
        if best is not None:
            return n, best
    return None


def choose_layout(args: Arguments, constraints: set[str]) -> dict[str, Any]:
    """The planner's best layout for this job (ValueError, one line, when none fits), as a record: the flags, the
    layout, the device, the prediction, the runners-up and the printed block."""
    from megatron_ru.plan.api import vocab_size_for_arguments
    t = args.training
    missing = [flag for flag, v in (("--global-batch-size", t.global_batch_size), ("--seq-length", args.data.seq_length))
               if v is None]
    if missing:
        raise ValueError(f"--auto-layout plans for a global batch and a sequence length: add {' and '.join(missing)}")
    gpu, source = device_spec(args)
    per_node = _gpus_per_node(args)
    space = search_space(args, constraints)
    vocab = vocab_size_for_arguments(args)
    plan = _plan(args, gpu, args.world_size, per_node, space, vocab)
    kept = ", ".join("--" + c.replace("_", "-") for c in sorted(constraints)) or "none"
    if plan.best is None:
        found = _smallest_fitting(args, gpu, per_node, space, vocab)
        where = (f"the smallest job of these devices it fits is {found[0]} ({found[1].layout.short()}, "
                 f"{found[1].memory.total_bytes / GIB:.3g} GiB per device)" if found else
                 f"it fits no job of up to {MAX_GPUS} of these devices")
        raise ValueError(f"--auto-layout: no layout fits {args.world_size} x {gpu.name} ({gpu.memory_gib:.4g} GiB) "
                         f"with the layout flags kept ({kept}); {where}")
    best = plan.best
    flags = best.layout.flags()
    rate = best.time.tokens_per_second_per_gpu
    runners = [{"layout": c.layout.short(), "memory_bytes": c.memory.total_bytes,
                "tokens_per_second_per_gpu": c.time.tokens_per_second_per_gpu,
                "slower": 1 - c.time.tokens_per_second_per_gpu / rate} for c in plan.fitting[1:1 + RUNNERS_UP]]
    lines = [f"--auto-layout: {args.world_size} ranks, {per_node} per node, {gpu.name} ({gpu.memory_gib:.2f} GiB; "
             f"{source}; a layout leaves {100 * plan.margin:.0f}% free); {plan.considered} layouts considered, "
             f"{len(plan.fitting)} fit; layout flags kept: {kept}",
             f"  chosen:    {best.layout.short()}: {best.memory.total_bytes / GIB:.3f} GiB predicted per device "
             f"({100 * best.memory.total_bytes / gpu.memory_bytes:.0f}%), {rate:.0f} tokens/s per device predicted"]
    lines += [f"  runner-up: {r['layout']}: {r['memory_bytes'] / GIB:.3f} GiB, {100 * r['slower']:.1f}% slower"
              for r in runners]
    lines += [f"  does not fit: {why}" for why in plan.rejected]
    lines.append("  flags: " + " ".join(flags))
    return {"flags": flags, "layout": best.layout.short(), "world_size": args.world_size, "gpus_per_node": per_node,
            "device": {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "source": source},
            "memory_margin": plan.margin,
            "predicted_bytes": best.memory.total_bytes, "tokens_per_second_per_device": rate,
            "constraints": sorted(constraints), "runners_up": runners, "rejected": list(plan.rejected),
            "block": "\n".join(lines)}


def out_of_memory_message(choice: dict[str, Any], measured_bytes: Optional[int]) -> str:
    """What a run whose chosen layout ran out of memory says: the prediction against the peak it reached, and the
    next layout to try."""
    measured = "unknown" if measured_bytes is None else f"{measured_bytes / GIB:.2f} GiB"
    nxt = choice["runners_up"][0]["layout"] if choice["runners_up"] else None
    margin = choice.get("memory_margin", MEMORY_MARGIN)
    wider = f"a --memory-margin above {margin:g}"
    advice = (f"try the runner-up ({nxt}) with its flags instead of --auto-layout, or {wider}" if nxt else
              f"give {wider}")
    return (f"--auto-layout's choice ({choice['layout']}) ran out of memory: predicted "
            f"{choice['predicted_bytes'] / GIB:.2f} GiB per device, the peak reached {measured}; {advice}")
