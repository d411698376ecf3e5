// Python sequences to the builder's values (CPython C API only): what
// hlo_scan.cc's entry point parses its arguments with. Each throws
// std::invalid_argument on a malformed value (the caller turns it into a
// Python ValueError) and releases what it borrowed.
#pragma once

#include <Python.h>

#include <stdexcept>
#include <vector>

#include "hlo_proto.h"

namespace hlo {

Shape shape_from_py(PyObject* obj) {
  int etype;
  PyObject* dims;
  if (!PyArg_ParseTuple(obj, "iO", &etype, &dims)) throw std::invalid_argument("shape must be (element_type, dims)");
  Shape s{etype, {}, {}};
  PyObject* seq = PySequence_Fast(dims, "dims must be a sequence");
  if (!seq) throw std::invalid_argument("dims must be a sequence");
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i)
    s.dims.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i)));
  Py_DECREF(seq);
  return s;
}

template <class T, class F> std::vector<T> list_from_py(PyObject* obj, F convert) {
  std::vector<T> out;
  PyObject* seq = PySequence_Fast(obj, "expected a sequence");
  if (!seq) throw std::invalid_argument("expected a sequence");
  try {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) out.push_back(convert(PySequence_Fast_GET_ITEM(seq, i)));
  } catch (...) {
    Py_DECREF(seq);
    throw;
  }
  Py_DECREF(seq);
  return out;
}

}  // namespace hlo
