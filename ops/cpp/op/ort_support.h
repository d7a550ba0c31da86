// ORT C API plumbing for the op wrapper (op.cpp): the API pointers, errors as exceptions
// and back, RAII for ORT objects, the node's attributes (every message names node and
// attribute) and session config entries (C API 24, looked up at run time).
#pragma once

#include <onnxruntime_c_api.h>

#include "cim_int4_contract.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace cim_op {

// The oldest ORT C API with everything used here (KernelContext_ParallelFor,
// shape inference callbacks, CreateKernelV2, KernelInfoGetConstantInput_tensor):
// onnxruntime 1.17.
constexpr uint32_t kMinOrtApi = 17;
constexpr const char* kMinOrtRelease = "1.17";

// Set once, by the first RegisterCustomOps call (std::call_once: kernels of other sessions
// may be reading them while later calls register the library again).
inline const OrtApi* g_api = nullptr;
inline const OrtApiBase* g_api_base = nullptr;


// An error that already carries the full message for the user.
struct OpError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Turns an OrtStatus from the C API into an exception, prefixed with what we were doing.
inline void check(OrtStatus* status, const std::string& what) {
  if (status == nullptr) return;
  std::string msg = what + ": " + g_api->GetErrorMessage(status);
  g_api->ReleaseStatus(status);
  throw OpError(msg);
}

template <typename Fn>
OrtStatus* guarded(Fn&& fn) noexcept {
  try {
    fn();
    return nullptr;
  } catch (const std::exception& e) {
    return g_api->CreateStatus(ORT_FAIL, e.what());
  } catch (...) {
    return g_api->CreateStatus(ORT_FAIL, CIM_OP_TYPE ": unknown C++ exception");
  }
}

struct ValueDeleter {
  void operator()(OrtValue* v) const { g_api->ReleaseValue(v); }
};
struct TypeShapeDeleter {
  void operator()(OrtTensorTypeAndShapeInfo* v) const { g_api->ReleaseTensorTypeAndShapeInfo(v); }
};
using ValuePtr = std::unique_ptr<OrtValue, ValueDeleter>;
using TypeShapePtr = std::unique_ptr<OrtTensorTypeAndShapeInfo, TypeShapeDeleter>;

inline std::string node_name(const OrtKernelInfo* info) {
  size_t size = 0;
  if (OrtStatus* s = g_api->KernelInfo_GetNodeName(info, nullptr, &size)) {
    g_api->ReleaseStatus(s);
    return "?";
  }
  std::string name(size, '\0');
  if (OrtStatus* s = g_api->KernelInfo_GetNodeName(info, name.data(), &size)) {
    g_api->ReleaseStatus(s);
    return "?";
  }
  name.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
  return name;
}

inline std::string dims_str(const std::vector<int64_t>& dims) {
  std::ostringstream s;
  s << '[';
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << ']';
  return s.str();
}

// A tensor's element type and shape.
struct TensorInfo {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> dims;
};

inline TensorInfo tensor_info(const OrtValue* value, const std::string& what) {
  OrtTensorTypeAndShapeInfo* raw = nullptr;
  check(g_api->GetTensorTypeAndShape(value, &raw), what);
  TypeShapePtr info(raw);
  TensorInfo out;
  size_t rank = 0;
  check(g_api->GetTensorElementType(info.get(), &out.type), what);
  check(g_api->GetDimensionsCount(info.get(), &rank), what);
  out.dims.resize(rank);
  check(g_api->GetDimensions(info.get(), out.dims.data(), rank), what);
  return out;
}

// Input `index` in shape inference: its dimensions and their names. The symbol strings belong to
// the context's info, so they are copied. ORT turns a dimension with neither a value nor a symbol
// into the value -1 (and then warns at run time that -1 != the real size); a fresh symbol keeps
// it unknown.
struct InferredShape {
  std::vector<int64_t> dims;
  std::vector<std::string> names;  // "" where the dimension has a value
};

inline InferredShape inferred_input(OrtShapeInferContext* ctx, size_t index, const std::string& what) {
  // The context owns this info (ORT's own wrappers never release it): no TypeShapePtr.
  OrtTensorTypeAndShapeInfo* in = nullptr;
  check(g_api->ShapeInferContext_GetInputTypeShape(ctx, index, &in), what);
  size_t rank = 0;
  check(g_api->GetDimensionsCount(in, &rank), what);
  InferredShape out;
  out.dims.resize(rank);
  check(g_api->GetDimensions(in, out.dims.data(), rank), what);
  std::vector<const char*> symbols(rank, nullptr);
  check(g_api->GetSymbolicDimensions(in, symbols.data(), rank), what);
  static std::atomic<uint64_t> unknown_count{0};
  out.names.resize(rank);
  for (size_t i = 0; i < rank; ++i) {
    if (symbols[i] != nullptr && symbols[i][0] != '\0') {
      out.names[i] = symbols[i];
    } else if (out.dims[i] < 0) {
      out.names[i] = "cim_int4_unk_" + std::to_string(unknown_count.fetch_add(1));
    }
  }
  return out;
}

