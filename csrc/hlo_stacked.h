// The stacked ys of the While (hlo_scan.cc): how each y lives in the loop state, which rows a
// block or a carried y writes, and a row's write.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hlo_proto.h"
#include "hlo_signature.h"

namespace hlo {

// XLA CPU (torch_xla 2.9) emits a FUSED dynamic-update-slice with its loop
// fusion emitter, which writes every element of the output: a y row written
// into the [length, ...] buffer by a dus fused with the row's producer costs
// O(length) per step, O(length^2) per scan. A dus whose operands are all
// get-tuple-elements of the loop state stays unfused and is emitted in place.
// So each y has a pending block in the loop state: the rows the previous
// iteration made ([unroll, ...], in buffer order) and the first row where they
// go. An iteration first writes the pending block, from the state, then makes
// its own rows and leaves them pending; after each While the entry writes the
// last block. The first iteration's pending block goes where its own rows will
// go, which overwrite it, so its value is never read (hlo_scan.cc's first_block).
// The buffer keeps the y's own shape and a block is placed by its first row (the
// step's own index): a flat buffer took a multiply for the offset and a reshape
// out, which XLA fused with the last block's write into a loop over the whole
// buffer; each is one more kernel for XLA CPU to compile, and a small scan's
// compile is mostly its kernels'.
// The delay costs two copies of a row per step. Where rows are big and few
// (layer stacks: a [1024, 256] row, 64 steps) the fused write costs less: its
// loop skips each other row with one test, so a y whose row has at least
// 4 * length elements is written at once, in its [length, ...] buffer.
inline int64_t per_step(const Shape& y) {
  int64_t n = 1;
  for (size_t i = 1; i < y.dims.size(); ++i) n *= y.dims[i];
  return n;
}
// `rows` rows of y ([length, ...] -> [rows, ...]).
inline Shape as_rows(const Shape& y, int64_t rows) {
  Shape block = y;
  block.dims[0] = rows;
  return block;
}
inline bool delayed(const Signature& sig, size_t k) { return per_step(sig.ys[k]) < 4 * sig.length; }
// Where a block of ys[k] starting at row `row` (a value) goes: row, 0, ..., 0.
inline std::vector<int64_t> block_at(Computation& c, const Signature& sig, size_t k, int64_t row, const std::string& p) {
  std::vector<int64_t> at{row};
  at.insert(at.end(), sig.ys[k].dims.size() - 1, c.constant_s64(p + "zero" + std::to_string(k), 0));
  return at;
}

// The first buffer row of the block iteration `counter` (a value) of seg writes.
inline int64_t block_row(Computation& c, const Signature& sig, const Segment& seg, int64_t counter, const std::string& p) {
  if (sig.reverse) return c.subtract(p + "block_row", c.constant_s64(p + "block_last", seg.stop - seg.unroll), counter);
  return c.add(p + "block_row", c.constant_s64(p + "block_first", seg.start), counter);
}

// A y that is its step's carry input (a layer stack saves each layer's input for the backward) is
// written from the step's carry OUTPUT into the next step's row, in the order the steps run, wrapping
// around; the entry then writes the first step's row from the initial carry (the wrapped write put the
// final carry there). Written from the input, its row write read the old carry after the body had
// made the new one, so XLA copied the carry (a whole row) in every iteration to keep it.
inline bool carried(const Signature& sig, size_t k) {
  return !sig.y_carry.empty() && sig.y_carry[k] >= 0 && !delayed(sig, k);
}

// The row of the step that runs after step idx (wrapping from the last step to the first).
inline int64_t next_row(Computation& c, const Signature& sig, int64_t idx, const std::string& p) {
  int64_t shift = c.constant_s64(p + "shift", sig.reverse ? sig.length - 1 : 1);
  return c.emit(p + "next_row", "remainder", scalar(kS64),
                {c.add(p + "shifted", idx, shift), c.constant_s64(p + "length", sig.length)});
}

// Writes v (one step's value) into row `row` of the [length, ...] buffer ys[k].
inline int64_t write_row(Computation& c, const Signature& sig, size_t k, int64_t ys, int64_t v, int64_t row,
                  const std::string& p) {
  std::string name = p + "y" + std::to_string(k);
  int64_t zero = c.constant_s64(name + "_zero", 0);
  std::vector<int64_t> at{ys, c.emit(name + "_row", "reshape", with_lead_one(drop_lead(sig.ys[k])), {v}), row};
  at.insert(at.end(), sig.ys[k].dims.size() - 1, zero);
  return c.emit(p + "ys" + std::to_string(k), "dynamic-update-slice", sig.ys[k], at);
}

}  // namespace hlo
