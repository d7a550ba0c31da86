// CimInt4Gather for ONNX Runtime: Y = dequantize(table)[indices] with the table as inputs
// (packed codes, scales, and int8 scales' super_scales), so one table can serve this op and a CimInt4MatMul (a tied LM
// head). Inputs are read in place on every call (nothing copied at load); indices are
// checked before any row is read, with ONNX Gather's rule for negative indices.
#include "op/gather_op.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cim_int4_contract.h"
#include "kernels/gather.h"
#include "kernels/repack.h"
#include "op/ort_support.h"

namespace cim_op {
namespace {

constexpr size_t kData = 0, kIndices = 1, kScales = 2, kSuper = 3;

struct TensorView {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> dims;
  const void* data = nullptr;
};

TensorView view_of(const OrtValue* value, const std::string& what) {
  auto [type, dims] = tensor_info(value, what);
  return TensorView{type, std::move(dims), data_of<void>(value)};
}

class GatherKernel {
 public:
  explicit GatherKernel(const OrtKernelInfo* info) : node_(node_name(info)) {
    AttributeReader attrs(info, node_, CIM_GATHER_OP_TYPE);
    K_ = attrs.required_int(cim::contract::kAttrK, "int K >= 1, the width of a dequantized row");
    group_size_ = attrs.optional_int(cim::contract::kAttrGroupSize, cim::contract::kDefaultGroupSize,
                                     (std::string("int, one of ") + cim::contract::kGroupSizesText).c_str());
    if (K_ < 1 || K_ > cim::kMaxDim) {
      attrs.fail("attribute 'K' is " + std::to_string(K_) + ", expected >= 1 (at most 2^31)");
    }
    if (!cim::is_supported_group_size(group_size_)) {
      attrs.fail("attribute 'group_size' is " + std::to_string(group_size_) + ", expected one of " +
                 cim::contract::kGroupSizesText);
    }
    const std::string bits_expected = std::string("int, one of ") + cim::contract::kBitsText;
    const int64_t bits =
        attrs.optional_int(cim::contract::kAttrBits, cim::contract::kDefaultBits, bits_expected.c_str());
    if (!cim::is_supported_bits(bits)) {
      attrs.fail("attribute 'bits' is " + std::to_string(bits) + ", expected one of " + cim::contract::kBitsText);
    }
    bits_ = static_cast<int>(bits);
    if (!cim::make_levels(bits_, read_grid(attrs, bits_), &levels_)) attrs.fail("attribute 'grid' does not fit 'bits'");
    inputs_ = attrs.input_count();
    if (inputs_ != 3 && inputs_ != 4) {
      attrs.fail("has " + std::to_string(inputs_) +
                 " inputs, expected 3 (packed, indices, scales) or 4 (packed, indices, int8 scales, super_scales)");
    }
    ranges_ = parallel_ranges(SessionConfig(info));
    // A table that is a constant initializer is checked now, so a bad file fails at load.
    TensorView constant[4];
    for (size_t slot : {kData, kScales, kSuper}) {
      if (slot >= inputs_) continue;
      int is_constant = 0;
      const OrtValue* value = nullptr;
      if (OrtStatus* s = g_api->KernelInfoGetConstantInput_tensor(info, slot, &is_constant, &value)) {
        g_api->ReleaseStatus(s);
        return;
      }
      if (!is_constant || value == nullptr) return;
      constant[slot] = view_of(value, where() + "reading a constant input");
    }
    table(constant[kData], constant[kScales], inputs_ == 4 ? &constant[kSuper] : nullptr);
  }

