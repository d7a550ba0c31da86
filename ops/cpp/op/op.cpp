// CimInt4MatMul for ONNX Runtime: schema, attribute validation, repack at kernel
// creation, compute split over ORT's intra-op thread pool; and the op domain (this op and
// CimInt4Gather, gather_op.cpp). The only exported symbol is RegisterCustomOps
// (exports.map); every C++ exception becomes an OrtStatus here.
#include <onnxruntime_c_api.h>

#include <malloc.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cim_int4_contract.h"
#include "kernels/gate.h"
#include "kernels/kernel.h"
#include "kernels/repack.h"
#include "op/gather_op.h"
#include "op/ort_support.h"
#include "tune/profile.h"

namespace {

using namespace cim_op;  // NOLINT: the wrapper is written in terms of its ORT plumbing



// Per-call scratch (int8 A, or a copy of a misaligned A): allocated and freed within the
// call. A thread_local buffer would live as long as ORT's threads and, having a destructor,
// would keep glibc from unloading the library.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Scratch = std::unique_ptr<void, FreeDeleter>;

Scratch scratch_bytes(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) throw std::bad_alloc();
  return Scratch(p);
}

// The node's code width (attribute 'bits', absent = 4), checked against the contract.
int read_bits(const AttributeReader& attrs) {
  const std::string expected = std::string("int, one of ") + cim::contract::kBitsText;
  const int64_t bits = attrs.optional_int(cim::contract::kAttrBits, cim::contract::kDefaultBits, expected.c_str());
  if (!cim::is_supported_bits(bits)) {
    attrs.fail("attribute 'bits' is " + std::to_string(bits) + ", expected one of " + cim::contract::kBitsText);
  }
  return static_cast<int>(bits);
}

// The node's gated activation (attribute 'gated'): -1 for none, else its index in the
// contract's list (the cim::Gate value).
int read_gated(const AttributeReader& attrs) {
  if (!attrs.has(cim::contract::kAttrGated)) return -1;
  const std::string expected = std::string("one of ") + cim::contract::kGatedActivationsText;
  const std::string gated = attrs.optional_string(cim::contract::kAttrGated, "", expected.c_str());
  const auto& names = cim::contract::kGatedActivations;
  for (size_t i = 0; i < std::size(names); ++i) {
    if (gated == names[i]) return static_cast<int>(i);
  }
  attrs.fail("attribute 'gated' is \"" + gated + "\", expected " + expected);
  return -1;
}

// The kernels' ScaleType of a `scales` tensor (its element type was checked on reading).
int scale_type_of(const OrtValue* value) {
  switch (tensor_info(value, "reading scales").type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return cim::kScaleF16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return cim::kScaleI8;
    default: return cim::kScaleF32;
  }
}

// The element types `scales` may have, and how a message names them.
const std::vector<ONNXTensorElementDataType>& scale_types() {
  static const std::vector<ONNXTensorElementDataType> types = {
      ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8};
  return types;
}
constexpr const char* kScaleTypeNames = "float32, float16 or int8";
// Rows of A from which a call is prefill, and its work ranges per pool thread (compute()).
constexpr int64_t kPrefillMinRows = 16;
constexpr int64_t kPrefillRangesPerThread = 4;

