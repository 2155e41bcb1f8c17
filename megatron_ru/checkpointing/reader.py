"""Read any megatron_ru checkpoint as canonical full tensors, offline (CPU, no process group).

Three layouts are read:

* the layer format (:mod:`megatron_ru.checkpointing.layout`), written by training and :func:`write_checkpoint`;
* DeepSpeed's PP > 1 files: ``layer_{j:02d}-model_{t:02d}-model_states.pt`` = layer ``j``'s TP shard ``t``
  (local names);
* DeepSpeed's PP = 1 files: ``mp_rank_{t:02d}_model_states.pt``, whose ``module`` holds TP shard ``t``
  of every parameter under its canonical name (memory-mapped: only the tensors asked for are read).

TP shards are joined with each parameter's partition dim and stride and the vocabulary padding is
cut to the model's ``V`` rows (:meth:`CheckpointReader.get`), or a shard at another TP size is taken from
the parts of the saved shards it overlaps (:meth:`CheckpointReader.shard_at`, what the loader uses). Files
are read one layer at a time (the previous layer's are dropped).

Optimizer state (:meth:`CheckpointReader.optimizer_state`), as full canonical fp32 tensors
(``fp32`` master weight, ``exp_avg``, ``exp_avg_sq``):

* layer format: its per-layer optimizer files, or (from training) each TP shard's fragments joined over the
  data-parallel ranks' ``optim_states-pp*-tp*-dp*.pt`` files;
* ZeRO 0, fp32: torch AdamW's state inside the ``mp_rank`` files, matched to parameters by the
  ordered canonical names of each optimizer group that the save recorded in ``metadata.json``
  (``optimizer_groups``; for PP = 1 checkpoints saved before that, rebuilt from the module's order);
* ZeRO 1 (fp32, bf16, fp16): the flat fp32 partitions of ``[bf16_]zero_pp_rank_{d}_mp_rank_{m}``
  concatenated over the data-parallel ranks ``d`` and walked with the ``param_shapes`` of the model
  file, like DeepSpeed's ``zero_to_fp32`` (each partition's alignment padding cut first).

Anything else in DeepSpeed's files (ZeRO 2/3, ZeRO 0 with bf16/fp16) is refused by name with the flag to
change.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

from megatron_ru.checkpointing.files import CheckpointError, check_files, list_files, safe_load
from megatron_ru.checkpointing.layout import (LAYERS_FORMAT, OPTIM_KEYS, layer_file, layer_optim_file,
                                              mp_model_file, mp_rank_of, optim_fragment_file,
                                              specs_by_name, stage_of)
from megatron_ru.checkpointing.lora_base import verify
from megatron_ru.checkpointing.meta import (TRACKER_FILE, CheckpointMeta, iteration_dir_name,
                                            read_latest_iteration)
from megatron_ru.model.spec import (ParamSpec, canonical_name, model_config_from_dict, padded_vocab_rows,
                                    shard_from_saved, stage_bounds)
from megatron_ru.parallel.utils import unshard_tensors
from megatron_ru.utils.logging import get_logger
from megatron_ru.utils.optim import weight_decay_groups

log = get_logger(__name__)

__all__ = ["CheckpointReader", "read_checkpoint"]

_ITER_DIR = re.compile(r"^iter_\d{7,}$")


def read_checkpoint(load_dir: str, iteration: Optional[int] = None) -> "CheckpointReader":
    """The checkpoint ``latest`` points at in ``load_dir`` (or ``iteration``)."""
    load_dir = os.path.abspath(load_dir)
    if iteration is None and _ITER_DIR.match(os.path.basename(load_dir)) and \
            os.path.isfile(os.path.join(load_dir, "metadata.json")):  # an iter_* directory itself
        return CheckpointReader(load_dir, CheckpointMeta.read(load_dir))
    if iteration is None:
        if not os.path.isdir(load_dir):
            raise FileNotFoundError(f"--load {load_dir} does not exist: point it at a megatron_ru checkpoint "
                                    f"directory (it holds {TRACKER_FILE})")
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            raise CheckpointError(f"--load {load_dir} holds no {TRACKER_FILE}: point it at a directory written by "
                                  f"pretrain_gpt.py --save or tools/convert_checkpoint.py")
    ckpt_dir = os.path.join(load_dir, iteration_dir_name(iteration))
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} does not exist: the checkpoint of iteration {iteration} is missing; "
                              f"fix {os.path.join(load_dir, TRACKER_FILE)} or pick an existing iter_* directory")
    return CheckpointReader(ckpt_dir, CheckpointMeta.read(ckpt_dir))


def _precision(meta: CheckpointMeta) -> str:
    training = (meta.args or {}).get("training", {}) if isinstance(meta.args, dict) else {}
    return "bf16" if training.get("bf16") else "fp16" if training.get("fp16") else "fp32"


class CheckpointReader:
    """Canonical full tensors of one checkpoint directory (``iter_XXXXXXX``)."""

    def __init__(self, ckpt_dir: str, meta: CheckpointMeta) -> None:
        self.dir = ckpt_dir
        self.meta = meta
        if meta.model_args is None or meta.vocab_size is None:
            raise CheckpointError(f"{os.path.join(ckpt_dir, 'metadata.json')} records no model arguments "
                                  f"(model_args, vocab_size): it was saved by an older megatron_ru; resume it "
                                  f"once with this version and save again to convert or reshard it")
        self.cfg = model_config_from_dict(meta.model_args)
        self.vocab_size = int(meta.vocab_size)
        self.tp = meta.tensor_model_parallel_size
        self.pp = meta.pipeline_model_parallel_size
        self.specs = specs_by_name(self.cfg, self.vocab_size)
        self.rows = padded_vocab_rows(self.cfg, self.vocab_size, self.tp)
        self.kind = "layers" if meta.format == LAYERS_FORMAT else "ds_pipe" if self.pp > 1 else "ds_mp"
        if meta.format not in (None, LAYERS_FORMAT):
            raise CheckpointError(f"{ckpt_dir}: unknown checkpoint format {meta.format!r} (this megatron_ru reads "
                                  f"{LAYERS_FORMAT!r} and DeepSpeed's files)")
        if meta.format is None and meta.zero_stage == 3:
            raise CheckpointError(f"{ckpt_dir} was saved with ZeRO stage 3 (the weights themselves are partitioned "
                                  f"over the data-parallel ranks), which megatron_ru cannot read offline: resume it "
                                  f"at its own layout with --zero-stage 3, or train with --zero-stage 0 or 1 to get "
                                  f"checkpoints that convert and reshard")
        self._present = sorted(list_files(ckpt_dir))
        self._check({"model"})
        self._layer: Optional[tuple[int, list[dict[str, Any]]]] = None
        self._ahead: Optional[tuple[int, Any]] = None   # (layer, Future of its files) read in the background
        self._pool: Any = None
        self._optim_layer: Optional[tuple[int, list[dict[str, Any]]]] = None
        self._mp_files: dict[int, dict[str, Any]] = {}
        self._layer_mapped: dict[str, dict[str, Any]] = {}
        self._mapped_layer: Optional[int] = None
        self._flat: dict[int, dict[str, Any]] = {}
        self._zero0: dict[int, dict[str, int]] = {}
        self._optim_checked = False
        self._frozen_logged: set[str] = set()
        self._base: Optional["CheckpointReader"] = None

    # ---- files -----------------------------------------------------------------------------------

    def _check(self, kinds: set[str]) -> None:
        pointer = os.path.join(os.path.dirname(self.dir), TRACKER_FILE)
        check_files(self.dir, self.meta.expected_files(self._present), kinds=kinds, pointer=pointer, earlier=[])

    def _load(self, name: str, mmap: bool = True) -> Any:
        """``mmap``: for files that hold more than one layer (tensors read when touched); a file of one
        layer is read whole, in large sequential reads (mapping it page by page is ~2x slower)."""
        return safe_load(os.path.join(self.dir, name), mmap=mmap)

    def _map_layer(self, layer: int) -> None:
        """Readers go through the layers in order: on a new layer, drop the memory-mapped DeepSpeed files (model
        states, ZeRO partitions); they are mapped again when read, so the pages touched for earlier layers leave
        this process's memory."""
        if self._mapped_layer != layer:
            self._mp_files.clear()
            self._flat.clear()
            self._layer_mapped.clear()
            self._mapped_layer = layer

    def _mp_file(self, mp_rank: int) -> dict[str, Any]:
        """The memory-mapped ``mp_rank_XX_model_states.pt`` of model-parallel rank ``mp_rank`` (ZeRO 0: with the
        optimizer's state). One stage's TP ranks' files are kept at a time: the pages a mapping has touched count
        in the process's memory until it is dropped, and the loaders walk the stages in order."""
        if mp_rank not in self._mp_files:
            if len(self._mp_files) >= self.tp:
                self._mp_files.clear()
            self._mp_files[mp_rank] = self._load(mp_model_file(mp_rank))
        return self._mp_files[mp_rank]

    def names(self) -> list[str]:
        """Canonical parameter names, in model order."""
        return list(self.specs)

    def spec(self, name: str) -> ParamSpec:
        if name not in self.specs:
            raise KeyError(f"{name!r} is not a parameter of this model (its parameters: "
                           f"{', '.join(list(self.specs)[:4])}, ...)")
        return self.specs[name]

    # ---- weights ---------------------------------------------------------------------------------

    def _read_layer_files(self, layer: int) -> list[dict[str, Any]]:
        return [self._load(layer_file(layer, t), mmap=False) for t in range(self.tp)]

    def _layer_files(self, layer: int) -> list[dict[str, Any]]:
        """Layer ``layer``'s files; the next layer's are read meanwhile in a background thread (readers
        go through the layers in order: reading overlaps joining and writing; two layers in memory)."""
        ahead = self._ahead
        self._ahead = None
        files = ahead[1].result() if ahead is not None and ahead[0] == layer else self._read_layer_files(layer)
        nxt = layer + 1
        if any(s.layer_index == nxt for s in self.specs.values()) and \
                all(layer_file(nxt, t) in self._present for t in range(self.tp)):
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-read-ahead")
            self._ahead = (nxt, self._pool.submit(self._read_layer_files, nxt))
        return files

    def _check_layer_file(self, layer: int, t: int, f: dict[str, Any]) -> None:
        if self.kind == "layers":  # our own files hold exactly the layer's parameters
            expected = {s.local_name for s in self.specs.values() if s.layer_index == layer}
            unexpected = sorted(set(f) - expected)
            if unexpected:
                raise CheckpointError(
                    f"{os.path.join(self.dir, layer_file(layer, t))} holds {', '.join(unexpected)}, which "
                    f"layer {layer} of the model in metadata.json does not have: the file is from another "
                    f"model or metadata.json was altered")

    def _layer_shards(self, layer: int) -> list[dict[str, Any]]:
        """Every TP rank's file of layer ``layer`` (full tensors are joined from them)."""
        if self._layer is None or self._layer[0] != layer:
            self._layer = None  # drop the previous layer's files before reading the next
            files = self._layer_files(layer)
            for t, f in enumerate(files):
                self._check_layer_file(layer, t, f)
            self._layer = (layer, files)
        return self._layer[1]

    def _layer_shard_file(self, layer: int, t: int) -> dict[str, Any]:
        """TP rank ``t``'s file of layer ``layer`` alone (memory-mapped: a loading rank reads only the shards,
        or the parts of them, it keeps), unless every TP rank's file of the layer is already in memory."""
        if self._layer is not None and self._layer[0] == layer:
            return self._layer[1][t]
        self._map_layer(layer)
        return self._mapped(layer_file(layer, t), lambda f: self._check_layer_file(layer, t, f))

    def _mapped(self, name: str, check: Any = None) -> dict[str, Any]:
        """File ``name`` memory-mapped, once per layer (dropped by :meth:`_map_layer` on the next); ``check(f)``
        when it is first read."""
        if name not in self._layer_mapped:
            f = self._load(name)
            if check is not None:
                check(f)
            self._layer_mapped[name] = f
        return self._layer_mapped[name]

    def _expected_shard_shape(self, spec: ParamSpec) -> tuple[int, ...]:
        shape = list(spec.shape)
        if spec.vocab:
            shape[0] = self.rows
        if spec.partition_dim is not None:
            shape[spec.partition_dim] //= self.tp
        return tuple(shape)

    def _checked(self, spec: ParamSpec, tensor: Any, where: str, key: str) -> torch.Tensor:
        want = self._expected_shard_shape(spec)
        if not torch.is_tensor(tensor):
            raise CheckpointError(f"{os.path.join(self.dir, where)}: {key!r} is not a tensor "
                                  f"({type(tensor).__name__}); the file is damaged")
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{os.path.join(self.dir, where)}: {key!r} has shape {list(tensor.shape)}, "
                                  f"expected {list(want)} (TP shard of {spec.name} {list(spec.shape)} at TP "
                                  f"{self.tp}); the file does not match the checkpoint's model arguments")
        return tensor

    def _weight_shard(self, spec: ParamSpec, t: int) -> torch.Tensor:
        if self.kind == "ds_mp":
            self._map_layer(spec.layer_index)
            module = self._mp_file(t).get("module") or {}
            where, key = mp_model_file(t), spec.name
            if key not in module and self.meta.lora_base is not None:
                return self._from_base(spec, t)
            if key not in module:
                raise CheckpointError(f"{os.path.join(self.dir, where)} has no {key!r}: the file is damaged or "
                                      f"from another model")
            return self._checked(spec, module[key], where, key)
        shard = self._layer_shard_file(spec.layer_index, t)
        where, key = layer_file(spec.layer_index, t), spec.local_name
        if key not in shard and self.meta.lora_base is not None:
            return self._from_base(spec, t)
        if key not in shard:
            raise CheckpointError(f"{os.path.join(self.dir, where)} has no {key!r} (it holds "
                                  f"{', '.join(sorted(shard))}): the file is damaged or from another model")
        return self._checked(spec, shard[key], where, key)

    def _from_base(self, spec: ParamSpec, t: int) -> torch.Tensor:
        """A frozen tensor of a LoRA checkpoint: read from its base checkpoint (any layout), as TP shard ``t``."""
        base = self.meta.lora_base or {}
        if self._base is None:
            try:
                reader = read_checkpoint(base["load"], int(base["iteration"]))
            except (OSError, CheckpointError) as e:
                raise CheckpointError(f"{self.dir} holds only the LoRA adapters and trained modules; its frozen weights "
                                      f"are in {base.get('load')} iteration {base.get('iteration')} (lora_base in "
                                      f"metadata.json), which cannot be read: {e}") from None
            verify(self.dir, base)  # the same base by content, not only by path
            self._base = reader
        return self._base.shard_at(spec.name, self.tp, t)  # from the base's shards it overlaps

    def _join(self, spec: ParamSpec, shards: list[torch.Tensor], copy: bool = True) -> torch.Tensor:
        """The canonical tensor from the TP shards, vocabulary padding cut. ``copy=False``: a single shard is
        returned as a view (of a memory-mapped file's tensor or of the reader's cache: not to be modified)."""
        shards = [s.detach() for s in shards]
        if len(shards) == 1 and not copy:
            full = shards[0]
        elif spec.partition_dim is None:
            full = shards[0].clone()
        else:
            full = unshard_tensors(shards, spec.partition_dim, spec.partition_stride)
        if spec.vocab:  # the padding rows are cut (a view)
            full = full[: self.vocab_size]
        return full

    def weight_file(self, name: str, tp_rank: Optional[int] = None) -> str:
        """The path of the file holding TP shard ``tp_rank`` of ``name`` (None: every TP rank's, as a pattern)."""
        spec = self.spec(name)
        if self.kind == "ds_mp":
            file, tp_part = mp_model_file(0 if tp_rank is None else tp_rank), "mp_rank_"
        else:
            file, tp_part = layer_file(spec.layer_index, 0 if tp_rank is None else tp_rank), "-model_"
        if tp_rank is None:  # the TP rank's field as a pattern
            file = file.replace(f"{tp_part}00", f"{tp_part}*", 1)
        return os.path.join(self.dir, file)

    def shard(self, name: str, tp_rank: int) -> torch.Tensor:
        """TP shard ``tp_rank`` of parameter ``name`` at the checkpoint's own TP (vocabulary padding kept)."""
        return self._weight_shard(self.spec(name), tp_rank).detach()

    def _reslice(self, spec: ParamSpec, tp: int, rank: int, read: Any) -> torch.Tensor:
        """TP shard ``rank`` at TP size ``tp`` (vocabulary rows padded for ``tp``) from only the saved shards it
        overlaps (``read(t)``: saved shard ``t``): the saved shard itself at the saved TP size, otherwise views
        of the parts it overlaps, joined (:func:`~megatron_ru.model.spec.shard_from_saved`)."""
        rows = padded_vocab_rows(self.cfg, self.vocab_size, tp)
        if spec.partition_dim is None:
            return read(0)
        if tp == self.tp and (not spec.vocab or rows == self.rows):
            return read(rank)
        return shard_from_saved(spec, read, self.vocab_size, self.rows, self.tp, rows, tp, rank)

    def shard_at(self, name: str, tp: int, rank: int) -> torch.Tensor:
        """TP shard ``rank`` of parameter ``name`` at TP size ``tp`` (vocabulary padding for ``tp``) read from
        the saved shards it overlaps only."""
        spec = self.spec(name)
        return self._reslice(spec, tp, rank, lambda t: self._weight_shard(spec, t).detach())

    def optimizer_shard_at(self, name: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
        """Like :meth:`shard_at` for ``{"fp32", "exp_avg", "exp_avg_sq"}``."""
        spec = self.spec(name)
        self._require_optimizer()
        saved: dict[int, dict[str, torch.Tensor]] = {}

        def read(t: int) -> dict[str, torch.Tensor]:
            if t not in saved:
                saved[t] = self._optim_shard(spec, t)
            return saved[t]

        return {key: self._reslice(spec, tp, rank, lambda t: read(t)[key].detach()).float() for key in OPTIM_KEYS}

    def get(self, name: str) -> torch.Tensor:
        """The full canonical tensor (``V`` rows for the vocabulary matrices), in the file's dtype."""
        spec = self.spec(name)
        if self.kind != "ds_mp" and spec.partition_dim is not None:
            self._layer_shards(spec.layer_index)  # every TP rank's file of the layer, the next read meanwhile
        return self._join(spec, [self._weight_shard(spec, t) for t in range(self.tp)])

    # ---- optimizer state -------------------------------------------------------------------------

    def optimizer_problem(self) -> Optional[str]:
        """Why this checkpoint's optimizer state cannot be read (None: it can)."""
        m = self.meta
        if self.kind == "layers":
            return None if m.optimizer is not None else (
                f"{self.dir} was written without optimizer state (weights only)")
        precision = _precision(m)
        if m.zero_stage == 1:
            return None
        if m.zero_stage == 0 and precision == "fp32":
            return None
        return (f"{self.dir} holds the optimizer state of ZeRO stage {m.zero_stage} with {precision}, which "
                f"megatron_ru cannot convert (supported: ZeRO stage 0 with fp32, ZeRO stage 1 with fp32, bf16 or "
                f"fp16): convert the weights only (--no-load-optim), or train with --zero-stage 1 (or 0 with "
                f"fp32) and save again")

    @property
    def has_optimizer_state(self) -> bool:
        return self.optimizer_problem() is None

    def _require_optimizer(self) -> None:
        problem = self.optimizer_problem()
        if problem:
            raise CheckpointError(problem)
        if not self._optim_checked:
            self._check({"optim"})
            self._optim_checked = True

    def _mp_of(self, spec: ParamSpec, t: int) -> int:
        if self.pp == 1:
            return t
        stage = stage_of(spec.layer_index, stage_bounds(self.cfg, self.pp))
        recorded = self.meta.optimizer_groups or {}
        for key, rec in recorded.items():
            if rec.get("pp_rank") == stage and rec.get("tp_rank") == t:
                return int(key)
        return mp_rank_of(stage, t, self.tp)

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor]:
        """``{"fp32", "exp_avg", "exp_avg_sq"}``: full canonical fp32 tensors of parameter ``name`` (read-only:
        from a checkpoint at TP 1 they are views of the file's tensors, not copies)."""
        spec = self.spec(name)
        self._require_optimizer()
        per_rank = [self._optim_shard(spec, t) for t in range(self.tp)]
        return {k: self._join(spec, [s[k] for s in per_rank], copy=False).float() for k in OPTIM_KEYS}

    def optimizer_shard(self, name: str, tp_rank: int) -> dict[str, torch.Tensor]:
        """Like :meth:`optimizer_state`, TP shard ``tp_rank`` at the checkpoint's own TP (padding kept)."""
        self._require_optimizer()
        return {k: v.detach().float() for k, v in self._optim_shard(self.spec(name), tp_rank).items()}

    def _fragment_shard(self, spec: ParamSpec, t: int) -> dict[str, torch.Tensor]:
        """TP shard ``t``'s optimizer state, joined from the fragments the data-parallel ranks saved."""
        self._map_layer(spec.layer_index)
        stage = stage_of(spec.layer_index, stage_bounds(self.cfg, self.pp))
        shape = self._expected_shard_shape(spec)
        numel = int(torch.Size(shape).numel())
        pieces = []
        for d in range(int(self.meta.optimizer_fragments or 1)):
            frag = self._mapped(optim_fragment_file(stage, t, d)).get(spec.name)
            if frag is not None:
                pieces.append((int(frag["offset"]), d, frag))
        if not pieces:
            return self._untrained(spec, t)
        pieces.sort(key=lambda x: x[0])
        out = {}
        for key in OPTIM_KEYS:
            parts, at = [], 0
            for offset, d, frag in pieces:
                where = optim_fragment_file(stage, t, d)
                value = frag.get(key)
                if value is None and key == "fp32":  # ZeRO 0 in fp32: the weight is the master
                    value = self._weight_shard(spec, t).detach().reshape(-1)[offset:]
                if not torch.is_tensor(value) or offset != at:
                    raise CheckpointError(f"{os.path.join(self.dir, where)}: the {key} fragment of {spec.name} "
                                          f"{'is not a tensor' if not torch.is_tensor(value) else f'starts at element {offset}, expected {at}'}: "
                                          f"the optimizer files are damaged or from another run")
                parts.append(value.reshape(-1))
                at += value.numel()
            if at != numel:
                raise CheckpointError(f"{self.dir}: the saved {key} fragments of {spec.name} hold {at} values, its TP "
                                      f"shard has {numel}: an optimizer file is missing or from another run")
            full = parts[0] if len(parts) == 1 else torch.cat(parts)
            out[key] = full.view(shape).float()
        return out

    def _optim_shard(self, spec: ParamSpec, t: int) -> dict[str, torch.Tensor]:
        if self.kind == "layers" and self.meta.optimizer_fragments:
            return self._fragment_shard(spec, t)
        if self.kind == "layers":
            layer = spec.layer_index
            if self._optim_layer is None or self._optim_layer[0] != layer:
                self._optim_layer = None
                self._optim_layer = (layer, [self._load(layer_optim_file(layer, r), mmap=False)
                                             for r in range(self.tp)])
            where = layer_optim_file(layer, t)
            state = self._optim_layer[1][t].get(spec.local_name)
            if not isinstance(state, dict):
                raise CheckpointError(f"{os.path.join(self.dir, where)} has no optimizer state for "
                                      f"{spec.local_name!r}: the file is damaged")
            return {k: self._checked(spec, state.get(k), where, f"{spec.local_name}.{k}") for k in OPTIM_KEYS}
        mp = self._mp_of(spec, t)
        if self.meta.zero_stage == 0:
            return self._zero0_shard(spec, t, mp)
        return self._zero1_shard(spec, mp, t)

    def _group_names(self, mp: int) -> list[list[str]]:
        """Ordered canonical names of each optimizer group of model-parallel rank ``mp`` (ZeRO 0)."""
        rec = (self.meta.optimizer_groups or {}).get(str(mp))
        if rec is not None:
            return [list(g) for g in rec["groups"]]
        if self.pp > 1:
            raise CheckpointError(f"{self.dir}: the save did not record the order of the optimizer's parameters "
                                  f"(saved by an older megatron_ru); convert the weights only (--no-load-optim), "
                                  f"or resume once at the checkpoint's layout and save again")
        module = self._mp_file(mp).get("module") or {}
        names = [k for k in module if k in self.specs]
        return [g for _, g in weight_decay_groups(names, lambda n: module[n].ndim >= 2)]  # the engine's groups

    def _zero0_index(self, mp: int, optim: dict[str, Any], where: str) -> dict[str, int]:
        """{canonical name: index in torch's optimizer state} of model-parallel rank ``mp`` (ZeRO 0)."""
        if mp in self._zero0:
            return self._zero0[mp]
        groups = self._group_names(mp)
        if len(groups) != len(optim["param_groups"]):
            raise CheckpointError(f"{os.path.join(self.dir, where)}: the optimizer has {len(optim['param_groups'])} "
                                  f"parameter groups, metadata.json records {len(groups)}: the checkpoint is damaged")
        index: dict[str, int] = {}
        for g, (names, group) in enumerate(zip(groups, optim["param_groups"])):
            if len(names) != len(group["params"]):
                raise CheckpointError(f"{os.path.join(self.dir, where)}: optimizer group {g} has "
                                      f"{len(group['params'])} parameters, the recorded order {len(names)}")
            for n, idx in zip(names, group["params"]):
                index[canonical_name(n, self.cfg)] = idx
        self._zero0[mp] = index
        return index

    def _zero0_shard(self, spec: ParamSpec, t: int, mp: int) -> dict[str, torch.Tensor]:
        self._map_layer(spec.layer_index)
        where = mp_model_file(mp)
        optim = self._mp_file(mp).get("optimizer")
        if not isinstance(optim, dict) or "state" not in optim:
            raise CheckpointError(f"{os.path.join(self.dir, where)} holds no optimizer state (ZeRO stage 0): the "
                                  f"file is damaged; convert the weights only with --no-load-optim")
        index = self._zero0_index(mp, optim, where).get(spec.name)
        if index is None or index not in optim["state"]:
            return self._untrained(spec, t)
        state = optim["state"][index]
        out = {"fp32": self._weight_shard(spec, t).float()}
        for k in ("exp_avg", "exp_avg_sq"):
            out[k] = self._checked(spec, state.get(k), where, f"optimizer state {index}.{k}")
        return out

    def _optim_files(self, mp: int) -> list[dict[str, Any]]:
        dp = self.meta.data_parallel_size
        prefixes = sorted({n.split("zero_pp_rank_")[0] for n in self._present if "zero_pp_rank_" in n
                           and n.endswith("_optim_states.pt")})
        if not prefixes:
            raise CheckpointError(f"{self.dir} holds no *zero_pp_rank_*_optim_states.pt files although saved with "
                                  f"ZeRO stage 1: the checkpoint is incomplete; convert the weights only with "
                                  f"--no-load-optim")
        return [self._load(f"{prefixes[0]}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")["optimizer_state_dict"]
                for d in range(dp)]

    def _flat_index(self, mp: int) -> dict[str, Any]:
        """Where each parameter of model-parallel rank ``mp`` lies in its group's flat fp32 vector."""
        if mp in self._flat:
            return self._flat[mp]
        if len(self._flat) >= self.tp:
            self._flat.clear()  # one stage's TP ranks' (memory-mapped) files at a time
        where = mp_model_file(mp)
        shapes = self._mp_file(mp).get("param_shapes")
        if not shapes:
            rec = (self.meta.optimizer_groups or {}).get(str(mp))
            if rec is None:
                raise CheckpointError(f"{os.path.join(self.dir, where)} has no param_shapes: the optimizer state "
                                      f"cannot be matched to parameters; convert the weights only "
                                      f"(--no-load-optim)")
            shapes = [{n: self.specs[canonical_name(n, self.cfg)].shape for n in g} for g in rec["groups"]]
        parts = self._optim_files(mp)
        bounds = stage_bounds(self.cfg, self.pp)
        stage = mp // self.tp if self.pp > 1 else 0
        index: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        for g, group in enumerate(shapes):
            offset = 0
            for n, shape in group.items():
                numel = int(torch.Size(shape).numel())
                cname = canonical_name(n, self.cfg)
                spec = self.specs.get(cname)
                # a tied weight is in both end stages' groups: read it from the stage that holds layer 0
                if spec is not None and (self.pp == 1 or stage_of(spec.layer_index, bounds) == stage):
                    index[cname] = (g, offset, tuple(shape))
                offset += numel
            total = sum(int(p["single_partition_of_fp32_groups"][g].numel()) for p in parts)
            if total < offset:
                raise CheckpointError(f"{self.dir}: the ZeRO partitions of model-parallel rank {mp}, group {g} hold "
                                      f"{total} values, its parameters need {offset}: the optimizer files are "
                                      f"damaged or from another model")
        self._flat[mp] = {"index": index, "parts": parts}
        return self._flat[mp]

    def _untrained(self, spec: ParamSpec, t: int) -> dict[str, torch.Tensor]:
        """A parameter the optimizer did not hold (frozen with --freeze / --train-only-embeddings): its
        weight as the master and zero moments, i.e. the state a fresh optimizer would give it."""
        if spec.name not in self._frozen_logged:
            self._frozen_logged.add(spec.name)
            log.info(f"{spec.name}: no optimizer state in {self.dir} (frozen while training): written with zero "
                     f"Adam moments")
        weight = self._weight_shard(spec, t).detach().float()
        return {"fp32": weight, "exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight)}

    def _zero1_shard(self, spec: ParamSpec, mp: int, t: int) -> dict[str, torch.Tensor]:
        self._map_layer(spec.layer_index)
        flat = self._flat_index(mp)
        if spec.name not in flat["index"]:
            return self._untrained(spec, t)
        g, offset, shape = flat["index"][spec.name]
        numel = int(torch.Size(shape).numel())
        out = {}
        for key in OPTIM_KEYS:
            pieces, start = [], 0
            for p in flat["parts"]:
                fp32 = p["single_partition_of_fp32_groups"][g]
                if key == "fp32":
                    vec = fp32
                else:
                    base = p["base_optimizer_state"]
                    # elastic_checkpoint: one state per group; otherwise torch's state_dict
                    moments = base[g] if isinstance(base, list) else base["state"].get(g, {})
                    # no state: saved before the optimizer's first step (weights-only load, no update yet)
                    vec = moments[key][: fp32.numel()] if key in moments else torch.zeros(fp32.numel())
                stop = start + vec.numel()
                lo, hi = max(start, offset), min(stop, offset + numel)
                if lo < hi:
                    pieces.append(vec[lo - start: hi - start])
                start = stop
            value = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).float().view(shape)
            out[key] = self._checked(spec, value, f"*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt", spec.name)
        return out

    def common_state(self) -> dict[str, Any]:
        """What every parameter shares: ``step`` (optimizer steps), ``lr_scheduler``, ``loss_scaler``
        (cur_scale and friends; None without loss scaling), ``skipped_steps``, ``global_steps``."""
        if self.kind == "layers":
            return dict(self.meta.optimizer or {})
        self._require_optimizer()
        head = self._mp_file(0)
        out: dict[str, Any] = {"lr_scheduler": head.get("lr_scheduler"),
                               "skipped_steps": int(head.get("skipped_steps") or 0),
                               "global_steps": int(head.get("global_steps") or self.meta.iteration),
                               "global_samples": int(head.get("global_samples") or self.meta.consumed_train_samples),
                               "loss_scaler": None}
        if self.meta.zero_stage == 0:
            state = (head.get("optimizer") or {}).get("state") or {}
        else:
            part = self._optim_files(0)[0]
            base = part["base_optimizer_state"]
            state = base if isinstance(base, list) else base["state"]
            scaler = part.get("loss_scaler")
            if scaler is not None:
                out["loss_scaler"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}
        steps = [s["step"] for s in (state.values() if isinstance(state, dict) else state)
                 if isinstance(s, dict) and "step" in s]
        out["step"] = int(float(steps[0])) if steps else 0
        return out
