"""Tensor-parallel-aware random numbers (Megatron's RNG tracker, device-agnostic).

Two streams matter for dropout:

* the default generator, seeded identically on every TP rank — dropout on activations
  that are replicated across TP ranks must drop the same elements everywhere;
* the ``model-parallel-rng`` stream, seeded ``seed + 2718 + tp_rank`` — dropout on
  activations that are split across TP ranks (attention heads, sequence-parallel shards)
  must differ between ranks, or every shard would reuse the same mask.

``with get_rng_tracker().fork():`` swaps the device generator's state for the named
stream and swaps it back afterwards. ``get_states()``/``set_states()`` give and take the
tracker state, for checkpoints and for activation recomputation (see :func:`checkpoint`).
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
#: Megatron's offset between the data seed and the tensor-parallel seed
TP_SEED_OFFSET = 2718


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states of the current device; ``fork(name)`` runs a block on one."""

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type or _device_type()
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states = {}
        self._seeds = set()

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"RNG seed {seed} is already used by another tracked stream")
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self._seeds.add(seed)
        saved = _get_state(self.device_type)
        torch.manual_seed(seed) if self.device_type == "cpu" else torch.cuda.manual_seed(seed)
        self._states[name] = _get_state(self.device_type)
        _set_state(self.device_type, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (safe to store in a checkpoint)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added; call "
                           f"megatron_ru.parallel.random.model_parallel_seed(seed, tp_rank) first")
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device_type)
            _set_state(self.device_type, saved)


_TRACKER = RNGStatesTracker()
#: calls per key of :func:`keyed_dropout` (part of the RNG state: saved, replayed by recomputation)
_KEYED_CALLS: dict[str, int] = {}
#: (data-parallel size, rank): call n of a DP rank is the global micro-batch n * size + rank
_KEYED_DP = (1, 0)


def set_keyed_dropout_data_parallel(size: int, rank: int) -> None:
    """Number :func:`keyed_dropout` calls as global micro-batches: the pretraining sampler gives DP rank
    ``r`` every ``size``-th micro-batch of one process's sequence (same micro-batch size), so the masks
    equal one process's at any DP size."""
    global _KEYED_DP
    _KEYED_DP = (size, rank)


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for ``name`` (a parameter's or an adapter's canonical name) under ``seed``
    (Python's hash() is salted per process); the initialisation (:mod:`megatron_ru.model.init`) and keyed
    dropout draw from it."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def keyed_dropout(key: str, x: torch.Tensor, p: float, *, full_shape: tuple[int, ...] | None = None,
                  columns: tuple[int, int] | None = None) -> torch.Tensor:
    """Dropout whose mask depends only on ``key`` (e.g. an adapter's canonical name), how many times
    it was called before, and the element's position in the full tensor — not on the layout or on the
    other random streams, so every TP/PP layout drops what one process drops. ``full_shape``/
    ``columns`` (start, width): ``x`` holds these last-dimension columns of a tensor of that shape.
    A call counts as one micro-batch (:func:`set_keyed_dropout_data_parallel`)."""
    n = _KEYED_CALLS.get(key, 0)
    _KEYED_CALLS[key] = n + 1
    gen = torch.Generator(device=x.device).manual_seed(name_seed(n * _KEYED_DP[0] + _KEYED_DP[1], key))
    # the scaled keep-mask, built in place (F.dropout takes no generator; this is also faster on CPU)
    mask = torch.rand(full_shape or tuple(x.shape), generator=gen, dtype=x.dtype, device=x.device).ge_(p)
    if columns is not None:
        mask = mask.narrow(-1, columns[0], columns[1])
    return x * mask.mul_(1.0 / (1.0 - p))


def reset_keyed_calls() -> None:
    _KEYED_CALLS.clear()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (a global like torch's own generator: dropout and
    recomputation must reach the same streams without threading an object through)."""
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int) -> None:
    """Seed the default generator with ``seed`` (same on all TP ranks) and the
    model-parallel stream with ``seed + 2718 + tp_rank`` (different on each TP rank)."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    reset_keyed_calls()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)


