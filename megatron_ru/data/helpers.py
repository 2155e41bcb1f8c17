"""Thin loader for the C++ dataset-index helpers (``megatron_ru.data._helpers``, csrc/helpers.cpp).

The functions here have the same signatures and results as :mod:`megatron_ru.data.helpers_ref`
(the numpy reference the tests compare against); they pick the int32 or int64 C++ variant
from the sizes involved, and convert inputs to the exact dtypes the extension takes, so
callers never see a pybind11 overload error. See csrc/helpers.cpp for the contracts.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max
_ext: ModuleType | None = None


def extension() -> ModuleType:
    """The compiled module; a clear ImportError saying how to build it when it is missing."""
    global _ext
    if _ext is None:
        try:
            from megatron_ru.data import _helpers
        except ImportError as exc:
            raise ImportError(
                "the C++ dataset helpers (megatron_ru.data._helpers, from csrc/helpers.cpp) are not built "
                f"({exc}). Build them with 'python setup.py build_ext --inplace' in the repository root, "
                "or reinstall with 'pip install --no-build-isolation -e .'") from exc
        _ext = _helpers
    return _ext


def index_dtype_for(num_positions: int, max_doc_size: int) -> type:
    """int32 when every doc_idx position and in-document offset fits, else int64."""
    if num_positions < _INT32_MAX and max_doc_size < _INT32_MAX:
        return np.int32
    return np.int64


def _prepare(sizes: np.ndarray, doc_idx: np.ndarray, index_dtype: type | None) -> tuple[np.ndarray, np.ndarray, type]:
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    if index_dtype is None:
        index_dtype = index_dtype_for(len(doc_idx), int(sizes.max()) if sizes.size else 0)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=index_dtype)
    return sizes, doc_idx, index_dtype


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int, *, index_dtype: type | None = None) -> np.ndarray:
    """Megatron's spanning sample index, shape [num_samples + 1, 2] (see helpers_ref)."""
    sizes, doc_idx, index_dtype = _prepare(sizes, doc_idx, index_dtype)
    fn = extension().build_sample_idx_int32 if index_dtype == np.int32 else extension().build_sample_idx_int64
    return fn(sizes, doc_idx, int(seq_length), int(num_epochs), int(tokens_per_epoch))


def build_boundary_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                              boundary_ptr: np.ndarray, boundary_off: np.ndarray, *,
                              index_dtype: type | None = None) -> np.ndarray:
    """Sample index whose samples all start at a boundary (see helpers_ref)."""
    sizes, doc_idx, index_dtype = _prepare(sizes, doc_idx, index_dtype)
    fn = (extension().build_boundary_sample_idx_int32 if index_dtype == np.int32
          else extension().build_boundary_sample_idx_int64)
    return fn(sizes, doc_idx, int(seq_length), np.ascontiguousarray(boundary_ptr, dtype=np.int64),
              np.ascontiguousarray(boundary_off, dtype=np.int64))


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: (dataset_index uint8[size], dataset_sample_index int64[size])."""
    return extension().build_blending_indices(np.ascontiguousarray(weights, dtype=np.float64), int(size))
