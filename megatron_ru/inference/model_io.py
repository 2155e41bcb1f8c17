"""A model in, a model out, whatever its kind: a Hugging Face directory or a megatron_ru checkpoint.

The adaptation tools (``adapt_vocab``, ``propagate_embeddings``, ``evaluate``) read models as
canonical tensors (docs/model.md) and write them back as the kind the user works with:

* :func:`open_model` — a directory with ``config.json`` is a Hugging Face
  Llama/Mistral/Qwen2/Qwen3/Gemma 3 model; a directory with ``latest_checkpointed_iteration.txt`` (or an ``iter_*`` directory) is a
  megatron_ru checkpoint at any TP × PP, in any format the checkpoint reader reads;
* :func:`save_model` — the same tensors as a Hugging Face directory (config, safetensors, tokenizer,
  generation config) or a megatron_ru checkpoint at a chosen TP × PP with its tokenizer copied into
  ``<out>/tokenizer`` and recorded, so ``pretrain_gpt.py --load OUT --use-checkpoint-args`` needs no
  tokenizer flags. Both are staged under a temporary name and renamed when complete.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.convert.tokenizer_files import (HF_TYPE, SP_TYPES, TOKENIZER_DIR, TokenizerSource,
                                                 copy_hf_tokenizer, hf_tokenizer_files, recorded_tokenizer)
from megatron_ru.data.tokenizer import Tokenizer
from megatron_ru.model.spec import WORD_EMBEDDING_WEIGHT
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

HF, MEGATRON = "hf", "megatron"
KINDS = (HF, MEGATRON)
SP_FILE = "tokenizer.model"


@dataclass
class ModelSource:
    """An opened model: its description and a way to read each canonical tensor."""

    path: str
    kind: str
    cfg: ModelConfig
    vocab_size: int
    tokenizer: Optional[TokenizerSource]
    hf_config: Optional[dict[str, Any]]
    meta: Any = None
    #: generation_config.json of the source (HF directory, or the checkpoint's hf_source), if any
    generation_config: Optional[dict[str, Any]] = None
    _get: Callable[[str], torch.Tensor] = field(default=None, repr=False)  # type: ignore[assignment]

    def names(self) -> list[str]:
        from megatron_ru.model.spec import parameter_specs
        return [s.name for s in parameter_specs(self.cfg, self.vocab_size)]

    def get(self, name: str) -> torch.Tensor:
        """The full canonical tensor ``name`` (V vocabulary rows), dtype as stored."""
        return self._get(name)


def _is_checkpoint(path: str) -> bool:
    from megatron_ru.checkpointing.meta import TRACKER_FILE
    return os.path.isfile(os.path.join(path, TRACKER_FILE)) or (
        os.path.basename(os.path.normpath(path)).startswith("iter_")
        and os.path.isfile(os.path.join(path, "metadata.json")))


def is_hf_model_dir(path: str) -> bool:
    """A Hugging Face model directory (config.json), not a megatron_ru checkpoint."""
    return bool(path) and os.path.isfile(os.path.join(path, "config.json")) and not _is_checkpoint(path)


def open_model(path: str, flag: str = "--model", allow_pickle: bool = False) -> ModelSource:
    """Open ``path`` (see the module docstring); errors name ``flag``."""
    if not path or not os.path.isdir(path):
        raise FileNotFoundError(f"{flag} {path}: no such directory (a Hugging Face model directory with "
                                "config.json, or a megatron_ru checkpoint directory)")
    if _is_checkpoint(path):
        return _open_checkpoint(path, flag)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _open_hf(path, flag, allow_pickle)
    raise FileNotFoundError(f"{flag} {path}: neither a Hugging Face model directory (no config.json) nor a "
                            "megatron_ru checkpoint (no latest_checkpointed_iteration.txt)")


def _open_checkpoint(path: str, flag: str) -> ModelSource:
    from megatron_ru.checkpointing import read_checkpoint
    from megatron_ru.convert.export_hf import _source_config, _source_generation_config
    try:
        reader = read_checkpoint(path)
    except (OSError, ValueError) as e:
        raise type(e)(f"{flag} {path}: {e}") from e
    root = os.path.dirname(reader.dir) if os.path.basename(reader.dir).startswith("iter_") else path
    hf_config, config_path = _source_config(root, None)
    return ModelSource(path=path, kind=MEGATRON, cfg=reader.cfg, vocab_size=reader.vocab_size,
                       tokenizer=recorded_tokenizer(root, reader.meta), hf_config=hf_config, meta=reader.meta,
                       generation_config=_source_generation_config(config_path), _get=reader.get)


def _open_hf(path: str, flag: str, allow_pickle: bool) -> ModelSource:
    from megatron_ru.convert.hf_io import HFWeights
    from megatron_ru.convert.hf_mapping import hf_to_canonical_names, model_config_from_hf, to_canonical
    from megatron_ru.convert.import_hf import architecture_of, check_tensors, expected_hf_tensors, read_hf_config

    config = read_hf_config(path)
    architecture_of(config, os.path.join(path, "config.json"))
    cfg, vocab_size = model_config_from_hf(config)
    weights = HFWeights(path, allow_pickle=allow_pickle)
    check_tensors(weights, expected_hf_tensors(cfg, vocab_size), cfg.tied_embeddings, path)
    sources = hf_to_canonical_names(cfg)

    def get(name: str) -> torch.Tensor:
        return to_canonical(name, {n: weights.get(n) for n in sources[name]}, cfg)

    tok = TokenizerSource(HF_TYPE, path) if hf_tokenizer_files(path) else None
    from megatron_ru.convert.export_hf import _source_generation_config
    return ModelSource(path=path, kind=HF, cfg=cfg, vocab_size=vocab_size, tokenizer=tok, hf_config=config,
                       generation_config=_source_generation_config(os.path.join(path, "config.json")), _get=get)


def load_tokenizer(source: TokenizerSource, num_threads: int = 1) -> Tokenizer:
    """Our :class:`Tokenizer` for a tokenizer source (a SentencePiece file or a Hugging Face directory)."""
    from megatron_ru.config.tokenizer import TokenizerConfig
    from megatron_ru.data.tokenizer import build_tokenizer
    return build_tokenizer(TokenizerConfig(tokenizer_type=source.type, tokenizer_model=source.path,
                                           tokenizer_num_threads=num_threads))


def tokenizer_source(path: str, flag: str) -> TokenizerSource:
    """A SentencePiece ``.model`` file -> GPTSentencePieceTokenizer; a directory with Hugging Face
    tokenizer files -> HuggingFaceTokenizer."""
    if path and os.path.isfile(path):
        return TokenizerSource("GPTSentencePieceTokenizer", path)
    if path and os.path.isdir(path):
        if not hf_tokenizer_files(path):
            raise FileNotFoundError(f"{flag} {path}: the directory holds no Hugging Face tokenizer files "
                                    "(tokenizer.json, tokenizer_config.json, ...)")
        return TokenizerSource(HF_TYPE, path)
    raise FileNotFoundError(f"{flag} {path}: no such file or directory (a SentencePiece .model file or a "
                            "Hugging Face tokenizer directory)")


def open_tokenizer(path: str, flag: str, num_threads: int = 1) -> tuple[TokenizerSource, Tokenizer]:
    source = tokenizer_source(path, flag)
    try:
        return source, load_tokenizer(source, num_threads)
    except (OSError, ValueError) as e:
        raise type(e)(f"{flag} {path}: {e}") from e


def model_tokenizer(src: ModelSource, given: Optional[str], flag: str,
                    model_flag: str) -> tuple[TokenizerSource, Tokenizer]:
    """The tokenizer named by ``flag`` (``given``), else the one saved with the model ``src`` (opened by
    ``model_flag``); neither is a ValueError that names both flags."""
    if given:
        return open_tokenizer(given, flag)
    if src.tokenizer is not None:
        return src.tokenizer, load_tokenizer(src.tokenizer)
    raise ValueError(f"{model_flag} {src.path} has no tokenizer saved with it: give {flag}")


def _tokenizer_record(tokenizer: TokenizerSource) -> dict[str, Any]:
    """metadata.json's tokenizer record of a checkpoint holding ``tokenizer`` in ``<ckpt>/tokenizer``."""
    if tokenizer.type == HF_TYPE:
        return {"tokenizer_type": HF_TYPE, "tokenizer_model": TOKENIZER_DIR}
    if tokenizer.type in SP_TYPES:
        return {"tokenizer_type": tokenizer.type, "tokenizer_model": os.path.join(TOKENIZER_DIR, SP_FILE)}
    raise ValueError(f"tokenizer type {tokenizer.type} cannot be saved with a model")


