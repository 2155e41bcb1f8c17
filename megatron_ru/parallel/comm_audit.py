"""Communication audit: count the collectives and point-to-point messages a rank issues.

While a :meth:`CommAudit.window` is open, the functions of ``torch.distributed`` that move tensors
are wrapped; every call made by our code, by ``deepspeed.comm`` and by DeepSpeed's pipeline p2p is
recorded with its kind, the global ranks of its group, its payload in bytes and its call site.
Outside a window nothing is wrapped, so start-up, evaluation and checkpoints are not counted and a
process that never opens a window runs the unwrapped functions.

    audit = CommAudit.for_state(state, path="comm.jsonl")     # path None: keep records in memory only
    with audit.window(iteration):
        loss = trainer.train_step()
    audit.history[-1]["dims"]                                  # {"tp": bytes, "dp": bytes, ...}

Byte conventions (docs/comm_audit.md): the ``payload`` of one op at one rank is the size of the whole
buffer the op is about (nccl-tests' "size"): ``all_reduce``/``reduce``/``broadcast``: the tensor;
``all_gather*``: the gathered output; ``reduce_scatter*``: the unscattered input; ``send``/``recv``: the
message. ``bytes`` are what the rank moves through its link with a bandwidth-optimal algorithm
(nccl-tests' bus bytes, :func:`wire_bytes`): all-reduce 2(n-1)/n x payload, all-gather and
reduce-scatter (n-1)/n, the rest 1. Ops in a one-rank group move nothing and are listed as ``local``.

References captured at import time (``mappings._ALL_GATHER_SINGLE``, DeepSpeed's
``cdb.all_gather_function``/``reduce_scatter_function``) are swapped too; a call nested in another
wrapped call (``all_gather_into_tensor`` -> ``all_gather_single``) is counted once, as the outer op.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)

#: kinds of op, and how the payload (bytes) and the peers are read from the call's arguments
_SINGLE = "tensor"          # first tensor argument
_OUTPUT = "output"          # the gathered output (tensor or list of tensors)
_INPUT = "input"            # the unscattered input (tensor or list of tensors)

#: torch.distributed function name -> (kind, which argument holds the payload, its position, its keyword)
_FUNCTIONS: dict[str, tuple[str, str, int, str]] = {
    "all_reduce": ("all_reduce", _SINGLE, 0, "tensor"),
    "all_reduce_coalesced": ("all_reduce", _SINGLE, 0, "tensors"),
    "reduce": ("reduce", _SINGLE, 0, "tensor"),
    "broadcast": ("broadcast", _SINGLE, 0, "tensor"),
    "all_gather": ("all_gather", _OUTPUT, 0, "tensor_list"),
    "all_gather_single": ("all_gather", _OUTPUT, 0, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", _OUTPUT, 0, "output_tensor"),
    "_all_gather_base": ("all_gather", _OUTPUT, 0, "output_tensor"),
    "all_gather_coalesced": ("all_gather", _OUTPUT, 0, "output_tensor_lists"),
    "reduce_scatter": ("reduce_scatter", _INPUT, 1, "input_list"),
    "reduce_scatter_single": ("reduce_scatter", _INPUT, 1, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", _INPUT, 1, "input"),
    "_reduce_scatter_base": ("reduce_scatter", _INPUT, 1, "input"),
    "all_to_all": ("all_to_all", _INPUT, 1, "input_tensor_list"),
    "all_to_all_single": ("all_to_all", _INPUT, 1, "input"),
    "gather": ("gather", _SINGLE, 0, "tensor"),
    "scatter": ("scatter", _SINGLE, 0, "tensor"),
    "send": ("send", _SINGLE, 0, "tensor"),
    "isend": ("send", _SINGLE, 0, "tensor"),
    "recv": ("recv", _SINGLE, 0, "tensor"),
    "irecv": ("recv", _SINGLE, 0, "tensor"),
    "barrier": ("barrier", "", -1, ""),
    "monitored_barrier": ("barrier", "", -1, ""),
    "batch_isend_irecv": ("batch", "", -1, ""),
}
#: argument position and keyword of the peer of a point-to-point op (global rank unless group_* is used)
_PEER = {"send": (1, "dst"), "isend": (1, "dst"), "recv": (1, "src"), "irecv": (1, "src")}
#: module frames that are plumbing, not a call site worth naming
_PLUMBING = tuple(os.sep + os.path.join(*parts) for parts in (
    ("torch", "distributed", ""), ("torch", "utils", ""), ("torch", "_dynamo", ""), ("torch", "_compile.py"),
    ("deepspeed", "comm", ""), ("contextlib.py",), ("functools.py",)))


def wire_factor(kind: str, n: int) -> tuple[int, int]:
    """(numerator, denominator) of the bus-bytes factor of one op of ``kind`` in an ``n``-rank group
    (nccl-tests' busbw): all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n of the
    full buffer, everything else 1 (broadcast, reduce, send, recv: the payload), barrier 0."""
    if n <= 1 or kind == "barrier":
        return 0, 1
    if kind == "all_reduce":
        return 2 * (n - 1), n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, n
    return 1, 1


def wire_bytes(kind: str, payload: int, n: int) -> int:
    """Bytes one rank moves through its link for one op of ``kind`` over ``payload`` bytes in an
    ``n``-rank group (send and recv: 2-rank, the payload)."""
    num, den = wire_factor(kind, n)
    return num * payload // den


def _nbytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _dtype(x: Any) -> str:
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return str(x.dtype).replace("torch.", "") if torch.is_tensor(x) else ""


def _arg(args: tuple, kwargs: dict, pos: int, key: str) -> Any:
    if key in kwargs:
        return kwargs[key]
    return args[pos] if 0 <= pos < len(args) else None


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):
        return ()


def _short(path: str) -> str:
    parts = path.split(os.sep)
    for root in ("megatron_ru", "deepspeed", "torch", "tests", "benchmarks"):
        if root in parts:
            return os.sep.join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return path


def _call_site(depth: int = 1) -> str:
    """``path:line (function)`` of the innermost ``depth`` frames outside torch.distributed,
    deepspeed.comm and this module (paths relative to their package root), innermost first."""
    frame = sys._getframe(3)
    found: list[str] = []
    while frame is not None and len(found) < depth:
        name = frame.f_code.co_filename
        if name != __file__ and not any(p in name for p in _PLUMBING):
            found.append(f"{_short(name)}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return " < ".join(found) or "?"


class CommAudit:
    """Counts this rank's communication inside :meth:`window` s. ``groups`` names the global ranks of
    this rank's groups (``tp``, ``dp``, ``pp``, ``embedding``, ``mp``, ``cp``): an op is attributed to
    the first name whose ranks equal its group's (point-to-point: ``pp`` when the peer is in this rank's
    pipeline group, ``cp`` when it is in its context-parallel group: the ring), else to ``world`` or
    ``other``; a one-rank group is ``local``. ``dp`` is the axis gradients are reduced over (DP x CP);
    at DP 1 it is the CP group itself, so an all-to-all over the CP group (the attention's exchange) is
    ``cp`` and every other collective over it is ``dp``, the planner's split (plan/comm.py)."""

    DIMENSION_ORDER = ("tp", "dp", "pp", "embedding", "mp", "cp")

    def __init__(self, groups: dict[str, Optional[Sequence[int]]], rank: int, path: Optional[str] = None,
                 sites: int = 1) -> None:
        self.groups = {k: tuple(sorted(v)) for k, v in groups.items() if v}
        self.rank = rank
        self.path = path
        #: frames of the call site to record per op (0: none); env MEGATRON_RU_COMM_AUDIT_STACK overrides
        self.sites = int(os.environ.get("MEGATRON_RU_COMM_AUDIT_STACK", sites))
        self.history: list[dict[str, Any]] = []
        self._ops: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])  # count, payload, wire bytes
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    @classmethod
    def for_state(cls, state: Any, path: Optional[str] = None, sites: int = 1) -> "CommAudit":
        """An audit of ``state``'s (a :class:`~megatron_ru.parallel.state.ParallelState`) groups."""
        return cls({"tp": state.tp_ranks, "dp": state.dp_ranks, "pp": state.pp_ranks,
                    "embedding": state.embedding_ranks, "mp": state.mp_ranks,
                    "cp": getattr(state, "cp_ranks", None)}, state.rank, path, sites)

    # ---- classification -----------------------------------------------------------------------
    def dimension(self, kind: str, ranks: tuple[int, ...]) -> str:
        """The parallel dimension an op of ``kind`` over ``ranks`` (global) belongs to."""
        if kind in ("send", "recv"):
            peers = set(ranks) - {self.rank}
            for name in ("pp", "cp"):  # a rank's pipeline and context-parallel peers are different ranks
                if peers and peers <= set(self.groups.get(name, ())):
                    return name
            return "other"
        key = tuple(sorted(ranks))
        if len(key) <= 1:
            return "local"
        if kind == "all_to_all" and self.groups.get("cp") == key:
            return "cp"
        for name in self.DIMENSION_ORDER:
            if self.groups.get(name) == key:
                return "pp" if name == "embedding" else name
        if len(key) == dist.get_world_size():
            return "world"
        return "other"

    # ---- recording ----------------------------------------------------------------------------
    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        kind, _, pos, key = _FUNCTIONS[name]
        group = kwargs.get("group")
        if kind == "batch":
            for op in _arg(args, kwargs, 0, "p2p_op_list") or ():
                fn = getattr(op.op, "__name__", str(op.op))
                sub = "send" if "send" in fn else "recv"
                peer = op.peer if getattr(op, "group_peer", None) is None or op.group is None \
                    else dist.get_global_rank(op.group, op.group_peer)
                self._add(sub, (self.rank, peer), _nbytes(op.tensor), _dtype(op.tensor))
            return
        if kind in ("send", "recv"):
            ppos, pkey = _PEER[name]
            peer = _arg(args, kwargs, ppos, pkey)
            gpeer = kwargs.get("group_dst" if pkey == "dst" else "group_src")
            if peer is None and gpeer is not None and group is not None:
                peer = dist.get_global_rank(group, gpeer)
            ranks: tuple[int, ...] = (self.rank,) if peer is None else (self.rank, int(peer))
        else:
            if group is None:
                # positional group: after the payload/op arguments; find the ProcessGroup among args
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = _group_ranks(group)
        payload = _arg(args, kwargs, pos, key) if pos >= 0 else None
        self._add(kind, ranks, _nbytes(payload), _dtype(payload))

    def _add(self, kind: str, ranks: tuple[int, ...], nbytes: int, dtype: str) -> None:
        site = _call_site(self.sites) if self.sites else ""
        entry = self._ops[(kind, ranks, dtype, site)]
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += wire_bytes(kind, nbytes, max(len(ranks), 2) if kind in ("send", "recv") else len(ranks))

    def _wrap(self, name: str, fn: Callable) -> Callable:
        audit = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            local = audit._local
            if getattr(local, "depth", 0):
                return fn(*args, **kwargs)
            local.depth = 1
            try:
                audit._record(name, args, kwargs)
                return fn(*args, **kwargs)
            finally:
                local.depth = 0

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(fn, "__name__", name)
        return wrapper

    # ---- install / uninstall ------------------------------------------------------------------
    def _targets(self) -> Iterator[tuple[Any, str, str]]:
        """(object, attribute, function name) of every reference to wrap."""
        from torch.distributed import distributed_c10d
        for name in _FUNCTIONS:
            for module in (dist, distributed_c10d):
                if callable(getattr(module, name, None)):
                    yield module, name, name
        from megatron_ru.parallel import mappings
        for attr, fn in (("_ALL_GATHER_SINGLE", mappings._ALL_GATHER_SINGLE),
                         ("_REDUCE_SCATTER_SINGLE", mappings._REDUCE_SCATTER_SINGLE)):
            yield mappings, attr, getattr(fn, "__name__", "")
        cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
        for attr in ("all_gather_function", "reduce_scatter_function"):
            fn = getattr(cdb, attr, None)
            if fn is not None:
                yield cdb, attr, getattr(fn, "__name__", "")

    def install(self) -> None:
        if self._saved:
            return
        # one wrapper per function, whichever module holds it: torch.distributed and distributed_c10d must
        # keep naming the same object (P2POp checks its op against distributed_c10d's isend/irecv)
        wrappers: dict[int, Callable] = {}
        for obj, attr, name in self._targets():
            if name not in _FUNCTIONS:
                continue
            fn = getattr(obj, attr)
            self._saved.append((obj, attr, fn))
            if id(fn) not in wrappers:
                wrappers[id(fn)] = self._wrap(name, fn)
            setattr(obj, attr, wrappers[id(fn)])

    def uninstall(self) -> None:
        for obj, attr, fn in reversed(self._saved):
            setattr(obj, attr, fn)
        self._saved = []

    # ---- windows ------------------------------------------------------------------------------
    @contextmanager
    def window(self, iteration: int) -> Iterator[None]:
        """Count the ops issued inside the block as iteration ``iteration``; appends the record to
        :attr:`history` and, with a path, to the JSONL file."""
        self._ops.clear()
        self.install()
        try:
            yield
        finally:
            self.uninstall()
        record = self.snapshot(iteration)
        self.history.append(record)
        if self.path:
            self._write(record)

    def snapshot(self, iteration: int) -> dict[str, Any]:
        ops, dims, payloads = [], defaultdict(int), defaultdict(int)
        for (kind, ranks, dtype, site), (count, nbytes, wire) in sorted(self._ops.items(), key=lambda kv: kv[0][:3]):
            dim = self.dimension(kind, ranks)
            ops.append({"kind": kind, "group": list(ranks), "dim": dim, "dtype": dtype, "count": count,
                        "payload": nbytes, "bytes": wire, **({"site": site} if site else {})})
            if dim != "local":
                dims[dim] += wire
                payloads[dim] += nbytes
        return {"iteration": iteration, "rank": self.rank, "dims": dict(dims), "payload": dict(payloads),
                "ops": ops}

    def _write(self, record: dict[str, Any]) -> None:
        path = self.path.format(rank=self.rank) if "{rank}" in self.path else self.path  # type: ignore[union-attr]
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # one write() per line on an O_APPEND descriptor: ranks sharing the file do not interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)


class _NoAudit:
    """What the loop holds when --comm-audit is not given: windows that do nothing."""

    @property
    def history(self) -> list[dict[str, Any]]:
        return []

    @contextmanager
    def window(self, iteration: int) -> Iterator[None]:
        yield


def audit_for_run(path: Optional[str], state: Any) -> "CommAudit | _NoAudit":
    """The loop's audit: a :class:`CommAudit` writing ``path`` (``{rank}`` in it: one file per rank),
    or one that does nothing when ``path`` is None."""
    if not path:
        return _NoAudit()
    log_rank0(log, f"communication audit: the ops of every iteration go to {path}")
    return CommAudit.for_state(state, path)
