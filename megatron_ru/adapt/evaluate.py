"""``tools/evaluate.py``: score text with a model, in units that compare across tokenizers.

    python tools/evaluate.py --load ckpt_or_hf_dir --input eval.jsonl [--group-by-key domain]
    torchrun --nproc-per-node 4 tools/evaluate.py --load ckpt --input eval.jsonl \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Loss per token depends on the tokenizer; bits per byte does not: the total negative log-likelihood
of a text, in bits, divided by the UTF-8 bytes of that text (bits per character: by its characters).
What is scored:

* each document's text tokens, every one of them: the document is preceded by the tokenizer's BOS
  token (or, without one, its end-of-document token, the separator the model saw in pretraining)
  as context, so the first text token is predicted too; the end-of-document token after the text is
  not scored (it is not text);
* a document longer than the context (``--seq-length``, default the model's) in windows that move
  by ``--stride`` tokens: every token is scored once, with all the left context its window has
  (Hugging Face's perplexity recipe); ``--stride`` equal to the window length gives disjoint windows;
* bytes and characters of the text itself (``--input``); for a preprocessed dataset (``--data-path``)
  those the tokens stand for (:mod:`megatron_ru.data.token_text`), trailing end-of-document tokens
  not scored.

Documents are spread over the data-parallel replicas; every rank of a replica runs the same windows
(:class:`megatron_ru.inference.runner.StageRunner`), the last pipeline stage scores them, and sums are
combined in float64. Output: a table on stdout and ``--output-json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ru.convert.hf_mapping import FAMILIES
from megatron_ru.utils import cli
from megatron_ru.utils.logging import get_logger, log_rank0
from megatron_ru.utils.dtypes import DTYPES

log = get_logger(__name__)

OVERALL = "overall"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/evaluate.py", allow_abbrev=False,
                                description="Score text with a model: loss, perplexity, bits per byte and per "
                                            "character, characters per token.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("Model and layout")
    g.add_argument("--load", required=True,
                   help=f"megatron_ru checkpoint (any TP/PP) or Hugging Face {FAMILIES} directory")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer to use instead of the model's (SentencePiece .model or Hugging Face directory)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP degree")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP degree")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter and activation dtype")
    g.add_argument("--distributed-backend", default="auto", choices=("auto", "nccl", "gloo"))
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g = p.add_argument_group("Text")
    g.add_argument("--input", default=None, help="JSONL file of documents")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is scored (each a document)")
    g.add_argument("--data-path", default=None, help="a preprocessed dataset prefix (.bin/.idx) instead of --input")
    g.add_argument("--group-by-key", default=None, help="also report per value of this JSONL key (e.g. domain)")
    g.add_argument("--max-documents", type=int, default=None, help="score the first N documents only")
    g.add_argument("--seq-length", type=int, default=None, help="window length (default: the model's maximum)")
    g.add_argument("--stride", type=int, default=None,
                   help="tokens a window moves for long documents (default: --seq-length, disjoint windows)")
    g.add_argument("--output-json", default=None, help="write the results here (rank 0)")
    return p


@dataclass
class Tally:
    nll: float = 0.0          # nats
    tokens: int = 0
    bytes: int = 0
    chars: int = 0
    documents: int = 0

    def add(self, other: "Tally") -> None:
        self.nll += other.nll
        self.tokens += other.tokens
        self.bytes += other.bytes
        self.chars += other.chars
        self.documents += other.documents

    def as_list(self) -> list[float]:
        return [self.nll, self.tokens, self.bytes, self.chars, self.documents]

    def result(self) -> dict[str, Any]:
        loss = self.nll / self.tokens if self.tokens else float("nan")
        bits = self.nll / math.log(2)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)) if self.tokens else float("nan"),
                "bits_per_byte": bits / self.bytes if self.bytes else float("nan"),
                "bits_per_char": bits / self.chars if self.chars else float("nan"),
                "chars_per_token": self.chars / self.tokens if self.tokens else float("nan"),
                "bytes_per_token": self.bytes / self.tokens if self.tokens else float("nan"),
                "tokens": self.tokens, "bytes": self.bytes, "characters": self.chars, "documents": self.documents,
                "nll_nats": self.nll}


@dataclass
class Document:
    ids: list[int]              # text tokens
    nbytes: int
    nchars: int
    group: Optional[str] = None


def windows(n_tokens: int, length: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, scored) over a sequence of ``n_tokens`` positions (context token included): the
    window's inputs are positions ``[begin, end - 1)`` (at most ``length``), its targets ``[begin + 1,
    end)``, of which the last ``scored`` are scored; every target (positions 1..n-1) is scored once."""
    prev_end = 1
    begin = 0
    while True:
        end = min(begin + length + 1, n_tokens)
        if end > prev_end:
            yield begin, end, end - prev_end
            prev_end = end
        if end >= n_tokens:
            return
        begin += stride