def _copy_tokenizer(tokenizer: TokenizerSource, out_dir: str) -> None:
    """Copy ``tokenizer`` into ``out_dir/tokenizer`` (where :func:`_tokenizer_record` says)."""
    dst = os.path.join(out_dir, TOKENIZER_DIR)
    if tokenizer.type == HF_TYPE:
        copy_hf_tokenizer(tokenizer.path, dst)
    else:
        os.makedirs(dst, exist_ok=True)
        shutil.copyfile(tokenizer.path, os.path.join(dst, SP_FILE))


def save_model(out: str, *, kind: str, cfg: ModelConfig, vocab_size: int, get_tensor: Callable[[str], torch.Tensor],
               tokenizer: Optional[TokenizerSource], tp: int = 1, pp: int = 1, dtype: Optional[torch.dtype] = None,
               hf_config: Optional[dict[str, Any]] = None, generation_config: Optional[dict[str, Any]] = None,
               extra_meta: Optional[dict[str, Any]] = None, extra_files: Optional[Callable[[str], None]] = None,
               force: bool = False) -> str:
    """Write the model ``get_tensor`` describes (full canonical tensors, ``vocab_size`` rows) to
    ``out`` as ``kind`` (see the module docstring). ``hf_config``: the source's config.json
    (architecture and fields the model does not determine; token ids come from ``tokenizer``);
    ``generation_config``: the source's sampling settings (HF output; its token ids become the
    tokenizer's)."""
    if kind not in KINDS:
        raise ValueError(f"--output-format {kind!r}: choose one of {', '.join(KINDS)}")
    if kind == HF:
        if tp != 1 or pp != 1:
            raise ValueError("a Hugging Face directory has no TP/PP layout: drop --target-tensor-parallel-size/"
                             "--target-pipeline-parallel-size or write --output-format megatron")
        _save_hf(out, cfg, vocab_size, get_tensor, tokenizer, dtype, hf_config, generation_config, extra_files, force)
    else:
        _save_checkpoint(out, cfg, vocab_size, get_tensor, tokenizer, tp, pp, dtype, hf_config, extra_meta,
                         extra_files, force)
    return out


