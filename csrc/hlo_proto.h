// Just enough of XLA's HLO protobufs to append computations to a module.
//
// The torch_xla wheel ships no headers and exports no XlaBuilder symbols, so
// hlo_scan.cc speaks the protobuf wire format directly. Field numbers are those
// of openxla's public xla/service/hlo.proto and xla/xla_data.proto; each has a
// name below so the builder reads as HLO, not as numbers.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace hlo {

// ------------------------------------------------------------ field numbers
// ShapeProto / LayoutProto / ProgramShapeProto / LiteralProto (xla_data.proto)
constexpr int kShapeElementType = 2, kShapeDims = 3, kShapeTupleShapes = 4, kShapeLayout = 5;
constexpr int kLayoutMinorToMajor = 1;
constexpr int kProgramParams = 1, kProgramResult = 2, kProgramParamNames = 3;
constexpr int kLiteralShape = 1, kLiteralS64s = 5;
// HloInstructionProto (hlo.proto)
constexpr int kInstrName = 1, kInstrOpcode = 2, kInstrShape = 3, kInstrLiteral = 8, kInstrParamNumber = 9,
              kInstrTupleIndex = 13, kInstrDynamicSliceSizes = 20, kInstrId = 35, kInstrOperandIds = 36,
              kInstrCalledComputationIds = 38, kInstrComparisonDirection = 63;
// HloComputationProto
constexpr int kCompName = 1, kCompInstructions = 2, kCompProgramShape = 4, kCompId = 5, kCompRootId = 6;
// HloModuleProto
constexpr int kModName = 1, kModEntryName = 2, kModComputations = 3, kModHostProgramShape = 4, kModId = 5,
              kModEntryId = 6;
// PrimitiveType values
constexpr int kPred = 1, kS64 = 5, kTuple = 13;

// ------------------------------------------------------------ wire format
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

struct Msg {
  std::string b;
  void varint(uint64_t v) {
    while (v >= 0x80) { b.push_back(char((v & 0x7f) | 0x80)); v >>= 7; }
    b.push_back(char(v));
  }
  void tag(int field, int wire) { varint((uint64_t(field) << 3) | wire); }
  void i64(int field, int64_t v) { tag(field, kVarint); varint(uint64_t(v)); }
  void bytes(int field, const std::string& s) { tag(field, kLengthDelimited); varint(s.size()); b += s; }
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
  void skip(uint64_t n) {
    if (uint64_t(end - p) < n) throw std::runtime_error("truncated field in body HloModuleProto");
    p += n;
  }
  // Calls f(field, value, bytes) for each field: value is the varint of a
  // varint field, bytes the payload of a length-delimited one.
  template <class F> void each(F f) {
    while (p < end) {
      uint64_t key = varint();
      int field = int(key >> 3), wire = int(key & 7);
      if (wire == kVarint) { f(field, varint(), std::string()); continue; }
      if (wire == kLengthDelimited) {
        uint64_t n = varint();
        const uint8_t* start = p;
        skip(n);
        f(field, 0, std::string(reinterpret_cast<const char*>(start), n));
        continue;
      }
      if (wire == kFixed64) { skip(8); continue; }
      if (wire == kFixed32) { skip(4); continue; }
      throw std::runtime_error("unsupported wire type in body HloModuleProto");
    }
  }
};

inline Reader reader(const std::string& s) {
  auto* d = reinterpret_cast<const uint8_t*>(s.data());
  return Reader{d, d + s.size()};
}

// ------------------------------------------------------------ shapes
struct Shape {
  int etype = 0;
  std::vector<int64_t> dims;
  std::vector<Shape> tuple;
  // Arrays get the default (row-major) layout: XLA aborts on a missing one.
  Msg proto() const {
    Msg m;
    m.i64(kShapeElementType, etype);
    if (etype == kTuple) {
      for (const Shape& s : tuple) m.msg(kShapeTupleShapes, s.proto());
      return m;
    }
    m.packed(kShapeDims, dims);
    std::vector<int64_t> minor_to_major;
    for (int64_t i = int64_t(dims.size()) - 1; i >= 0; --i) minor_to_major.push_back(i);
    Msg layout;
    layout.packed(kLayoutMinorToMajor, minor_to_major);
    m.msg(kShapeLayout, layout);  // present even when empty
    return m;
  }
};

