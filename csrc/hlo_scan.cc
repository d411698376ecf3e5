// Builds the HloModuleProto of a whole scan around the body's HloModuleProto.
//
// Python gives the body module (LoweringContext.hlo()), the loop signature and
// the schedule (torch_scan_hop/core/schedule.py: segments in execution order, each
// [start, stop) run as iterations of `unroll` body calls). We return
//
//   entry(carry..., xs..., ys..., pass...):
//     state = (counter=0, carry..., xs..., ys..., pass..., pending blocks, their rows,
//              pending rows, their indices)
//     for each segment:                    one While per segment
//       state = while counter < stop - start:
//                 write the pending blocks and rows; `unroll` body calls; their ys and the
//                 last call's written rows are the new pending blocks and rows
//       write the pending blocks and rows; counter = 0
//     return (carry..., ys...)
//
// Body call j of an iteration reads step index start + (counter + j), or
// stop - 1 - (counter + j) when reversed: it dynamic-slices each x there and
// calls the body computation. Its ys reach the stacked buffers one iteration
// late, so that each write is a lone, in-place dynamic-update-slice whatever
// the length ("stacked ys" below). A y that is the step's carry input is
// written from the step's carry output into the next step's row ("carried").
// One body call, shared with the straight-line form, is hlo_step.h. A scan whose
// one iteration runs every step (unroll == length) has no While at all: its
// entry is the steps in a row (hlo_straight.h).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <string>
#include <vector>

#include "hlo_proto.h"
#include "hlo_py.h"
#include "hlo_signature.h"
#include "hlo_stacked.h"
#include "hlo_rows.h"
#include "hlo_step.h"
#include "hlo_straight.h"