class Kernel {
 public:
  explicit Kernel(const OrtKernelInfo* info) : node_(node_name(info)) {
    AttributeReader attrs(info, node_);
    const int64_t K = attrs.required_int(cim::contract::kAttrK, "int K >= 1, the input's last dimension");
    const int64_t N = attrs.required_int(cim::contract::kAttrN, "int N >= 1, the output's last dimension");
    const int64_t group_size = attrs.optional_int(cim::contract::kAttrGroupSize, cim::contract::kDefaultGroupSize,
                                                  (std::string("int, one of ") + cim::contract::kGroupSizesText).c_str());
    // Bounds first: every size below is computed from these and must not overflow.
    const std::string limit = " (at most 2^31 = " + std::to_string(cim::kMaxDim) + ")";
    if (K < 1 || K > cim::kMaxDim) attrs.fail("attribute 'K' is " + std::to_string(K) + ", expected >= 1" + limit);
    if (N < 1 || N > cim::kMaxDim) attrs.fail("attribute 'N' is " + std::to_string(N) + ", expected >= 1" + limit);
    if (!cim::is_supported_group_size(group_size)) {
      attrs.fail("attribute 'group_size' is " + std::to_string(group_size) + ", expected one of " +
                 cim::contract::kGroupSizesText);
    }
    const int bits = read_bits(attrs);
    const int grid = read_grid(attrs, bits);
    gated_ = read_gated(attrs);
    if (gated_ >= 0 && N % 2 != 0) {
      attrs.fail("attribute 'N' is " + std::to_string(N) + ", expected an even N with 'gated' (the gate's N/2 " +
                 "channels, then the up projection's)");
    }
    // The node's compute mode, unless the session config overrides it for every node;
    // each is checked where it is given.
    const SessionConfig config(info);
    auto checked_mode = [&](std::string mode, const std::string& source) {
      if (std::find(std::begin(cim::contract::kComputeModes), std::end(cim::contract::kComputeModes), mode) ==
          std::end(cim::contract::kComputeModes)) {
        attrs.fail(source + " is \"" + mode + "\", expected one of " + cim::contract::kComputeModesText);
      }
      return mode;
    };
    std::string compute =
        checked_mode(attrs.optional_string(cim::contract::kAttrCompute, cim::contract::kDefaultCompute,
                                          (std::string("one of ") + cim::contract::kComputeModesText).c_str()),
                     "attribute 'compute'");
    if (std::string session_compute = config.get(cim::contract::kComputeConfig); !session_compute.empty()) {
      compute = checked_mode(std::move(session_compute),
                             std::string("session config entry '") + cim::contract::kComputeConfig + "'");
    }
    int8_ = compute == "int8";  // the one mode besides the default fp32

    const int64_t groups = (K + group_size - 1) / group_size;
    const int64_t row_bytes = groups * group_size * bits / 8;
    const std::string packed_layout = "[N, ceil(K/group_size)*group_size*bits/8], codes of bits=" +
                                      std::to_string(bits) + " as one little-endian bit stream per row";
    // int8 scales come with their float16 super-scales, one per kSuperGroups groups.
    const int64_t supers = cim::supers_of(groups);
    const std::string super_layout = "[N, ceil(ceil(K/group_size)/" + std::to_string(cim::kSuperGroups) +
                                     ")], int8 scales' super-scales";
    auto check_super = [&](int scale_type, bool has_super) {
      if (scale_type == cim::kScaleI8 && !has_super) {
        attrs.fail(std::string("has int8 'scales' but no '") + cim::contract::kAttrSuperScales + "', expected float16 " +
                   dims_str({N, supers}) + " (" + super_layout + ")");
      }
      if (scale_type != cim::kScaleI8 && has_super) {
        attrs.fail(std::string("has '") + cim::contract::kAttrSuperScales +
                   "', which only int8 'scales' take; its 'scales' are float32 or float16");
      }
    };
    ValuePtr bias;
    if (attrs.has(cim::contract::kAttrBias)) bias = attrs.tensor(cim::contract::kAttrBias, {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT}, "float32", {N}, "[N]");
    const float* bias_data = bias ? data_of<float>(bias.get()) : nullptr;
    const size_t inputs = attrs.input_count();
    if (inputs == 3 || inputs == 4) {
      if (gated_ >= 0) attrs.fail("has inputs 'packed' and 'scales' and attribute 'gated'; a gated node takes attributes");
      // Codes and scales as constant initializers (a table shared with a CimInt4Gather, say):
      // ORT keeps them; the stream below is our own copy, made once here.
      if (attrs.has(cim::contract::kAttrPacked) || attrs.has(cim::contract::kAttrScales) ||
          attrs.has(cim::contract::kAttrSuperScales)) {
        attrs.fail("has inputs 'packed' and 'scales' and also attributes of those names; give one or the other");
      }
      const OrtValue* packed =
          attrs.constant_input(1, cim::contract::kAttrPacked, {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8}, "uint8",
                               {{N, row_bytes}, {N, groups, group_size * bits / 8}}, packed_layout.c_str());
      const OrtValue* scales = attrs.constant_input(2, cim::contract::kAttrScales, scale_types(), kScaleTypeNames,
                                                    {{N, groups}, {N * groups}}, "[N, ceil(K/group_size)]");
      const int scale_type = scale_type_of(scales);
      check_super(scale_type, inputs == 4);
      const OrtValue* super =
          inputs == 4 ? attrs.constant_input(3, cim::contract::kAttrSuperScales, {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16},
                                             "float16", {{N, supers}, {N * supers}}, super_layout.c_str())
                      : nullptr;
      const std::string problem =
          storage_.build(K, N, group_size, bits, data_of<uint8_t>(packed), data_of<void>(scales), scale_type,
                         super != nullptr ? data_of<uint16_t>(super) : nullptr, bias_data, grid);
      if (!problem.empty()) attrs.fail(problem);
    } else if (inputs == 1) {
      // The attribute copies ORT hands out live only in this scope: at load, the peak is
      // the model plus one node's copies, and afterwards we hold only our repacked stream.
      ValuePtr scales = attrs.tensor(cim::contract::kAttrScales, scale_types(), kScaleTypeNames, {N, groups},
                                     "[N, ceil(K/group_size)]");
      ValuePtr packed = attrs.tensor(cim::contract::kAttrPacked, {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8}, "uint8",
                                     {N, row_bytes}, packed_layout.c_str());
      const int scale_type = scale_type_of(scales.get());
      check_super(scale_type, attrs.has(cim::contract::kAttrSuperScales));
      ValuePtr super;
      if (scale_type == cim::kScaleI8) {
        super = attrs.tensor(cim::contract::kAttrSuperScales, {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16}, "float16",
                             {N, supers}, super_layout.c_str());
      }
      const uint8_t* packed_data = data_of<uint8_t>(packed.get());
      const auto* scale_bytes = data_of<uint8_t>(scales.get());
      const uint16_t* super_data = super ? data_of<uint16_t>(super.get()) : nullptr;
      // A gated node: rows [0, N/2) are the gate, [N/2, N) the up projection, each its own stream.
      const int64_t n_out = gated_ >= 0 ? N / 2 : N;
      std::string problem =
          storage_.build(K, n_out, group_size, bits, packed_data, scale_bytes, scale_type, super_data, bias_data, grid);
      if (problem.empty() && gated_ >= 0) {
        problem = up_.build(K, n_out, group_size, bits, packed_data + n_out * row_bytes,
                            scale_bytes + n_out * groups * cim::scale_size_of(scale_type), scale_type,
                            super_data != nullptr ? super_data + n_out * supers : nullptr,
                            bias_data ? bias_data + n_out : nullptr, grid);
      }
      if (!problem.empty()) attrs.fail(problem);
    } else {
      attrs.fail("has " + std::to_string(inputs) +
                 " inputs, expected 1 (A, with attributes 'packed' and 'scales'), 3 (A, packed, scales) or 4 (A, " +
                 "packed, int8 scales, super_scales)");
    }
    bias.reset();
#if defined(__GLIBC__)
    // The attribute copies are gone; glibc keeps freed blocks of this size in its heap
    // (its mmap threshold grows with each large free), so hand the pages back: a
    // session then holds the model ORT keeps plus our stream, not a third copy.
    malloc_trim(0);
#endif

    // CIM_INT4_KERNEL picks an instruction-set path by name; tests use it to run each one.
    const char* wanted = std::getenv("CIM_INT4_KERNEL");
    const char* available = nullptr;
    kernels_ = cim::select_kernels(wanted, &available);
    if (kernels_ == nullptr) {
      attrs.fail(std::string("CIM_INT4_KERNEL=") + wanted + " is not a kernel this CPU runs; available: " +
                 available + " (or auto)");
    }
    // The decode variant per mode: CIM_INT4_VARIANT, this CPU's profile, or a tuning now.
    cim::VariantChoice choice;
    std::string variant_error;
    if (!cim::choose_variants(*kernels_, choice, variant_error)) attrs.fail(variant_error);
    if (!choice.message.empty()) std::fprintf(stderr, "%s\n", choice.message.c_str());
    const cim::Mode mode = int8_ ? cim::kInt8 : cim::kFp32;
    matmul_ = kernels_->matmul_for(bits, mode, *choice.variant[mode]);
    gate_ = cim::gate_for(*kernels_);
    ranges_ = parallel_ranges(config);
  }

