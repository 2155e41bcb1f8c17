"""``convert_checkpoint.py export-hf``: a megatron_ru checkpoint (any TP x PP) -> a Hugging Face
directory that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load unchanged.

The architecture and the config fields the model does not determine (token ids, ...) come from
the imported model's ``config.json`` (``<load>/hf_source``, or ``--hf-config``); a checkpoint
trained from scratch gets the architecture that expresses it (``hf_mapping.architecture_for``:
Llama, Qwen2 with Q/K/V biases, Mistral with a sliding window). What these models cannot express
(LayerNorm, learned positions, GELU, linear biases) is refused before anything is written, naming the flag.
Weights stream: one canonical tensor is read (its TP shards joined, padding removed), split into
its Hugging Face tensors and appended to a planned safetensors shard.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_ru.convert.hf_io import ShardedSafetensorsWriter, parse_size
from megatron_ru.convert.import_hf import HF_SOURCE_DIR, split_shapes
from megatron_ru.utils.dtypes import DTYPES
from megatron_ru.utils.staging import check_output, overlap_problem, staged_directory
from megatron_ru.convert.tokenizer_files import (HF_TYPE, SP_TYPES, TokenizerSource, recorded_tokenizer,
                                                 write_hf_tokenizer)
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

HELP = "megatron_ru checkpoint -> Hugging Face directory (config, safetensors shards, tokenizer)"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, metavar="DIR", help="megatron_ru checkpoint directory (--save of a run "
                   "or of import-hf)")
    p.add_argument("--save", required=True, metavar="HF_OUT", help="Hugging Face directory to write")
    p.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="dtype of the written weights (default: as stored in the checkpoint)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (transformers' units: "
                   "5GB = 5e9 bytes, 2GiB = 2^31)")
    p.add_argument("--hf-config", default=None, metavar="PATH",
                   help="config.json (or its directory) of the Hugging Face model the checkpoint came from: "
                        "architecture and token ids (default: <load>/hf_source/config.json when present)")
    p.add_argument("--architecture", default=None,
                   help="Hugging Face architecture to write (default: --hf-config's, else inferred)")
    p.add_argument("--tokenizer-type", default=None, choices=(HF_TYPE,) + SP_TYPES,
                   help="tokenizer to export (default: the checkpoint's, or the one its run was given)")
    p.add_argument("--tokenizer-model", default=None, help="its file (SentencePiece) or directory (Hugging Face)")
    p.add_argument("--lora", choices=("merge", "peft"), default=None,
                   help="a checkpoint with LoRA/DoRA adapters: 'merge' writes the weights with the adapters merged "
                        "in; 'peft' writes the base weights and a PEFT adapter directory (--lora-save) that "
                        "peft.PeftModel.from_pretrained loads on top of them")
    p.add_argument("--lora-save", default=None, metavar="DIR",
                   help="with --lora peft: the adapter directory (default: <save>/adapter)")
    p.add_argument("--force", action="store_true", help="replace --save if it exists")


def run(args: argparse.Namespace) -> dict[str, Any]:
    tok = None
    if args.tokenizer_type or args.tokenizer_model:
        if not (args.tokenizer_type and args.tokenizer_model):
            raise ValueError("--tokenizer-type and --tokenizer-model go together")
        tok = TokenizerSource(args.tokenizer_type, args.tokenizer_model)
    report = export_hf(args.load, args.save, iteration=args.iteration, dtype=args.dtype,
                       max_shard_size=args.max_shard_size, hf_config=args.hf_config,
                       architecture=args.architecture, tokenizer=tok, force=args.force, lora=args.lora,
                       lora_save=args.lora_save)
    return report.as_dict()


@dataclass
class ExportReport:
    save: str
    architecture: str
    vocab_size: int
    tied: bool
    dtype: str
    files: list[str] = field(default_factory=list)
    tokenizer: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _source_config(load: str, hf_config: Optional[str]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    path = hf_config or os.path.join(load, HF_SOURCE_DIR, "config.json")
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        if hf_config:
            raise FileNotFoundError(f"--hf-config {hf_config}: no such config.json")
        return None, None
    with open(path, encoding="utf-8") as f:
        return json.load(f), path


def export_plan(cfg: Any, vocab_size: int, dtype_of: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(Hugging Face name, shape, dtype) of every tensor written, in writing order."""
    from megatron_ru.model.spec import parameter_specs
    plan = []
    for spec in parameter_specs(cfg, vocab_size):
        for name, t in split_shapes(spec, cfg).items():
            plan.append((name, tuple(t.shape), dtype_of(spec.name)))
    return plan


