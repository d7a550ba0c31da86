"""FP32 ONNX model -> CimInt4MatMul model."""

from .api import ExportError, NothingToQuantize, export_int4, export_with_summary, load_model, save_model
from .options import DEFAULT_COMPUTE, DEFAULT_METHOD, METHODS, ExportOptions
from .quantize import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_SCALE_RULE,
    SUPPORTED_GROUP_SIZES,
    QuantizedWeight,
    pack,
    quantize,
    quantize_weight,
)
from .rewrite import ExportSummary, Rewritten, Skipped, rewrite_model
from .scale_rules import SCALE_RULES

__all__ = [
    "DEFAULT_COMPUTE",
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_METHOD",
    "DEFAULT_SCALE_RULE",
    "METHODS",
    "SCALE_RULES",
    "SUPPORTED_GROUP_SIZES",
    "ExportError",
    "ExportOptions",
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
