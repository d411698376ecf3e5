// A scan whose one iteration runs every step (unroll == length) as straight-line
// code in the entry, no While: step i calls the body on row i of each x (a slice
// at a constant index) and each y is the concatenation of its rows.
//
// Why: in a While, the ys are [length, ...] buffers in the loop state. XLA CPU
// has no uninitialized buffer, so each starts as a broadcast that writes all of
// it; each row is then written into it, and a backward scan reading a saved row
// copies it out again (a dot cannot read a dynamic slice in place). Straight-line,
// the backward's slice of the forward's concatenation is the row itself, which
// XLA forwards: nothing is filled, stacked or copied, and XLA sees forward and
// backward steps in one computation (it computes GELU's erf once for both, as in
// the Python loop's graph). A layer stack of Linear + GELU, 8 deep, then costs on
// the device what the loop does (docs/benchmarks.md); the price is compile time
// that grows with the length, as the loop's does: scan_layers picks it by default
// on XLA for short stacks only (layers/scan_layers.py, _resolve_unroll), scan never.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hlo_proto.h"
#include "hlo_signature.h"
#include "hlo_step.h"

namespace hlo {

// One segment whose single iteration runs every step.
inline bool straight(const Signature& sig) {
  return sig.segments.size() == 1 && sig.segments[0].start == 0 && sig.segments[0].stop == sig.length &&
         sig.segments[0].unroll == sig.length;
}

// Fills e (the module's entry): entry(carry..., xs..., pass...) -> (carry..., ys...).
// No ys parameters: each y is made whole, so the caller makes no [length, ...] buffer
// to pass (on XLA each would be a graph op per call, host time the loop does not pay).
inline void build_straight_entry(Computation& e, const Signature& sig) {
  std::vector<int64_t> carry, xs, pass;
  auto params = [&](const char* name, const std::vector<Shape>& shapes, std::vector<int64_t>& out) {
    for (size_t i = 0; i < shapes.size(); ++i) out.push_back(e.param(name + std::to_string(i), shapes[i]));
  };
  params("carry", sig.carry, carry);
  params("xs", sig.xs, xs);
  params("pass", sig.pass, pass);
  std::vector<std::vector<int64_t>> rows(sig.ys.size(), std::vector<int64_t>(sig.length, -1));
  for (int64_t j = 0; j < sig.length; ++j) {
    int64_t idx = sig.reverse ? sig.length - 1 - j : j;
    std::string p = "s" + std::to_string(idx) + "_";
    StepResult step = call_body(e, sig, carry, xs, pass, e.constant_s64(p + "idx", idx), p);
    write_rows(e, sig, step, p);
    carry = step.carry;
    for (size_t k = 0; k < sig.ys.size(); ++k)
      rows[k][idx] = e.emit(p + "y" + std::to_string(k) + "_row", "reshape", with_lead_one(drop_lead(sig.ys[k])),
                            {step.ys[k]});
  }
  std::vector<int64_t> outs(carry);
  for (size_t k = 0; k < sig.ys.size(); ++k)
    outs.push_back(e.emit("ys" + std::to_string(k), "concatenate", sig.ys[k], rows[k],
                          [](Msg& m) { m.packed(kHloInstructionDimensions, {0}); }));
  std::vector<Shape> out_shapes(sig.carry);
  out_shapes.insert(out_shapes.end(), sig.ys.begin(), sig.ys.end());
  Shape result = tuple_of(out_shapes);
  e.finish(e.emit("result", "tuple", result, outs), result);
}

}  // namespace hlo
