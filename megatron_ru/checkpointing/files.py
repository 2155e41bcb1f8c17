"""The files of one checkpoint: what it must hold, reading them safely, and saying clearly what is wrong.

A checkpoint's ``metadata.json`` lists every ``*.pt`` file of the directory with its size
(``files``), gathered from all ranks when the save completed. Before anything is loaded, every
file this load needs is checked to exist with that size, so a deleted TP shard, a truncated layer
file or a lost RNG file is one error naming the files, not a crash deep inside DeepSpeed (or,
worse, another rank's weights loaded in its place). Checkpoints written before the list existed
get the list derived from their layout (:func:`derive_expected`).

Every error here is a :class:`CheckpointError` (a ``ValueError``: the user's input is wrong) that
names the file, what is wrong and what to do; a save that could not be written (a full disk) is a
:class:`CheckpointSaveError`.
"""
from __future__ import annotations

import errno
import os
import pickle
import re
from typing import Any, Iterable, Optional

import torch

from megatron_ru.deepspeed_bridge.compat import TESTED_RANGE_TEXT
from megatron_ru.deepspeed_bridge.zero_files import pickled_classes


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file and the fix."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written; the previous checkpoint stays current."""


RNG_RE = re.compile(r"^rng_rank_(\d+)\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
OPTIM_RE = re.compile(r"^(.*)zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: optimizer files of the layer format (megatron_ru.checkpointing): per pipeline layer and TP rank
LAYER_OPTIM_RE = re.compile(r"^layer_(\d+)-model_(\d+)-optim_states\.pt$")
#: a training run's optimizer files in the layer format: each rank's fragments
FRAGMENT_RE = re.compile(r"^optim_states-pp(\d+)-tp(\d+)-dp(\d+)\.pt$")


def rng_file_name(rank: int) -> str:
    return f"rng_rank_{rank:05d}.pt"


def file_kind(name: str) -> str:
    """``rng`` (our RNG states), ``optim`` (ZeRO optimizer partitions) or ``model`` (DeepSpeed's model
    files, which also hold the optimizer without ZeRO, and the per-layer files of a pipeline)."""
    if RNG_RE.match(name):
        return "rng"
    if OPTIM_RE.match(name) or LAYER_OPTIM_RE.match(name) or FRAGMENT_RE.match(name):
        return "optim"
    return "model"


def list_files(ckpt_dir: str) -> dict[str, int]:
    """``{name: size}`` of the complete ``*.pt`` files in ``ckpt_dir`` (temporary names excluded)."""
    out = {}
    for entry in os.scandir(ckpt_dir):
        if entry.name.endswith(".pt") and entry.is_file():
            out[entry.name] = entry.stat().st_size
    return out


def derive_expected(tp: int, pp: int, dp: int, zero_stage: int, present: Iterable[str]) -> dict[str, Optional[int]]:
    """The files a checkpoint of this layout holds, for checkpoints saved before ``metadata.json``
    listed them (sizes unknown: None). Model files: one per model-parallel (TP × PP) rank, with ZeRO 3
    one per DP and model-parallel rank; layer files (PP > 1): every TP rank's file of every layer
    index any TP rank has a file for; ZeRO optimizer files: every (DP, model-parallel) rank, with the
    prefix in use (``bf16_``)."""
    present = list(present)
    mp = tp * pp
    if zero_stage == 3:  # the weights are partitioned too: one model file per DP and model-parallel rank
        out: dict[str, Optional[int]] = {f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt": None
                                         for d in range(dp) for m in range(mp)}
    else:
        out = {f"mp_rank_{m:02d}_model_states.pt": None for m in range(mp)}
    out.update({rng_file_name(r): None for r in range(mp * dp)})
    if pp > 1:
        layers = sorted({int(m.group(1)) for m in map(LAYER_RE.match, present) if m})
        out.update({f"layer_{i:02d}-model_{t:02d}-model_states.pt": None for i in layers for t in range(tp)})
    if zero_stage > 0:
        prefixes = sorted({m.group(1) for m in map(OPTIM_RE.match, present) if m}) or [""]
        out.update({f"{prefixes[0]}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt": None
                    for d in range(dp) for m in range(mp)})
    return out


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_files(ckpt_dir: str, expected: dict[str, Optional[int]], *, kinds: set[str],
                pointer: str, earlier: list[int]) -> None:
    """Raise one :class:`CheckpointError` for every expected file of ``kinds`` that is missing,
    empty or of another size than saved."""
    missing, bad_size = [], []
    for name, size in sorted(expected.items()):
        if file_kind(name) not in kinds:
            continue
        path = os.path.join(ckpt_dir, name)
        try:
            actual = os.stat(path).st_size
        except FileNotFoundError:
            missing.append(name)
            continue
        if actual == 0 or (size is not None and actual != size):
            bad_size.append(f"{name} ({actual} bytes, saved as {size if size is not None else 'non-empty'})")
    if not missing and not bad_size:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} file(s) missing: {_listing(missing)}")
    if bad_size:
        parts.append(f"{len(bad_size)} file(s) truncated or overwritten: {_listing(bad_size)}")
    fixes = ["restore the files from a copy of the checkpoint"]
    if earlier:
        fixes.append(f"resume from an earlier checkpoint by writing its iteration "
                     f"({', '.join(map(str, earlier[-3:]))} exist) into {pointer}")
    damaged_kinds = {file_kind(n.split(" ")[0]) for n in missing + bad_size}
    if damaged_kinds == {"rng"}:
        fixes.append("pass --no-load-rng to resume with fresh random states (the resumed run is then "
                     "no longer bit-exact with an uninterrupted run when dropout is on)")
    elif damaged_kinds == {"optim"}:
        fixes.append("pass --no-load-optim to load the weights only (fresh optimizer state)")
    raise CheckpointError(f"checkpoint {ckpt_dir} is damaged, nothing was loaded: {'; '.join(parts)}. "
                          f"To continue: {'; or '.join(fixes)}")


# ---- reading one file ------------------------------------------------------------------------------

_ALLOWED: list[bool] = []


def _allow_deepspeed_globals() -> None:
    """Allow-list DeepSpeed's four plain data classes once, process-wide. (torch's ``safe_globals``
    context manager restores the list on exit: with loads in two threads — the checkpoint reader
    reads the next layer in the background — one thread's exit removed them under the other's load.)"""
    if not _ALLOWED:
        torch.serialization.add_safe_globals(pickled_classes())
        _ALLOWED.append(True)


def _first_line(e: BaseException) -> str:
    """The first sentence of an error (torch's run on with advice we do not want to pass on)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text.split(". ")[0][:160]


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
#: the first bytes of every file torch.save writes (a zip archive)
ZIP_MAGIC = b"PK\x03\x04"


def safe_load(path: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with DeepSpeed's plain data classes allow-listed; a missing,
    damaged or code-carrying file is a :class:`CheckpointError` naming it. ``mmap``: tensors stay in the
    file until touched (offline readers that take slices of large files)."""
    save_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    fix = (f"restore it from a copy of the checkpoint, or resume from an earlier checkpoint by writing its "
           f"iteration into {os.path.join(save_dir, 'latest_checkpointed_iteration.txt')}")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; {fix}")
    size = os.path.getsize(path)
    damaged = f"{path} ({size} bytes) is truncated or overwritten"
    with open(path, "rb") as f:
        head = f.read(4)
    if head != ZIP_MAGIC:  # torch.save writes a zip archive; anything else (a legacy pickle included) is not ours
        what = "it is empty" if size == 0 else f"it does not start as a torch.save archive: first bytes {head!r}"
        raise CheckpointError(f"{path}: not a torch checkpoint ({what}, {size} bytes); it was overwritten or "
                              f"damaged: {fix}")
    try:
        _allow_deepspeed_globals()
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = _GLOBAL_RE.search(str(e))
        if found and found.group(1).startswith(("deepspeed.", "torch.")):
            raise CheckpointError(
                f"{path} holds a {found.group(1)} object, which megatron_ru does not allow-list for loading "
                f"(a DeepSpeed release other than the tested {TESTED_RANGE_TEXT} may have written it): save it "
                f"again with a tested DeepSpeed, or {fix}") from None
        if found:
            raise CheckpointError(
                f"{path} refers to code ({found.group(1)}), which a checkpoint never holds: it "
                f"was refused and nothing in it ran. The file was not written by megatron_ru or was altered "
                f"after the save: {fix}") from None
        raise CheckpointError(f"{damaged} (it does not parse as a checkpoint): {fix}") from None
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, IndexError) as e:
        reason = _first_line(e) or ("empty" if size == 0 else "ends early")
        raise CheckpointError(f"{damaged} ({type(e).__name__}: {reason}): {fix}") from None


