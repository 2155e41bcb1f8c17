"""The base checkpoint a LoRA checkpoint was trained on, recorded by content and not only by path.

A LoRA checkpoint holds only the trained tensors; its frozen weights are read from the base it names
in ``metadata.json`` (``lora_base``: ``{"load": dir, "iteration": N, "fingerprint": ...}``). A path
and an iteration say where the base was, not what it was: another model of the same shape written
there later (``import-hf --force``, a continued run) would load without a word and give other
results. So the record carries a fingerprint of the base's weight files, and every reader of the
LoRA checkpoint (resume, ``export-hf --lora``, ``reshard``) refuses a base whose files differ,
naming both directories.

The fingerprint: for each weight file (``*.pt`` of kind ``model``: no optimizer partitions, no RNG
states) of the base's ``iter_*`` directory, its size and the SHA-256 of its bytes. Sizes are checked
first (free); the hashes read every byte once, files in parallel threads (hashlib releases the GIL),
at about 1.7 GB/s per core on the machines we measured (BENCHMARKS.md, "LoRA base fingerprint").
Under a launcher, each rank hashes its share of the files (:func:`fingerprint_distributed`,
:func:`verify_distributed`).
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional

from megatron_ru.checkpointing.files import CheckpointError, file_kind

ALGORITHM = "sha256"
_CHUNK = 8 << 20


def weight_files(ckpt_dir: str) -> list[str]:
    """The weight files of an ``iter_*`` directory (sorted names)."""
    return sorted(e.name for e in os.scandir(ckpt_dir)
                  if e.is_file() and e.name.endswith(".pt") and file_kind(e.name) == "model")


def file_digest(path: str) -> str:
    h = hashlib.new(ALGORITHM)
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)


def _threads(n_files: int) -> int:
    return max(1, min(n_files, os.cpu_count() or 1, 8))


def fingerprint(ckpt_dir: str, names: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """``{"algorithm": "sha256", "files": {name: [size, hex digest]}}`` of ``names`` (default: every
    weight file of ``ckpt_dir``)."""
    names = weight_files(ckpt_dir) if names is None else sorted(names)
    paths = [os.path.join(ckpt_dir, n) for n in names]
    with ThreadPoolExecutor(_threads(len(paths))) as pool:
        digests = list(pool.map(file_digest, paths))
    return {"algorithm": ALGORITHM,
            "files": {n: [os.path.getsize(p), d] for n, p, d in zip(names, paths, digests)}}


def _describe(lora_dir: str, base: dict[str, Any]) -> str:
    return (f"{lora_dir} holds LoRA adapters trained on the base checkpoint {base.get('load')} iteration "
            f"{base.get('iteration')} (lora_base in its metadata.json)")


def _fix(base: dict[str, Any]) -> str:
    return (f"the base there was replaced or changed after the adapters were trained: put the original base back "
            f"at {base.get('load')}, or write the path of a copy of it into lora_base.load")


def size_problems(base_ckpt: str, recorded: dict[str, Any]) -> list[str]:
    """Missing, extra and resized weight files (no reading)."""
    files = recorded.get("files") or {}
    present = set(weight_files(base_ckpt))
    out = [f"{n} is missing" for n in sorted(set(files) - present)]
    out += [f"{n} is not in the recorded base" for n in sorted(present - set(files))]
    for n in sorted(set(files) & present):
        size = os.path.getsize(os.path.join(base_ckpt, n))
        if size != files[n][0]:
            out.append(f"{n} has {size} bytes, recorded {files[n][0]}")
    return out


def digest_problems(base_ckpt: str, recorded: dict[str, Any], names: Iterable[str]) -> list[str]:
    """The files among ``names`` whose bytes differ from the record."""
    names = sorted(names)
    if not names:
        return []
    now = fingerprint(base_ckpt, names)["files"]
    files = recorded["files"]
    return [f"{n} has {ALGORITHM} {now[n][1][:12]}..., recorded {files[n][1][:12]}..." for n in names
            if now[n][1] != files[n][1]]


def mismatch_error(lora_dir: str, base: dict[str, Any], problems: list[str]) -> CheckpointError:
    shown = "; ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
    return CheckpointError(f"{_describe(lora_dir, base)}, but the checkpoint at {base.get('load')} is not that base: "
                           f"{shown}; {_fix(base)}")


def base_dir(base: dict[str, Any]) -> str:
    from megatron_ru.checkpointing.meta import iteration_dir_name
    return os.path.join(str(base["load"]), iteration_dir_name(int(base["iteration"])))


def recorded_fingerprint(base: dict[str, Any]) -> Optional[dict[str, Any]]:
    fp = base.get("fingerprint")
    if fp is None:
        return None
    if not isinstance(fp, dict) or fp.get("algorithm") != ALGORITHM or not isinstance(fp.get("files"), dict):
        raise CheckpointError(f"lora_base.fingerprint {str(fp)[:80]!r} is not a fingerprint this megatron_ru reads "
                              f"({ALGORITHM} of each weight file): the metadata.json is damaged or from a newer "
                              f"version")
    return fp


def verify(lora_dir: str, base: dict[str, Any]) -> None:
    """Refuse (:class:`CheckpointError`) a base whose weight files differ from the record; a record
    without a fingerprint (saved before it existed) is accepted as it is."""
    recorded = recorded_fingerprint(base)
    if recorded is None:
        return
    ckpt = base_dir(base)
    problems = size_problems(ckpt, recorded) or digest_problems(ckpt, recorded, recorded["files"])
    if problems:
        raise mismatch_error(lora_dir, base, problems)


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (every rank of the job hashes some)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return names
    return names[dist.get_rank()::dist.get_world_size()]


def fingerprint_distributed(ckpt_dir: str) -> dict[str, Any]:
    """:func:`fingerprint` with the hashing shared by the ranks of the job; every rank returns the
    whole fingerprint. Collective."""
    names = weight_files(ckpt_dir)
    merged: dict[str, Any] = {}
    for part in _all_gather(fingerprint(ckpt_dir, _share(names))["files"]):
        merged.update(part)
    return {"algorithm": ALGORITHM, "files": dict(sorted(merged.items()))}


def verify_distributed(lora_dir: str, base: dict[str, Any]) -> None:
    """:func:`verify` with the hashing shared by the ranks of the job; every rank raises the same
    error. Collective: every rank calls it, and every rank reaches the gather whatever it found."""
    recorded = recorded_fingerprint(base)
    if recorded is None:
        return
    ckpt = base_dir(base)
    try:
        problems = size_problems(ckpt, recorded) or digest_problems(ckpt, recorded, _share(sorted(recorded["files"])))
    except OSError as e:
        problems = [f"reading it failed ({e})"]
    found = [p for share in _all_gather(problems) for p in share]
    if found:
        raise mismatch_error(lora_dir, base, list(dict.fromkeys(found)))
