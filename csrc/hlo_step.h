// One call of the body computation inside the scan module: what both the While's
// loop body (hlo_scan.cc) and the straight-line entry (hlo_straight.h) emit per step.
// Operands come from the carry, one row of each x and the pass-through inputs; where
// the body's HLO declares another element type than the torch dtype of a value, the
// call converts on the way in and out (torch_xla lowers native_dropout's bool mask
// as f32, say): the loop state keeps the torch dtype, the call the body's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hlo_proto.h"
#include "hlo_signature.h"

namespace hlo {

// Carry k with its written dim of size 1: one row written by the body (see carry_rows).
inline Shape row_slot(const Signature& sig, size_t k) {
  Shape slot = sig.carry[k];
  slot.dims[size_t(sig.carry_rows[k])] = 1;
  return slot;
}

// The call's result: our shapes with the element types the body declares; after the ys, a
// (row, index) pair per row the body writes (row_carries).
inline Shape body_result(const Signature& sig) {
  std::vector<Shape> parts = sig.carry;
  for (const Shape& y : sig.ys) parts.push_back(drop_lead(y));
  for (int64_t k : sig.row_carries) parts.push_back(row_slot(sig, size_t(k))), parts.push_back(scalar(kS64));
  for (size_t i = 0; i < parts.size(); ++i) parts[i].etype = sig.body_result_types[i];
  return tuple_of(parts);
}

// v (of shape `shape`) as element type etype.
inline int64_t as_type(Computation& c, int64_t v, Shape shape, int etype, const std::string& label) {
  if (shape.etype == etype) return v;
  shape.etype = etype;
  return c.emit(label + "_as", "convert", shape, {v});
}

// Row idx (a value) of the stacked x `xs` (shape `full`), without its lead dim.
inline int64_t slice_x(Computation& c, const Shape& full, int64_t xs, int64_t idx, int64_t zero,
                       const std::string& label) {
  std::vector<int64_t> starts{xs, idx};
  starts.insert(starts.end(), full.dims.size() - 1, zero);
  Shape one = with_lead_one(drop_lead(full));
  int64_t sl = c.emit(label + "_row", "dynamic-slice", one, starts,
                      [&](Msg& m) { m.packed(kHloInstructionDynamicSliceSizes, one.dims); });
  return c.emit(label, "reshape", drop_lead(full), {sl});
}

// What one body call made, in the torch dtypes: the new carry and this step's ys; per row the
// body writes (row_carries), that row and its index: the new carry is the input with its rows
// written in that order (write_rows), which the While may do one iteration late.
struct StepResult {
  std::vector<int64_t> carry, ys, rows, row_idx;
};

// The body called at step index idx (a value) on `carry`, the rows idx of `xs` and `pass`.
inline StepResult call_body(Computation& c, const Signature& sig, const std::vector<int64_t>& carry,
                            const std::vector<int64_t>& xs, const std::vector<int64_t>& pass, int64_t idx,
                            const std::string& p) {
  int64_t zero = c.constant_s64(p + "zero", 0);
  std::vector<int64_t> operands;
  for (size_t n = 0; n < sig.body_params.size(); ++n) {
    auto [kind, i] = sig.body_params[n];
    int64_t v = -1;
    Shape shape;
    if (kind == kCarry) v = carry[i], shape = sig.carry[i];
    if (kind == kPass) v = pass[i], shape = sig.pass[i];
    if (kind == kX) v = slice_x(c, sig.xs[i], xs[i], idx, zero, p + "x" + std::to_string(i)), shape = drop_lead(sig.xs[i]);
    operands.push_back(as_type(c, v, shape, sig.body_param_types[n], p + "arg" + std::to_string(n)));
  }
  Shape result = body_result(sig);
  int64_t out = c.call(p + "body", result, operands, {sig.body_id});
  StepResult r;
  for (size_t i = 0; i < carry.size(); ++i) {
    std::string name = p + "carry" + std::to_string(i);
    r.carry.push_back(as_type(c, c.gte(name, out, result.tuple[i], int(i)), result.tuple[i], sig.carry[i].etype, name));
  }
  for (size_t k = 0; k < sig.ys.size(); ++k) {
    std::string name = p + "y" + std::to_string(k);
    const Shape& part = result.tuple[carry.size() + k];
    r.ys.push_back(as_type(c, c.gte(name, out, part, int(carry.size() + k)), part, sig.ys[k].etype, name));
  }
  int index = int(carry.size() + sig.ys.size());
  for (size_t w = 0; w < sig.row_carries.size(); ++w) {
    std::string name = p + "row" + std::to_string(w);
    const Shape& part = result.tuple[size_t(index)];
    r.rows.push_back(as_type(c, c.gte(name, out, part, index), part, sig.carry[size_t(sig.row_carries[w])].etype, name));
    r.row_idx.push_back(c.gte(name + "_idx", out, scalar(kS64), index + 1));
    index += 2;
  }
  return r;
}

// Carry k (a value) with `row` written at index `idx` (values) of its written dim.
inline int64_t write_row_of(Computation& c, const Signature& sig, size_t k, int64_t buf, int64_t row, int64_t idx,
                            const std::string& label) {
  int64_t zero = c.constant_s64(label + "_zero", 0);
  std::vector<int64_t> at{buf, row};
  for (size_t d = 0; d < sig.carry[k].dims.size(); ++d) at.push_back(int64_t(d) == sig.carry_rows[k] ? idx : zero);
  return c.emit(label, "dynamic-update-slice", sig.carry[k], at);
}

// The step's rows written into its new carry at once (the straight-line entry, and the calls of an
// unrolled iteration before its last).
inline void write_rows(Computation& c, const Signature& sig, StepResult& step, const std::string& p) {
  for (size_t w = 0; w < sig.row_carries.size(); ++w) {
    size_t k = size_t(sig.row_carries[w]);
    step.carry[k] = write_row_of(c, sig, k, step.carry[k], step.rows[w], step.row_idx[w], p + "wrote" + std::to_string(w));
  }
}

}  // namespace hlo