def _save_checkpoint(out: str, cfg: ModelConfig, vocab_size: int, get_tensor: Callable[[str], torch.Tensor],
                     tokenizer: Optional[TokenizerSource], tp: int, pp: int, dtype: Optional[torch.dtype],
                     hf_config: Optional[dict[str, Any]], extra_meta: Optional[dict[str, Any]],
                     extra_files: Optional[Callable[[str], None]], force: bool) -> None:
    import json

    from megatron_ru.checkpointing import write_checkpoint
    from megatron_ru.convert.import_hf import HF_SOURCE_DIR
    meta = dict(extra_meta or {})

    def side_files(tmp: str) -> None:
        if hf_config is not None:
            os.makedirs(os.path.join(tmp, HF_SOURCE_DIR), exist_ok=True)
            with open(os.path.join(tmp, HF_SOURCE_DIR, "config.json"), "w", encoding="utf-8") as f:
                json.dump({**hf_config, "vocab_size": vocab_size}, f, indent=2)
        if tokenizer is not None:
            _copy_tokenizer(tokenizer, tmp)
        if extra_files is not None:
            extra_files(tmp)

    if tokenizer is not None:
        meta["tokenizer"] = _tokenizer_record(tokenizer)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_checkpoint(out, cfg=cfg, vocab_size=vocab_size, tp=tp, pp=pp, get_tensor=get_tensor, dtype=dtype,
                     extra_meta=meta, force=force, extra_files=side_files)


def _save_hf(out: str, cfg: ModelConfig, vocab_size: int, get_tensor: Callable[[str], torch.Tensor],
             tokenizer: Optional[TokenizerSource], dtype: Optional[torch.dtype], hf_config: Optional[dict[str, Any]],
             generation_config: Optional[dict[str, Any]], extra_files: Optional[Callable[[str], None]], force: bool) -> None:
    from megatron_ru.convert.export_hf import ModelNotExpressible, write_hf_files
    from megatron_ru.convert.hf_mapping import export_architecture, from_canonical
    from megatron_ru.utils.staging import staged_directory
    arch = export_architecture(cfg, source_config=hf_config)
    first = get_tensor(WORD_EMBEDDING_WEIGHT)
    out_dtype = dtype or first.dtype
    cache = {WORD_EMBEDDING_WEIGHT: first}

    def tensors_of(spec: Any) -> dict[str, torch.Tensor]:
        t = cache.pop(spec.name, None)
        t = get_tensor(spec.name) if t is None else t
        return from_canonical(spec.name, t.to(out_dtype), cfg)

    with staged_directory(out, force) as tmp:
        try:
            write_hf_files(tmp, cfg, vocab_size, tensors_of, dtype=out_dtype, architecture=arch,
                           source_config=hf_config, tokenizer=tokenizer, generation_config=generation_config,
                           tokenizer_ids_win=tokenizer is not None)
        except ModelNotExpressible as e:
            raise ValueError(f"{e}; write --output-format megatron") from None
        if extra_files is not None:
            extra_files(tmp)

