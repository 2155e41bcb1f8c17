"""Acceptance 2 of issue 14 (memory states): the planner's parameter, gradient and optimizer bytes
equal what DeepSpeed's engine holds, counted from its tensors, at several layouts of a tiny model on
4 gloo ranks (TP x PP x DP, ZeRO 0 and 1, fp32 and bf16, tied and untied embeddings).

The engine's bytes are counted at the optimizer step of the second iteration (the optimizer state
exists from the first): unique storages of the module's parameters, their ``.grad``, the tensors the
DeepSpeed wrapper keeps (flat gradient buffers, fp32 master partitions) and the optimizer state;
scalars of the wrapper (gradient norm) are left out. One spawn runs every layout."""
from __future__ import annotations

import os
from typing import Any

import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv, without_flags

ENV = {"DS_ACCELERATOR": "cpu"}
WORLD = 4
#: (tp, pp, precision, zero, gpt-style tied embeddings)
#: (ten runs were checked once, equal on every rank: these five and (1, 1, bf16, 1), (2, 1, fp32, 1),
#: (1, 2, fp32, 0), (1, 2, bf16, 1), (2, 2, fp32, 1); see docs/planner.md)
CASES = [(1, 1, "fp32", 0, False), (1, 1, "fp32", 1, False), (2, 1, "bf16", 1, False),
         (1, 2, "fp32", 1, True), (2, 2, "bf16", 1, True)]


def _argv(prefix: str, cache: str, tp: int, pp: int, precision: str, zero: int, gpt: bool) -> list[str]:
    argv = tiny_argv(prefix, cache, iters=4, extra=["--eval-iters", "0", "--tensor-model-parallel-size", str(tp),
                                                    "--pipeline-model-parallel-size", str(pp), "--zero-stage",
                                                    str(zero), "--global-batch-size", "4"])
    if precision == "bf16":
        argv.append("--bf16")
    if gpt:  # LayerNorm, GELU with biases, learned positions, tied embeddings, an odd MLP size
        argv = without_flags(argv, "--position-embedding-type", "--normalization", "--swiglu", "--disable-bias-linear",
                             "--untie-embeddings-and-output-weights", "--group-query-attention",
                             "--num-query-groups", "--ffn-hidden-size")
        argv += ["--ffn-hidden-size", "136"]
    return argv


def _walk(obj: Any, out: list, depth: int = 0) -> None:
    import torch
    if torch.is_tensor(obj):
        out.append(obj)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for x in obj:
            _walk(x, out, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            _walk(x, out, depth + 1)


def count_engine_bytes(engine: Any) -> dict[str, int]:
    """Bytes of unique storages: parameters, gradients (``.grad`` and the wrapper's gradient buffers),
    optimizer (the wrapper's other tensors, e.g. fp32 master partitions, and the optimizer state)."""
    seen: set[int] = set()
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}

    def add(t: Any, kind: str) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            return
        seen.add(st.data_ptr())
        out[kind] += st.nbytes()

    params = list(engine.module.parameters())
    for p in params:
        add(p, "parameters")
    for p in params:
        if p.grad is not None:
            add(p.grad, "gradients")
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)
    if wrapper is not inner:
        for name, value in vars(wrapper).items():
            if name == "optimizer":
                continue
            found: list = []
            _walk(value, found)
            for t in found:
                if t.numel() <= 1:
                    continue  # the wrapper's scalars (gradient norm, loss scale)
                add(t, "gradients" if "grad" in name else "optimizer")
    state: list = []
    _walk(list(inner.state.values()), state)
    for t in state:
        add(t, "optimizer")
    return out


def _body(rank: int, world_size: int, runs: list[list[str]]) -> list[dict[str, Any]]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.plan.api import vocab_size_for_arguments
    from megatron_ru.training.pretrain import setup
    results = []
    for argv in runs:
        args = parse_arguments(argv, world_size=world_size, device_type="cpu")
        trainer = setup(args)
        trainer.train_step()  # creates the optimizer state
        counted: dict[str, int] = {}
        opt = trainer.engine.optimizer
        original = opt.step

        def counting_step(*a: Any, **kw: Any) -> Any:
            counted.update(count_engine_bytes(trainer.engine))
            return original(*a, **kw)

        opt.step = counting_step
        trainer.train_step()
        opt.step = original
        trainer.metrics.close()
        results.append({"counted": counted, "vocab": vocab_size_for_arguments(args), "wrapper": type(opt).__name__})
    return results


@pytest.mark.slow
def test_state_bytes_equal_the_engines_tensors(tmp_path):
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.plan.api import buckets_for_arguments, layout_for_arguments
    from megatron_ru.plan.params import stage_tensors
    from megatron_ru.plan.states import state_bytes
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    runs = [_argv(prefix, cache, *case) for case in CASES]
    results = run_distributed(_body, WORLD, args=(runs,), timeout=600, env=ENV)
    failures, rows = [], []
    for i, (case, argv) in enumerate(zip(CASES, runs)):
        args = parse_arguments(argv, world_size=WORLD, device_type="cpu")
        layout = layout_for_arguments(args)
        for rank in range(WORLD):
            res = results[rank][i]
            tp_rank, dp_rank, pp_rank = rank % layout.tp, (rank // layout.tp) % layout.dp, rank // (layout.tp * layout.dp)
            tensors = stage_tensors(args.model, res["vocab"], layout.tp, layout.pp)[pp_rank]
            sb = state_bytes(tensors, layout, args.optimizer.optimizer, buckets_for_arguments(args), dp_rank)
            planned = {"parameters": sb.parameters, "gradients": sb.gradients, "optimizer": sb.optimizer}
            rows.append((case, rank, res["wrapper"], sb.wrapper, res["counted"], planned))
            wrapper = res["wrapper"] if sb.wrapper != "none" else "none"  # fp32 ZeRO 0: the bare optimizer
            if planned != res["counted"] or sb.wrapper != wrapper:
                failures.append(f"{case} rank {rank} (tp {tp_rank}, dp {dp_rank}, pp {pp_rank}): engine "
                                f"{res['wrapper']} {res['counted']} != planner {sb.wrapper} {planned}")
    assert not failures, "\n".join(failures)
