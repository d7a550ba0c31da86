"""ExportOptions: which MatMul/Gemm nodes an export quantizes, and how."""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.reference import COMPUTE_MODES
from .quantize import DEFAULT_GROUP_SIZE, DEFAULT_SCALE_RULE, check_group_size
from .scale_rules import check_scale_rule

# Written into every node's ``compute`` attribute unless the export asks otherwise.
DEFAULT_COMPUTE = "fp32"


def check_compute(compute: str) -> None:
    """Raise ValueError unless ``compute`` is a compute mode of the op."""
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")


@dataclass(frozen=True)
class ExportOptions:
    """Which nodes (group size, exclusions, minimum size, input initializers) and how (scale rule, compute mode).

    ``fold_input_initializers``: initializers also listed as graph inputs are quantized with a
    warning (None), quantized silently (True) or left in FP32 (False).
    ``keep_embedding``: leave every Gather on a constant table (the token embedding) in FP32; by
    default it becomes an int4 CimInt4Gather, and a tied LM head shares its int4 tensors.
    """

    group_size: int = DEFAULT_GROUP_SIZE
    exclude: tuple[str, ...] = ()
    min_size: int = 0
    scale_rule: str = DEFAULT_SCALE_RULE
    compute: str = DEFAULT_COMPUTE
    fold_input_initializers: bool | None = None
    keep_embedding: bool = False

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        check_scale_rule(self.scale_rule)
        check_compute(self.compute)
        object.__setattr__(self, "exclude", tuple(self.exclude))
