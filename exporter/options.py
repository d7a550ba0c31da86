"""ExportOptions: everything an export is asked to do, in one value carried whole from the CLI or API to its users.

To add an option: add a field here (with its default and, if it can be wrong, its check in
``__post_init__``), then read ``options.<field>`` where it acts (rewrite, sensitivity, api).
``export_int4(..., <field>=value)`` and ``cim-int4 export`` pick it up by name: the CLI maps
every flag whose ``dest`` is a field name (``cli.export_options``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from numbers import Integral, Real
from typing import Any

import numpy as np

from ..contract import (
    COMPUTE_MODES,
    DEFAULT_BITS,
    DEFAULT_COMPUTE,
    DEFAULT_GRID,
    DEFAULT_GROUP_SIZE,
    GRIDS,
    check_group_size,
)
from .gptq import DEFAULT_BLOCK, DEFAULT_DAMP
from .quantize import DEFAULT_SCALE_DTYPE, DEFAULT_SCALE_RULE, check_scale_dtype
from .scale_rules import check_scale_rule
from .tune.scales import DEFAULT_LR as DEFAULT_TUNE_LR
from .widths import AUTO, Bits, normalize_bits

# Output cosine the sensitivity analysis aims for on the calibration inputs (``feeds``).
DEFAULT_TARGET_COSINE = 0.99

Feeds = Mapping[str, np.ndarray]

# ``compute``: one mode for every node, or "auto" = each node's own: a converted MatMulNBits
# node's accuracy level (4 -> int8, else fp32), an exported node the op's default.
COMPUTE_CHOICES = ("auto", *COMPUTE_MODES)

# How weights are rounded given calibration inputs (exporter.methods); every method without them is "rtn".
METHODS = ("rtn", "gptq", "awq", "awq+gptq", "auto")
DEFAULT_METHOD = "rtn"
CALIBRATED = ("gptq", "awq", "awq+gptq")  # the methods that need calibration inputs
ANY_WIDTH_METHODS = ("rtn", "gptq")  # the methods that quantize at any ``bits`` (the others at 4 only)
# The methods a rotation (``rotate``) is used with: those that round against the activations' statistics
# (not "auto", which keeps round-to-nearest unless another method measures 5% better). Round-to-nearest on
# a rotated SmolLM2-135M at 3 bits: 7x the unrotated gap (docs/widths.md, 'Rotation').
ROTATED_METHODS = ("gptq", "awq+gptq")
# How bits="auto" measures each layer's sensitivity per width (exporter.allocate).
BITS_SENSITIVITIES = ("auto", "exact", "proxy")


def check_method(method: str) -> None:
    """Raise ValueError unless ``method`` is one of METHODS."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