# ---- a full disk during a save ---------------------------------------------------------------------

def _mount_of(path: str) -> tuple[str, str]:
    """(mount point, device or file system name) holding ``path``."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    mount = path
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    device = mount
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 2 and fields[1] == mount:
                    device = fields[0]
    except OSError:
        pass
    return mount, device


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def is_no_space(e: BaseException) -> bool:
    """ENOSPC/EDQUOT, or torch's zip writer noticing a short write (``unexpected pos``)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left on device" in text or ("inline_container" in text and "unexpected pos" in text) \
        or "file write failed" in text


#: below this much room a file system counts as full (a failed write leaves its partial file in place)
_FULL_BYTES = 1 << 20


def describe_write_failure(path: str, e: BaseException) -> str:
    """One sentence for a failed write of ``path``: "no space left on DEVICE while writing PATH ...". torch's
    file writer (a C++ ofstream) reports a short write at its flush as ``basic_ios::clear: iostream error``,
    which names no cause: it counts as no space when the file system is full (for root, whom the blocks
    reserved for root are open to, when those are gone too)."""
    mount, device = _mount_of(path)
    try:
        st: Optional[os.statvfs_result] = os.statvfs(mount)
    except OSError:
        st = None
    full = st is not None and (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize < _FULL_BYTES
    if is_no_space(e) or ("iostream error" in str(e) and full):
        room = "" if st is None else \
            f" ({_size(st.f_bavail * st.f_frsize)} free of {_size(st.f_blocks * st.f_frsize)})"
        return f"no space left on {device} (mounted at {mount}{room}) while writing {path}"
    return f"writing {path} failed ({type(e).__name__}: {_first_line(e)})"
