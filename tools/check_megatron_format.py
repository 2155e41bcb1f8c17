#!/usr/bin/env python
"""Check byte compatibility with Megatron-LM's indexed dataset (needs megatron-core importable).

    pip install --no-deps --target /tmp/mcore megatron-core==0.16.1
    python tools/check_megatron_format.py --megatron-path /tmp/mcore

Writes the same random documents (uint16 and int32) with megatron-core's IndexedDatasetBuilder
and with ours, compares the .bin/.idx bytes, and reads each one's files with the other reader.
Exit status 0 when everything matches.
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_ru.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megatron_ru.utils.cli import ArgumentParser  # noqa: E402


def check(workdir: str, dtype: type, seed: int = 0) -> list[str]:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronReader
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder

    rng = np.random.default_rng(seed)
    docs = [[rng.integers(0, 60000, size=int(rng.integers(1, 30))) for _ in range(int(rng.integers(1, 5)))]
            for _ in range(200)]
    theirs_prefix, ours_prefix = os.path.join(workdir, "megatron"), os.path.join(workdir, "ours")
    builder = MegatronBuilder(theirs_prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
    builder.finalize(theirs_prefix + ".idx")
    with IndexedDatasetBuilder(ours_prefix + ".bin", dtype) as ours:
        for doc in docs:
            for seq in doc:
                ours.add_item(seq)
            ours.end_document()
        ours.finalize(ours_prefix + ".idx")
    problems = []
    for ext in (".bin", ".idx"):
        if open(theirs_prefix + ext, "rb").read() != open(ours_prefix + ext, "rb").read():
            problems.append(f"{np.dtype(dtype)}: {ext} bytes differ")
    flat = [s for doc in docs for s in doc]
    theirs_reads_ours, ours_reads_theirs = MegatronReader(ours_prefix), IndexedDataset(theirs_prefix)
    if not all(np.array_equal(theirs_reads_ours[i], flat[i]) for i in range(len(flat))):
        problems.append(f"{np.dtype(dtype)}: megatron-core reads different tokens from our files")
    if not all(np.array_equal(ours_reads_theirs[i], flat[i]) for i in range(len(flat))):
        problems.append(f"{np.dtype(dtype)}: we read different tokens from megatron-core's files")
    return problems


def main() -> int:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatron-path", default=None, help="directory to add to sys.path for megatron-core")
    args = ap.parse_args()
    if args.megatron_path:
        sys.path.append(args.megatron_path)
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        print(f"check_megatron_format.py: error: megatron-core is not importable ({e}); install it, e.g. "
              "pip install --no-deps --target /tmp/mcore megatron-core, and pass --megatron-path /tmp/mcore",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as d:
        problems = check(d, np.uint16) + check(d, np.int32)
    print("\n".join(problems) if problems else "identical bytes and mutual reads for uint16 and int32")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
