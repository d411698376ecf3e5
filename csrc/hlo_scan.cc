// Builds the HloModuleProto of a whole scan around the body's HloModuleProto.
//
// The torch_xla wheel ships no headers and exports no XlaBuilder symbols, so
// this file speaks the protobuf wire format directly (field numbers from
// openxla's public xla/service/hlo.proto and xla/xla_data.proto). Python gives
// the body module (LoweringContext.hlo()) and the loop signature; we return
//
//   entry(carry..., xs..., ys..., pass...):
//     state = (counter=0, carry..., xs..., ys..., pass...)
//     state = while counter < (T / k) * k:  k body calls per iteration
//     state = while counter < T:            1 body call (only if T % k != 0)
//     return (carry..., ys...)
//
// where each body call dynamic-slices x at idx (= counter + j, or T-1-that when
// reversed), calls the body computation, and dynamic-update-slices y into ys.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// ---------------------------------------------------------------- wire format
struct Msg {
  std::string b;
  void varint(uint64_t v) {
    while (v >= 0x80) { b.push_back(char((v & 0x7f) | 0x80)); v >>= 7; }
    b.push_back(char(v));
  }
  void tag(int field, int wire) { varint((uint64_t(field) << 3) | wire); }
  void i64(int field, int64_t v) { tag(field, 0); varint(uint64_t(v)); }
  void bytes(int field, const std::string& s) { tag(field, 2); varint(s.size()); b += s; }
  void msg(int field, const Msg& m) { bytes(field, m.b); }
  void packed(int field, const std::vector<int64_t>& vs, bool keep_empty = false) {
    if (vs.empty() && !keep_empty) return;
    Msg m;
    for (int64_t v : vs) m.varint(uint64_t(v));
    bytes(field, m.b);
  }
};

struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  uint64_t varint() {
    uint64_t v = 0;
    for (int s = 0; p < end && s < 64; s += 7) {
      uint8_t c = *p++;
      v |= uint64_t(c & 0x7f) << s;
      if (!(c & 0x80)) return v;
    }
    throw std::runtime_error("truncated varint in body HloModuleProto");
  }
  // Calls f(field, wire, value, bytes) for each field; value is the varint for
  // wire type 0, bytes the payload for wire type 2.
  template <class F> void each(F f) {
    while (p < end) {
      uint64_t key = varint();
      int field = int(key >> 3), wire = int(key & 7);
      if (wire == 0) { f(field, wire, varint(), std::string()); continue; }
      if (wire == 2) {
        uint64_t n = varint();
        if (uint64_t(end - p) < n) throw std::runtime_error("truncated field in body HloModuleProto");
        std::string s(reinterpret_cast<const char*>(p), n);
        p += n;
        f(field, wire, 0, s);
        continue;
      }
      if (wire == 1) { p += 8; continue; }
      if (wire == 5) { p += 4; continue; }
      throw std::runtime_error("unsupported wire type in body HloModuleProto");
    }
  }
};

Reader reader(const std::string& s) {
  auto* d = reinterpret_cast<const uint8_t*>(s.data());
  return Reader{d, d + s.size()};
}

// ---------------------------------------------------------------- shapes
constexpr int kPred = 1, kS64 = 5, kTuple = 13;

struct Shape {
  int etype = 0;
  std::vector<int64_t> dims;
  std::vector<Shape> tuple;
  Msg proto() const {
    Msg m;
    m.i64(2, etype);
    if (etype == kTuple) {
      for (const Shape& s : tuple) m.msg(4, s.proto());
      return m;
    }
    m.packed(3, dims);
    std::vector<int64_t> minor_to_major;
    for (int64_t i = int64_t(dims.size()) - 1; i >= 0; --i) minor_to_major.push_back(i);
    Msg layout;
    layout.packed(1, minor_to_major);
    m.msg(5, layout);  // present even when empty: XLA aborts on a missing layout
    return m;
  }
};

Shape scalar(int etype) { return Shape{etype, {}, {}}; }
Shape tuple_of(std::vector<Shape> parts) { return Shape{kTuple, {}, std::move(parts)}; }
Shape drop_lead(const Shape& s) { return Shape{s.etype, {s.dims.begin() + 1, s.dims.end()}, {}}; }
Shape with_lead_one(const Shape& s) {
  Shape r{s.etype, {1}, {}};
  r.dims.insert(r.dims.end(), s.dims.begin(), s.dims.end());
  return r;
}