def _read_jsonl(path: str, keys: Sequence[str], group_key: Optional[str], limit: Optional[int]) -> list[tuple[str, Optional[str]]]:
    from megatron_ru.utils.jsonl import json_objects
    out: list[tuple[str, Optional[str]]] = []
    for n, rec in json_objects(path, "--input"):
        group = None
        if group_key is not None:
            if group_key not in rec:
                raise ValueError(f"--group-by-key {group_key}: line {n} of {path} has no such key")
            group = str(rec[group_key])
        for key in keys:
            if key not in rec:
                raise ValueError(f"--json-keys {key}: line {n} of {path} has no such key (it has "
                                 f"{', '.join(rec)})")
            if isinstance(rec[key], str) and rec[key]:
                out.append((rec[key], group))
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


def text_documents(texts: Sequence[tuple[str, Optional[str]]], tokenizer: Any) -> list[Document]:
    """(text, group) pairs tokenized, with the bytes and characters of each text."""
    return [Document(tokenizer.tokenize(t), len(t.encode("utf-8")), len(t), g) for t, g in texts]


def load_documents(ns: argparse.Namespace, tokenizer: Any) -> list[Document]:
    if (ns.input is None) == (ns.data_path is None):
        raise ValueError("give exactly one of --input (JSONL) and --data-path (a preprocessed dataset)")
    if ns.input is not None:
        return text_documents(_read_jsonl(ns.input, ns.json_keys, ns.group_by_key, ns.max_documents), tokenizer)
    if ns.group_by_key is not None:
        raise ValueError("--group-by-key needs --input (a preprocessed dataset has no keys)")
    from megatron_ru.data.token_text import byte_and_char_counts, token_texts
    from megatron_ru.data.indexed_dataset import IndexedDataset
    nbytes, nchars = byte_and_char_counts(token_texts(tokenizer))
    ds = IndexedDataset(ns.data_path)
    docs = []
    for d in range(ds.num_documents):
        ids = [int(i) for seq in ds.document(d) for i in seq]
        while ids and ids[-1] == tokenizer.eod:
            ids.pop()
        docs.append(Document(ids, int(nbytes[ids].sum()) if ids else 0, int(nchars[ids].sum()) if ids else 0))
        if ns.max_documents is not None and len(docs) >= ns.max_documents:
            break
    return docs


def _context_token(tokenizer: Any) -> int:
    return tokenizer.bos if tokenizer.bos is not None else tokenizer.eod


