"""``convert_checkpoint.py reshard``: a megatron_ru checkpoint at another (TP, PP), optimizer state included.

Reads any megatron_ru checkpoint (the layer format training and the tools write; DeepSpeed's files at any
layout, ZeRO 0 fp32 or ZeRO 1) as canonical full tensors, one layer at a time, and writes the layer format
at the target layout (:func:`write_checkpoint`: temporary directory renamed at the end, ``--force`` to
replace). ``pretrain_gpt.py --load`` reads any checkpoint at any layout itself; this writes a layout to disk
once, for a checkpoint many runs will load (each then reads only its own files). Carried: weights, fp32
master weights, Adam moments, step count, LR schedule, consumed samples, iteration, loss scale, the
tokenizer files and import-hf's copy of the source config (so an export names the source architecture).
Not carried: RNG states (the resumed run seeds fresh ones from --seed; with dropout on, its random
streams differ from an uninterrupted run). We wrote this instead of using DeepSpeed's universal
checkpoint (``ds_to_universal``): that tool does not know our TP split rules (SwiGLU stride, packed
QKV groups, vocabulary padding) and its loader needs DeepSpeed's own TP-aware modules.
"""
from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from megatron_ru.checkpointing.hints import resume_resharded
from megatron_ru.checkpointing.meta import HF_SOURCE_DIR
from megatron_ru.checkpointing.reader import read_checkpoint
from megatron_ru.checkpointing.writer import write_checkpoint
from megatron_ru.utils.cli import ArgumentParser
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

HELP = "rewrite a megatron_ru checkpoint at another tensor/pipeline-parallel size, with its optimizer state"

_TOKENIZER_PATH_KEYS = ("tokenizer_model", "vocab_file", "merge_file")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="checkpoint directory (holds latest_checkpointed_iteration.txt)")
    parser.add_argument("--save", required=True, help="output directory (must not exist unless --force)")
    parser.add_argument("--target-tensor-parallel-size", type=int, required=True, help="TP of the output")
    parser.add_argument("--target-pipeline-parallel-size", type=int, required=True, help="PP of the output")
    parser.add_argument("--iteration", type=int, default=None,
                        help="which iter_* directory to read; None: the one latest_checkpointed_iteration.txt "
                             "names")
    parser.add_argument("--no-load-optim", action="store_true",
                        help="write the weights only (the run then starts a fresh optimizer)")
    parser.add_argument("--force", action="store_true", help="replace an existing --save directory")


def _copy_side_files(meta_tokenizer: Any, load_dir: str):
    """The tokenizer files a checkpoint names relative to its directory (import-hf), and import-hf's copy of
    the source config (export-hf writes the source architecture and token ids from it), copied along."""
    rel = []
    if isinstance(meta_tokenizer, dict):
        rel = [meta_tokenizer[k] for k in _TOKENIZER_PATH_KEYS
               if isinstance(meta_tokenizer.get(k), str) and not os.path.isabs(meta_tokenizer[k])]
    named = set(rel)
    if os.path.isdir(os.path.join(load_dir, HF_SOURCE_DIR)):
        rel.append(HF_SOURCE_DIR)

    def copy(tmp: str) -> None:
        for path in rel:
            src, dst = os.path.join(load_dir, path), os.path.join(tmp, path)
            if not os.path.exists(src) and path in named:
                raise FileNotFoundError(f"{src} is missing: the checkpoint's metadata.json names it as its "
                                        f"tokenizer; restore it, or reshard a checkpoint that has it")
            os.makedirs(os.path.dirname(dst) or tmp, exist_ok=True)
            if os.path.isdir(src):
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)
    return copy if rel else None


def _refuse_overlap(save: str, inputs: list) -> None:
    """The conversion tools' one overlap rule (an existing --save is the writer's to refuse without --force)."""
    from megatron_ru.utils.staging import overlap_problem
    problem = overlap_problem(save, inputs)
    if problem:
        raise ValueError(problem)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Reshard; returns the report (printed as one JSON line)."""
    load, save = os.path.abspath(args.load), os.path.abspath(args.save)
    _refuse_overlap(args.save, [("--load", args.load)])
    reader = read_checkpoint(load, args.iteration)
    meta = reader.meta
    if meta.lora_base is not None:  # its frozen weights are read from there: an input too
        _refuse_overlap(args.save, [("the LoRA base of --load", meta.lora_base.get("load"))])
    optimizer = None
    if not args.no_load_optim:
        problem = reader.optimizer_problem()
        if problem is None:
            optimizer = reader
        elif reader.kind == "layers":  # weights only already (import-hf, or resharded with --no-load-optim)
            log.info(f"{problem}: the output holds weights only as well")
        else:
            raise ValueError(problem)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    extra = {"consumed_train_samples": meta.consumed_train_samples,
             "consumed_valid_samples": meta.consumed_valid_samples,
             "args": meta.args, "tokenizer": meta.tokenizer}
    out = write_checkpoint(save, cfg=reader.cfg, vocab_size=reader.vocab_size, tp=tp, pp=pp, get_tensor=reader.get,
                           iteration=meta.iteration, optimizer=optimizer, extra_meta=extra, force=args.force,
                           extra_files=_copy_side_files(meta.tokenizer, load))
    return {"load": reader.dir, "save": out, "iteration": meta.iteration,
            "source": {"tensor_model_parallel_size": reader.tp, "pipeline_model_parallel_size": reader.pp,
                       "data_parallel_size": meta.data_parallel_size, "zero_stage": meta.zero_stage,
                       "format": meta.format or "deepspeed"},
            "target": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
            "optimizer_state": optimizer is not None,
            "continue_with": resume_resharded(save, tp, pp, optimizer is not None)}


def main(argv: Any = None) -> dict[str, Any]:
    parser = ArgumentParser(prog="reshard", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))