// ---------------------------------------------------------------- builder
struct Module;

struct Computation {
  Module* mod;
  std::string name;
  int64_t id;
  std::vector<Msg> instrs;
  std::vector<Shape> params;
  Shape result;
  int64_t root = -1;

  int64_t emit(const std::string& opcode, const Shape& shape, const std::vector<int64_t>& operands,
               const std::function<void(Msg&)>& extra = nullptr);
  int64_t param(int number, const Shape& shape) {
    params.push_back(shape);
    return emit("parameter", shape, {}, [&](Msg& m) { m.i64(9, number); });
  }
  int64_t constant_s64(int64_t v) {
    return emit("constant", scalar(kS64), {}, [&](Msg& m) {
      Msg lit;
      lit.msg(1, scalar(kS64).proto());
      lit.packed(5, {v}, true);
      m.msg(8, lit);
    });
  }
  int64_t gte(int64_t tuple, const Shape& shape, int index) {
    return emit("get-tuple-element", shape, {tuple}, [&](Msg& m) { m.i64(13, index); });
  }
  Msg proto() const;
};

struct Module {
  int64_t next_id;
  std::vector<std::string> computations;  // serialized, callees first
  int64_t fresh() { return next_id++; }
};

int64_t Computation::emit(const std::string& opcode, const Shape& shape, const std::vector<int64_t>& operands,
                          const std::function<void(Msg&)>& extra) {
  int64_t id = mod->fresh();
  Msg m;
  m.bytes(1, "scan_" + opcode + "." + std::to_string(id));
  m.bytes(2, opcode);
  m.msg(3, shape.proto());
  if (extra) extra(m);
  m.i64(35, id);
  m.packed(36, operands);
  instrs.push_back(m);
  return id;
}

Msg Computation::proto() const {
  Msg program;
  for (const Shape& s : params) program.msg(1, s.proto());
  program.msg(2, result.proto());
  for (size_t i = 0; i < params.size(); ++i) program.bytes(3, "p" + std::to_string(i));
  Msg m;
  m.bytes(1, name + "." + std::to_string(id));  // torch_xla splits names at '.'
  for (const Msg& i : instrs) m.msg(2, i);
  m.msg(4, program);
  m.i64(5, id);
  m.i64(6, root);
  return m;
}

// ---------------------------------------------------------------- the scan
struct Signature {
  int64_t length = 0, unroll = 1;
  bool reverse = false;
  std::vector<Shape> carry, xs, ys, pass;
  std::vector<std::pair<int, int>> body_params;  // (kind 0 carry / 1 x / 2 pass, index)
  int64_t body_id = -1;
};

// Loop state: (counter, carry..., xs..., ys..., pass...)
std::vector<Shape> state_parts(const Signature& sig) {
  std::vector<Shape> parts{scalar(kS64)};
  for (auto* group : {&sig.carry, &sig.xs, &sig.ys, &sig.pass}) parts.insert(parts.end(), group->begin(), group->end());
  return parts;
}

Shape body_result(const Signature& sig) {
  std::vector<Shape> parts = sig.carry;
  for (const Shape& y : sig.ys) parts.push_back(drop_lead(y));
  return tuple_of(parts);
}

int64_t build_cond(Module& mod, const Signature& sig, int64_t limit) {
  Computation c{&mod, "scan_cond", mod.fresh()};
  Shape state = tuple_of(state_parts(sig));
  int64_t p = c.param(0, state);
  int64_t counter = c.gte(p, scalar(kS64), 0);
  int64_t bound = c.constant_s64(limit);
  c.root = c.emit("compare", scalar(kPred), {counter, bound}, [](Msg& m) { m.bytes(63, "LT"); });
  c.result = scalar(kPred);
  mod.computations.push_back(c.proto().b);
  return c.id;
}

