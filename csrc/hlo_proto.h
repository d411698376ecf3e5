// Just enough of XLA's HLO protobufs to append computations to a module.
//
// The torch_xla wheel ships no headers and exports no XlaBuilder symbols, so
// hlo_scan.cc speaks the protobuf wire format directly. Field numbers are those
// of openxla's public xla/service/hlo.proto and xla/xla_data.proto; each has a
// named constant below (<Message><Field>, with the proto declaration beside it)
// so that the builder reads as HLO, not as numbers.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace hlo {

// ------------------------------------------------------------ field numbers
// Every field number the builder writes or reads, one block per message. The
// comment beside each is the field's declaration in openxla/xla's
// xla/service/hlo.proto or xla/xla_data.proto, which these numbers match.

// HloModuleProto (xla/service/hlo.proto)
constexpr int kHloModuleName = 1;                  // string name = 1;
constexpr int kHloModuleEntryComputationName = 2;  // string entry_computation_name = 2;
constexpr int kHloModuleComputations = 3;          // repeated HloComputationProto computations = 3;
constexpr int kHloModuleHostProgramShape = 4;      // xla.ProgramShapeProto host_program_shape = 4;
constexpr int kHloModuleId = 5;                    // int64 id = 5;
constexpr int kHloModuleEntryComputationId = 6;    // int64 entry_computation_id = 6;

// HloComputationProto (xla/service/hlo.proto)
constexpr int kHloComputationName = 1;          // string name = 1;
constexpr int kHloComputationInstructions = 2;  // repeated HloInstructionProto instructions = 2;
constexpr int kHloComputationProgramShape = 4;  // xla.ProgramShapeProto program_shape = 4;
constexpr int kHloComputationId = 5;            // int64 id = 5;
constexpr int kHloComputationRootId = 6;        // int64 root_id = 6;

// HloInstructionProto (xla/service/hlo.proto)
constexpr int kHloInstructionName = 1;                   // string name = 1;
constexpr int kHloInstructionOpcode = 2;                 // string opcode = 2;
constexpr int kHloInstructionShape = 3;                  // xla.ShapeProto shape = 3;
constexpr int kHloInstructionLiteral = 8;                // xla.LiteralProto literal = 8;
constexpr int kHloInstructionParameterNumber = 9;        // int64 parameter_number = 9;
constexpr int kHloInstructionTupleIndex = 13;            // int64 tuple_index = 13;
constexpr int kHloInstructionDimensions = 14;            // repeated int64 dimensions = 14;
constexpr int kHloInstructionDynamicSliceSizes = 20;     // repeated int64 dynamic_slice_sizes = 20;
constexpr int kHloInstructionId = 35;                    // int64 id = 35;
constexpr int kHloInstructionOperandIds = 36;            // repeated int64 operand_ids = 36;
constexpr int kHloInstructionCalledComputationIds = 38;  // repeated int64 called_computation_ids = 38;
constexpr int kHloInstructionComparisonDirection = 63;   // string comparison_direction = 63;

// ProgramShapeProto (xla/xla_data.proto)
constexpr int kProgramShapeParameters = 1;      // repeated ShapeProto parameters = 1;
constexpr int kProgramShapeResult = 2;          // ShapeProto result = 2;
constexpr int kProgramShapeParameterNames = 3;  // repeated string parameter_names = 3;

// ShapeProto (xla/xla_data.proto)
constexpr int kShapeElementType = 2;  // PrimitiveType element_type = 2;
constexpr int kShapeDimensions = 3;   // repeated int64 dimensions = 3;
constexpr int kShapeTupleShapes = 4;  // repeated ShapeProto tuple_shapes = 4;
constexpr int kShapeLayout = 5;       // LayoutProto layout = 5;

// LayoutProto (xla/xla_data.proto)
constexpr int kLayoutMinorToMajor = 1;  // repeated int64 minor_to_major = 1;

// LiteralProto (xla/xla_data.proto)
constexpr int kLiteralShape = 1;  // ShapeProto shape = 1;
constexpr int kLiteralS64s = 5;   // repeated int64 s64s = 5;

// Where a LiteralProto keeps the values of an element type, and how many bytes one zero takes
// there: packed varints (preds, s32s, s64s, u32s, u64s) one byte, packed fixed-width floats and
// the byte strings (s8s, f16s, bf16s, ...) their width. {0, 0}: a type not listed here.
struct LiteralField {
  int field, zero_bytes;
};
inline LiteralField literal_field(int etype) {
  switch (etype) {
    case 1: return {2, 1};    // PRED: repeated bool preds = 2
    case 2: return {15, 1};   // S8: bytes s8s = 15
    case 3: return {17, 2};   // S16: bytes s16s = 17
    case 4: return {4, 1};    // S32: repeated int32 s32s = 4
    case 5: return {5, 1};    // S64: repeated int64 s64s = 5
    case 6: return {3, 1};    // U8: bytes u8s = 3
    case 7: return {16, 2};   // U16: bytes u16s = 16
    case 8: return {6, 1};    // U32: repeated uint32 u32s = 6
    case 9: return {7, 1};    // U64: repeated uint64 u64s = 7
    case 10: return {11, 2};  // F16: bytes f16s = 11
    case 11: return {8, 4};   // F32: repeated float f32s = 8
    case 12: return {9, 8};   // F64: repeated double f64s = 9
    case 15: return {12, 8};  // C64: repeated float c64s = 12 (real, imag)
    case 16: return {13, 2};  // BF16: bytes bf16s = 13
    case 18: return {18, 16}; // C128: repeated double c128s = 18 (real, imag)
    default: return {0, 0};
  }
}