  void compute(OrtKernelContext* context) const {
    const cim::PackedWeights& w = storage_.weights();
    const OrtValue* input = nullptr;
    check(g_api->KernelContext_GetInput(context, 0, &input), where() + "reading input A");
    OrtTensorTypeAndShapeInfo* info_raw = nullptr;
    check(g_api->GetTensorTypeAndShape(input, &info_raw), where() + "reading input A");
    TypeShapePtr info(info_raw);
    ONNXTensorElementDataType type;
    check(g_api->GetTensorElementType(info.get(), &type), where() + "input A");
    size_t rank = 0;
    check(g_api->GetDimensionsCount(info.get(), &rank), where() + "input A");
    std::vector<int64_t> dims(rank);
    check(g_api->GetDimensions(info.get(), dims.data(), rank), where() + "input A");
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      throw OpError(where() + "input A must be float32, got ONNX element type " + std::to_string(int(type)));
    }
    if (rank < 1 || dims.back() != w.K) {
      throw OpError(where() + "input A has shape " + dims_str(dims) + ", expected [..., K] with K=" +
                    std::to_string(w.K));
    }
    int64_t M = 1;
    for (size_t i = 0; i + 1 < rank; ++i) M *= dims[i];
    std::vector<int64_t> out_dims = dims;
    out_dims.back() = w.N;  // a gated node's half
    OrtValue* output = nullptr;
    check(g_api->KernelContext_GetOutput(context, 0, out_dims.data(), out_dims.size(), &output),
          where() + "allocating output Y");
    if (M == 0) return;

