"""``convert_checkpoint.py import-hf``: a local Hugging Face Llama / Mistral / Qwen2 directory ->
a megatron_ru checkpoint at a chosen TP x PP layout.

Everything is checked before anything is written: the architecture, the config (through the
family mapping, which names a field it cannot express), the layout, and every tensor's name and
shape against what the config implies (from the safetensors headers alone). Then the checkpoint
writer asks for one canonical tensor at a time; each is built from its Hugging Face tensors (e.g.
q, k, v -> ``linear_qkv``) read just then. The output is assembled under a temporary name and
renamed at the end, with the model's tokenizer files in ``<save>/tokenizer`` and its original
``config.json`` / ``generation_config.json`` in ``<save>/hf_source`` (export uses them).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, ContextManager, Optional

import torch

from megatron_ru.checkpointing.meta import HF_SOURCE_DIR
from megatron_ru.convert.hf_io import HFWeights
from megatron_ru.convert.hf_mapping import FAMILIES
from megatron_ru.utils.staging import check_output
from megatron_ru.checkpointing.hints import continue_pretraining
from megatron_ru.convert.tokenizer_files import HF_TYPE, TOKENIZER_DIR, copy_hf_tokenizer
from megatron_ru.utils.logging import get_logger
from megatron_ru.utils.dtypes import DTYPES

log = get_logger(__name__)

HELP = f"Hugging Face {FAMILIES} directory -> megatron_ru checkpoint at a TP x PP layout"
HF_SIDE_FILES = ("config.json", "generation_config.json")
_MAX_LISTED = 12


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, metavar="HF_DIR",
                   help="local Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--save", required=True, metavar="DIR", help="megatron_ru checkpoint directory to write")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, metavar="T")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, metavar="P")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="dtype of the written weights (default: as stored in the Hugging Face files)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="also read pytorch_model*.bin (pickle: only for files you trust)")
    p.add_argument("--lora-adapter", default=None, metavar="PEFT_DIR",
                   help="a PEFT LoRA/DoRA adapter directory (adapter_config.json + adapter_model.safetensors) trained "
                        "on this model: the checkpoint starts with these adapters (and its modules_to_save)")
    p.add_argument("--force", action="store_true", help="replace --save if it exists")


def run(args: argparse.Namespace) -> dict[str, Any]:
    report = import_hf(args.load, args.save, args.target_tensor_parallel_size, args.target_pipeline_parallel_size,
                       dtype=args.dtype, allow_pickle=args.allow_pickle, force=args.force,
                       lora_adapter=args.lora_adapter)
    return report.as_dict()


@dataclass
class ImportReport:
    save: str
    architecture: str
    vocab_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    tensors: int
    tokenizer_files: list[str] = field(default_factory=list)
    continue_with: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"--load {hf_dir}: no such directory (a local Hugging Face model directory, "
                                "as written by save_pretrained)")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load {hf_dir}: no config.json; a Hugging Face model directory has one "
                                "(written by save_pretrained)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def architecture_of(config: dict[str, Any], path: str) -> str:
    """The config's architecture, which must be one we convert (else the error lists those)."""
    from megatron_ru.convert.hf_mapping import MODEL_TYPES, SUPPORTED_ARCHITECTURES
    by_type = {model_type: arch for arch, model_type in MODEL_TYPES.items()}
    archs = config.get("architectures") or []
    if not archs and config.get("model_type") in by_type:
        archs = [by_type[config["model_type"]]]
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not known:
        found = ", ".join(map(str, archs)) or f"none (model_type {config.get('model_type')!r})"
        raise ValueError(f"{path}: architectures = {found} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return known[0]


def _shape(s: Any) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


def split_shapes(spec: Any, cfg: Any) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors (names, shapes; no data) one canonical parameter becomes."""
    from megatron_ru.convert.hf_mapping import from_canonical
    try:
        return from_canonical(spec.name, torch.empty(spec.shape, dtype=torch.float32, device="meta"), cfg)
    except (NotImplementedError, RuntimeError):  # an operation without a meta kernel: use real (small) memory
        return from_canonical(spec.name, torch.zeros(spec.shape, dtype=torch.float32), cfg)


def expected_hf_tensors(cfg: Any, vocab_size: int) -> dict[str, dict[str, tuple[int, ...]]]:
    """canonical name -> {Hugging Face name: shape} as the config implies (computed on meta tensors)."""
    from megatron_ru.model.spec import parameter_specs
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for spec in parameter_specs(cfg, vocab_size):
        out[spec.name] = {n: tuple(t.shape) for n, t in split_shapes(spec, cfg).items()}
    return out


def check_tensors(weights: HFWeights, expected: dict[str, dict[str, tuple[int, ...]]], tied: bool,
                  hf_dir: str) -> None:
    """One ValueError naming every missing, unexpected or mis-shaped tensor (expected vs actual)."""
    want = {n: s for per in expected.values() for n, s in per.items()}
    problems: list[str] = []
    for name, shape in want.items():
        if name not in weights:
            problems.append(f"missing tensor {name} (expected shape {_shape(shape)})")
        elif weights.info(name).shape != shape:
            info = weights.info(name)
            problems.append(f"tensor {name} in {info.file} has shape {_shape(info.shape)}, expected {_shape(shape)} "
                            "from config.json")
    for name in weights.names():
        if name in want:
            continue
        if tied and name == "lm_head.weight":  # a tied model may still store the shared matrix twice
            emb = weights.info("model.embed_tokens.weight").shape if "model.embed_tokens.weight" in weights else None
            if weights.info(name).shape != emb:
                problems.append(f"tensor lm_head.weight has shape {_shape(weights.info(name).shape)}, expected "
                                f"{_shape(emb or ())} (tie_word_embeddings is true: it must equal the embedding)")
            continue
        problems.append(f"unexpected tensor {name} (shape {_shape(weights.info(name).shape)}, in "
                        f"{weights.info(name).file}): config.json does not describe it")
    if problems:
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise ValueError(f"--load {hf_dir}: the weights do not match config.json: "
                         + "; ".join(problems[:_MAX_LISTED]) + more)


def _no_zip_crc32() -> ContextManager[Any]:
    """torch.save without the zip archive's CRC32: computing it costs 1-2.5 s per GB here (most of the
    import's time), and torch.load never checks it (measured: a flipped data byte loads silently with
    and without mmap); what the loader does check, the files' sizes in metadata.json, is unchanged."""
    try:
        from torch.utils.serialization import config
        return config.patch({"save.compute_crc32": False})
    except (ImportError, AttributeError):  # an older torch: always computes it
        return contextlib.nullcontext()