def export_hf(load: str, save: str, *, iteration: Optional[int] = None, dtype: Optional[str] = None,
              max_shard_size: str | int = "5GB", hf_config: Optional[str] = None,
              architecture: Optional[str] = None, tokenizer: Optional[TokenizerSource] = None,
              force: bool = False, lora: Optional[str] = None, lora_save: Optional[str] = None) -> ExportReport:
    from megatron_ru.checkpointing import read_checkpoint
    from megatron_ru.convert.hf_mapping import export_architecture
    from megatron_ru.model.spec import parameter_specs

    if not os.path.isdir(load):
        raise FileNotFoundError(f"--load {load}: no such directory")
    inputs = [("--load", load), ("--hf-config", hf_config), ("--tokenizer-model", tokenizer and tokenizer.path)]
    check_output(save, inputs, force)
    _refuse_overlap(lora_save, inputs, "--lora-save")
    shard_bytes = parse_size(max_shard_size)
    reader = read_checkpoint(load, iteration)
    if reader.meta.lora_base is not None:  # its frozen weights are read from there: an input too
        base = [("the LoRA base of --load", reader.meta.lora_base.get("load"))]
        _refuse_overlap(save, base, "--save")
        _refuse_overlap(lora_save, base, "--lora-save")
    cfg, vocab_size = reader.cfg, reader.vocab_size
    source_reader, lora_cfg = reader, None
    if cfg.lora is not None or lora is not None:
        from megatron_ru.convert.lora_export import base_config, merged_weights
        if cfg.lora is None:
            raise ValueError(f"--lora {lora}: --load {load} holds no LoRA adapters (export it without --lora)")
        if lora is None:
            raise ValueError(f"--load {load} holds LoRA adapters: add --lora merge (weights with the adapters merged "
                             f"in) or --lora peft (the base weights and a PEFT adapter directory)")
        lora_cfg, cfg = cfg, base_config(cfg)
        if lora == "merge":
            reader = _Merged(merged_weights(reader.get, lora_cfg))
    source, source_path = _source_config(load, hf_config)
    arch = export_architecture(cfg, architecture, source)
    tok = tokenizer or recorded_tokenizer(load, source_reader.meta)

    specs = parameter_specs(cfg, vocab_size)
    target = DTYPES[dtype] if dtype else None
    out_dtype = target or reader.shard(specs[0].name, 0).dtype  # one dtype for the whole export (config.json)
    if tok is None:
        log.warning("no tokenizer found for %s (none imported, none recorded by its run): the export has none; "
                    "pass --tokenizer-type/--tokenizer-model", load)
    with staged_directory(save, force) as tmp:
        try:
            files = write_hf_files(tmp, cfg, vocab_size, lambda spec: _hf_tensors(reader, spec, cfg, out_dtype),
                                   dtype=out_dtype, architecture=arch, source_config=source, tokenizer=tok,
                                   generation_config=_source_generation_config(source_path),
                                   max_shard_size=shard_bytes)
        except ModelNotExpressible as e:
            raise ValueError(f"--load {load}: {e}") from None
        if lora == "peft":
            from megatron_ru.convert.lora_export import peft_adapter, write_peft_adapter
            tensors, adapter_config = peft_adapter(source_reader.get, lora_cfg, save, out_dtype)
            adapter_dir = os.path.join(tmp, "adapter") if lora_save is None else lora_save
            write_peft_adapter(adapter_dir, tensors, adapter_config)
            files.append("adapter/" if lora_save is None else lora_save)
    log.info("exported %s (%s, %d vocabulary rows, %s) to %s", load, arch, vocab_size, _DTYPE_NAMES[out_dtype], save)
    return ExportReport(save, arch, vocab_size, cfg.tied_embeddings, _DTYPE_NAMES.get(out_dtype, str(out_dtype)),
                        files,
                        None if tok is None else f"{tok.type} {tok.path}")


def _refuse_overlap(out: Optional[str], inputs: Any, flag: str) -> None:
    problem = overlap_problem(out, inputs, flag) if out is not None else None
    if problem:
        raise ValueError(problem)


class _Merged:
    """A reader view whose linear weights have the adapters merged in (full tensors only)."""
    tp = 1

    def __init__(self, get: Callable[[str], torch.Tensor]) -> None:
        self.get = get

    def shard(self, name: str, tp_rank: int) -> torch.Tensor:
        return self.get(name)


