"""Every place we reach into DeepSpeed's internals, behind one door, with the version they were tested on.

DeepSpeed is the engine (docs/training.md); its public API covers almost all we need. Where it does
not, the patch lives here, checks that the thing it replaces still exists (a clear error naming the
tested version otherwise), and has a test in ``tests/unit/test_deepspeed_compat.py`` that proves it
takes effect on the installed DeepSpeed:

* :func:`disable_cpu_shm_comm` — ``deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False``:
  on CPU, DeepSpeed JIT-builds a shared-memory allreduce kernel on first init (~50 s); gloo does the work.
* :func:`compile_lazily` — ``deepspeed.runtime.compiler.compile``: DeepSpeed's Muon kernels, imported by every
  ZeRO and bf16 engine, ran ``torch.compile`` at import (torch's inductor: ~1.5 s of CPU per rank).
* :func:`install_fp32_clipping` — ``engine.clip_fp32_gradients``: DeepSpeed's fp32 no-ZeRO clipping
  drops replicated parameters on every pipeline stage but the first (see ``training/engine.py``).
* :func:`install_checkpoint_io` — the checkpoint engine's ``load`` (weights-only ``torch.load``, errors
  that name the file) and ``save`` (a failed write, e.g. a full disk, is recorded instead of raised
  half-way through DeepSpeed's collectives, so every rank can agree to abandon the save).
* :func:`install_exact_layer_loading` — ``PipelineModule.load_state_dir``: DeepSpeed globs
  ``layer_XX-*model_states.pt`` and merges or splits whatever it finds to fit the TP size; we read
  exactly this rank's file (``layer_XX-model_YY-model_states.pt``) or fail.
* :func:`install_numeric_model_file_order` — ``engine._get_all_ckpt_names``: DeepSpeed sorts the
  ``mp_rank_XX`` files as strings and picks the one at index ``mp_rank`` (wrong from 101 ranks on).
* :func:`create_flat_optimizer_state`, :func:`optimizer_param_names` — loading optimizer state by
  parameter name (``megatron_ru/checkpointing/loader.py``): the torch optimizer inside ZeRO 1/2 and
  bf16 optimizers creates its state at the first step and DeepSpeed links each parameter's fragment to
  it then (``_lazy_init_hp_params_optimizer_state``); we create it and link it at load time. The save
  records the optimizer's parameter order from ``engine._get_zero_param_shapes`` (what
  ``zero_to_fp32`` walks) and ``engine.checkpoint_mp_rank`` (which ``mp_rank_XX`` file is whose).
  Tested by ``tests/integration/test_reshard.py`` (state saved again equals the state loaded).
* :func:`skip_single_replica_allreduce` — ``engine.enable_backward_allreduce`` /
  ``pipeline_enable_backward_allreduce``: with one data-parallel replica, DeepSpeed's bf16 and no-ZeRO
  paths still flatten every gradient into a bucket, "all-reduce" it over one rank and copy it back
  (~6 % of a 1B bf16 step on one H200); we skip that copy, which changes no number.
* :func:`install_batched_bf16_step` — ``BF16_Optimizer.update_hp_grads``, ``.clear_hp_grads`` and
  ``.step``: the same gradients and updates with multi-tensor kernels instead of per-parameter Python
  loops, no zeroing pass over the fp32 gradients, and no host read of the clipping coefficient.
* :func:`install_grad_zero_count` — the torch optimizer's ``step`` inside the engine's optimizer: counts
  the zeros of the gradient it steps with (--log-num-zeros-in-grad), where that gradient lives on each path.
* :class:`DeepSpeedMpu` — the ``get_*`` interface DeepSpeed calls on ``mpu=`` (PP = 1); a mixin of
  :class:`~megatron_ru.parallel.state.ParallelState`, which passes itself as ``mpu``.
"""
from __future__ import annotations

import os
import re
import types
from typing import Any, Callable, Optional

from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)

