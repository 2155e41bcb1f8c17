// C++ helpers for the data pipeline (pybind11 module megatron_ru.data._helpers).
// The hot loops of dataset index building live here; megatron_ru/data/helpers_ref.py is the
// pure-numpy reference the tests compare against.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>

namespace py = pybind11;

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "megatron_ru dataset index helpers";
}
