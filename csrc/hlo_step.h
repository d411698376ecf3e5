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

// The call's result: our shapes with the element types the body declares.
inline Shape body_result(const Signature& sig) {
  std::vector<Shape> parts = sig.carry;
  for (const Shape& y : sig.ys) parts.push_back(drop_lead(y));
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

// What one body call made, in the torch dtypes: the new carry and this step's ys.
struct StepResult {
  std::vector<int64_t> carry, ys;
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
  return r;
}

}  // namespace hlo
