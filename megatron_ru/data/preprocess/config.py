"""Flags of tools/preprocess_data.py (Megatron-LM's names where Megatron has them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.base import arg


@dataclass
class PreprocessConfig:
    """Input and output"""

    input: list[str] = arg(default_factory=list, help="JSONL input: one or more files or globs (quote the glob); "
                           ".jsonl.gz is decompressed on the fly.")
    output_prefix: str = arg("", "Output prefix: writes <prefix>_<key>_document.bin/.idx.")
    json_keys: list[str] = arg(default_factory=lambda: ["text"], help="JSON keys to tokenize; one dataset per key.")
    split_sentences: bool = arg(False, "Store each sentence as a sequence (simple deterministic splitter, "
                                "see docs/data_format.md).")
    keep_newlines: bool = arg(False, "With --split-sentences: keep the whitespace (newlines) between sentences, "
                              "so that the sequences concatenate to the exact input text.")
    split_paragraphs: bool = arg(False, "Store each paragraph (text up to and including a blank-line break) as a "
                                 "sequence and each document as a document.")
    group_by_key: Optional[str] = arg(None, "Write one dataset per value of this JSON key: "
                                      "<prefix>_<value>_<key>_document.")
    append_eod: bool = arg(False, "Append the end-of-document token to every document.")
    workers: int = arg(1, "Parallel workers that parse and tokenize (1: one worker thread beside the main "
                           "thread that reads and parses, or the main process itself; see --worker-type).")
    worker_type: str = arg("auto", "thread: workers are threads of one process (no start-up, no copies between "
                           "processes; only for tokenizers whose batch call releases the GIL, e.g. sentencepiece "
                           ">= 0.2.2); process: forked processes (any tokenizer); auto: threads when the "
                           "tokenizer releases the GIL and --workers <= 8, else processes.",
                           choices=("auto", "thread", "process"))
    partitions: int = arg(1, "Cut the input into this many contiguous parts processed concurrently and merged "
                          "in order (same bytes as 1).")
    log_interval: int = arg(1000, "Progress line on stderr every this many documents.")
    skip_invalid: bool = arg(False, "Skip (and count) invalid lines instead of stopping at the first one.")
    batch_bytes: int = arg(1 << 20, "Bytes of input per batch sent to a worker.")
    tokenize_chunk_chars: int = arg(100_000, "Texts longer than this are tokenized in pieces of about this size "
                                    "(UTF-8 bytes where the text stays bytes), cut only where the tokenizer's ids "
                                    "stay those of the whole text, and spread over all workers' threads (bounds "
                                    "memory for huge documents; see docs/data_format.md).")
    dataset_impl: str = arg("mmap", "Accepted for Megatron-LM scripts; only the mmap format exists.",
                            choices=("mmap",))
    keep_sequential_samples: bool = arg(False, "Accepted for Megatron-LM scripts: input order is always kept "
                                        "here, with any --partitions.")
    lang: str = arg("english", "Accepted for Megatron-LM scripts (nltk language); the splitter here is "
                    "language-independent.")

    def problems(self) -> list[str]:
        found: list[str] = []
        if not self.input:
            found.append("--input is required (JSONL file(s) or a quoted glob)")
        if not self.output_prefix:
            found.append("--output-prefix is required")
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            found.append(f"--json-keys must name distinct keys (got {self.json_keys})")
        if self.group_by_key is not None and self.group_by_key in self.json_keys:
            found.append(f"--group-by-key {self.group_by_key} is also in --json-keys; group by another key")
        if self.split_sentences and self.split_paragraphs:
            found.append("--split-sentences and --split-paragraphs exclude each other; pick one")
        for flag, value in (("--workers", self.workers), ("--partitions", self.partitions),
                            ("--log-interval", self.log_interval), ("--batch-bytes", self.batch_bytes),
                            ("--tokenize-chunk-chars", self.tokenize_chunk_chars)):
            if value < 1:
                found.append(f"{flag} must be >= 1 (got {value})")
        return found