#: the DeepSpeed releases these patches were tested with (setup.py states the same range)
TESTED_RANGE = ((0, 19, 8), (0, 20, 0))
TESTED_RANGE_TEXT = "deepspeed>=0.19.8,<0.20"
_version_checked = False


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def version_problem(version: str) -> Optional[str]:
    """Why ``version`` is outside the tested range (None when inside)."""
    low, high = TESTED_RANGE
    if low <= _parse_version(version) < high:
        return None
    return (f"DeepSpeed {version} is installed; megatron_ru was tested with {TESTED_RANGE_TEXT} and patches "
            f"some of its internals (megatron_ru/deepspeed_bridge/compat.py): install a tested release "
            f"(pip install '{TESTED_RANGE_TEXT}') or run tests/unit/test_deepspeed_compat.py against this one")


def check_version() -> None:
    """Warn once when the installed DeepSpeed is outside :data:`TESTED_RANGE`. (Each patch also checks
    the attribute it replaces and raises if it is gone, so an untested release fails loudly, not silently.)"""
    global _version_checked
    if _version_checked:
        return
    import deepspeed
    problem = version_problem(deepspeed.__version__)
    if problem:
        log_rank0(log, problem, level=30)
    _version_checked = True


def _missing(what: str) -> RuntimeError:
    import deepspeed
    return RuntimeError(f"DeepSpeed {deepspeed.__version__} has no {what}, which megatron_ru patches "
                        f"(megatron_ru/deepspeed_bridge/compat.py): install {TESTED_RANGE_TEXT}")


# ---- 1. no JIT build of the CPU shared-memory allreduce ---------------------------------------------