// Sets output 0 in shape inference: float32 with `dims`, dimension i named `names[i]` ("" for none).
inline void set_float_output(OrtShapeInferContext* ctx, const std::vector<int64_t>& dims,
                             const std::vector<std::string>& names, const std::string& what) {
  std::vector<const char*> symbols(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) symbols[i] = names[i].c_str();
  OrtTensorTypeAndShapeInfo* raw = nullptr;
  check(g_api->CreateTensorTypeAndShapeInfo(&raw), what);
  TypeShapePtr out(raw);
  check(g_api->SetTensorElementType(out.get(), ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT), what);
  check(g_api->SetDimensions(out.get(), dims.data(), dims.size()), what);
  check(g_api->SetSymbolicDimensions(out.get(), symbols.data(), dims.size()), what);
  check(g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, out.get()), what);
}

// Reads the node's attributes for one kernel; every message names node and attribute.
class AttributeReader {
 public:
  AttributeReader(const OrtKernelInfo* info, std::string node, const char* op_type = CIM_OP_TYPE)
      : info_(info), node_(std::move(node)), op_type_(op_type) {
    check(g_api->GetAllocatorWithDefaultOptions(&allocator_), where() + "getting an allocator");
  }

  std::string where() const { return std::string(op_type_) + " node '" + node_ + "': "; }

  // How many inputs the node has (omitted optional inputs at the end not counted).
  size_t input_count() const {
    size_t count = 0;
    check(g_api->KernelInfo_GetInputCount(info_, &count), where() + "counting inputs");
    return count;
  }

  // Input `index` (called `name`), which must be a constant initializer of one of the given
  // element types with one of the `shapes`. ORT owns the value; it lives as long as the session.
  const OrtValue* constant_input(size_t index, const char* name, const std::vector<ONNXTensorElementDataType>& types,
                                 const char* type_name, const std::vector<std::vector<int64_t>>& shapes,
                                 const char* layout) const {
    std::string expected = std::string(type_name) + " tensor ";
    for (size_t i = 0; i < shapes.size(); ++i) expected += (i ? " or " : "") + dims_str(shapes[i]);
    expected += std::string(" (") + layout + ")";
    int is_constant = 0;
    const OrtValue* value = nullptr;
    if (OrtStatus* s = g_api->KernelInfoGetConstantInput_tensor(info_, index, &is_constant, &value)) {
      std::string why = g_api->GetErrorMessage(s);
      g_api->ReleaseStatus(s);
      fail(std::string("input ") + std::to_string(index) + " '" + name + "' cannot be read (ORT: " + why + ")");
    }
    if (!is_constant || value == nullptr) {
      fail(std::string("input ") + std::to_string(index) + " '" + name +
           "' must be a constant initializer (not a graph input or a computed tensor); expected " + expected);
    }
    const auto [got_type, got] = tensor_info(value, where() + "reading input " + name);
    if (std::find(types.begin(), types.end(), got_type) == types.end()) {
      fail(std::string("input '") + name + "' has element type " + std::to_string(int(got_type)) +
           " (ONNX TensorProto enum), expected " + expected);
    }
    for (const auto& shape : shapes) {
      if (got == shape) return value;
    }
    fail(std::string("input '") + name + "' has shape " + dims_str(got) + ", expected " + expected);
  }

  [[noreturn]] void fail(const std::string& msg) const { throw OpError(where() + msg); }

  int64_t required_int(const char* name, const char* expected) const {
    int64_t value = 0;
    if (OrtStatus* s = g_api->KernelInfoGetAttribute_int64(info_, name, &value)) {
      g_api->ReleaseStatus(s);
      fail(std::string("attribute '") + name + "' is missing or not an int (expected " + expected + ")");
    }
    return value;
  }

