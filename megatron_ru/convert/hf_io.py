"""Hugging Face weight files, read and written one tensor at a time.

Reading (:class:`HFWeights`): a local directory with ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (any other ``*.safetensors`` files are read by their headers).
Shapes and dtypes come from the safetensors headers alone (no tensor data is touched); a tensor
is read with ``safetensors.safe_open`` and the file handle closed again, so the pages of the
memory-mapped file do not accumulate in this process's resident set. ``pytorch_model*.bin``
(pickle) is read only with ``allow_pickle=True``.

Writing (:class:`ShardedSafetensorsWriter`): the names, shapes and dtypes of every tensor are
known before the first byte (the caller plans them), so each shard's safetensors header is
written first and the tensors are streamed behind it in order: no shard is ever assembled in
memory. File names are transformers': ``model.safetensors`` when everything fits under
``max_shard_size``, else ``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

#: safetensors dtype codes <-> torch dtypes
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_CODES = {v: k for k, v in _DTYPES.items()}

#: tensors some checkpoints carry that are not weights (old transformers saved RoPE buffers)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from the file's header."""
    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 bytes (transformers' convention: KB/MB/GB powers of 1000,
    KiB/MiB/GiB powers of 1024); a bare integer is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB, 2GiB or a number of bytes")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(value * scale)
    if size < 1:
        raise ValueError(f"--max-shard-size {text!r} must be at least one byte")
    return size


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8 or n > 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header length {n} does not fit the file's "
                             f"{size} bytes); the file is truncated or of another format")
        try:
            return json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: damaged safetensors header ({e})") from None