def disable_cpu_shm_comm() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory allreduce op on CPU (only a speed-up for CPU
    inference; gloo handles our collectives). DeepSpeed reads the flag in ``deepspeed.comm.torch``
    (``build_shm_op``) when its communication backend is created."""
    import torch
    if torch.cuda.is_available():
        return
    import deepspeed.ops
    ops = deepspeed.ops.__compatible_ops__
    if not isinstance(ops, dict):
        raise _missing("deepspeed.ops.__compatible_ops__ dictionary")
    ops["deepspeed_shm_comm"] = False


# ---- 1a. DeepSpeed's compiled helpers compiled when first called, not when imported -----------------------

def compile_lazily() -> None:
    """``deepspeed.runtime.compiler.compile``: DeepSpeed decorates its Muon kernels with ``torch.compile`` when
    their module is imported, and imports that module on every ZeRO and bf16 engine's start (to ask whether the
    optimizer is a Muon one); ``torch.compile`` at decoration imports torch's inductor, about 1.5 s of CPU per
    rank. Decorated through this, a function is handed to ``torch.compile`` at its first call: the same
    compiled function where Muon is used, nothing where it is not."""
    import functools

    import torch
    from deepspeed.runtime import compiler
    if not callable(getattr(compiler, "compile", None)):
        raise _missing("deepspeed.runtime.compiler.compile")
    if getattr(compiler.compile, "_megatron_ru", False):
        return

    def lazy_compile():
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = torch.compile(fn)
                return compiled(*args, **kwargs)
            return call
        return decorate

    lazy_compile._megatron_ru = True  # type: ignore[attr-defined]
    compiler.compile = lazy_compile


# ---- 1b. no gradient all-reduce over a single data-parallel replica --------------------------------------

def skip_single_replica_allreduce(engine: Any, dp_size: int) -> bool:
    """With ``dp_size`` 1, turn off DeepSpeed's gradient all-reduce where it is only a bucket copy (the bf16
    optimizer and the no-ZeRO path use ``buffered_allreduce_fallback``: flatten, scale by 1, all-reduce
    over one rank, copy back). ZeRO 1/2 optimizers with their own ``reduce_gradients`` also move the
    gradients into their partitions there, so they keep it. Returns whether it was turned off."""
    if dp_size != 1 or hasattr(engine.optimizer, "reduce_gradients") or engine.zero_optimization_partition_gradients():
        return False
    attr = "pipeline_enable_backward_allreduce" if hasattr(engine, "pipeline_enable_backward_allreduce") \
        else "enable_backward_allreduce"
    if not hasattr(engine, attr):
        raise _missing(f"{type(engine).__name__}.{attr}")
    setattr(engine, attr, False)
    return True


# ---- 1c. the bf16 optimizer's per-step loops as multi-tensor kernels -----------------------------

def install_batched_bf16_step(engine: Any) -> bool:
    """Make DeepSpeed's ``BF16_Optimizer`` (bf16 at ZeRO 1) run its per-parameter loops as multi-tensor
    kernels, with one host synchronisation per step instead of two; the numbers are DeepSpeed's:

    * ``update_hp_grads``: the first micro batch's bf16 gradients are copied into the fp32 gradients
      (``torch._foreach_copy_``), later ones added (``torch._foreach_add_``); DeepSpeed adds every one into
      a buffer it zeroed after the last step, with an fp32 copy and an add per parameter. bf16 to fp32 is
      exact and ``0 + g == g``, so the gradients are the same (a -0.0 may stay -0.0, which no later
      operation tells from 0.0).
    * ``clear_hp_grads``: only marks the fp32 gradients stale (DeepSpeed zeroes the whole buffer); the step
      zeroes those of parameters that got no gradient since (usually none) before it reads the buffer.
    * ``step``: the gradient norm from ``torch._foreach_norm`` (DeepSpeed: one ``norm`` per tensor; the
      same per-tensor norms, combined, model-parallel reduced and masked as DeepSpeed does), and clipping
      by ``min(1, max_norm / (norm + 1e-6))`` in one ``torch._foreach_mul_`` without reading the
      coefficient on the host (DeepSpeed: ``if clip_coef < 1`` on the host, then one ``mul_`` per
      tensor; multiplying by exactly 1 changes no bit). The one remaining read is the non-finite check.

    Installed where the optimizer is the plain case (no MoE, Muon, AutoEP folding; the 2-norm); returns
    whether it was. Tested bit for bit against DeepSpeed's own methods in tests/unit/test_deepspeed_compat.py."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    opt = engine.optimizer
    if not isinstance(opt, BF16_Optimizer):
        return False
    for attr in ("fp32_groups_gradients", "fp32_groups_has_gradients", "bf16_groups", "get_grads_for_norm",
                 "fp32_groups_flat_partition", "fp32_groups_gradient_flat_partition", "update_lp_params",
                 "clear_hp_grads", "clear_lp_grads", "_lazy_init_hp_params_optimizer_state", "clip_grad"):
        if not hasattr(opt, attr):
            raise _missing(f"BF16_Optimizer.{attr}")
    if (getattr(opt, "has_moe_layers", False) or getattr(opt, "_uses_muon", False) or float(opt.norm_type) != 2.0
            or getattr(opt, "autoep_folding_tp_group", None) is not None or opt.immediate_grad_update):
        return False
    opt.update_hp_grads = types.MethodType(_batched_update_hp_grads, opt)
    opt.clear_hp_grads = types.MethodType(_mark_hp_grads_stale, opt)
    opt.step = types.MethodType(_batched_bf16_step, opt)
    return True


def _batched_update_hp_grads(self: Any, clear_lp_grads: bool = False) -> None:
    import torch
    first: tuple[list, list] = ([], [])  # (fp32 gradients, bf16 gradients): copied
    more: tuple[list, list] = ([], [])  # added
    with torch.no_grad():
        for i, group in enumerate(self.bf16_groups):
            for j, lp in enumerate(group):
                if lp.grad is None:
                    continue
                hp_grad = self.fp32_groups_gradients[i][j]
                into = more if self.fp32_groups_has_gradients[i][j] else first
                into[0].append(hp_grad)
                into[1].append(lp.grad.detach().view(hp_grad.shape))
                lp._hp_grad = hp_grad
                self.fp32_groups_has_gradients[i][j] = True
        if first[0]:
            torch._foreach_copy_(*first)
        if more[0]:
            torch._foreach_add_(*more)
        if clear_lp_grads:
            lp_grads = first[1] + more[1]
            if lp_grads:
                torch._foreach_zero_(lp_grads)