  // Whether the node has attribute `name` of any type. The C API has no direct query,
  // so ask with each getter; one of them succeeds when the attribute is there.
  bool has(const char* name) const {
    auto ok = [](OrtStatus* s) {
      if (s == nullptr) return true;
      g_api->ReleaseStatus(s);
      return false;
    };
    int64_t i = 0;
    float f = 0;
    size_t size = 0;
    if (ok(g_api->KernelInfoGetAttribute_int64(info_, name, &i))) return true;
    if (ok(g_api->KernelInfoGetAttribute_float(info_, name, &f))) return true;
    if (ok(g_api->KernelInfoGetAttribute_string(info_, name, nullptr, &size))) return true;
    if (ok(g_api->KernelInfoGetAttributeArray_float(info_, name, nullptr, &size))) return true;
    if (ok(g_api->KernelInfoGetAttributeArray_int64(info_, name, nullptr, &size))) return true;
    OrtValue* v = nullptr;
    if (!ok(g_api->KernelInfoGetAttribute_tensor(info_, name, allocator_, &v))) return false;
    g_api->ReleaseValue(v);
    return true;
  }

  // An optional int attribute: `fallback` when absent, an error when of another type.
  int64_t optional_int(const char* name, int64_t fallback, const char* expected) const {
    if (!has(name)) return fallback;
    return required_int(name, expected);
  }

  // An optional string attribute: `fallback` when absent, an error when of another type.
  std::string optional_string(const char* name, const std::string& fallback, const char* expected) const {
    if (!has(name)) return fallback;
    size_t size = 0;
    if (OrtStatus* s = g_api->KernelInfoGetAttribute_string(info_, name, nullptr, &size)) {
      g_api->ReleaseStatus(s);
      fail(std::string("attribute '") + name + "' is not a string (expected " + expected + ")");
    }
    std::string value(size, '\0');
    check(g_api->KernelInfoGetAttribute_string(info_, name, value.data(), &size), where() + name);
    value.resize(size > 0 ? size - 1 : 0);
    return value;
  }

  // A tensor attribute of one of the given element types and the given shape; on
  // mismatch, a message that states what was found and what was expected.
  ValuePtr tensor(const char* name, const std::vector<ONNXTensorElementDataType>& types, const char* type_name,
                  const std::vector<int64_t>& shape, const char* layout) const {
    const std::string expected = std::string(type_name) + " tensor " + dims_str(shape) + " (" + layout + ")";
    OrtValue* raw = nullptr;
    if (OrtStatus* s = g_api->KernelInfoGetAttribute_tensor(info_, name, allocator_, &raw)) {
      std::string why = g_api->GetErrorMessage(s);
      g_api->ReleaseStatus(s);
      fail(std::string("attribute '") + name + "' is missing or not a tensor (expected " + expected + "; ORT: " +
           why + ")");
    }
    ValuePtr value(raw);
    const auto [got_type, got] = tensor_info(value.get(), where() + "reading attribute " + name);
    if (std::find(types.begin(), types.end(), got_type) == types.end()) {
      fail(std::string("attribute '") + name + "' has element type " + std::to_string(int(got_type)) +
           " (ONNX TensorProto enum), expected " + expected);
    }
    if (got != shape) {
      fail(std::string("attribute '") + name + "' has shape " + dims_str(got) + ", expected " + expected);
    }
    return value;
  }

 private:
  const OrtKernelInfo* info_;
  std::string node_;
  const char* op_type_;
  OrtAllocator* allocator_ = nullptr;
};

// The node's grid (attribute 'grid', absent = the contract's default) as an index into
// contract::kGrids, checked against the code width `bits` (a non-uniform grid is for the
// widths contract::kGridBits only).
inline int read_grid(const AttributeReader& attrs, int bits) {
  const std::string expected = std::string("one of ") + cim::contract::kGridsText;
  const std::string grid = attrs.optional_string(cim::contract::kAttrGrid, cim::contract::kDefaultGrid, expected.c_str());
  const auto& names = cim::contract::kGrids;
  for (size_t i = 0; i < std::size(names); ++i) {
    if (grid != names[i]) continue;
    const auto& widths_of_grids = cim::contract::kGridBits;
    if (i != 0 && std::find(std::begin(widths_of_grids), std::end(widths_of_grids), bits) == std::end(widths_of_grids)) {
      std::string widths;
      for (int64_t b : widths_of_grids) widths += (widths.empty() ? "" : ", ") + std::to_string(b);
      attrs.fail("attribute 'grid' is \"" + grid + "\", which is for 'bits' " + widths + ", got bits=" +
                 std::to_string(bits));
    }
    return static_cast<int>(i);
  }
  attrs.fail("attribute 'grid' is \"" + grid + "\", expected " + expected);
  return 0;
}

