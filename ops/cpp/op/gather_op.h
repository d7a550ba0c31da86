// CimInt4Gather: rows of an int4 table (the CimInt4MatMul codes/scales format) by index.
#pragma once

#include <onnxruntime_c_api.h>

namespace cim_op {

// The op's schema and kernel callbacks; lives as long as the library.
const OrtCustomOp& gather_op();

}  // namespace cim_op