def _hf_tensors(reader: Any, spec: Any, cfg: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The Hugging Face tensors of one canonical parameter. A parameter split over TP by rows comes
    as lists of row pieces taken straight from the TP shards, in the order the full tensor has them
    (vocabulary padding cut; Q/K/V per query group; gate and up halves of each shard): joining the
    shards first would copy every such tensor once more. Everything else: the joined tensor through
    ``from_canonical``."""
    from megatron_ru.convert.hf_mapping import fused_linear, from_canonical, hf_to_canonical_names
    from megatron_ru.model.spec import PartLayout
    if reader.tp == 1 or spec.partition_dim != 0:
        return from_canonical(spec.name, reader.get(spec.name).to(dtype), cfg)
    sources = hf_to_canonical_names(cfg)[spec.name]
    shards = [reader.shard(spec.name, t).to(dtype) for t in range(reader.tp)]
    if spec.vocab:
        pieces, left = [], spec.shape[0]
        for shard in shards:
            take = min(left, shard.shape[0])
            if take:
                pieces.append(shard[:take])
            left -= take
        return {sources[0]: pieces}
    fused = fused_linear(spec.name)
    if fused is not None:  # each shard holds its query groups' q, k, v rows (its gate and up halves)
        layout = PartLayout.full(fused, cfg, reader.tp)
        out: dict[str, list] = {n: [] for n in sources}
        for shard in shards:
            for n, rows in zip(sources, layout.split(shard, dim=0).values()):
                out[n].append(rows)
        return out
    return from_canonical(spec.name, reader.get(spec.name).to(dtype), cfg)


def _extra_fields(source: Optional[dict[str, Any]], dtype: torch.dtype) -> dict[str, Any]:
    """Fields of config.json the model does not determine: the source's token ids, and the dtype."""
    extra: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if source and source.get(key) is not None:
            extra[key] = source[key]
    extra["dtype"] = _DTYPE_NAMES[dtype]
    return extra


def _source_generation_config(source_path: Optional[str]) -> Optional[dict[str, Any]]:
    """generation_config.json next to the source config.json, if there is one."""
    if source_path:
        gen = os.path.join(os.path.dirname(source_path), "generation_config.json")
        if os.path.isfile(gen):
            with open(gen, encoding="utf-8") as f:
                return json.load(f)
    return None


class ModelNotExpressible(ValueError):
    """The model has no Hugging Face equivalent of the architecture asked for (the message lists why)."""


def write_hf_files(out_dir: str, cfg: Any, vocab_size: int, tensors_of: Callable[[Any], dict[str, Any]], *,
                   dtype: torch.dtype, architecture: str, source_config: Optional[dict[str, Any]] = None,
                   tokenizer: Optional[TokenizerSource] = None, generation_config: Optional[dict[str, Any]] = None,
                   tokenizer_ids_win: bool = False, max_shard_size: int = 5 * 10 ** 9) -> list[str]:
    """Write a Hugging Face model into ``out_dir`` (an existing staging directory): the tokenizer,
    the safetensors shards (``tensors_of(spec)`` gives each canonical parameter's Hugging Face
    tensors, full or as row pieces), ``config.json`` and ``generation_config.json``; returns the
    file names written. Token ids in config.json come from ``source_config``, else the tokenizer;
    ``tokenizer_ids_win``: from the tokenizer first (a new vocabulary). The names returned are every
    file written: the tokenizer's, the shards and their index, the two configs."""
    from megatron_ru.convert.hf_mapping import hf_config_from_model
    from megatron_ru.model.spec import parameter_specs

    extra = _extra_fields(None if tokenizer_ids_win else source_config, dtype)
    before = set(os.listdir(out_dir))
    tok_ids: dict[str, Any] = write_hf_tokenizer(tokenizer, out_dir) if tokenizer is not None else {}
    tokenizer_files = sorted(set(os.listdir(out_dir)) - before)
    for key, value in tok_ids.items():
        if value is not None and key not in extra:
            extra[key] = value
    try:  # the one check that the model can be written as ``architecture``: before any tensor is written
        config = hf_config_from_model(cfg, vocab_size, architecture, extra)
    except ValueError as e:
        raise ModelNotExpressible(str(e)) from None
    writer = ShardedSafetensorsWriter(out_dir, export_plan(cfg, vocab_size, lambda name: dtype), max_shard_size)
    try:
        for spec in parameter_specs(cfg, vocab_size):
            for name, piece in tensors_of(spec).items():
                writer.write(name, piece)
        files = writer.close()
    except BaseException:
        writer.abort()
        raise
    _write_json(os.path.join(out_dir, "config.json"), config)
    gen = dict(generation_config or {})
    if tokenizer_ids_win or not generation_config:  # the source's generation settings are kept as they are
        gen.update({k: extra[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if extra.get(k) is not None})
    _write_json(os.path.join(out_dir, "generation_config.json"), gen)
    return tokenizer_files + files + ["config.json", "generation_config.json"]


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