def _mark_hp_grads_stale(self: Any) -> None:
    for i, group in enumerate(self.fp32_groups_gradients):
        self.fp32_groups_has_gradients[i] = [False] * len(group)


def _zero_stale_hp_grads(self: Any) -> None:
    """Zero the fp32 gradients no micro batch wrote since the last step (the optimizer reads the whole
    buffer; the alignment padding outside every parameter was zeroed at start and is never written)."""
    import torch
    stale = [g for grads, has in zip(self.fp32_groups_gradients, self.fp32_groups_has_gradients)
             for g, h in zip(grads, has) if not h]
    if stale:
        with torch.no_grad():
            torch._foreach_zero_(stale)


def _global_grad_norm(grads: list, mpu: Any) -> Any:
    """DeepSpeed's ``get_global_norm_of_tensors`` (2-norm, no MoE) with the per-tensor norms in one call."""
    import torch
    from deepspeed import comm as ds_dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().current_device_name()
    norms = torch._foreach_norm([g.detach().float() for g in grads], 2.0) if grads else []
    total = torch.stack([n.to(device) for n in norms]).pow(2.0).sum() if norms else \
        torch.zeros((), dtype=torch.float32, device=device)
    if mpu is not None:
        ds_dist.all_reduce(total, op=ds_dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.to(grads[0].device if grads else device).pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=total.device)
    return total


def _batched_bf16_step(self: Any, closure: Any = None) -> None:
    import torch
    from deepspeed.runtime.utils import is_invalid_grad_norm
    if closure is not None:
        raise NotImplementedError(f"{type(self).__name__} does not support closure.")
    self.overflow = False
    _zero_stale_hp_grads(self)
    norm = _global_grad_norm(self.get_grads_for_norm()[0], self.mpu)
    self._global_grad_norm = norm
    if is_invalid_grad_norm(norm):  # the step's one host read
        self.overflow = True
        self._global_grad_norm = float("inf")
        self.clear_hp_grads()
        self.clear_lp_grads()
        return
    if self.clip_grad > 0.0:
        grads = self.get_grads_for_norm(for_clipping=True)
        if grads:
            coef = (self.clip_grad / (norm + 1e-6)).clamp(max=1.0)
            with torch.no_grad():
                torch._foreach_mul_(grads, coef)
    for param_partition, grad_partition in zip(self.fp32_groups_flat_partition,
                                               self.fp32_groups_gradient_flat_partition):
        param_partition.grad = grad_partition.to(param_partition.dtype) \
            if grad_partition.dtype != param_partition.dtype else grad_partition
    self.optimizer.step()
    if self.grad_acc_dtype is not torch.float32:
        for param_partition in self.fp32_groups_flat_partition:
            param_partition.grad = None
    self._lazy_init_hp_params_optimizer_state()
    self.update_lp_params()
    self.clear_hp_grads()


# ---- 1d. the zeros of the gradient each step uses (--log-num-zeros-in-grad) ------------------------------

class GradZeroCount:
    """This rank's count of zero elements in the gradient its torch optimizer last stepped with (unscaled and
    clipped, as Megatron-LM's ``count_zeros_fp32``), each parameter's element counted where ``counts(param)``
    says (the grad norm's rule: TP-replicated parameters on TP rank 0, pipeline-tied copies once). A
    parameter the step gave no gradient counts as all zeros (Megatron's ``main_grad`` is a zeroed buffer).
    ``partitioned``: each data-parallel rank holds a disjoint part of the gradient (ZeRO 1/2), so the count
    is summed over the data-parallel group as well as the model-parallel one."""

    def __init__(self, engine: Any, partitioned: bool) -> None:
        self.engine, self.partitioned = engine, partitioned
        self._step, self._local = -1, None

    def add(self, zeros: Any) -> None:
        step = int(self.engine.global_steps)  # DeepSpeed counts the step after its optimizer step
        if step != self._step:
            self._step, self._local = step, zeros
        else:
            self._local = self._local + zeros

    def last(self) -> Any:
        """The count (an int64 tensor on the gradients' device, or an int) of the engine's last step; None when that step ran no optimizer step
        (a skipped step: the same on every rank)."""
        return self._local if self._step == int(self.engine.global_steps) - 1 else None


