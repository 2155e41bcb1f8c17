#!/usr/bin/env python
"""tools/preprocess_data.py end to end vs the tokenizer's own batch throughput (issue 2, item 7).

    python benchmarks/preprocess.py --size-mb 50 --workdir /tmp/bench_preprocess

Generates a synthetic corpus of long multi-paragraph documents (cached in --workdir), trains a
SentencePiece BPE model on its first few MB (or takes --tokenizer-model), then in the same run:
  limit(k)  = tokens/s of SentencePieceProcessor.encode(batch, num_threads=k) over the same
              texts already in memory as str (no JSON, no I/O, no start-up), k = 1, 2;
  tool(k)   = tokens/s of `python tools/preprocess_data.py --workers k` as a subprocess, wall
              clock including interpreter start-up, imports, reading, JSON and writing.
Prints ratio(k) = tool(k) / limit(k) -- of the best runs, and the median of per-round ratios
(each tool run against the limit run next to it) -- and one JSON line with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ru.data.preprocess.synthetic import write_corpus  # noqa: E402


def load_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def tokenizer_limit(model: str, corpus: str, threads: int, batch_chars: int) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and tokens for the tokenizer alone, batches of ``batch_chars``.

    The texts are read again (untimed) for every run: sentencepiece converts each ``str`` to
    UTF-8 in the calling thread, and CPython caches that conversion on the string object, so a
    second run over the same objects skips work that tokenizing any new text includes (measured:
    3-4 % of the 2-thread time on the benchmark corpus)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    texts = load_texts(corpus)
    batches, cur, size = [], [], 0
    for t in texts:
        cur.append(t)
        size += len(t)
        if size >= batch_chars:
            batches.append(cur)
            cur, size = [], 0
    if cur:
        batches.append(cur)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for b in batches:
        tokens += sum(a.size for a in sp.encode(b, num_threads=threads, return_type="numpy"))
    return time.perf_counter() - t0, time.process_time() - c0, tokens


def run_tool(corpus: str, model: str, out: str, workers: int, extra: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (the tool and its worker processes) of one run."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", out, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model,
           "--append-eod", "--workers", str(workers), "--log-interval", "100000000"] + extra
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"preprocess_data.py failed:\n{proc.stderr}")
    return dt, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _same_files(a: str, b: str) -> bool:
    return all(open(a + e, "rb").read() == open(b + e, "rb").read() for e in (".bin", ".idx"))


def _variant_key(i: int) -> str:
    return "" if i == 0 else f"_v{i}"


def _keep_best(results: dict, name: str, wall: float, cpu: float) -> None:
    if wall < results.get(f"{name}_seconds", float("inf")):
        results[f"{name}_seconds"] = wall
        results[f"{name}_cpu_seconds"] = cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=50.0)
    ap.add_argument("--workdir", default="/tmp/bench_preprocess")
    ap.add_argument("--tokenizer-model", default=None)
    ap.add_argument("--vocab-size", type=int, default=16000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch-chars", type=int, default=4 << 20, help="text per tokenizer call in the limit run")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; each measures the limit and every tool variant once")
    ap.add_argument("--extra", default="", help="extra preprocess_data.py flags, e.g. '--split-paragraphs'")
    ap.add_argument("--variant", action="append", default=[],
                    help="also measure the tool with these extra flags in the same rounds, e.g. "
                         "'--worker-type process' (repeatable)")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    corpus = os.path.join(args.workdir, f"corpus_{args.size_mb:g}mb.jsonl")
    if not os.path.exists(corpus):
        t0 = time.perf_counter()
        n = write_corpus(corpus, int(args.size_mb * 1e6), seed=1, paragraphs=(10, 60))
        print(f"generated {corpus}: {n} documents in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    model = args.tokenizer_model
    if model is None:
        model = os.path.join(args.workdir, f"sp_bpe_{args.vocab_size}.model")
        if not os.path.exists(model):
            from megatron_ru.data.tokenizers.train import train_sentencepiece

            texts = load_texts(corpus)[:400]
            train_sentencepiece(texts, model[:-len(".model")], "bpe", args.vocab_size, num_threads=2)
    mb = os.path.getsize(corpus) / 1e6
    with open(corpus, "rb") as f:
        documents = sum(1 for _ in f)
    results: dict = {"corpus_mb": round(mb, 1), "documents": documents, "machine": platform.processor() or
                     platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    # Rounds of (tokenizer alone, then each tool variant), the order flipped every other round so
    # that a slow drift of the machine's speed hits both sides alike. Two summaries: best of the
    # rounds for each (the least disturbed runs) and the median of the per-round ratios (each
    # tool run against the limit measured next to it).
    variants = [("default", args.extra.split())] + [(v, args.extra.split() + v.split()) for v in args.variant]
    results["load_average_before"] = os.getloadavg()[0]
    paired: dict = {}
    for r in range(args.repeat):
        for k in args.workers:
            steps = ["limit"] + list(range(len(variants)))
            if r % 2:
                steps.reverse()
            limit_wall, tool_walls = None, {}
            for step in steps:
                if step == "limit":
                    limit_wall, cpu, tokens = tokenizer_limit(model, corpus, k, args.batch_chars)
                    results["tokens"] = tokens
                    _keep_best(results, f"limit_{k}", limit_wall, cpu)
                    continue
                name = _variant_key(step)
                wall, cpu = run_tool(corpus, model, os.path.join(args.workdir, f"out_w{k}{name}"), k,
                                     variants[step][1])
                _keep_best(results, f"tool{name}_{k}", wall, cpu)
                tool_walls[name] = wall
            for name, wall in tool_walls.items():
                paired.setdefault(f"{name}_{k}", []).append(limit_wall / wall)  # token counts cancel (+eod below)
            results.setdefault("rounds", []).append({"workers": k, "limit_seconds": round(limit_wall, 3),
                                                     **{f"tool{n}_seconds": round(w, 3) for n, w in tool_walls.items()}})
    results["load_average_after"] = os.getloadavg()[0]
    toks = results["tokens"] + results["documents"]  # --append-eod adds one token per document
    for k in args.workers:
        lw, lc = results[f"limit_{k}_seconds"], results[f"limit_{k}_cpu_seconds"]
        results[f"limit_{k}_tokens_per_s"] = results["tokens"] / lw
        for i, (label, _) in enumerate(variants):
            name = _variant_key(i)
            tw, tc = results[f"tool{name}_{k}_seconds"], results[f"tool{name}_{k}_cpu_seconds"]
            ratios = [x * toks / results["tokens"] for x in paired[f"{name}_{k}"]]
            results[f"tool{name}_{k}_tokens_per_s"] = toks / tw
            results[f"ratio{name}_{k}"] = (toks / tw) / (results["tokens"] / lw)
            results[f"paired_ratios{name}_{k}"] = [round(x, 4) for x in ratios]
            results[f"median_paired_ratio{name}_{k}"] = statistics.median(ratios)
            results[f"cpu_ratio{name}_{k}"] = (toks / tc) / (results["tokens"] / lc)
            print(f"--workers {k}{'' if label == 'default' else ' ' + label}: tool {tw:.2f} s wall "
                  f"({toks / tw:,.0f} tokens/s), tokenizer alone with {k} thread(s) {lw:.2f} s "
                  f"({results['tokens'] / lw:,.0f} tokens/s): ratio of the bests {results[f'ratio{name}_{k}']:.3f}, "
                  f"median of {len(ratios)} paired ratios {statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f}); tokens per CPU-second ratio "
                  f"{results[f'cpu_ratio{name}_{k}']:.3f}", file=sys.stderr)
    outs = [os.path.join(args.workdir, f"out_w{k}{_variant_key(i)}_text_document")
            for k in args.workers for i in range(len(variants))]
    results["outputs_identical"] = all(_same_files(outs[0], o) for o in outs[1:])
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in results.items()}))


if __name__ == "__main__":
    main()