    void* a_data = nullptr;
    // The C API has no const accessor in older releases; A is only read.
    check(g_api->GetTensorMutableData(const_cast<OrtValue*>(input), &a_data), where() + "input A");
    void* y_data = nullptr;
    check(g_api->GetTensorMutableData(output, &y_data), where() + "output Y");

    Scratch a_copy, q_buffer;
    const float* A = static_cast<const float*>(a_data);
    if (reinterpret_cast<uintptr_t>(a_data) % alignof(float) != 0) {
      // ORT passes a caller's buffer through as is, at any byte offset; kernels read floats.
      a_copy = scratch_bytes(static_cast<size_t>(M * w.K) * sizeof(float));
      void* aligned = a_copy.get();
      std::memcpy(aligned, a_data, static_cast<size_t>(M * w.K) * sizeof(float));
      A = static_cast<const float*>(aligned);
    }

    Job job;
    Scratch up_out;
    if (gated_ >= 0) {
      up_out = scratch_bytes(static_cast<size_t>(M * w.N) * sizeof(float));
      job.up = &up_.weights();
      job.up_y = static_cast<float*>(up_out.get());
      job.gate = gate_;
      job.gate_kind = static_cast<cim::Gate>(gated_);
    }
    job.args.A = A;
    job.args.M = M;
    job.args.lda = w.K;
    job.args.Y = static_cast<float*>(y_data);
    job.args.ldy = w.N;
    job.args.W = &w;
    job.fn = matmul_;
    if (int8_) {
      // A is quantized once per call, before the parallel section.
      const int64_t k_padded = w.groups * w.group_size;
      const size_t q_bytes = static_cast<size_t>(M * k_padded + 63) / 64 * 64;
      const size_t per_group = static_cast<size_t>(M * w.groups);
      q_buffer = scratch_bytes(q_bytes + per_group * (sizeof(float) + sizeof(int32_t)));
      auto* base = static_cast<uint8_t*>(q_buffer.get());
      auto* q = reinterpret_cast<int8_t*>(base);
      auto* scale = reinterpret_cast<float*>(base + q_bytes);
      auto* zsum = reinterpret_cast<int32_t*>(base + q_bytes + per_group * sizeof(float));
      kernels_->quantize_a(A, M, w.K, w.K, w.group_size, q, scale, zsum);
      job.qa = cim::QuantizedA{q, scale, zsum};
      job.args.QA = &job.qa;
    }
    // Contiguous static ranges of whole strips (4 tiles, 64 channels), one per pool thread:
    // each thread streams one stretch of the weights, and range edges fall 256 bytes apart
    // in each row of Y, so with N a multiple of 16 (Y rows on 64-byte lines) no two threads
    // write into the same cache line; otherwise only the lines that straddle two rows can be
    // shared (a cost, never a wrong value: no float is written twice). (Ranges of tiles, to
    // even out the shares of a 9-strip layer, measured 1-6% slower on Zen 3: a strip cut in
    // two runs its tiles one at a time.)
    // int8-mode prefill: kPrefillRangesPerThread ranges a thread, taken as the pool's threads
    // come free, so a thread slowed by its neighbour (two vCPUs of one core, a noisy host) does
    // not hold the node up with half the work. On a 2-vCPU Zen 4, M = 128, 4 x 4096^2: 59.8 ->
    // 46.8 ms at 2 threads (1 thread: 59.7, which 2 threads had not beaten), level at 1 thread. Not fp32
    // mode: it packs A per range, and ranges_ cannot tell a 1-thread pool from a larger one
    // (the C API does not say), where the extra ranges cost it 2% for a 5% gain at 2 threads.
    const int64_t wanted = int8_ && M >= kPrefillMinRows ? ranges_ * kPrefillRangesPerThread : ranges_;
    job.span = cim::range_span(w.tiles, wanted);
    const int64_t tasks = (w.tiles + job.span - 1) / job.span;
    check(g_api->KernelContext_ParallelFor(context, &Job::run, static_cast<size_t>(tasks), 0, &job),
          where() + "running on the intra-op thread pool");
  }

  std::string where() const { return std::string(CIM_OP_TYPE " node '") + node_ + "': "; }

 private:
  struct Job {
    cim::MatMulArgs args;
    cim::QuantizedA qa;
    cim::MatMulFn fn = nullptr;
    int64_t span = 0;  // tiles a task (cim::range_span)
    // A gated node: the up projection's weights, its output [M, N] (row stride N), the epilogue.
    const cim::PackedWeights* up = nullptr;
    float* up_y = nullptr;
    cim::GateFn gate = nullptr;
    cim::Gate gate_kind = cim::Gate::kSilu;
    static void run(void* self, size_t task) {
      const Job& job = *static_cast<const Job*>(self);
      const int64_t tiles = job.args.W->tiles;
      const int64_t begin = std::min(tiles, static_cast<int64_t>(task) * job.span);
      const int64_t end = std::min(tiles, begin + job.span);
      job.fn(job.args, begin, end);
      cim::recompute_nonfinite(job.args, begin, end);
      if (job.up == nullptr) return;
      // The same channels of the up projection, then Y = act(Y) * up on them, row by row.
      cim::MatMulArgs up_args = job.args;
      up_args.W = job.up;
      up_args.Y = job.up_y;
      up_args.ldy = job.up->N;
      job.fn(up_args, begin, end);
      cim::recompute_nonfinite(up_args, begin, end);
      const int64_t c0 = begin * cim::kTileN;
      const int64_t c1 = std::min(job.up->N, end * cim::kTileN);
      if (c1 <= c0) return;
      for (int64_t m = 0; m < job.args.M; ++m) {
        job.gate(job.gate_kind, job.args.Y + m * job.args.ldy + c0, job.up_y + m * job.up->N + c0, c1 - c0);
      }
    }
  };

  std::string node_;
  bool int8_ = false;  // compute mode "int8" (else "fp32")
  cim::PackedStorage storage_;
  cim::PackedStorage up_;  // a gated node's up projection (attribute 'gated')
  int gated_ = -1;         // the gated activation (cim::Gate), -1 for none
  cim::GateFn gate_ = nullptr;
  const cim::KernelTable* kernels_ = nullptr;
  cim::MatMulFn matmul_ = nullptr;  // the chosen variant's kernel for this node's mode
  int64_t ranges_ = 1;
};