def _zeros(t: Any) -> Any:
    import torch
    return t.numel() - torch.count_nonzero(t)


def install_grad_zero_count(engine: Any, counts: Callable[[Any], bool]) -> GradZeroCount:
    """Count the zeros of the gradient before every step of the torch optimizer inside the engine's
    optimizer, where that gradient is final (after DeepSpeed's all-reduce, unscaling and clipping) and not
    yet freed:

    * no ZeRO, fp32 (the torch optimizer itself): each parameter's ``.grad``, whole on every DP rank;
    * ``BF16_Optimizer``: its fp32 gradient of each parameter (``fp32_groups_gradients``), whole on every DP
      rank (it partitions the weights and optimizer state, not this buffer);
    * ``DeepSpeedZeroOptimizer`` (ZeRO 1/2): it steps one group at a time with this DP rank's flat fp32
      partition as the only parameter; each parameter's fragment in it (``_hp_mapping``'s address) is
      counted, never the alignment padding, and the DP ranks' partitions are disjoint.

    Other optimizers (fp16 at ZeRO 0, ZeRO 3) are refused (the flag's validation refuses them first)."""
    import torch
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer):
        for attr in ("bit16_groups", "single_partition_of_fp32_groups", "optimizer"):
            if not hasattr(opt, attr):
                raise _missing(f"DeepSpeedZeroOptimizer.{attr}")

        def count(inner: Any) -> Any:
            flats = [p for g in inner.param_groups for p in g["params"]]
            total: Any = 0
            for i, flat in enumerate(opt.single_partition_of_fp32_groups):
                if not any(flat is f for f in flats) or flat.grad is None:
                    continue
                grad = flat.grad.view(-1)
                for p in opt.bit16_groups[i]:
                    m = getattr(p, "_hp_mapping", None)
                    if m is not None and counts(p):
                        at = m.get_hp_fragment_address()
                        total = total + _zeros(grad.narrow(0, at.start, at.numel))
            return total
        partitioned = True
    elif isinstance(opt, BF16_Optimizer):
        for attr in ("bf16_groups", "fp32_groups_gradients", "optimizer"):
            if not hasattr(opt, attr):
                raise _missing(f"BF16_Optimizer.{attr}")

        def count(inner: Any) -> Any:
            grads = [g for lps, gs in zip(opt.bf16_groups, opt.fp32_groups_gradients)
                     for lp, g in zip(lps, gs) if counts(lp)]
            return sum((_zeros(g) for g in grads), 0)
        partitioned = False
    elif isinstance(opt, torch.optim.Optimizer):
        def count(inner: Any) -> Any:
            total: Any = 0
            for p in (p for g in inner.param_groups for p in g["params"] if counts(p)):
                total = total + (_zeros(p.grad) if p.grad is not None else p.numel())
            return total
        partitioned = False
    else:
        raise ValueError(f"--log-num-zeros-in-grad cannot count the gradient of DeepSpeed's {type(opt).__name__} "
                         "(fp16 at --zero-stage 0, or --zero-stage 3): use --bf16 or fp32, at --zero-stage 2 or lower")
    counter = GradZeroCount(engine, partitioned)
    inner = getattr(opt, "optimizer", opt)
    step = inner.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        counter.add(count(inner))
        return step(*args, **kwargs)

    inner.step = counted_step  # type: ignore[method-assign]
    return counter


# ---- 2. TP/PP-aware fp32 gradient clipping ---------------------------------------------------------

def install_fp32_clipping(engine: Any, clip: Callable[[Any], Any]) -> None:
    """Replace ``engine.clip_fp32_gradients`` (DeepSpeed's fp32, no-ZeRO path) with ``clip(params)``,
    which clips in place and returns the global norm; DeepSpeed reports that norm as
    ``get_global_grad_norm()``."""
    if not callable(getattr(engine, "clip_fp32_gradients", None)):
        raise _missing("DeepSpeedEngine.clip_fp32_gradients")

    def clip_fp32_gradients(self: Any) -> None:
        self._global_grad_norm = clip(self.module.parameters())

    engine.clip_fp32_gradients = types.MethodType(clip_fp32_gradients, engine)