// ------------------------------------------------------------ enum values
// PrimitiveType (xla/xla_data.proto): the values of ShapeProto.element_type.
constexpr int kPred = 1;    // PRED = 1;
constexpr int kS64 = 5;     // S64 = 5;
constexpr int kTuple = 13;  // TUPLE = 13;

// ------------------------------------------------------------ wire format
// A field's key is (field number << kWireTypeBits) | wire type
// (https://protobuf.dev/programming-guides/encoding/).
constexpr int kWireTypeBits = 3;
constexpr uint64_t kWireTypeMask = (1u << kWireTypeBits) - 1;
constexpr int kVarint = 0;           // int64, bool, enum
constexpr int kFixed64 = 1;          // fixed64, double: skipped when read
constexpr int kLengthDelimited = 2;  // string, bytes, messages, packed repeated scalars
constexpr int kFixed32 = 5;          // fixed32, float: skipped when read

struct Msg {
  std::string b;
  void varint(uint64_t v) {
    while (v >= 0x80) { b.push_back(char((v & 0x7f) | 0x80)); v >>= 7; }
    b.push_back(char(v));
  }
  void tag(int field, int wire) { varint((uint64_t(field) << kWireTypeBits) | uint64_t(wire)); }
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
      int field = int(key >> kWireTypeBits), wire = int(key & kWireTypeMask);
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
    m.packed(kShapeDimensions, dims);
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
  for (const Shape& s : params) program.msg(kProgramShapeParameters, s.proto());
  program.msg(kProgramShapeResult, result.proto());
  for (size_t i = 0; i < params.size(); ++i) program.bytes(kProgramShapeParameterNames, "p" + std::to_string(i));
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
    m.bytes(kHloInstructionName, label + "." + std::to_string(iid));
    m.bytes(kHloInstructionOpcode, opcode);
    m.msg(kHloInstructionShape, shape.proto());
    if (extra) extra(m);
    m.i64(kHloInstructionId, iid);
    m.packed(kHloInstructionOperandIds, operands);
    instrs.push_back(m);
    return iid;
  }
  int64_t param(const std::string& label, const Shape& shape) {
    int number = int(params.size());
    params.push_back(shape);
    return emit(label, "parameter", shape, {}, [&](Msg& m) { m.i64(kHloInstructionParameterNumber, number); });
  }
  int64_t constant_s64(const std::string& label, int64_t v) {
    return emit(label, "constant", scalar(kS64), {}, [&](Msg& m) {
      Msg lit;
      lit.msg(kLiteralShape, scalar(kS64).proto());
      lit.packed(kLiteralS64s, {v}, true);
      m.msg(kHloInstructionLiteral, lit);
    });
  }
  // An array of junk as a literal: zeros but for its first element's lowest byte, so that XLA's
  // algebraic simplifier does not make it a broadcast of one value (which XLA CPU compiles as a
  // kernel). For values never read. -1 where the element type has no LiteralField.
  int64_t constant_junk(const std::string& label, const Shape& shape) {
    LiteralField f = literal_field(shape.etype);
    if (!f.field) return -1;
    int64_t n = 1;
    for (int64_t d : shape.dims) n *= d;
    return emit(label, "constant", shape, {}, [&](Msg& m) {
      Msg lit;
      lit.msg(kLiteralShape, shape.proto());
      std::string values(size_t(n * f.zero_bytes), '\0');
      if (n) values[0] = 1;  // 1 (a varint), true, or a denormal
      lit.bytes(f.field, values);
      m.msg(kHloInstructionLiteral, lit);
    });
  }
  int64_t add(const std::string& label, int64_t a, int64_t b) { return emit(label, "add", scalar(kS64), {a, b}); }
  int64_t subtract(const std::string& label, int64_t a, int64_t b) {
    return emit(label, "subtract", scalar(kS64), {a, b});
  }
  int64_t multiply(const std::string& label, int64_t a, int64_t b) {
    return emit(label, "multiply", scalar(kS64), {a, b});
  }
  int64_t gte(const std::string& label, int64_t tuple, const Shape& shape, int index) {
    return emit(label, "get-tuple-element", shape, {tuple}, [&](Msg& m) { m.i64(kHloInstructionTupleIndex, index); });
  }
  int64_t call(const std::string& label, const Shape& shape, const std::vector<int64_t>& operands,
               const std::vector<int64_t>& computations) {
    return emit(label, "call", shape, operands, [&](Msg& m) { m.packed(kHloInstructionCalledComputationIds, computations); });
  }
  // Serializes this computation into the module; returns its id.
  int64_t finish(int64_t root_id, const Shape& result_shape) {
    root = root_id;
    result = result_shape;
    Msg m;
    m.bytes(kHloComputationName, name + "." + std::to_string(id));  // torch_xla splits names at '.'
    for (const Msg& i : instrs) m.msg(kHloComputationInstructions, i);
    m.msg(kHloComputationProgramShape, program_shape(params, result));
    m.i64(kHloComputationId, id);
    m.i64(kHloComputationRootId, root);
    mod->computations.push_back(m.b);
    return id;
  }
};

}  // namespace hlo