  void compute(OrtKernelContext* context) const {
    const OrtValue* values[4] = {};
    for (size_t i = 0; i < inputs_; ++i) check(g_api->KernelContext_GetInput(context, i, &values[i]), where() + "inputs");
    // An optional input left empty ("") is absent: ORT hands out no value for it.
    const bool has_super = inputs_ == 4 && values[kSuper] != nullptr;
    const TensorView super = has_super ? view_of(values[kSuper], where() + "input 'super_scales'") : TensorView{};
    const cim::Int4Table t = table(view_of(values[kData], where() + "input 'packed'"),
                                   view_of(values[kScales], where() + "input 'scales'"), has_super ? &super : nullptr);
    const TensorView indices = view_of(values[kIndices], where() + "input 'indices'");
    int64_t count = 1;
    for (int64_t d : indices.dims) count *= d;
    // Every index is checked (and made non-negative) before any row is read.
    std::vector<int64_t> rows(static_cast<size_t>(count));
    if (indices.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64) {
      normalize(static_cast<const int64_t*>(indices.data), count, t.rows, rows.data());
    } else if (indices.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32) {
      normalize(static_cast<const int32_t*>(indices.data), count, t.rows, rows.data());
    } else {
      throw OpError(where() + "input 'indices' must be int32 or int64, got ONNX element type " +
                    std::to_string(int(indices.type)));
    }
    std::vector<int64_t> out_dims = indices.dims;
    out_dims.push_back(K_);
    OrtValue* output = nullptr;
    check(g_api->KernelContext_GetOutput(context, 0, out_dims.data(), out_dims.size(), &output),
          where() + "allocating output Y");
    if (count == 0) return;
    void* y = nullptr;
    check(g_api->GetTensorMutableData(output, &y), where() + "output Y");

    Job job{t, rows.data(), static_cast<float*>(y), count, 0};
    // Decode gathers one row (K floats): no thread pool. A long prompt splits into ranges.
    const int64_t ranges = std::min(ranges_, (count * K_ + kMinFloatsPerRange - 1) / kMinFloatsPerRange);
    job.per_range = (count + ranges - 1) / ranges;
    if (ranges <= 1) {
      cim::gather_rows(t, job.rows, 0, count, job.Y);
      return;
    }
    const int64_t tasks = (count + job.per_range - 1) / job.per_range;
    check(g_api->KernelContext_ParallelFor(context, &Job::run, static_cast<size_t>(tasks), 0, &job),
          where() + "running on the intra-op thread pool");
  }

 private:
  static constexpr int64_t kMinFloatsPerRange = 1 << 16;

  struct Job {
    cim::Int4Table table;
    const int64_t* rows;
    float* Y;
    int64_t count;
    int64_t per_range;
    static void run(void* self, size_t task) {
      const Job& job = *static_cast<const Job*>(self);
      const int64_t begin = std::min(job.count, static_cast<int64_t>(task) * job.per_range);
      cim::gather_rows(job.table, job.rows, begin, std::min(job.count, begin + job.per_range), job.Y);
    }
  };

  std::string where() const { return std::string(CIM_GATHER_OP_TYPE " node '") + node_ + "': "; }

