"""Sum a MEGATRON_RU_TEST_CPU_LOG file (tests/conftest.py) per test file, the costliest first.

    MEGATRON_RU_TEST_CPU_LOG=/tmp/cpu.jsonl make test
    python tests/cpu_log.py /tmp/cpu.jsonl [--tests N]
"""
from __future__ import annotations

import argparse
import collections
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--tests", type=int, default=20, help="also list the N costliest tests")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.log, encoding="utf-8") if line.strip()]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f[0] += r["cpu_s"]
        f[1] += r["wall_s"]
        f[2] += 1
    total_cpu = sum(f[0] for f in files.values())
    print(f"{len(rows)} tests, {total_cpu:.0f} CPU-s (children reaped by the tests included)")
    print(f"{'CPU-s':>8} {'share':>6} {'wall-s':>8} {'tests':>6}  file")
    for name, (cpu, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:8.0f} {100 * cpu / total_cpu:5.1f}% {wall:8.0f} {n:6d}  {name}")
    if args.tests:
        print(f"\nthe {args.tests} costliest tests")
        for r in sorted(rows, key=lambda r: -r["cpu_s"])[:args.tests]:
            print(f"{r['cpu_s']:8.0f} {r['wall_s']:8.0f}  {r['test']}")


if __name__ == "__main__":
    main()
