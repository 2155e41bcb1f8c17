"""Tokenizer configuration (Megatron-LM's flag names)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.base import arg

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
)


@dataclass
class TokenizerConfig:
    """Tokenizer"""

    tokenizer_type: Optional[str] = arg(
        None, "Tokenizer kind. SentencePiece*/HuggingFace need --tokenizer-model, GPT2BPETokenizer "
        "needs --vocab-file and --merge-file, NullTokenizer needs --vocab-size.", choices=TOKENIZER_TYPES)
    tokenizer_model: Optional[str] = arg(
        None, "SentencePiece .model file, a local directory with tokenizer.json/tokenizer_config.json "
        "for HuggingFaceTokenizer, or a tiktoken ranks file (LLaMA-3's original/tokenizer.model) for "
        "TikTokenizer (nothing is downloaded).")
    vocab_file: Optional[str] = arg(None, "GPT-2 BPE vocabulary (vocab.json).")
    merge_file: Optional[str] = arg(None, "GPT-2 BPE merges (merges.txt).")
    vocab_size: Optional[int] = arg(
        None, "NullTokenizer: number of ordinary token ids; the end-of-document id is this value.")
    vocab_extra_ids: int = arg(0, "SentencePieceTokenizer: add <extra_id_0..N-1> special tokens (T5 style).")
    eod_token: Optional[str] = arg(
        None, "The token that ends a document (--append-eod's separator, generation's stop token, the token "
        "before each evaluated document when the tokenizer has no BOS), by its text, e.g. '<|endoftext|>'. "
        "Default: the tokenizer's own: HuggingFaceTokenizer the eos_token of tokenizer_config.json (an instruct "
        "model's end of turn, e.g. SmolLM2's and Qwen2's <|im_end|>), SentencePiece </s> (<EOD> for "
        "SentencePieceTokenizer), GPT-2 <|endoftext|>, TikTokenizer <|end_of_text|>.")
    tokenizer_num_threads: int = arg(
        1, "Threads the tokenizer's own batch API uses within one process (within each preprocessing "
        "worker too; preprocessing scales with --workers).")

    def problems(self) -> list[str]:
        found: list[str] = []
        t = self.tokenizer_type
        if t is None:
            return [f"--tokenizer-type is required (one of: {', '.join(TOKENIZER_TYPES)})"]
        if t in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "TikTokenizer"):
            found += _file_problem("--tokenizer-model", self.tokenizer_model, t, want_dir=False)
        elif t == "HuggingFaceTokenizer":
            found += _file_problem("--tokenizer-model", self.tokenizer_model, t, want_dir=True)
        elif t == "GPT2BPETokenizer":
            found += _file_problem("--vocab-file", self.vocab_file, t, want_dir=False)
            found += _file_problem("--merge-file", self.merge_file, t, want_dir=False)
        elif t == "NullTokenizer":
            if self.vocab_size is None or self.vocab_size < 1:
                found.append(f"--vocab-size must be a positive integer for NullTokenizer (got {self.vocab_size})")
        if self.vocab_extra_ids < 0:
            found.append(f"--vocab-extra-ids must be >= 0 (got {self.vocab_extra_ids})")
        if self.tokenizer_num_threads < 1:
            found.append(f"--tokenizer-num-threads must be >= 1 (got {self.tokenizer_num_threads})")
        return found


#: files of which a Hugging Face tokenizer directory holds at least one (save_pretrained writes them)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def holds_hf_tokenizer(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in HF_TOKENIZER_FILES)


def _file_problem(flag: str, path: Optional[str], ttype: str, want_dir: bool) -> list[str]:
    kind = "directory" if want_dir else "file"
    if not path:
        return [f"{flag} is required for --tokenizer-type {ttype} (path to the {kind})"]
    if want_dir and not os.path.isdir(path):
        return [f"{flag} {path}: no such directory (HuggingFaceTokenizer loads a local tokenizer "
                "directory only; save it with tokenizer.save_pretrained(DIR) first)"]
    if want_dir and not holds_hf_tokenizer(path):
        inner = os.path.join(path, "tokenizer")
        where = (f"; it looks like a checkpoint, whose tokenizer is in {inner}: pass {flag} {inner}"
                 if holds_hf_tokenizer(inner) else
                 "; give the directory that tokenizer.save_pretrained(DIR) wrote")
        return [f"{flag} {path}: this directory holds no Hugging Face tokenizer (none of "
                f"{', '.join(HF_TOKENIZER_FILES)}){where}"]
    if not want_dir and not os.path.isfile(path):
        return [f"{flag} {path}: no such file"]
    return []