@dataclass(frozen=True)
class ExportOptions:
    """Which MatMul/Gemm nodes an export quantizes, how, and how the output is written.

    * ``group_size``, ``scale_rule``, ``compute``: the nodes' group size, the rule choosing
      their scales (exporter.scale_rules) and their ``compute`` attribute (one of
      ``COMPUTE_CHOICES``; ``node_compute`` is what an exported node gets).
    * ``exclude`` (regular expressions over node names) and ``min_size`` (weight elements):
      nodes left FP32.
    * ``fold_input_initializers``: initializers also listed as graph inputs are quantized with
      a warning (None), quietly (True) or left FP32 (False).
    * ``feeds`` (an ``.npz`` path, a dict of input arrays, or an iterable of such dicts) and
      ``target_cosine``: keep the most sensitive layers FP32 until the outputs reach
      ``target_cosine`` (exporter.sensitivity).
    * ``method`` (``rtn``, ``gptq``, ``awq``, ``awq+gptq``, ``auto``) and the GPTQ knobs: how
      weights are rounded given ``feeds`` (exporter.methods, docs/methods.md).
    * ``simplify``: run onnxsim first (extra ``simplify``).
    * ``external_data``: write the output's tensors to ``<output>.data`` whatever its size.
      ``compute`` and ``external_data`` are also the options of a MatMulNBits conversion
      (exporter.convert), which takes no other.
    * ``fuse_gated``: each gated MLP (two projections of one input, an activation on one, their
      product) becomes one gated CimInt4MatMul (exporter.gated); False keeps four or five nodes.
    * ``keep_embedding``: leave every Gather on a constant table (the token embedding) FP32; by
      default it becomes an int4 CimInt4Gather and a tied LM head reads its tensors
      (docs/embeddings.md).
    * ``bits`` (an int, ``{node name or regex: bits}``, or ``"auto"``), ``bits_budget`` (average
      bits per weight incl. scales, with ``"auto"``) and ``scale_dtype`` (``"int8"`` with float16
      super-scales, the default; ``"float16"``; ``"float32"``): the code width of each layer and
      the stored scales' type (exporter.widths, exporter.allocate, docs/widths.md). Methods ``rtn``
      and ``gptq`` quantize at any width (``bits="auto"`` then measures each width under that
      method); the AWQ ones at 4. Every method writes every scale dtype.
    * ``grid`` (``"uniform"``, ``"normal"``): what the codes of 2- and 3-bit layers stand for
      (contract.GRIDS); ``"normal"`` puts them on Gaussian levels, for rotated weights (docs/widths.md).
      Other widths stay uniform.
    * ``tune_epochs`` (0: none), ``tune_lr`` and ``tune_feeds`` (default: ``feeds``): after the
      export, train every group scale, codes fixed, so the model's first output (a language model's
      logits) comes back to FP32's in KL on the calibration batches (exporter.tune; docs/methods.md
      "Scale tuning"). Stored as before: no byte more. Needs every op of the graph in exporter.tune.graph.
    """

    group_size: int = DEFAULT_GROUP_SIZE
    exclude: tuple[str, ...] = ()
    min_size: int = 0
    scale_rule: str = DEFAULT_SCALE_RULE
    compute: str = DEFAULT_COMPUTE
    fold_input_initializers: bool | None = None
    feeds: str | os.PathLike | Feeds | Iterable[Feeds] | None = None
    target_cosine: float = DEFAULT_TARGET_COSINE
    simplify: bool = False
    external_data: bool = False
    method: str = DEFAULT_METHOD
    gptq_damp: float = DEFAULT_DAMP  # times mean(diag H), added to H's diagonal
    gptq_block: int = DEFAULT_BLOCK  # input channels per lazy update
    gptq_act_order: bool = True  # sweep channels by decreasing H[k, k] (groups stay contiguous); docs/methods.md
    keep_embedding: bool = False
    fuse_gated: bool = True
    bits: Bits = DEFAULT_BITS
    bits_budget: float | None = None
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    bits_sensitivity: str = "auto"  # bits="auto": one of BITS_SENSITIVITIES (exporter.allocate)
    rotate: bool = False
    grid: str = DEFAULT_GRID
    tune_epochs: int = 0
    tune_lr: float = DEFAULT_TUNE_LR
    tune_feeds: str | os.PathLike | Feeds | Iterable[Feeds] | None = None

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        check_scale_rule(self.scale_rule)
        if self.compute not in COMPUTE_CHOICES:
            raise ValueError(f"compute must be one of {COMPUTE_CHOICES}, got {self.compute!r}")
        check_method(self.method)
        if not (self.gptq_damp > 0 and np.isfinite(self.gptq_damp)):
            raise ValueError(f"gptq_damp must be a positive finite number, got {self.gptq_damp!r}")
        if not (isinstance(self.gptq_block, int) and self.gptq_block > 0):
            raise ValueError(f"gptq_block must be a positive integer, got {self.gptq_block!r}")
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "bits", normalize_bits(self.bits))
        check_scale_dtype(self.scale_dtype)
        if self.grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {self.grid!r}")
        if self.grid != DEFAULT_GRID and self.method not in ANY_WIDTH_METHODS:
            raise ValueError(f"grid={self.grid!r} needs method 'rtn' or 'gptq' (got {self.method!r})")
        if self.bits_sensitivity not in BITS_SENSITIVITIES:
            raise ValueError(f"bits_sensitivity must be one of {BITS_SENSITIVITIES}, got {self.bits_sensitivity!r}")
        if self.method not in ANY_WIDTH_METHODS and self.bits != DEFAULT_BITS:
            raise ValueError(
                f"method {self.method!r} quantizes at {DEFAULT_BITS} bits only; "
                f"use method 'rtn' or 'gptq' with bits={self.bits!r}"
            )
        if self.rotate and (self.method not in ROTATED_METHODS or self.feeds is None):
            raise ValueError(
                f"rotate=True needs method {' or '.join(map(repr, ROTATED_METHODS))} and feeds (got method "
                f"{self.method!r}{'' if self.feeds is not None else ', no feeds'}): rounded to nearest, rotated "
                "weights lose far more (docs/widths.md, 'Rotation')"
            )
        if isinstance(self.tune_epochs, bool) or not (isinstance(self.tune_epochs, Integral) and self.tune_epochs >= 0):
            raise ValueError(f"tune_epochs must be a non-negative integer, got {self.tune_epochs!r}")
        object.__setattr__(self, "tune_epochs", int(self.tune_epochs))
        lr = self.tune_lr
        if isinstance(lr, bool) or not (isinstance(lr, Real) and lr > 0 and np.isfinite(lr)):
            raise ValueError(f"tune_lr must be a positive finite number, got {self.tune_lr!r}")
        if self.tune_epochs and self.feeds is None and self.tune_feeds is None:
            raise ValueError("tune_epochs needs calibration inputs: pass feeds= or tune_feeds= (an .npz or batches)")
        if self.tune_feeds is not None and not self.tune_epochs:
            raise ValueError("tune_feeds is only read by scale tuning: pass tune_epochs >= 1 with it")
        if self.bits_budget is not None:
            if self.bits != AUTO:
                raise ValueError(f"bits_budget needs bits='auto' (got bits={self.bits!r})")
            if not (isinstance(self.bits_budget, (int, float)) and 2.0 < self.bits_budget <= 32.0):
                raise ValueError(f"bits_budget must be bits per weight in (2, 32], got {self.bits_budget!r}")

    @property
    def node_compute(self) -> str:
        """The ``compute`` an exported node gets (``"auto"``: the op's default)."""
        return DEFAULT_COMPUTE if self.compute == "auto" else self.compute

    @property
    def whole_model(self) -> bool:
        """Whether the export needs every weight in memory (onnxsim does; AWQ, scale tuning: in place).

        Other exports with feeds (``bits="auto"`` too) read each weight from the input file once, into
        the probe (exporter.probe).
        """
        awq = self.method in ("awq", "awq+gptq", "auto")
        return self.simplify or (self.feeds is not None and awq) or self.tune_epochs > 0

    def with_(self, **changes: Any) -> ExportOptions:
        """A copy with ``changes`` (field names); TypeError names an unknown one."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"unknown export option(s) {', '.join(unknown)}; ExportOptions has {names()}")
        return replace(self, **changes) if changes else self


def names() -> str:
    """The option names, comma-separated (for messages)."""
    return ", ".join(f.name for f in fields(ExportOptions))
