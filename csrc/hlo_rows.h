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
// per step, as for the stacked ys (hlo_scan.cc). So the row is written one iteration late, as the ys'
// blocks are: the iteration first writes the pending row from the state (a lone, in-place
// update), BEFORE its body calls, which then read the buffer as the loop has it. The first
// iteration's pending row is the carry's own row 0, written back unchanged; the entry writes
// the last one after each While.
inline void write_pending_rows(Computation& c, const Signature& sig, std::vector<int64_t>& carry,
                               const std::vector<int64_t>& rows, const std::vector<int64_t>& idx, const std::string& p) {
  for (size_t k = 0; k < carry.size(); ++k)
    if (row_written(sig, k)) carry[k] = write_row_of(c, sig, k, carry[k], rows[k], idx[k], p + "row" + std::to_string(k));
}

// Before a While: each written carry's row 0 and index 0 as its pending row (writing it back
// changes nothing).
inline void first_pending_rows(Computation& e, const Signature& sig, const std::vector<int64_t>& carry,
                               std::vector<int64_t>& rows, std::vector<int64_t>& idx, const std::string& p) {
  rows.assign(sig.carry.size(), -1), idx.assign(sig.carry.size(), -1);
  for (size_t k = 0; k < sig.carry.size(); ++k) {
    if (!row_written(sig, k)) continue;
    std::string name = p + "first_row" + std::to_string(k);
    Shape slot = row_slot(sig, k);
    int64_t zero = e.constant_s64(name + "_zero", 0);
    std::vector<int64_t> at{carry[k]};
    at.insert(at.end(), slot.dims.size(), zero);
    rows[k] = e.emit(name, "dynamic-slice", slot, at, [&](Msg& m) { m.packed(kHloInstructionDynamicSliceSizes, slot.dims); });
    idx[k] = zero;
  }
}

}  // namespace hlo
