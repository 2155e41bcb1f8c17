"""Time to build GPT dataset indices with the C++ helpers vs the numpy/Python reference.

A synthetic corpus (document and paragraph lengths drawn like a long-document web corpus,
>= 100 M tokens by default) is indexed in each --sample-start mode with
``build_gpt_indices(use_cpp=True)`` and ``use_cpp=False`` in the same run; the sample-index
step is also timed alone on the same doc_idx, and the blending indices are timed for a
3-dataset blend. Results must be identical; the ratio reference / C++ is reported.

    .venv/bin/python benchmarks/dataset_index.py [--tokens 100000000] [--seq-length 2048]

Prints a markdown table (for BENCHMARKS.md) and writes benchmarks/out/dataset_index.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from megatron_ru.data import helpers, helpers_ref
from megatron_ru.data.gpt_dataset import DocumentLayout, build_gpt_indices


def synthetic_lengths(tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Paragraph lengths and document starts: long documents of ~12 paragraphs of ~120 tokens."""
    rng = np.random.default_rng(seed)
    n_par = int(tokens / 120 * 1.1)
    lengths = np.maximum(1, rng.lognormal(np.log(90), 0.8, size=n_par)).astype(np.int32)
    cum = np.cumsum(lengths, dtype=np.int64)
    lengths = lengths[: int(np.searchsorted(cum, tokens)) + 1]
    per_doc = np.maximum(1, rng.geometric(1 / 12, size=len(lengths)))
    doc_first = np.concatenate([[0], np.cumsum(per_doc)])
    doc_first = doc_first[doc_first < len(lengths)]
    return lengths, np.concatenate([doc_first, [len(lengths)]]).astype(np.int64)


def timed(fn, *args, **kwargs):
    """(result, best seconds): repeated until 1 s has been spent (at least once), the minimum
    taken, because millisecond-scale steps are noisy on a shared machine."""
    best, spent, runs = float("inf"), 0.0, 0
    while runs == 0 or (spent < 1.0 and runs < 50):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return out, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--epochs", type=float, default=1.0, help="samples asked, in epochs of the corpus")
    ap.add_argument("--blend-samples", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    lengths, doc_first = synthetic_lengths(args.tokens, args.seed)
    total_tokens = int(lengths.sum(dtype=np.int64))
    num_docs = len(doc_first) - 1
    num_samples = int(args.epochs * total_tokens / args.seq_length)
    rows = []
    print(f"corpus: {total_tokens:,} tokens, {num_docs:,} documents, {len(lengths):,} paragraphs; "
          f"seq_length {args.seq_length}, {num_samples:,} samples asked")
    for mode in ("any", "document", "paragraph"):
        layout = DocumentLayout.from_lengths(lengths, doc_first, mode)
        documents = np.arange(num_docs)
        fast, t_cpp = timed(build_gpt_indices, layout, documents, num_samples, args.seq_length, args.seed, mode, use_cpp=True)
        slow, t_ref = timed(build_gpt_indices, layout, documents, num_samples, args.seq_length, args.seed,
                            mode, use_cpp=False)
        for name in ("doc_idx", "sample_idx", "shuffle_idx"):
            assert np.array_equal(getattr(fast, name), getattr(slow, name)), f"{mode}: {name} differs"
        doc_idx = fast.doc_idx  # the sample-index step alone, on the same doc_idx
        if mode == "any":
            tpe = int(layout.sizes.sum())
            step = lambda impl: impl.build_sample_idx(layout.sizes, doc_idx, args.seq_length, fast.num_epochs, tpe)  # noqa: E731
        else:
            step = lambda impl: impl.build_boundary_sample_idx(layout.sizes, doc_idx, args.seq_length,  # noqa: E731
                                                               layout.boundary_ptr, layout.boundary_off)
        a, s_cpp = timed(step, helpers)
        b, s_ref = timed(step, helpers_ref)
        assert np.array_equal(a, b)
        rows.append({"what": f"GPT indices, --sample-start {mode}", "cpp_s": t_cpp, "ref_s": t_ref,
                     "samples": len(fast.shuffle_idx), "skipped_share": fast.skipped_share})
        rows.append({"what": f"  sample index only ({mode})", "cpp_s": s_cpp, "ref_s": s_ref, "samples": len(a) - 1})
    weights = np.array([0.5, 0.3, 0.2])
    (di, dsi), b_cpp = timed(helpers.build_blending_indices, weights, args.blend_samples)
    (di2, dsi2), b_ref = timed(helpers_ref.build_blending_indices, weights, args.blend_samples)
    assert np.array_equal(di, di2) and np.array_equal(dsi, dsi2)
    rows.append({"what": "blending indices, 3 datasets", "cpp_s": b_cpp, "ref_s": b_ref, "samples": args.blend_samples})

    print("\n| step | C++ (s) | reference (s) | reference / C++ | samples | skipped tokens |\n|---|---|---|---|---|---|")
    for r in rows:
        skipped = f"{100 * r['skipped_share']:.1f}%" if r.get("skipped_share") is not None else ""
        print(f"| {r['what']} | {r['cpp_s']:.3f} | {r['ref_s']:.3f} | {r['ref_s'] / r['cpp_s']:.1f}x "
              f"| {r['samples']:,} | {skipped} |")
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "dataset_index.json"), "w") as f:
        json.dump({"tokens": total_tokens, "documents": num_docs, "paragraphs": int(len(lengths)),
                   "seq_length": args.seq_length, "num_samples": num_samples, "machine": platform.machine(),
                   "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