template <typename T>
const T* data_of(const OrtValue* v) {
  // The C API has no const accessor in older releases; the data is only read.
  void* p = nullptr;
  check(g_api->GetTensorMutableData(const_cast<OrtValue*>(v), &p), "reading tensor data");
  return static_cast<const T*>(p);
}

// The session's config entries as a kernel sees them (read once per kernel), empty when
// this ORT is older than C API 24 (ORT 1.24), which added KernelInfo_GetConfigEntries. Our
// headers are older (C API 21): the functions are read from their slots in OrtApi, which
// only ever grows at the end (indices as in ORT's own static_asserts in
// onnxruntime_c_api.cc).
class SessionConfig {
 public:
  explicit SessionConfig(const OrtKernelInfo* info) {
    constexpr size_t kGetKeyValue = 297, kReleaseKeyValuePairs = 300;  // C API 22
    constexpr size_t kKernelInfoGetConfigEntries = 391;                // C API 24
    // Asking an older ORT for API 24 makes it print a warning: read the version first
    // ("1.24.0" and later have it).
    if (g_api_base == nullptr) return;
    int major = 0, minor = 0;
    if (std::sscanf(g_api_base->GetVersionString(), "%d.%d", &major, &minor) != 2 || major < 1 ||
        (major == 1 && minor < 24)) {
      return;
    }
    const OrtApi* api24 = g_api_base->GetApi(24);
    if (api24 == nullptr) return;
    const auto* slots = reinterpret_cast<void* const*>(api24);
    GetConfigEntriesFn get_entries;
    ReleaseFn release;
    std::memcpy(&get_entries, &slots[kKernelInfoGetConfigEntries], sizeof get_entries);
    std::memcpy(&get_value_, &slots[kGetKeyValue], sizeof get_value_);
    std::memcpy(&release, &slots[kReleaseKeyValuePairs], sizeof release);
    KeyValuePairs* entries = nullptr;
    if (OrtStatus* s = get_entries(info, &entries)) {
      g_api->ReleaseStatus(s);
      return;
    }
    entries_ = Owned(entries, release);
  }

  // The value of `key`, or "" when absent.
  std::string get(const char* key) const {
    const char* value = entries_ ? get_value_(entries_.get(), key) : nullptr;
    return value != nullptr ? std::string(value) : std::string();
  }

 private:
  struct KeyValuePairs;
  using GetConfigEntriesFn = OrtStatus*(ORT_API_CALL*)(const OrtKernelInfo*, KeyValuePairs**);
  using GetKeyValueFn = const char*(ORT_API_CALL*)(const KeyValuePairs*, const char*);
  using ReleaseFn = void(ORT_API_CALL*)(KeyValuePairs*);
  using Owned = std::unique_ptr<KeyValuePairs, ReleaseFn>;
  GetKeyValueFn get_value_ = nullptr;
  Owned entries_{nullptr, nullptr};
};

// How many contiguous ranges a call is split into: ideally one per thread of ORT's intra-op
// pool, which the C API does not tell a kernel. When the session pins its pool
// (`session.intra_op_thread_affinities`, one entry per pool thread besides the caller,
// readable from C API 24), that count; else the machine's CPUs (not the calling thread's
// affinity: the caller may be pinned to one CPU while the pool runs on all). Extra ranges
// on a smaller pool run one after another and cost nothing.
inline int64_t parallel_ranges(const SessionConfig& config) {
  const std::string affinities = config.get("session.intra_op_thread_affinities");
  if (!affinities.empty()) return 2 + std::count(affinities.begin(), affinities.end(), ';');
  return std::max(1u, std::thread::hardware_concurrency());
}

// The fields every op of this library fills the same way: CPU, one float32 output, kernels
// of type Kernel (made from the kernel info, run by compute(context)), exceptions turned into
// an OrtStatus. The struct layout filled is that of kMinOrtApi; newer ORT reads it as such.
// The caller adds the name, the inputs and the shape inference.
template <typename Kernel>
OrtCustomOp custom_op_base() {
  OrtCustomOp op{};
  op.version = kMinOrtApi;
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CPUExecutionProvider"; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernel = nullptr;
  op.KernelCompute = nullptr;
  op.CreateKernelV2 = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
    *kernel = nullptr;
    return guarded([&] { *kernel = new Kernel(info); });
  };
  op.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) -> OrtStatus* {
    return guarded([&] { static_cast<const Kernel*>(kernel)->compute(context); });
  };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.GetStartVersion = [](const OrtCustomOp*) { return CIM_OP_VERSION; };
  op.GetEndVersion = [](const OrtCustomOp*) { return CIM_GRID_OP_VERSION; };
  return op;
}

}  // namespace cim_op