// One body call at step offset j of the current iteration; updates carry and ys in place.
void emit_step(Computation& c, const Signature& sig, int64_t counter, int64_t j, std::vector<int64_t>& carry,
               const std::vector<int64_t>& xs, std::vector<int64_t>& ys, const std::vector<int64_t>& pass) {
  int64_t idx = counter;
  if (j) idx = c.emit("add", scalar(kS64), {idx, c.constant_s64(j)});
  if (sig.reverse) idx = c.emit("subtract", scalar(kS64), {c.constant_s64(sig.length - 1), idx});
  int64_t zero = c.constant_s64(0);
  std::vector<int64_t> operands;
  for (auto [kind, i] : sig.body_params) {
    if (kind == 0) { operands.push_back(carry[i]); continue; }
    if (kind == 2) { operands.push_back(pass[i]); continue; }
    const Shape& full = sig.xs[i];
    std::vector<int64_t> starts{xs[i], idx};
    starts.insert(starts.end(), full.dims.size() - 1, zero);
    std::vector<int64_t> sizes = with_lead_one(drop_lead(full)).dims;
    int64_t sl = c.emit("dynamic-slice", with_lead_one(drop_lead(full)), starts, [&](Msg& m) { m.packed(20, sizes); });
    operands.push_back(c.emit("reshape", drop_lead(full), {sl}));
  }
  Shape result = body_result(sig);
  int64_t call = c.emit("call", result, operands, [&](Msg& m) { m.packed(38, {sig.body_id}); });
  for (size_t i = 0; i < carry.size(); ++i) carry[i] = c.gte(call, sig.carry[i], int(i));
  for (size_t k = 0; k < ys.size(); ++k) {
    Shape y = drop_lead(sig.ys[k]);
    int64_t v = c.gte(call, y, int(carry.size() + k));
    int64_t v1 = c.emit("reshape", with_lead_one(y), {v});
    std::vector<int64_t> ops{ys[k], v1, idx};
    ops.insert(ops.end(), y.dims.size(), zero);
    ys[k] = c.emit("dynamic-update-slice", sig.ys[k], ops);
  }
}

int64_t build_loop_body(Module& mod, const Signature& sig, int64_t calls) {
  Computation c{&mod, "scan_loop", mod.fresh()};
  std::vector<Shape> parts = state_parts(sig);
  Shape state = tuple_of(parts);
  int64_t p = c.param(0, state);
  std::vector<int64_t> elems;
  for (size_t i = 0; i < parts.size(); ++i) elems.push_back(c.gte(p, parts[i], int(i)));
  size_t nc = sig.carry.size(), nx = sig.xs.size(), ny = sig.ys.size();
  std::vector<int64_t> carry(elems.begin() + 1, elems.begin() + 1 + nc);
  std::vector<int64_t> xs(elems.begin() + 1 + nc, elems.begin() + 1 + nc + nx);
  std::vector<int64_t> ys(elems.begin() + 1 + nc + nx, elems.begin() + 1 + nc + nx + ny);
  std::vector<int64_t> pass(elems.begin() + 1 + nc + nx + ny, elems.end());
  for (int64_t j = 0; j < calls; ++j) emit_step(c, sig, elems[0], j, carry, xs, ys, pass);
  int64_t next = c.emit("add", scalar(kS64), {elems[0], c.constant_s64(calls)});
  std::vector<int64_t> out{next};
  for (auto* group : {&carry, &xs, &ys, &pass}) out.insert(out.end(), group->begin(), group->end());
  c.root = c.emit("tuple", state, out);
  c.result = state;
  mod.computations.push_back(c.proto().b);
  return c.id;
}