// Output shape = input shape with the last dimension replaced by N.
OrtStatus* infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  return guarded([&] {
    const OrtOpAttr* attr = nullptr;
    check(g_api->ShapeInferContext_GetAttribute(ctx, cim::contract::kAttrN, &attr), CIM_OP_TYPE ": attribute 'N'");
    int64_t N = 0;
    size_t bytes = 0;
    check(g_api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &N, sizeof(N), &bytes), CIM_OP_TYPE ": attribute 'N'");
    const OrtOpAttr* k_attr = nullptr;
    int64_t K = -1;
    if (OrtStatus* s = g_api->ShapeInferContext_GetAttribute(ctx, cim::contract::kAttrK, &k_attr)) {
      g_api->ReleaseStatus(s);
    } else if (k_attr != nullptr) {
      check(g_api->ReadOpAttr(k_attr, ORT_OP_ATTR_INT, &K, sizeof(K), &bytes), CIM_OP_TYPE ": attribute 'K'");
    }

    // A gated node's output has N/2 channels (attribute 'gated', any value: the kernel checks it).
    const OrtOpAttr* gated_attr = nullptr;
    if (OrtStatus* s = g_api->ShapeInferContext_GetAttribute(ctx, cim::contract::kAttrGated, &gated_attr)) {
      g_api->ReleaseStatus(s);
    } else if (gated_attr != nullptr) {
      N /= 2;
    }

    auto [dims, names] = inferred_input(ctx, 0, CIM_OP_TYPE ": input A");
    if (dims.empty()) throw OpError(CIM_OP_TYPE ": input A must have rank >= 1, got a scalar");
    if (K > 0 && dims.back() >= 0 && dims.back() != K) {
      throw OpError(std::string(CIM_OP_TYPE ": input A has last dimension ") + std::to_string(dims.back()) +
                    ", expected K=" + std::to_string(K));
    }
    dims.back() = N;
    names.back().clear();
    set_float_output(ctx, dims, names, CIM_OP_TYPE ": output Y");
  });
}