def _bin_files(hf_dir: str) -> list[str]:
    if os.path.isfile(os.path.join(hf_dir, BIN_INDEX)):
        with open(os.path.join(hf_dir, BIN_INDEX), encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return sorted(n for n in os.listdir(hf_dir) if re.fullmatch(r"pytorch_model.*\.bin", n))


class HFWeights:
    """The tensors of a local Hugging Face model directory, by name, read one at a time."""

    def __init__(self, hf_dir: str, allow_pickle: bool = False) -> None:
        self.dir = hf_dir
        self.infos: dict[str, TensorInfo] = {}
        self.pickle = False
        self._bin_cache: tuple[Optional[str], dict] = (None, {})
        safe = self._safetensors_files()
        if safe:
            for fname in safe:
                self._add_safetensors(fname)
            self._check_index()
            return
        bins = _bin_files(hf_dir)
        if not bins:
            raise FileNotFoundError(
                f"--load {hf_dir}: no weights found: expected {SAFE_SINGLE}, or shards listed in {SAFE_INDEX} "
                f"(or {BIN_SINGLE} with --allow-pickle)")
        if not allow_pickle:
            raise ValueError(
                f"--load {hf_dir}: the weights are only in pickle files ({', '.join(bins)}); unpickling can run "
                "arbitrary code from the file, so they are read only with --allow-pickle (pass it if you trust "
                "the files, or convert them to safetensors first)")
        self.pickle = True
        for fname in bins:
            for name, t in self._load_bin(fname).items():
                self._add(TensorInfo(name, fname, tuple(t.shape), t.dtype))

    # ---- discovery ----
    def _safetensors_files(self) -> list[str]:
        index = os.path.join(self.dir, SAFE_INDEX)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index (no weight_map: {e})") from None
            files = sorted(set(weight_map.values()))
            missing = [n for n in files if not os.path.isfile(os.path.join(self.dir, n))]
            if missing:
                raise FileNotFoundError(f"{index} lists {', '.join(missing)}, which is not in {self.dir}")
            return files
        if os.path.isfile(os.path.join(self.dir, SAFE_SINGLE)):
            return [SAFE_SINGLE]
        return sorted(n for n in os.listdir(self.dir) if n.endswith(".safetensors"))

    def _check_index(self) -> None:
        """The index and the shards' headers must agree on where every tensor is."""
        index = os.path.join(self.dir, SAFE_INDEX)
        if not os.path.isfile(index):
            return
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        for name, fname in weight_map.items():
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name not in self.infos:
                raise ValueError(f"{index} puts tensor {name} in {fname}, whose header does not have it; the "
                                 "index and the shards are from different saves")
            if self.infos[name].file != fname:
                raise ValueError(f"{index} puts tensor {name} in {fname}, but it is in {self.infos[name].file}")

    def _add(self, info: TensorInfo) -> None:
        if info.name.endswith(IGNORED_SUFFIXES):
            return
        if info.name in self.infos:
            raise ValueError(f"tensor {info.name} is in both {self.infos[info.name].file} and {info.file} "
                             f"under {self.dir}")
        self.infos[info.name] = info

    def _add_safetensors(self, fname: str) -> None:
        path = os.path.join(self.dir, fname)
        for name, entry in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise ValueError(f"{path}: tensor {name} has dtype {entry.get('dtype')}, which cannot be converted")
            self._add(TensorInfo(name, fname, tuple(entry["shape"]), dtype))

    def _load_bin(self, fname: str) -> dict:
        if self._bin_cache[0] != fname:
            self._bin_cache = (None, {})
            path = os.path.join(self.dir, fname)
            try:  # zip archives are memory-mapped: only the tensors read are paged in
                sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:  # the legacy (non-zip) format cannot be mapped
                sd = torch.load(path, map_location="cpu", weights_only=True)
            self._bin_cache = (fname, sd)
        return self._bin_cache[1]

    # ---- access ----
    def names(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def info(self, name: str) -> TensorInfo:
        return self.infos[name]

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read now (shape and dtype as stored)."""
        info = self.infos[name]
        if self.pickle:
            return self._load_bin(info.file)[name].clone()
        from safetensors import SafetensorError, safe_open
        path = os.path.join(self.dir, info.file)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                t = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: cannot read tensor {name} ({e}); the file is damaged or truncated") from None
        # a view of the mapped file would keep its pages (and the mapping) alive: own the memory
        return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


@dataclass
class _Shard:
    file: str
    entries: list[tuple[str, tuple[int, ...], torch.dtype]]


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


#: safetensors' serialization order puts wider dtypes first (its Dtype enum, descending), then names
_DTYPE_RANK = {torch.bool: 0, torch.uint8: 1, torch.int8: 2, torch.float8_e5m2: 3, torch.float8_e4m3fn: 4,
               torch.int16: 5, torch.float16: 6, torch.bfloat16: 7, torch.int32: 8, torch.float32: 9,
               torch.float64: 10, torch.int64: 11}


def _file_order(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The order safetensors' ``save_file`` lays tensors out in a file: dtype (widest first), then name."""
    return sorted(entries, key=lambda e: (-_DTYPE_RANK.get(e[2], 0), e[0]))


class ShardedSafetensorsWriter:
    """Writes the planned tensors as transformers-named safetensors shards, each file byte for byte
    what ``safetensors.torch.save_file`` writes for the same tensors (its header, order and
    alignment), whatever order the tensors arrive in.

    ``plan``: (name, shape, dtype) of every tensor in the order :meth:`write` will get them. A
    tensor bigger than ``max_shard_size`` gets a shard of its own (as transformers does).
    """

    def __init__(self, out_dir: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_size: int, metadata: Optional[dict[str, str]] = None) -> None:
        self.out_dir = out_dir
        self.metadata = {"format": "pt", **(metadata or {})}
        shards: list[list] = [[]]
        size = 0
        for name, shape, dtype in plan:
            n = _nbytes(shape, dtype)
            if shards[-1] and size + n > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(int(s) for s in shape), dtype))
            size += n
        total = len(shards)
        self.shards = [_Shard(SAFE_SINGLE if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors", s)
                       for i, s in enumerate(shards)]
        self.total_size = sum(_nbytes(s, d) for _, s, d in plan)
        self._queue = [(si, e) for si, sh in enumerate(self.shards) for e in sh.entries]
        self._pos = 0
        self._file = None
        self._file_index = -1

    def _open(self, si: int) -> None:
        self._close_file()
        shard = self.shards[si]
        header: dict = {"__metadata__": self.metadata}
        offset = 0
        for name, shape, dtype in _file_order(shard.entries):
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(os.path.join(self.out_dir, shard.file), "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        data_start = 8 + len(raw)
        self._offsets = {name: data_start + info["data_offsets"][0]
                         for name, info in header.items() if name != "__metadata__"}
        self._file_index = si

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def write(self, name: str, tensor: torch.Tensor | list[torch.Tensor]) -> None:
        """Append the next planned tensor (its name, shape and dtype must match the plan). A list of
        tensors is the tensor's rows in pieces (concatenated along dim 0 on disk, never in memory)."""
        if self._pos >= len(self._queue):
            raise RuntimeError(f"tensor {name} was not planned (all {len(self._queue)} tensors written)")
        si, (pname, shape, dtype) = self._queue[self._pos]
        pieces = tensor if isinstance(tensor, list) else [tensor]
        rows = sum(int(p.shape[0]) for p in pieces) if pieces and pieces[0].dim() else None
        got = (rows, *pieces[0].shape[1:]) if rows is not None else tuple(pieces[0].shape)
        if name != pname or tuple(got) != shape or any(p.dtype != dtype or tuple(p.shape[1:]) != shape[1:]
                                                       for p in pieces):
            raise RuntimeError(f"tensor {name} {tuple(got)} {pieces[0].dtype} written where the plan has "
                               f"{pname} {shape} {dtype}")
        if si != self._file_index:
            self._open(si)
        self._file.seek(self._offsets[name])
        for piece in pieces:
            data = piece.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            self._file.write(memoryview(data.numpy()))
        self._pos += 1

    def close(self) -> list[str]:
        """Finish the last shard and write the index (when sharded); returns the files written."""
        if self._pos != len(self._queue):
            raise RuntimeError(f"only {self._pos} of {len(self._queue)} planned tensors were written; next: "
                               f"{self._queue[self._pos][1][0]}")
        self._close_file()
        files = [s.file for s in self.shards]
        if len(self.shards) > 1:
            weight_map = {name: s.file for s in self.shards for name, _, _ in s.entries}
            index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
            with open(os.path.join(self.out_dir, SAFE_INDEX), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
            files.append(SAFE_INDEX)
        return files

    def abort(self) -> None:
        """Close an open shard file (the caller removes the directory)."""
        if self._file is not None:
            self._file.close()
            self._file = None