std::string build_module(const std::string& body, Signature sig) {
  Module mod{0, {}};
  int64_t max_id = 0;
  Reader r = reader(body);
  r.each([&](int field, int, uint64_t v, const std::string& s) {
    if (field == 6) sig.body_id = int64_t(v);
    if (field != 3) return;
    mod.computations.push_back(s);
    reader(s).each([&](int f, int, uint64_t cv, const std::string& inst) {
      if (f == 5) max_id = std::max<int64_t>(max_id, int64_t(cv));
      if (f != 2) return;
      reader(inst).each([&](int g, int, uint64_t iv, const std::string&) {
        if (g == 35) max_id = std::max<int64_t>(max_id, int64_t(iv));
      });
    });
  });
  if (sig.body_id < 0 || mod.computations.empty()) throw std::runtime_error("body HloModuleProto has no entry computation");
  mod.next_id = max_id + 1;

  int64_t k = std::max<int64_t>(1, std::min(sig.unroll, std::max<int64_t>(sig.length, 1)));
  int64_t main_trips = (sig.length / k) * k;
  std::vector<Shape> parts = state_parts(sig);
  Shape state = tuple_of(parts);
  int64_t body_k = build_loop_body(mod, sig, k);
  int64_t cond_k = build_cond(mod, sig, main_trips);
  int64_t body_1 = -1, cond_1 = -1;
  if (main_trips != sig.length) {
    body_1 = build_loop_body(mod, sig, 1);
    cond_1 = build_cond(mod, sig, sig.length);
  }

  Computation e{&mod, "scan_entry", mod.fresh()};
  std::vector<int64_t> init{e.constant_s64(0)};
  for (size_t i = 1; i < parts.size(); ++i) init.push_back(e.param(int(i - 1), parts[i]));
  int64_t loop = e.emit("tuple", state, init);
  loop = e.emit("while", state, {loop}, [&](Msg& m) { m.packed(38, {body_k, cond_k}); });
  if (body_1 >= 0) loop = e.emit("while", state, {loop}, [&](Msg& m) { m.packed(38, {body_1, cond_1}); });
  size_t nc = sig.carry.size(), nx = sig.xs.size();
  std::vector<int64_t> outs;
  std::vector<Shape> out_shapes;
  for (size_t i = 0; i < nc; ++i) { outs.push_back(e.gte(loop, sig.carry[i], int(1 + i))); out_shapes.push_back(sig.carry[i]); }
  for (size_t i = 0; i < sig.ys.size(); ++i) { outs.push_back(e.gte(loop, sig.ys[i], int(1 + nc + nx + i))); out_shapes.push_back(sig.ys[i]); }
  e.result = tuple_of(out_shapes);
  e.root = e.emit("tuple", e.result, outs);
  Msg entry = e.proto();
  mod.computations.push_back(entry.b);

  Msg program;  // host_program_shape: the entry's program shape again
  for (const Shape& s : e.params) program.msg(1, s.proto());
  program.msg(2, e.result.proto());
  for (size_t i = 0; i < e.params.size(); ++i) program.bytes(3, "p" + std::to_string(i));
  Msg m;
  m.bytes(1, "scan." + std::to_string(e.id));
  m.bytes(2, "scan_entry." + std::to_string(e.id));
  for (const std::string& c : mod.computations) m.bytes(3, c);
  m.msg(4, program);
  m.i64(5, e.id);
  m.i64(6, e.id);
  return m.b;
}

// ---------------------------------------------------------------- Python glue
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
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) out.push_back(convert(PySequence_Fast_GET_ITEM(seq, i)));
  Py_DECREF(seq);
  return out;
}

PyObject* py_build_scan_module(PyObject*, PyObject* args) {
  const char* body;
  Py_ssize_t body_len;
  long long length, unroll;
  int reverse;
  PyObject *carry, *xs, *ys, *pass, *params;
  if (!PyArg_ParseTuple(args, "y#LpLOOOOO", &body, &body_len, &length, &reverse, &unroll, &carry, &xs, &ys, &pass,
                        &params))
    return nullptr;
  try {
    Signature sig;
    sig.length = length;
    sig.reverse = reverse;
    sig.unroll = unroll;
    sig.carry = list_from_py<Shape>(carry, shape_from_py);
    sig.xs = list_from_py<Shape>(xs, shape_from_py);
    sig.ys = list_from_py<Shape>(ys, shape_from_py);
    sig.pass = list_from_py<Shape>(pass, shape_from_py);
    sig.body_params = list_from_py<std::pair<int, int>>(params, [](PyObject* o) {
      int kind, index;
      if (!PyArg_ParseTuple(o, "ii", &kind, &index)) throw std::invalid_argument("body param must be (kind, index)");
      return std::make_pair(kind, index);
    });
    if (PyErr_Occurred()) return nullptr;
    std::string out = build_module(std::string(body, body_len), sig);
    return PyBytes_FromStringAndSize(out.data(), Py_ssize_t(out.size()));
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"build_scan_module", py_build_scan_module, METH_VARARGS,
     "build_scan_module(body_proto, length, reverse, unroll, carry, xs, ys, passthrough, body_params) -> bytes\n"
     "Shapes are (xla_element_type, dims); body_params[i] = (kind, index) says what feeds body parameter i:\n"
     "kind 0 = carry[index], 1 = one slice of xs[index], 2 = passthrough[index]."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_hlo_scan", "HloModuleProto builder for scan's XLA While.", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit__hlo_scan() { return PyModule_Create(&module_def); }
