"""Tokenizer files travelling with converted checkpoints.

Import copies a Hugging Face model's tokenizer files into ``<checkpoint>/tokenizer/``, which
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <checkpoint>/tokenizer`` loads for
preprocessing and training. Export writes a tokenizer ``AutoTokenizer.from_pretrained`` loads:
the Hugging Face files as they were, or a SentencePiece model (``GPTSentencePieceTokenizer``, e.g.
from ``tools/train_tokenizer.py``) turned into a fast Llama tokenizer by transformers' own
converter; its ids equal SentencePiece's, and like our preprocessing it adds no BOS token.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

TOKENIZER_DIR = "tokenizer"

#: files of a Hugging Face tokenizer (weights and model config are not among them)
_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
          "spiece.model", "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json",
          "chat_template.jinja", "chat_template.json")
_PATTERN = re.compile(r"^(tokenizer.*|.*\.tiktoken)$")
HF_TYPE = "HuggingFaceTokenizer"
SP_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer")


def hf_tokenizer_files(src_dir: str) -> list[str]:
    """Names of the tokenizer files in a Hugging Face model directory."""
    return sorted(n for n in os.listdir(src_dir)
                  if os.path.isfile(os.path.join(src_dir, n)) and (n in _NAMES or _PATTERN.match(n)))


def copy_hf_tokenizer(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the tokenizer files of ``src_dir`` into ``dst_dir`` (created); returns their names."""
    names = hf_tokenizer_files(src_dir)
    if names:
        os.makedirs(dst_dir, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return names


def tokenizer_flags(tokenizer_type: str, path: str) -> list[str]:
    """The pretrain_gpt.py / preprocess_data.py flags that select this tokenizer."""
    return ["--tokenizer-type", tokenizer_type, "--tokenizer-model", path]


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer known to a checkpoint: its megatron_ru type and its file or directory."""
    type: str
    path: str


def checkpoint_tokenizer(ckpt_dir: str, run_args: Optional[dict[str, Any]] = None) -> Optional[TokenizerSource]:
    """The tokenizer of a megatron_ru checkpoint: the one recorded for it (``--tokenizer-type``/
    ``--tokenizer-model`` in ``run_args``, when those files still exist), else ``<ckpt>/tokenizer``
    (imported Hugging Face files). None when neither is there."""
    args = run_args or {}
    ttype, path = args.get("tokenizer_type"), args.get("tokenizer_model")
    if ttype in (HF_TYPE,) + SP_TYPES and path and os.path.exists(path):
        return TokenizerSource(ttype, path)
    local = os.path.join(ckpt_dir, TOKENIZER_DIR)
    if os.path.isdir(local) and hf_tokenizer_files(local):
        return TokenizerSource(HF_TYPE, local)
    return None


def _run_args(meta: Any) -> dict[str, Any]:
    """The tokenizer flags a checkpoint's run used, from its recorded arguments (flat or grouped);
    the tokenizer recorded with the checkpoint itself (import, adaptation) wins."""
    args = getattr(meta, "args", None) or {}
    flat = dict(args.get("tokenizer") or {}) if isinstance(args.get("tokenizer"), dict) else {}
    for key in ("tokenizer_type", "tokenizer_model"):
        if key in args and key not in flat:
            flat[key] = args[key]
    recorded = getattr(meta, "tokenizer", None)
    return flat if not recorded else {**flat, **recorded}


def recorded_tokenizer(load: str, meta: Any) -> Optional[TokenizerSource]:
    """The tokenizer a checkpoint directory ``load`` records (:class:`CheckpointMeta` ``meta``);
    relative paths are relative to ``load``."""
    args = _run_args(meta)
    model = args.get("tokenizer_model")
    if model and not os.path.isabs(model) and os.path.exists(os.path.join(load, model)):
        args = {**args, "tokenizer_model": os.path.join(load, model)}
    return checkpoint_tokenizer(load, args)


def write_hf_tokenizer(source: TokenizerSource, out_dir: str) -> dict[str, Optional[int]]:
    """Write ``source`` into ``out_dir`` as files ``AutoTokenizer`` loads; returns its special
    token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) for generation_config.json."""
    if source.type == HF_TYPE:
        if not os.path.isdir(source.path) or not hf_tokenizer_files(source.path):
            raise FileNotFoundError(f"tokenizer directory {source.path} holds no Hugging Face tokenizer files "
                                    f"({', '.join(_NAMES[:3])}, ...)")
        copy_hf_tokenizer(source.path, out_dir)
    elif source.type == "GPTSentencePieceTokenizer":
        sentencepiece_to_llama_fast(source.path, out_dir)
    else:
        raise ValueError(f"--tokenizer-type {source.type} cannot be exported to a Hugging Face tokenizer (its "
                         "<EOD>/<extra_id> tokens exist only in megatron_ru); supported: "
                         f"{HF_TYPE}, GPTSentencePieceTokenizer")
    return special_token_ids(out_dir)


def special_token_ids(tokenizer_dir: str) -> dict[str, Optional[int]]:
    """bos/eos/pad ids of a saved Hugging Face tokenizer (None where it has none)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def sentencepiece_to_llama_fast(model_file: str, out_dir: str) -> None:
    """A SentencePiece model as a fast Llama tokenizer (``tokenizer.json`` + ``tokenizer_config.json``).

    transformers converts ``tokenizer.model`` itself when a ``LlamaTokenizer`` is loaded from it; the
    prefix-space setting is taken from the model (``add_dummy_prefix``), and no BOS is added
    (megatron_ru's preprocessing adds none), so the ids equal ``SentencePieceProcessor.encode``'s.
    """
    import sentencepiece

    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"--tokenizer-model {model_file}: no such SentencePiece model file")
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as e:
        raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model ({e})") from e
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    if sp.eos_id() < 0:
        raise ValueError(f"--tokenizer-model {model_file}: the model has no </s> (eos), which the exported "
                         "model's generation config needs as its end-of-text token")

    def piece(i: int) -> Optional[str]:
        return sp.id_to_piece(i) if i >= 0 else None

    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
              "add_prefix_space": bool(proto.normalizer_spec.add_dummy_prefix), "legacy": False,
              "bos_token": piece(sp.bos_id()), "eos_token": piece(sp.eos_id()), "unk_token": piece(sp.unk_id()),
              "pad_token": piece(sp.pad_id()), "clean_up_tokenization_spaces": False,
              "model_max_length": 1 << 30}
    config = {k: v for k, v in config.items() if v is not None}
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="spm-convert-") as tmp:
        shutil.copyfile(model_file, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        tok = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        # SentencePiece puts its dummy prefix before any text, even text that starts with a space; the
        # Metaspace pre-tokenizer transformers sets up skips it there: spell out SentencePiece's rule
        from tokenizers import normalizers
        steps = [normalizers.Prepend("▁")] if proto.normalizer_spec.add_dummy_prefix else []
        backend = tok.backend_tokenizer
        backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = None
        if proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
            # transformers' Llama conversion makes a BPE of any model (merges guessed from the vocabulary),
            # which segments a unigram model's text differently: the pieces with their scores, as SentencePiece
            from tokenizers import models
            backend.model = models.Unigram([(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())],
                                           unk_id=sp.unk_id(), byte_fallback=proto.trainer_spec.byte_fallback)
    # saved as a plain fast tokenizer: transformers' LlamaTokenizer class would rebuild the pipeline
    # above from its own settings when loading, instead of using tokenizer.json as written
    from transformers import PreTrainedTokenizerFast
    specials = {k: v for k, v in config.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   model_max_length=config["model_max_length"], **specials)
    fast.save_pretrained(out_dir)
    # the class name transformers 4.x also knows (5.x maps it to the same tokenizers backend)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    saved["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2)
