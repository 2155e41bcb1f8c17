// C++ helpers for the data pipeline (pybind11 module megatron_ru.data._helpers).
//
// The hot loops of dataset index building live here; megatron_ru/data/helpers_ref.py is the
// pure-Python/numpy reference the tests compare against, and megatron_ru/data/helpers.py is
// the thin wrapper that chooses the int32/int64 variant. Every loop runs with the GIL
// released: inputs are plain C arrays owned by numpy objects that the caller keeps alive.
//
// Functions (IdxT is int32 or int64; the suffix names it):
//   build_sample_idx_{int32,int64}(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
//       Megatron's spanning sample index: row k = (position in doc_idx, token offset) where
//       sample k starts; sample k ends on the token where sample k+1 starts (seq_length + 1
//       tokens each, consecutive samples share one token). Shape [num_samples + 1, 2] with
//       num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length.
//   build_boundary_sample_idx_{int32,int64}(sizes, doc_idx, seq_length, boundary_ptr, boundary_off)
//       Every sample starts at a boundary (CSR: boundaries of document d are the token offsets
//       boundary_off[boundary_ptr[d]:boundary_ptr[d+1]], ascending). A sample reads
//       seq_length + 1 tokens across documents; the next one starts at the first boundary at or
//       after its token seq_length (where the spanning mode would start it). Samples are made
//       while the stream has seq_length + 1 tokens left; the last row is where the next sample
//       would start ((len(doc_idx), 0) when no boundary is left).
//   build_blending_indices(weights, size) -> (dataset_index uint8[size], dataset_sample_index int64[size])
//       Megatron's greedy blend: sample i goes to the dataset with the largest
//       weight * max(i, 1) - samples_taken_so_far (first such dataset on ties).
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

template <typename T>
using carray = py::array_t<T, py::array::c_style>;

namespace {

// Checks every doc_idx entry names a document and that IdxT can hold positions and offsets.
template <typename IdxT>
int64_t checked_stream_tokens(const int64_t* sizes, int64_t n_docs, const IdxT* doc_idx, int64_t n_pos) {
  const int64_t limit = static_cast<int64_t>(std::numeric_limits<IdxT>::max());
  if (n_pos >= limit) {
    throw std::invalid_argument("doc_idx has " + std::to_string(n_pos) +
                                " entries, too many for this index dtype; use the int64 variant");
  }
  int64_t total = 0;
  for (int64_t p = 0; p < n_pos; ++p) {
    const int64_t d = static_cast<int64_t>(doc_idx[p]);
    if (d < 0 || d >= n_docs) {
      throw std::invalid_argument("doc_idx[" + std::to_string(p) + "] = " + std::to_string(d) +
                                  " is not a document id (there are " + std::to_string(n_docs) + " documents)");
    }
    if (sizes[d] < 0 || sizes[d] >= limit) {
      throw std::invalid_argument("document " + std::to_string(d) + " has size " + std::to_string(sizes[d]) +
                                  ", outside what this index dtype holds; use the int64 variant");
    }
    total += sizes[d];
  }
  return total;
}

template <typename IdxT>
carray<IdxT> build_sample_idx(const carray<int64_t>& sizes_arr, const carray<IdxT>& doc_idx_arr,
                              int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be positive");
  if (num_epochs <= 0) throw std::invalid_argument("num_epochs must be positive");
  if (tokens_per_epoch <= 0) throw std::invalid_argument("tokens_per_epoch must be positive");
  const int64_t* sizes = sizes_arr.data();
  const IdxT* doc_idx = doc_idx_arr.data();
  const int64_t n_docs = sizes_arr.size();
  const int64_t n_pos = doc_idx_arr.size();
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  carray<IdxT> out({num_samples + 1, static_cast<int64_t>(2)});
  IdxT* sample_idx = out.mutable_data();
  {
    py::gil_scoped_release release;
    const int64_t stream = checked_stream_tokens(sizes, n_docs, doc_idx, n_pos);
    if (stream < num_epochs * tokens_per_epoch) {
      throw std::invalid_argument("doc_idx holds " + std::to_string(stream) + " tokens, fewer than num_epochs * tokens_per_epoch = " +
                                  std::to_string(num_epochs * tokens_per_epoch));
    }
    int64_t pos = 0;     // position in doc_idx
    int64_t offset = 0;  // token offset inside document doc_idx[pos]
    sample_idx[0] = 0;
    sample_idx[1] = 0;
    for (int64_t k = 1; k <= num_samples; ++k) {
      // Consecutive samples share one token: walk seq_length + 1 tokens and stop on the last.
      int64_t remaining = seq_length + 1;
      while (remaining != 0) {
        const int64_t doc_length = sizes[doc_idx[pos]] - offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++pos;
          offset = 0;
        }
      }
      sample_idx[2 * k] = static_cast<IdxT>(pos);
      sample_idx[2 * k + 1] = static_cast<IdxT>(offset);
    }
  }
  return out;
}

struct Cursor {
  int64_t pos;     // position in doc_idx (== n_pos once past the end)
  int64_t offset;  // token offset inside document doc_idx[pos]
  int64_t global;  // tokens of the stream before this point
};

