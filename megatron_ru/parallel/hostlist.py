"""Expand a Slurm node list the way ``scontrol show hostnames`` does.

    expand_hostlist("node[01-03,07]")          -> ["node01", "node02", "node03", "node07"]
    expand_hostlist("a[1-2],b3")               -> ["a1", "a2", "b3"]
    expand_hostlist("rack[1-2]-node[01-02]")   -> ["rack1-node01", "rack1-node02",
                                                   "rack2-node01", "rack2-node02"]

A range keeps the zero padding of its lower bound ("08-10" -> 08, 09, 10). Several brackets in
one name expand as a cartesian product, leftmost bracket outermost, as Slurm prints them.

As a command it prints one host per line, like ``scontrol show hostnames NODELIST``; the Slurm
job scripts use it where ``scontrol`` is missing or has no Slurm configuration to read (a
laptop, CI, the login node of another cluster). It needs only the standard library, so it runs
as a file too, outside any virtual environment::

    python -m megatron_ru.parallel.hostlist 'gpu-[001-002]'
    python3 -I megatron_ru/parallel/hostlist.py 'gpu-[001-002]'
"""
from __future__ import annotations

import itertools
import sys


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at position {i} in node list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unmatched ']' at position {i} in node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in node list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range_set(body: str, whole: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07']."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} inside [{body}] in node list {whole!r}: "
                             "expected N or N-M with digits")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"descending range {item!r} in node list {whole!r}")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def _expand_name(name: str, whole: str) -> list[str]:
    pieces: list[list[str]] = []
    rest = name
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, closed, rest = tail.partition("]")
        if not closed:
            raise ValueError(f"unclosed '[' in node list {whole!r}")
        pieces.append([head])
        pieces.append(_expand_range_set(body, whole))
    pieces.append([rest])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(text: str) -> list[str]:
    """All host names of a Slurm node list, in order."""
    if not text or not text.strip():
        raise ValueError("empty node list")
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        hosts.extend(_expand_name(part, text))
    return hosts


def first_host(text: str) -> str:
    """The first host of a node list (without expanding the rest)."""
    part = _split_top_level(text.strip())[0] if text and text.strip() else ""
    if not part:
        raise ValueError("empty node list")
    names = _expand_name(part, text)
    return names[0]


def main(argv: list[str] | None = None) -> int:
    """``hostlist NODELIST``: the hosts, one per line (exit 2 with the reason on a bad list)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m megatron_ru.parallel.hostlist NODELIST   (e.g. 'gpu-[001-004]')\n")
        return 2
    try:
        hosts = expand_hostlist(args[0])
    except ValueError as e:
        sys.stderr.write(f"error: cannot expand the node list {args[0]!r}: {e}\n")
        return 2
    sys.stdout.write("".join(f"{h}\n" for h in hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
