// The loop signature Python gives build_scan_module (see hlo_scan.cc) and its
// validation: what the module is built from, checked before anything is built
// so that a wrong call is a Python ValueError, not a malformed module.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hlo_proto.h"

namespace hlo {

enum Kind { kCarry = 0, kX = 1, kPass = 2 };  // what feeds a body parameter

struct Segment {
  int64_t start, stop, unroll;
};

struct Signature {
  int64_t length = 0;
  bool reverse = false;
  std::vector<Segment> segments;
  std::vector<Shape> carry, xs, ys, pass;
  std::vector<std::pair<int, int>> body_params;  // body parameter i <- (kind, index)
  std::vector<int64_t> y_carry;  // per y: the carry it is (its step's carry input, unchanged), or -1
  // per carry: the dim whose row the body writes (it returns the carry input unchanged and, after
  // its ys, the row and its index: hlo_step.h's "row writes"), or -1
  std::vector<int64_t> carry_rows;
  // per row written per step, in the order the body writes them: its carry (a carry whose rows the
  // body writes has one entry or more: xla/row_writes.py's row writes)
  std::vector<int64_t> row_carries;
  int64_t body_id = -1;
  std::vector<int> body_param_types, body_result_types;  // as the body's HLO declares them
};

// Whether carry k's rows are written by the loop (see carry_rows).
inline bool row_written(const Signature& sig, size_t k) { return !sig.carry_rows.empty() && sig.carry_rows[k] >= 0; }

// How many rows the loop writes per step (see row_carries).
inline size_t num_row_writes(const Signature& sig) { return sig.row_carries.size(); }

// row_carries when the caller gave none: one row per carry whose rows are written, in carry order.
inline void default_row_carries(Signature& sig) {
  if (!sig.row_carries.empty()) return;
  for (size_t k = 0; k < sig.carry_rows.size(); ++k)
    if (row_written(sig, k)) sig.row_carries.push_back(int64_t(k));
}

inline void check_signature(const Signature& sig) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("build_scan_module: " + what); };
  for (const Shape& x : sig.xs)
    if (x.dims.empty() || x.dims[0] != sig.length) fail("every xs shape needs the leading length dim");
  for (const Shape& y : sig.ys)
    if (y.dims.empty() || y.dims[0] != sig.length) fail("every ys shape needs the leading length dim");
  for (const Segment& seg : sig.segments) {
    if (seg.start < 0 || seg.stop > sig.length || seg.start >= seg.stop) fail("segment outside [0, length)");
    if (seg.unroll < 1 || (seg.stop - seg.start) % seg.unroll) fail("segment length is not a multiple of its unroll");
  }
  if (!sig.y_carry.empty() && sig.y_carry.size() != sig.ys.size()) fail("y_carry needs one entry per y");
  for (size_t k = 0; k < sig.y_carry.size(); ++k) {
    int64_t i = sig.y_carry[k];
    if (i < 0) continue;
    const Shape& y = sig.ys[k];
    if (i >= int64_t(sig.carry.size()) || sig.carry[i].etype != y.etype ||
        std::vector<int64_t>(y.dims.begin() + 1, y.dims.end()) != sig.carry[i].dims)
      fail("y_carry pairs a y with a carry of another shape");
  }
  if (!sig.carry_rows.empty() && sig.carry_rows.size() != sig.carry.size()) fail("carry_rows needs one entry per carry");
  for (size_t k = 0; k < sig.carry_rows.size(); ++k)
    if (sig.carry_rows[k] >= int64_t(sig.carry[k].dims.size())) fail("carry_rows names a dim the carry does not have");
  for (int64_t k : sig.row_carries)
    if (k < 0 || k >= int64_t(sig.carry.size()) || !row_written(sig, size_t(k))) fail("row_carries names a carry without rows");
  for (auto [kind, i] : sig.body_params) {
    size_t n = kind == kCarry ? sig.carry.size() : kind == kX ? sig.xs.size() : kind == kPass ? sig.pass.size() : 0;
    if (i < 0 || size_t(i) >= n) fail("body parameter source (" + std::to_string(kind) + ", " + std::to_string(i) + ") out of range");
  }
}

}  // namespace hlo
