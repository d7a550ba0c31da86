"""FP32 ONNX model -> CimInt4MatMul model."""

from ..contract import DEFAULT_COMPUTE, DEFAULT_GROUP_SIZE, SUPPORTED_GROUP_SIZES, pack
from .api import ExportError, NothingToQuantize, export_int4, export_with_summary, load_model, save_model
from .options import DEFAULT_METHOD, DEFAULT_TARGET_COSINE, METHODS, ExportOptions
from .quantize import DEFAULT_SCALE_RULE, QuantizedWeight, quantize, quantize_weight
from .rewrite import rewrite_model
from .scale_rules import SCALE_RULES
from .summary import ExportSummary, Rewritten, Skipped

__all__ = [
    "DEFAULT_COMPUTE",
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_METHOD",
    "DEFAULT_SCALE_RULE",
    "DEFAULT_TARGET_COSINE",
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