def get_rng_state() -> dict[str, Any]:
    """Every generator that affects training: CPU, CUDA (if present) and the tracker."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": _TRACKER.get_states(),
                             "keyed_calls": dict(_KEYED_CALLS)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    _TRACKER.set_states(state["tracker"])
    _KEYED_CALLS.clear()
    _KEYED_CALLS.update(state.get("keyed_calls", {}))


def _tracker_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """Forward context snapshots the tracker; recompute context replays from that snapshot,
    so dropout inside ``fork()`` draws the same masks when the layer is recomputed."""
    snapshot: dict[str, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def forward_ctx() -> Iterator[None]:
        snapshot["states"] = _TRACKER.get_states()
        snapshot["keyed"] = dict(_KEYED_CALLS)
        yield

    @contextlib.contextmanager
    def recompute_ctx() -> Iterator[None]:
        current, keyed = _TRACKER.get_states(), dict(_KEYED_CALLS)
        _TRACKER.set_states(snapshot["states"])
        _KEYED_CALLS.clear()
        _KEYED_CALLS.update(snapshot["keyed"])
        try:
            yield
        finally:
            _TRACKER.set_states(current)
            _KEYED_CALLS.clear()
            _KEYED_CALLS.update(keyed)

    return forward_ctx(), recompute_ctx()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Activation recomputation that also replays the TP RNG streams (torch's checkpoint
    replays only the default generators)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=_tracker_contexts, preserve_rng_state=True)


def distributed_checkpoint(function: Callable[..., torch.Tensor], group: Any, x: torch.Tensor,
                           *args: Any) -> torch.Tensor:
    """:func:`checkpoint` of ``function(x, *args)`` that keeps only this rank's ``1/|group|`` of ``x`` (Megatron's
    --distribute-saved-activations / Megatron-DeepSpeed's --distribute-checkpointed-activations): the layer input
    every tensor-parallel rank holds whole is split across them and all-gathered before the recomputation.
    ``args`` need no gradient (position ids, masks). An ``x`` without a gradient (a frozen embedding below) takes
    :func:`checkpoint`: the parameters inside must still receive theirs."""
    if not x.requires_grad or group is None or torch.distributed.get_world_size(group) == 1:
        return checkpoint(function, x, *args)
    return _DistributedCheckpoint.apply(function, group, x, *args)


def _my_part(x: torch.Tensor, group: Any) -> torch.Tensor:
    n, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    flat = x.detach().reshape(-1)
    per = -(-flat.numel() // n)
    part = flat[rank * per: (rank + 1) * per]
    if part.numel() < per:  # the last ranks' share of a numel that n does not divide
        part = torch.cat([part, part.new_zeros(per - part.numel())])
    return part.clone()  # its own storage: the whole input can be freed


def _gather_parts(part: torch.Tensor, group: Any, shape: torch.Size) -> torch.Tensor:
    parts = [torch.empty_like(part) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, part, group=group)
    numel = 1
    for d in shape:
        numel *= d
    return torch.cat(parts)[:numel].reshape(shape)


class _DistributedCheckpoint(torch.autograd.Function):
    """Forward without a graph, keeping this rank's part of the input and every generator's state; backward
    gathers the input, replays the generators, runs ``function`` again with a graph and back-propagates."""

    @staticmethod
    def forward(ctx: Any, function: Callable[..., torch.Tensor], group: Any, x: torch.Tensor,  # type: ignore[override]
                *args: Any) -> torch.Tensor:
        ctx.function, ctx.group, ctx.args, ctx.shape = function, group, args, x.shape
        ctx.rng = get_rng_state()
        with torch.no_grad():
            out = function(x, *args)
        ctx.save_for_backward(_my_part(x, group))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (part,) = ctx.saved_tensors
        x = _gather_parts(part, ctx.group, ctx.shape).requires_grad_(True)
        current = get_rng_state()
        set_rng_state(ctx.rng)
        try:
            with torch.enable_grad():
                out = ctx.function(x, *ctx.args)
        finally:
            set_rng_state(current)
        torch.autograd.backward(out, grad)
        return (None, None, x.grad) + (None,) * len(ctx.args)