# ---- 3. the checkpoint engine's load and save -------------------------------------------------------

class SaveRecorder:
    """What went wrong while DeepSpeed (and we) wrote a checkpoint: the first failed path and error."""

    def __init__(self) -> None:
        self.failure: Optional[tuple[str, BaseException]] = None

    def run(self, path: str, write: Callable[[], None]) -> None:
        """``write()``, recording instead of raising a failure (later writes are skipped: the
        checkpoint is abandoned anyway)."""
        if self.failure is not None:
            return
        try:
            write()
        except Exception as e:  # noqa: BLE001 - any failed write abandons the save; reported by the caller
            self.failure = (path, e)


def install_checkpoint_io(engine: Any, load: Callable[[str, Any], Any],
                          recorder: Optional[SaveRecorder] = None) -> None:
    """Route DeepSpeed's checkpoint reads through ``load(path, map_location)`` and, with a
    ``recorder``, its writes through ``recorder.run`` (DeepSpeed's default engine loads with
    ``weights_only=False`` and a failed write would raise between its collectives)."""
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is None or not callable(getattr(ckpt_engine, "load", None)) or \
            not callable(getattr(ckpt_engine, "save", None)):
        raise _missing("engine.checkpoint_engine with load/save")
    original_save = getattr(ckpt_engine, "_megatron_ru_original_save", ckpt_engine.save)
    ckpt_engine._megatron_ru_original_save = original_save

    def load_(path: str, map_location: Any = None) -> Any:
        return load(path, "cpu" if map_location is None or callable(map_location) else map_location)

    ckpt_engine.load = load_
    if recorder is None:
        ckpt_engine.save = original_save
        return

    def save_(state_dict: Any, path: str) -> None:
        recorder.run(path, lambda: original_save(state_dict, path))

    ckpt_engine.save = save_


# ---- 4. a pipeline stage reads exactly its own layer files -------------------------------------------

def install_exact_layer_loading(module: Any) -> None:
    """Make ``PipelineModule.load_state_dir`` read ``layer_XX-model_YY-model_states.pt`` of this rank
    only. DeepSpeed's version globs every TP rank's file of a layer and hands the list to its
    Megatron state-dict loader, which merges or splits them when their count differs from the TP
    size: with one TP shard missing, the other rank's weights are loaded without a word."""
    for attr in ("load_state_dir", "ckpt_layer_path", "forward_funcs", "_synchronize_tied_weights"):
        if not hasattr(module, attr):
            raise _missing(f"PipelineModule.{attr}")

    def load_state_dir(self: Any, load_dir: str, checkpoint_engine: Any, strict: bool = True) -> None:
        for idx, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "load_state_dict"):
                continue  # functions have no state
            path = self.ckpt_layer_path(load_dir, idx)
            layer.load_state_dict(checkpoint_engine.load(path, map_location="cpu"), strict=strict)
        import torch
        with torch.no_grad():  # an in-place broadcast of a parameter, not part of any graph (pipeline_module)
            self._synchronize_tied_weights()

    module.load_state_dir = types.MethodType(load_state_dir, module)


def _natural_key(path: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]


def install_numeric_model_file_order(engine: Any) -> None:
    """Make ``engine._get_all_ckpt_names`` list ``mp_rank_XX`` files in rank order. DeepSpeed sorts them
    as strings and then takes the file at index ``mp_rank``: from 101 model-parallel ranks on,
    ``mp_rank_100`` sorts before ``mp_rank_10_`` and a rank would read another rank's file."""
    original = getattr(engine, "_get_all_ckpt_names", None)
    if not callable(original):
        raise _missing("DeepSpeedEngine._get_all_ckpt_names")
    original = getattr(engine, "_megatron_ru_original_ckpt_names", original)
    engine._megatron_ru_original_ckpt_names = original

    def _get_all_ckpt_names(self: Any, checkpoints_path: str, tag: str) -> list[str]:
        return sorted(original(checkpoints_path, tag), key=_natural_key)

    engine._get_all_ckpt_names = types.MethodType(_get_all_ckpt_names, engine)