OrtCustomOp make_op() {
  OrtCustomOp op = custom_op_base<Kernel>();
  op.GetName = [](const OrtCustomOp*) { return CIM_OP_TYPE; };
  // A, then optionally packed and scales (and int8 scales' super_scales) as constant
  // initializers (else attributes).
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) {
    // scales: float32, float16 or int8, checked at load
    return i == 1   ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
           : i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED
           : i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  };
  op.InferOutputShapeFn = &infer_shape;
  return op;
}

const OrtCustomOp& the_op() {
  static const OrtCustomOp op = make_op();
  return op;
}

// Domains must outlive every session that uses them; ORT keeps raw pointers. One domain
// serves every RegisterCustomOps call (it holds one immutable op), so registering in many
// sessions costs nothing per call. It is released when the library is unloaded: ORT keeps
// the library loaded while any session options or session that registered it live, and
// reloads it (and with it this static) for the next registration after the last is gone.
struct DomainDeleter {
  void operator()(OrtCustomOpDomain* d) const {
    if (g_api != nullptr) g_api->ReleaseCustomOpDomain(d);
  }
};

OrtCustomOpDomain* the_domain() {
  static const std::unique_ptr<OrtCustomOpDomain, DomainDeleter> domain = [] {
    OrtCustomOpDomain* raw = nullptr;
    check(g_api->CreateCustomOpDomain(CIM_OP_DOMAIN, &raw), "creating op domain " CIM_OP_DOMAIN);
    std::unique_ptr<OrtCustomOpDomain, DomainDeleter> owned(raw);
    check(g_api->CustomOpDomain_Add(raw, &the_op()), "adding " CIM_OP_TYPE);
    check(g_api->CustomOpDomain_Add(raw, &gather_op()), "adding " CIM_GATHER_OP_TYPE);
    return owned;
  }();
  return domain.get();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(kMinOrtApi);
  if (api == nullptr) {
    // API version 1 exists in every release; use it only to report the problem.
    const OrtApi* v1 = api_base->GetApi(1);
    std::string msg = std::string("cim-int4 needs onnxruntime >= ") + kMinOrtRelease + " (C API " +
                      std::to_string(kMinOrtApi) + "); this process runs onnxruntime " +
                      api_base->GetVersionString();
    return v1 != nullptr ? v1->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  static std::once_flag once;
  std::call_once(once, [&] {
    g_api = api;
    g_api_base = api_base;
  });
  return guarded([&] { check(g_api->AddCustomOpDomain(options, the_domain()), "registering domain " CIM_OP_DOMAIN); });
}