// Moves c to the first boundary at or after it (a boundary at a document's end is the next
// document's start, so only offsets < size count).
template <typename IdxT>
void to_boundary(Cursor& c, const int64_t* sizes, const IdxT* doc_idx, int64_t n_pos,
                 const int64_t* bptr, const int64_t* boff) {
  while (c.pos < n_pos) {
    const int64_t d = doc_idx[c.pos];
    const int64_t size = sizes[d];
    const int64_t* first = boff + bptr[d];
    const int64_t* last = boff + bptr[d + 1];
    const int64_t* b = std::lower_bound(first, last, c.offset);
    if (b != last && *b < size) {
      c.global += *b - c.offset;
      c.offset = *b;
      return;
    }
    c.global += size - c.offset;
    ++c.pos;
    c.offset = 0;
  }
}

template <typename IdxT>
carray<IdxT> build_boundary_sample_idx(const carray<int64_t>& sizes_arr, const carray<IdxT>& doc_idx_arr,
                                       int64_t seq_length, const carray<int64_t>& bptr_arr,
                                       const carray<int64_t>& boff_arr) {
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be positive");
  const int64_t n_docs = sizes_arr.size();
  if (bptr_arr.size() != n_docs + 1) {
    throw std::invalid_argument("boundary_ptr must have one entry per document plus one");
  }
  const int64_t* sizes = sizes_arr.data();
  const IdxT* doc_idx = doc_idx_arr.data();
  const int64_t* bptr = bptr_arr.data();
  const int64_t* boff = boff_arr.data();
  const int64_t n_pos = doc_idx_arr.size();
  const int64_t n_boff = boff_arr.size();
  std::vector<IdxT> rows;
  {
    py::gil_scoped_release release;
    if (bptr[0] != 0 || bptr[n_docs] != n_boff) {
      throw std::invalid_argument("boundary_ptr must start at 0 and end at len(boundary_off)");
    }
    for (int64_t d = 0; d < n_docs; ++d) {
      if (bptr[d + 1] < bptr[d]) throw std::invalid_argument("boundary_ptr must be non-decreasing");
      for (int64_t j = bptr[d] + 1; j < bptr[d + 1]; ++j) {
        if (boff[j] < boff[j - 1]) {
          throw std::invalid_argument("boundary offsets of document " + std::to_string(d) + " are not ascending");
        }
      }
    }
    const int64_t total = checked_stream_tokens(sizes, n_docs, doc_idx, n_pos);
    Cursor c{0, 0, 0};
    to_boundary(c, sizes, doc_idx, n_pos, bptr, boff);
    while (c.pos < n_pos && c.global + seq_length + 1 <= total) {
      rows.push_back(static_cast<IdxT>(c.pos));
      rows.push_back(static_cast<IdxT>(c.offset));
      // Walk seq_length tokens: the spanning mode would start the next sample here.
      int64_t need = seq_length;
      for (;;) {
        const int64_t rest = sizes[doc_idx[c.pos]] - c.offset;
        if (need < rest) {
          c.offset += need;
          break;
        }
        need -= rest;
        ++c.pos;
        c.offset = 0;
      }
      c.global += seq_length;
      to_boundary(c, sizes, doc_idx, n_pos, bptr, boff);
    }
    rows.push_back(static_cast<IdxT>(c.pos));
    rows.push_back(static_cast<IdxT>(c.pos < n_pos ? c.offset : 0));
  }
  const int64_t n_rows = static_cast<int64_t>(rows.size() / 2);
  carray<IdxT> out({n_rows, static_cast<int64_t>(2)});
  std::memcpy(out.mutable_data(), rows.data(), rows.size() * sizeof(IdxT));
  return out;
}

std::tuple<carray<uint8_t>, carray<int64_t>> build_blending_indices(const carray<double>& weights_arr, int64_t size) {
  const int64_t n = weights_arr.size();
  if (n < 1 || n > 255) {
    throw std::invalid_argument("blending needs 1 to 255 datasets, got " + std::to_string(n));
  }
  if (size < 0) throw std::invalid_argument("size must be non-negative");
  const double* weights = weights_arr.data();
  for (int64_t d = 0; d < n; ++d) {
    if (!std::isfinite(weights[d]) || weights[d] < 0) {
      throw std::invalid_argument("weight " + std::to_string(d) + " is not a finite non-negative number");
    }
  }
  carray<uint8_t> dataset_index(size);
  carray<int64_t> dataset_sample_index(size);
  uint8_t* di = dataset_index.mutable_data();
  int64_t* dsi = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> taken(n, 0);
    for (int64_t i = 0; i < size; ++i) {
      const double x = std::max(static_cast<double>(i), 1.0);
      int64_t best = 0;
      double best_error = weights[0] * x - static_cast<double>(taken[0]);
      for (int64_t d = 1; d < n; ++d) {
        const double error = weights[d] * x - static_cast<double>(taken[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      di[i] = static_cast<uint8_t>(best);
      dsi[i] = taken[best];
      ++taken[best];
    }
  }
  return std::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "megatron_ru dataset index helpers (see csrc/helpers.cpp for the contracts)";
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  m.def("build_boundary_sample_idx_int32", &build_boundary_sample_idx<int32_t>, py::arg("sizes"),
        py::arg("doc_idx"), py::arg("seq_length"), py::arg("boundary_ptr"), py::arg("boundary_off"));
  m.def("build_boundary_sample_idx_int64", &build_boundary_sample_idx<int64_t>, py::arg("sizes"),
        py::arg("doc_idx"), py::arg("seq_length"), py::arg("boundary_ptr"), py::arg("boundary_off"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
}