  // The table of inputs `data`, `scales` and `super` (int8 scales' super-scales, else null),
  // after checking their types and shapes against K and group_size.
  cim::Int4Table table(const TensorView& data, const TensorView& scales, const TensorView* super) const {
    const int64_t groups = (K_ + group_size_ - 1) / group_size_;
    const int64_t row_bytes = groups * group_size_ * bits_ / 8;
    const std::string layout = "[rows, ceil(K/group_size)*group_size*bits/8] with K=" + std::to_string(K_) +
                               ", group_size=" + std::to_string(group_size_) + ", bits=" + std::to_string(bits_);
    if (data.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
      throw OpError(where() + "input 'packed' must be uint8 " + layout + ", got ONNX element type " +
                    std::to_string(int(data.type)));
    }
    const bool flat = data.dims.size() == 2 && data.dims[1] == row_bytes;
    const bool blocked =
        data.dims.size() == 3 && data.dims[1] == groups && data.dims[2] == group_size_ * bits_ / 8;
    if (!flat && !blocked) {
      throw OpError(where() + "input 'packed' has shape " + dims_str(data.dims) + ", expected " + layout +
                    " (or [rows, groups, group_size*bits/8])");
    }
    const int64_t rows = data.dims[0];
    const bool f16 = scales.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    const bool i8 = scales.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    if ((scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && !f16 && !i8) ||
        (scales.dims != std::vector<int64_t>{rows, groups} && scales.dims != std::vector<int64_t>{rows * groups})) {
      throw OpError(where() + "input 'scales' is ONNX element type " + std::to_string(int(scales.type)) +
                    " with shape " + dims_str(scales.dims) + ", expected float32, float16 or int8 " +
                    dims_str({rows, groups}) + " ([rows, ceil(K/group_size)])");
    }
    const int64_t supers = cim::supers_of(groups);
    if (i8 != (super != nullptr)) {
      throw OpError(where() + (i8 ? "has int8 'scales' but no input 'super_scales'"
                                  : "has input 'super_scales', which only int8 'scales' take"));
    }
    if (super != nullptr && (super->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
                             (super->dims != std::vector<int64_t>{rows, supers} &&
                              super->dims != std::vector<int64_t>{rows * supers}))) {
      throw OpError(where() + "input 'super_scales' is ONNX element type " + std::to_string(int(super->type)) +
                    " with shape " + dims_str(super->dims) + ", expected float16 " + dims_str({rows, supers}) +
                    " ([rows, ceil(ceil(K/group_size)/" + std::to_string(cim::kSuperGroups) + ")])");
    }
    cim::Int4Table t;
    t.packed = static_cast<const uint8_t*>(data.data);
    t.scales = scales.data;
    t.scale_type = i8 ? cim::kScaleI8 : f16 ? cim::kScaleF16 : cim::kScaleF32;
    t.super_scales = super != nullptr ? static_cast<const uint16_t*>(super->data) : nullptr;
    t.bits = bits_;
    t.levels = levels_;
    t.rows = rows;
    t.K = K_;
    t.group_size = group_size_;
    t.groups = groups;
    return t;
  }

  template <typename Index>
  void normalize(const Index* indices, int64_t count, int64_t rows, int64_t* out) const {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t index = static_cast<int64_t>(indices[i]);
      const int64_t row = index < 0 ? index + rows : index;
      if (row < 0 || row >= rows) {
        throw OpError(where() + "indices element out of data bounds, idx=" + std::to_string(index) +
                      " must be within the inclusive range [" + std::to_string(-rows) + "," +
                      std::to_string(rows - 1) + "]");
      }
      out[i] = row;
    }
  }

  std::string node_;
  int64_t K_ = 0;
  int64_t group_size_ = 32;
  int bits_ = 4;
  cim::CodeLevels levels_;  // what each code stands for (attribute 'grid')
  int64_t ranges_ = 1;
  size_t inputs_ = 3;
};

// Output shape = indices' shape + [K].
OrtStatus* infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  return guarded([&] {
    const OrtOpAttr* attr = nullptr;
    check(g_api->ShapeInferContext_GetAttribute(ctx, cim::contract::kAttrK, &attr), CIM_GATHER_OP_TYPE ": attribute 'K'");
    int64_t K = 0;
    size_t bytes = 0;
    check(g_api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &K, sizeof(K), &bytes), CIM_GATHER_OP_TYPE ": attribute 'K'");
    auto [dims, names] = inferred_input(ctx, kIndices, CIM_GATHER_OP_TYPE ": input indices");
    // Rank 0 is also what an input of unknown shape reports: say nothing rather than "[K]".
    if (dims.empty()) return;
    dims.push_back(K);
    names.emplace_back();
    set_float_output(ctx, dims, names, CIM_GATHER_OP_TYPE ": output Y");
  });
}

OrtCustomOp make_op() {
  OrtCustomOp op = custom_op_base<GatherKernel>();
  op.GetName = [](const OrtCustomOp*) { return CIM_GATHER_OP_TYPE; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) {
    // indices: int32 or int64; scales: float32, float16 or int8 (both checked in compute)
    return i == kData    ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
           : i == kSuper ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                         : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return i == kSuper ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  };
  op.InferOutputShapeFn = &infer_shape;
  return op;
}

}  // namespace

const OrtCustomOp& gather_op() {
  static const OrtCustomOp op = make_op();
  return op;
}

}  // namespace cim_op
