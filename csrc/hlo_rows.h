// Written rows: a carry the body writes one row of per step, written by the While one iteration
// late (see below). The body's side is Python's torch_scan_hop/xla/row_writes.py; one call's rows
// and their immediate write are hlo_step.h's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hlo_proto.h"
#include "hlo_signature.h"
#include "hlo_step.h"

namespace hlo {

// A carry the body writes one row of per step (``buf[t] = h``; the body returns the carry input
// unchanged and the row and its index after its ys, Python's xla/row_writes.py) would be a
// dynamic-update-slice fused with the row's producer, which writes the whole carry: O(length)
// per step, as for the stacked ys (hlo_stacked.h). So the row is written one iteration late, as the ys'
// blocks are: the iteration first writes the pending row from the state (a lone, in-place
// update), BEFORE its body calls, which then read the buffer as the loop has it. The first
// iteration's pending row is the carry's own row 0, written back unchanged; the entry writes
// the last one after each While.
// A carry whose rows of a later dim are written (buf[:, t] = h) is held by the While's state with
// that dim first: its row (f32[B,1,H]) held as such got another layout from XLA's layout assignment
// than the buffer's (the unit dim moved, the same bytes) and the copy back was fused into the update,
// which then wrote the whole buffer every step. Held transposed (f32[T,B,H]), a row is a slice of
// the first dim, as for buf[t] = h, and its update a lone in-place one; the body's own read of the
// buffer (when it has one) is a transpose back, the entry's one transpose each way per scan.
inline bool held_transposed(const Signature& sig, size_t k) { return row_written(sig, k) && sig.carry_rows[k] > 0; }

// The permutation (HLO transpose's dimensions) that puts carry k's written dim first.
inline std::vector<int64_t> held_order(const Signature& sig, size_t k) {
  std::vector<int64_t> perm{sig.carry_rows[k]};
  for (int64_t i = 0; i < int64_t(sig.carry[k].dims.size()); ++i)
    if (i != sig.carry_rows[k]) perm.push_back(i);
  return perm;
}

inline Shape permuted(const Shape& s, const std::vector<int64_t>& perm) {
  Shape out = s;
  for (size_t i = 0; i < perm.size(); ++i) out.dims[i] = s.dims[size_t(perm[i])];
  return out;
}

// Carry k as the While's state holds it, and one written row of it (its written dim first).
inline Shape held_carry(const Signature& sig, size_t k) {
  return held_transposed(sig, k) ? permuted(sig.carry[k], held_order(sig, k)) : sig.carry[k];
}
inline Shape held_row(const Signature& sig, size_t k) {
  return held_transposed(sig, k) ? permuted(row_slot(sig, k), held_order(sig, k)) : row_slot(sig, k);
}

// v (carry k, or its row when `row`) from torch's dim order to the held one (`back`: the other way).
inline int64_t transposed(Computation& c, const Signature& sig, size_t k, int64_t v, bool row, bool back,
                          const std::string& label) {
  if (!held_transposed(sig, k)) return v;
  std::vector<int64_t> perm = held_order(sig, k);
  Shape shape = row ? held_row(sig, k) : held_carry(sig, k);
  if (back) {
    std::vector<int64_t> inv(perm.size());
    for (size_t i = 0; i < perm.size(); ++i) inv[size_t(perm[i])] = int64_t(i);
    perm = inv, shape = row ? row_slot(sig, k) : sig.carry[k];
  }
  return c.emit(label + (back ? "_back" : "_held"), "transpose", shape, {v},
                [&](Msg& m) { m.packed(kHloInstructionDimensions, perm); });
}

// Held carry k (a value) with the held row `row` written at index idx (values) of its first dim.
inline int64_t write_held_row(Computation& c, const Signature& sig, size_t k, int64_t buf, int64_t row, int64_t idx,
                              const std::string& label) {
  int64_t zero = c.constant_s64(label + "_zero", 0);
  std::vector<int64_t> at{buf, row, idx};
  at.insert(at.end(), sig.carry[k].dims.size() - 1, zero);
  return c.emit(label, "dynamic-update-slice", held_carry(sig, k), at);
}

// The held carries in torch's dim order, for a body call (a carry held transposed is dead code
// there unless the body reads it).
inline std::vector<int64_t> unheld_carries(Computation& c, const Signature& sig, const std::vector<int64_t>& carry,
                                           const std::string& p) {
  std::vector<int64_t> out = carry;
  for (size_t k = 0; k < out.size(); ++k) out[k] = transposed(c, sig, k, carry[k], false, true, p + "carry" + std::to_string(k));
  return out;
}

// After a body call: the carries it made, but a written carry's, whose output is its input
// (xla/row_writes.py): the held one stays, its rows written at once (`now`: a call of an iteration
// before its last) or left pending.
inline void next_held_carries(Computation& c, const Signature& sig, const StepResult& step, bool now,
                              std::vector<int64_t>& carry, std::vector<int64_t>& rows, std::vector<int64_t>& idx,
                              const std::string& p) {
  for (size_t k = 0; k < carry.size(); ++k)
    if (!row_written(sig, k)) carry[k] = step.carry[k];
  for (size_t w = 0; w < sig.row_carries.size(); ++w) {
    size_t k = size_t(sig.row_carries[w]);
    int64_t row = transposed(c, sig, k, step.rows[w], true, false, p + "row" + std::to_string(w));
    if (now)
      carry[k] = write_held_row(c, sig, k, carry[k], row, step.row_idx[w], p + "wrote" + std::to_string(w));
    else
      rows[w] = row, idx[w] = step.row_idx[w];
  }
}

// The pending rows written into the held carries (see above).
inline void write_pending_rows(Computation& c, const Signature& sig, std::vector<int64_t>& carry,
                               const std::vector<int64_t>& rows, const std::vector<int64_t>& idx, const std::string& p) {
  for (size_t w = 0; w < sig.row_carries.size(); ++w) {
    size_t k = size_t(sig.row_carries[w]);
    carry[k] = write_held_row(c, sig, k, carry[k], rows[w], idx[w], p + "row" + std::to_string(w));
  }
}

// Before a While: each written carry's row 0 and index 0 as its pending row (writing it back
// changes nothing); `carry`: held.
inline void first_pending_rows(Computation& e, const Signature& sig, const std::vector<int64_t>& carry,
                               std::vector<int64_t>& rows, std::vector<int64_t>& idx, const std::string& p) {
  rows.assign(sig.row_carries.size(), -1), idx.assign(sig.row_carries.size(), -1);
  for (size_t w = 0; w < sig.row_carries.size(); ++w) {
    size_t k = size_t(sig.row_carries[w]);
    std::string name = p + "first_row" + std::to_string(w);
    Shape slot = held_row(sig, k);
    int64_t zero = e.constant_s64(name + "_zero", 0);
    std::vector<int64_t> at{carry[k]};
    at.insert(at.end(), slot.dims.size(), zero);
    rows[w] = e.emit(name, "dynamic-slice", slot, at, [&](Msg& m) { m.packed(kHloInstructionDynamicSliceSizes, slot.dims); });
    idx[w] = zero;
  }
}

}  // namespace hlo