@torch.no_grad()
def score_document(runner: Any, doc: Document, start: int, length: int, stride: int, device: torch.device) -> float:
    """Sum of NLL (nats, float64) of ``doc``'s text tokens; on the last stage (0.0 elsewhere)."""
    seq = torch.tensor([start] + doc.ids, dtype=torch.long, device=device)
    total = 0.0
    for begin, end, scored in windows(len(seq), length, stride):
        tokens = seq[begin:end - 1].unsqueeze(0)
        targets = seq[end - scored:end]
        positions = torch.arange(end - 1 - begin, device=device).unsqueeze(0)
        logits = runner(tokens, positions)
        if logits is None:
            continue
        logp = torch.log_softmax(logits[0, -scored:].double(), dim=-1)
        total += float(-logp.gather(1, targets.unsqueeze(1)).sum())
    return total


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> dict[str, Any]:
    from megatron_ru.inference.model_io import model_tokenizer, open_model
    from megatron_ru.inference.runner import start_stage_runner

    model = open_model(ns.load, "--load")
    _, tokenizer = model_tokenizer(model, ns.tokenizer, "--tokenizer", "--load")
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model in --load {ns.load} has "
                         f"{model.vocab_size} vocabulary rows: it is not this model's tokenizer")
    length = ns.seq_length or model.cfg.max_position_embeddings
    stride = ns.stride or length
    if length < 2 or length > model.cfg.max_position_embeddings:
        raise ValueError(f"--seq-length {length}: must be in [2, {model.cfg.max_position_embeddings}] (the model's "
                         "maximum positions)")
    if not 1 <= stride <= length:
        raise ValueError(f"--stride {stride}: must be in [1, --seq-length {length}]")
    docs = load_documents(ns, tokenizer)
    if not docs:
        raise ValueError("no documents to score (empty input)")
    start = _context_token(tokenizer)

    state, runner = start_stage_runner(ns, model.cfg, model.vocab_size, DTYPES[ns.dtype])
    runner.load(model.get)
    log_rank0(log, f"scoring {len(docs)} documents with {ns.load} at TP={state.tp_size} PP={state.pp_size} "
                   f"DP={state.dp_size}; windows of {length} tokens, stride {stride}")
    t0 = time.perf_counter()
    results = score_documents(runner, docs, start, length, stride, state)
    names = sorted({d.group for d in docs if d.group is not None})
    out = {"load": ns.load, "input": ns.input or ns.data_path, "seq_length": length, "stride": stride,
           "tensor_model_parallel_size": state.tp_size, "pipeline_model_parallel_size": state.pp_size,
           "context_token": start, OVERALL: results[OVERALL], "groups": {n: results[n] for n in names},
           "seconds": time.perf_counter() - t0}
    emit_report(out, format_table(out), ns.output_json, state)
    return out


def score_documents(runner: Any, docs: Sequence[Document], start: int, length: int, stride: int,
                    state: Any) -> dict[str, dict[str, Any]]:
    """:meth:`Tally.result` of ``docs`` over every data-parallel replica: ``OVERALL`` and each group."""
    tallies: dict[str, Tally] = defaultdict(Tally)
    for i in range(state.dp_rank, len(docs), state.dp_size):
        doc = docs[i]
        nll = score_document(runner, doc, start, length, stride, state.device)
        one = Tally(nll, len(doc.ids), doc.nbytes, doc.nchars, 1)
        tallies[OVERALL].add(one)
        if doc.group is not None:
            tallies[doc.group].add(one)
    return _reduce(tallies, [OVERALL] + sorted({d.group for d in docs if d.group is not None}), state, runner)


def emit_report(out: dict[str, Any], table: str, output_json: Optional[str], state: Any) -> None:
    """On rank 0: ``table`` on stdout and ``out`` written atomically to ``output_json`` (when given)."""
    if state.rank != 0:
        return
    cli.emit(table)
    if output_json:
        # its directory made as `--save` makes its own: a missing one lost the report after the scoring
        os.makedirs(os.path.dirname(os.path.abspath(output_json)), exist_ok=True)
        tmp = output_json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
        os.replace(tmp, output_json)


def _reduce(tallies: dict[str, Tally], names: list[str], state: Any, runner: Any) -> dict[str, dict[str, Any]]:
    """Sums over the data-parallel replicas, as the last stage's TP rank 0 of each replica counted them."""
    t = torch.tensor([tallies[n].as_list() for n in names], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine = t if runner.is_source() else torch.zeros_like(t)
        if dist.get_backend() == "nccl":
            mine = mine.to(state.device)
        dist.all_reduce(mine)
        t = mine.cpu()
    return {n: Tally(float(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4])).result() for n, r in zip(names, t.tolist())}


def format_table(out: dict[str, Any]) -> str:
    head = f"{'group':<20} {'documents':>9} {'tokens':>9} {'loss':>8} {'ppl':>10} {'bits/byte':>10} {'bits/char':>10} {'chars/token':>11}"
    rows = [head, "-" * len(head)]
    for name, r in [(OVERALL, out[OVERALL])] + list(out["groups"].items()):
        rows.append(f"{name[:20]:<20} {r['documents']:>9d} {r['tokens']:>9d} {r['loss']:>8.4f} {r['perplexity']:>10.3f} "
                    f"{r['bits_per_byte']:>10.5f} {r['bits_per_char']:>10.5f} {r['chars_per_token']:>11.3f}")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The whole program; returns the exit status (0 done, 2 a bad flag or input, 1 a failure)."""
    from megatron_ru.parallel.failure import distributed_tool_main
    return distributed_tool_main(argv, build_parser, run, what="evaluation")