inline Shape scalar(int etype) { return Shape{etype, {}, {}}; }
inline Shape tuple_of(std::vector<Shape> parts) { return Shape{kTuple, {}, std::move(parts)}; }
inline Shape drop_lead(const Shape& s) { return Shape{s.etype, {s.dims.begin() + 1, s.dims.end()}, {}}; }
inline Shape with_lead_one(const Shape& s) {
  Shape r{s.etype, {1}, {}};
  r.dims.insert(r.dims.end(), s.dims.begin(), s.dims.end());
  return r;
}

inline Msg program_shape(const std::vector<Shape>& params, const Shape& result) {
  Msg program;
  for (const Shape& s : params) program.msg(kProgramParams, s.proto());
  program.msg(kProgramResult, result.proto());
  for (size_t i = 0; i < params.size(); ++i) program.bytes(kProgramParamNames, "p" + std::to_string(i));
  return program;
}

// ------------------------------------------------------------ builder
// A module under construction: serialized computations, callees first, and
// the next free id (ids are unique across the module, the body's included).
struct Module {
  int64_t next_id = 0;
  std::vector<std::string> computations;
  int64_t fresh() { return next_id++; }
};

// One computation. Instruction names are "<name>.<id>": the name says what the
// value is (carry0, s1_idx, ...), the id keeps names unique in the module.
struct Computation {
  Module* mod;
  std::string name;
  int64_t id;
  std::vector<Msg> instrs;
  std::vector<Shape> params;
  Shape result;
  int64_t root = -1;

  Computation(Module* m, std::string n) : mod(m), name(std::move(n)), id(m->fresh()) {}

  int64_t emit(const std::string& label, const std::string& opcode, const Shape& shape,
               const std::vector<int64_t>& operands, const std::function<void(Msg&)>& extra = nullptr) {
    int64_t iid = mod->fresh();
    Msg m;
    m.bytes(kInstrName, label + "." + std::to_string(iid));
    m.bytes(kInstrOpcode, opcode);
    m.msg(kInstrShape, shape.proto());
    if (extra) extra(m);
    m.i64(kInstrId, iid);
    m.packed(kInstrOperandIds, operands);
    instrs.push_back(m);
    return iid;
  }
  int64_t param(const std::string& label, const Shape& shape) {
    int number = int(params.size());
    params.push_back(shape);
    return emit(label, "parameter", shape, {}, [&](Msg& m) { m.i64(kInstrParamNumber, number); });
  }
  int64_t constant_s64(const std::string& label, int64_t v) {
    return emit(label, "constant", scalar(kS64), {}, [&](Msg& m) {
      Msg lit;
      lit.msg(kLiteralShape, scalar(kS64).proto());
      lit.packed(kLiteralS64s, {v}, true);
      m.msg(kInstrLiteral, lit);
    });
  }
  int64_t add(const std::string& label, int64_t a, int64_t b) { return emit(label, "add", scalar(kS64), {a, b}); }
  int64_t subtract(const std::string& label, int64_t a, int64_t b) {
    return emit(label, "subtract", scalar(kS64), {a, b});
  }
  int64_t gte(const std::string& label, int64_t tuple, const Shape& shape, int index) {
    return emit(label, "get-tuple-element", shape, {tuple}, [&](Msg& m) { m.i64(kInstrTupleIndex, index); });
  }
  int64_t call(const std::string& label, const Shape& shape, const std::vector<int64_t>& operands,
               const std::vector<int64_t>& computations) {
    return emit(label, "call", shape, operands, [&](Msg& m) { m.packed(kInstrCalledComputationIds, computations); });
  }
  // Serializes this computation into the module; returns its id.
  int64_t finish(int64_t root_id, const Shape& result_shape) {
    root = root_id;
    result = result_shape;
    Msg m;
    m.bytes(kCompName, name + "." + std::to_string(id));  // torch_xla splits names at '.'
    for (const Msg& i : instrs) m.msg(kCompInstructions, i);
    m.msg(kCompProgramShape, program_shape(params, result));
    m.i64(kCompId, id);
    m.i64(kCompRootId, root);
    mod->computations.push_back(m.b);
    return id;
  }
};

}  // namespace hlo
