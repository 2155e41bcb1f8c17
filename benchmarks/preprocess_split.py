"""tools/preprocess_data.py with --split-sentences against the same run without it, on the same corpus.

Each round runs the tool twice in fresh processes (whole documents, then one sequence per
sentence; the order alternates between rounds), same tokenizer, workers and flags otherwise; the
figure is the median of the per-round ratios (split time / whole-document time: 1.0 means
splitting costs nothing). Corpora: ``make demo``'s (examples/demo.py: 4 MB of synthetic
Russian/English documents, its SentencePiece BPE 4k tokenizer trained here the same way) and any
``--corpus NAME=PATH`` given (e.g. the Debian manual pages that tools/real_model.py caches).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable


def demo_inputs(workdir: str) -> tuple[str, str]:
    """The demo's corpus and tokenizer model, made as examples/demo.py makes them."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import demo  # noqa: E402  (examples/demo.py)

    os.makedirs(workdir, exist_ok=True)
    corpus = demo.make_corpus(workdir)
    model = os.path.join(workdir, "tokenizer", "bpe4000.model")
    if not os.path.exists(model):
        model = demo.train_tokenizer(workdir, corpus)
    return corpus, model


def run_tool(corpus: str, model: str, prefix: str, workers: int, split: bool) -> float:
    cmd = [PY, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus, "--output-prefix", prefix,
           "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model, "--append-eod",
           "--workers", str(workers)] + (["--split-sentences"] if split else [])
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t


def tokens_in(prefix: str) -> tuple[int, int]:
    from megatron_ru.data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return int(ds.sequence_lengths.sum()), len(ds)


def measure(name: str, corpus: str, model: str, workdir: str, workers: int, rounds: int) -> dict:
    plain, split, ratios = [], [], []
    out = os.path.join(workdir, "out")
    os.makedirs(out, exist_ok=True)
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        t = {s: run_tool(corpus, model, os.path.join(out, name), workers, s) for s in order}
        plain.append(t[False])
        split.append(t[True])
        ratios.append(t[True] / t[False])
    tok_plain, seq_plain = tokens_in(os.path.join(out, f"{name}_text_document"))
    tok_split, seq_split = tokens_in(os.path.join(out, f"{name}_text_sentence"))
    return {"corpus": name, "mb": os.path.getsize(corpus) / 1e6, "workers": workers, "rounds": rounds,
            "plain_s": statistics.median(plain), "split_s": statistics.median(split),
            "plain_tok_s": tok_plain / statistics.median(plain), "split_tok_s": tok_split / statistics.median(split),
            "sequences": (seq_plain, seq_split), "ratio": statistics.median(ratios),
            "ratio_range": (min(ratios), max(ratios))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/bench_split")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--corpus", action="append", default=[], metavar="NAME=PATH",
                    help="another JSONL corpus (key 'text'), tokenized with the demo's tokenizer")
    args = ap.parse_args()
    demo_corpus, model = demo_inputs(args.workdir)
    corpora = [("demo", demo_corpus)] + [tuple(c.split("=", 1)) for c in args.corpus]
    print("| corpus (MB) | workers | rounds | without (median s) | --split-sentences (median s) | "
          "tokens/s without / split | sequences without / split | **median paired ratio** | min-max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, path in corpora:
        for w in args.workers:
            m = measure(name, path, model, args.workdir, w, args.rounds)
            print(f"| {name} ({m['mb']:.1f}) | {w} | {m['rounds']} | {m['plain_s']:.2f} | {m['split_s']:.2f} | "
                  f"{m['plain_tok_s'] / 1e3:.0f}k / {m['split_tok_s'] / 1e3:.0f}k | "
                  f"{m['sequences'][0]} / {m['sequences'][1]} | **{m['ratio']:.2f}x** | "
                  f"{m['ratio_range'][0]:.2f}-{m['ratio_range'][1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