# ---- 5. optimizer state by parameter name ---------------------------------------------------------------

def create_flat_optimizer_state(opt: Any, step: int) -> None:
    """Give the torch optimizer inside a ZeRO 1/2 or bf16 optimizer ``opt`` zero Adam state (``step``
    steps) for each flat fp32 partition, and link every parameter's fragment to it, so that
    ``deepspeed.utils.safe_set_full_optimizer_state`` can set it before the first step."""
    import torch

    from megatron_ru.utils.optim import adam_step_tensor
    for attr in ("optimizer", "_lazy_init_hp_params_optimizer_state", "_hp_optimizer_states_linked"):
        if not hasattr(opt, attr):
            raise _missing(f"{type(opt).__name__}.{attr}")
    base = opt.optimizer
    for group in base.param_groups:
        for flat in group["params"]:
            base.state[flat] = {"step": adam_step_tensor(step, flat, group), "exp_avg": torch.zeros_like(flat),
                                "exp_avg_sq": torch.zeros_like(flat)}
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()


_FLAT_GROUP_ATTRS = ("bit16_groups", "bf16_groups", "fp16_groups", "round_robin_bit16_groups")


def optimizer_param_names(engine: Any) -> tuple[int, list[list[str]]]:
    """(DeepSpeed's model-parallel rank of this rank's ``mp_rank_XX`` file, the module names of each
    optimizer group's parameters in the order the optimizer holds them)."""
    opt = engine.optimizer
    if any(hasattr(opt, a) for a in _FLAT_GROUP_ATTRS):
        if not callable(getattr(engine, "_get_zero_param_shapes", None)):
            raise _missing("DeepSpeedEngine._get_zero_param_shapes")
        groups = [list(g.keys()) for g in engine._get_zero_param_shapes()]
    else:  # the torch optimizer itself (ZeRO 0, fp32)
        names = {id(p): n for n, p in engine.module.named_parameters()}
        groups = [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    return int(getattr(engine, "checkpoint_mp_rank", 0)), groups


# ---- 6. the mpu interface --------------------------------------------------------------------------

class DeepSpeedMpu:
    """Mixin of :class:`~megatron_ru.parallel.state.ParallelState`: every ``get_*`` method DeepSpeed
    0.19's engine, ZeRO optimizers, gradient clipping, checkpointing and pipeline engine call on
    ``mpu``, answered from the state's attributes (``rank``, ``tp_rank``, ``mp_group``, ...).

    "Model parallel" in this interface means TP × PP (all ranks holding one replica), as in
    DeepSpeed's own ``PipelineParallelGrid``; "slice parallel" is tensor parallel. We deliberately do
    NOT define ``get_sequence_parallel_*`` / ``get_sequence_data_parallel_*``: those are
    DeepSpeed-Ulysses hooks, and their presence changes how ZeRO picks its groups. Megatron's
    ``--sequence-parallel`` lives inside the tensor-parallel group instead."""

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_size: int
    dp_size: int
    pp_size: int
    tp_ranks: list[int]
    dp_ranks: list[int]
    mp_ranks: list[int]
    is_first_stage: bool
    is_last_stage: bool
    tp_group: Any
    dp_group: Any
    pp_group: Any
    mp_group: Any
    embedding_group: Any

    def get_global_rank(self) -> int:
        return self.rank

    def get_model_parallel_rank(self) -> int:
        return self.mp_ranks.index(self.rank)

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size * self.pp_size

    def get_model_parallel_group(self) -> Any:
        return self.mp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)

    def get_pipe_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (broadcast source)."""
        return self.tp_ranks[0]

    # DeepSpeed's pipeline engine calls tensor parallelism "slice parallelism"
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def get_embedding_group(self) -> Any:
        return self.embedding_group

    def is_pipeline_first_stage(self) -> bool:
        return self.is_first_stage

    def is_pipeline_last_stage(self) -> bool:
        return self.is_last_stage
