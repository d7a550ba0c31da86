"""FP32 ONNX model -> CimInt4MatMul model."""

from .api import ExportError, NothingToQuantize, export_int4, export_with_summary, load_model, save_model
from .quantize import DEFAULT_GROUP_SIZE, SUPPORTED_GROUP_SIZES, QuantizedWeight, pack, quantize, quantize_weight
from .rewrite import ExportSummary, Rewritten, Skipped, rewrite_model

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "SUPPORTED_GROUP_SIZES",
    "ExportError",
    "ExportSummary",
    "NothingToQuantize",
    "QuantizedWeight",
    "Rewritten",
    "Skipped",
    "export_int4",
    "export_with_summary",
    "load_model",
    "pack",
    "quantize",
    "quantize_weight",
    "rewrite_model",
    "save_model",
]