namespace {

using namespace hlo;

// ---------------------------------------------------------------- loop state
// (counter, carry..., xs..., ys..., pass..., pending blocks..., their offsets...): a block and
// an offset for each delayed y (a y written at once has -1 in State's blocks and offsets).
std::vector<Shape> state_parts(const Signature& sig, int64_t unroll) {
  std::vector<Shape> parts{scalar(kS64)};
  for (size_t k = 0; k < sig.carry.size(); ++k) parts.push_back(held_carry(sig, k));
  parts.insert(parts.end(), sig.xs.begin(), sig.xs.end());
  parts.insert(parts.end(), sig.ys.begin(), sig.ys.end());
  parts.insert(parts.end(), sig.pass.begin(), sig.pass.end());
  for (size_t k = 0; k < sig.ys.size(); ++k)
    if (delayed(sig, k)) parts.push_back(as_rows(sig.ys[k], unroll));
  for (size_t k = 0; k < sig.ys.size(); ++k)
    if (delayed(sig, k)) parts.push_back(scalar(kS64));
  for (int64_t k : sig.row_carries) parts.push_back(held_row(sig, size_t(k)));
  for (size_t w = 0; w < sig.row_carries.size(); ++w) parts.push_back(scalar(kS64));
  return parts;
}

struct State {
  int64_t counter = -1;
  std::vector<int64_t> carry, xs, ys, pass, blocks, offsets, rows, row_idx;
};

// What to read back from a loop state: all of it (inside a loop), all but the
// counter (between Whiles, where the next segment restarts it), or only the
// results (after the last While). Unread parts get no dead instruction.
enum Reads { kAll, kNoCounter, kResults };

State unpack(Computation& c, int64_t tuple, const Signature& sig, int64_t unroll, Reads reads = kAll,
             const std::string& p = "") {
  State s;
  std::vector<Shape> parts = state_parts(sig, unroll);
  int index = 0;
  auto group = [&](const char* name, size_t n, std::vector<int64_t>& out, bool wanted, bool per_y = false,
                   bool per_carry = false) {
    for (size_t i = 0; i < n; ++i) {
      if ((per_y && !delayed(sig, i)) || (per_carry && !row_written(sig, i))) {
        out.push_back(-1);
        continue;
      }
      out.push_back(wanted ? c.gte(p + name + std::to_string(i), tuple, parts[index], index) : int64_t(-1));
      ++index;
    }
  };
  s.counter = reads == kAll ? c.gte(p + "counter", tuple, parts[0], 0) : int64_t(-1);
  index = 1;
  group("carry", sig.carry.size(), s.carry, true);
  group("xs", sig.xs.size(), s.xs, reads != kResults);
  group("ys", sig.ys.size(), s.ys, true);
  group("pass", sig.pass.size(), s.pass, reads != kResults);
  group("block", sig.ys.size(), s.blocks, true, true);
  group("offset", sig.ys.size(), s.offsets, true, true);
  group("pending_row", sig.row_carries.size(), s.rows, true);
  group("pending_idx", sig.row_carries.size(), s.row_idx, true);
  return s;
}

int64_t pack(Computation& c, const std::string& label, const State& s, const Signature& sig, int64_t unroll) {
  std::vector<int64_t> parts{s.counter};
  for (auto* group : {&s.carry, &s.xs, &s.ys, &s.pass, &s.blocks, &s.offsets, &s.rows, &s.row_idx})
    for (int64_t v : *group)
      if (v != -1) parts.push_back(v);  // -1: the block and offset of a y written at once, a carry's unwritten row
  return c.emit(label, "tuple", tuple_of(state_parts(sig, unroll)), parts);
}

// Writes each pending block into its ys buffer.
void write_blocks(Computation& c, const Signature& sig, State& s, const std::string& p) {
  for (size_t k = 0; k < s.ys.size(); ++k)
    if (delayed(sig, k)) {
      std::vector<int64_t> operands{s.ys[k], s.blocks[k]};
      for (int64_t v : block_at(c, sig, k, s.offsets[k], p)) operands.push_back(v);
      s.ys[k] = c.emit(p + "ys" + std::to_string(k), "dynamic-update-slice", sig.ys[k], operands);
    }
}

// ---------------------------------------------------------------- one body call
int64_t step_index(Computation& c, const Signature& sig, const Segment& seg, int64_t counter, int64_t j,
                   const std::string& p) {
  int64_t pos = j ? c.add(p + "pos", counter, c.constant_s64(p + "offset", j)) : counter;
  if (sig.reverse) return c.subtract(p + "idx", c.constant_s64(p + "last", seg.stop - 1), pos);
  return c.add(p + "idx", c.constant_s64(p + "start", seg.start), pos);
}

// Body call j of the current iteration; updates s.carry and appends each y, as one row, to rows[k]. The
// last call's written carry rows are left pending (s.rows), the others' written at once.
void emit_step(Computation& c, const Signature& sig, const Segment& seg, int64_t j, State& s,
               std::vector<std::vector<int64_t>>& rows) {
  std::string p = "s" + std::to_string(j) + "_";
  int64_t idx = step_index(c, sig, seg, s.counter, j, p);
  StepResult step = call_body(c, sig, unheld_carries(c, sig, s.carry, p), s.xs, s.pass, idx, p);
  next_held_carries(c, sig, step, j + 1 < seg.unroll, s.carry, s.rows, s.row_idx, p);
  for (size_t k = 0; k < s.ys.size(); ++k) {
    std::string name = p + "y" + std::to_string(k);
    int64_t y = step.ys[k];
    if (delayed(sig, k)) {
      rows[k].push_back(c.emit(name + "_row", "reshape", as_rows(sig.ys[k], 1), {y}));
      continue;
    }
    if (carried(sig, k)) {
      size_t i = size_t(sig.y_carry[k]);
      int64_t carry = transposed(c, sig, i, s.carry[i], false, true, name + "_carry");
      s.ys[k] = write_row(c, sig, k, s.ys[k], carry, next_row(c, sig, idx, name + "_"), p);
    }
    else
      s.ys[k] = write_row(c, sig, k, s.ys[k], y, idx, p);
  }
}

// ---------------------------------------------------------------- one segment
int64_t build_cond(Module& mod, const Signature& sig, const Segment& seg, int n) {
  Computation c(&mod, "scan_cond" + std::to_string(n));
  int64_t state = c.param("state", tuple_of(state_parts(sig, seg.unroll)));
  int64_t counter = c.gte("counter", state, scalar(kS64), 0);
  int64_t steps = c.constant_s64("steps", seg.stop - seg.start);
  int64_t more = c.emit("more", "compare", scalar(kPred), {counter, steps},
                        [](Msg& m) { m.bytes(kHloInstructionComparisonDirection, "LT"); });
  return c.finish(more, scalar(kPred));
}

int64_t build_loop_body(Module& mod, const Signature& sig, const Segment& seg, int n) {
  Computation c(&mod, "scan_loop" + std::to_string(n));
  Shape state = tuple_of(state_parts(sig, seg.unroll));
  State s = unpack(c, c.param("state", state), sig, seg.unroll);
  write_blocks(c, sig, s, "pending_");
  write_pending_rows(c, sig, s.carry, s.rows, s.row_idx, "pending_");
  int64_t counter = s.counter;
  std::vector<std::vector<int64_t>> rows(sig.ys.size());
  for (int64_t j = 0; j < seg.unroll; ++j) emit_step(c, sig, seg, j, s, rows);
  int64_t first_row = block_row(c, sig, seg, counter, "");
  for (size_t k = 0; k < sig.ys.size(); ++k) {
    if (!delayed(sig, k)) continue;
    std::string name = "block" + std::to_string(k);
    if (sig.reverse) std::reverse(rows[k].begin(), rows[k].end());  // call j writes row stop - 1 - (counter + j)
    s.blocks[k] = rows[k].size() == 1 ? rows[k][0] : c.emit(name, "concatenate", as_rows(sig.ys[k], seg.unroll), rows[k],
                                                            [](Msg& m) { m.packed(kHloInstructionDimensions, {0}); });
    s.offsets[k] = first_row;
  }
  s.counter = c.add("next_counter", counter, c.constant_s64("unroll", seg.unroll));
  return c.finish(pack(c, "next_state", s, sig, seg.unroll), state);
}

// ---------------------------------------------------------------- the module
// The pending block a segment's first iteration writes (at its own rows, which it then leaves
// pending, so the value is never read): a literal when small, as the slice of the buffer there
// (a broadcast of the fill, after XLA's simplifier) would be one more kernel for XLA CPU to
// compile (each kernel is an LLVM module: most of a small scan's compile time).
constexpr int64_t kLiteralBlockMaxBytes = 1 << 16;
int64_t first_block(Computation& e, const Signature& sig, size_t k, const Shape& block, int64_t ys, int64_t first_row,
                    const std::string& name) {
  if (block.dims[0] * per_step(block) * literal_field(block.etype).zero_bytes <= kLiteralBlockMaxBytes) {
    int64_t junk = e.constant_junk(name, block);
    if (junk >= 0) return junk;
  }
  std::vector<int64_t> operands{ys};
  for (int64_t v : block_at(e, sig, k, first_row, name + "_")) operands.push_back(v);
  return e.emit(name, "dynamic-slice", block, operands,
                [&](Msg& m) { m.packed(kHloInstructionDynamicSliceSizes, block.dims); });
}

int element_type(const std::string& shape) {
  int etype = 0;
  reader(shape).each([&](int f, uint64_t v, const std::string&) {
    if (f == kShapeElementType) etype = int(v);
  });
  return etype;
}

// Element types of the parameters and of the result tuple's parts in a ProgramShapeProto.
void read_types(const std::string& program, Signature& sig) {
  reader(program).each([&](int f, uint64_t, const std::string& shape) {
    if (f == kProgramShapeParameters) sig.body_param_types.push_back(element_type(shape));
    if (f != kProgramShapeResult) return;
    reader(shape).each([&](int g, uint64_t, const std::string& part) {
      if (g == kShapeTupleShapes) sig.body_result_types.push_back(element_type(part));
    });
  });
}

// Copies the body's computations into mod; sets sig.body_id and the body's types.
void adopt_body(Module& mod, const std::string& body, Signature& sig) {
  int64_t max_id = 0;
  std::vector<std::pair<int64_t, std::string>> programs;  // (computation id, program shape)
  reader(body).each([&](int field, uint64_t v, const std::string& s) {
    if (field == kHloModuleEntryComputationId) sig.body_id = int64_t(v);
    if (field != kHloModuleComputations) return;
    mod.computations.push_back(s);
    int64_t id = -1;
    std::string program;
    reader(s).each([&](int f, uint64_t cv, const std::string& inst) {
      if (f == kHloComputationId) id = int64_t(cv), max_id = std::max<int64_t>(max_id, id);
      if (f == kHloComputationProgramShape) program = inst;
      if (f != kHloComputationInstructions) return;
      reader(inst).each([&](int g, uint64_t iv, const std::string&) {
        if (g == kHloInstructionId) max_id = std::max<int64_t>(max_id, int64_t(iv));
      });
    });
    programs.emplace_back(id, program);
  });
  if (sig.body_id < 0 || mod.computations.empty()) throw std::runtime_error("body HloModuleProto has no entry computation");
  for (auto& [id, program] : programs)
    if (id == sig.body_id) read_types(program, sig);
  if (sig.body_param_types.size() != sig.body_params.size() ||
      sig.body_result_types.size() != sig.carry.size() + sig.ys.size() + 2 * num_row_writes(sig))
    throw std::invalid_argument("build_scan_module: the body's parameters or results do not match the signature");
  mod.next_id = max_id + 1;
}

// The module around its finished entry computation, serialized.
std::string module_proto(const Module& mod, const Computation& entry) {
  Msg m;
  m.bytes(kHloModuleName, "scan." + std::to_string(entry.id));
  m.bytes(kHloModuleEntryComputationName, "scan_entry." + std::to_string(entry.id));
  for (const std::string& c : mod.computations) m.bytes(kHloModuleComputations, c);
  m.msg(kHloModuleHostProgramShape, program_shape(entry.params, entry.result));
  m.i64(kHloModuleId, entry.id);
  m.i64(kHloModuleEntryComputationId, entry.id);
  return m.b;
}

std::string build_module(const std::string& body, Signature sig) {
  Module mod;
  adopt_body(mod, body, sig);
  if (straight(sig)) {
    Computation e(&mod, "scan_entry");
    build_straight_entry(e, sig);
    return module_proto(mod, e);
  }
  std::vector<std::pair<int64_t, int64_t>> loops;  // (body, cond) per segment
  for (size_t n = 0; n < sig.segments.size(); ++n)
    loops.emplace_back(build_loop_body(mod, sig, sig.segments[n], int(n)), build_cond(mod, sig, sig.segments[n], int(n)));

  Computation e(&mod, "scan_entry");
  State s;
  auto params = [&](const char* name, const std::vector<Shape>& shapes, std::vector<int64_t>& out) {
    for (size_t i = 0; i < shapes.size(); ++i) out.push_back(e.param(name + std::to_string(i), shapes[i]));
  };
  params("carry", sig.carry, s.carry);
  params("xs", sig.xs, s.xs);
  params("ys", sig.ys, s.ys);
  params("pass", sig.pass, s.pass);
  const std::vector<int64_t> init_carry = s.carry;
  for (size_t k = 0; k < s.carry.size(); ++k) s.carry[k] = transposed(e, sig, k, s.carry[k], false, false, "carry" + std::to_string(k));
  for (size_t n = 0; n < loops.size(); ++n) {
    const Segment& seg = sig.segments[n];
    std::string p = "seg" + std::to_string(n) + "_";
    s.counter = e.constant_s64(p + "counter", 0);
    int64_t first_row = block_row(e, sig, seg, s.counter, p);
    s.blocks.assign(sig.ys.size(), -1), s.offsets.assign(sig.ys.size(), -1);
    for (size_t k = 0; k < sig.ys.size(); ++k) {  // the first block: overwritten unread
      if (!delayed(sig, k)) continue;
      std::string name = p + "block" + std::to_string(k);
      Shape block = as_rows(sig.ys[k], seg.unroll);
      s.offsets[k] = first_row;
      s.blocks[k] = first_block(e, sig, k, block, s.ys[k], first_row, name);
    }
    first_pending_rows(e, sig, s.carry, s.rows, s.row_idx, p);
    int64_t init = pack(e, p + "init", s, sig, seg.unroll);
    int64_t done = e.emit(p + "while", "while", tuple_of(state_parts(sig, seg.unroll)), {init}, [&](Msg& m) {
      m.packed(kHloInstructionCalledComputationIds, {loops[n].first, loops[n].second});  // (body, condition)
    });
    s = unpack(e, done, sig, seg.unroll, n + 1 == loops.size() ? kResults : kNoCounter, p);
    write_blocks(e, sig, s, p + "last_");
    write_pending_rows(e, sig, s.carry, s.rows, s.row_idx, p + "last_");
  }
  for (size_t k = 0; k < sig.ys.size(); ++k)
    if (carried(sig, k))
      s.ys[k] = write_row(e, sig, k, s.ys[k], init_carry[sig.y_carry[k]],
                          e.constant_s64("first_row" + std::to_string(k), sig.reverse ? sig.length - 1 : 0), "first_");
  std::vector<int64_t> outs(s.carry);
  for (size_t k = 0; k < outs.size(); ++k) outs[k] = transposed(e, sig, k, outs[k], false, true, "result" + std::to_string(k));
  outs.insert(outs.end(), s.ys.begin(), s.ys.end());
  std::vector<Shape> out_shapes(sig.carry);
  out_shapes.insert(out_shapes.end(), sig.ys.begin(), sig.ys.end());
  Shape result = tuple_of(out_shapes);
  e.finish(e.emit("result", "tuple", result, outs), result);
  return module_proto(mod, e);
}

// ---------------------------------------------------------------- Python glue
Segment segment_from_py(PyObject* obj) {
  Segment s;
  if (!PyArg_ParseTuple(obj, "LLL", &s.start, &s.stop, &s.unroll))
    throw std::invalid_argument("segment must be (start, stop, unroll)");
  return s;
}

std::pair<int, int> source_from_py(PyObject* obj) {
  int kind, index;
  if (!PyArg_ParseTuple(obj, "ii", &kind, &index)) throw std::invalid_argument("body param must be (kind, index)");
  return {kind, index};
}

PyObject* py_build_scan_module(PyObject*, PyObject* args) {
  const char* body;
  Py_ssize_t body_len;
  long long length;
  int reverse;
  PyObject *segments, *carry, *xs, *ys, *pass, *params, *y_carry = Py_None, *carry_rows = Py_None;
  PyObject* row_carries = Py_None;
  if (!PyArg_ParseTuple(args, "y#LpOOOOOO|OOO", &body, &body_len, &length, &reverse, &segments, &carry, &xs, &ys,
                        &pass, &params, &y_carry, &carry_rows, &row_carries))
    return nullptr;
  try {
    Signature sig;
    sig.length = length;
    sig.reverse = reverse;
    sig.segments = list_from_py<Segment>(segments, segment_from_py);
    sig.carry = list_from_py<Shape>(carry, shape_from_py);
    sig.xs = list_from_py<Shape>(xs, shape_from_py);
    sig.ys = list_from_py<Shape>(ys, shape_from_py);
    sig.pass = list_from_py<Shape>(pass, shape_from_py);
    sig.body_params = list_from_py<std::pair<int, int>>(params, source_from_py);
    if (y_carry != Py_None)
      sig.y_carry = list_from_py<int64_t>(y_carry, [](PyObject* o) { return int64_t(PyLong_AsLongLong(o)); });
    if (carry_rows != Py_None)
      sig.carry_rows = list_from_py<int64_t>(carry_rows, [](PyObject* o) { return int64_t(PyLong_AsLongLong(o)); });
    if (row_carries != Py_None)
      sig.row_carries = list_from_py<int64_t>(row_carries, [](PyObject* o) { return int64_t(PyLong_AsLongLong(o)); });
    if (PyErr_Occurred()) return nullptr;
    default_row_carries(sig);
    check_signature(sig);
    std::string out = build_module(std::string(body, body_len), sig);
    return PyBytes_FromStringAndSize(out.data(), Py_ssize_t(out.size()));
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"build_scan_module", py_build_scan_module, METH_VARARGS,
     "build_scan_module(body_proto, length, reverse, segments, carry, xs, ys, passthrough, body_params[, y_carry[, carry_rows[, row_carries]]])\n"
     "-> bytes\n"
     "segments: (start, stop, unroll) in execution order, one While each. Shapes are (xla_element_type, dims);\n"
     "body_params[i] = (kind, index) feeds body parameter i: kind 0 = carry[index], 1 = one slice of\n"
     "xs[index], 2 = passthrough[index]. y_carry (optional): per y, the carry it is (the body returns\n"
     "that carry parameter unchanged as the y), or -1. carry_rows (optional): per carry, the dim whose row the\n"
     "body writes (it returns the carry unchanged and, after the ys, the row and its s64 index), or -1.\n"
     "row_carries (optional): per row the body writes per step, in its order, the carry (default: one per\n"
     "carry with a dim in carry_rows)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_hlo_scan", "HloModuleProto builder for scan's XLA While.", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit__hlo_scan() { return PyModule_Create(&module_def); }
