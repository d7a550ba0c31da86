"""cim-int4: INT4 weight-only quantization for ONNX Runtime on x86 CPUs.

``export_int4`` rewrites a model's MatMul/Gemm nodes into ``CimInt4MatMul``;
``make_session`` (or ``library_path`` with ``SessionOptions.register_custom_ops_library``)
runs the result in ONNX Runtime; ``compare`` checks it against the FP32 model layer by layer;
``from_matmulnbits`` converts ORT MatMulNBits models.
"""

from .exporter import ExportError, NothingToQuantize, export_int4
from .exporter.convert import from_matmulnbits
from .ops import OP_DOMAIN, OP_TYPE, OP_VERSION, library_path, make_session
from .validate import CompareError, Report, compare

__all__ = [
    "CompareError",
    "Report",
    "compare",
    "OP_DOMAIN",
    "OP_TYPE",
    "OP_VERSION",
    "ExportError",
    "NothingToQuantize",
    "export_int4",
    "from_matmulnbits",
    "library_path",
    "make_session",
]
