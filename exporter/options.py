"""ExportOptions: which MatMul/Gemm nodes an export quantizes, and how."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops.reference import COMPUTE_MODES
from .gptq import DEFAULT_BLOCK, DEFAULT_DAMP
from .quantize import DEFAULT_GROUP_SIZE, DEFAULT_SCALE_RULE, check_group_size
from .scale_rules import check_scale_rule

# Written into every node's ``compute`` attribute unless the export asks otherwise.
DEFAULT_COMPUTE = "fp32"


# How weights are rounded given calibration inputs (exporter.methods); every method without them is "rtn".
METHODS = ("rtn", "gptq", "awq", "awq+gptq", "auto")
DEFAULT_METHOD = "rtn"
CALIBRATED = ("gptq", "awq", "awq+gptq")  # the methods that need calibration inputs


def check_method(method: str) -> None:
    """Raise ValueError unless ``method`` is one of METHODS."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def check_compute(compute: str) -> None:
    """Raise ValueError unless ``compute`` is a compute mode of the op."""
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")


@dataclass(frozen=True)
class ExportOptions:
    """Which nodes (group size, exclusions, minimum size, input initializers) and how (scale rule, compute, method).

    ``fold_input_initializers``: initializers also listed as graph inputs are quantized with a
    warning (None), quantized silently (True) or left in FP32 (False).
    """

    group_size: int = DEFAULT_GROUP_SIZE
    exclude: tuple[str, ...] = ()
    min_size: int = 0
    scale_rule: str = DEFAULT_SCALE_RULE
    compute: str = DEFAULT_COMPUTE
    fold_input_initializers: bool | None = None
    # Calibrated methods (exporter.methods; used only with calibration inputs).
    method: str = DEFAULT_METHOD
    gptq_damp: float = DEFAULT_DAMP  # times mean(diag H), added to H's diagonal
    gptq_block: int = DEFAULT_BLOCK  # input channels per lazy update
    gptq_act_order: bool = False  # sweep channels by decreasing H[k, k] (groups stay contiguous)

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        check_scale_rule(self.scale_rule)
        check_compute(self.compute)
        check_method(self.method)
        if not (self.gptq_damp > 0 and np.isfinite(self.gptq_damp)):
            raise ValueError(f"gptq_damp must be a positive finite number, got {self.gptq_damp!r}")
        if not (isinstance(self.gptq_block, int) and self.gptq_block > 0):
            raise ValueError(f"gptq_block must be a positive integer, got {self.gptq_block!r}")
        object.__setattr__(self, "exclude", tuple(self.exclude))