def import_hf(load: str, save: str, tp: int = 1, pp: int = 1, *, dtype: Optional[str] = None,
              allow_pickle: bool = False, force: bool = False, lora_adapter: Optional[str] = None) -> ImportReport:
    config = read_hf_config(load)
    check_output(save, [("--load", load), ("--lora-adapter", lora_adapter)], force)
    from megatron_ru.checkpointing import write_checkpoint
    from megatron_ru.convert.hf_mapping import hf_to_canonical_names, model_config_from_hf, to_canonical

    config_path = os.path.join(load, "config.json")
    arch = architecture_of(config, config_path)
    cfg, vocab_size = model_config_from_hf(config)
    from megatron_ru.config.model import model_parallel_problems
    problems = model_parallel_problems(cfg, tp, pp, "--target-tensor-parallel-size", "--target-pipeline-parallel-size")
    if problems:
        raise ValueError(f"{config_path} cannot be split at this layout: " + "; ".join(problems))
    weights = HFWeights(load, allow_pickle=allow_pickle)
    expected = expected_hf_tensors(cfg, vocab_size)
    check_tensors(weights, expected, cfg.tied_embeddings, load)
    sources = hf_to_canonical_names(cfg)
    target = DTYPES[dtype] if dtype else None

    adapter: dict[str, torch.Tensor] = {}
    base_cfg = cfg
    if lora_adapter is not None:
        import dataclasses

        from megatron_ru.convert.lora_export import read_peft_adapter
        spec, adapter = read_peft_adapter(lora_adapter, cfg)
        cfg = dataclasses.replace(cfg, lora=spec.to_dict())

    def get_tensor(name: str) -> torch.Tensor:
        if name in adapter:
            t = adapter[name]
            return t if target is None else t.to(target)
        hf = {n: weights.get(n) for n in sources[name]}
        t = to_canonical(name, hf, base_cfg)
        return t if target is None else t.to(target)

    tok_meta = {"tokenizer_type": HF_TYPE, "tokenizer_model": TOKENIZER_DIR}
    from megatron_ru.convert.tokenizer_files import hf_tokenizer_files
    has_tokenizer = bool(hf_tokenizer_files(load))
    if not has_tokenizer:
        log.warning("%s has no tokenizer files (tokenizer.json, tokenizer_config.json, ...): the checkpoint records "
                    "none; give --tokenizer-type/--tokenizer-model when training", load)
    copied: list[str] = []

    def side_files(tmp: str) -> None:  # written into the checkpoint's temporary directory before its rename
        copied.extend(copy_hf_tokenizer(load, os.path.join(tmp, TOKENIZER_DIR)))
        os.makedirs(os.path.join(tmp, HF_SOURCE_DIR), exist_ok=True)
        for name in HF_SIDE_FILES:
            if os.path.isfile(os.path.join(load, name)):
                shutil.copyfile(os.path.join(load, name), os.path.join(tmp, HF_SOURCE_DIR, name))

    os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
    with _no_zip_crc32():
        write_checkpoint(save, cfg=cfg, vocab_size=vocab_size, tp=tp, pp=pp, get_tensor=get_tensor, dtype=target,
                         extra_meta={"tokenizer": tok_meta} if has_tokenizer else None, force=force,
                         extra_files=side_files)
    hint = continue_pretraining(save, tp, pp, cfg.max_position_embeddings, has_tokenizer=bool(copied))
    log.info("imported %s (%s, %d vocabulary rows) into %s at TP=%d PP=%d", load, arch, vocab_size, save, tp, pp)
    return ImportReport(save, arch, vocab_size, tp, pp, len(expected), copied, hint)
